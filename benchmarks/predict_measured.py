"""The kernel report's prediction beside what the H200 measured (benchmarks/RESULTS.md, run 4).

    python benchmarks/predict_measured.py [--qk] [--json] [--arch N]
    python benchmarks/predict_measured.py --qk-matrix 80,86,89,90,100,120    # Q/K pass 2, issue-38 targets

Recompiles, without a GPU, the launches that were measured — commit 0c79385's head_stats and Q/K
launchers (benchmarks/measured/, ``git show 0c79385:...``) at the measured shapes, for sm_90 — and
prints predicted against measured time (graph ms) and the ratio. The same for today's launchers
(``now``) at the same shapes: predicted only. Under TRITON_INTERPRET=1 nothing compiles: unset it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch
import triton

from fastdiag import kernel_report as report
from fastdiag.core.kernels import head_stats_triton, qk_stats_triton
from fastdiag.kernel_report.cases import probs_cases, scores_per_iteration
from fastdiag.kernel_report.compiled import _captured_launches
from fastdiag.kernel_report.predict import predict

HERE = os.path.dirname(os.path.abspath(__file__))
# (shape, dims [N, B, H, T, T], dtype, graph ms, copy ms): RESULTS.md, "Speed", the H200 rows
HEAD_STATS_MEASURED = [
    ("gpt2-small", (1, 8, 12, 1024, 1024), torch.bfloat16, 0.567, 0.106),
    ("gpt2-small", (1, 8, 12, 1024, 1024), torch.float32, 1.65, 0.203),
    ("long-context", (1, 1, 16, 4096, 4096), torch.bfloat16, 1.13, 0.265),
    ("long-context", (1, 1, 16, 4096, 4096), torch.float32, 3.17, 0.529),
]
# (shape, [B, H, T, D], pass 1 + 2 graph ms, SDPA flash ms): bf16 causal
QK_MEASURED = [
    ("gpt2-small", (8, 12, 1024, 64), 0.394, 0.124),
    ("long-context", (1, 16, 4096, 128), 1.02, 0.376),
]
# The issue-38 targets (predicted): Q/K pass 2 at the flash forward's cost, and a Llama-size 4k layer
QK_TARGETS = [("gpt2-small", (8, 12, 1024, 64), 0.124), ("llama-4k", (1, 32, 4096, 128), 0.5)]
# The H200's measured Q/K pass 1 + 2 (0c79385, GPT-2-small, graph) over the model's prediction from triton
# 3.6's compile of it, the compile that ran (RESULTS.md, 2026-12-05 06:30: 0.394 / 0.175): the latency
# inside the SM (mma -> exp -> mma chains, one block per SM) the model leaves out
QK_MISS = 0.394 / 0.175


def measured_module(name: str):
    """benchmarks/measured/<name>.py, the launcher as it was measured."""
    full = f"measured_{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, os.path.join(HERE, "measured", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules[full]


def _predict(row, elements: float, read_bytes: float, copy_bytes: float | None = None, arch: int = 90):
    instructions = (row.tile_instructions_per_element or row.instructions_per_element) / 32
    return predict(report.GPUS[arch], elements, row.wavefronts_per_element, instructions, read_bytes, copy_bytes,
                   row.in_flight_per_sm)


def head_stats_rows(module, arch: int = 90) -> list[dict]:
    """Each measured head_stats shape launched by ``module``'s launcher, compiled and predicted."""
    out = []
    for shape, dims, dtype, graph_ms, copy_ms in HEAD_STATS_MEASURED:
        n, b, h, t, _ = dims

        def launch(dims=dims, dtype=dtype):
            module.head_stats_triton(torch.empty(dims, dtype=dtype), None, False)

        case = report.ReportCase("head_stats", shape, str(dtype).replace("torch.", ""), dtype.itemsize, launch,
                                 lambda c, h=h: h * c["BLOCK_R"] * c["BLOCK_K"])
        row = report.report_case(case, report.GPUS[arch])
        elements = n * b * h * t * t
        p = _predict(row, elements, elements * dtype.itemsize, arch=arch)
        out.append(dict(kernel="head_stats", shape=shape, dtype=case.dtype, measured_ms=graph_ms,
                        predicted_ms=1e3 * p.seconds, ratio=1e3 * p.seconds / graph_ms, bound=p.bound,
                        measured_pct_of_copy=100 * copy_ms / graph_ms, predicted_pct_of_copy=100 * p.fraction_of_copy,
                        wavefronts_per_element=row.wavefronts_per_element, conflicts=row.conflict_factor,
                        registers=row.registers, spill_bytes=row.spill_bytes,
                        in_flight_kb_per_sm=row.in_flight_per_sm / 1024, latency_ms=1e3 * p.latency_s))
    return out


def probs_row(module, shape: str, dims, reference_ms: float, arch: int = 90, forced: bool = True) -> dict:
    """Pass 2 through materialised P (`qk_probs_triton`: the write kernel, then the Gram of each chunk) of
    ``module`` at ``dims`` (bf16 causal, the LSE given), predicted: the two launches' times summed over the
    layer's chunks; ``qk_miss`` (sm_90) applies the Q/K launches' measured miss to the write kernel alone
    (the Gram is head_stats' kernel, whose model reproduced its measured rows). ``forced``: the plan run
    where the launcher would choose another."""
    b, h, t, d = dims
    q = torch.empty(b, h, t, d, dtype=torch.bfloat16)
    lse = torch.empty(b, h, t)

    def launch():
        if forced:
            module._probs_stats(q, q, None, True, d ** -0.5, None, lse)
        else:
            module.qk_stats_triton(q, q, None, True, d ** -0.5, lse=lse)

    rows = [report.report_case(case, report.GPUS[arch]) for case in probs_cases(shape, torch.bfloat16, launch, b, h, h,
                                                                                   t, t, d, True)]
    write, gram = rows
    parts = [f"{r.kernel} {r.predicted_ms:.3f} ms ({r.predicted_bound}, {r.num_warps}w, "
             f"{(r.tile_instructions_per_element or r.instructions_per_element):.1f} instr/"
             f"{'score' if r is write else 'elem'}, {r.wavefronts_per_element:.3f} wavefr, {r.conflict_factor:.1f}x conflicts, "
             f"{r.registers} regs, {r.spill_bytes} B spilled, {r.shared_bytes // 1024}/{r.shared_limit // 1024} KB)"
             for r in rows]
    total = write.predicted_ms + gram.predicted_ms
    return dict(kernel="qk pass 2", plan="materialised P" + (" (forced)" if forced else ""), shape=shape,
                dims=list(dims), arch=arch, reference_ms=reference_ms, predicted_ms=total,
                ratio=total / reference_ms, write_ms=write.predicted_ms, gram_ms=gram.predicted_ms,
                with_qk_miss_ms=write.predicted_ms * QK_MISS + gram.predicted_ms, parts=parts,
                spill_bytes=max(r.spill_bytes for r in rows), shared_over=any(r.shared_bytes > r.shared_limit for r in rows))


def _qk_launches(module, dims, lse_given: bool, arch: int = 90):
    """Pass 1 (unless ``lse_given``) and pass 2's launches of ``module`` at ``dims``, bf16 causal."""
    b, h, t, d = dims
    q = torch.empty(b, h, t, d, dtype=torch.bfloat16)

    def pass1():
        module.row_lse_triton(q, q, None, True, d ** -0.5)

    def pass2():
        module.qk_stats_triton(q, q, None, True, d ** -0.5, lse=torch.empty(b, h, t))

    launches = [] if lse_given else [("qk_lse", pass1, 0)]
    cfg = module.pass2_configs(h, h, d, torch.bfloat16, report.GPU["shared_bytes"])[0] \
        if "explicit_mask" in module.pass2_configs.__code__.co_varnames else None
    captured = _captured_launches(report.ReportCase("qk_stats", "", "bfloat16", 2, pass2, scores_per_iteration),
                                  report.GPUS[arch])
    launches.append(("qk_probs" if captured[0][0].fn.__name__ == "_qk_probs_kernel" else "qk_stats", pass2, 0))
    if captured[0][0].fn.__name__ == "_qk_heads_kernel" and len(captured) > 1:
        launches.append(("qk_stats row sums", pass2, 1))     # the per-head kernel's two-launch plan
    elif cfg is not None and cfg["BLOCK_HK"] * cfg["BLOCK_G"] < h:
        launches.append(("qk_stats off-diagonal", pass2, 1))
    return launches


def qk_rows(module, shapes, lse_given: bool = False, arch: int = 90) -> list[dict]:
    """Pass 1 + 2 of ``module`` (bf16 causal) at ``shapes`` [(name, dims, measured or target ms, ...)]:
    per launch, scores = the programs' padded head blocks x rows x keys of the causal triangle."""
    out = []
    for shape, dims, reference_ms, *_ in shapes:
        b, h, t, d = dims
        total = 0.0
        parts, spilled, over = [], [], []
        try:
            launches = _qk_launches(module, dims, lse_given, arch)
        except RuntimeError as e:   # no Triton tile fits this target: pass 2 runs on qk_stats_torch
            if "launched no Triton kernel" not in str(e):
                raise
            out.append(dict(kernel="qk pass 1 + 2" if not lse_given else "qk pass 2", shape=shape, dims=list(dims),
                            arch=arch, reference_ms=reference_ms, predicted_ms=None, ratio=None,
                            parts=["no Triton pass 2 fits: qk_stats_torch (not predicted)"], spill_bytes=None,
                            shared_over=None))
            continue
        probs_plan = None
        for kernel, launch, index in launches:
            if kernel == "qk_probs":     # the launcher chose pass 2 through materialised P: its own sizes
                probs = probs_row(module, shape, dims, reference_ms, arch, forced=False)
                total += probs["predicted_ms"] / 1e3
                parts += probs["parts"]
                spilled.append(probs["spill_bytes"])
                over.append(probs["shared_over"])
                probs_plan = probs
                continue
            case = report.ReportCase(kernel, shape, "bfloat16", 2, launch, scores_per_iteration, launch_index=index)
            row = report.report_case(case, report.GPUS[arch])
            c = row.constexprs
            if c.get("PAIR_HEADS"):   # head-pair programs: two blocks scored in each (recomputed: blocks - 1 times)
                blocks = h // c["PAIR_HEADS"]
                held = blocks * (blocks - 1) // 2 * c["BLOCK_H"]
            elif "HEADS" in c:        # the per-head pass 2 (`qk_heads_triton`): real heads only
                held = h
            else:
                block = c["BLOCK_HK"] * c["BLOCK_G"]
                blocks = triton.cdiv(h, block)
                held = blocks * block if index == 0 else blocks * (blocks - 1) // 2 * 2 * block   # off-diagonal: two blocks
            if kernel == "qk_lse":
                held = h
            rows_tile, keys_tile = c["BLOCK_M"], c["BLOCK_N"]
            tiles = triton.cdiv(t, rows_tile)
            # causal: query tile i reads keys up to its last row, whole key tiles
            keys = sum(min(t, triton.cdiv((i + 1) * rows_tile, keys_tile) * keys_tile) for i in range(tiles))
            scores = b * held * rows_tile * keys
            p = _predict(row, scores, 2 * b * h * t * d * 2, arch=arch)
            total += p.seconds
            spilled.append(row.spill_bytes)
            over.append(row.shared_bytes > row.shared_limit)
            plan = (f"per-head{' pairs' if c.get('PAIR_HEADS') else ''} M{c['BLOCK_M']} N{c['BLOCK_N']} "
                    f"{row.num_warps}w" if "HEADS" in c else f"batched {c['BLOCK_HK'] * c['BLOCK_G']} heads M{c['BLOCK_M']} "
                    f"N{c['BLOCK_N']}")
            parts.append(f"{kernel} {1e3 * p.seconds:.3f} ms ({plan}, {held / h:.0f}x scored, {p.bound}, "
                         f"{row.wavefronts_per_element:.3f} wavefr/score, {row.conflict_factor:.1f}x conflicts, "
                         f"{row.registers} regs, {row.spill_bytes} B spilled, {row.shared_bytes // 1024}/"
                         f"{row.shared_limit // 1024} KB)")
        row = dict(kernel="qk pass 1 + 2" if not lse_given else "qk pass 2", shape=shape, dims=list(dims),
                   arch=arch, reference_ms=reference_ms, predicted_ms=1e3 * total, ratio=1e3 * total / reference_ms,
                   parts=parts, spill_bytes=max(spilled), shared_over=any(over))
        if probs_plan is not None:
            row.update(plan="materialised P", with_qk_miss_ms=(1e3 * total - probs_plan["predicted_ms"]
                                                               + probs_plan["write_ms"]) * QK_MISS + probs_plan["gram_ms"])
        out.append(row)
    return out


def qk_matrix(archs: list[int], as_json: bool = False) -> None:
    """Pass 2 (LSE given, bf16 causal) at the issue-38 targets, each target arch: a markdown table.
    The targets are the H200's measured times (sm_90); on the other generations the row says whether
    the launch is Triton, unspilled and within shared memory, and what the model predicts there. The
    Q/K miss (measured / predicted of the launch the H200 ran, commit 0c79385 at GPT-2-small, this
    triton's compile) is printed beside sm_90's predictions: the latency the model leaves out."""
    miss = QK_MISS
    rows = []
    for arch in archs:
        chosen = qk_rows(qk_stats_triton, QK_TARGETS, lse_given=True, arch=arch)
        rows += chosen
        # pass 2 through materialised P beside the choice, where the launcher chose another plan
        rows += [probs_row(qk_stats_triton, shape, dims, ms, arch) for (shape, dims, ms), r in zip(QK_TARGETS, chosen)
                 if r.get("plan") != "materialised P"]
    if as_json:
        for r in rows:
            print(json.dumps(dict(r, triton=triton.__version__, qk_miss=miss)))
        return
    print(f"triton {triton.__version__}: PREDICTED Q/K pass 2 (LSE given, bf16 causal); x Q/K miss: sm_90's "
          f"prediction x {miss:.2f} (the H200's measured Q/K launch against triton 3.6's compile of it)")
    print("| target | shape | plan | Triton, 0 B spilled, fits | predicted ms | x Q/K miss | target ms (H200) | "
          "≤ target (sm_90) | launches |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["predicted_ms"] is None:
            print(f"| sm_{r['arch']} | {r['shape']} | torch | no (no Triton tile) | - | - | {r['reference_ms']} | - | "
                  f"{r['parts'][0]} |")
            continue
        clean = r["spill_bytes"] == 0 and not r["shared_over"]
        on_h200 = r["arch"] == 90
        met = ("yes" if r["predicted_ms"] <= r["reference_ms"] else "no") if on_h200 else "-"
        # the miss applies to Q/K launches: materialised P's Gram is head_stats' kernel (`probs_row`)
        scaled = f"{r.get('with_qk_miss_ms', r['predicted_ms'] * miss):.3f}" if on_h200 else "-"
        print(f"| sm_{r['arch']} | {r['shape']} | {r.get('plan', 'chosen')} | {'yes' if clean else 'no'} | "
              f"{r['predicted_ms']:.3f} | {scaled} | {r['reference_ms']} | {met} | {'; '.join(r['parts'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qk", action="store_true", help="also the Q/K launches")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    ap.add_argument("--measured-only", action="store_true", help="only the launches that were measured")
    ap.add_argument("--qk-matrix", metavar="ARCHS",
                    help="only Q/K pass 2 (LSE given) at the issue-38 targets for each of ARCHS (e.g. 80,86,89,90,100,120)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("predict_measured: kernels cannot be compiled under TRITON_INTERPRET=1; unset it")
    if args.qk_matrix:
        qk_matrix([int(a) for a in args.qk_matrix.split(",")], args.json)
        return
    rows = [dict(r, launcher="0c79385") for r in head_stats_rows(measured_module("head_stats_0c79385"))]
    if not args.measured_only:
        rows += [dict(r, launcher="now") for r in head_stats_rows(head_stats_triton, args.arch)]
    if args.qk and args.measured_only:
        rows += [dict(r, launcher="0c79385") for r in qk_rows(measured_module("qk_stats_0c79385"), QK_MEASURED)]
    elif args.qk:
        rows += [dict(r, launcher="0c79385") for r in qk_rows(measured_module("qk_stats_0c79385"), QK_MEASURED)]
        rows += [dict(r, launcher="now") for r in qk_rows(qk_stats_triton, QK_MEASURED + QK_TARGETS[1:], arch=args.arch)]
        rows += [dict(r, launcher="now, LSE given") for r in qk_rows(qk_stats_triton, QK_TARGETS, lse_given=True,
                                                                     arch=args.arch)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"triton {triton.__version__}, sm_{args.arch}; PREDICTED (kernel report) beside the H200's measured graph ms")
    for r in rows:
        if r["kernel"] == "head_stats":
            print(f"{r['launcher']:<8} head_stats {r['shape']:<13} {r['dtype']:<9} measured {r['measured_ms']:.3f} ms "
                  f"({r['measured_pct_of_copy']:.1f} % of copy)  predicted {r['predicted_ms']:.3f} ms "
                  f"({r['predicted_pct_of_copy']:.1f} %, {r['bound']})  predicted/measured {r['ratio']:.2f}  "
                  f"{r['wavefronts_per_element']:.3f} wavefr/elem, {r['conflicts']:.1f}x conflicts, "
                  f"{r['registers']} regs, {r['spill_bytes']} B spilled, {r['in_flight_kb_per_sm']:.0f} KB in flight/SM "
                  f"(latency bound {r['latency_ms']:.3f} ms)")
        else:
            print(f"{r['launcher']:<8} {r['kernel']} {r['shape']} {r['dims']}: reference {r['reference_ms']:.3f} ms, "
                  f"predicted {r['predicted_ms']:.3f} ms ({r['ratio']:.2f}x); " + "; ".join(r["parts"]))


if __name__ == "__main__":
    main()
