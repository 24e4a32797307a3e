"""The README's GPU paragraph, generated from the raw lines `benchmarks/gpu_check.sh` wrote on lent GPUs
(benchmarks/gpu_runs/*-runN.jsonl): every number a range over all runs, dtypes and launch modes that
measured it, with the slice named; nothing that no run measured."""
from __future__ import annotations

import json
import re
from pathlib import Path

GPU_RUNS = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_runs"


def load_gpu_runs(folder: Path = GPU_RUNS) -> dict[int, list[dict]]:
    """Run number → its JSON lines (lines that are not JSON, e.g. a truncated last one, left out)."""
    runs = {}
    for path in sorted(folder.glob("*-run*.jsonl")):
        number = int(re.search(r"-run(\d+)\.jsonl$", path.name).group(1))
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        runs[number] = [r for r in rows if not r.get("dry_run")]
    return dict(sorted(runs.items()))


def _span(values: list[float], fmt: str = "{:.2g}", unit: str = "") -> str:
    lo, hi = min(values), max(values)
    text = fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"
    return text + unit


def _most(values: list[float]) -> str:
    return f"{max(values):.2g}"


def _runs_text(numbers) -> str:
    numbers = sorted(set(numbers))
    return ("run " if len(numbers) == 1 else "runs ") + ", ".join(map(str, numbers))


def _dtype(row: dict) -> str:
    return {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}.get(row.get("dtype"), "?")


def gpu_paragraph(runs: dict[int, list[dict]]) -> list[str]:
    """The measured facts of every run, as Markdown lines."""
    date = next((r["date"][:10] for rows in runs.values() for r in rows if r.get("date")), "?")
    versions = next((r["versions"] for rows in runs.values() for r in rows if r.get("versions")), "?")
    tests = "; ".join(f"run {n}: " + ", ".join(part for part in r["summary"].split(" in ")[0].split(", ")
                                               if "warning" not in part)
                      for n, rows in runs.items() for r in rows if r.get("stage") == "tests")
    versions = " ".join(w for w in versions.split() if w not in ("cuda", "True", "False", "NVIDIA", "H200"))
    last = max(runs)
    acc = [r for r in runs[last] if r.get("stage") == "accuracy"]
    hs = [r for r in acc if r["kernel"] == "head_stats"]
    qk = [r for r in acc if r["kernel"] == "qk"]
    out = [f"**Measured on a GPU** (one H200, {versions}, {date}; {len(runs)} runs of `benchmarks/gpu_check.sh`, "
           f"raw lines in `benchmarks/gpu_runs/`, summarised in [benchmarks/RESULTS.md](benchmarks/RESULTS.md); "
           f"this paragraph is generated from those lines by `python docs/generate.py gpu`):", ""]
    out.append(f"- Device tests: {tests} (the failures of runs 1–2 were fixed before run 3: a CPU-built causal "
               "mask in the Q/K reference, a dispatcher torch.compile could not trace, fp32 Gram chains too long).")
    if hs:
        tk = sorted({r["dims"][-1] for r in hs})
        out.append(f"- Against float64 at model size ({_runs_text([last])}, fp32 and bf16): head_stats s̄ within "
                   f"{_most([r['s_bar'] for r in hs])}, σ_H within {_most([r['sigma_h'] for r in hs])}, its Gram within "
                   f"{_most([r['gram'] for r in hs])} (relative error; T = {' and '.join(map(str, tk))}); Q/K statistics (T = "
                   f"{' and '.join(str(t) for t in sorted({r['dims'][-2] for r in qk}))} only) σ_H within "
                   f"{_most([r['sigma_h'] for r in qk])}, Gram within "
                   + ", ".join(f"{_dtype(r)} {r['gram']:.2g}" for r in qk)
                   + " — their s̄ was not recorded. attach's values under fp32, bf16 and fp16 autocast equal the "
                   "float64 reference on the same forward (device tests).")
    kern = [(n, r) for n, rows in runs.items() for r in rows if r.get("stage") == "kernels"]
    hsk = [(n, r) for n, r in kern if r["kernel"] == "head_stats"]
    if hsk:
        def pct(rows, key, dtype):
            return [r[key] for n, r in rows if key in r and _dtype(r) == dtype]
        graph = {d: pct(hsk, "pct_of_copy_graph", d) for d in ("bf16", "fp32")}
        python = {d: pct(hsk, "pct_of_copy", d) for d in ("bf16", "fp32")}
        every = graph["bf16"] + graph["fp32"] + python["bf16"] + python["fp32"]
        out.append(f"- The fused head_stats kernel streams {_span(every, '{:.0f}', ' %')} of device-copy bandwidth "
                   f"(GPT-2-small and the 4k context, {_runs_text(n for n, _ in hsk)}): replayed from a CUDA graph bf16 "
                   f"{_span(graph['bf16'], '{:.0f}', ' %')}, fp32 {_span(graph['fp32'], '{:.0f}', ' %')} "
                   f"({_runs_text(n for n, r in hsk if 'pct_of_copy_graph' in r)}); launched from Python bf16 "
                   f"{_span(python['bf16'], '{:.0f}', ' %')}, fp32 {_span(python['fp32'], '{:.0f}', ' %')} "
                   "(estimate from the compiled code: 65–84 %; Nsight Compute shows it L1/shared-memory bound).")
    qkk = [(n, r) for n, r in kern if r["kernel"].startswith("qk")]
    if qkk:
        bf = [r["ratio_to_flash"] for n, r in qkk if "ratio_to_flash" in r]
        fp = [r["ratio_to_sdpa"] for n, r in qkk if "ratio_to_sdpa" in r]
        graphed = [r["qk_graph_ms"] / r["sdpa_flash_ms"] for n, r in qkk if "qk_graph_ms" in r]
        out.append(f"- Q/K pass 1 + 2 take {_span(bf + fp, '{:.3g}', '×')} an SDPA forward of the same q, k, v "
                   f"(launched from Python, {_runs_text(n for n, _ in qkk)}): bf16 against flash "
                   f"{_span(bf, '{:.3g}', '×')}, fp32 against fp32 SDPA {_span(fp, '{:.3g}', '×')}; bf16 replayed "
                   f"from a CUDA graph {_span(graphed, '{:.3g}', '×')} the flash forward launched from Python.")
    att = [(n, r) for n, rows in runs.items() for r in rows if r.get("stage") == "attach"]
    if att:
        rows = []
        for model, autocast in sorted({(r["model"], r["autocast"]) for _, r in att}):
            mine = [r for _, r in att if (r["model"], r["autocast"]) == (model, autocast)]
            rows.append(f"{model} {('fp32' if autocast == 'none' else autocast.replace('bfloat16', 'bf16'))} "
                        f"{_span([r['every10_ratio'] for r in mine], '{:.2f}', '×')} / "
                        f"{_span([r['every1_ratio'] for r in mine], '{:.2f}', '×')}")
        e10 = [r["every10_ratio"] for _, r in att]
        e1 = [r["every1_ratio"] for _, r in att]
        out.append(f"- `attach` costs {_span(e10, '{:.2f}', '×')} a training step at every=10 and "
                   f"{_span(e1, '{:.2f}', '×')} at every=1 ({_runs_text(n for n, _ in att)}; alternated blocks; "
                   f"every=10 / every=1 per model: {'; '.join(rows)}); targets 1.01× / 1.05×.")
    return out
