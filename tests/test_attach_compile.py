"""fastdiag.attach under torch.compile(fullgraph=True): two graphs (measured / not), never one per
step, and the same statistics as eager."""
import pickle
import re
import warnings
from copy import deepcopy

import pytest
import torch

import fastdiag
from fastdiag.core import calls
from fastdiag.testing import NanoGPT

from tests.helpers import SDPALayer, TwoLayers, assert_named, assert_stats_close, reference_stats


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


# ---- the layout of a compiled softmax: confirmed by the stated head count, or named -------------------
# Under torch.compile the product with values is not tracked, so the layout of a softmax over the last
# axis is not read from it: it is recorded as [B, H, Tq, Tk] only where the module states its head count
# H and dim 1 alone of dims 0-2 has H; otherwise the module is named and nothing is recorded for it.

class Hand(torch.nn.Module):
    """Hand-written attention over [B, T, 16] inputs with 4 heads; scores laid out [B, H, Tq, Tk]
    ("bhqk") or [B, Tq, H, Tk] ("bqhk", by einsum), softmax(-1); ``heads`` stated as ``num_heads``
    (or not). ``self.used``: the probabilities it multiplied V by, [B, H, Tq, Tk] float64."""

    def __init__(self, layout, stated):
        super().__init__()
        self.layout, self.proj = layout, torch.nn.Linear(16, 48)
        if stated:
            self.num_heads = 4

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 4) for z in self.proj(x).chunk(3, -1))
        if self.layout == "bhqk":
            p = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)).mul(0.5).softmax(-1)
            self.used = p.detach().double()
            return (p @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, 16)
        p = torch.einsum("bqhd,bkhd->bqhk", q, k).mul(0.5).softmax(-1)
        self.used = p.detach().double().transpose(1, 2)
        return torch.einsum("bqhk,bkhd->bqhd", p, v).reshape(b, t, 16)


class HandNet(torch.nn.Module):
    def __init__(self, layout, stated):
        super().__init__()
        self.embed = torch.nn.Linear(16, 16)
        self.mixer = Hand(layout, stated)

    def forward(self, x):
        return self.mixer(self.embed(x))


def _compiled_pass(model, x, strict=False):
    """One compiled (fullgraph, eager backend) forward and backward with attach, checked bit-identical
    to the model without attach: (the monitor, fastdiag's warnings)."""
    torch._dynamo.reset()

    def run(m):
        return m(**x) if isinstance(x, dict) else m(x)

    want = run(model)
    want.square().mean().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = fastdiag.attach(model, every=1, strict=strict)
        try:
            got = run(compiled)
            got.square().mean().backward()
        finally:
            monitor.detach()
    assert torch.equal(got, want)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grads))
    return monitor, [str(w.message) for w in caught if "fastdiag" in str(w.message)]


def test_a_compiled_softmax_is_recorded_where_the_stated_heads_confirm_its_layout():
    """[B, H, Tq, Tk] with 4 stated heads, batch 2, 6 tokens: only dim 1 has 4, so it is exact, quietly."""
    torch.manual_seed(0)
    model, x = HandNet("bhqk", stated=True), torch.randn(2, 6, 16)
    monitor, warned = _compiled_pass(model, x)
    assert not warned, warned
    assert_stats_close(monitor.latest_stats()["mixer"], fastdiag.head_stats(model.mixer.used, backend="reference"),
                       1e-4)


@pytest.mark.parametrize("layout,stated,b,t,why", [
    ("bqhk", False, 2, 6, "states no head count"),                    # before: read as [B, H, Tq, Tk], error 1.7
    ("bqhk", True, 2, 6, "dim 1 is not the module's 4 heads"),
    ("bqhk", True, 2, 4, "dims 1 and 2 each have the module's 4 heads"),  # Tq = H: before, error 0.49
    ("bhqk", True, 2, 4, "dims 1 and 2 each have the module's 4 heads"),  # right as written, but not confirmed
    ("bhqk", True, 4, 6, "dims 0 and 1 each have the module's 4 heads"),  # B = H: [H, B, Tq, Tk] would fit too
])
def test_a_compiled_softmax_whose_layout_is_not_confirmed_is_named_not_recorded(layout, stated, b, t, why):
    torch.manual_seed(0)
    model, x = HandNet(layout, stated), torch.randn(b, t, 16)
    monitor, warned = _compiled_pass(model, x)
    assert monitor.latest() is None
    assert "torch.compile" in monitor.coverage()["missing"]["mixer"]
    assert len(warned) == 1 and "'mixer' (Hand)" in warned[0] and why in warned[0], warned
    with pytest.raises(RuntimeError, match="'mixer'.*torch.compile"):
        _compiled_pass(model, x, strict=True)


class LogDomain(torch.nn.Module):
    """Attention whose probabilities are formed in the log domain, over [B, H, Tq, Tk] scores."""

    def __init__(self, how):
        super().__init__()
        self.how, self.proj = how, torch.nn.Linear(16, 48)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.proj(x).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) * 0.5
        p = scores.log_softmax(-1).exp() if self.how == "log_softmax" else (scores - scores.logsumexp(-1, keepdim=True)).exp()
        return x + (p @ v).transpose(1, 2).reshape(b, t, 16)


@pytest.mark.parametrize("how", ["log_softmax", "logsumexp"])
def test_compiled_attention_formed_in_the_log_domain_beside_a_measured_layer_is_named(how):
    """log_softmax(s).exp() (measured eager) and exp(s − logsumexp) under torch.compile: the product with
    values is not followed there, so the module is named, never silently left out of s̄ (before: the
    SDPA layer beside it alone was recorded, with no word)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mixer = SDPALayer(), LogDomain(how)

        def forward(self, x):
            return self.mixer(self.attn(x))

    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 6, 16)
    monitor, warned = _compiled_pass(model, x)
    assert list(monitor.latest_stats()) == ["attn"]
    assert "mixer" in monitor.coverage()["missing"]
    assert len(warned) == 1 and "'mixer' (LogDomain)" in warned[0], warned
    with pytest.raises(RuntimeError, match="'mixer'"):
        _compiled_pass(model, x, strict=True)


def test_a_compiled_hugging_face_eager_llama_stays_exact_and_quiet():
    """Llama's eager attention states its heads in its config only (num_attention_heads 4; batch 2, 10
    tokens): confirmed, exact against float64 of the model's own output_attentions, no warning."""
    hf = pytest.importorskip("tests.hf_matrix")
    model = hf.build("llama (GQA)", "eager")
    batch = hf.inputs("llama (GQA)", padded=False)
    want = hf.reference("llama (GQA)", model, batch)

    class Logits(torch.nn.Module):   # the compiled callable returns a tensor
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    wrapper = Logits()
    monitor, warned = _compiled_pass(wrapper, batch)
    assert not warned, warned
    got = list(monitor.latest_stats().values())
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert_stats_close(g, w, hf.TOL)


# ---- another model run inside a compiled one ---------------------------------------------------------

@pytest.mark.parametrize("where,layers", [
    ("root", 2),
    ("block", 1),
    ("block", 2),
    ("root", 1),
])
@pytest.mark.parametrize("held", ["list", "closure", "global", "unread", "misread"])
def test_a_foreign_model_in_a_compiled_model_is_not_folded_into_a_layer(where, layers, held, monkeypatch):
    """A frozen teacher outside the student's tree, called in its forward, compiled. Held in a list
    attribute, its modules are hooked at attach; reached through a closure or a global, nothing hooks it,
    and dynamo's module stack read while tracing tells its attention ops apart: either way they are
    another model's, named, and the student's layer is exact, whoever calls the teacher. Where dynamo's
    stack is not read ("unread": another torch; "misread": reading it fails, the trace goes on), the rules
    without it name every case: a call holding its own attention and the teacher's (or the teacher's two)
    is named as two attention ops in one call, never recorded as ``block#1``; a one-op teacher called by
    the root is named as attention beside the attention of the modules it contains."""
    from tests.helpers import SDPALayer, TwoLayers, reference_stats
    from tests.test_attach_forms import Student

    torch.manual_seed(5)
    teacher = (SDPALayer() if layers == 1 else TwoLayers()).requires_grad_(False)
    torch.manual_seed(0)
    model = Student(teacher, where)
    monkeypatch.setitem(globals(), "_GLOBAL_TEACHER", teacher)
    if held == "global":
        model.frozen = model.block.frozen = [_call_global_teacher]
    elif held != "list":
        model.frozen = model.block.frozen = [lambda x: teacher(x)]
    if held == "unread":
        monkeypatch.setattr(calls, "stack_reader_ready", lambda: False)
    elif held == "misread":     # reading dynamo's stack fails at trace time: no conclusion, the trace goes on
        monkeypatch.setattr(calls.AttentionCalls, "verdict", lambda *args: 1 / 0)
    monitor, warned = _compiled_pass(model, torch.randn(2, 6, 16))
    caller = "<root>" if where == "root" else where
    if held not in ("unread", "misread"):
        assert set(monitor.latest_stats()) == {"block"}
        assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
        assert monitor.coverage()["missing"] == {}
        outer = "SDPALayer" if layers == 1 else "TwoLayers"
        assert any(f"attention in SDPALayer, part of {outer}: a module outside the attached model called by "
                   f"{caller!r} (" in w for w in warned), warned
        return
    assert set(monitor.latest_stats() or {}) <= {"block"}
    why = "beside attention in the modules it contains" if (where, layers) == ("root", 1) else "2 attention ops"
    assert why in monitor.coverage()["missing"][caller]
    assert any(f"{caller!r}" in w and why in w for w in warned), warned


_GLOBAL_TEACHER = None   # a teacher reached through a global (set by the tests that use it)


def _call_global_teacher(x):
    return _GLOBAL_TEACHER(x)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "recompiled"])
def test_the_compiled_layout_check_holds_at_another_sequence_length(dynamic):
    """A compiled model seeing other sequence lengths, with dynamic shapes (Tq symbolic) or
    recompiled per length: the layout check runs on each pass's own shapes. [B, H, Tq, Tk] with 4 stated
    heads is confirmed and exact at 6 and 7 tokens; at 4 tokens (Tq = H) it cannot be confirmed, so that
    pass is named and records nothing — never recorded on the strength of another length's check."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = HandNet("bhqk", stated=True)
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=dynamic)
    xs = [torch.randn(2, t, 16) for t in (6, 4, 7)]
    wants = [model(x) for x in xs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            for x, want in zip(xs, wants):
                t = x.shape[1]
                records = monitor.num_records
                assert torch.equal(compiled(x), want)         # the compiled output is the model's own
                if t == 4:
                    assert monitor.num_records == records       # named below, nothing recorded
                    continue
                assert monitor.num_records == records + 1
                assert_stats_close(monitor.latest_stats()["mixer"],
                                   fastdiag.head_stats(model.mixer.used, backend="reference"), 1e-4)
    warned = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
    assert len(warned) == 1, warned
    assert "'mixer' (Hand)" in warned[0] and "(2, 4, 4, 4)" in warned[0] and "dims 1 and 2" in warned[0]


# ---- a teacher called by a module with no attention of its own (a loss head), compiled --------------

class LossHead(torch.nn.Module):
    """A loss head with no attention of its own and no submodules (a leaf): it calls a frozen teacher,
    kept outside the module tree, on its input. ``holder``: where the teacher is kept ("list", "dict",
    "setattr": ``object.__setattr__``, or None: handed in by the caller)."""

    def __init__(self, teacher=None, holder=None):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))
        if holder is not None:
            _hold(self, teacher, holder)

    def forward(self, x, teacher=None):
        teacher = _held(self) if teacher is None else teacher
        with torch.no_grad():
            target = teacher(x)
        return (x * self.scale - target).square().mean(-1)


def _hold(module, teacher, holder):
    if holder == "closure":
        module.frozen = [lambda x: teacher(x)]
    elif holder == "global":    # the test sets _GLOBAL_TEACHER
        module.frozen = [_call_global_teacher]
    elif holder == "list":
        module.frozen = [teacher]
    elif holder == "dict":
        module.frozen = {"teacher": teacher}
    else:
        object.__setattr__(module, "teacher", teacher)


def _held(module):
    frozen = module.__dict__.get("frozen")
    return module.teacher if frozen is None else frozen[0] if isinstance(frozen, list) else frozen["teacher"]


class Distilled(torch.nn.Module):
    """One attention layer of its own (``block``) and a loss head calling a one-op teacher kept outside
    the tree, on the head (``on="head"``) or on the root, handed to the head (``on="root"``)."""

    def __init__(self, teacher, holder, on):
        super().__init__()
        self.block = SDPALayerOf()
        self.on = on
        self.head = LossHead(teacher, holder) if on == "head" else LossHead()
        if on == "root":
            _hold(self, teacher, holder)

    def forward(self, x):
        h = x + self.block(x)
        return self.head(h, _held(self) if self.on == "root" else None)


def SDPALayerOf():
    from tests.helpers import SDPALayer
    return SDPALayer()


def _one_op_teacher(form):
    torch.manual_seed(5)
    teacher = SDPALayerOf() if form == "sdpa" else Hand("bhqk", stated=True)
    return teacher.requires_grad_(False)


# every holder with an SDPA teacher; the softmax teacher with one holder of each kind (hooks, dynamo's stack)
@pytest.mark.parametrize("form,holder,on", [
    *(("sdpa", holder, on) for holder, on in [("list", "head"), ("setattr", "head"), ("dict", "head"),
                                              ("list", "root"), ("setattr", "root"), ("dict", "root"),
                                              ("closure", "head"), ("global", "head")]),
    ("softmax", "list", "head"), ("softmax", "dict", "root"), ("softmax", "closure", "head"),
    ("softmax", "global", "head")])
def test_a_teacher_called_by_a_compiled_loss_head_is_no_layer_of_it(form, holder, on, monkeypatch):
    """A one-op teacher called by a module with no attention of its own, compiled: its attention is
    another model's, named as such, never recorded as the head's layer; the student's layer is exact.
    Held in an attribute, its hooks tell it; through a closure or a global, dynamo's module stack."""
    from tests.helpers import reference_stats

    teacher = _one_op_teacher(form)
    monkeypatch.setitem(globals(), "_GLOBAL_TEACHER", teacher)
    torch.manual_seed(0)
    model = Distilled(teacher, holder, on)
    monitor, warned = _compiled_pass(model, torch.randn(2, 6, 16))
    assert set(monitor.latest_stats()) == {"block"}, monitor.latest_stats()
    assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
    assert monitor.coverage()["missing"] == {}
    inner = "SDPALayer" if form == "sdpa" else "Hand"
    assert any("outside the attached model called by 'head' (LossHead)" in w and f"attention in {inner}" in w
               for w in warned), warned


@pytest.mark.parametrize("holder", ["closure", "global"])
def test_where_dynamos_stack_is_not_read_a_compiled_loss_heads_attention_is_said_to_be_unchecked(holder, monkeypatch):
    """Where this torch's traced module stack cannot be read (another torch, or reading it fails), a
    one-op teacher reached through a closure or a global and called by the loss head is recorded as the
    head's layer — and said: one warning names the layers whose attention was recorded without the check
    (before, nothing was said)."""
    teacher = _one_op_teacher("sdpa")
    monkeypatch.setitem(globals(), "_GLOBAL_TEACHER", teacher)
    monkeypatch.setattr(calls, "stack_reader_ready", lambda: False)
    torch.manual_seed(0)
    model = Distilled(teacher, holder, "head")
    monitor, warned = _compiled_pass(model, torch.randn(2, 6, 16))
    assert set(monitor.latest_stats()) == {"block", "head"}
    said = [w for w in warned if "could not be read" in w]
    assert len(said) == 1 and "'head'" in said[0] and "'block'" in said[0], warned


@pytest.mark.parametrize("form,holder", [("sdpa", "list"), ("softmax", "closure")])
def test_a_teacher_attached_itself_inside_a_compiled_student_is_measured_as_its_own(form, holder):
    """The teacher called by the loss head is attached with a monitor of its own: each monitor records its
    own model's attention exactly, the student's never the teacher's. (Its root hooks are a graph break
    inside the student's graph: compiled without fullgraph, docs/attach.md "torch.compile"; the teacher
    then runs in a frame of its own, told by the frame's module.)"""
    from tests.helpers import reference_stats

    torch._dynamo.reset()
    teacher = _one_op_teacher(form)
    torch.manual_seed(0)
    model = Distilled(teacher, holder, "head")
    x = torch.randn(2, 6, 16)
    want = model(x)
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fastdiag.attach(teacher, every=1) as of_teacher, fastdiag.attach(model, every=1) as of_student:
            for _ in range(2):
                got = compiled(x)
                got.sum().backward()
                assert torch.equal(got, want)
                assert set(of_student.latest_stats()) == {"block"}
                assert set(of_teacher.latest_stats()) == {"<root>"}
                assert_stats_close(of_student.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
                want_teacher = (reference_stats(*teacher.last) if form == "sdpa"
                                else fastdiag.head_stats(teacher.used, backend="reference"))
                assert_stats_close(of_teacher.latest_stats()["<root>"], want_teacher, 1e-4)
    assert of_student.coverage()["missing"] == {} and of_teacher.coverage()["missing"] == {}


def test_a_held_teacher_adds_no_graph_and_its_hooks_go_with_detach():
    """The teacher's hooks are held while attached, so the compiled student still has two graphs
    (measured, not) over seven steps; each measured step records the student's layer alone. A teacher
    held only after attach is found at the next measured pass's begin. Detached, no hook is left on it."""
    from tests.helpers import reference_stats

    torch._dynamo.reset()
    teacher = _one_op_teacher("sdpa")
    torch.manual_seed(0)
    model = Distilled(teacher, "list", "head")
    x = torch.randn(2, 6, 16)
    count, graphs = _counting("eager")
    compiled = torch.compile(model, backend=count, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fastdiag.attach(model, every=3) as monitor:
            assert teacher._forward_pre_hooks and teacher._forward_hooks
            for _ in range(7):
                compiled(x).sum().backward()
                if monitor.latest_stats() is not None:
                    assert set(monitor.latest_stats()) == {"block"}
            assert [r["step"] for r in monitor.history()] == [0, 3, 6]
            assert len(graphs) == 2, "the held teacher's hooks must not recompile the student"
            late = _one_op_teacher("sdpa")
            model.head.frozen = [late]       # a teacher held only now: found at the next measured begin
            for _ in range(3):
                compiled(x).sum().backward()
            assert monitor.history()[-1]["step"] == 9 and set(monitor.latest_stats()) == {"block"}
            assert monitor.coverage()["missing"] == {}
            assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
    for module in (teacher, late):
        assert not module._forward_pre_hooks and not module._forward_hooks


def test_a_module_held_back_by_the_model_is_no_other_model():
    """A submodule holding its parent (a back-reference in a list) or the model's own block in a plain
    attribute: their trees are this model's, not hooked as another model's; the block stays measured."""
    from tests.helpers import reference_stats

    torch.manual_seed(0)
    model = Distilled(_one_op_teacher("sdpa"), "list", "head")
    model.block.owner = [model]
    object.__setattr__(model.head, "shortcut", model.block)
    monitor, warned = _compiled_pass(model, torch.randn(2, 6, 16))
    assert set(monitor.latest_stats()) == {"block"}
    assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
    assert not model._forward_pre_hooks and not model.block._forward_pre_hooks    # none left after detach
    assert all("'head' (LossHead)" in w for w in warned), warned


class RootAttends(torch.nn.Module):
    """Attention in the root's own code (an attention pool over its block's output) beside the block's."""

    def __init__(self):
        super().__init__()
        from tests.helpers import SDPALayer
        self.block = SDPALayer()
        self.pool = torch.nn.Linear(16, 48)
        self.last = None

    def forward(self, x):
        h = x + self.block(x)
        b, t, _ = h.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.pool(h).chunk(3, -1))
        self.last = (q.detach(), k.detach())
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 16)


@pytest.mark.parametrize("read", [True, False], ids=["stack-read", "unread"])
def test_a_compiled_roots_own_attention_beside_its_blocks_is_exact_where_dynamos_stack_says_so(read, monkeypatch):
    """The root's own attention op beside its block's: dynamo's module stack at trace time shows no other
    model's module around it, so it is recorded, exact, as the eager pass records it. Where that stack
    is not read, it cannot be told from a teacher's op run by the root: named, not recorded."""
    from tests.helpers import reference_stats

    if not read:
        monkeypatch.setattr(calls, "stack_reader_ready", lambda: False)
    torch.manual_seed(0)
    model = RootAttends()
    monitor, warned = _compiled_pass(model, torch.randn(2, 6, 16))
    assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
    if read:
        assert not warned, warned
        assert set(monitor.latest_stats()) == {"<root>", "block"}
        assert_stats_close(monitor.latest_stats()["<root>"], reference_stats(*model.last), 1e-4)
    else:
        assert set(monitor.latest_stats()) == {"block"}
        assert "beside attention in the modules it contains" in monitor.coverage()["missing"]["<root>"]


def test_a_global_multihead_attention_called_by_a_compiled_loss_head_is_named(monkeypatch):
    """A bare torch.nn.MultiheadAttention reached through a global, called by the loss head: another
    model's attention (as in eager passes, where a torch.nn module that holds modules is another model),
    named, never the head's layer; a torch.nn softmax made on the fly stays the caller's own code."""
    from tests.helpers import reference_stats

    torch.manual_seed(5)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).requires_grad_(False)
    monkeypatch.setitem(globals(), "_GLOBAL_TEACHER", lambda x: mha(x, x, x, need_weights=False)[0])
    torch.manual_seed(0)
    model = Distilled(None, "global", "head")
    monitor, warned = _compiled_pass(model, torch.randn(2, 6, 16))
    assert set(monitor.latest_stats()) == {"block"} and monitor.coverage()["missing"] == {}
    assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
    assert any("attention in MultiheadAttention, part of MultiheadAttention: a module outside the attached model "
               "called by 'head' (LossHead)" in w for w in warned), warned


# ---- modules built inside a compiled forward (graph breaks: dynamo cannot build parameters) ----------

class BuildsInForward(torch.nn.Module):
    """An attention block, and a module built inside ``forward``: a frozen one-layer teacher built on
    every call by the root or by the block, or a layer built lazily on the first call and kept."""

    def __init__(self, what):
        super().__init__()
        from tests.helpers import SDPALayer
        self.block, self.what, self.proj = SDPALayer(), what, None
        if what == "teacher in block":
            self.block.forward = self._block_forward

    def _teacher_hint(self, x):
        from tests.helpers import SDPALayer
        with torch.no_grad():
            return 0 * SDPALayer().requires_grad_(False)(x)

    def _block_forward(self, x, attn_mask=None):
        from tests.helpers import SDPALayer
        return SDPALayer.forward(self.block, x + self._teacher_hint(x))

    def forward(self, x):
        if self.what == "teacher in root":
            x = x + self._teacher_hint(x)
        elif self.what == "lazy layer":
            if self.proj is None:
                self.proj = torch.nn.Linear(x.shape[-1], x.shape[-1])
            x = self.proj(x)
        return self.block(x)


@pytest.mark.parametrize("what", ["teacher in root", "teacher in block", "lazy layer"])
def test_a_module_built_inside_a_compiled_forward_keeps_the_users_step_running(what):
    """dynamo cannot build an ``nn.Linear`` in a graph: it breaks the graph and builds it in Python,
    with attach's function mode still traced around it. The mode's own check of whether it is being
    traced made ``Tensor.dim()`` come back None there, and the user's step raised TypeError in
    ``nn.init`` (torch 2.13) where it runs without attach. Now the step runs, bit-identical, and the
    block is exact, or named where its one call runs its own attention and the teacher's."""
    from tests.helpers import reference_stats
    torch.manual_seed(0)
    model, x = BuildsInForward(what), torch.randn(2, 6, 16)

    def step(attached):
        torch._dynamo.reset()
        torch.manual_seed(1)    # the modules built in forward draw their weights from it
        compiled = torch.compile(model, backend="eager")
        monitor = fastdiag.attach(model, every=1) if attached else None
        try:
            out = compiled(x)
            out.square().mean().backward()
        finally:
            if monitor is not None:
                monitor.detach()
        grads = [p.grad.clone() for p in model.block.parameters()]
        model.zero_grad()
        return out, grads, monitor

    want, want_grads = step(False)[:2]
    if what == "lazy layer":
        model.proj = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_grads, monitor = step(True)
    warned = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
    assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    if what == "teacher in block":     # its one call ran two attention ops: named, nothing recorded
        assert not monitor.latest_stats()
        assert_named(monitor, warned, "block", "2 attention ops")
        return
    assert set(monitor.latest_stats()) == {"block"}
    assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
    if what == "lazy layer":
        assert monitor.coverage()["missing"] == {} and warned == []
        return
    # the teacher's op, traced in a frame of its own after the break, is the root's own code to the
    # compiled pass: the root is named as such and nothing of the teacher is recorded
    assert_named(monitor, warned, "<root>", "cannot be told from another model's attention")


class BreaksBeforeSoftmax(torch.nn.Module):
    """Hand-written attention (heads stated) with a graph break between its scores and its softmax: the
    softmax is traced in a resumed frame that no longer holds the module (``self`` is not live there)."""

    def __init__(self, d=16, num_heads=4):
        super().__init__()
        self.qkv, self.num_heads, self.last = torch.nn.Linear(d, 3 * d), num_heads, None

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        self.last = (q.detach(), k.detach())
        scores = q @ k.transpose(-1, -2) / 2.0
        torch._dynamo.graph_break()
        return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, d)


def test_a_softmax_after_a_graph_break_is_exact_and_said_to_be_unchecked():
    """The resumed frame's module stack holds none of the model's modules, so whose attention the softmax
    is cannot be checked there: recorded as the layer's own (the hooks' call says so), exact, and the one
    warning names the layer and the graph break, never claiming the stack itself was unreadable."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(BreaksBeforeSoftmax()), torch.randn(2, 6, 16)
    want = model(x)
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            got = compiled(x)
            stats = monitor.latest_stats()
    assert torch.equal(got, want)
    q, k = model[0].last
    want_stats = fastdiag.head_stats(torch.softmax((q.double() @ k.double().transpose(-1, -2)) / 2.0, -1),
                                     backend="reference")
    assert set(stats) == {"0"}
    assert_stats_close(stats["0"], want_stats, 1e-4)
    warned = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
    assert len(warned) == 1 and "layers '0'" in warned[0] and "after a graph break" in warned[0], warned


def test_torch_export_of_an_attached_model_is_the_models_own():
    """Exporting a model while it is attached (say, at the end of training; torch.export's default,
    non-strict) used to raise: it ran a measured pass whose statistics' out= products met autograd
    tracing. Tracing for export is no step: nothing runs, the exported program holds no fastdiag op and
    computes the model's output, the counter does not move, and the next real step is measured.
    (strict=True still refuses the monitor's step hooks, kept out of compiled graphs: detach first.)"""
    strict = False
    from tests.helpers import SDPALayer
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(SDPALayer()), torch.randn(2, 6, 16)
    want = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            exported = torch.export.export(model, (x,), strict=strict)
            assert monitor.step == 0 and monitor.latest() is None
            model(x).sum().backward()
            assert set(monitor.latest_stats()) == {"0"} and monitor.step == 1
    assert not any("fastdiag" in str(node.target) for node in exported.graph.nodes)
    assert torch.equal(exported.module()(x), want)
    assert [str(w.message) for w in caught if "fastdiag" in str(w.message)] == []


def test_a_first_measured_pass_compiled_with_dynamic_shapes_takes_the_native_cpu_kernel(monkeypatch):
    """A fresh process whose first measured pass is compiled with dynamic shapes (dynamic=True, or the
    automatic dynamic of a second batch size): the native CPU kernel is made ready at the pass's begin
    (eager), so the trace takes its op. Before, only an eager pass built it: the trace took the torch path,
    whose chunk arithmetic on a symbolic size breaks the graph (fullgraph=True raised in the step)."""
    from fastdiag.core.kernels import qk_stats_cpu as native

    if native.library() is None:
        pytest.skip(f"no native CPU kernel here: {native.unavailable_reason()}")
    monkeypatch.setattr(native, "_library", None)      # as in a fresh process: never built yet
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoLayers()
    xs = [torch.randn(b, 6, 16) for b in (2, 3)]
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    with fastdiag.attach(model, every=1) as monitor:
        for x in xs:
            compiled(x).square().mean().backward()
            for i, layer in enumerate(model.layers):
                assert_stats_close(monitor.latest_stats()[f"layers.{i}"], reference_stats(*layer.last), 1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "llama (GQA)"])
def test_hugging_face_sdpa_compiled_with_dynamic_shapes_runs_and_matches_eager(arch):
    """torch.compile(dynamic=True) makes the head dim, and so SDPA's scale, symbolic: checking the scale
    (float(), isfinite) broke the graph inside the measured pass, and dynamo's fallback then raised
    TypeError in the user's step (``arange(..., device=torch.Size)``), where it runs without attach. Now
    the traced call keeps the scale as it comes: outputs bit-identical, the statistics those of an eager
    measured pass of the same batch."""
    from tests.hf_matrix import build, inputs
    torch._dynamo.reset()
    model = build(arch, "sdpa")
    batch = inputs(arch, padded=False)
    compiled = torch.compile(model, backend="eager", dynamic=True, fullgraph=True)
    want = compiled(**batch).logits
    with fastdiag.attach(model, every=1) as monitor:
        got = compiled(**batch).logits
        traced = monitor.latest_stats()
        model(**batch)
        eager = monitor.latest_stats()
    assert torch.equal(got, want)
    assert set(traced) == set(eager) and len(eager) >= 2
    for name in eager:
        assert_stats_close(traced[name], eager[name], 1e-6)


def test_a_float64_model_compiled_with_dynamic_shapes_and_fullgraph_stays_one_graph():
    """float64 Q/K take the torch path (no native kernel), whose Gram products were cut by gcd arithmetic on
    the sizes: symbolic under dynamic shapes, a graph break, so fullgraph=True raised in the step. Traced,
    the Gram is one float64 product: two batch shapes, one graph each way, outputs bit-identical, exact."""
    from tests.helpers import SDPALayer, reference_stats

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = SDPALayer()

        def forward(self, x):
            return self.block(x)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Root().double()
    compiled = torch.compile(model, backend="eager", dynamic=True, fullgraph=True)
    xs = [torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(3, 7, 16, dtype=torch.float64)]
    wants = [model(x) for x in xs]
    with fastdiag.attach(model, every=1) as monitor:
        for x, want in zip(xs, wants):
            got = compiled(x)
            got.sum().backward()
            assert torch.equal(got, want)
            assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-6)


def _sequential_root(kind):
    torch.manual_seed(0)
    if kind == "sequential":
        return torch.nn.Sequential(SDPALayer(is_causal=True), torch.nn.Linear(16, 16), SDPALayer())
    return torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
                                       2, enable_nested_tensor=False)


@pytest.mark.parametrize("kind", ["sequential", "encoder"])
@pytest.mark.parametrize("order", ["compile after attach", "attach the compiled", "model.compile",
                                   "compile, then attach the model"])
def test_a_torch_nn_root_compiled_with_fullgraph_is_two_graphs_and_exact(kind, order):
    """torch.compile wraps a torch.nn module's whole call, hooks and all (its forward is in a file dynamo
    skips), so the root's step hooks, kept out of graphs, raised in the step under fullgraph=True. Attached,
    such a root's forward gets a frame of its own: the hooks run outside, two graphs, outputs bit-identical,
    the statistics those of eager; detach removes that frame, and the wrapper still compiles the model."""
    torch._dynamo.reset()
    model = _sequential_root(kind)
    x = torch.randn(2, 6, 16)
    want_out = model(x)
    want = _eager_stats(model, x)
    count, graphs = _counting("eager")
    if order == "attach the compiled":
        run = torch.compile(model, backend=count, fullgraph=True)
        monitor = fastdiag.attach(run, every=2)
    elif order == "compile, then attach the model":    # the wrapper not handed to attach: found (round5)
        model = _sequential_root(kind)                 # the same weights, never attached (no own frame yet)
        run = torch.compile(model, backend=count, fullgraph=True)
        monitor = fastdiag.attach(model, every=2)
    else:
        monitor = fastdiag.attach(model, every=2)
        if order == "model.compile":
            model.compile(backend=count, fullgraph=True)
            run = model
        else:
            run = torch.compile(model, backend=count, fullgraph=True)
    assert "forward" in model.__dict__
    for _ in range(4):
        out = run(x)
    assert torch.equal(out, want_out)
    assert len(graphs) == 2, "one graph measured, one not"
    assert [r["step"] for r in monitor.history()] == [0, 2]
    stats = monitor.latest_stats()
    assert list(stats) == list(want)
    for name in want:
        assert_stats_close(stats[name].to(torch.float64), want[name].to(torch.float64))
    # lightning, once imported (by another test), wraps torch.compile and stores its kwargs on the module:
    # this test's backend is a local function, which no pickle takes
    vars(model).pop("_compile_kwargs", None)
    copy = pickle.loads(pickle.dumps(model))       # copies of the attached model: no monitor, the same forward
    assert torch.equal(copy(x), want_out) and torch.equal(deepcopy(model)(x), want_out)
    monitor.detach()
    assert "forward" not in model.__dict__, "detach leaves the model as it was"
    # detached, `run` goes on as it would have without attach: torch.compile's wrapper compiles the module,
    # hooks gone (one graph more); model.compile(fullgraph=True) of modules that are all torch.nn finds no
    # frame to compile in torch 2.13 and raises, with or without attach — told by a twin never attached
    if order == "model.compile":
        twin = _sequential_root(kind)
        twin.compile(backend="eager", fullgraph=True)
        try:
            twin(x)
        except RuntimeError as error:
            with pytest.raises(RuntimeError, match=re.escape(str(error).splitlines()[0][:40])):
                run(x)
            return
    assert torch.equal(run(x), want_out)
    assert len(graphs) == (4 if order == "model.compile" else 3)


@pytest.mark.parametrize("root", ["encoder", "holder"])
def test_a_compiled_encoder_in_eval_names_its_layers_only(root):
    """A compiled nn.TransformerEncoder on a measured eval pass (measure_eval=True): traced, the monitor's mode
    cannot be left for torch's fast path, so the slow path's attention ops ran inside it and were taken for the
    encoder's own ('<root>': "2 attention ops in one call", found by round5). They belong to the layers, named
    as not measured on eval passes as eager names them; the training pass before stays exact."""
    torch._dynamo.reset()
    encoder = _sequential_root("encoder")
    model = encoder if root == "encoder" else torch.nn.Sequential(torch.nn.Linear(16, 16), encoder)
    x = torch.randn(2, 6, 16)
    want = model.eval()(x)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor = fastdiag.attach(model, every=1, measure_eval=True)
        run = torch.compile(model, backend="eager")
        run(x)
        trained = set(monitor.latest_stats())
        model.eval()
        out = run(x)
    assert torch.equal(out, want)
    prefix = "" if root == "encoder" else "1."
    layers = {f"{prefix}layers.0.self_attn", f"{prefix}layers.1.self_attn"}
    assert trained == layers
    assert set(monitor.coverage()["missing"]) == layers
    monitor.detach()
