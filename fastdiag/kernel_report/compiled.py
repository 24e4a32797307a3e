"""The report's compile-and-read machinery: a launch captured, compiled for a target and read
(registers, spills, shared memory, hot-loop instructions, wavefronts) into a `KernelReport`; see the
package's doc."""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable


from fastdiag.core.kernels.device import DEFAULT_ARCH, GPUS

from .predict import EFFICIENCY, LATENCY_S, predict, resident_warps
from .wavefronts import loop_wavefronts

GPU = GPUS[DEFAULT_ARCH]          # the default target (the GPU lent to this project)
# The launcher modules a capture patches (their device probes, interpreter flags)
KERNEL_MODULES = ("fastdiag.core.kernels.head_stats_triton", "fastdiag.core.kernels.qk_stats_triton",
                  "fastdiag.core.kernels.qk_heads_triton", "fastdiag.core.kernels.qk_probs_triton")

@dataclass(frozen=True)
class ReportCase:
    """One launch to compile: ``launch()`` calls the kernel's real launcher on CPU tensors.
    ``elements_per_iteration(constexprs)``: elements one program loads per hot-loop iteration."""
    kernel: str
    shape: str
    dtype: str
    element_bytes: int
    launch: Callable[[], object]
    elements_per_iteration: Callable[[dict], int]
    # Optional: (elements, hot-loop iterations) of one iteration of the loop around the hot loop (a
    # persistent kernel's tile), so that the work done once per tile is counted too.
    tile: Callable[[dict], tuple[int, int]] | None = None
    # Which of the launcher's kernel launches to compile, in launch order (0: the one that streams the
    # input first; Q/K pass 2's off-diagonal head-block programs are its second launch).
    launch_index: int = 0
    # The whole launch: elements (loaded P elements, or scores) and the bytes it reads from memory,
    # for the predicted time (0: per element only)
    elements: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0       # bytes written to memory (materialised P), in the predicted time only


def tool(name: str, arch: int = 90) -> str | None:
    """Path of a CUDA tool shipped with triton (or on PATH), None when absent. ``ptxas`` is the one
    Triton itself compiles ``sm_<arch>`` with."""
    try:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    if name == "ptxas":
        path = get_ptxas(arch).path
        return path if path and os.path.exists(path) else None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(path):
        return path
    from shutil import which
    return which(name)


def tools_missing() -> list[str]:
    return [t for t in ("ptxas", "nvdisasm", "cuobjdump") if tool(t) is None]


# ---- capture what a launch would compile ------------------------------------------------------

class _TargetDriver:
    """Stands in for Triton's CUDA driver: a target to compile for, no device."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return f"report-sm{self.target.arch}"

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def _target_limits(gpu: dict):
    """`device.device_limits` as the launchers see it while the report captures a launch for ``gpu``."""
    def device_limits(_device) -> dict:
        return {"shared_bytes": gpu["shared_bytes"], "sms": gpu["sms"], "arch": gpu["arch"]}
    return device_limits


def _target_spill_probe(gpu: dict, captured: list):
    """`device.spill_bytes` while capturing: the probe's launch is compiled for ``gpu`` and read by
    ptxas (the capture hook records it; it is not one of the report's cases)."""
    def spill_bytes(kernel, grid, args: tuple, kwargs: dict) -> int:
        kernel.warmup(*args, grid=grid, **kwargs)
        fn, compile_args = captured.pop()
        compiled, _ = _compile(fn, compile_args, gpu)
        return _ptxas_usage(compiled.asm["ptx"], gpu["arch"])[1]
    return spill_bytes


@contextlib.contextmanager
def _capture_compiles(modules, gpu: dict = GPU):
    """Inside: launches of the modules' kernels compile nothing and run nothing; they are recorded."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    captured = []

    def hook(*, fn, compile, **_):
        captured.append((fn.jit_function, compile))
        return True   # "already handled": Triton neither compiles nor launches

    saved_active, saved_hook = driver._active, knobs.runtime.jit_cache_hook
    patched = []   # (module, name, old value)
    for module in modules:
        stand_ins = {"device_limits": _target_limits(gpu), "spill_bytes": _target_spill_probe(gpu, captured)}
        for name, value in stand_ins.items():
            if hasattr(module, name):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, value)
        if getattr(module, "INTERPRETING", False):
            patched.append((module, "INTERPRETING", True))
            module.INTERPRETING = False
        for name, value in vars(module).copy().items():
            fn = getattr(value, "fn", None)
            if not isinstance(value, JITFunction) and type(value).__name__ == "InterpretedFunction":
                patched.append((module, name, value))
                setattr(module, name, JITFunction(fn))     # triton.jit would interpret again
    driver.set_active(_TargetDriver(GPUTarget("cuda", gpu["arch"], 32)))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield captured
    finally:
        driver._active, knobs.runtime.jit_cache_hook = saved_active, saved_hook
        for module, name, value in patched:
            setattr(module, name, value)


def _captured_launches(case: ReportCase, gpu: dict = GPU) -> list:
    """[(JIT function, compile arguments)] of every kernel the launcher launches on ``gpu``, in order."""
    modules = {importlib.import_module(m) for m in (*KERNEL_MODULES, case.launch.__module__)}
    with _capture_compiles(sorted(modules, key=lambda m: m.__name__), gpu) as captured:
        case.launch()
    if not captured:
        raise RuntimeError(f"{case.kernel}: the launcher launched no Triton kernel")
    return captured


# ---- compile and read the cubin ---------------------------------------------------------------

@dataclass
class KernelReport:
    kernel: str
    shape: str
    dtype: str
    triton_kernel: str
    num_warps: int
    constexprs: dict
    registers: int
    spill_bytes: int
    shared_bytes: int
    loop_instructions: int
    elements_per_iteration: int
    instructions_per_element: float
    ceiling_fraction_of_copy: float
    tile_instructions_per_element: float | None = None    # with the per-tile work (cases that give `tile`)
    arch: int = 90
    gpu: str = "H200"
    shared_limit: int = GPU["shared_bytes"]
    shared_bytes_per_element: float = 0.0   # shared-memory traffic of the hot loop per element
    issue_ceiling: float = 0.0               # the bounds the ceiling is the smallest of
    shared_ceiling: float = 0.0
    # shared-memory wavefronts of the hot loop per element (global-load wavefronts included), and
    # how many times the conflict-free count they are
    wavefronts_per_element: float = 0.0
    conflict_factor: float = 1.0
    dram_ceiling: float = 0.0                # the bytes read per element at copy bandwidth
    predicted_ms: float | None = None        # the whole launch (`predict`), None where the case gives no size
    predicted_bound: str = ""
    in_flight_per_sm: float = 0.0            # bytes requested and not yet arrived, per SM (`predict`)
    latency_ceiling: float = 0.0

    def row(self) -> dict:
        return asdict(self)

    def prediction_cells(self) -> list[str]:
        """instr/elem, wavefronts/elem, conflicts, then the issue / shared / DRAM / latency bounds and
        the predicted speed as % of copy, and the bound: the columns every report table shows."""
        return [f"{(self.tile_instructions_per_element or self.instructions_per_element):.1f}",
                f"{self.wavefronts_per_element:.3f}", f"{self.conflict_factor:.1f}x",
                *(_percent(x) for x in (self.issue_ceiling, self.shared_ceiling, self.dram_ceiling,
                                        self.latency_ceiling, self.ceiling_fraction_of_copy)), self.predicted_bound]


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({out.returncode}): {out.stderr.strip()[:500]}")
    return out.stdout + out.stderr


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spilled bytes) as ptxas reports them for this PTX."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        text = _run([tool("ptxas", arch), f"-arch={sm_arch_from_capability(arch)}", "-v", src,
                     "-o", os.path.join(tmp, "k.cubin")])
    regs = max(int(m) for m in re.findall(r"Used (\d+) registers", text))
    stores = sum(int(m) for m in re.findall(r"(\d+) bytes spill stores", text))
    loads = sum(int(m) for m in re.findall(r"(\d+) bytes spill loads", text))
    return regs, max(stores, loads)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def _instructions(sass: str) -> tuple[dict, list[str]]:
    labels, instructions = {}, []          # label -> index; [text]
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instructions)
            continue
        m = _SASS_LINE.search(line)
        if m:
            instructions.append(m.group(2))
    return labels, instructions


def _loops(sass: str) -> list[tuple[int, int, int]]:
    """Loops that load from global memory, as (first, last, instructions without NOPs)."""
    labels, instructions = _instructions(sass)
    loops = []
    for i, text in enumerate(instructions):
        m = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), i + 1) <= i:
            body = instructions[labels[m.group(1)]:i + 1]
            if any(re.search(r"\bLDG\b|\bLDGSTS\b|\bUTMALDG\b", t) for t in body):
                loops.append((labels[m.group(1)], i, sum(1 for t in body if not re.search(r"\bNOP\b", t))))
    if not loops:
        raise RuntimeError("no loop loading from global memory found in the SASS")
    return loops


def hot_loop_instructions(sass: str) -> int:
    """Instructions of the innermost loop that loads from global memory (a backward branch's span)."""
    return min(count for _, _, count in _loops(sass))


def tile_loop_instructions(sass: str) -> int | None:
    """Instructions of the smallest loading loop around the hot loop (hot loop included), None if none."""
    loops = _loops(sass)
    first, last, count = min(loops, key=lambda loop: loop[2])
    around = [n for start, end, n in loops if start <= first and last <= end and n > count]
    return min(around) if around else None


# Bytes one warp-instruction moves through shared memory: lanes × width (LDS, STS, LDGSTS's write),
# matrices × 128 B (LDSM, STSM: 8 × 8 16-bit values each); narrow accesses still take a full
# 128-byte wavefront.
_WIDTH_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "32": 4, "64": 8, "128": 16}


def _shared_bytes_of(text: str) -> int:
    op = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_x]+)*)", text)
    if not op:
        return 0
    name, suffixes = op.group(1), op.group(2).split(".")[1:]
    if name in ("LDS", "STS", "LDGSTS", "ATOMS"):
        width = next((_WIDTH_BYTES[x] for x in suffixes if x in _WIDTH_BYTES), 4)
        return max(128, 32 * width)
    if name in ("LDSM", "STSM"):
        return 128 * next((int(x) for x in suffixes if x in ("2", "4")), 1)    # LDSM.16.M88.4: 4 matrices
    if name in ("HGMMA", "WGMMA"):
        # a warpgroup MMA reads its shared operands through descriptors: B (N × K), and A (64 × K) when
        # it is not in registers; each of the group's 4 warps issues the instruction, so a quarter each
        shape = next((x for x in suffixes if re.fullmatch(r"\d+x\d+x\d+", x)), None)
        if shape is None:
            return 0
        m, n, k = (int(v) for v in shape.split("x"))
        element = 4 if "TF32" in suffixes else 1 if any(x.startswith("E4M3") or x.startswith("E5M2")
                                                        for x in suffixes) else 2
        a_in_registers = re.search(r",\s*R\d+\s*,\s*gdesc", text) is not None   # "D, A, gdesc[B], C"
        shared = n * k * element + (0 if a_in_registers else m * k * element)
        return shared // 4
    return 0


def hot_loop_shared_bytes(sass: str) -> int:
    """Bytes through shared memory per warp per iteration of the hot loop (see `_shared_bytes_of`)."""
    labels, instructions = _instructions(sass)
    first, last, _ = min(_loops(sass), key=lambda loop: loop[2])
    return sum(_shared_bytes_of(t) for t in instructions[first:last + 1])


def _copy_seconds_per_element(element_bytes: float, gpu: dict) -> float:
    """A device copy of one element: its bytes read and written at the copy bandwidth."""
    return 2 * element_bytes / gpu["copy_bandwidth"]


def shared_ceiling(wavefronts_per_element: float, element_bytes: float, gpu: dict = GPU) -> float:
    """Fraction of the measured copy's speed shared memory allows: one wavefront per SM per clock,
    derated by `predict.EFFICIENCY`."""
    if wavefronts_per_element <= 0:
        return float("inf")
    per_element = wavefronts_per_element / (gpu["sms"] * gpu["clock_hz"] * EFFICIENCY)
    return _copy_seconds_per_element(element_bytes, gpu) / per_element


def issue_ceiling(instructions_per_element: float, element_bytes: float, gpu: dict = GPU) -> float:
    """Fraction of the measured copy's speed the SMs can issue for: 4 warp-instructions per SM per
    clock (``instructions_per_element`` counts lanes: / 32), derated by `predict.EFFICIENCY`."""
    rate = gpu["sms"] * gpu["warp_instructions_per_clock"] * 32 * gpu["clock_hz"] * EFFICIENCY
    return _copy_seconds_per_element(element_bytes, gpu) / (instructions_per_element / rate)


def dram_ceiling(read_bytes_per_element: float, element_bytes: float, gpu: dict = GPU) -> float:
    """Fraction of the copy's speed the memory allows a kernel that reads ``read_bytes_per_element``
    at the target's read-only bandwidth (P read once: half a copy's bytes)."""
    if read_bytes_per_element <= 0:
        return float("inf")
    return _copy_seconds_per_element(element_bytes, gpu) / (read_bytes_per_element / gpu["read_bandwidth"])


def latency_ceiling(read_bytes_per_element: float, in_flight_per_sm: float, element_bytes: float,
                    gpu: dict = GPU) -> float:
    """Fraction of the copy's speed that ``in_flight_per_sm`` bytes per SM sustain at one memory
    latency (`predict.LATENCY_S`) each."""
    if read_bytes_per_element <= 0 or in_flight_per_sm <= 0:
        return float("inf")
    per_element = read_bytes_per_element * LATENCY_S / (gpu["sms"] * in_flight_per_sm)
    return _copy_seconds_per_element(element_bytes, gpu) / per_element


def _compile(fn, args: dict, gpu: dict):
    import triton
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn, args["signature"], args["constants"], args["configs"][0])
    options = {k: args[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion")}
    # the hook's arguments leave out the register cap; the serialised options carry it
    launched = json.loads(args.get("specialization_data") or "{}").get("options", {})
    if launched.get("maxnreg"):
        options["maxnreg"] = launched["maxnreg"]
    return triton.compile(src, target=GPUTarget("cuda", gpu["arch"], 32), options=options), options


def compiled_launch(launch: Callable[[], object], gpu: dict = GPU) -> dict:
    """``{"ttir", "ptx"}`` of the first kernel ``launch()`` (a launcher called on CPU tensors) would
    compile on ``gpu``: what a check of the emitted code reads where no run can show a bug."""
    fn, args = _captured_launches(ReportCase("", "", "", 0, launch, lambda _: 1), gpu)[0]
    compiled, _ = _compile(fn, args, gpu)
    return {"ttir": compiled.asm["ttir"], "ptx": compiled.asm["ptx"]}


def report_case(case: ReportCase, gpu: dict = GPU) -> KernelReport:
    """``case`` launched as on ``gpu`` (its limits choose the tiles), compiled for its architecture."""
    launches = _captured_launches(case, gpu)
    if case.launch_index >= len(launches):
        raise RuntimeError(f"{case.kernel} {case.shape}: launch {case.launch_index} asked for, the launcher made "
                           f"{len(launches)}")
    fn, args = launches[case.launch_index]
    compiled, options = _compile(fn, args, gpu)
    registers, spills = _ptxas_usage(compiled.asm["ptx"], gpu["arch"])
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = _run([tool("nvdisasm"), "-c", cubin])
        usage = _run([tool("cuobjdump"), "-res-usage", cubin])
    static_shared = int(re.search(r"SHARED:(\d+)", usage).group(1))
    shared = max(static_shared, compiled.metadata.shared)
    loop = hot_loop_instructions(sass)
    constexprs = {(k if isinstance(k, str) else fn.arg_names[k[0]]): v for k, v in args["constants"].items()}
    elements = case.elements_per_iteration(constexprs)
    lanes = 32 * options["num_warps"]
    per_element = loop * lanes / elements
    shared_per_element = hot_loop_shared_bytes(sass) * options["num_warps"] / elements
    per_element_with_tile = None
    around = tile_loop_instructions(sass)
    if case.tile is not None and around is not None:
        tile_elements, iterations = case.tile(constexprs)
        per_element_with_tile = (iterations * loop + around - loop) * lanes / tile_elements
    waves = loop_wavefronts(compiled.asm["ptx"])
    wavefronts = waves.total * options["num_warps"] / elements
    conflicts = waves.shared / waves.shared_ideal if waves.shared_ideal else 1.0
    read_per_element = case.read_bytes / case.elements if case.elements else float(case.element_bytes)
    issue = issue_ceiling(per_element_with_tile or per_element, case.element_bytes, gpu)
    served = shared_ceiling(wavefronts, case.element_bytes, gpu)
    dram = dram_ceiling(read_per_element, case.element_bytes, gpu)
    warps = resident_warps(registers, options["num_warps"], shared, gpu, gpu["blocks_per_sm"])
    in_flight = warps * waves.global_bytes * max(1, options["num_stages"] - 1)
    latency = latency_ceiling(read_per_element, in_flight, case.element_bytes, gpu)
    ceiling, bound = min((dram, "dram"), (served, "shared"), (issue, "issue"), (latency, "latency"))
    predicted_ms = None
    if case.elements:
        predicted_ms = 1e3 * predict(gpu, case.elements, wavefronts, (per_element_with_tile or per_element) / 32,
                                     case.read_bytes, in_flight_per_sm=in_flight, write_bytes=case.write_bytes).seconds
    return KernelReport(case.kernel, case.shape, case.dtype, fn.fn.__name__, options["num_warps"],
                        {k: v for k, v in constexprs.items() if k.isupper()},
                        registers, spills, shared, loop, elements, per_element, ceiling,
                        per_element_with_tile, gpu["arch"], gpu["name"], gpu["shared_bytes"], shared_per_element,
                        issue, served, wavefronts, conflicts, dram, predicted_ms, bound, in_flight, latency)


def _percent(x: float) -> str:
    return "-" if x == float("inf") else f"{100 * x:.0f}%"


def format_report(rows: list[KernelReport]) -> str:
    head = (f"{'arch':<6} {'kernel':<11} {'shape':<22} {'dtype':<9} {'warps':>5} {'regs':>5} {'spill B':>7} "
            f"{'smem/limit KB':>13} {'instr/elem':>10} {'wavefr/elem':>11} {'conflicts':>9} "
            f"{'issue':>6} {'smem':>6} {'dram':>6} {'latency':>7} {'predicted':>9} {'bound':>7} {'pred. ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        over = " OVER" if r.shared_bytes > r.shared_limit else ""
        ms = f"{r.predicted_ms:.3f}" if r.predicted_ms else "-"
        cells = r.prediction_cells()
        widths = (10, 11, 9, 6, 6, 6, 7, 9, 7)
        lines.append(f"sm_{r.arch:<3} {r.kernel:<11} {r.shape:<22} {r.dtype:<9} {r.num_warps:>5} {r.registers:>5} "
                     f"{r.spill_bytes:>7} {f'{r.shared_bytes / 1024:.0f}/{r.shared_limit // 1024}{over}':>13} "
                     + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + f" {ms:>8}")
    for arch in sorted({r.arch for r in rows}):
        g = GPUS[arch]
        copy = "measured" if g["copy_measured"] else "estimated, 0.85 x peak"
        lines.append(f"sm_{arch}: {g['name']}, {g['sms']} SMs, {g['clock_hz'] / 1e9:.3f} GHz, device copy "
                     f"{g['copy_bandwidth'] / 1e12:.2f} TB/s read + write ({copy}), shared memory "
                     f"{g['shared_bytes'] // 1024} KB per block")
    lines.append(
        "PREDICTED, not measured. instr/elem = hot-loop SASS x 32 lanes x warps / elements loaded per iteration "
        "(with the once-per-tile work where known); wavefr/elem = shared-memory wavefronts of the hot loop "
        "per element, lane addresses of the compiled PTX evaluated (bank conflicts counted; conflicts = x the "
        "conflict-free count); issue / smem / dram = the speed each allows as a fraction of a device copy of "
        "the same tensor (read + write, RESULTS.md's measured column): 4 warp-instr and 1 wavefront per SM per "
        f"clock derated by {EFFICIENCY:.3f} (ncu, the measured H200 launch), the bytes read at the read-only "
        f"bandwidth, the bytes in flight per SM (occupancy x per-warp loads x stages ahead) per {LATENCY_S * 1e6:.1f} us "
        "of memory latency (assumed, not calibrated); predicted = the smallest; bound = which.")
    return "\n".join(lines)


def _report_in_subprocess(shapes: dict, archs: tuple[int, ...] = (90,)) -> list[KernelReport]:
    """Under TRITON_INTERPRET=1 even triton.language's own helpers are interpreted and cannot be
    compiled: the report runs in a fresh interpreter without it."""
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "fastdiag.kernel_report", json.dumps(shapes), json.dumps(list(archs))],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"kernel report subprocess failed: {out.stderr.strip().splitlines()[-1:]}")
    return [KernelReport(**row) for row in json.loads(out.stdout)]
