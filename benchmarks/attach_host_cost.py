"""What `fastdiag.attach` adds to the host side of a training step, counted and timed on CPU.

Counts (deterministic, the main evidence): on one training step (forward, loss, backward) of a tiny
Hugging Face GPT-2 and a grouped-query Llama (4 layers, 4 heads x 16, batch 2 x 32, sdpa), after two
warm-up steps, bare and with ``attach(every=1, keep_records=False)``:

- aten ops added per measured layer (a TorchDispatchMode; ``backend="triton"`` under
  TRITON_INTERPRET=1: the launch glue is counted, each kernel launch as one op, and the tensor copies
  the interpreter makes to emulate a launch not at all: a GPU launch has none), on a float16 copy of
  the model and on the float32 model itself (its Q and K scored in float64 by the same two launches:
  pass 1 and the per-head kernel's float32 plan, as on sm_80 / sm_90),
- Python calls added per measured layer (``sys.setprofile`` "call" events; ``backend="torch"``),
- ops that would make a CUDA host wait (`fastdiag.core.host_sync`), on every backend.

Timings (``--time BLOCKS``): HF GPT-2 (4 layers, d 256, T 256, batch 4, sdpa) at 2 threads, blocks
of steps alternating bare / bare again (the control: how far order and load alone move a ratio) /
every=1 / attached-but-unmeasured / the eager + ``output_attentions`` alternative with naive
statistics, on one model set up for each block (``--copies``: a copy per kind); medians of the
per-block means, as ratios to bare. The machine
load (``os.getloadavg``) is printed beside them.

A measured forward's parts (``--parts ROUNDS``): bare, with the statistics, and with the kernel's calls
answered from a cache and run right after the forward instead: what running the kernel inside the
model costs beyond its own time.

    python benchmarks/attach_host_cost.py [--time BLOCKS] [--parts ROUNDS] [--threads N] [--cpu-time] [--detail]
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fastdiag  # noqa: E402
from fastdiag.core.host_sync import SyncDetector  # noqa: E402

LAYERS = 4


def tiny(family: str, attn: str = "sdpa", layers: int = LAYERS, d: int = 64, heads: int = 4,
         positions: int = 64):
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_head=heads, n_embd=d, vocab_size=128,
                                         n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                                          hidden_size=d, intermediate_size=2 * d, vocab_size=128,
                                          max_position_embeddings=positions)
        cls = transformers.LlamaForCausalLM
    config._attn_implementation = attn
    model = cls(config).train()
    return model


def timed_model(attn: str = "sdpa"):
    """The timed model of ``--time`` and ``--parts``: HF GPT-2, 4 layers, d 256, 4 heads, 256 positions."""
    return tiny("gpt2", attn, layers=4, d=256, heads=4, positions=256)


def step_fn(model, batch: int = 2, seq: int = 32):
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
    return step


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.interpreter = 0       # ops of the interpreter's launch emulation (not in ``ops``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _launches_as_one_op(counter: OpCounter):
    """Triton's interpreter emulates a launch with tensor copies of its own (`GridExecutor`): a GPU
    launch issues none of them. Each launch counts as one op here, and what the interpreter does
    inside it is not counted (run with the dispatch mode off)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime import interpreter

    original = interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        counter.ops[f"triton launch {getattr(self.fn, '__name__', self.fn)}"] += 1
        with _disable_current_modes(), OpCounter() as inside:
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.interpreter += sum(inside.ops.values())
    interpreter.GridExecutor.__call__ = launch
    return lambda: setattr(interpreter.GridExecutor, "__call__", original)


def count_ops(step) -> OpCounter:
    with OpCounter() as counter:
        restore = _launches_as_one_op(counter)
        try:
            step()
        finally:
            restore()
    return counter


def count_calls(step) -> int:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def attached(model, backend: str, counter, warmup: int = 2):
    """``counter(step)`` on the third step of ``model`` attached with every=1 (two warm-up steps first)."""
    step = step_fn(model)
    monitor = fastdiag.attach(model, every=1, keep_records=False, backend=backend)
    try:
        for _ in range(warmup):
            step()
        return counter(step)
    finally:
        monitor.detach()


def bare(model, counter, warmup: int = 2):
    step = step_fn(model)
    for _ in range(warmup):
        step()
    return counter(step)


def syncs_seen(model, backend: str) -> list[str]:
    step = step_fn(model)
    monitor = fastdiag.attach(model, every=1, keep_records=False, backend=backend)
    try:
        seen = []
        for _ in range(3):              # the careful first pass and the ones after it
            with SyncDetector() as detector:
                step()
            seen += detector.ops
        return seen
    finally:
        monitor.detach()


def counts(detail: bool = False, families=("gpt2", "llama"), syncs: bool = True) -> list[dict]:
    rows = []
    for family in families:
        model = tiny(family)
        # counted on a float16 copy (what a bf16/fp16 step on a GPU runs) and on the float32 model (its Q/K
        # scored in float64 by pass 1 and the per-head kernel's float32 plan, as on a GPU with float64 MMA)
        half = tiny(family).half()
        ops_bare, ops_att = bare(half, count_ops), attached(half, "triton", count_ops)
        fp32_glue = (sum(attached(model, "triton", count_ops).ops.values())
                     - sum(bare(model, count_ops).ops.values())) / LAYERS
        calls_bare, calls_att = bare(model, count_calls), attached(model, "torch", count_calls)
        sync = {backend: syncs_seen(model, backend) for backend in ("torch", "triton", "reference")} if syncs else {}
        glue = sum(ops_att.ops.values()) - sum(ops_bare.ops.values())
        row = dict(model=family, aten_ops_per_layer=glue / LAYERS, float32_aten_ops_per_layer=fp32_glue,
                   with_interpreter_copies=(glue + ops_att.interpreter - ops_bare.interpreter) / LAYERS,
                   python_calls_per_layer=(calls_att - calls_bare) / LAYERS,
                   sync_ops={b: len(s) for b, s in sync.items()})
        rows.append(row)
        print(f"{family}: +{row['aten_ops_per_layer']:.1f} aten ops / measured layer (triton, float16; "
              f"{row['with_interpreter_copies']:.1f} with the interpreter's launch copies; float32: "
              f"+{fp32_glue:.1f}), "
              f"+{row['python_calls_per_layer']:.0f} Python calls / measured layer (torch), host-sync ops "
              + ", ".join(f"{b} {n}" for b, n in row["sync_ops"].items()), flush=True)
        if detail:
            added = ops_att.ops - ops_bare.ops
            print("  aten ops added:", ", ".join(f"{op} {n}" for op, n in added.most_common(40)))
            for b, s in sync.items():
                if s:
                    print(f"  syncs ({b}):", collections.Counter(s).most_common())
    return rows


def naive_stats(attentions) -> torch.Tensor:
    """What a user would write with output_attentions: s̄ and σ_H from the probabilities in plain torch."""
    sync, spread = [], []
    for p in attentions:
        p = p.detach().float()
        v = p.transpose(0, 1).reshape(p.shape[1], -1)
        v = v / v.norm(dim=1, keepdim=True)
        c = v @ v.T
        h = c.shape[0]
        sync.append((c.sum() - c.diagonal().sum()) / (h * (h - 1)))
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean(dim=(0, 2))
        spread.append(entropy.std(unbiased=False))
    return torch.stack(sync).mean() + torch.stack(spread).mean()


def timings(blocks: int, steps_per_block: int = 3, every_unmeasured: int = 10**9, threads: int = 2,
            cpu_time: bool = False, copies: bool = False) -> dict:
    """Blocks of steps per kind, alternated, the kinds' order rotated from round to round.

    One model (the default), as in a user's process: each block sets it up for its kind — attached for
    that block only (its careful first pass and a lean one in two untimed warm-up steps, detached after
    it), or switched to eager attention for the alternative — so every kind runs the same tensors in the
    same heap. ``copies``: the earlier method, one copy of the model per kind (same weights), each
    attached once for the whole run; with five models in the process a measured step read ~6 % dearer
    than with one (RESULTS.md, fifth session). ``cpu_time``: the process's CPU time instead of the wall
    clock. A garbage collection before each block keeps one kind's garbage out of the next kind's time."""
    torch.set_num_threads(threads)
    clock = time.process_time if cpu_time else time.perf_counter
    unmeasured = f"every={every_unmeasured} (unmeasured)"
    # a second bare kind is the control: its ratio to the first is what order, copies and load alone move
    kinds = ("bare", "bare (another copy)" if copies else "bare (again)", "every=1", unmeasured,
             "eager+output_attentions")
    every = {"every=1": 1, unmeasured: every_unmeasured}
    if copies:
        models = {kind: timed_model("eager" if kind.startswith("eager") else "sdpa") for kind in kinds}
        for model in models.values():
            model.load_state_dict(models["bare"].state_dict())
    else:
        model = timed_model()
        models = dict.fromkeys(kinds, model)
    ids = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(1))
    optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=0.0) for m in models.values()}
    monitors = {kind: fastdiag.attach(models[kind], every=n, keep_records=False) for kind, n in every.items()} \
        if copies else {}

    def run(kind):
        model = models[kind]
        if kind == "eager+output_attentions":
            out = model(input_ids=ids, labels=ids, output_attentions=True)
            out.loss.backward()
            naive_stats(out.attentions)
        else:
            model(input_ids=ids, labels=ids).loss.backward()
        optimizers[id(model)].step()
        optimizers[id(model)].zero_grad()

    def set_up(kind):
        """One model: its attention implementation and monitor for this block (two warm-up steps)."""
        if copies:
            return None
        model.config._attn_implementation = "eager" if kind.startswith("eager") else "sdpa"
        monitor = fastdiag.attach(model, every=every[kind], keep_records=False) if kind in every else None
        for _ in range(2):
            run(kind)
        return monitor

    times = {k: [] for k in kinds}
    loads = []
    try:
        if copies:
            for kind in kinds:   # warm-up: each monitor's careful first pass (the unmeasured one's step 0)
                for _ in range(3):
                    run(kind)
        for block in range(blocks):
            loads.append(os.getloadavg()[0])
            for kind in kinds[block % len(kinds):] + kinds[:block % len(kinds)]:
                monitor = set_up(kind)
                try:
                    gc.collect()
                    t0 = clock()
                    for _ in range(steps_per_block):
                        run(kind)
                    times[kind].append((clock() - t0) / steps_per_block)
                finally:
                    if monitor is not None:
                        monitor.detach()
    finally:
        for monitor in monitors.values():
            monitor.detach()
        if not copies:
            model.config._attn_implementation = "sdpa"
    print("block means, ms: " + "; ".join(f"{k} " + " ".join(f"{x * 1e3:.0f}" for x in v) for k, v in times.items()))
    base = statistics.median(times["bare"])
    result = {k: statistics.median(v) / base for k, v in times.items()}
    # each block's own ratio to the bare steps of its round: their range says how far the load moved them
    spread = {k: sorted(t / b for t, b in zip(v, times["bare"])) for k, v in times.items()}
    print(f"HF GPT-2 4 layers d 256 T 256 batch 4 sdpa, {'a copy per kind' if copies else 'one model'}, "
          f"{torch.get_num_threads()} threads, {'CPU time' if cpu_time else 'wall clock'}, {blocks} rounds of "
          f"alternated blocks of {steps_per_block} steps, load {min(loads):.1f}-{max(loads):.1f}: bare {base * 1e3:.0f} ms; "
          + "; ".join(f"{k} x{r:.3f} (median block ratio {statistics.median(spread[k]):.3f}, "
                      f"blocks {spread[k][0]:.3f}-{spread[k][-1]:.3f})"
                      for k, r in result.items() if k != "bare"), flush=True)
    result["bare_ms"] = base * 1e3
    return result


def parts(rounds: int, threads: int = 1, cpu_time: bool = True) -> dict:
    """Where a measured forward's time goes (HF GPT-2 of ``timings``, forward only, no grad): bare; with the
    statistics; with the native kernel's calls answered from a cache (the rest of attach unchanged) and the
    same calls run right after the forward instead. Inside minus (cached + after) is what running the
    kernel in the middle of the model costs beyond its own time (caches, threads)."""
    from fastdiag.core.kernels import qk_stats_cpu as native

    torch.set_num_threads(threads)
    clock = time.process_time if cpu_time else time.perf_counter
    model = timed_model()
    ids = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(1))
    launch, cached, calls = native._launch, {}, []

    def answered_from_cache(*args):
        calls.append([a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        key = tuple(args[0].shape)
        if key not in cached:
            cached[key] = launch(*args)
        return cached[key].clone()

    kinds = ("bare", "statistics inside", "cached, the same kernel calls after")
    times = {k: [] for k in kinds}
    try:
        with torch.no_grad():
            for _ in range(rounds):
                for kind in kinds:
                    native._launch = answered_from_cache if kind.startswith("cached") else launch
                    monitor = None if kind == "bare" else fastdiag.attach(model, every=1, keep_records=False)
                    try:
                        for _ in range(2):
                            model(input_ids=ids, labels=ids)
                        gc.collect()
                        for _ in range(5):
                            calls.clear()
                            t0 = clock()
                            model(input_ids=ids, labels=ids)
                            t1 = clock()
                            for args in calls:
                                launch(*args)
                            times[kind].append((t1 - t0, clock() - t1))
                    finally:
                        if monitor is not None:
                            monitor.detach()
    finally:
        native._launch = launch
    result = {k: tuple(statistics.median(t[i] for t in v) * 1e3 for i in (0, 1)) for k, v in times.items()}
    print(f"a measured forward's parts (HF GPT-2 4 layers d 256 T 256 batch 4, no grad, {threads} thread(s), "
          f"{'CPU time' if cpu_time else 'wall clock'}, {rounds} rounds of 5, load {os.getloadavg()[0]:.1f}): "
          + "; ".join(f"{k} {f:.1f} ms" + (f" + {after:.1f} ms after" if after >= 0.05 else "")
                      for k, (f, after) in result.items()), flush=True)
    return result


def unmeasured_cost(rounds: int = 40, steps: int = 50) -> float:
    """Microseconds an attached but unmeasured step adds, in process CPU time: on a tiny GPT-2 with the
    timed model's modules (4 layers, d 16, T 8), whose step is short enough that the hooks' Python shows
    above the noise (a ~0.2 % effect on the timed model drowns in its block-to-block spread). The same
    model alternates bare and attached (every=10**9, its careful step 0 untimed) in paired blocks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # the hooks' cost is Python's: a thread pool on ops this small only adds noise
    model = tiny("gpt2", layers=LAYERS, d=16, heads=4, positions=16)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    added, bare_us = [], []
    for _ in range(rounds):
        block = {}
        for kind in ("bare", "attached"):
            monitor = fastdiag.attach(model, every=10**9, keep_records=False) if kind == "attached" else None
            try:
                for _ in range(3 + (monitor is not None)):
                    step()
                gc.collect()
                gc.disable()
                t0 = time.process_time()
                for _ in range(steps):
                    step()
                block[kind] = (time.process_time() - t0) / steps * 1e6
            finally:
                gc.enable()
                if monitor is not None:
                    monitor.detach()
        added.append(block["attached"] - block["bare"])
        bare_us.append(block["bare"])
    torch.set_num_threads(threads)
    added.sort()
    q1, median, q3 = added[len(added) // 4], statistics.median(added), added[3 * len(added) // 4]
    print(f"attached but unmeasured: +{median:.0f} us per step (paired blocks, quartiles {q1:.0f}..{q3:.0f}; "
          f"tiny GPT-2 with the timed model's {LAYERS} layers of modules, bare {statistics.median(bare_us):.0f} us, "
          f"process CPU time, {rounds} rounds of {steps} steps)", flush=True)
    return median


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", type=int, default=0, metavar="BLOCKS", help="alternated timing blocks (0: none)")
    parser.add_argument("--detail", action="store_true", help="print the aten ops added, by op")
    parser.add_argument("--no-counts", action="store_true")
    parser.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama")
    parser.add_argument("--no-syncs", action="store_true", help="skip the host-sync count")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for --time (default 2)")
    parser.add_argument("--cpu-time", action="store_true", help="time --time blocks in process CPU time")
    parser.add_argument("--copies", action="store_true",
                        help="--time with a copy of the model per kind (the earlier method), not one model")
    parser.add_argument("--parts", type=int, default=0, metavar="ROUNDS",
                        help="a measured forward's parts: bare, with statistics, their kernel moved after it")
    args = parser.parse_args(argv)
    if args.time < 0:
        parser.error("--time: expected a non-negative number of blocks")
    if args.threads < 1:
        parser.error("--threads: expected a positive number of threads")
    print(f"load {os.getloadavg()[0]:.1f}; {fastdiag.__file__}", flush=True)
    families = [f for f in args.models.split(",") if f]
    if any(f not in ("gpt2", "llama") for f in families):
        parser.error(f"--models: expected gpt2 and/or llama, got {args.models!r}")
    if not args.no_counts:
        counts(args.detail, families, syncs=not args.no_syncs)
    if args.parts:
        parts(args.parts, threads=args.threads, cpu_time=args.cpu_time)
    if args.time:
        result = timings(args.time, threads=args.threads, cpu_time=args.cpu_time, copies=args.copies)
        added_us = unmeasured_cost()
        print(f"  = {added_us / (result['bare_ms'] * 1e3) * 100:.2f} % of the timed bare step "
              f"({result['bare_ms']:.0f} ms): attached-but-unmeasured x{1 + added_us / (result['bare_ms'] * 1e3):.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
