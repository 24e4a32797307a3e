"""fastdiag.attach on attention written every which way: nanoGPT's flash and manual paths, SDPA
imported by name, a model defined in ``__main__`` with no source file, torch.nn.Transformer with key
padding, torch.compile(fullgraph=True) on the manual path; padding handed in per step; coverage,
warnings and errors (never a silent missing number); another thread's attention not recorded."""
import math
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as sdpa_bound_by_name

import fastdiag

from tests.helpers import assert_stats_close


class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: flash (SDPA) or the manual softmax with its registered mask; it states
    its head count as ``n_head``, as nanoGPT does (under torch.compile that confirms the manual path's layout)."""

    def __init__(self, d=16, heads=4, t=8, flash=True, by_name=False):
        super().__init__()
        self.n_head, self.flash, self.by_name = heads, flash, by_name
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))
        self.seen = None

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.flash:
            sdpa = sdpa_bound_by_name if self.by_name else F.scaled_dot_product_attention
            y = sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
            self.seen = (q.detach(), k.detach())  # probabilities formed by the test, after the pass
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            self.seen = att.detach().double()
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def probs(self) -> torch.Tensor:
        """Float64 probabilities of the last call (what SDPA computed, written out)."""
        if not isinstance(self.seen, tuple):
            return self.seen
        q, k = (z.double() for z in self.seen)
        t = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
        return scores.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(-1)


class Block(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(16), NanoAttention(**kw)

    def forward(self, x):
        return x + self.attn(self.ln_1(x))


class NanoModel(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.wte = nn.Embedding(32, 16)
        self.h = nn.ModuleList([Block(**kw), Block(**kw)])

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return x


def _run_unchanged(model, *args, **kwargs):
    """Run model with and without attach: outputs and gradients must be identical; returns monitor."""
    want = model(*args)
    want.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with fastdiag.attach(model, every=1, **kwargs) as monitor:
        out = model(*args)
        out.square().sum().backward()
    assert torch.equal(out, want)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    return monitor


@pytest.mark.parametrize("flash,by_name", [(True, False), (True, True), (False, False)],
                         ids=["flash", "sdpa-imported-by-name", "manual-softmax"])
def test_nanogpt_flash_on_and_off(flash, by_name):
    torch.manual_seed(0)
    model = NanoModel(flash=flash, by_name=by_name)
    idx = torch.randint(0, 32, (3, 8))
    monitor = _run_unchanged(model, idx)
    stats = monitor.latest_stats()
    names = ["h.0.attn", "h.1.attn"]
    assert list(stats) == names
    how = "sdpa" if flash else "probabilities"
    assert monitor.coverage() == {"found": names, "measured": {n: fastdiag.core.monitor.HOW[how] for n in names},
                                  "missing": {}, "all_rows": {}, "padding_rows": {}}
    for name, block in zip(names, model.h):
        assert_stats_close(stats[name], fastdiag.head_stats(block.attn.probs(), backend="reference"))


MAIN_SCRIPT = r'''
import torch, torch.nn as nn, fastdiag
from torch.nn.functional import scaled_dot_product_attention

class Mixer(nn.Module):                      # not named like attention, defined in __main__, no file
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 6, 3, 4, 4).permute(2, 0, 3, 1, 4)
        return scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 6, 16)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix, self.out = Mixer(), nn.Linear(16, 4)
    def forward(self, x):
        return self.out(self.mix(x))

torch.manual_seed(0)
net, x = Net(), torch.randn(2, 6, 16)
monitor = fastdiag.attach(net, every=1)
net(x)
print(sorted(monitor.latest_stats()), monitor.coverage()["measured"])
'''


def test_model_defined_in_main_with_no_source_file():
    done = subprocess.run([sys.executable, "-"], input=MAIN_SCRIPT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "['mix'] {'mix': \"re-derived from the SDPA call's Q, K, mask and scale\"}" in done.stdout


def test_transformer_with_key_padding_leaves_padded_rows_out():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=16, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                           dim_feedforward=32, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    src_pad = torch.zeros(2, 7, dtype=torch.bool)
    src_pad[0, -2:] = True
    tgt_pad = torch.zeros(2, 5, dtype=torch.bool)
    tgt_pad[1, -1] = True
    kw = dict(src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad,
              tgt_mask=nn.Transformer.generate_square_subsequent_mask(5), tgt_is_causal=True)
    want = model(src, tgt, **kw)
    with fastdiag.attach(model, every=1) as monitor:
        out = model(src, tgt, **kw)
    assert torch.equal(out, want)
    stats = monitor.latest_stats()
    assert list(stats) == ["encoder.layers.0.self_attn", "decoder.layers.0.self_attn",
                           "decoder.layers.0.multihead_attn"]
    # padded query rows are left out of self-attention; cross-attention rows are the decoder's own
    assert stats["encoder.layers.0.self_attn"].rows.item() == 2 * 7 - 2
    assert stats["decoder.layers.0.self_attn"].rows.item() == 2 * 5 - 1
    assert stats["decoder.layers.0.multihead_attn"].rows.item() == 2 * 5
    enc = model.encoder.layers[0].self_attn
    model.eval()
    with torch.no_grad():
        _, probs = enc(src, src, src, key_padding_mask=src_pad, need_weights=True, average_attn_weights=False)
    ref = fastdiag.head_stats(probs.double(), ~src_pad, backend="reference")
    assert_stats_close(stats["encoder.layers.0.self_attn"], ref)


def test_set_padding_marks_rows_a_model_does_not_mask():
    """nanoGPT passes no mask: the padding of a right-padded batch is handed in per step."""
    torch.manual_seed(0)
    model = NanoModel(flash=True)
    idx = torch.randint(0, 32, (2, 8))
    real = torch.ones(2, 8, dtype=torch.long)
    real[1, 5:] = 0
    monitor = fastdiag.attach(model, every=1)
    with pytest.raises(ValueError, match="mask"):
        monitor.set_padding(torch.ones(8))
    monitor.set_padding(real)
    model(idx)
    padded = monitor.latest_stats()
    model(idx)                                  # the mask held for one step only
    full = monitor.latest_stats()
    monitor.detach()
    assert padded["h.0.attn"].rows.item() == 13 and full["h.0.attn"].rows.item() == 16
    for name, block in zip(("h.0.attn", "h.1.attn"), model.h):
        assert_stats_close(padded[name], fastdiag.head_stats(block.attn.probs(), real.bool(), backend="reference"))


def test_manual_softmax_compiles_fullgraph_into_two_graphs():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = NanoModel(flash=False)
    idx = torch.randint(0, 32, (2, 8))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with fastdiag.attach(model, every=2) as monitor:
        for _ in range(5):
            compiled(idx).square().mean().backward()
        stats = monitor.latest_stats()
    assert len(graphs) == 2
    assert [r["step"] for r in monitor.history()] == [0, 2, 4]
    assert list(stats) == ["h.0.attn", "h.1.attn"]
    for name, block in zip(stats, model.h):
        assert_stats_close(stats[name], fastdiag.head_stats(block.attn.probs(), backend="reference"))


# ---- never silent -------------------------------------------------------------------------------

class OpaqueAttention(nn.Module):
    """Attention the monitor cannot see: a 3-D softmax ([B·H, T, T], heads folded into the batch)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 6, 3, 4, 4).permute(2, 0, 3, 1, 4).reshape(3, 8, 6, 4)
        return torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), v).reshape(2, 4, 6, 4).transpose(1, 2).reshape(2, 6, 16)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen, self.hidden = NanoAttention(t=6), OpaqueAttention()

    def forward(self, x):
        return self.hidden(self.seen(x))



class SometimesHiddenAttention(nn.Module):
    """SDPA while ``hidden`` is False; attention the monitor cannot see (a 3-D softmax) once it is True."""

    def __init__(self):
        super().__init__()
        self.proj, self.hidden = nn.Linear(16, 48), False

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 6, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
        if not self.hidden:
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 6, 16)
        q, k, v = (t.reshape(8, 6, 4) for t in (q, k, v))
        return torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), v).reshape(2, 4, 6, 4).transpose(1, 2).reshape(2, 6, 16)


def test_a_layer_measured_before_and_missing_later_is_listed_as_missing():
    """Measured on step 0, unseen on step 1: named once, and listed under ``missing`` (saying it was
    measured on other passes) as well as under ``measured`` — a gap is never hidden by earlier records."""
    torch.manual_seed(0)
    model, x = SometimesHiddenAttention(), torch.randn(2, 6, 16)
    with fastdiag.attach(model, every=1) as monitor:
        model(x)
        assert list(monitor.latest_stats()) == ["<root>"] and monitor.coverage()["missing"] == {}
        model.hidden = True
        with pytest.warns(RuntimeWarning, match=r"'<root>' \(SometimesHiddenAttention\)"):
            model(x)
        assert monitor.num_records == 1                  # nothing recorded for step 1
        coverage = monitor.coverage()
        assert list(coverage["measured"]) == ["<root>"]
        assert list(coverage["missing"]) == ["<root>"] and "measured on others" in coverage["missing"]["<root>"]


@pytest.mark.parametrize("when", ["after a measured pass", "before any pass"])
def test_an_attention_layer_replaced_after_attach_is_named_not_silently_dropped(when):
    """``model.layers[1] = NewLayer()`` after attach: the new module carries none of the monitor's hooks, so
    its attention cannot be measured (before, it was left out of s̄ with no word). Named when it is set, and
    listed in ``missing``; replacing a part with no attention (a LoRA wrapper around a projection) is quiet and
    the layers stay exact."""
    from tests.helpers import SDPALayer, TwoLayers, reference_stats

    torch.manual_seed(0)
    model, x = TwoLayers(), torch.randn(2, 6, 16)
    with fastdiag.attach(model, every=1) as monitor:
        if when == "after a measured pass":
            model(x)
        with pytest.warns(RuntimeWarning, match=r"'layers\.1' was set to a new SDPALayer after attach: the new module carries none of"):
            model.layers[1] = SDPALayer()
        assert "set to a new SDPALayer after attach" in monitor.coverage()["missing"]["layers.1"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.layers[0].q = nn.Sequential(model.layers[0].q)       # no attention in it: quiet
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # a careful pass also names the new layer as a module outside the model
            model(x)
        assert_stats_close(monitor.latest_stats()["layers.0"], reference_stats(*model.layers[0].last))
        assert "<root>" not in monitor.latest_stats()
    assert not torch.nn.modules.module._global_module_registration_hooks


def test_an_attention_module_without_statistics_is_named_in_a_warning_once():
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(2, 6, 16)
    monitor = fastdiag.attach(model, every=1)
    with pytest.warns(RuntimeWarning, match=r"'hidden' \(OpaqueAttention\).*no softmax over \[B, H, Tq, Tk\]"):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)                                 # once only
    coverage = monitor.coverage()
    assert coverage["found"] == ["seen", "hidden"] and list(coverage["measured"]) == ["seen"]
    assert list(coverage["missing"]) == ["hidden"]
    monitor.detach()
    with fastdiag.attach(model, every=1, strict=True):
        with pytest.raises(RuntimeError, match="'hidden'"):
            model(x)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # detached itself


def test_a_model_without_attention_is_named_and_detached_never_raised_in_the_step():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).softmax(-1)        # a softmax, but not over [B, H, Tq, Tk] scores

    model, x = MLP(), torch.randn(2, 4)
    want = model(x)
    monitor = fastdiag.attach(model)             # nothing structural: found on the first pass
    with pytest.warns(RuntimeWarning, match="found no attention in MLP") as caught:
        assert torch.equal(model(x), want)       # the user's step runs on (issue 39, item 7)
    for looked_for in ("records_head_stats", "MultiheadAttention", "named like attention",
                       "scaled_dot_product_attention", "softmax over [B, H, Tq, Tk]"):
        assert looked_for in str(caught[0].message)
    assert monitor.latest() is None
    assert not model._forward_hooks and not model._forward_pre_hooks
    fastdiag.attach(model, strict=True)          # strict asks for the error
    with pytest.raises(RuntimeError, match="found no attention in MLP"):
        model(x)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_another_threads_attention_is_not_recorded():
    torch.manual_seed(0)
    model, other = NanoModel(flash=True), NanoModel(flash=True)
    idx = torch.randint(0, 32, (2, 8))
    with fastdiag.attach(model, every=1) as monitor:
        started, release = threading.Event(), threading.Event()

        class Pausing(nn.Module):       # holds the attached model inside its measured pass
            def forward(self, x):
                started.set()
                release.wait(60)
                return x

        model.h[0].ln_1 = nn.Sequential(Pausing(), model.h[0].ln_1)
        worker = threading.Thread(target=model, args=(idx,))
        worker.start()
        started.wait(60)
        other(idx)                       # the other thread's attention, while the mode is entered there
        release.set()
        worker.join()
    assert list(monitor.latest_stats()) == ["h.0.attn", "h.1.attn"]
    assert_stats_close(monitor.latest_stats()["h.1.attn"],
                       fastdiag.head_stats(model.h[1].attn.probs(), backend="reference"))


def test_a_forward_that_raises_is_not_a_coverage_verdict():
    """An exception before the attention ran (an OOM, a bad batch) says nothing about coverage: no
    'found no attention' error on top of it, no warning, the monitor stays attached."""
    torch.manual_seed(0)
    model = NanoModel(flash=True)
    monitor = fastdiag.attach(model, every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(IndexError):
            model(torch.full((2, 8), 99))        # out of the embedding's range: raises before attention
    model(torch.randint(0, 32, (2, 8)))
    assert monitor.coverage()["missing"] == {} and list(monitor.latest_stats())[-2:] == ["h.0.attn", "h.1.attn"]
    monitor.detach()
