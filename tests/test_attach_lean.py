"""Lean measured passes (fastdiag.core.plan): after the careful first measured pass, later ones follow
its plan and give bit-identical statistics; anything the plan does not expect is measured as a careful
pass would, and the plan is dropped."""
import pytest
import torch
import torch.nn.functional as F

import fastdiag
from fastdiag.testing import NanoGPT
from tests.helpers import tiny_hf

transformers = pytest.importorskip("transformers")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(a[k]._tensors(), b[k]._tensors())) for k in a)


@pytest.mark.parametrize("family,attn", [("gpt2", "sdpa"), ("llama", "sdpa"), ("gpt2", "eager"), ("nanogpt", "sdpa")])
def test_lean_passes_equal_the_careful_one(family, attn):
    if family == "nanogpt":
        torch.manual_seed(0)
        model = NanoGPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
        x = torch.randint(0, 64, (2, 16))
        run = lambda: model(x).square().mean()  # noqa: E731
    else:
        model = tiny_hf(family, attn)
        ids = torch.randint(0, 64, (2, 12))
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :3] = 0
        run = lambda: model(input_ids=ids, attention_mask=mask, labels=ids).loss  # noqa: E731
    want_out = run()
    want_out.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monitor = fastdiag.attach(model, every=1)
    try:
        stats = []
        for i in range(3):
            out = run()
            out.backward()
            assert torch.equal(out, want_out)
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grads))
            model.zero_grad()
            stats.append(monitor.latest_stats())
            if i == 0:
                assert monitor._plans, "the careful pass left a plan"
                coverage = monitor.coverage()
        assert monitor._plans, "the lean passes kept the plan"
        assert _same(stats[0], stats[1]) and _same(stats[0], stats[2])
        assert monitor.coverage() == coverage
    finally:
        monitor.detach()


def test_an_unexpected_shape_is_measured_carefully_and_drops_the_plan():
    model = tiny_hf("llama", "sdpa")
    monitor = fastdiag.attach(model, every=1)
    try:
        short, long = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 12))
        model(input_ids=short)
        assert monitor._plans
        model(input_ids=long)                      # off the plan: careful handling, the plan dropped
        got = monitor.latest_stats()
        assert not monitor._plans
        model(input_ids=long)                      # careful again: a new plan
        assert monitor._plans and _same(got, monitor.latest_stats())
    finally:
        monitor.detach()


class _Attention(torch.nn.Module):
    """Self-attention, or cross-attention when a context is passed: the plan of one is not the other's."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.q, self.kv = heads, torch.nn.Linear(d, d), torch.nn.Linear(d, 2 * d)

    def forward(self, x, context=None):
        b, t, d = x.shape
        source = x if context is None else context
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv(source).view(b, source.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attention()

    def forward(self, x, context=None):
        return self.attn(x, context)


def test_self_then_cross_attention_of_one_shape_keeps_padding_rows_right():
    torch.manual_seed(0)
    model = _Block()
    x, context = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[0, :2] = False
    monitor = fastdiag.attach(model, every=1)
    try:
        monitor.set_padding(padding)
        model(x)
        self_rows = monitor.latest_stats()["attn"].rows.item()
        assert self_rows == 10 and monitor._plans
        monitor.set_padding(padding)
        model(x, context=context)                  # cross-attention: the padding mask is no self-attention's
        assert monitor.latest_stats()["attn"].rows.item() == 12
        assert not monitor._plans
    finally:
        monitor.detach()


def _nanogpt():
    torch.manual_seed(0)
    return NanoGPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)


def test_vmap_ensemble_and_per_sample_grads_step_aside_with_one_warning():
    """torch.func transforms (issue 40.3): never raise in the step; warned once, the outputs unchanged."""
    from torch.func import functional_call, grad, stack_module_state, vmap

    models = [_nanogpt() for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = models[0]
    x = torch.randint(0, 64, (2, 16))

    def ensemble(p, b):
        return functional_call(base, (p, b), (x,))

    def loss(p, b, xi):
        return functional_call(base, (p, b), (xi[None],)).square().mean()

    want_ensemble = vmap(ensemble)(params, buffers)
    one = {k: v[0] for k, v in params.items()}
    bufs = {k: v[0] for k, v in buffers.items()}
    want_grads = vmap(grad(loss), in_dims=(None, None, 0))(one, bufs, x)
    monitor = fastdiag.attach(base, every=1)
    try:
        with pytest.warns(RuntimeWarning, match="torch.func transform") as caught:
            got_ensemble = vmap(ensemble)(params, buffers)
            got_grads = vmap(grad(loss), in_dims=(None, None, 0))(one, bufs, x)
        assert sum("torch.func" in str(w.message) for w in caught) == 1
        assert torch.equal(got_ensemble, want_ensemble)
        assert all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads)
        base(x)                                     # outside a transform: measured
        assert monitor.latest()["s_bar"] == monitor.latest()["s_bar"]
    finally:
        monitor.detach()


def test_a_padding_mask_that_cannot_reach_the_device_never_breaks_the_step():
    """Issue 40.7: a meta mask is refused where it is handed in; a step never raises on a mask's device."""
    model = _nanogpt()
    monitor = fastdiag.attach(model, every=1)
    try:
        with pytest.raises(ValueError, match="mask: a meta tensor"):
            monitor.set_padding(torch.ones(2, 16, dtype=torch.bool, device="meta"))
        model(torch.randint(0, 64, (2, 16)))
    finally:
        monitor.detach()


def test_reduce_overhead_compile_measures_as_eager():
    """torch.compile(mode="reduce-overhead") (CUDA graphs on a GPU, tests/test_attach_gpu.py; inductor
    alone on CPU): every measured step's statistics equal eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = NanoGPT(vocab=32, d_model=16, n_heads=2, n_layers=1, seq_len=8)
    x = torch.randint(0, 32, (2, 8))
    with fastdiag.attach(model, every=1) as monitor:
        model(x)
        want = monitor.latest_stats()
    monitor = fastdiag.attach(model, every=2)
    try:
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():    # forward graphs only: the compile stays short
            for _ in range(4):
                compiled(x)
        assert [r["step"] for r in monitor.history()] == [0, 2]
        got = monitor.latest_stats()
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name].gram.double(), want[name].gram.double(), rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(got[name].entropy_sum.double(), want[name].entropy_sum.double(),
                                       rtol=1e-5, atol=1e-7)
    finally:
        monitor.detach()
        torch._dynamo.reset()
