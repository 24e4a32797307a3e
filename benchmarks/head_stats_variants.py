"""head_stats compiled (no GPU) for each target, shape, variant and dtype a launch can take: the
launcher's own tiles and warps on that target, registers, spills, shared memory and the hot loop.

    python benchmarks/head_stats_variants.py [ARCHS] [KNOB=VALUE ...]
    python benchmarks/head_stats_variants.py 80,86,89,90,100,120
    python benchmarks/head_stats_variants.py 90 _GRAM_TILES_PER_WARP=0.5 _SLAB_PER_WARP=1024   # the 4-warp launch

KNOB=VALUE sets a launcher constant of ``head_stats_triton`` for the run (a tile experiment, as
gpu_check's ``tune`` stage does on a GPU). Run it under another triton with benchmarks/triton_versions.sh's
venv (``PYTHONPATH=. VENV/bin/python benchmarks/head_stats_variants.py``). The last line counts rows
with spills.
"""
from __future__ import annotations

import sys

import torch

from fastdiag import kernel_report as report
from fastdiag.core.kernels import head_stats_triton
from fastdiag.kernel_report import cases

SHAPES = {"gpt2-small": (1, 8, 12, 1024), "long-context": (1, 1, 16, 4096),
          "llama-7b": (1, 1, 32, 4096), "llama-13b": (1, 1, 40, 4096)}
DTYPES = ("float32", "float16", "bfloat16")


def main() -> None:
    archs = [int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "90").split(",")]
    for knob in sys.argv[2:]:
        name, value = knob.split("=")
        setattr(head_stats_triton, name, float(value) if "." in value else int(value))
    spilling = over = 0
    worst: dict = {}            # (variant kind, dtype kind) -> lowest predicted % of copy
    for arch in archs:
        for case in cases.head_stats_cases(SHAPES, quick=False):
            if case.dtype not in DTYPES:
                continue
            r = report.report_case(case, report.GPUS[arch])
            c = r.constexprs
            spilling += r.spill_bytes > 0
            over += r.shared_bytes > r.shared_limit
            key = ("causal" if "causal" in r.shape else "plain", "fp32" if r.dtype == "float32" else "16-bit")
            worst[key] = min(worst.get(key, float("inf")), r.ceiling_fraction_of_copy)
            print(f"sm_{arch:<4} {r.shape:<26} {r.dtype:<9} warps {r.num_warps} R{c['BLOCK_R']} K{c['BLOCK_K']:<3} "
                  f"regs {r.registers:>3} spill {r.spill_bytes:>4} smem {r.shared_bytes / 1024:5.1f} KB "
                  f"instr/elem {(r.tile_instructions_per_element or r.instructions_per_element):5.1f} "
                  f"wavefr/elem {r.wavefronts_per_element:5.3f} conflicts {r.conflict_factor:3.1f}x "
                  f"predicted {100 * r.ceiling_fraction_of_copy:3.0f}% of copy ({r.predicted_bound})", flush=True)
    print(f"rows with spills: {spilling}; rows over the target's shared memory: {over}")
    print("lowest predicted % of copy: " + ", ".join(f"{v} {d} {100 * x:.0f}%" for (v, d), x in sorted(worst.items())))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
