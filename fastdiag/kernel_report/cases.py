"""The launches the kernel report compiles: each launcher called on CPU tensors of a benchmark or
model shape (captured, never run), for every variant and dtype a caller can reach."""
from __future__ import annotations

import dataclasses
import os

import torch
import triton

from fastdiag.core.kernels.device import DEFAULT_ARCH, GPUS
from fastdiag.core.kernels.head_stats_triton import head_stats_triton
from fastdiag.core.kernels.qk_probs_triton import PROBS_TILES, chunk_keys, probs_chunks
from fastdiag.core.kernels.qk_stats_triton import (heads_config, pass1_fits, qk_stats_triton,
                                                    row_lse_triton)

from .compiled import KernelReport, ReportCase, report_case

# ---- the kernel report (`fastdiag bench --kernel-report`): this launcher at the benchmark shapes --

# Variants a launch can take: (causal, query mask). Causal with a query mask is the heaviest loop
# (per-element key bound and row validity).
HEAD_STATS_VARIANTS = {"plain": (False, False), "causal+qmask": (True, True)}


def head_stats_cases(shapes: dict, quick: bool = True) -> list[ReportCase]:
    """This launcher at ``shapes`` ``{name: (N, B, H, T)}``: fp32, fp16, bf16 plain (``quick``), or every
    variant of `HEAD_STATS_VARIANTS` in fp32, fp16, bf16 and fp64 (the IEEE Gram dot)."""
    cases = []
    dtypes = (torch.float32, torch.float16, torch.bfloat16) + (() if quick else (torch.float64,))
    variants = ("plain",) if quick else tuple(HEAD_STATS_VARIANTS)
    for shape, (n, b, h, t) in shapes.items():
        for variant in variants:
            causal, qmask = HEAD_STATS_VARIANTS[variant]
            for dtype in dtypes:
                def launch(dims=(n, b, h, t, t), dtype=dtype, causal=causal, qmask=qmask):
                    mask = torch.empty(1, dims[1], dims[3], dtype=torch.bool) if qmask else None
                    head_stats_triton(torch.empty(dims, dtype=dtype), mask, causal)  # captured, never run

                def elements_per_iteration(constexprs, h=h):
                    return h * constexprs["BLOCK_R"] * constexprs["BLOCK_K"]

                def tile(constexprs, h=h, t=t):     # a tile: BLOCK_R rows of all keys (not causal)
                    return h * constexprs["BLOCK_R"] * t, triton.cdiv(t, constexprs["BLOCK_K"])

                label = shape if variant == "plain" else f"{shape} {variant}"
                loaded = n * b * h * (t * (t + 1) // 2 if causal else t * t)   # causal: keys past the diagonal unread
                cases.append(ReportCase("head_stats", label, str(dtype).replace("torch.", ""),
                                        dtype.itemsize, launch, elements_per_iteration, tile,
                                        elements=loaded, read_bytes=loaded * dtype.itemsize))
    return cases


def _head_stats_bench_cases(shapes: dict) -> list[ReportCase]:
    return head_stats_cases(shapes, quick=True)


# ---- the kernel report: what a GPU launch of these launchers compiles, for each target -----------

# Model shapes of `kernel_report`, (H, Hk, D, T): GPT-2-small, Llama-7B, Llama-3-8B (grouped-query) and a 4k context.
REPORT_SHAPES = {
    "gpt2-small": (12, 12, 64, 1024),
    "llama-7b": (32, 32, 128, 1024),
    "llama-3-8b": (32, 8, 128, 1024),
    "long-context": (16, 16, 128, 4096),
}
# Every variant a launch can take: (causal, query rows mask, explicit mask kind).
REPORT_VARIANTS = {
    "causal": (True, False, None),               # what the zoo and HF causal models call
    "plain": (False, False, None),
    "causal+rows": (True, True, None),           # a query mask (padding): pass 2 only reads it
    "bool-mask": (False, False, "bool"),
    "additive-mask": (False, False, "additive"),
}
REPORT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)     # float64 runs as float32 (`_dot_inputs`)
# Head dims of the models behind the benchmark shapes (`fastdiag bench --kernel-report`).
_BENCH_HEAD_DIM = {"gpt2-small": 64, "long-context": 128}


def scores_per_iteration(constexprs: dict) -> int:
    """Scores of real heads (the per-head kernel scores no padded head; its row-sum launch and the
    materialised-P write one head a program) and of the batched kernels' blocks."""
    if "BLOCK_H" not in constexprs and "BLOCK_HK" not in constexprs:      # `qk_probs_triton._qk_probs_kernel`
        return constexprs["BLOCK_M"] * constexprs["BLOCK_N"]
    if "HEADS" in constexprs:
        return min(constexprs["HEADS"], constexprs["BLOCK_H"]) * constexprs["BLOCK_M"] * constexprs["BLOCK_N"]
    return constexprs["BLOCK_HK"] * constexprs["BLOCK_G"] * constexprs["BLOCK_M"] * constexprs["BLOCK_N"]


def _cases(shape: str, b: int, h: int, hk: int, t: int, d: int, dtype: torch.dtype = torch.bfloat16,
           variant: str = "causal", shared_limit: int = GPUS[DEFAULT_ARCH]["shared_bytes"],
           arch: int = DEFAULT_ARCH) -> list[ReportCase]:
    """Pass 1 and pass 2 (diagonal head blocks) of one variant. An "element" is one score (one query
    row, key and head), so the ceiling reads: how fast these kernels cover the probabilities
    compared with the probabilities kernel streaming a materialised P at copy bandwidth. A variant
    that changes only pass 2 (query rows) reports pass 2 alone; float32 pass 2 is left out where it runs on
    `qk_stats_torch` (`torch_path_cases`). Where the launcher takes materialised P, `qk_report` reports
    its two launches (`probs_cases`)."""
    causal, rows, mask_kind = REPORT_VARIANTS[variant]
    q = torch.empty(b, h, t, d, dtype=dtype)
    k = torch.empty(b, hk, t, d, dtype=dtype)
    mask = None if mask_kind is None else torch.empty(b, 1, t, t, dtype=torch.bool if mask_kind == "bool" else dtype)
    rows_ok = torch.empty(b, t, dtype=torch.bool) if rows else None
    label = shape if variant == "causal" else f"{shape} {variant}"
    name = str(dtype).replace("torch.", "")

    def pass1():
        row_lse_triton(q, k, mask, causal, d ** -0.5)                # captured, never run

    def pass2():
        lse = torch.empty(q.shape[:3], dtype=torch.float32)          # a given LSE: pass 2 launches first
        qk_stats_triton(q, k, mask, causal, d ** -0.5, rows_ok=rows_ok, lse=lse)

    # the scores of real heads (causal: the lower triangle) and the Q and K bytes read; the prediction's
    # time leaves out padded heads' scores (benchmarks/predict_measured.py counts them)
    size = dict(elements=b * h * (t * (t + 1) // 2 if causal else t * t),
                read_bytes=(b * h * t * d + b * hk * t * d) * dtype.itemsize)
    cases = []
    if dtype != torch.float32:    # 16-bit pass 2 is Triton on every target (per-head kernel or materialised P)
        cases.append(ReportCase("qk_stats", label, name, dtype.itemsize, pass2, scores_per_iteration, **size))
    elif _float32_pass2(h, hk, d, shared_limit, arch):
        # float32: pass 1 launches first even with a given LSE (its float64 LSE is pass 2's; the given one checked)
        cases.append(ReportCase("qk_stats", label, name, dtype.itemsize, pass2, scores_per_iteration,
                                launch_index=1, **size))
    if not rows and pass1_fits(dtype, shared_limit, arch):
        cases.insert(0, ReportCase("qk_lse", label, name, dtype.itemsize, pass1, scores_per_iteration, **size))
    return cases


def probs_sizes(b: int, h: int, tq: int, tk: int, causal: bool) -> dict:
    """What pass 2 through materialised P (`qk_probs_triton`) moves, counted as its kernels do: ``scores``
    the write kernel computes (whole key tiles up to each row tile's causal bound), ``written`` P elements
    (keys inside each chunk's buffer), ``gram`` P elements the Gram launches read (causal: up to each row's
    diagonal), and ``chunks``."""
    m, n = PROBS_TILES["BLOCK_M"], PROBS_TILES["BLOCK_N"]
    scores = written = gram = 0
    chunks = probs_chunks(b, h, tq, tk, causal, m)
    for _b0, batches, r0, rows in chunks:
        keys = chunk_keys(tk, causal, r0, rows)
        for first in range(r0, r0 + rows, m):
            key_end = min(tk, first + m) if causal else tk
            loop_keys = triton.cdiv(key_end, n) * n
            scores += batches * h * m * loop_keys
            written += batches * h * min(m, r0 + rows - first) * min(keys, loop_keys)
        seen = sum(min(tk, r + 1) for r in range(r0, r0 + rows)) if causal else rows * tk
        gram += batches * h * seen
    return dict(scores=scores, written=written, gram=gram, chunks=len(chunks))


def probs_cases(label: str, dtype: torch.dtype, launch, b: int, h: int, hk: int, tq: int, tk: int, d: int,
                causal: bool) -> list[ReportCase]:
    """The two launches of pass 2 through materialised P that ``launch`` makes first (a chunk's write
    and its Gram; every chunk compiles the same two), sized for the whole layer: the write kernel per
    score (Q and K read, P written at the copy's rate), the Gram per P element read."""
    sizes = probs_sizes(b, h, tq, tk, causal)
    name = str(dtype).replace("torch.", "")
    qk_bytes = (b * h * tq * d + b * hk * tk * d) * dtype.itemsize
    return [ReportCase("qk_probs", label, name, dtype.itemsize, launch, scores_per_iteration,
                       elements=sizes["scores"], read_bytes=qk_bytes, write_bytes=2 * sizes["written"]),
            ReportCase("qk_probs gram", label, "float16", 2, launch, lambda c, h=h: h * c["BLOCK_R"] * c["BLOCK_K"],
                       launch_index=1, elements=sizes["gram"], read_bytes=2 * sizes["gram"])]


def _float32_pass2(h: int, hk: int, d: int, shared_limit: int, arch: int) -> bool:
    """Whether float32 pass 2 runs in Triton there: the per-head kernel's float32 plan (`heads_config`), where
    pass 1 runs too (`pass1_fits`: float64 dots compile to MMA); elsewhere the torch path."""
    return pass1_fits(torch.float32, shared_limit, arch) and heads_config(h, hk, d, 4) is not None


def torch_path_cases(shapes: dict = REPORT_SHAPES, archs: tuple[int, ...] = (90,),
                     dtypes=REPORT_DTYPES) -> list[str]:
    """``"sm_86 llama-7b bfloat16 pass 2"`` for each target, shape, dtype and pass that no Triton tile
    fits: it runs on `qk_stats_torch` there (exact, slower), so the report has no row for it."""
    out = []
    for arch in archs:
        limit = GPUS[arch]["shared_bytes"]
        for shape, (h, hk, d, _t) in shapes.items():
            for dtype in dtypes:
                name = f"sm_{arch} {shape} {str(dtype).replace('torch.', '')}"
                if not pass1_fits(dtype, limit, arch):
                    out.append(f"{name} passes 1 + 2")
                elif dtype == torch.float32 and not _float32_pass2(h, hk, d, limit, arch):
                    out.append(f"{name} pass 2")
    return out


def _qk_bench_cases(shapes: dict) -> list[ReportCase]:
    """At the benchmark shapes, bf16 causal; those too short for a key loop (the grokking task's T = 3,
    whose zoo model never calls SDPA) are left out."""
    return [case for shape, (_n, b, h, t) in shapes.items() if t >= 256
            for case in _cases(shape, b, h, h, t, _BENCH_HEAD_DIM.get(shape, 64))]


def qk_report(shapes: dict = REPORT_SHAPES, archs: tuple[int, ...] = (90,), variants=("causal",),
                  dtypes=(torch.bfloat16,), progress=lambda _: None) -> list[KernelReport]:
    """Pass 1 and pass 2 at model shapes ``{name: (H, Hk, D, T)}`` (B 1), for each target of ``archs``
    (`device.GPUS`), variant and dtype, compiled without a GPU exactly as a launch on that target would
    compile them (its shared memory chooses the tiles, specialisation included): registers, spill
    bytes, shared memory, hot-loop instructions and shared-memory bytes per score."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise ValueError("qk_report: kernels cannot be compiled under TRITON_INTERPRET=1; unset it")
    unknown = [a for a in archs if a not in GPUS]
    if unknown:
        raise ValueError(f"archs: must be some of {sorted(GPUS)}, got {list(archs)}")
    rows = []
    for arch in archs:
        for shape, (h, hk, d, t) in shapes.items():
            for variant in variants:
                for dtype in dtypes:
                    for case in _cases(shape, 1, h, hk, t, d, dtype, variant, GPUS[arch]["shared_bytes"], arch):
                        progress(f"sm_{arch} {case.kernel} {case.shape} {case.dtype}")
                        rows.append(report_case(case, GPUS[arch]))
                        if rows[-1].triton_kernel == "_qk_probs_kernel":
                            # materialised P: the write and the Gram, each sized for the whole layer
                            rows[-1:] = [report_case(c, GPUS[arch]) for c in probs_cases(
                                case.shape, dtype, case.launch, 1, h, hk, t, t, d, REPORT_VARIANTS[variant][0])]
                            continue
                        if rows[-1].constexprs.get("GRAM") and not rows[-1].constexprs.get("ROW_SUMS"):
                            # the per-head kernel's two-launch plan: the row sums are its second launch
                            row_sums = dataclasses.replace(case, shape=f"{case.shape} row sums",
                                                               launch_index=case.launch_index + 1)
                            rows.append(report_case(row_sums, GPUS[arch]))
    return rows

# What `registered_cases` (``fastdiag bench --kernel-report``) reports at the benchmark shapes
BENCH_CASES = (_head_stats_bench_cases, _qk_bench_cases)
