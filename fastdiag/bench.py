"""Measured overhead of the diagnostics: kernel level and training-step level.

Kernel level: for each shape and dtype, the pure-PyTorch reference written the obvious way
(`head_stats_ref` at float32, eager), the same reference under `torch.compile`, and fastdiag's backend
for the device (`auto`). Step level: a training step without fastdiag and with `attach(every=10)` /
`attach(every=1)`, timed as alternating blocks in one process so machine noise cancels.

Timing: warm-up first (compilation is never timed), then many repeats and medians; on CUDA,
`triton.testing.do_bench` (CUDA events, cache flushed between repeats).
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fastdiag.bench_workloads import ENSEMBLE_WORKLOADS, KERNEL_SHAPES
from fastdiag.core.diagnostics import head_stats
from fastdiag.grokking.build import build_model
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import default_ensemble_size
from fastdiag.core.kernels import head_stats_ref
from fastdiag import kernel_report as _report
from fastdiag.models import count_parameters
from fastdiag.core.monitor import attach
from fastdiag.core.stats import summarize
from fastdiag.store import Store
from fastdiag.sweep.plan import available_cores
from fastdiag.sweep.run import run_sweep
from fastdiag.testing import NanoGPT, random_probs

@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


@dataclass
class KernelResult:
    shape: str
    dims: tuple
    dtype: str
    device: str
    bytes_read: int
    timings: dict = field(default_factory=dict)          # method -> Timing
    copy_bandwidth_gbs: float | None = None               # device-to-device copy, same run

    def row(self) -> dict:
        d = asdict(self)
        fast = self.timings["fastdiag"].median_ms
        d["gbytes_per_s"] = self.bytes_read / (fast * 1e-3) / 1e9
        d["speedup_vs_eager"] = self.timings["eager"].median_ms / fast
        if "compiled" in self.timings:
            d["speedup_vs_compiled"] = self.timings["compiled"].median_ms / fast
        if self.copy_bandwidth_gbs:
            d["fraction_of_copy_bandwidth"] = d["gbytes_per_s"] / self.copy_bandwidth_gbs
        return d


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 20) -> Timing:
    if device.type == "cuda":
        import triton.testing

        q = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        return Timing(*q)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return Timing(statistics.median(samples), samples[int(0.2 * (len(samples) - 1))],
                  samples[int(0.8 * (len(samples) - 1))])


def _copy_bandwidth_gbs(x: torch.Tensor) -> float:
    dst = torch.empty_like(x)
    t = time_fn(lambda: dst.copy_(x), x.device)
    return 2 * x.numel() * x.element_size() / (t.median_ms * 1e-3) / 1e9   # read + write


def bench_kernel(shape_name: str, dims: tuple, dtype: torch.dtype, device: torch.device,
                 compiled: bool = True, repeats: int = 20, progress: Callable[[str], None] = print) -> KernelResult:
    n, b, h, t = dims
    probs = random_probs((n, b, h, t, t), dtype=dtype, seed=0, device=device)
    mask = None
    result = KernelResult(shape_name, dims, str(dtype).replace("torch.", ""), device.type,
                          probs.numel() * probs.element_size())
    eager_ref = lambda: head_stats_ref(probs, mask, acc_dtype=torch.float32)  # noqa: E731
    methods = {"eager": eager_ref, "fastdiag": lambda: head_stats(probs, mask, backend="auto")}
    if compiled:
        compiled_ref = torch.compile(lambda p: head_stats_ref(p, None, acc_dtype=torch.float32))
        methods["compiled"] = lambda: compiled_ref(probs)
    for method, fn in methods.items():
        progress(f"kernel {shape_name} {result.dtype} {method} ...")
        result.timings[method] = time_fn(fn, device, repeats=repeats)
    if device.type == "cuda":
        result.copy_bandwidth_gbs = _copy_bandwidth_gbs(probs)
    return result


# ---- kernel report: compiled for the GPU here, no GPU needed ------------------------------------

def kernel_report(shape_names: list[str], progress: Callable[[str], None] = print) -> list:
    """`fastdiag.kernel_report` of every Triton kernel at these benchmark shapes."""
    return _report.kernel_report({name: KERNEL_SHAPES[name] for name in shape_names}, progress=progress)


def kernel_dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":
        dtypes = [torch.float32, torch.float16]
        if torch.cuda.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes
    return [torch.float32, torch.bfloat16]


# ---- step level --------------------------------------------------------------------------------

@dataclass
class StepResult:
    name: str
    device: str
    base_ms: float
    every10_ms: float
    every1_ms: float
    overhead_every10_pct: float           # 100 (every10_ms / base_ms - 1): the printed medians' ratio
    overhead_every1_pct: float
    blocks: int
    every10_interval_pct: tuple[float, float] = (math.nan, math.nan)   # `ratio_interval` of the blocks, in %
    every1_interval_pct: tuple[float, float] = (math.nan, math.nan)


def _training_step(model, batch, targets, optimizer, last_position_only: bool):
    optimizer.zero_grad(set_to_none=True)
    logits = model(batch)
    if last_position_only:
        logits = logits[:, -1] if logits.dim() == 3 else logits
        loss = torch.nn.functional.cross_entropy(logits, targets)
    else:
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()


def step_workloads(device: torch.device) -> dict[str, Callable[[], tuple]]:
    """name -> factory of (model, batch, targets, last_position_only)."""

    def grokking():
        cfg = RunConfig()
        model = build_model(cfg).to(device)
        g = torch.Generator().manual_seed(0)
        batch = torch.randint(0, cfg.p, (512, 3), generator=g).to(device)
        batch[:, 2] = cfg.p
        targets = torch.randint(0, cfg.p, (512,), generator=g).to(device)
        return model, batch, targets, True

    def nanogpt():
        seq = 256 if device.type == "cuda" else 128
        width = (768, 12, 6) if device.type == "cuda" else (256, 8, 4)
        model = NanoGPT(vocab=512, d_model=width[0], n_heads=width[1], n_layers=width[2], seq_len=seq).to(device)
        g = torch.Generator().manual_seed(0)
        bsz = 16 if device.type == "cuda" else 8
        batch = torch.randint(0, 512, (bsz, seq), generator=g).to(device)
        return model, batch, torch.roll(batch, -1, dims=1), False

    return {"grokking-canonical": grokking, "nanogpt-sdpa": nanogpt}


def rotating_blocks(run_block: Callable[[str], float], variants: list[str], rounds: int, label: str,
                    progress: Callable[[str], None] = print) -> dict[str, list[float]]:
    """One warm-up block per variant, then ``rounds`` rounds of one block each, the order rotated every
    round, so slow drifts of the machine hit every variant alike. ``run_block(variant)`` returns its
    milliseconds per step; the result is every variant's samples, round by round."""
    for v in variants:
        run_block(v)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(rounds):
        progress(f"{label} {i + 1}/{rounds}")
        shift = i % len(variants)
        for v in variants[shift:] + variants[:shift]:
            samples[v].append(run_block(v))
    return samples


def ratio_interval(samples: list[float], base: list[float]) -> tuple[float, float]:
    """A distribution-free interval for the median of the per-round ratios (each compares blocks run side
    by side): the sign test's order statistics, the narrowest pair with at least 95 % coverage, or the
    smallest and largest ratio where the rounds are too few for that (5 rounds: 93.8 %; 21 rounds: the
    6th to the 16th ratio, 97.3 %)."""
    ratios = sorted(a / b for a, b in zip(samples, base))
    n = len(ratios)
    k = 0       # ratios left out at each end; coverage 1 - 2 P(Binomial(n, 1/2) <= k)
    while k + 1 < n / 2 and 2 * sum(math.comb(n, i) for i in range(k + 2)) / 2 ** n <= 0.05:
        k += 1
    return ratios[k], ratios[n - 1 - k]


def within_noise(interval: tuple[float, float], ratio: float = 1.0) -> bool:
    """Whether a ratio interval holds ``ratio`` (no difference)."""
    return interval[0] <= ratio <= interval[1]


def _pct(interval: tuple[float, float]) -> tuple[float, float]:
    return 100 * (interval[0] - 1), 100 * (interval[1] - 1)


def _ms_per_step(device: torch.device, steps: int, step: Callable[[], object],
                 read: Callable[[], object] | None = None) -> float:
    """Milliseconds per call of ``step``, over ``steps`` calls and a final ``read`` of their results
    (statistics really computed and readable), device work included."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if read is not None:
        read()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def bench_step(name: str, factory, device: torch.device, blocks: int = 15, block_steps: int = 10,
               progress: Callable[[str], None] = print) -> StepResult:
    """Blocks of ``block_steps`` training steps without fastdiag, with attach(every=10) and with
    attach(every=1), in rotating order on ONE model and optimizer: no variant gets a luckier copy
    of the weights in memory, and slow drifts of the machine hit all variants alike."""
    model, batch, targets, last_only = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    every = {"base": None, "every10": 10, "every1": 1}

    def run_block(variant: str) -> float:
        monitor = attach(model, every=every[variant]) if every[variant] else None
        elapsed = _ms_per_step(device, block_steps, lambda: _training_step(model, batch, targets, opt, last_only),
                               read=monitor.latest if monitor is not None else None)
        if monitor is not None:
            monitor.detach()
        return elapsed

    samples = rotating_blocks(run_block, list(every), blocks, f"step {name} block", progress)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return StepResult(name, device.type, med["base"], med["every10"], med["every1"],
                      100 * (med["every10"] / med["base"] - 1), 100 * (med["every1"] / med["base"] - 1), blocks,
                      _pct(ratio_interval(samples["every10"], samples["base"])),
                      _pct(ratio_interval(samples["every1"], samples["base"])))


# ---- step level: the SDPA path, against what a user would do instead ---------------------------

@dataclass
class SdpaStepResult:
    device: str
    workload: str
    base_ms: float            # bare training step (attention through F.scaled_dot_product_attention)
    with_stats_ms: float      # `fastdiag.attach(model, every=1)`: every SDPA call through `sdpa_with_stats`
    eager_ms: float           # eager attention + output_attentions + head_stats of the probabilities
    with_stats_ratio: float   # with_stats_ms / base_ms: the printed medians' ratio
    eager_ratio: float        # eager_ms / base_ms
    rounds: int
    block_steps: int
    with_stats_interval: tuple[float, float] = (math.nan, math.nan)   # `ratio_interval` of the rounds
    eager_interval: tuple[float, float] = (math.nan, math.nan)


def hf_gpt2_sdpa_workload(device: torch.device, layers: int = 4, width: int = 256, heads: int = 8,
                          seq: int = 256, batch: int = 4, vocab: int = 512, attn_dropout: float = 0.0):
    """A Hugging Face GPT-2 (4 layers, d 256, 8 heads, T 256, batch 4) and one batch.

    Attention dropout is off by default: with it, eager ``output_attentions`` returns the dropped-out
    weights (not probabilities) and SDPA runs its dropout kernel (no LSE to reuse)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=seq, vocab_size=vocab,
                     bos_token_id=0, eos_token_id=0, attn_pdrop=attn_dropout, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    batch_ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    return model, batch_ids


def bench_sdpa_step(device: torch.device, rounds: int = 9, block_steps: int = 5, attn_dropout: float = 0.0,
                    progress: Callable[[str], None] = print) -> SdpaStepResult:
    """Blocks of training steps of one HF GPT-2 model and optimizer, in rotating order per round:
    bare (sdpa), ``fastdiag.attach(model, every=1)`` (every SDPA call through `sdpa_with_stats`:
    statistics of every layer, every step),
    and the alternative a user has without fastdiag's Q/K path: eager attention with
    ``output_attentions=True`` and `head_stats` of the returned probabilities."""
    model, ids = hf_gpt2_sdpa_workload(device, attn_dropout=attn_dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(eager: bool):
        opt.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, output_attentions=eager)
        out.loss.backward()
        opt.step()
        if eager:
            return [head_stats(a.detach()) for a in out.attentions]
        return None

    def run_block(variant: str) -> float:
        model.set_attn_implementation("eager" if variant == "eager" else "sdpa")
        monitor = attach(model, every=1) if variant == "with_stats" else None
        collected = []

        def read():
            if monitor is not None:
                monitor.latest()                                             # the statistics are really read
            elif collected:
                summarize(collected[-len(model.transformer.h):]).s_bar.item()

        elapsed = _ms_per_step(device, block_steps, lambda: collected.extend(step(variant == "eager") or []), read)
        if monitor is not None:
            monitor.detach()
        return elapsed

    variants = ["base", "with_stats", "eager"]
    samples = rotating_blocks(run_block, variants, rounds, "sdpa step round", progress)
    model.set_attn_implementation("sdpa")
    med = {v: statistics.median(x) for v, x in samples.items()}
    interval = {v: ratio_interval(samples[v], samples["base"]) for v in variants}
    workload = "hf-gpt2 4x256x8 T256 B4" + (f" attn-drop {attn_dropout:g}" if attn_dropout else "")
    return SdpaStepResult(device.type, workload, med["base"], med["with_stats"], med["eager"],
                          med["with_stats"] / med["base"], med["eager"] / med["base"], rounds, block_steps,
                          interval["with_stats"], interval["eager"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def format_table(columns: list[tuple], rows: list[dict]) -> str:
    """The benchmark tables: ``columns`` are (header, row key or function of the row, alignment and
    width as in a format spec such as ``"<13"``, the number's format such as ``".3f"``); a value that
    does not exist (None, NaN: no compiled reference, no copy bandwidth off a GPU) prints as a dash."""
    head = " ".join(f"{header:{width}}" for header, _, width, _ in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for _, get, width, spec in columns:
            value = r[get] if isinstance(get, str) else get(r)
            cells.append(f"{'–':{width}}" if value is None or value != value else f"{value:{width}{spec}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def format_sdpa_step_table(rows: list[dict]) -> str:
    return format_table([("device", "device", "<7", ""), ("workload", "workload", "<36", ""),
                         ("base ms", "base_ms", ">8", ".1f"), ("sdpa+stats", "with_stats_ms", ">10", ".1f"),
                         ("eager+attn", "eager_ms", ">10", ".1f"),
                         ("x stats [interval]", _ratio_cell("with_stats_ratio", "with_stats_interval"), ">22", ""),
                         ("x eager [interval]", _ratio_cell("eager_ratio", "eager_interval"), ">22", "")],
                        rows) + RATIO_NOTE


# What every ratio column says (the same words under each table).
RATIO_NOTE = ("\nratios and overheads: of the printed medians; [interval]: a sign-test interval for the median "
              "of the per-round ratios (95 % or more; with under 9 rounds their range: 93.8 % with 5); ~0: the "
              "interval holds no difference (within noise)")


def _ratio_cell(ratio_key: str, interval_key: str, percent: bool = False):
    """A ratio (or, ``percent``, an overhead in %) with its interval, marked ~0 when the interval holds
    no difference: a negative overhead is never printed bare."""
    def cell(r: dict) -> str | None:
        value, (lo, hi) = r[ratio_key], r.get(interval_key) or (math.nan, math.nan)
        if value is None or value != value:
            return None
        if lo != lo:                       # an old JSON row without the interval
            return f"{value:.2f}" if percent else f"{value:.3f}"
        noise = " ~0" if (lo <= 0 <= hi if percent else lo <= 1 <= hi) else "   "
        if percent:
            return f"{value:+.1f} [{lo:+.1f}, {hi:+.1f}]{noise}"
        return f"{value:.3f} [{lo:.3f}, {hi:.3f}]{noise}"
    return cell


def _median_ms(timing: str):
    return lambda r: (r["timings"].get(timing) or {}).get("median_ms")


def format_kernel_table(rows: list[dict]) -> str:
    table = format_table([
        ("shape", "shape", "<13", ""), ("dtype", "dtype", "<9", ""), ("eager ms", _median_ms("eager"), ">9", ".3f"),
        ("compiled", _median_ms("compiled"), ">9", ".3f"), ("fastdiag", _median_ms("fastdiag"), ">9", ".3f"),
        ("x eager", "speedup_vs_eager", ">8", ".2f"), ("x comp", lambda r: r.get("speedup_vs_compiled"), ">7", ".2f"),
        ("GB/s", "gbytes_per_s", ">7", ".1f"),
        ("%copy", lambda r: None if r.get("fraction_of_copy_bandwidth") is None
         else 100 * r["fraction_of_copy_bandwidth"], ">6", ".1f")], rows)
    if any(r["timings"].get("compiled") is None or r.get("fraction_of_copy_bandwidth") is None for r in rows):
        table += ("\n–: not measured here (compiled: --no-compile or no torch.compile; %copy: the copy "
                  "bandwidth is measured on a GPU only)")
    return table


def format_step_table(rows: list[dict]) -> str:
    return format_table([("step", "name", "<20", ""), ("base ms", "base_ms", ">9", ".3f"),
                         ("every=10", "every10_ms", ">9", ".3f"), ("every=1", "every1_ms", ">9", ".3f"),
                         ("ovh@10 % [interval]", _ratio_cell("overhead_every10_pct", "every10_interval_pct", True),
                          ">24", ""),
                         ("ovh@1 % [interval]", _ratio_cell("overhead_every1_pct", "every1_interval_pct", True),
                          ">24", "")], rows) + RATIO_NOTE


# ---- sweep throughput: vectorised ensembles against one run at a time -------------------------
# (the workloads: fastdiag/bench_workloads.py)

@dataclass
class EnsembleResult:
    device: str
    workload: str
    runs: int
    members: int
    epochs: int
    one_by_one_s: float
    ensemble_s: float
    runs_per_hour_one_by_one: float
    runs_per_hour_ensemble: float
    speedup: float


def bench_ensemble(device: torch.device, workload: str = "canonical", members: int | None = None,
                   runs: int | None = None, epochs: int | None = None,
                   progress: Callable[[str], None] = print) -> EnsembleResult:
    """Runs per hour of a real sweep (`sweep.run_sweep`, its default workers and threads, a fresh
    store each) of ``runs`` runs (distinct seeds and λ, diagnostics on): one by one (``--ensemble 1``)
    against ensembles of ``members`` (``--ensemble K``), one after the other in this session.

    The default ``runs`` gives every local worker a full pack, so neither side idles cores."""
    if workload not in ENSEMBLE_WORKLOADS:
        raise ValueError(f"workload: expected one of {', '.join(ENSEMBLE_WORKLOADS)}, got {workload!r}")
    spec = {**ENSEMBLE_WORKLOADS[workload], **({"epochs": epochs} if epochs else {})}
    k = members or max(2, default_ensemble_size(RunConfig(device=device.type, **spec)))
    runs = runs or k * (1 if device.type == "cuda" else available_cores())
    cfgs = [RunConfig(seed=i, weight_decay=[0.1, 0.3, 1.0, 3.0][i % 4], stop_at_grok=False,
                      device=device.type, **spec) for i in range(runs)]
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (1, k):
            progress(f"ensemble bench: {workload}, {runs} runs, --ensemble {size} ...")
            with Store(Path(tmp) / f"k{size}.sqlite") as store:
                t0 = time.perf_counter()
                summary = run_sweep(cfgs, store, ensemble=size, progress=False)
                seconds[size] = time.perf_counter() - t0
            if summary.failed:
                raise RuntimeError(f"ensemble bench: {summary.failed} run(s) failed: {summary.failures[:1]}")
    return EnsembleResult(device.type, workload, runs, k, spec["epochs"], seconds[1], seconds[k],
                          3600 * runs / seconds[1], 3600 * runs / seconds[k], seconds[1] / seconds[k])


def format_ensemble_table(rows: list[dict]) -> str:
    return format_table([("device", "device", "<7", ""), ("workload", "workload", "<10", ""), ("runs", "runs", ">5", ""),
                         ("K", "members", ">4", ""), ("epochs", "epochs", ">6", ""),
                         ("1-by-1 s", "one_by_one_s", ">9", ".1f"), ("ensemble s", "ensemble_s", ">10", ".1f"),
                         ("runs/h 1-by-1", "runs_per_hour_one_by_one", ">14", ".0f"),
                         ("runs/h ens", "runs_per_hour_ensemble", ">11", ".0f"), ("speed-up", "speedup", ">9", ".2f")],
                        rows)


# ---- architecture steps: a Mamba training step beside the transformer's --------------------------

# Grokking training steps (docs/experiments.md: batch 512, T = 3) of the canonical transformer, a transformer with
# the Mamba's parameter count (d_ff 648: 958,624 parameters against the Mamba's 958,208) and the Mamba.
ARCH_STEPS: dict[str, dict] = {
    "transformer": dict(),
    "transformer-0.96M": dict(preset="custom", d_ff=648),
    "mamba": dict(arch="mamba"),
}


@dataclass
class ArchStepResult:
    name: str
    device: str
    n_params: int
    ms_per_step: float
    vs_transformer: float      # ms_per_step / the canonical transformer's: the printed medians' ratio
    blocks: int
    interval: tuple[float, float] = (1.0, 1.0)   # `ratio_interval` of the blocks


def bench_arch_steps(device: torch.device, blocks: int = 15, block_steps: int = 5,
                     progress: Callable[[str], None] = print) -> list[ArchStepResult]:
    """Blocks of ``block_steps`` training steps of each `ARCH_STEPS` model (AdamW, the run's own
    settings), in rotating order in this process, so machine noise hits all alike."""
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 97, (512, 3), generator=g)
    batch[:, 2] = 97
    targets = torch.randint(0, 97, (512,), generator=g)
    batch, targets = batch.to(device), targets.to(device)
    setups = {}
    for name, spec in ARCH_STEPS.items():
        cfg = RunConfig(device=device.type, **spec)
        torch.manual_seed(0)
        model = build_model(cfg, device=device).to(device)
        setups[name] = (model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                                                 weight_decay=cfg.weight_decay))

    def run_block(name: str) -> float:
        model, opt = setups[name]
        return _ms_per_step(device, block_steps, lambda: _training_step(model, batch, targets, opt, True))

    samples = rotating_blocks(run_block, list(setups), blocks, "arch steps block", progress)
    base = samples["transformer"]
    return [ArchStepResult(name, device.type, count_parameters(setups[name][0]), statistics.median(v),
                           statistics.median(v) / statistics.median(base), blocks, ratio_interval(v, base))
            for name, v in samples.items()]


def format_arch_table(rows: list[dict]) -> str:
    return format_table([("training step", "name", "<18", ""), ("params", "n_params", ">9", ","),
                         ("ms/step", "ms_per_step", ">9", ".1f"),
                         ("x transformer [interval]", _ratio_cell("vs_transformer", "interval"), ">26", "")],
                        rows) + RATIO_NOTE
