"""What fastdiag's Triton kernels cost on a GPU, measured without one.

Triton compiles for a GPU target on any machine, and the CUDA tools that ship with the triton wheel
(``ptxas``, ``nvdisasm``, ``cuobjdump``) read the result. For every registered kernel and benchmark
shape this module calls the kernel's *real launcher* on CPU tensors of that shape with Triton's
driver pointed at an sm_90 target and its compile hook catching the launch: the launch is never run,
but the signature, specialisation and constexprs are exactly those a GPU launch would compile. The
kernel is then compiled for sm_90 and reported:

- registers per thread, spilled bytes, shared memory (static + Triton's dynamic), from ptxas / the cubin;
- SASS instructions in the hot loop (the innermost loop that loads from global memory), per loaded
  element: ``loop instructions × 32 lanes × num_warps / elements loaded per iteration``;
- for a persistent kernel whose case gives ``tile``, the same per element with the work done once
  per tile counted too (the loop around the hot loop: ``(hot loop × its iterations per tile + the
  rest of the tile loop) × 32 × num_warps / elements of a tile``);
- the issue-bound ceiling as a fraction of copy bandwidth. An SM issues at most 4 warp-instructions
  per clock, so at clock f the SMs can stream at most
  ``SMs × 4 × 32 × f / (instructions per element)`` elements/s; copy bandwidth streams
  ``BW / bytes per element``. ceiling = min(1, the first / the second).

A kernel module registers itself with `register` (see the end of ``head_stats_triton.py``) and adds
its module name to `KERNEL_MODULES`.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable


# H200 SXM: copy bandwidth (device to device, read + write counted once each), SMs, sustained clock.
GPU = {"name": "H200", "arch": 90, "sms": 132, "copy_bandwidth": 4.3e12, "clock_hz": 1.755e9,
       "warp_instructions_per_clock": 4, "registers_per_thread": 255, "shared_bytes": 227 * 1024}

KERNEL_MODULES = ("fastdiag.kernels.head_stats_triton", "fastdiag.kernels.qk_stats_triton")


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


_REGISTRY: dict[str, Callable[[dict], list[ReportCase]]] = {}


def register(name: str, cases: Callable[[dict], list[ReportCase]]) -> None:
    """Add a kernel to the report. ``cases(shapes)`` returns its launches; ``shapes`` are the benchmark
    shapes ``{name: (N, B, H, T)}`` of `fastdiag.bench` (a kernel may use its own instead)."""
    _REGISTRY[name] = cases


def registered_cases(shapes: dict) -> list[ReportCase]:
    for module in KERNEL_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return [case for cases in _REGISTRY.values() for case in cases(shapes)]


def tool(name: str) -> str | None:
    """Path of a CUDA tool shipped with triton (or on PATH), None when absent. ``ptxas`` is the one
    Triton itself compiles sm_90 with."""
    try:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    if name == "ptxas":
        path = get_ptxas(GPU["arch"]).path
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


@contextlib.contextmanager
def _capture_compiles(modules):
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
        if getattr(module, "INTERPRETING", False):
            patched.append((module, "INTERPRETING", True))
            module.INTERPRETING = False
        for name, value in vars(module).copy().items():
            fn = getattr(value, "fn", None)
            if not isinstance(value, JITFunction) and type(value).__name__ == "InterpretedFunction":
                patched.append((module, name, value))
                setattr(module, name, JITFunction(fn))     # triton.jit would interpret again
    driver.set_active(_TargetDriver(GPUTarget("cuda", GPU["arch"], 32)))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield captured
    finally:
        driver._active, knobs.runtime.jit_cache_hook = saved_active, saved_hook
        for module, name, value in patched:
            setattr(module, name, value)


def _captured_launches(case: ReportCase) -> list:
    """[(JIT function, compile arguments)] of every kernel the launcher launches, in order."""
    module = importlib.import_module(case.launch.__module__)
    with _capture_compiles([module]) as captured:
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

    def row(self) -> dict:
        return asdict(self)


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({out.returncode}): {out.stderr.strip()[:500]}")
    return out.stdout + out.stderr


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spilled bytes) as ptxas reports them for this PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        text = _run([tool("ptxas"), f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(tmp, "k.cubin")])
    regs = max(int(m) for m in re.findall(r"Used (\d+) registers", text))
    stores = sum(int(m) for m in re.findall(r"(\d+) bytes spill stores", text))
    loads = sum(int(m) for m in re.findall(r"(\d+) bytes spill loads", text))
    return regs, max(stores, loads)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def _loops(sass: str) -> list[tuple[int, int, int]]:
    """Loops that load from global memory, as (first, last, instructions without NOPs)."""
    labels, instructions = {}, []          # label -> index; [text]
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instructions)
            continue
        m = _SASS_LINE.search(line)
        if m:
            instructions.append(m.group(2))
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


def issue_ceiling(instructions_per_element: float, element_bytes: int, gpu: dict = GPU) -> float:
    """Fraction of copy bandwidth the SMs can issue for: min(1, issue rate / needed rate)."""
    issue = gpu["sms"] * gpu["warp_instructions_per_clock"] * 32 * gpu["clock_hz"] / instructions_per_element
    needed = gpu["copy_bandwidth"] / element_bytes
    return min(1.0, issue / needed)


def report_case(case: ReportCase) -> KernelReport:
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", GPU["arch"], 32)
    fn, args = _captured_launches(case)[0]       # the first launch is the kernel that streams the input
    src = triton.compiler.ASTSource(fn, args["signature"], args["constants"], args["configs"][0])
    options = {k: args[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion")}
    compiled = triton.compile(src, target=target, options=options)
    registers, spills = _ptxas_usage(compiled.asm["ptx"], GPU["arch"])
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
    per_element_with_tile = None
    around = tile_loop_instructions(sass)
    if case.tile is not None and around is not None:
        tile_elements, iterations = case.tile(constexprs)
        per_element_with_tile = (iterations * loop + around - loop) * lanes / tile_elements
    return KernelReport(case.kernel, case.shape, case.dtype, fn.fn.__name__, options["num_warps"],
                        {k: v for k, v in constexprs.items() if k.isupper()},
                        registers, spills, shared, loop, elements, per_element,
                        issue_ceiling(per_element, case.element_bytes), per_element_with_tile)


def kernel_report(shapes: dict, progress: Callable[[str], None] = lambda _: None) -> list[KernelReport]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return _report_in_subprocess(shapes)
    missing = tools_missing()
    if missing:
        raise RuntimeError(f"kernel report: CUDA tools not found: {', '.join(missing)} "
                           "(they ship with the triton wheel under triton/backends/nvidia/bin)")
    rows = []
    for case in registered_cases(shapes):
        progress(f"compiling {case.kernel} {case.shape} {case.dtype} for sm_{GPU['arch']} ...")
        rows.append(report_case(case))
    return rows


def format_report(rows: list[KernelReport]) -> str:
    g = GPU
    head = (f"{'kernel':<11} {'shape':<13} {'dtype':<9} {'warps':>5} {'regs':>5} {'spill B':>7} {'smem KB':>7} "
            f"{'loop':>5} {'elem/it':>7} {'instr/elem':>10} {'ceiling':>8} {'with tile':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.kernel:<11} {r.shape:<13} {r.dtype:<9} {r.num_warps:>5} {r.registers:>5} {r.spill_bytes:>7} "
                     f"{r.shared_bytes / 1024:>7.1f} {r.loop_instructions:>5} {r.elements_per_iteration:>7} "
                     f"{r.instructions_per_element:>10.1f} {100 * r.ceiling_fraction_of_copy:>7.0f}% "
                     + (f"{r.tile_instructions_per_element:>9.1f}" if r.tile_instructions_per_element else f"{'-':>9}"))
    lines.append(
        f"instr/elem = hot-loop SASS × 32 lanes × warps / elements loaded per iteration; ceiling = min(1, "
        f"{g['sms']} SMs × {g['warp_instructions_per_clock']} warp-instr/clk × 32 × {g['clock_hz'] / 1e9:.3f} GHz "
        f"/ instr/elem ÷ ({g['copy_bandwidth'] / 1e12:.1f} TB/s / bytes per element)) — {g['name']} sm_{g['arch']}, "
        f"issue-bound estimate, not a measurement; with tile = instr/elem counting also the work done once per "
        f"tile of a persistent kernel (the loop around the hot loop)")
    return "\n".join(lines)


def _report_in_subprocess(shapes: dict) -> list[KernelReport]:
    """Under TRITON_INTERPRET=1 even triton.language's own helpers are interpreted and cannot be
    compiled: the report runs in a fresh interpreter without it."""
    import json
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "fastdiag.kernels.report", json.dumps(shapes)],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"kernel report subprocess failed: {out.stderr.strip().splitlines()[-1:]}")
    return [KernelReport(**row) for row in json.loads(out.stdout)]


if __name__ == "__main__":
    import json
    import sys

    from fastdiag.kernels import report   # the module kernels register with, not this __main__ copy

    print(json.dumps([r.row() for r in report.kernel_report(json.loads(sys.argv[1]))]))
