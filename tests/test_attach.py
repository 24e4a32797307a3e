"""fastdiag.attach: finds attention with no change to the model, measures it exactly, undoes itself.

Every adapter is checked against eager attention written out in tests/helpers.py (probabilities in float64 from the
same q and k) fed to `head_stats(backend="reference")`: fp32 relative error ≤ 1e-5.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdiag
from fastdiag.qk import qk_head_stats
from fastdiag.testing import NanoGPT
from tests.helpers import StandInZooAttention, TwoLayers, assert_stats_close, reference_stats
from tests.helpers import nano as _nano

ORIGINAL_SDPA = F.scaled_dot_product_attention


# ---- a module that calls SDPA (nanoGPT style) and keeps what it passed -------------------------

def _padding_mask(b, t, bool_mask):
    keep = torch.ones(b, 1, t, t, dtype=torch.bool)
    keep[0, ..., t - 3:] = False          # batch 0: the last 3 keys are padding
    keep[1, ..., 2, :] = False            # batch 1: query row 2 sees nothing (left out)
    if bool_mask:
        return keep
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.3 * torch.randn(keep.shape)


SDPA_CASES = {
    "plain": (dict(), None),
    "causal": (dict(is_causal=True), None),
    "scale": (dict(is_causal=True, scale=0.37), None),
    "bool-mask": (dict(), "bool"),
    "additive-mask": (dict(), "float"),
    "gqa": (dict(is_causal=True, enable_gqa=True), None),
    "gqa-mask": (dict(enable_gqa=True), "bool"),
}


@pytest.mark.parametrize("chunk_bytes", [64 * 2**20, 1], ids=["whole", "row-chunks"])
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_adapter_matches_eager_attention(case, chunk_bytes):
    sdpa_kwargs, mask_kind = SDPA_CASES[case]
    kv_heads = 2 if "gqa" in case else 4
    torch.manual_seed(0)
    model = TwoLayers(kv_heads=kv_heads, **sdpa_kwargs)
    x = torch.randn(2, 9, 16)
    mask = None if mask_kind is None else _padding_mask(2, 9, mask_kind == "bool")
    want_out = model(x, mask)
    want_out.square().sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    with fastdiag.attach(model, every=1, chunk_bytes=chunk_bytes) as monitor:
        out = model(x, mask)
        out.square().sum().backward()
        stats = monitor.latest_stats()
    assert torch.equal(out, want_out)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grads))
    assert set(stats) == {"layers.0", "layers.1"}
    for name, layer in zip(("layers.0", "layers.1"), model.layers):
        q, k = layer.last
        kw = {key: v for key, v in sdpa_kwargs.items() if key in ("is_causal", "scale")}
        assert_stats_close(stats[name], reference_stats(q, k, attn_mask=mask, **kw))


def test_chunks_add_exactly():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 4, 17, 8, generator=g), torch.randn(3, 4, 11, 8, generator=g)
    whole = qk_head_stats(q, k, is_causal=True)
    for chunk_bytes in (1, 3 * 4 * 11 * 4 * 5):  # one row, five rows per chunk
        parts = qk_head_stats(q, k, is_causal=True, chunk_bytes=chunk_bytes)
        torch.testing.assert_close(parts.gram, whole.gram, rtol=1e-6, atol=0)
        torch.testing.assert_close(parts.entropy_sum, whole.entropy_sum, rtol=1e-6, atol=0)
    assert_stats_close(whole, reference_stats(q, k, is_causal=True))


def test_non_finite_attention_is_reported_not_hidden():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    q[0, 1, 2, 0] = float("nan")
    stats = qk_head_stats(q, k, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    assert not stats.valid().item() and torch.isnan(stats.sync()).item()


def test_a_layer_whose_statistics_come_out_invalid_is_named():
    """Statistics that are invalid (NaN: here a non-finite score in layer 1 only; on a GPU also sharp rows
    float32 cannot hold to the target, `row_entropy_triton`) are named at the next host read, once, with
    the module's name; the other layer's are not, and a step with none warns nothing."""
    import warnings

    torch.manual_seed(0)
    model = TwoLayers()
    x = torch.randn(2, 9, 16)
    with fastdiag.attach(model, every=1) as monitor:
        model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            monitor.latest()
        with torch.no_grad():
            model.layers[1].q.weight[0, 0] = float("inf")       # a query of layer 1 becomes non-finite
        model(x)
        with pytest.warns(RuntimeWarning, match=r"layer 'layers\.1' \(SDPALayer\): its statistics are NaN"):
            record = monitor.latest()
        assert record["spread/layers.1"] != record["spread/layers.1"] and record["spread/layers.0"] > 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            monitor.history()                                   # named once


# ---- steps, modes, selection, scope ---------------------------------------------------------

def test_every_counts_training_passes_only():
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    monitor = fastdiag.attach(model, every=3)
    for _ in range(7):
        model(x)
    model.eval()
    with torch.no_grad():
        model(x)  # eval passes neither count nor are measured
    model.train()
    assert monitor.step == 7
    assert [r["step"] for r in monitor.history()] == [0, 3, 6]
    latest = monitor.latest()
    assert set(latest) == {"step", "mode", "s_bar", "sigma_h", "sync/blocks.0", "sync/blocks.1",
                           "spread/blocks.0", "spread/blocks.1"}
    assert latest["s_bar"] == pytest.approx((latest["sync/blocks.0"] + latest["sync/blocks.1"]) / 2)
    assert latest["sigma_h"] == pytest.approx((latest["spread/blocks.0"] + latest["spread/blocks.1"]) / 2)
    monitor.detach()


def test_measure_eval_records_eval_passes_at_the_current_step():
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    with fastdiag.attach(model, every=2, measure_eval=True) as monitor:
        model(x)
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
        model(x)
    assert [(r["step"], r["mode"]) for r in monitor.history()] == [(0, "train"), (1, "eval")]
    assert monitor.step == 2
    assert monitor.latest(mode="train")["step"] == 0


def test_layers_selects_by_name_or_predicate():
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    with fastdiag.attach(model, every=1, layers=["blocks.1"]) as monitor:
        model(x)
    assert set(monitor.latest_stats()) == {"blocks.1"}
    with fastdiag.attach(model, every=1, layers=lambda name: name.endswith("0")) as monitor:
        model(x)
    assert set(monitor.latest_stats()) == {"blocks.0"}
    with pytest.raises(ValueError, match="no module named 'blocks.7'"):
        fastdiag.attach(model, layers=["blocks.7"])


def test_other_models_calling_sdpa_are_not_measured():
    model, other = _nano(0), _nano(1)
    x = torch.randint(0, 32, (2, 8))
    with fastdiag.attach(model, every=1) as monitor:
        other(x)
        assert monitor.num_records == 0 and monitor.step == 0
        model(x)
        other(x)
        alone = monitor.latest()
    with fastdiag.attach(model, every=1) as fresh:
        model(x)
        assert fresh.latest() == alone


def test_detach_restores_the_model_exactly():
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = model(x)
    before = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m.__dict__))
              for name, m in model.named_modules()}
    monitor = fastdiag.attach(model, every=1)
    model(x)
    monitor.detach()
    monitor.detach()  # idempotent
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA  # never replaced: a mode sees the calls
    assert torch.overrides._get_current_function_mode_stack() == []
    after = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m.__dict__))
             for name, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name][0] == before[name][0] and after[name][1] == before[name][1]
        assert after[name][2].keys() == before[name][2].keys()
    assert not any(m._forward_hooks_always_called or m._forward_hooks_with_kwargs
                   or m._forward_pre_hooks_with_kwargs for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(model(x), want)
    fastdiag.attach(model).detach()  # may attach again


def test_attach_twice_or_to_a_model_without_attention_is_refused():
    model = _nano()
    with fastdiag.attach(model):
        with pytest.raises(ValueError, match="already attached"):
            fastdiag.attach(model)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError) as err:
        fastdiag.attach(mlp)
    for searched in ("records_head_stats", "MultiheadAttention", "named like attention",
                     "scaled_dot_product_attention", "softmax over [B, H, Tq, Tk]"):
        assert searched in str(err.value)
    for bad in (dict(every=0), dict(backend="cuda"), dict(flush_every=0)):
        with pytest.raises(ValueError):
            fastdiag.attach(model, **bad)
    with pytest.raises(TypeError):
        fastdiag.attach(model, log=42)


def test_measured_steps_do_not_sync_with_the_host(monkeypatch):
    """No .item()/.tolist()/bool(tensor)/float(tensor) while training (the CPU stand-in for
    torch.cuda.set_sync_debug_mode("error")); reading the results afterwards may sync."""
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    logged = []
    monitor = fastdiag.attach(model, every=1, log=lambda step, values: logged.append(step), flush_every=100)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync inside a training step")

    with monkeypatch.context() as patch:
        for method in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
            patch.setattr(torch.Tensor, method, refuse)
        for _ in range(3):
            model(x).square().mean().backward()
    assert logged == []
    assert len(monitor.history()) == 3
    monitor.detach()
    assert logged == [0, 1, 2]


# ---- loggers --------------------------------------------------------------------------------

def test_callable_logger_is_flushed_every_k_records_and_on_detach():
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    calls = []
    monitor = fastdiag.attach(model, every=2, log=lambda step, values: calls.append((step, values)), flush_every=2)
    model(x)
    model(x)
    assert calls == []            # one record (step 0): nothing sent yet
    model(x)                      # step 2: the second record reaches flush_every=2
    assert [step for step, _ in calls] == [0, 2]
    model(x)
    model(x)                      # step 4: a third record, kept until the next flush
    assert [step for step, _ in calls] == [0, 2]
    step, values = calls[0]
    assert set(values) == {"fastdiag/s_bar", "fastdiag/sigma_h", "fastdiag/sync/blocks.0",
                           "fastdiag/sync/blocks.1", "fastdiag/spread/blocks.0", "fastdiag/spread/blocks.1"}
    assert all(isinstance(v, float) for v in values.values())
    monitor.detach()
    assert [step for step, _ in calls] == [0, 2, 4]


def test_tensorboard_summary_writer(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    writer = SummaryWriter(str(tmp_path))
    with fastdiag.attach(model, every=2, log=writer) as monitor:
        for _ in range(4):
            model(x)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"fastdiag/s_bar", "fastdiag/sigma_h", "fastdiag/sync/blocks.0", "fastdiag/spread/blocks.1"} <= tags
    s_bar = events.Scalars("fastdiag/s_bar")
    assert [e.step for e in s_bar] == [0, 2]
    assert s_bar[-1].value == pytest.approx(monitor.latest()["s_bar"], rel=1e-6)


# ---- fastdiag's own zoo protocol (records_head_stats) ----------------------------------------

def test_zoo_protocol_with_a_stand_in_module():
    torch.manual_seed(0)
    model = nn.Sequential(StandInZooAttention(), StandInZooAttention())
    x = torch.randn(2, 5, 16)
    want = model(x)
    with fastdiag.attach(model, every=2, backend="reference") as monitor:
        assert all(m.diag_backend == "reference" for m in model)
        out = model(x)
        assert not any(m.record for m in model)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        model(x)                       # step 1: not measured, the SDPA path (not counted twice)
        assert monitor.num_records == 1
    stats = monitor.latest_stats()
    assert set(stats) == {"0", "1"}
    for name, m in zip(("0", "1"), model):
        assert_stats_close(stats[name], fastdiag.head_stats(m.probs, backend="reference"))
    assert all(m.record is False and m.stats is None and m.diag_backend == "auto" for m in model)


def _zoo_transformer():
    models = pytest.importorskip("fastdiag.models")
    if not hasattr(models, "attention_modules"):
        pytest.skip("fastdiag.models has no attention_modules yet")
    torch.manual_seed(0)
    return models, models.build("transformer", preset="custom", n_layers=2, n_heads=4, d_model=32,
                                d_ff=64, vocab_size=20, seq_len=6)


def test_zoo_transformer_is_measured_through_its_record_flag():
    models, model = _zoo_transformer()
    x = torch.randint(0, 20, (3, 6))
    want = model(x)
    names = list(models.attention_modules(model))
    # the reference: the layers' own statistics with record set by hand, float64
    for m in models.attention_modules(model).values():
        m.record, m.diag_backend = True, "reference"
    model(x)
    reference = {n: m.stats for n, m in models.attention_modules(model).items()}
    for m in models.attention_modules(model).values():
        m.record, m.stats, m.diag_backend = False, None, "auto"
    with fastdiag.attach(model, every=1) as monitor:
        out = model(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    stats = monitor.latest_stats()
    assert list(stats) == names and list(monitor.coverage()["measured"]) == names
    for name in names:
        assert_stats_close(stats[name], reference[name])
    assert all(m.record is False and m.stats is None for m in models.attention_modules(model).values())


# ---- torch.nn.MultiheadAttention and the nn.Transformer layers ------------------------------

def _mha_reference(mha, query, key, padding=None, **kw):
    """Per-head probabilities from MHA itself (need_weights, no averaging), eval, float64 stats;
    padding: bool [N, T], True = real position (self-attention rows left out, docs/attach.md "Padding")."""
    mha.eval()
    with torch.no_grad():
        _, probs = mha(query, key, key, need_weights=True, average_attn_weights=False, **kw)
    mha.train()
    if probs.dim() == 3:
        probs = probs.unsqueeze(0)
    rows = torch.isfinite(probs).all(-1).all(1)
    if padding is not None:
        rows = rows & padding
    return fastdiag.head_stats(torch.nan_to_num(probs, nan=0.0), rows, backend="reference")


MHA_CASES = ["plain", "need_weights=False", "batch_first", "key_padding_mask", "float-masks",
             "causal", "cross-kdim", "bias_k+zero_attn", "unbatched"]


@pytest.mark.parametrize("case", MHA_CASES)
def test_multihead_attention_matches_its_own_weights(case):
    torch.manual_seed(0)
    e, heads, tq, tk, n = 16, 4, 6, 6, 3
    kwargs = dict(batch_first=case == "batch_first")
    if case == "cross-kdim":
        kwargs.update(kdim=8, vdim=8)
        tk = 7
    if case == "bias_k+zero_attn":
        kwargs.update(add_bias_kv=True, add_zero_attn=True)
    mha = nn.MultiheadAttention(e, heads, **kwargs)
    shape_q = (n, tq, e) if case == "batch_first" else (tq, e) if case == "unbatched" else (tq, n, e)
    query = torch.randn(shape_q)
    key = torch.randn(shape_q if case != "cross-kdim" else (tk, n, 8))
    call = {}
    if case == "key_padding_mask":
        kpm = torch.zeros(n, tk, dtype=torch.bool)
        kpm[0, -2:] = True
        call.update(key_padding_mask=kpm)
    if case == "float-masks":
        call.update(attn_mask=torch.randn(tq, tk), key_padding_mask=torch.randn(n, tk))
    if case == "causal":
        call.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(tq), is_causal=True)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, q, k):
            return self.attn(q, k, k, need_weights=case != "need_weights=False", **call)[0]

    model = Wrap()
    want = model(query, key)
    with fastdiag.attach(model, every=1) as monitor:
        out = model(query, key)
    assert torch.equal(out, want)
    assert list(monitor.latest_stats()) == ["attn"]  # its inner SDPA call is not counted again
    ref_call = {k: v for k, v in call.items() if k != "is_causal"}
    assert_stats_close(monitor.latest_stats()["attn"], _mha_reference(mha, query, key, **ref_call))


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layers(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn((2, 7, 16) if batch_first else (7, 2, 16))
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    kpm = torch.zeros(2, 7)
    kpm[1, -2:] = float("-inf")
    want = encoder(x, mask=causal, src_key_padding_mask=kpm, is_causal=True)
    with fastdiag.attach(encoder, every=1) as monitor:
        out = encoder(x, mask=causal, src_key_padding_mask=kpm, is_causal=True)
    assert torch.equal(out, want)
    stats = monitor.latest_stats()
    assert list(stats) == ["layers.0.self_attn", "layers.1.self_attn"]
    # layer 0 sees x itself (post-norm): its attention from MHA's own per-head weights
    ref = _mha_reference(encoder.layers[0].self_attn, x, x, padding=kpm == 0, attn_mask=causal,
                         key_padding_mask=kpm)
    assert_stats_close(stats["layers.0.self_attn"], ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.set_sync_debug_mode)")
@pytest.mark.parametrize("which", ["nanogpt", "mha"])
def test_no_host_sync_on_cuda(which):
    torch.manual_seed(0)
    if which == "nanogpt":
        model = NanoGPT(vocab=32, d_model=64, n_heads=4, n_layers=2, seq_len=64).cuda()
        x = torch.randint(0, 32, (4, 64), device="cuda")
    else:
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
                                      num_layers=2, enable_nested_tensor=False).cuda()
        x = torch.randn(4, 64, 64, device="cuda")

    def steps(n):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(n):
                model(x).float().square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    model(x).float().square().mean().backward()
    try:
        steps(1)
    except RuntimeError as err:
        pytest.skip(f"the model syncs by itself, without fastdiag: {err}")
    with fastdiag.attach(model, every=1) as monitor:
        model(x).float().square().mean().backward()  # warm-up: kernels compiled, caches filled
        steps(3)
        assert len(monitor.history()) == 4
