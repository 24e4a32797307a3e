"""fastdiag.attach under mixed precision and odd layouts: exact under autocast, in grouped-query decode, and never breaking a
step torch accepts (mixed precision, KV caches, cross-attention, odd layouts, hostile inputs). Each case is checked against float64
statistics of the probabilities the model really used, with outputs and gradients unchanged."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from torch.overrides import TorchFunctionMode

import fastdiag
from fastdiag.qk import _as_batched_heads, qk_head_stats

from tests.helpers import assert_stats_close, eager_probs

transformers = pytest.importorskip("transformers")

from tests.hf_matrix import CaptureSDPA, attached_unchanged, build, inputs, sdpa_probs, sharpen  # noqa: E402


def _hs(probs, rows=None):
    return fastdiag.head_stats(probs.double(), rows, backend="reference")


# ---- 1. autocast: fastdiag's arithmetic outside the caller's autocast -----------------------------

def _attached_under_bf16_autocast(arch: str, impl: str):
    """The matrix model ``arch`` on its padded batch under bf16 autocast, measured with attach (outputs
    and gradients unchanged, no warning): (model, batch, monitor)."""
    model = build(arch, impl)
    batch = inputs(arch, padded=True)

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(**batch).logits

    monitor, problems = attached_unchanged(model, run)
    assert not problems
    return model, batch, monitor


@pytest.mark.parametrize("arch", ["gpt2", "llama (GQA)"])
def test_sdpa_under_autocast_matches_float64_of_the_bf16_q_and_k_the_model_used(arch):
    model, batch, monitor = _attached_under_bf16_autocast(arch, "sdpa")
    with torch.no_grad(), CaptureSDPA() as capture, torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch)
    # the tensors SDPA ran on: autocast hands it bf16 (the model's own projections are bf16 already)
    ref = []
    for call in capture.calls:
        call = {k: v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in call.items()}
        probs = sdpa_probs(call)
        ref.append(_hs(probs, probs.sum(-1).sub(1).abs().lt(1e-6).all(1) & batch["attention_mask"].bool()))
    stats = list(monitor.latest_stats().values())
    assert len(stats) == len(ref)
    for got, want in zip(stats, ref):
        assert_stats_close(got, want, tol=1e-5)


class SoftmaxCapture(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (F.softmax, torch.softmax, torch.Tensor.softmax) and out.dim() == 4:
            self.outputs.append(out.detach().clone())
        return out


def test_eager_under_autocast_measures_the_softmax_output_in_float64():
    """Eager under autocast: the measured tensor is the softmax's own output (fp32 from HF's
    ``softmax(..., dtype=float32)``), accumulated without autocast — not a bf16 re-computation."""
    model, batch, monitor = _attached_under_bf16_autocast("llama (GQA)", "eager")
    with torch.no_grad(), SoftmaxCapture() as capture, torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch)
    stats = list(monitor.latest_stats().values())
    assert len(stats) == len(capture.outputs) == 2
    for got, probs in zip(stats, capture.outputs):
        assert probs.dtype == torch.float32
        rows = probs.double().sum(-1).sub(1).abs().lt(1e-5).all(1) & batch["attention_mask"].bool()
        assert_stats_close(got, _hs(probs, rows))


def test_multihead_attention_under_autocast_reprojects_in_the_autocast_dtype():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, 6, 16)

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x, x, x, need_weights=False)[0]

    monitor, problems = attached_unchanged(mha, run)
    assert not problems
    e = 16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as MultiheadAttention does: [T, N, E], in bf16
        q = F.linear(x.transpose(0, 1), mha.in_proj_weight[:e], mha.in_proj_bias[:e])
        k = F.linear(x.transpose(0, 1), mha.in_proj_weight[e:2 * e], mha.in_proj_bias[e:2 * e])
    assert q.dtype == torch.bfloat16
    q, k = (z.reshape(6, 2, 4, 4).permute(1, 2, 0, 3) for z in (q, k))
    probs, _ = eager_probs(q, k)
    assert_stats_close(monitor.latest_stats()["<root>"], _hs(probs))


# ---- 2. grouped-query decode: H heads, not Hkv -----------------------------------------------------

def test_gqa_decode_step_under_sdpa_records_every_query_head():
    """transformers packs a one-token query [B, H, 1, D] as [B, Hkv, H/Hkv, D] when a mask is passed:
    the decode step must give H heads, equal to the eager twin's probabilities."""
    arch = "llama (GQA)"
    batch = inputs(arch, padded=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    token = torch.randint(2, 64, (2, 1), generator=torch.Generator().manual_seed(5))
    results = {}
    for impl in ("sdpa", "eager"):
        model = build(arch, impl).eval()
        with torch.no_grad():
            past = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
            if impl == "eager":
                out = model(input_ids=token, attention_mask=step_mask, past_key_values=past,
                            output_attentions=True)
                results[impl] = [a for a in out.attentions]
                continue
            with CaptureSDPA() as capture:
                model(input_ids=token, attention_mask=step_mask, past_key_values=copy.deepcopy(past))
            with fastdiag.attach(model, every=1, measure_eval=True) as monitor:
                model(input_ids=token, attention_mask=step_mask, past_key_values=past)
        assert capture.calls[0]["query"].shape[1:3] == (2, 2)       # packed: Hkv = 2 heads of 2 rows
        results[impl] = list(monitor.latest_stats().values())
    assert len(results["sdpa"]) == 2
    for got, probs in zip(results["sdpa"], results["eager"]):
        assert got.num_heads == 4 and got.rows.item() == 2
        assert_stats_close(got, _hs(probs))


# ---- attach never breaks a step torch accepts --------------------------------------------------------

class HandWritten(nn.Module):
    """Softmax attention written by hand, in the ways torch accepts."""

    def __init__(self, how):
        super().__init__()
        self.how, self.qkv = how, nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).split(8, -1)
        if self.how == "sdpa-2d":                                          # unbatched [T, D]
            return F.scaled_dot_product_attention(q, k, v)
        b, t = x.shape[:2]
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in (q, k, v))
        if self.how == "sdpa-3d":                                          # heads folded into the batch
            out = F.scaled_dot_product_attention(q.reshape(b * 2, t, 4), k.reshape(b * 2, t, 4),
                                                 v.reshape(b * 2, t, 4))
            return out.reshape(b, 2, t, 4)
        scores = q @ k.transpose(-1, -2) / 2
        probs = torch.softmax(input=scores, dim=-1) if self.how == "keyword" else scores.softmax(-1)
        self.probs = probs.detach()
        return probs @ v


def test_softmax_with_its_input_passed_by_keyword_is_measured():
    torch.manual_seed(0)
    model, x = HandWritten("keyword"), torch.randn(2, 5, 8)
    monitor, problems = attached_unchanged(model, lambda m: m(x))
    assert not problems
    assert_stats_close(monitor.latest_stats()["<root>"], _hs(model.probs))


def test_an_empty_batch_through_a_hand_written_softmax_is_a_step_with_no_rows():
    torch.manual_seed(0)
    model, x = HandWritten("softmax"), torch.randn(0, 5, 8)
    monitor, problems = attached_unchanged(model, lambda m: m(x))
    assert not problems
    stats = monitor.latest_stats()["<root>"]
    assert stats.rows.item() == 0 and stats.num_heads == 2 and stats.gram.abs().sum().item() == 0


@pytest.mark.parametrize("how,x", [("sdpa-2d", (5, 8)), ("sdpa-3d", (2, 5, 8))])
def test_sdpa_without_a_head_dimension_runs_unchanged_and_is_named_not_measured(how, x):
    torch.manual_seed(0)
    model, x = HandWritten(how), torch.randn(*x)
    monitor, problems = attached_unchanged(model, lambda m: m(x))
    assert len(problems) == 1 and "'<root>' (HandWritten) is not measured" in problems[0] \
        and f"{x.dim()}-D query" in problems[0]
    assert monitor.latest() is None and monitor.coverage()["measured"] == {}
    assert "cannot be read" in monitor.coverage()["missing"]["<root>"]
    with fastdiag.attach(model, every=1, strict=True):
        with pytest.raises(RuntimeError, match="not measured"):
            model(x)


def test_set_padding_with_a_mask_that_matches_no_call_is_named():
    torch.manual_seed(0)
    model, x = HandWritten("softmax"), torch.randn(2, 5, 8)
    monitor = fastdiag.attach(model, every=1)
    monitor.set_padding(torch.ones(5, 2))                               # [T, B]: transposed
    with pytest.warns(RuntimeWarning, match=r"set_padding's mask of shape \(5, 2\) matched no self-attention"):
        model(x)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    monitor.set_padding(mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)
    assert monitor.latest_stats()["<root>"].rows.item() == 8
    with pytest.raises(ValueError, match="within: no module named 'nope'"):
        monitor.set_padding(mask, within="nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a mask on another device)")
def test_set_padding_with_a_mask_on_the_host_for_a_model_on_the_gpu():
    torch.manual_seed(0)
    model, x = HandWritten("softmax").cuda(), torch.randn(2, 5, 8, device="cuda")
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    with fastdiag.attach(model, every=1) as monitor:
        monitor.set_padding(mask)
        model(x)
    assert monitor.latest_stats()["<root>"].rows.item() == 8


# ---- qk_head_stats memory and argument errors -------------------------------------------------------

def test_a_shared_mask_under_5d_q_is_not_copied_per_batch_and_head():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 4, 6, 8, generator=g), torch.randn(2, 3, 4, 6, 8, generator=g)
    mask = torch.randn(6, 6, generator=g).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    _, _, mask4, _, _ = _as_batched_heads(q, k, mask, None, None)
    assert mask4.shape == (1, 1, 6, 6)
    per_batch = mask.expand(2, 1, 1, 6, 6).clone()
    per_batch[1, 0, 0, :, 0] = float("-inf")                           # differs per batch: kept per batch only
    assert _as_batched_heads(q, k, per_batch, None, None)[2].shape == (6, 1, 6, 6)
    for m in (mask, per_batch):
        probs, rows = eager_probs(q.reshape(6, 4, 6, 8), k.reshape(6, 4, 6, 8),
                                  m.expand(2, 3, 4, 6, 6).reshape(6, 4, 6, 6))
        assert_stats_close(qk_head_stats(q, k, m, backend="torch"), _hs(probs, rows))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(k=torch.randn(3, 2, 5, 4)), ValueError, "k: batch dimensions"),
    (dict(attn_mask=torch.zeros(1, 2, 1, 5, 5)), ValueError, "attn_mask: 5 dimensions"),
    (dict(attn_mask=torch.ones(5, 5, dtype=torch.int64)), TypeError, "attn_mask: expected a bool"),
    (dict(scale="big"), TypeError, "scale: expected a number"),
    (dict(q=torch.randn(2, 2, 5, 4).to_sparse()), TypeError, "q: expected a dense"),
])
def test_qk_head_stats_errors_name_the_argument(kwargs, error, match):
    args = dict(q=torch.randn(2, 2, 5, 4), k=torch.randn(2, 2, 5, 4), **{})
    args.update(kwargs)
    with pytest.raises(error, match=match):
        qk_head_stats(**args)


def test_head_stats_refuses_sparse_probabilities_by_name():
    with pytest.raises(TypeError, match="probs: expected a dense"):
        fastdiag.head_stats(torch.rand(2, 2, 5, 5).to_sparse())


# ---- 3. self- or cross-attention from provenance, not from Tq = Tk -----------------------------------

class ContextAttention(nn.Module):
    """``attn(x, context=...)``: queries from x, keys and values from the context (x itself if None);
    the context's padding is a key mask. Tq = Tk, so shapes cannot tell self from cross."""

    def __init__(self, softmax):
        super().__init__()
        self.softmax, self.q, self.kv = softmax, nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, x, context=None, context_mask=None):
        context = x if context is None else context
        b, t = x.shape[:2]
        q = self.q(x).view(b, t, 2, 4).transpose(1, 2)
        k, v = (z.view(b, -1, 2, 4).transpose(1, 2) for z in self.kv(context).split(8, -1))
        mask = context_mask[:, None, None, :]
        self.seen = (q.detach(), k.detach(), mask)
        if not self.softmax:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = (q @ k.transpose(-1, -2) / 2).masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v


@pytest.mark.parametrize("softmax", [False, True], ids=["sdpa", "eager"])
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_padding_rows_are_left_out_only_where_queries_and_keys_share_their_input(softmax, cross):
    torch.manual_seed(0)
    model, x, other = ContextAttention(softmax), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False                      # the context's padding: keys 4, 5 of sequence 0
    monitor, problems = attached_unchanged(model, lambda m: m(x, context=other if cross else x, context_mask=mask))
    assert not problems
    q, k, m = model.seen
    probs, _ = eager_probs(q, k, m)
    # every row sees a real key; cross: every query row is real (Perceiver's latents); self: its own
    # position is padding where the key is
    want_rows = torch.ones(2, 6, dtype=torch.bool) if cross else mask
    stats = monitor.latest_stats()["<root>"]
    assert stats.rows.item() == (12 if cross else 10)
    assert_stats_close(stats, _hs(probs, want_rows))
    assert monitor.coverage()["all_rows"] == {}


def test_hf_callback_hands_the_encoder_mask_to_the_encoder_only():
    """T5 with source and target of equal length: the encoder's attention_mask must not drop real
    decoder rows (decoder self-attention and cross-attention count every target row)."""
    from fastdiag.integrations.hf import FastdiagCallback

    from tests.hf_matrix import reference
    arch = "t5 (relative position bias)"
    model = build(arch, "eager")
    batch = inputs(arch, padded=True)
    batch["decoder_input_ids"] = batch["input_ids"].flip(-1)          # target length = source length
    callback = FastdiagCallback(every=1)
    callback.on_train_begin(None, None, None, model=model)
    try:
        model(**batch)
        stats = list(callback.monitor.latest_stats().values())
    finally:
        callback.on_train_end(None, None, None)
    ref = reference(arch, model, batch)
    assert [s.rows.item() for s in stats] == [15, 15, 20, 20, 20, 20]   # 5 source positions padded
    for got, want in zip(stats, ref):
        assert_stats_close(got, want)


def test_compiled_self_attention_counts_every_row_and_says_so():
    """Under torch.compile the provenance is not traced: padding rows cannot be told from the call,
    so every row that sees a key is counted and coverage() names the layer (never a guess)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = ContextAttention(softmax=False), torch.randn(2, 6, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    compiled = torch.compile(model, backend=lambda gm, example_inputs: gm.forward, fullgraph=True)
    with fastdiag.attach(model, every=1) as monitor:
        compiled(x, context_mask=mask)
    assert monitor.latest_stats()["<root>"].rows.item() == 12
    assert "not known" in monitor.coverage()["all_rows"]["<root>"]


# ---- 4. finite masks: a key is masked where the model's softmax gave it exactly 0 -----------------

class AdditiveMaskAttention(nn.Module):
    """Padding masked with a finite additive value (MarkupLM -1e4, Funnel -1e6, XLNet -1e30)."""

    def __init__(self, fill, use_sdpa):
        super().__init__()
        self.fill, self.use_sdpa, self.qkv = fill, use_sdpa, nn.Linear(8, 24)

    def forward(self, x, real):
        b, t = x.shape[:2]
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).split(8, -1))
        mask = (~real[:, None, None, :]).float() * self.fill
        self.seen = (q.detach(), k.detach(), mask)
        if self.use_sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return (q @ k.transpose(-1, -2) / 2 + mask).softmax(-1) @ v


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["eager", "sdpa"])
@pytest.mark.parametrize("fill", [-1e4, -1e6, -1e30])
def test_padding_masked_with_a_finite_value_leaves_padded_rows_out(fill, use_sdpa):
    torch.manual_seed(0)
    model, x = AdditiveMaskAttention(fill, use_sdpa), torch.randn(2, 6, 8)
    real = torch.ones(2, 6, dtype=torch.bool)
    real[0, 4:] = False
    real[1, :1] = False
    monitor, problems = attached_unchanged(model, lambda m: m(x, real))
    assert not problems
    q, k, mask = model.seen
    scores = q.double() @ k.double().transpose(-1, -2) / 2 + mask.double()
    stats = monitor.latest_stats()["<root>"]
    assert stats.rows.item() == 9
    assert_stats_close(stats, _hs(scores.softmax(-1), real))


def test_xlnet_padding_that_sees_itself_is_counted_and_named_until_the_mask_is_handed_in():
    """XLNet's mask (finite, −1e30) lets each padded query attend to itself, so its padded positions
    cannot be told from the call: every row is counted and said so (a warning at the first read,
    coverage()["all_rows"]); with set_padding the padded rows are left out, exactly."""
    config = transformers.XLNetConfig(d_model=32, n_layer=2, n_head=4, d_inner=64, vocab_size=64, dropout=0.0)
    torch.manual_seed(0)
    model = sharpen(transformers.XLNetModel(config))
    batch = inputs("bert", padded=True)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        want = model(**batch, output_attentions=True).attentions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            model(**batch)
            all_rows = monitor.coverage()["all_rows"]
    named = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
    assert len(named) == 2 and all("set_padding" in m for m in named)
    assert set(all_rows) == {"layer.0.rel_attn", "layer.1.rel_attn"}
    for got, probs in zip(monitor.latest_stats().values(), want):
        assert got.rows.item() == 20
        assert_stats_close(got, _hs(probs))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastdiag.attach(model, every=1) as monitor:
            monitor.set_padding(batch["attention_mask"])
            model(**batch)
            assert monitor.coverage()["all_rows"] == {}
    for got, probs in zip(monitor.latest_stats().values(), want):
        assert got.rows.item() == 15
        assert_stats_close(got, _hs(probs, real))


def test_funnel_helper_structure_is_not_warned_about_and_strict_passes():
    """FunnelAttentionStructure is named like attention but is a helper whose forward never runs."""
    config = transformers.FunnelConfig(d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1],
                                       vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                                       activation_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.FunnelBaseModel._from_config(config, attn_implementation="eager").train()
    batch = inputs("bert", padded=False)
    with torch.no_grad():
        want = model(**batch, output_attentions=True).attentions
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastdiag.attach(model, every=1, strict=True) as monitor:
            model(**batch)
    stats = monitor.latest_stats()
    assert len(stats) == len(want) == 2 and monitor.coverage()["missing"] == {}
    for got, probs in zip(stats.values(), want):
        assert_stats_close(got, _hs(probs))


# ---- 7. torch's eval fast paths: outputs bit-identical -------------------------------------------

def test_eval_fast_paths_keep_their_outputs_and_say_what_they_cannot_measure():
    """measure_eval=True: nn.TransformerEncoder's nested-tensor fast path and MultiheadAttention's
    native path run exactly as without attach (a function mode would switch them off); the fused
    encoder layers are named as not measured, a bare MultiheadAttention is measured by its adapter."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:] = True
    with torch.no_grad():
        want = encoder(x, src_key_padding_mask=pad)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fastdiag.attach(encoder, every=1, measure_eval=True) as monitor:
                got = encoder(x, src_key_padding_mask=pad)
    assert torch.equal(got, want)
    named = [str(w.message) for w in caught if "fast path" in str(w.message)]
    assert len(named) == 2 and "'layers.0.self_attn'" in named[0]
    assert set(monitor.coverage()["missing"]) == {"layers.0.self_attn", "layers.1.self_attn"}

    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    with torch.no_grad():
        want = mha(x, x, x, need_weights=False)[0]
        with fastdiag.attach(mha, every=1, measure_eval=True) as monitor:
            got = mha(x, x, x, need_weights=False)[0]
    assert torch.equal(got, want)
    q, k = (F.linear(x, w, b).view(2, 6, 4, 4).transpose(1, 2)
            for w, b in list(zip(mha.in_proj_weight.split(16), mha.in_proj_bias.split(16)))[:2])
    assert_stats_close(monitor.latest_stats()["<root>"], _hs(eager_probs(q, k)[0]))


# ---- 5, 6. one module = one layer record, and a softmax is attention only when it weighs values ---

class OddSoftmaxes(nn.Module):
    """Softmaxes over 4-D (or 5-D) tensors, written the ways that are not one [B, H, Tq, Tk] map."""

    def __init__(self, how):
        super().__init__()
        self.how, self.qkv, self.num_heads = how, nn.Linear(8, 24), 2

    def forward(self, x):
        b, t = x.shape[:2]
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).split(8, -1))
        scores = q @ k.transpose(-1, -2) / 2                                   # [B, H, T, T]
        if self.how == "heat map":      # a spatial softmax used elementwise: no values weighed
            return (scores.softmax(-1) * scores).sum(-1, keepdim=True) * v
        if self.how == "router":        # grouped MoE router [B, T, G, E], experts mixed elementwise
            gates = q.transpose(1, 2).softmax(-1)                              # [B, T, H, 4]
            return (gates.unsqueeze(-1) * v.transpose(1, 2).unsqueeze(-2)).sum(-2).transpose(1, 2)
        if self.how == "factored":      # Nyströmformer-like: two softmax factors in one call
            landmarks = k[:, :, :2]
            return (q @ landmarks.transpose(-1, -2)).softmax(-1) @ ((landmarks @ k.transpose(-1, -2)).softmax(-1) @ v)
        if self.how == "5-D":           # n-gram streams: [B, S, H, T, T]
            probs = torch.stack([scores, scores * 2], 1).softmax(-1)
            return (probs @ v.unsqueeze(1)).sum(1)
        if self.how == "window":        # Longformer-like [B, T, H, window] scores: each query its own keys
            window = scores.transpose(1, 2)[..., :3]
            values = v.transpose(1, 2).unsqueeze(1).expand(b, t, t, 2, 4)[:, :, :3]     # [B, T, window, H, D]
            return torch.einsum("bthw,btwhd->bhtd", window.softmax(-1), values)
        if self.how == "logsumexp":     # exp(s - logsumexp), no softmax
            return torch.exp(scores - scores.logsumexp(-1, keepdim=True)) @ v
        if self.how == "flex":          # flex_attention in a class not named like attention
            return flex_attention(q, k, v)
        raise AssertionError(self.how)


@pytest.mark.parametrize("how,message", [
    ("heat map", "never multiplied with values"), ("router", "never multiplied with values"),
    ("factored", "2 attention ops"), ("5-D", "5-D scores"), ("window", "not the module's 2 heads"),
    ("logsumexp", "exp\\(s − logsumexp\\)")])
def test_softmaxes_that_are_not_one_attention_map_are_no_layer_and_are_named(how, message):
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.real, self.odd = HandWritten("softmax"), OddSoftmaxes(how)

        def forward(self, x):
            return self.odd(self.real(x).transpose(1, 2).reshape(x.shape))

    torch.manual_seed(0)
    model, x = Pair(), torch.randn(2, 6, 8)
    monitor, problems = attached_unchanged(model, lambda m: m(x))
    assert len(problems) == 1 and "'odd'" in problems[0]
    assert re.search(message, problems[0])
    assert list(monitor.latest_stats()) == ["real"] and list(monitor.coverage()["measured"]) == ["real"]
    assert_stats_close(monitor.latest_stats()["real"], _hs(model.real.probs))


def test_flex_attention_in_a_class_not_named_like_attention_is_named():
    """flex_attention never forms its probabilities (and has no CPU backward, hence no_grad): the
    module calling it is named, whatever its class name; the other layer stays exact."""
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.real, self.odd = HandWritten("softmax"), OddSoftmaxes("flex")

        def forward(self, x):
            return self.odd(self.real(x).transpose(1, 2).reshape(x.shape))

    torch.manual_seed(0)
    model, x = Pair(), torch.randn(2, 6, 8)
    with torch.no_grad():
        want = model(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fastdiag.attach(model, every=1) as monitor:
                got = model(x)
    assert torch.equal(got, want)
    problems = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
    assert len(problems) == 1 and "'odd'" in problems[0] and "calls flex_attention" in problems[0]
    assert list(monitor.latest_stats()) == ["real"] and "odd" in monitor.coverage()["missing"]
    assert_stats_close(monitor.latest_stats()["real"], _hs(model.real.probs))


def test_nystromformer_factors_are_not_recorded_as_layers():
    """Its three softmax factors were three layers; now the module is named as not measured."""
    config = transformers.NystromformerConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=40, num_landmarks=4,
        segment_means_seq_len=16)
    torch.manual_seed(0)
    model = transformers.NystromformerModel(config).train()
    ids = torch.randint(2, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    monitor, problems = attached_unchanged(model, lambda m: m(input_ids=ids).last_hidden_state)
    assert len(problems) == 1 and "'encoder.layer.0.attention.self'" in problems[0] and "attention ops" in problems[0]
    assert monitor.latest() is None
