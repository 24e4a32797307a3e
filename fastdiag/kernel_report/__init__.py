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

The launches reported live in `cases` (the kernels never import the report); while a launch is
captured, the launcher modules' `device_limits` and `spill_bytes` (`fastdiag.core.kernels.device`)
are replaced by the target's limits and a ptxas probe.
"""
from __future__ import annotations

import os
from typing import Callable

from .compiled import (DEFAULT_ARCH, EFFICIENCY, GPU, GPUS, KERNEL_MODULES, KernelReport, LATENCY_S,
                       ReportCase, _capture_compiles, _captured_launches, _compile, _ptxas_usage,
                       _report_in_subprocess, compiled_launch, dram_ceiling, format_report,
                       hot_loop_instructions, hot_loop_shared_bytes, issue_ceiling, latency_ceiling,
                       loop_wavefronts, predict, report_case, resident_warps, shared_ceiling,
                       tile_loop_instructions, tool, tools_missing)


def registered_cases(shapes: dict) -> list[ReportCase]:
    """Every kernel's launches at the benchmark shapes ``{name: (N, B, H, T)}`` of `fastdiag.bench`
    (`cases.BENCH_CASES`; a kernel may use its own shapes instead)."""
    from .cases import BENCH_CASES   # the launchers: Triton at their top

    return [case for cases in BENCH_CASES for case in cases(shapes)]


def kernel_report(shapes: dict, progress: Callable[[str], None] = lambda _: None,
                  archs: tuple[int, ...] = (90,)) -> list[KernelReport]:
    """Every registered kernel at ``shapes``, compiled for each of ``archs`` (keys of `GPUS`)."""
    unknown = [a for a in archs if a not in GPUS]
    if unknown or not archs:
        raise ValueError(f"archs: must be some of {sorted(GPUS)}, got {list(archs)}")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return _report_in_subprocess(shapes, archs)
    missing = tools_missing()
    if missing:
        raise RuntimeError(f"kernel report: CUDA tools not found: {', '.join(missing)} "
                           "(they ship with the triton wheel under triton/backends/nvidia/bin)")
    rows = []
    for arch in archs:
        for case in registered_cases(shapes):
            progress(f"compiling {case.kernel} {case.shape} {case.dtype} for sm_{arch} ...")
            rows.append(report_case(case, GPUS[arch]))
    return rows


