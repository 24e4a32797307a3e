"""What a launcher needs to know about the GPU it launches on: the limits that size its tiles and a
probe of whether a compiled kernel spills. Nothing here profiles or compiles for another target:
`fastdiag.kernel_report` does that, and stands in for `device_limits` and `spill_bytes` (module
attributes of the launchers it captures) while it compiles a launch for a target without a GPU.

``GPUS``: one GPU per NVIDIA generation a launch may compile for — SM count, sustained clock and the
bandwidth of a device-to-device copy (bytes read + bytes written per second): the H200's is measured
(benchmarks/RESULTS.md, run 4: 2 × 201 MB in 0.106 ms … 2 × 1.07 GB in 0.529 ms, 3.80–4.06 TB/s; 4.0
taken), the others 0.85 × the memory's peak from the spec sheets (the H200 measured 0.83 of its
4.8 TB/s) — estimates, marked ``copy_measured: False``; and the bandwidth of a read-only stream
(``read_bandwidth``): the H200's measured beside each copy (torch reading the same tensor, run 4:
2.68–4.13 TB/s, median 3.5), the others 0.875 × their copy's, the H200's ratio. Shared memory is the opt-in limit per block;
255 registers per thread and 64 K per SM on all of them.
"""
from __future__ import annotations

import os

GPUS = {
    80: {"name": "A100-SXM4-80GB", "arch": 80, "sms": 108, "copy_bandwidth": 0.85 * 2.04e12, "clock_hz": 1.41e9,
         "shared_bytes": 163 * 1024, "copy_measured": False},
    86: {"name": "A10", "arch": 86, "sms": 72, "copy_bandwidth": 0.85 * 600e9, "clock_hz": 1.695e9,
         "shared_bytes": 99 * 1024, "copy_measured": False},
    89: {"name": "RTX 4090", "arch": 89, "sms": 128, "copy_bandwidth": 0.85 * 1008e9, "clock_hz": 2.52e9,
         "shared_bytes": 99 * 1024, "copy_measured": False},
    90: {"name": "H200", "arch": 90, "sms": 132, "copy_bandwidth": 4.0e12, "clock_hz": 1.755e9,
         "shared_bytes": 227 * 1024, "copy_measured": True, "read_bandwidth": 3.5e12},
    100: {"name": "B200", "arch": 100, "sms": 148, "copy_bandwidth": 0.85 * 8.0e12, "clock_hz": 1.965e9,
          "shared_bytes": 227 * 1024, "copy_measured": False},
    120: {"name": "RTX 5090", "arch": 120, "sms": 170, "copy_bandwidth": 0.85 * 1.792e12, "clock_hz": 2.407e9,
          "shared_bytes": 99 * 1024, "copy_measured": False},
}
for _gpu in GPUS.values():
    _gpu.setdefault("read_bandwidth", 0.875 * _gpu["copy_bandwidth"])
    # resident blocks per SM (CUDA C programming guide, technical specifications)
    _gpu.setdefault("blocks_per_sm", {86: 16, 89: 24}.get(_gpu["arch"], 32))
    # an SM issues 4 warp-instructions and serves one 128-byte shared-memory wavefront per clock
    _gpu.update(warp_instructions_per_clock=4, registers_per_thread=255, registers_per_sm=65536,
                shared_bytes_per_clock=128)
DEFAULT_ARCH = 90          # the GPU lent to this project (an H200)


def device_limits(device) -> dict | None:
    """``{"shared_bytes": opt-in shared memory per block, "sms": SM count, "arch": compute capability
    as 90 for sm_90}`` of a CUDA ``device`` (``torch.cuda.get_device_properties``); None elsewhere
    (CPU, the interpreter: no limit applies)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
    return {"shared_bytes": int(shared), "sms": props.multi_processor_count, "arch": 10 * props.major + props.minor}


def spill_bytes(kernel, grid, args: tuple, kwargs: dict) -> int | None:
    """Bytes per thread that ``kernel[grid](*args, **kwargs)`` spills as compiled for the running CUDA
    device; None where nothing compiles for a GPU (CPU tensors, the interpreter). Compiles (cached by
    Triton), never runs."""
    if not all(getattr(a, "is_cuda", True) for a in args) or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    from triton.runtime.errors import OutOfResources

    try:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        compiled._init_handles()      # the driver reads the local-memory size when it loads the binary
        return compiled.n_spills
    except OutOfResources:
        raise                         # the launcher's cue for smaller tiles
    except Exception:                 # noqa: BLE001 — a probe that fails says nothing; the launch itself will
        return None
