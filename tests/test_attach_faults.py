"""fastdiag.attach under faults: a logger that raises, a forward that raises midway, copies and
pickles of an attached model, bad arguments caught at attach, nested monitors, other threads."""
import copy
import io
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import fastdiag
from fastdiag.core.monitor import _MONITORS

from tests.helpers import StandInZooAttention, TwoLayers, assert_stats_close, reference_stats
from tests.helpers import nano as _nano


def _hook_state(model):
    return {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m.__dict__))
            for name, m in model.named_modules()}


def assert_model_as_before(model, before):
    after = _hook_state(model)
    assert after.keys() == before.keys()
    for name in before:
        assert after[name][0] == before[name][0] and after[name][1] == before[name][1]
        assert after[name][2].keys() == before[name][2].keys()
        for attr in ("record", "stats", "diag_backend"):
            assert after[name][2].get(attr) is before[name][2].get(attr), (name, attr)
    assert torch.overrides._get_current_function_mode_stack() == []


# ---- a logger that raises --------------------------------------------------------------------

class DiskFullOnce:
    """A SummaryWriter look-alike whose disk is full for one call."""

    def __init__(self):
        self.calls, self.scalars = 0, []

    def add_scalar(self, tag, value, step):
        self.calls += 1
        if self.calls == 1:
            raise OSError(28, "No space left on device")
        self.scalars.append((step, tag))


@pytest.mark.parametrize("kind", ["writer", "callable"])
def test_a_logger_that_raises_is_reported_and_never_breaks_training_or_detach(kind):
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    writer = DiskFullOnce()
    log = writer if kind == "writer" else (lambda step, values: writer.add_scalar("all", values, step))
    monitor = fastdiag.attach(model, every=1, log=log, flush_every=1)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        model(x).sum().backward()             # step 0's record: the logger raises inside the step
    for _ in range(3):
        model(x).sum().backward()             # later steps are not poisoned
    monitor.detach()                          # nor is detach
    assert monitor.step == 4 and len(monitor.history()) == 4
    assert {step for step, _ in writer.scalars} == {0, 1, 2, 3}   # the failed record is sent again
    assert not _MONITORS and not any(m._forward_hooks for m in model.modules())


def test_a_logger_that_always_raises_does_not_break_detach():
    model = _nano()
    monitor = fastdiag.attach(model, every=1, log=lambda step, values: 1 / 0, flush_every=100)
    model(torch.randint(0, 32, (2, 8)))
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError"):
        monitor.detach()
    assert not _MONITORS and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ---- a forward that raises midway -------------------------------------------------------------

class FailsInSecondLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = TwoLayers()
        self.fail = False

    def forward(self, x):
        x = x + self.body.layers[0](x)
        if self.fail:
            raise RuntimeError("out of memory (stand-in)")
        return x + self.body.layers[1](x)


def test_a_forward_that_raises_midway_leaves_no_partial_record():
    torch.manual_seed(0)
    model = FailsInSecondLayer()
    x = torch.randn(2, 6, 16)
    monitor = fastdiag.attach(model, every=2)
    model.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        model(x)                     # layer 0 measured, layer 1 never reached
    assert monitor.num_records == 0 and monitor.step == 0   # not a step: the next pass is measured
    model.fail = False
    model(x)
    assert monitor.num_records == 1 and list(monitor.latest_stats()) == ["body.layers.0", "body.layers.1"]
    for i, layer in enumerate(model.body.layers):
        assert_stats_close(monitor.latest_stats()[f"body.layers.{i}"], reference_stats(*layer.last))
    monitor.detach()



class InterruptedInSecondLayer(FailsInSecondLayer):
    def forward(self, x):
        x = x + self.body.layers[0](x)
        if self.fail:
            raise KeyboardInterrupt      # Ctrl-C in a notebook cell: no Exception, torch runs no always_call hook
        return x + self.body.layers[1](x)


def test_a_forward_interrupted_by_ctrl_c_leaves_no_mode_behind_and_the_next_pass_is_exact():
    """A KeyboardInterrupt (a BaseException) inside a measured pass skips the root's end hook (torch runs
    always_call hooks for an Exception only): before, the monitor's mode stayed on torch's stack and its
    global hooks stayed registered, the next pass was taken for a nested call of the interrupted one, and
    record held the interrupted pass's layer as well ('body.layers.0#1', averaged into s̄). The next pass finds the interrupted one gone and ends it first."""
    torch.manual_seed(0)
    model = InterruptedInSecondLayer()
    x = torch.randn(2, 6, 16)
    monitor = fastdiag.attach(model, every=1)
    model.fail = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    model.fail = False
    model(x)
    assert torch.overrides._get_current_function_mode_stack() == []
    assert not torch.nn.modules.module._global_forward_hooks
    assert monitor.num_records == 1 and monitor.step == 1
    assert list(monitor.latest_stats()) == ["body.layers.0", "body.layers.1"]   # no 'body.layers.0#1'
    for i, layer in enumerate(model.body.layers):
        assert_stats_close(monitor.latest_stats()[f"body.layers.{i}"], reference_stats(*layer.last))
    monitor.detach()

# ---- copies and pickles ----------------------------------------------------------------------

def test_a_deepcopy_of_an_attached_model_is_clean():
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    monitor = fastdiag.attach(model, every=1)
    model(x)
    ema = copy.deepcopy(model)
    for _ in range(3):
        out = ema(x)
    assert monitor.step == 1 and monitor.num_records == 1     # the copy is not measured
    monitor.detach()
    fresh = copy.deepcopy(model)
    torch.testing.assert_close(out, fresh(x), rtol=0, atol=0)  # the copy's forward is the model's own
    with fastdiag.attach(ema, every=1) as own:                 # a copy may get its own monitor
        ema(x)
    assert own.num_records == 1 and monitor.num_records == 1


def test_torch_save_of_an_attached_model_works_and_loads_without_a_monitor():
    model = _nano()
    x = torch.randint(0, 32, (2, 8))
    monitor = fastdiag.attach(model, every=1)
    model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    steps = monitor.step
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert monitor.step == steps + 1                        # only the model's own pass counted
    with fastdiag.attach(loaded, every=1) as own:
        loaded(x)
    assert own.num_records == 1
    monitor.detach()


# ---- arguments checked at attach ----------------------------------------------------------------

@pytest.mark.parametrize("chunk_bytes", [0, -1, 1.5, None, "64MB", True])
def test_bad_chunk_bytes_is_refused_at_attach(chunk_bytes):
    with pytest.raises(ValueError, match="chunk_bytes"):
        fastdiag.attach(_nano(), chunk_bytes=chunk_bytes)
    assert not _MONITORS


def test_triton_backend_without_a_gpu_or_the_interpreter_is_refused_at_attach():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device runs the Triton kernel")
    code = ("import torch, fastdiag\n"
            "from fastdiag.testing import NanoGPT\n"
            "model = NanoGPT(vocab=32, d_model=16, n_heads=4, n_layers=1, seq_len=8)\n"
            "try:\n"
            "    fastdiag.attach(model, backend='triton')\n"
            "except ValueError as e:\n"
            "    print('refused:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.startswith("refused: backend:"), out.stdout + out.stderr


# ---- nested monitors --------------------------------------------------------------------------

class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(StandInZooAttention(), StandInZooAttention())
        self.sdpa = TwoLayers()

    def forward(self, x):
        return self.sdpa(self.inner(x))


@pytest.mark.parametrize("order", ["in-order", "out-of-order"])
def test_nested_monitors_measure_exactly_and_restore_the_model_in_any_detach_order(order):
    torch.manual_seed(0)
    model = Outer()
    x = torch.randn(2, 5, 16)
    before = _hook_state(model)
    want = model(x)
    inner = fastdiag.attach(model.inner, every=1, backend="reference")
    outer = fastdiag.attach(model, every=1, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert list(inner.latest_stats()) == ["0", "1"]
    # the inner monitor's own statistics (softmaxes over [B, H, rows, Tk]) are never attention to
    # the outer one: exactly one entry per layer
    assert list(outer.latest_stats()) == ["inner.0", "inner.1", "sdpa.layers.0", "sdpa.layers.1"]
    for name, m in zip(("0", "1"), model.inner):
        reference = fastdiag.head_stats(m.probs, backend="reference")
        assert_stats_close(inner.latest_stats()[name], reference)
        assert_stats_close(outer.latest_stats()["inner." + name], reference)
    for i, layer in enumerate(model.sdpa.layers):
        assert_stats_close(outer.latest_stats()[f"sdpa.layers.{i}"], reference_stats(*layer.last))
    first, second = (inner, outer) if order == "out-of-order" else (outer, inner)
    first.detach()
    model(x)
    assert second.num_records == 2
    second.detach()
    assert_model_as_before(model, before)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_nested_monitors_on_sdpa_layers_see_only_the_models_attention():
    torch.manual_seed(0)
    model = nn.Sequential(TwoLayers())
    x = torch.randn(2, 6, 16)
    a = fastdiag.attach(model[0], every=1)
    b = fastdiag.attach(model, every=1)
    model(x)
    assert list(a.latest_stats()) == ["layers.0", "layers.1"]
    assert list(b.latest_stats()) == ["0.layers.0", "0.layers.1"]
    for i, layer in enumerate(model[0].layers):
        want = reference_stats(*layer.last)
        assert_stats_close(a.latest_stats()[f"layers.{i}"], want)
        assert_stats_close(b.latest_stats()[f"0.layers.{i}"], want)
    a.detach()
    b.detach()


# ---- threads ----------------------------------------------------------------------------------

def test_the_same_model_run_by_another_thread_during_a_measured_pass_is_not_recorded():
    """An evaluation thread running the attached model while a training pass is being measured:
    that pass's records are the training pass's alone, and the other pass is not a step."""
    torch.manual_seed(0)
    started, release = threading.Event(), threading.Event()

    class PausingTwoLayers(TwoLayers):   # holds the main thread's pass between its two layers
        def forward(self, x):
            x = x + self.layers[0](x)
            if threading.current_thread() is threading.main_thread():
                started.set()
                release.wait(60)
            return x + self.layers[1](x)

    model = PausingTwoLayers()
    x, y = torch.randn(2, 6, 16), torch.randn(3, 6, 16)
    with fastdiag.attach(model, every=1, measure_eval=True) as monitor:
        def evaluate():
            started.wait(60)
            with torch.no_grad():
                model(y)            # the same model, another thread, while step 0 is being measured
            release.set()

        worker = threading.Thread(target=evaluate)
        worker.start()
        model(x)
        worker.join()
        main_pass = [layer.last for layer in model.layers]
    assert monitor.step == 1 and monitor.num_records == 1
    stats = monitor.latest_stats()
    assert list(stats) == ["layers.0", "layers.1"]
    assert_stats_close(stats["layers.1"], reference_stats(*main_pass[1]))
    model.layers[0](x)                                 # layer 0's q and k of x again (the thread overwrote them)
    assert_stats_close(stats["layers.0"], reference_stats(*model.layers[0].last))



class _Uses(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.lin, self.att = nn.Linear(16, 16), attention

    def forward(self, x):
        return self.att(self.lin(x))


def test_an_attention_module_shared_by_two_attached_models_is_measured_by_each_quietly():
    """One attention module in two attached models (shared weights): each model's pass measures it, exact.
    Before, the first model's hook on it took the second model's pass for a call outside any pass and said
    'nothing there is measured', which was false."""
    from tests.helpers import SDPALayer

    torch.manual_seed(0)
    shared = SDPALayer()
    first, second = _Uses(shared), _Uses(shared)
    x = torch.randn(2, 6, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(first, every=1) as a, fastdiag.attach(second, every=1) as b:
            first(x)
            want_first = reference_stats(*shared.last)
            second(x)
            want_second = reference_stats(*shared.last)
            assert list(a.latest_stats()) == ["att"] and list(b.latest_stats()) == ["att"]
            assert_stats_close(a.latest_stats()["att"], want_first)
            assert_stats_close(b.latest_stats()["att"], want_second)
    assert not [str(w.message) for w in caught if "fastdiag" in str(w.message)]

class _TwoBlocks(torch.nn.Module):
    def __init__(self, checkpointed=None):
        super().__init__()
        from tests.helpers import SDPALayer
        self.block, self.block2, self.checkpointed = SDPALayer(), SDPALayer(), checkpointed

    def forward(self, x):
        if self.checkpointed is None:
            return self.block2(self.block(x))
        from torch.utils.checkpoint import checkpoint
        x = checkpoint(self.block, x, use_reentrant=self.checkpointed == "reentrant")
        return checkpoint(self.block2, x, use_reentrant=self.checkpointed == "reentrant")


def test_forward_called_directly_is_said_not_silently_unmeasured():
    """``model.forward(x)`` skips the root's hooks, which count and measure steps: the attention modules
    inside run with no pass around them and nothing is measured. It used to be silent (latest() None,
    no warning); now one warning names the module, in training (and on eval passes with measure_eval),
    never on a plain no-grad evaluation."""
    torch.manual_seed(0)
    model, x = _TwoBlocks(), torch.randn(2, 6, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            model.eval()
            with torch.no_grad():
                model.forward(x)
            quiet = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
            model.train()
            for _ in range(2):
                model.forward(x).sum().backward()
            assert monitor.latest() is None and monitor.step == 0
    warned = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
    assert quiet == []
    assert len(warned) == 1 and "'block' (SDPALayer) ran outside any forward pass" in warned[0], warned


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_recomputes_quietly_and_stays_exact(how):
    """Checkpointed blocks run their forward again inside the backward pass, after the model's pass has
    ended: not a forward called outside a pass, so nothing is said, and the statistics are the forward's."""
    from tests.helpers import assert_stats_close, reference_stats
    torch.manual_seed(0)
    model, x = _TwoBlocks(how), torch.randn(2, 6, 16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            model(x).sum().backward()
            stats = monitor.latest_stats()
    assert [str(w.message) for w in caught if "fastdiag" in str(w.message)] == []
    assert set(stats) == {"block", "block2"}
    assert_stats_close(stats["block2"], reference_stats(*model.block2.last), 1e-4)


@pytest.mark.parametrize("when", ["after attach", "before attach"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_submodule_replaced_by_its_compiled_wrapper_after_attach_keeps_the_step_running(fullgraph, when):
    """``model.blocks = torch.compile(model.blocks)`` after attach, the root eager: the measured pass's global
    module hooks (another model's modules) ran inside the compiled region, and dynamo raised in the user's step
    (AssertionError: ... already tracked for mutation; found by round5). Now they step aside where traced, and
    the wrapper of the model's own module is no other model: bit-identical, the blocks' layers exact. Compiled
    before attach, the layers have the same names (torch.compile's ``_orig_mod`` is no part of a name: they
    were ``blocks._orig_mod.layers.0``; found by round5)."""
    class Host(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = TwoLayers()

        def forward(self, x):
            return self.blocks(x)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Host()
    twin = copy.deepcopy(model)
    twin.blocks = torch.compile(twin.blocks, backend="eager", fullgraph=fullgraph)
    x = torch.randn(2, 6, 16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastdiag")     # nothing named: no layer left out
        if when == "before attach":
            model.blocks = torch.compile(model.blocks, backend="eager", fullgraph=fullgraph)
        with fastdiag.attach(model, every=1) as monitor:
            if when == "after attach":
                model.blocks = torch.compile(model.blocks, backend="eager", fullgraph=fullgraph)
            out = model(x)
            stats = monitor.latest_stats()
    want = twin(x)
    out.square().mean().backward()
    want.square().mean().backward()
    assert torch.equal(out, want)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
    layers = model.blocks._orig_mod.layers
    assert sorted(stats) == ["blocks.layers.0", "blocks.layers.1"]
    for i, layer in enumerate(layers):
        assert_stats_close(stats[f"blocks.layers.{i}"], reference_stats(*layer.last))
