"""The measuring stages of benchmarks/gpu_check.sh, one per call, each appending JSON lines to
``$OUT/results.jsonl`` as it goes (flushed per line: a stage cut off by its timeout keeps what it
finished).

    python benchmarks/gpu_stages.py STAGE [STAGE ...] [--dry-run]     STAGE: kernels | accuracy | attach | int64 | ...

gpu_check.sh runs each stage in a process of its own on a GPU (its own timeout; a fault ends one
stage), and all of them in one process in a dry run (each Python start-up costs seconds of CPU in CI).

On a GPU: model-size shapes, CUDA events, medians. ``--dry-run`` runs the same code on CPU with tiny
shapes (kernels under TRITON_INTERPRET=1), so CI proves the script works before a GPU sees it; its
numbers mean nothing. Every line says which mode made it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import fastdiag
from fastdiag.qk import qk_head_stats
from fastdiag.testing import NanoGPT, random_probs

OUT = os.environ.get("OUT", ".")


def emit(stage: str, dry_run: bool, **fields) -> None:
    line = json.dumps({"stage": stage, "dry_run": dry_run, **fields}, default=str)
    print(line, flush=True)
    with open(os.path.join(OUT, "results.jsonl"), "a") as f:
        f.write(line + "\n")
        f.flush()


def median_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def graph_ms(fn, device: torch.device, repeats: int) -> float | None:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph: the GPU's own time, without the
    launcher's host work (Python, argument checks, kernel launches). None off CUDA."""
    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                    # warm-up on a side stream, as the CUDA-graph docs do
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, device, repeats)


def profile_top(fn, device: torch.device, rows: int = 8) -> list[dict]:
    """The GPU kernels one ``fn()`` call launches, by device time (torch.profiler), and its host time."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.device_time_total)
    return [{"name": e.key[:60], "count": e.count, "device_us": round(e.device_time_total, 1)} for e in events[:rows]]


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---- stages -----------------------------------------------------------------------------------

def stage_kernels(dev: torch.device, dry: bool) -> None:
    """head_stats against a device copy and a read-only pass of the same bytes; Q/K pass 1 + 2 against
    the SDPA flash forward of the same Q, K, V."""
    from fastdiag.core.kernels.head_stats_triton import head_stats_triton
    from fastdiag.core.kernels.qk_stats_triton import qk_stats_triton

    repeats = 1 if dry else 20
    shapes = {"tiny": (1, 1, 4, 32, 32)} if dry else {"gpt2-small": (1, 8, 12, 1024, 1024),
                                                      "long-context": (1, 1, 16, 4096, 4096)}
    for name, dims in shapes.items():
        for dtype in (torch.bfloat16, torch.float32) if not dry else (torch.float32,):
            probs = random_probs(dims, dtype=dtype, seed=0, device=dev)
            out = torch.empty_like(probs)
            kernel = median_ms(lambda: head_stats_triton(probs), dev, repeats)
            graphed = graph_ms(lambda: head_stats_triton(probs), dev, repeats)
            copy = median_ms(lambda: out.copy_(probs), dev, repeats)
            read = median_ms(lambda: probs.sum(dtype=torch.float32), dev, repeats)
            emit("kernels", dry, kernel="head_stats", shape=name, dims=dims, dtype=str(dtype), kernel_ms=kernel,
                 graph_ms=graphed, copy_ms=copy, read_only_ms=read, pct_of_copy=100 * copy / kernel,
                 pct_of_copy_graph=graphed and 100 * copy / graphed, pct_of_read=100 * read / kernel,
                 profile=profile_top(lambda: head_stats_triton(probs), dev),
                 note="kernel_ms: launcher called from Python (host work included); graph_ms: the same "
                      "replayed from a CUDA graph (GPU time); pct = copy time / that time")
            del probs, out
    qk_shapes = {"tiny": (1, 2, 32, 16)} if dry else {"gpt2-small": (8, 12, 1024, 64),
                                                      "long-context": (1, 16, 4096, 128)}
    for name, (b, h, t, d) in qk_shapes.items():
        dtype = torch.float32 if dry else torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(b, h, t, d, device=dev, dtype=dtype, generator=g) for _ in range(3))
        stats = median_ms(lambda: qk_stats_triton(q, k, None, True, d ** -0.5), dev, repeats)
        stats_graph = graph_ms(lambda: qk_stats_triton(q, k, None, True, d ** -0.5), dev, repeats)
        top = profile_top(lambda: qk_stats_triton(q, k, None, True, d ** -0.5), dev)
        if dev.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                flash = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dev, repeats)
        else:
            flash = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dev, repeats)
        emit("kernels", dry, kernel="qk pass 1 + 2", shape=name, dims=(b, h, t, d), dtype=str(dtype),
             qk_ms=stats, qk_graph_ms=stats_graph, sdpa_flash_ms=flash, ratio_to_flash=stats / flash,
             profile=top)
        # fp32: pass 1 in Triton, pass 2 on cuBLAS in full fp32 (no Triton tile fits; benchmarks/RESULTS.md)
        qf, kf, vf = q.float(), k.float(), v.float()
        fp32 = median_ms(lambda: qk_stats_triton(qf, kf, None, True, d ** -0.5), dev, repeats)
        flash32 = median_ms(lambda: F.scaled_dot_product_attention(qf, kf, vf, is_causal=True), dev, repeats)
        emit("kernels", dry, kernel="qk fp32", shape=name, dims=(b, h, t, d), qk_ms=fp32, sdpa_fp32_ms=flash32,
             ratio_to_sdpa=fp32 / flash32, note="pass 1 Triton, pass 2 chunked cuBLAS (TF32 off)")
        del q, k, v, qf, kf, vf


def stage_accuracy(dev: torch.device, dry: bool) -> None:
    """bf16 and fp32 at model size against float64 (relative errors; targets 1e-5 fp32, 1e-3 bf16)."""
    # T = 1024 and 4096: the Gram's fp32 chains grow with the keys a row tile streams
    for dims in [(1, 1, 4, 32, 32)] if dry else [(1, 2, 12, 1024, 1024), (1, 1, 16, 4096, 4096)]:
        for dtype in (torch.float32,) if dry else (torch.float32, torch.bfloat16):
            probs = random_probs(dims, dtype=dtype, seed=1, device=dev)
            got = fastdiag.head_stats(probs, backend="triton", causal=False)
            ref = fastdiag.head_stats(probs.double(), backend="reference")     # float64 on the same device
            emit("accuracy", dry, kernel="head_stats", dims=dims, dtype=str(dtype), gram=_rel(got.gram, ref.gram),
                 entropy=_rel(got.entropy_sum, ref.entropy_sum),
                 sigma_h=_rel(got.entropy_spread(), ref.entropy_spread()), s_bar=_rel(got.sync(), ref.sync()))
            del probs
    b, h, t, d = (1, 2, 32, 16) if dry else (2, 12, 1024, 64)
    for dtype in (torch.float32,) if dry else (torch.float32, torch.bfloat16):
        g = torch.Generator(device=dev).manual_seed(2)
        q, k = (torch.randn(b, h, t, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
        got = qk_head_stats(q, k, is_causal=True, backend="triton")
        ref = qk_head_stats(q.cpu(), k.cpu(), is_causal=True, backend="reference")
        emit("accuracy", dry, kernel="qk", dims=(b, h, t, d), dtype=str(dtype), gram=_rel(got.gram, ref.gram),
             entropy=_rel(got.entropy_sum, ref.entropy_sum), sigma_h=_rel(got.entropy_spread(), ref.entropy_spread()))


def _models(dev: torch.device, dry: bool):
    """(name, model, loss of a callable model, autocast dtype or None): HF GPT-2-small under bf16 autocast as such models
    train, the zoo's nanoGPT under bf16 autocast and in plain fp32 (Q/K pass 2 on cuBLAS there)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=64) if dry else {}
    hf = GPT2LMHeadModel(GPT2Config(**size, attn_implementation="sdpa")).to(dev)
    tokens = torch.randint(0, hf.config.vocab_size, (1 if dry else 8, 32 if dry else 1024), device=dev)
    yield "hf-gpt2-small-sdpa", hf, lambda m: m(tokens, labels=tokens).loss, torch.bfloat16
    zoo = NanoGPT(vocab=64, d_model=32 if dry else 128, n_heads=2 if dry else 4, n_layers=1 if dry else 2,
                  seq_len=16 if dry else 128).to(dev)
    x = torch.randint(0, 64, (2 if dry else 512, 16 if dry else 128), device=dev)
    for dtype in (torch.bfloat16, None):
        yield "nanogpt-sdpa", zoo, lambda m: m(x).float().square().mean(), dtype


def stage_attach(dev: torch.device, dry: bool) -> None:
    """attach overhead in a real training step: blocks alternate bare / every=10 / every=1, medians."""
    blocks, per_block = (1, 1) if dry else (7, 10)
    for name, model, loss_fn, dtype in _models(dev, dry):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        on = dev.type == "cuda" and dtype is not None
        autocast = torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=on)

        def steps(n):
            for _ in range(n):
                with autocast:
                    loss = loss_fn(model)
                loss.backward()
                opt.step()
                opt.zero_grad()
            if dev.type == "cuda":
                torch.cuda.synchronize()

        steps(1 if dry else 2)
        times = alternated_attach_blocks(model, steps, blocks, per_block)
        base = statistics.median(times[0])
        with fastdiag.attach(model, every=1):
            steps(2)                                  # the careful pass, then a lean one
            idle = gpu_idle_fraction(lambda: steps(1), dev)
        graphed = {every: graphed_step_ms(model, loss_fn, autocast, dev, every, 3 if dry else 20)
                   for every in (0, 1)}
        compiled = compiled_ratios(model, loss_fn, autocast, dev, dry) if name != "nanogpt-sdpa" or on else {}
        emit("attach", dry, model=name, autocast=str(dtype).replace("torch.", "") if on else "none",
             step_ms=1e3 * base, every10_ratio=statistics.median(times[10]) / base,
             every1_ratio=statistics.median(times[1]) / base, blocks=blocks, steps_per_block=per_block,
             gpu_idle_every1=idle, graphed_step_ms=graphed[0],
             graphed_every1_ratio=None if graphed[0] is None or graphed[1] is None else graphed[1] / graphed[0],
             **compiled)


def alternated_attach_blocks(model, steps, blocks: int, per_block: int) -> dict[int, list[float]]:
    """Seconds per step of ``steps(n)`` in blocks alternating bare (0) / every=10 / every=1."""
    times = {0: [], 10: [], 1: []}
    for _ in range(blocks):
        for every in (0, 10, 1):
            monitor = fastdiag.attach(model, every=every) if every else None
            t0 = time.perf_counter()
            steps(per_block)
            times[every].append((time.perf_counter() - t0) / per_block)
            if monitor is not None:
                monitor.detach()
    return times


def gpu_idle_fraction(step, dev: torch.device) -> float | None:
    """The fraction of one ``step()``'s wall time in which no kernel runs on the GPU (torch.profiler:
    the union of the device's kernel intervals against the step's span). None off CUDA."""
    if dev.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for start, stop in kernels:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return max(0.0, 1.0 - busy / wall_us) if wall_us > 0 else None


def graphed_step_ms(model, loss_fn, autocast, dev: torch.device, every: int, repeats: int) -> float | None:
    """Median ms of a whole training step (forward, loss, backward) captured in one CUDA graph and
    replayed, bare (``every`` 0) or measured on every replay (``every`` 1: attached before the warm-up,
    so the captured pass is a lean measured one; the statistics are rewritten in place on each replay)."""
    if dev.type != "cuda":
        return None
    monitor = fastdiag.attach(model, every=1, keep_records=False) if every else None
    try:
        def step():
            with autocast:
                loss = loss_fn(model)
            loss.backward()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream().wait_stream(side)
        model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return median_ms(graph.replay, dev, repeats)
    finally:
        if monitor is not None:
            monitor.detach()
        model.zero_grad(set_to_none=True)


def compiled_ratios(model, loss_fn, autocast, dev: torch.device, dry: bool) -> dict:
    """The model under torch.compile(mode="reduce-overhead") (CUDA graphs): step ms bare, and every=1 /
    every=10 as ratios to it (alternated blocks after the compile warm-up)."""
    if dev.type != "cuda":
        return {}
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    blocks, per_block = (1, 2) if dry else (5, 10)

    def steps(n):
        for _ in range(n):
            with autocast:
                loss = loss_fn(compiled)
            loss.backward()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    alternated_attach_blocks(model, steps, 1, 4)    # warm-up: both graphs (measured, not) compiled and recorded
    times = alternated_attach_blocks(model, steps, blocks, per_block)
    base = statistics.median(times[0])
    torch._dynamo.reset()
    return {"reduce_overhead_step_ms": 1e3 * base,
            "reduce_overhead_every10_ratio": statistics.median(times[10]) / base,
            "reduce_overhead_every1_ratio": statistics.median(times[1]) / base}


def stage_int64(dev: torch.device, dry: bool) -> None:
    """A tensor whose (H − 1) · Tq · Tk passes 2³¹: the last head's Gram entries against the same
    heads copied out alone (a wrapped 32-bit offset reads other memory). Last: it may fault."""
    h, t = (4, 32) if dry else (40, 8192)
    dtype = torch.float32 if dry else torch.bfloat16
    # made on the device a head at a time (random_probs builds float64 on the host: 21 GB here)
    probs = torch.empty(1, 1, h, t, t, dtype=dtype, device=dev)
    g = torch.Generator(device=dev).manual_seed(3)
    for head in range(h):
        logits = torch.randn(t, t, device=dev, generator=g) * (0.3 + 2.7 * head / max(1, h - 1))
        probs[0, 0, head] = logits.softmax(-1).to(dtype)
    del logits
    full = fastdiag.head_stats(probs, backend="triton")
    pair = fastdiag.head_stats(probs[:, :, [0, h - 1]].contiguous(), backend="triton")
    emit("int64", dry, dims=tuple(probs.shape), elements=probs.numel(), past_2_31=probs.numel() >= 2 ** 31,
         last_head_gram_rel=_rel(full.gram[..., [0, h - 1], :][..., [0, h - 1]], pair.gram),
         last_head_entropy_rel=_rel(full.entropy_sum[..., [0, h - 1]], pair.entropy_sum))


def _measured_module(name: str):
    """A launcher as the H200 measured it (benchmarks/measured/<name>.py, commit 0c79385)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from predict_measured import measured_module

    return measured_module(name)


def _measured_head_stats():
    """Commit 0c79385's head_stats launcher, the one the H200 measured (benchmarks/measured/)."""
    return _measured_module("head_stats_0c79385")


def stage_tune(dev: torch.device, dry: bool) -> None:
    """head_stats' tiles (`stage_tune_head_stats`), then Q/K pass 2's launches (`stage_tune_qk`)."""
    stage_tune_qk(dev, dry)
    stage_tune_head_stats(dev, dry)


def stage_tune_head_stats(dev: torch.device, dry: bool) -> None:
    """head_stats' launches on this GPU: CUDA-graph time of the launcher per (slab elements per warp,
    keys per step, Gram tiles per warp, pipeline stages), bf16 and fp32, against the same device copy,
    beside commit 0c79385's launcher (the one measured before, ``launcher: 0c79385``). The launcher's
    constants are set for each row and restored after; the first row is today's default, the second
    the same tiles pipelined as before (3 stages: an unswizzled buffer read with 8-way bank conflicts,
    predicted 3x slower). Rows alternate old and new so clock drift does not favour either."""
    from fastdiag.core.kernels import head_stats_triton as hs

    repeats = 1 if dry else 20
    shapes = {"tiny": (1, 1, 4, 32, 32)} if dry else {"gpt2-small": (1, 8, 12, 1024, 1024),
                                                      "long-context": (1, 1, 16, 4096, 4096),
                                                      "llama-7b": (1, 1, 32, 4096, 4096)}
    default = (hs._SLAB_PER_WARP, hs._MAX_BLOCK_K, hs._GRAM_TILES_PER_WARP, hs.NUM_STAGES)
    configs = [default] if dry else [default, default[:3] + (3,), (2048, 64, 2, 1), (512, 64, 2, 1),
                                     (1024, 128, 2, 1), (1024, 64, 1, 1), (1024, 64, 2, 2)]
    old = _measured_head_stats()
    dtypes = (torch.float32,) if dry else (torch.bfloat16, torch.float32)
    try:
        for name, dims in shapes.items():
            for dtype in dtypes:
                probs = random_probs(dims, dtype=dtype, seed=0, device=dev)
                out = torch.empty_like(probs)
                copy = median_ms(lambda: out.copy_(probs), dev, repeats)
                for slab, block_k, tiles_per_warp, stages in configs:
                    hs._SLAB_PER_WARP, hs._MAX_BLOCK_K, hs._GRAM_TILES_PER_WARP, hs.NUM_STAGES = (
                        slab, block_k, tiles_per_warp, stages)
                    block_h, block_r, bk, warps = hs._tiles(dims[2], dims[1] * dims[3], dims[4], probs.element_size(),
                                                            False)
                    row = dict(shape=name, dtype=str(dtype), slab_per_warp=slab, block_k=bk, block_r=block_r,
                               warps=warps, num_stages=stages, launcher="now")
                    for launcher, run in (("0c79385", lambda: old.head_stats_triton(probs)),
                                          ("now", lambda: hs.head_stats_triton(probs))):
                        if launcher == "0c79385" and (slab, block_k, tiles_per_warp, stages) != default:
                            continue       # the old launcher once per shape and dtype, beside the default
                        fields = dict(row, launcher=launcher) if launcher == "now" else dict(
                            shape=name, dtype=str(dtype), launcher=launcher)
                        try:
                            t = graph_ms(run, dev, repeats) or median_ms(run, dev, repeats)
                            emit("tune", dry, **fields, graph_ms=t, copy_ms=copy, pct_of_copy=100 * copy / t)
                        except Exception as e:   # a configuration that does not compile or launch: say so, go on
                            emit("tune", dry, **fields, failed=f"{type(e).__name__}: {e}"[:200])
                del probs, out
    finally:
        hs._SLAB_PER_WARP, hs._MAX_BLOCK_K, hs._GRAM_TILES_PER_WARP, hs.NUM_STAGES = default


def _qk_pass2_launches(q, k, lse, d):
    """(name, launch) of every Q/K pass 2 a device may run at q's shape, the LSE given: the per-head
    kernel (`qk_heads_triton`, where it applies and compiles without spilling) and each of its plans
    that fits the device forced, the batched one with the launcher's first tiles, commit 0c79385's
    launcher (measured on the H200), materialised P (two chunk sizes), and what the launcher picks by itself."""
    from fastdiag.core.kernels import qk_stats_triton as qk

    scale = d ** -0.5
    limits = qk.device_limits(q.device)
    tiles = qk.pass2_configs(q.shape[1], k.shape[1], d, q.dtype, limits and limits["shared_bytes"])
    old = _measured_module("qk_stats_0c79385")
    launches = [("chosen", lambda: qk.qk_stats_triton(q, k, None, True, scale, lse=lse)),
                ("0c79385", lambda: old.qk_stats_triton(q, k, None, True, scale, lse=lse))]
    if qk._heads_stats(q, k, None, True, scale, None, lse, limits) is not None:
        launches.append(("per-head", lambda: qk._heads_stats(q, k, None, True, scale, None, lse, limits)))
    cfg = qk.heads_config(q.shape[1], k.shape[1], d, q.dtype.itemsize)
    # each plan of `heads_plans` that fits this device's shared memory forced (one launch; the Gram, then
    # the row sums; 8 warps; 32 rows; the head pairs at > 16 heads or head dim > 64), spilled or not
    plans = [] if cfg is None else qk.heads_plans(cfg)
    for plan, launches_of_plan in enumerate(plans):
        if limits is None or all(qk.heads_shared_bytes(x, q.dtype.itemsize) <= limits["shared_bytes"]
                                 for x in launches_of_plan):
            name = "per-head pairs" if launches_of_plan[0].get("PAIR_HEADS") else "per-head plan"
            launches.append((f"{name} {plan}",
                             lambda plan=plan: qk._heads_stats(q, k, None, True, scale, None, lse, limits, plan)))
    if tiles:
        launches.append(("batched", lambda: qk.qk_stats_triton(q, k, None, True, scale, lse=lse, tiles=tiles[0])))
    # pass 2 through materialised 16-bit P (`qk_probs_triton`; a dry run's float32 inputs as float16): its
    # 64 MiB chunks (the default), 256 MB ones (fewer launches) and 32 MB ones (within an H200's 50 MB L2: P
    # may be read back before it reaches DRAM)
    q16, k16 = (x if x.dtype != torch.float32 else x.half() for x in (q, k))
    launches += [(f"materialised P{label}", lambda budget=budget: qk._probs_stats(q16, k16, None, True, scale, None,
                                                                                  lse, budget))
                 for label, budget in (("", qk.PROBS_BUFFER_BYTES), (" 256 MB chunks", 256 << 20),
                                       (" 32 MB chunks", 32 << 20))]
    return launches


def stage_tune_qk(dev: torch.device, dry: bool) -> None:
    """Q/K pass 2 (bf16 causal, the LSE given) on this GPU: each launch of `_qk_pass2_launches` as a
    CUDA graph, beside the SDPA forward of the same Q, K (and V = K) — issue 38's target is pass 2 at
    ≤ 1.0x that forward — in alternated rounds so clock drift favours none."""
    import torch.nn.functional as F

    from fastdiag.core.kernels.qk_stats_triton import row_lse_triton

    repeats, rounds = (1, 1) if dry else (20, 3)
    shapes = {"tiny": (1, 2, 32, 16)} if dry else {"gpt2-small": (8, 12, 1024, 64), "llama-4k": (1, 32, 4096, 128)}
    dtype = torch.float32 if dry else torch.bfloat16
    for name, (b, h, t, d) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(3)
        q, k = (torch.randn(b, h, t, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
        lse = row_lse_triton(q, k, None, True, d ** -0.5)
        launches = [("sdpa forward", lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True))]
        launches += _qk_pass2_launches(q, k, lse, d)
        times: dict[str, list] = {}
        for _ in range(rounds):
            for launcher, run in launches:
                try:
                    times.setdefault(launcher, []).append(graph_ms(run, dev, repeats) or median_ms(run, dev, repeats))
                except Exception as e:   # a launch that does not compile or run: say so, go on
                    times[launcher] = f"{type(e).__name__}: {e}"[:200]
        sdpa = times["sdpa forward"]
        for launcher, ts in times.items():
            if isinstance(ts, str):
                emit("tune", dry, kernel="qk pass 2", shape=name, launcher=launcher, failed=ts)
                continue
            ms = sorted(ts)[len(ts) // 2]
            emit("tune", dry, kernel="qk pass 2", shape=name, dims=[b, h, t, d], launcher=launcher, graph_ms=ms,
                 rounds=ts, vs_sdpa=ms / sorted(sdpa)[len(sdpa) // 2] if not isinstance(sdpa, str) else None)


def stage_probe(dev: torch.device, dry: bool) -> None:
    """What SDPA backend this GPU picks for plain bf16 calls, and whether cuDNN attention's LSE could
    stand in for pass 1 (shape, natural log, agreement with `row_lse_triton`)."""
    from fastdiag.core.kernels.qk_stats_triton import row_lse_triton

    if dev.type != "cuda":
        emit("probe", dry, skipped="no CUDA device")
        return
    from torch.nn.attention import SDPBackend

    for causal in (False, True):
        g = torch.Generator(device=dev).manual_seed(5)
        q, k, v = (torch.randn(2, 12, 256, 64, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
        choice = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=None, enable_gqa=False))
        fields = dict(causal=causal, choice=choice.name)
        try:
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
            out, lse = res[0], res[1]
            ours = row_lse_triton(q, k, None, causal, 64 ** -0.5)
            fields.update(lse_shape=tuple(lse.shape), lse_dtype=str(lse.dtype),
                          out_equal_sdpa=bool(torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal))),
                          lse_max_abs_diff=(lse.reshape(ours.shape).float() - ours).abs().max().item())
        except Exception as e:
            fields.update(failed=f"{type(e).__name__}: {e}"[:300])
        emit("probe", dry, **fields)


def stage_ncu(dev: torch.device, dry: bool) -> None:
    """One launch of each fused kernel at GPT-2-small bf16, for `ncu` to profile (gpu_check.sh's ncu
    stage): today's head_stats, then commit 0c79385's (the launch measured before, whose shared-memory
    wavefronts per ldmatrix the kernel report predicts at 8 per matrix), then Q/K pass 1 and each pass 2
    kernel the LSE given (per-head where it applies, batched, 0c79385's)."""
    from fastdiag.core.kernels.head_stats_triton import head_stats_triton
    from fastdiag.core.kernels.qk_stats_triton import row_lse_triton

    dims = (1, 1, 4, 32, 32) if dry else (1, 8, 12, 1024, 1024)
    probs = random_probs(dims, dtype=torch.float32 if dry else torch.bfloat16, seed=0, device=dev)
    head_stats_triton(probs)
    _measured_head_stats().head_stats_triton(probs)
    b, h, t, d = (1, 2, 32, 16) if dry else (8, 12, 1024, 64)
    q, k = (torch.randn(b, h, t, d, device=dev, dtype=torch.float32 if dry else torch.bfloat16) for _ in range(2))
    lse = row_lse_triton(q, k, None, True, d ** -0.5)
    launched = ["_head_stats_kernel (now)", "_head_stats_kernel (0c79385)", "_qk_lse_kernel"]
    for name, run in _qk_pass2_launches(q, k, lse, d):
        if name not in ("chosen", "per-head") and "chunks" not in name:   # each pass 2 kernel once
            run()
            launched.append(f"pass 2 {name}")
    emit("ncu", dry, launched=launched)


STAGES = {"kernels": stage_kernels, "accuracy": stage_accuracy, "attach": stage_attach, "int64": stage_int64,
          "tune": stage_tune, "probe": stage_probe, "ncu": stage_ncu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", nargs="+", choices=sorted(STAGES), help="run in turn; one failing does not stop the next")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, kernels interpreted")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_stages: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_stages: --dry-run needs TRITON_INTERPRET=1 (gpu_check.sh --dry-run sets it)", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.dry_run else "cuda")
    failed = 0
    for stage in args.stage:
        try:
            STAGES[stage](dev, args.dry_run)
        except Exception as e:
            emit(stage, args.dry_run, error=f"{type(e).__name__}: {e}"[:500],
                 where=traceback.format_exc().strip().splitlines()[-3:])
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
