"""The multi-generation kernel report: every Triton kernel of fastdiag compiled (no GPU needed) for
sm_80 / 86 / 89 / 90 / 100 / 120 at model shapes, each variant a launch can take and each dtype,
with the tiles a launch on that target would choose (its own shared-memory limit).

    python benchmarks/kernel_matrix.py [--archs 80,86,89,90,100,120] [--quick] [--variants V,..] [--dtypes D,..]
                                       [--no-head-stats] [--json OUT.json]

Prints the table (markdown) and a summary line: rows with spills and rows over the target's shared
memory. Run it under another triton with benchmarks/triton_versions.sh's venv."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from fastdiag import kernel_report as report
from fastdiag.kernel_report import cases

# (N, B, H, T): Llama-7B / Llama-3-8B have 32 query heads, Llama-2-13B 40 (the padded head axis of 64
# takes eight warps)
HEAD_STATS_SHAPES = {"gpt2-small": (1, 8, 12, 1024), "long-context": (1, 1, 16, 4096),
                     "llama-7b": (1, 1, 32, 4096), "llama-13b": (1, 1, 40, 4096)}


QUICK_VARIANTS = ("causal", "causal+rows", "additive-mask")
QUICK_DTYPES = (torch.bfloat16, torch.float32)


def rows_for(arch: int, quick: bool, progress, qk_shapes: dict, variants: tuple, dtypes: tuple,
             head_stats: bool = True) -> list[report.KernelReport]:
    gpu = report.GPUS[arch]
    rows = []
    for case in cases.head_stats_cases(HEAD_STATS_SHAPES, quick=quick) if head_stats else []:
        progress(f"sm_{arch} {case.kernel} {case.shape} {case.dtype}")
        rows.append(report.report_case(case, gpu))
    return rows + cases.qk_report(qk_shapes, (arch,), variants, dtypes, progress)


def markdown(rows: list[report.KernelReport]) -> list[str]:
    """One line a row; the last columns are the kernel report's PREDICTION (`fastdiag.kernel_report.predict`):
    the speed each bound allows as a % of a device copy of the same tensor, the smallest, and which."""
    lines = ["| arch | kernel | shape, variant | dtype | regs | spill B | smem / limit KB | instr/elem | "
             "wavefr/elem | conflicts | issue | smem | dram | latency | predicted | bound |", "|" + "---|" * 16]
    for r in rows:
        over = " **over**" if r.shared_bytes > r.shared_limit else ""
        spill = f"**{r.spill_bytes}**" if r.spill_bytes else "0"
        lines.append(f"| sm_{r.arch} | {r.kernel} | {r.shape} | {r.dtype} | {r.registers} | {spill} | "
                     f"{r.shared_bytes / 1024:.0f} / {r.shared_limit // 1024}{over} | "
                     + " | ".join(r.prediction_cells()) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(str(a) for a in report.GPUS))
    ap.add_argument("--quick", action="store_true", help="bf16 and fp32, the heaviest variants only")
    ap.add_argument("--qk-shapes", default=",".join(cases.REPORT_SHAPES),
                    help="Q/K model shapes: " + ", ".join(cases.REPORT_SHAPES))
    ap.add_argument("--variants", default=None,
                    help="Q/K variants (comma list of " + ", ".join(cases.REPORT_VARIANTS) + ")")
    ap.add_argument("--dtypes", default=None, help="Q/K dtypes (comma list: bfloat16, float16, float32)")
    ap.add_argument("--no-head-stats", action="store_true", help="the Q/K kernels only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = (tuple(args.variants.split(",")) if args.variants
                else QUICK_VARIANTS if args.quick else tuple(cases.REPORT_VARIANTS))
    if not set(variants) <= set(cases.REPORT_VARIANTS):
        sys.exit(f"--variants: a comma list of {', '.join(cases.REPORT_VARIANTS)}, got {args.variants!r}")
    try:
        dtypes = (tuple(getattr(torch, d) for d in args.dtypes.split(",")) if args.dtypes
                  else QUICK_DTYPES if args.quick else cases.REPORT_DTYPES)
    except AttributeError:
        sys.exit(f"--dtypes: a comma list of bfloat16, float16, float32, got {args.dtypes!r}")
    shapes = {name: cases.REPORT_SHAPES[name] for name in args.qk_shapes.split(",")}
    try:
        archs = [int(a) for a in args.archs.split(",")]
        if any(a not in report.GPUS for a in archs):
            raise ValueError
    except ValueError:
        sys.exit(f"--archs: a comma list of {', '.join(map(str, report.GPUS))}, got {args.archs!r}")
    start = time.time()
    rows = []
    for arch in archs:
        rows += rows_for(arch, args.quick, lambda s: print(s, file=sys.stderr, flush=True), shapes, variants, dtypes,
                         head_stats=not args.no_head_stats)
    print(f"triton {triton.__version__}, torch {torch.__version__}, {len(rows)} rows, "
          f"{time.time() - start:.0f} s to compile")
    print("\n".join(markdown(rows)))
    spills = [r for r in rows if r.spill_bytes]
    over = [r for r in rows if r.shared_bytes > r.shared_limit]
    print(f"rows with spills: {len(spills)}; rows over the target's shared memory: {len(over)}")
    print("predicted % of copy, lowest per kernel: " + ", ".join(
        f"{k} {100 * min(r.ceiling_fraction_of_copy for r in rows if r.kernel == k):.0f}%"
        for k in sorted({r.kernel for r in rows})))
    torch_path = cases.torch_path_cases(shapes, tuple(archs), dtypes)
    print(f"Q/K passes on the chunked torch path (no Triton tile fits the target): {'; '.join(torch_path) or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "rows": [r.row() for r in rows]}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
