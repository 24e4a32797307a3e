"""fastdiag.attach under torch.compile(fullgraph=True): two graphs (measured / not), never one per
step, and the same statistics as eager."""
import pytest
import torch

import fastdiag
from fastdiag.testing import NanoGPT

from tests.helpers import assert_stats_close


def _counting(backend):
    """A dynamo backend that counts the graphs it is given and hands them to ``backend``."""
    graphs = []

    def compile_graph(gm, example_inputs):
        graphs.append(gm)
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return gm.forward

    return compile_graph, graphs


def _run(model, x, steps, compile_mode, backend):
    torch._dynamo.reset()
    count, graphs = _counting(backend)
    with fastdiag.attach(model, every=3) as monitor:
        if compile_mode == "torch.compile":
            run = torch.compile(model, backend=count, fullgraph=True)
        else:
            model.compile(backend=count, fullgraph=True)
            run = model
        for _ in range(steps):
            run(x).square().mean().backward()
        stats = monitor.latest_stats()
    if compile_mode == "model.compile":
        model._compiled_call_impl = None  # back to eager for the reference
    return monitor, stats, graphs


def _eager_stats(model, x):
    with fastdiag.attach(model, every=1) as monitor:
        model(x)
    return monitor.latest_stats()


@pytest.mark.parametrize("compile_mode,backend", [("torch.compile", "inductor"), ("model.compile", "eager")])
def test_nanogpt_sdpa_compiles_fullgraph_into_two_graphs(compile_mode, backend):
    torch.manual_seed(0)
    model = NanoGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8)
    x = torch.randint(0, 32, (2, 8))
    monitor, stats, graphs = _run(model, x, steps=7, compile_mode=compile_mode, backend=backend)
    assert len(graphs) == 2, "one graph measured, one not; the step counter must not recompile"
    assert [r["step"] for r in monitor.history()] == [0, 3, 6]
    # the parameters moved during training: compare with eager at the final weights
    want = _eager_stats(model, x)
    for name in ("blocks.0", "blocks.1"):
        assert_stats_close(stats[name].to(torch.float64), want[name].to(torch.float64))


def test_zoo_transformer_compiles_fullgraph():
    models = pytest.importorskip("fastdiag.models")
    torch.manual_seed(0)
    model = models.build("transformer", preset="custom", n_layers=2, n_heads=4, d_model=32, d_ff=64,
                         vocab_size=20, seq_len=6)
    x = torch.randint(0, 20, (3, 6))
    monitor, stats, graphs = _run(model, x, steps=4, compile_mode="torch.compile", backend="eager")
    assert len(graphs) == 2
    assert [r["step"] for r in monitor.history()] == [0, 3]
    want = _eager_stats(model, x)
    assert list(stats) == list(want)
    for name in want:
        assert_stats_close(stats[name].to(torch.float64), want[name].to(torch.float64))


def test_attach_to_an_already_compiled_model():
    """attach(torch.compile(model)) after compiled calls: hooks go on the module inside the wrapper."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = NanoGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8)
    x = torch.randint(0, 32, (2, 8))
    count, graphs = _counting("eager")
    compiled = torch.compile(model, backend=count, fullgraph=True)
    want = compiled(x)
    with fastdiag.attach(compiled, every=2) as monitor:
        for _ in range(4):
            out = compiled(x)
    assert torch.equal(out, want)
    assert [r["step"] for r in monitor.history()] == [0, 2]
    assert list(monitor.latest_stats()) == ["blocks.0", "blocks.1"]
    assert torch.equal(compiled(x), want)  # detached: back to the unmeasured graph
    assert len(graphs) <= 4  # before attach, measured, unmeasured with hooks, after detach
