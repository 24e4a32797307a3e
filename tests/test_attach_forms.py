"""fastdiag.attach on attention that belongs to another model, and on attention forms beyond
``softmax(-1)`` of ``[B, H, Tq, Tk]`` scores (issue 39, items 2, 4, 5). Each case is exact (1e-4 against
float64 of the probabilities the model used) or named by a warning naming the module; outputs and
gradients are bit-identical in every case."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdiag

from tests.helpers import SDPALayer, TwoLayers, assert_named, assert_stats_close, reference_stats
from tests.hf_matrix import attached_unchanged

EXACT = 1e-4


def _hs(probs, rows=None):
    return fastdiag.head_stats(probs.double(), rows, backend="reference")


def _x(b=2, t=6, d=16, seed=1):
    return torch.randn(b, t, d, generator=torch.Generator().manual_seed(seed))


def _fastdiag_warnings(caught):
    return [str(w.message) for w in caught if "fastdiag" in str(w.message)]


# ---- item 2: a layer belongs to the module whose code ran it --------------------------------------

class Student(nn.Module):
    """One attention layer of its own, and a frozen teacher kept outside its module tree (a list
    attribute: not a submodule), run inside ``forward`` by the root (``where="root"``) or by a block."""

    def __init__(self, teacher, where="root"):
        super().__init__()
        self.block = SDPALayer()
        self.where = where
        self.frozen = [teacher]
        if where == "block":
            self.block.frozen = [teacher]
            self.block.forward = self._block_forward

    def _block_forward(self, x, attn_mask=None):
        with torch.no_grad():
            hint = self.block.frozen[0](x)
        return SDPALayer.forward(self.block, x + 0 * hint)

    def forward(self, x):
        if self.where == "root":
            with torch.no_grad():
                hint = self.frozen[0](x)
            x = x + 0 * hint
        return self.block(x)


def _teacher():
    torch.manual_seed(5)
    return TwoLayers().requires_grad_(False)


@pytest.mark.parametrize("where", ["root", "block"])
def test_a_foreign_models_attention_is_no_layer_of_this_one_and_is_named(where):
    torch.manual_seed(0)
    teacher = _teacher()
    model = Student(teacher, where)
    x = _x()
    monitor, warned = attached_unchanged(model, lambda m: m(x))
    record = monitor.latest()
    assert [k for k in record if k.startswith("sync/")] == ["sync/block"], record
    q, k = model.block.last
    want = reference_stats(q, k)
    assert_stats_close(monitor.latest_stats()["block"], want, EXACT)
    assert abs(record["s_bar"] - want.sync().item()) <= EXACT
    assert any("outside the attached model" in w and "SDPALayer" in w for w in warned), warned
    assert monitor.coverage()["missing"] == {}


def test_a_foreign_model_attached_itself_is_measured_as_its_own():
    torch.manual_seed(0)
    teacher = _teacher()
    model = Student(teacher, "root")
    x = _x()
    with fastdiag.attach(teacher, every=1) as of_teacher, fastdiag.attach(model, every=1) as of_student:
        model(x)
    assert set(of_student.latest_stats()) == {"block"}
    assert set(of_teacher.latest_stats()) == {"layers.0", "layers.1"}
    h = x
    for name, layer in zip(("layers.0", "layers.1"), teacher.layers):
        q, k = layer.last
        assert_stats_close(of_teacher.latest_stats()[name], reference_stats(q, k), EXACT)
    q, k = model.block.last
    assert_stats_close(of_student.latest_stats()["block"], reference_stats(q, k), EXACT)
    del h


class FastPathTeacherStudent(nn.Module):
    """A student whose output uses a frozen torch.nn teacher in eval, kept outside its tree: a
    TransformerEncoder (with a key-padding mask: nested tensors on its fast path) or a MultiheadAttention."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(5)
        if kind == "encoder":
            layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
            teacher = nn.TransformerEncoder(layer, 2)      # enable_nested_tensor: padding runs nested
        else:
            teacher = nn.MultiheadAttention(16, 4, batch_first=True)
        self.kind, self.frozen = kind, [teacher.eval().requires_grad_(False)]
        torch.manual_seed(0)
        self.block = SDPALayer()

    def forward(self, x):
        teacher = self.frozen[0]
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[1, -2:] = True
        with torch.no_grad():
            hint = (teacher(x, src_key_padding_mask=padding) if self.kind == "encoder"
                    else teacher(x, x, x, key_padding_mask=padding, need_weights=False)[0])
        return self.block(x + hint.nan_to_num())


@pytest.mark.parametrize("kind", ["encoder", "mha"])
def test_a_foreign_fast_path_module_in_eval_keeps_outputs_bit_identical(kind):
    """With the mode active torch takes a fast-path module's slow path, whose outputs differ (4.8e-7 on the
    careful pass here before; nested-tensor padding 0 against real numbers): another model's fast-path
    module in eval runs with the mode left out, as this model's own do, and is named once, never recorded."""
    model = FastPathTeacherStudent(kind)
    x = _x()
    for _ in range(2):     # two monitors: each one's careful first pass
        model.zero_grad()
        monitor, warned = attached_unchanged(model, lambda m: m(x))
        q, k = model.block.last
        assert_stats_close(monitor.latest_stats()["block"], reference_stats(q, k), EXACT)
        assert set(monitor.latest_stats()) == {"block"}
    assert any("outside the attached model" in w and "fast path" in w for w in warned), warned


class TwoOpsAtRoot(nn.Module):
    """Attention done twice in the root's own forward: not one map, refused by name."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v) + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, 16)


def test_the_root_has_one_name_everywhere_and_a_refused_root_leaves_no_layer():
    torch.manual_seed(0)
    x = _x()
    layer = SDPALayer()
    monitor, _ = attached_unchanged(layer, lambda m: m(x))
    assert "sync/<root>" in monitor.latest()
    assert list(monitor.coverage()["measured"]) == ["<root>"]
    assert_stats_close(monitor.latest_stats()["<root>"], reference_stats(*layer.last), EXACT)

    model = TwoOpsAtRoot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            model(x)
    assert monitor.latest() is None            # no layer "#1" survives the refusal
    assert list(monitor.coverage()["missing"]) == ["<root>"]
    assert any("'<root>'" in w and "2 attention ops" in w for w in _fastdiag_warnings(caught))
# ---- items 4 and 5: attention forms -----------------------------------------------------------------

class Mixer(nn.Module):
    """Hand-written attention in a module not named like attention. ``form``:
    einsum_bqhk: scores [B, Tq, H, Tk] by einsum, softmax(-1), einsum with V;
    transpose_bqhk: scores [B, Tq, H, Tk], softmax(-1), then ``P.transpose(1, 2) @ V``;
    dim2: scores [B, H, Tk, Tq], softmax(dim=-2), then ``Pᵀ @ V``;
    dim2_right: scores [B, H, Tk, Tq], softmax(dim=-2), then ``(Vᵀ @ P)ᵀ``;
    dim1: scores [B, Tk, H, Tq], softmax(dim=1), einsum with V;
    memory: keys and values a memory shared by every row, ``P.reshape(-1, M) @ V``;
    flattened_window: each query's own gathered window of values (not measured: named);
    log_softmax_exp: ``log_softmax(s, -1).exp() @ V``;
    mha_forward: ``F.multi_head_attention_forward`` with its own packed weights (open_clip style);
    ``self.used``: the probabilities it multiplied V by, as [B, H, Tq, Tk] float64."""

    def __init__(self, form, d=16, heads=4, state_heads=False):
        super().__init__()
        self.form, self.h, self.hd = form, heads, d // heads
        if state_heads:
            self.num_heads = heads
        self.in_proj_weight = nn.Parameter(torch.randn(3 * d, d) * 0.5)
        self.in_proj_bias = nn.Parameter(torch.randn(3 * d) * 0.1)
        self.out = nn.Linear(d, d)
        self.used = None

    def forward(self, x):
        b, t, d = x.shape
        if self.form == "mha_forward":
            xt = x.transpose(0, 1)
            y, _ = F.multi_head_attention_forward(
                xt, xt, xt, d, self.h, self.in_proj_weight, self.in_proj_bias, None, None, False, 0.0,
                self.out.weight, self.out.bias, training=self.training, need_weights=False)
            self.used = x.detach()   # its probabilities are formed by the test, after the pass (`reference`)
            return y.transpose(0, 1)
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = (z.view(b, t, self.h, self.hd) for z in qkv.chunk(3, -1))
        scale = self.hd ** -0.5
        if self.form == "einsum_bqhk":
            p = torch.einsum("bqhd,bkhd->bqhk", q, k).mul(scale).softmax(-1)
            self.used = p.detach().double().permute(0, 2, 1, 3)
            y = torch.einsum("bqhk,bkhd->bqhd", p, v)
        elif self.form == "transpose_bqhk":
            s = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)).mul(scale).transpose(1, 2)   # [B, Tq, H, Tk]
            p = s.softmax(-1)
            self.used = p.detach().double().transpose(1, 2)
            y = (p.transpose(1, 2) @ v.transpose(1, 2)).transpose(1, 2)
        elif self.form in ("dim2", "dim2_right"):
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            p = (k @ q.transpose(-1, -2)).mul(scale).softmax(dim=-2)                       # [B, H, Tk, Tq]
            self.used = p.detach().double().transpose(-1, -2)
            y = p.transpose(-1, -2) @ v if self.form == "dim2" else (v.transpose(-1, -2) @ p).transpose(-1, -2)
            y = y.transpose(1, 2)
        elif self.form == "dim1":          # scores [B, Tk, H, Tq] normalised over dim 1, then einsum with V
            p = torch.einsum("bqhd,bkhd->bkhq", q, k).mul(scale).softmax(dim=1)
            self.used = p.detach().double().permute(0, 2, 3, 1)
            y = torch.einsum("bkhq,bkhd->bqhd", p, v)
        elif self.form == "memory":        # keys and values a learned memory shared by every row: [B·H·Tq, M] @ [M, D]
            memory = self.in_proj_weight[:5, :self.hd]
            p = (q.transpose(1, 2) @ memory.T).mul(scale).softmax(-1)                     # [B, H, Tq, M]
            self.used = p.detach().double()
            y = (p.reshape(-1, 5) @ memory).view(b, self.h, t, self.hd)
            y = y.transpose(1, 2)
        elif self.form == "flattened_window":   # each query its own gathered keys: the layout cannot be read
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            p = (q @ k.transpose(-1, -2)).mul(scale)[..., :3].softmax(-1)                # [B, H, Tq, 3]
            values = v.unsqueeze(1).expand(b, t, t, self.h, self.hd)[:, :, :3]           # [B, Tq, 3, H, D]
            y = torch.einsum("bhqw,bqwhd->bqhd", p, values)
        elif self.form == "log_softmax_exp":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            p = F.log_softmax((q @ k.transpose(-1, -2)) * scale, dim=-1).exp()
            self.used = p.detach().double()
            y = (p @ v).transpose(1, 2)
        else:
            raise ValueError(self.form)
        return self.out(y.reshape(b, t, d))


    def reference(self) -> torch.Tensor:
        """The probabilities the module used, [B, H, Tq, Tk] float64."""
        if self.form != "mha_forward":
            return self.used
        x = self.used.double()
        b, t, _ = x.shape
        q, k, _ = F.linear(x, self.in_proj_weight.double(), self.in_proj_bias.double()).chunk(3, -1)
        q, k = (z.view(b, t, self.h, self.hd).transpose(1, 2) for z in (q, k))
        return ((q @ k.transpose(-1, -2)) * self.hd ** -0.5).softmax(-1).detach()


class Net(nn.Module):
    def __init__(self, form, **kw):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.mixer = Mixer(form, **kw)

    def forward(self, x):
        return self.mixer(self.embed(x))


@pytest.mark.parametrize("form,t,state_heads", [
    ("einsum_bqhk", 6, False),        # item 5: no head count stated (read as [B, H, Tq, Tk]: error 1.7)
    ("einsum_bqhk", 4, True),         # item 5: Tq = H = 4 (error 0.49)
    ("transpose_bqhk", 6, False),
    ("transpose_bqhk", 4, True),
    ("dim2", 6, False),               # item 4: softmax over dim=-2, Pᵀ·V
    ("dim2_right", 5, False),
    ("dim1", 6, False),               # item 4: any softmax axis that is not the last, read from the einsum
    ("memory", 6, False),             # rows flattened to [B·H·Tq, M] against a memory of values
    ("log_softmax_exp", 6, False),    # item 4: log_softmax(...).exp()
    ("mha_forward", 6, False),        # item 4: F.multi_head_attention_forward in a module not named like attention
])
def test_attention_forms_are_measured_exactly_from_the_probabilities_used(form, t, state_heads):
    torch.manual_seed(0)
    model = Net(form, state_heads=state_heads)
    x = _x(t=t)
    monitor, warned = attached_unchanged(model, lambda m: m(x))
    assert not warned, warned
    stats = monitor.latest_stats()
    assert set(stats) == {"mixer"}, (stats, monitor.coverage())
    assert_stats_close(stats["mixer"], _hs(model.mixer.reference()), EXACT)
    assert set(monitor.coverage()["measured"]) == {"mixer"}


def test_a_softmax_over_an_axis_that_is_not_multiplied_with_values_is_named_not_recorded():
    """dim=-2 softmax used as a gate (multiplied elementwise, never contracted): not a layer, named."""

    class Gate(nn.Module):
        def forward(self, x):
            b, t, d = x.shape
            s = x.view(b, t, 4, 4).transpose(1, 2) @ x.view(b, t, 4, 4).permute(0, 2, 3, 1)
            return x * s.softmax(dim=-2).mean((1, 2)).unsqueeze(-1)

    class WithGate(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = SDPALayer()
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.attn(x))

    torch.manual_seed(0)
    model = WithGate()
    x = _x()
    monitor, warned = attached_unchanged(model, lambda m: m(x))
    assert set(monitor.latest_stats()) == {"attn"}
    assert any("'gate'" in w and "not attention" in w for w in warned), warned


class Projected(nn.Module):
    """A projection, then ``module`` (named ``name``) on ``[T, B, 16]`` inputs."""

    def __init__(self, name, module):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.name = name
        setattr(self, name, module)

    def forward(self, x):
        return getattr(self, self.name)(self.proj(x))


class SeqFirst(nn.Module):
    """Scores [Tq, B, H, Tk] (sequence first, 4 heads) multiplied with values by einsum; the module
    states ``num_heads`` heads."""

    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads

    def forward(self, x):
        t, b, d = x.shape
        q = k = v = x.view(t, b, 4, 4)
        p = torch.einsum("qbhd,kbhd->qbhk", q, k).softmax(-1)
        self.used = p.detach().double().permute(1, 2, 0, 3)
        return torch.einsum("qbhk,kbhd->qbhd", p, v).reshape(t, b, d)


@pytest.mark.parametrize("stated", [4, 8])
def test_a_sequence_first_layout_is_read_from_the_product_with_values_or_named(stated):
    """Stated 4 heads: measured, heads read from the einsum with values, exact. Stated 8 while neither
    batch-like axis the product reads (batch 3, heads 4) has 8: which axis holds the heads cannot be
    told, so the module is named, not measured."""
    torch.manual_seed(0)
    model = Projected("attn", SeqFirst(stated))
    x = torch.randn(6, 3, 16)
    monitor, warned = attached_unchanged(model, lambda m: m(x))
    if stated == 4:
        assert not warned, warned
        assert_stats_close(monitor.latest_stats()["attn"], _hs(model.attn.used), EXACT)
    else:
        assert any("'attn'" in w and "not the module's 8 heads" in w for w in warned), warned
        assert monitor.latest() is None
        assert "attn" in monitor.coverage()["missing"]


# ---- real Hugging Face: WavLM calls F.multi_head_attention_forward -----------------------------------

def test_wavlm_multi_head_attention_forward_is_measured_exactly():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.WavLMConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                      conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
                                      attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                                      layerdrop=0.0, mask_time_prob=0.0, num_buckets=32, max_bucket_distance=64)
    model = transformers.WavLMModel(config).train()
    audio = torch.randn(2, 400, generator=torch.Generator().manual_seed(2))

    captured = []

    class Capture(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.multi_head_attention_forward:
                captured.append((args, kwargs))
            return func(*args, **kwargs)

    with Capture(), torch.no_grad():
        model(audio)
    # the probabilities torch formed in that very call (WavLM asks for them: need_weights=True), per head
    ref = []
    for args, kwargs in captured:
        with torch.no_grad():
            _, probs = F.multi_head_attention_forward(*args, **dict(kwargs, average_attn_weights=False))
        ref.append(_hs(probs))

    monitor, warned = attached_unchanged(model, lambda m: m(audio).last_hidden_state)
    assert not warned, warned
    stats = monitor.latest_stats()
    assert list(stats) == ["encoder.layers.0.attention", "encoder.layers.1.attention"], list(stats)
    for got, want in zip(stats.values(), ref):
        assert_stats_close(got, want, EXACT)


def test_a_hugging_face_teacher_outside_the_tree_is_no_layer_of_the_student():
    """Distillation as users write it: a tiny HF GPT-2 student (eager) in the attached module, a tiny
    HF Llama teacher (sdpa) kept in a list and run under no_grad inside ``forward``. Only the
    student's two layers are recorded, each exact against its own attention probabilities."""
    pytest.importorskip("transformers")
    from tests.helpers import tiny_hf

    class Distill(nn.Module):
        def __init__(self):
            super().__init__()
            self.student = tiny_hf("gpt2", "eager")
            self.frozen = [tiny_hf("llama", "sdpa").eval()]

        def forward(self, ids):
            with torch.no_grad():
                target = self.frozen[0](ids).logits.softmax(-1)
            logits = self.student(ids).logits
            return (logits.log_softmax(-1) * target).sum(-1)

    model = Distill()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    monitor, warned = attached_unchanged(model, lambda m: m(ids))
    with torch.no_grad():
        want = model.student(ids, output_attentions=True).attentions
    stats = monitor.latest_stats()
    assert list(stats) == ["student.transformer.h.0.attn", "student.transformer.h.1.attn"], list(stats)
    for got, probs in zip(stats.values(), want):
        assert_stats_close(got, _hs(probs), EXACT)
    assert any("outside the attached model" in w and "LlamaForCausalLM" in w for w in warned), warned


@pytest.mark.parametrize("form", ["einsum_bqhk", "transpose_bqhk", "dim2", "dim2_right", "dim1", "memory",
                                  "log_softmax_exp", "mha_forward"])
def test_every_measured_pass_records_the_form_not_only_the_first(form):
    """The first measured pass is careful; later ones may follow its plan (lean passes, which hand
    over SDPA calls and softmaxes over the last axis only): a form they do not see leaves no plan,
    so every pass records the layer."""
    torch.manual_seed(0)
    model = Net(form)
    x = _x()
    with fastdiag.attach(model, every=1) as monitor:
        for _ in range(4):
            model(x)
            assert_stats_close(monitor.latest_stats()["mixer"], _hs(model.mixer.reference()), EXACT)
    assert [("sync/mixer" in r) for r in monitor.history()] == [True] * 4


def test_a_product_with_values_whose_layout_cannot_be_read_is_named():
    """Each query multiplied with its own gathered window of values (``"bhqw,bqwhd->bqhd"``): the
    query axis is shared with the values, so which axis holds the queries cannot be read; named."""
    torch.manual_seed(0)
    model = Net("flattened_window")
    monitor, warned = attached_unchanged(model, lambda m: m(_x()))
    assert any("'mixer'" in w and "does not say which axes" in w for w in warned), warned
    assert monitor.latest() is None and "mixer" in monitor.coverage()["missing"]


# ---- TorchScript: its ops run where no hook or function mode sees them ---------------------------

class ScriptableAttention(nn.Module):
    """Hand-written attention TorchScript can compile (a softmax over [B, H, Tq, Tk])."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(d, 3 * d), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1)
        return (p @ v).transpose(1, 2).reshape(b, t, d)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_model_is_refused_naming_the_argument(how):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    model = torch.jit.script(ScriptableAttention()) if how == "script" else torch.jit.trace(ScriptableAttention(), x)
    with pytest.raises(TypeError, match=r"model: expected an eager torch.nn.Module, got a TorchScript module"):
        fastdiag.attach(model)


class WithScripted(nn.Module):
    """An SDPA block, then a TorchScript part: attention (a scripted `ScriptableAttention` or a scripted
    encoder layer) or none (a scripted linear layer)."""

    def __init__(self, part):
        super().__init__()
        self.block = SDPALayer()
        self.scripted = torch.jit.script({"attention": ScriptableAttention,
                                          "encoder": lambda: nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
                                          "linear": lambda: nn.Linear(16, 16)}[part]())

    def forward(self, x):
        return self.scripted(self.block(x))


@pytest.mark.parametrize("part", ["attention", "encoder", "linear"])
def test_a_torchscript_submodule_is_left_out_and_named_when_it_does_attention(part):
    """attach used to raise RuntimeError from torch (``register_forward_pre_hook is not supported on
    ScriptModules``). Now the eager parts are measured exactly, outputs and gradients unchanged, and a
    scripted part whose graph takes a softmax or runs attention is named (its ops are not seen); one that
    does no attention is left out silently. strict=True refuses it at attach."""
    torch.manual_seed(0)
    model, x = WithScripted(part), torch.randn(2, 6, 16)
    monitor, warned = attached_unchanged(model, lambda m: m(x))
    assert_stats_close(monitor.latest_stats()["block"], reference_stats(*model.block.last), 1e-4)
    if part == "linear":
        assert monitor.coverage()["missing"] == {} and warned == []
        return
    assert_named(monitor, warned, "scripted", "a TorchScript module")
    with pytest.raises(ValueError, match="'scripted' is not measured: a TorchScript module"):
        fastdiag.attach(model, strict=True)
    with fastdiag.attach(model, every=1) as again:   # nothing was left hooked by the refused attach
        model(x)
        assert set(again.latest_stats()) == {"block"}
