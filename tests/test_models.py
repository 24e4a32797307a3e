"""fastdiag.models: presets, output shapes, the two attention paths, the Mamba scan."""
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import fastdiag
import fastdiag.models as M
from fastdiag.grokking.build import _meta_count, build_model, parameter_count
from fastdiag.grokking.config import ARCHS, RunConfig


@pytest.mark.parametrize("preset, target", [("canonical", 0.82e6), ("19m", 19e6), ("85m", 85e6)])
def test_preset_parameter_counts(preset, target):
    with torch.device("meta"):  # no memory, no init cost: the 85 M model builds in milliseconds
        model = M.build("transformer", preset=preset, vocab_size=98)
    n = M.count_parameters(model)
    assert abs(n - target) / target < 0.03, (preset, n)


def test_canonical_is_untied_and_counted_exactly():
    with torch.device("meta"):
        model = M.build("transformer", vocab_size=98)
    assert M.count_parameters(model) == 818_816
    assert model.head.weight is not model.tok_emb.weight


@pytest.mark.parametrize("arch", ARCHS)   # every architecture the run config accepts builds
def test_every_architecture_maps_tokens_to_last_position_logits(arch):
    torch.manual_seed(0)
    kwargs = {"transformer": dict(n_layers=2, d_model=32, n_heads=4), "mlp": dict(hidden=32),
              "lstm": dict(hidden=32, n_layers=2), "mamba": dict(d_model=16, n_layers=2)}[arch]
    model = M.build(arch, vocab_size=12, **kwargs)
    idx = torch.randint(0, 12, (5, 3))
    out = model(idx)
    assert out.shape == (5, 12) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def _small_transformer(**kw):
    torch.manual_seed(1)
    cfg = dict(vocab_size=20, n_layers=2, n_heads=4, d_model=32, d_ff=64)
    cfg.update(kw)
    return M.build("transformer", preset="custom", **cfg)


def test_attention_modules_and_their_attributes():
    model = _small_transformer()
    mods = M.attention_modules(model)
    assert list(mods) == ["blocks.0.attn", "blocks.1.attn"]
    for m in mods.values():
        assert type(m).records_head_stats is True
        assert m.record is False and m.stats is None and m.diag_backend == "auto"
    assert M.attention_modules(M.build("mlp", hidden=8)) == {}


def test_sdpa_path_equals_explicit_path_and_records_stats():
    model = _small_transformer().eval()
    idx = torch.randint(0, 20, (16, 3))
    with torch.no_grad():
        fast = model(idx, all_positions=True)
        for m in M.attention_modules(model).values():
            m.record = True
        slow = model(idx, all_positions=True)
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)
    for m in M.attention_modules(model).values():
        assert isinstance(m.stats, fastdiag.HeadStats)
        assert m.stats.gram.shape == (4, 4) and int(m.stats.rows) == 16 * 3
        s = m.stats.sync()
        assert torch.isfinite(s) and -1 <= float(s) <= 1 + 1e-6


@pytest.mark.parametrize("record", [False, True])
def test_the_last_position_alone_is_the_last_row_of_all_positions(record):
    """The loss's forward computes the last block past its attention for the last position only: the same
    logits as that row of the full forward, a gradient for every parameter, and statistics of every row."""
    model = _small_transformer()
    for m in M.attention_modules(model).values():
        m.record = record
    idx = torch.randint(0, 20, (16, 3))
    last = model(idx)
    stats = [m.stats for m in M.attention_modules(model).values()]
    full = model(idx, all_positions=True)[:, -1]
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-6)
    last.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    if record:
        assert all(int(s.rows) == 16 * 3 for s in stats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_layer_norm_through_the_affine_kernel_keeps_the_bits(dtype, threads):
    """`norm._normalised` runs the CPU kernel with weight 1 and bias 0 (faster than without weight): the
    same forward and backward bits as ``F.layer_norm`` without an affine step."""
    from fastdiag.models.norm import _normalised
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in [(512, 3, 128), (3, 64, 3, 128), (33, 48)]:
            x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).to(dtype).requires_grad_()
            grad = torch.randn(shape, dtype=torch.float64).to(dtype)
            plain = F.layer_norm(x, shape[-1:])
            ours = _normalised(x, 1e-5)
            assert torch.equal(plain, ours)
            assert torch.equal(*(torch.autograd.grad(y, x, grad)[0] for y in (plain, ours)))
    finally:
        torch.set_num_threads(previous)


def test_recorded_stats_equal_head_stats_of_the_layer_probabilities():
    model = _small_transformer().eval()
    attn = model.blocks[0].attn
    idx = torch.randint(0, 20, (8, 3))
    captured = {}

    def hook(module, args):
        captured["x"] = args[0]

    attn.register_forward_pre_hook(hook)
    attn.record = True
    with torch.no_grad():
        model(idx)
        x = captured["x"]
        B, T, C = x.shape
        q, k, _ = attn.qkv(x).split(C, dim=2)
        q, k = (t.view(B, T, 4, C // 4).transpose(1, 2) for t in (q, k))
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // 4)
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        expected = fastdiag.head_stats(scores.softmax(-1), backend="reference")
    torch.testing.assert_close(attn.stats.sync(), expected.sync(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(attn.stats.entropy_spread(), expected.entropy_spread(), rtol=1e-4, atol=1e-6)


def test_sdpa_is_looked_up_at_call_time(monkeypatch):
    model = _small_transformer()
    calls = []
    original = F.scaled_dot_product_attention

    def wrapper(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", wrapper)
    idx = torch.randint(0, 20, (4, 3))
    model(idx)
    assert calls == [True, True]
    for m in M.attention_modules(model).values():
        m.record = True
    model(idx)
    assert len(calls) == 2, "the recording path computes probabilities itself"


def test_build_errors():
    with pytest.raises(ValueError, match="unknown architecture"):
        M.build("rnn")
    with pytest.raises(TypeError, match="unknown setting"):
        M.build("mlp", n_heads=4)
    with pytest.raises(ValueError, match="divisible"):
        M.build("transformer", d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="preset"):
        M.build("transformer", preset="7b")
    with pytest.raises(ValueError, match="positive"):
        M.build("lstm", n_layers=0)


def test_build_model_of_a_run_config():
    with torch.device("meta"):
        m = build_model(RunConfig())
        assert isinstance(m, M.Transformer) and m.config.n_layers == 4 and m.config.d_ff == 512
        m = build_model(RunConfig(preset="custom", n_layers=2, d_model=64, n_heads=4))
        assert (m.config.n_layers, m.config.d_model, m.config.n_heads, m.config.d_ff) == (2, 64, 4, 256)
        m = build_model(RunConfig(arch="lstm", d_model=64))
        assert m.config.hidden == 64 and m.config.n_layers == 4
        m = build_model(RunConfig(arch="mamba"))
        assert (m.config.d_model, m.config.expand, m.config.d_state, m.config.d_conv) == (128, 4, 16, 4)
    with pytest.raises(ValueError, match="n_heads"):
        build_model(RunConfig(arch="mlp", n_heads=4))
    with pytest.raises(ValueError, match="preset"):
        build_model(RunConfig(arch="lstm", preset="19m"))


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_count_past_three_layers_is_the_built_models(arch):
    """parameter_count extrapolates from the 2- and 3-layer models past three layers: exact, because
    every architecture's layers after the first are identical."""
    for layers in (1, 2, 3, 4, 7):
        cfg = RunConfig(arch=arch, n_layers=layers, d_model=32, p=31, preset="custom" if arch == "transformer" else "canonical")
        assert parameter_count(cfg) == _meta_count(cfg), (arch, layers)


def test_default_cross_architecture_sizes():
    with torch.device("meta"):
        mlp, lstm = M.build("mlp"), M.build("lstm")
    assert len([m for m in mlp.body if isinstance(m, torch.nn.Linear)]) == 4
    assert lstm.lstm.num_layers == 4 and lstm.lstm.hidden_size == 512


# ---- Mamba ---------------------------------------------------------------------------------------

MAMBA_SSM_SHAPES = {  # mamba_ssm.modules.mamba_simple.Mamba(d_model=128, d_state=16, d_conv=4, expand=4)
    "in_proj.weight": (1024, 128), "conv1d.weight": (512, 1, 4), "conv1d.bias": (512,),
    "x_proj.weight": (8 + 2 * 16, 512), "dt_proj.weight": (512, 8), "dt_proj.bias": (512,),
    "A_log": (512, 16), "D": (512,), "out_proj.weight": (128, 512),
}


def test_mamba_mixer_has_mamba_ssm_parameter_names_and_shapes():
    model = M.build("mamba")
    assert not model.uses_mamba_ssm  # CPU
    mixer = model.layers[0].mixer
    assert {k: tuple(v.shape) for k, v in mixer.state_dict().items()} == MAMBA_SSM_SHAPES
    assert torch.equal(mixer.A_log[3], torch.log(torch.arange(1, 17, dtype=torch.float32)))
    assert len(model.layers) == 4


def _recurrent_reference(mixer, x):
    """Step-by-step float64 recurrence (mamba-ssm's `step` semantics), independent of selective_scan_fn."""
    p = {k: v.detach().to(torch.float64) for k, v in mixer.state_dict().items()}
    x = x.to(torch.float64)
    b, L, _ = x.shape
    d_inner, n, r, w = mixer.d_inner, mixer.d_state, mixer.dt_rank, mixer.d_conv
    A = -torch.exp(p["A_log"])
    conv_state = torch.zeros(b, d_inner, w, dtype=torch.float64)
    h = torch.zeros(b, d_inner, n, dtype=torch.float64)
    outs = []
    for t in range(L):
        xz = x[:, t] @ p["in_proj.weight"].T
        xt, z = xz[:, :d_inner], xz[:, d_inner:]
        conv_state = torch.cat([conv_state[:, :, 1:], xt[:, :, None]], dim=2)
        xt = (conv_state * p["conv1d.weight"][:, 0]).sum(-1) + p["conv1d.bias"]
        xt = xt * torch.sigmoid(xt)
        dbc = xt @ p["x_proj.weight"].T
        dt, B, C = dbc[:, :r], dbc[:, r:r + n], dbc[:, r + n:]
        dt = F.softplus(dt @ p["dt_proj.weight"].T + p["dt_proj.bias"])
        for i in range(b):
            for c in range(d_inner):
                h[i, c] = torch.exp(dt[i, c] * A[c]) * h[i, c] + dt[i, c] * B[i] * xt[i, c]
        y = (h * C[:, None, :]).sum(-1) + p["D"] * xt
        y = y * (z * torch.sigmoid(z))
        outs.append(y @ p["out_proj.weight"].T)
    return torch.stack(outs, dim=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_selective_scan_matches_float64_recurrence(seed):
    torch.manual_seed(seed)
    mixer = M.SelectiveSSM(d_model=8, d_state=4, d_conv=3, expand=2)
    with torch.no_grad():  # move away from the special initial values
        mixer.A_log.add_(0.3 * torch.randn_like(mixer.A_log))
        mixer.D.add_(torch.randn_like(mixer.D))
        mixer.dt_proj.bias.add_(torch.randn_like(mixer.dt_proj.bias))
    x = torch.randn(3, 6, 8)   # longer than d_conv, so the causal convolution window is exercised
    out = mixer(x)
    ref = _recurrent_reference(mixer, x)
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=1e-4, atol=1e-5)
    # causality: changing a later input leaves earlier outputs untouched
    x2 = x.clone()
    x2[:, 4:] += 1.0
    torch.testing.assert_close(mixer(x2)[:, :4], out[:, :4])


def test_mamba_state_dict_roundtrip():
    a, b = M.build("mamba", d_model=16, n_layers=2), M.build("mamba", d_model=16, n_layers=2)
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 98, (4, 3))
    torch.testing.assert_close(a(idx), b(idx))


# ---- selective_scan_fn against selective_scan_ref (mamba-ssm's reference, in float64) ------------------------------------------

def _scan_inputs(b, d, n, l, seed, dtype=torch.float64, softplus=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)   # noqa: E731
    delta = r(b, d, l) if softplus else 0.1 + torch.rand(b, d, l, generator=g, dtype=dtype)
    A = -torch.exp(0.5 * r(d, n))                                   # Mamba's A = -exp(A_log) < 0
    return dict(u=r(b, d, l), delta=delta, A=A, B=r(b, n, l), C=r(b, n, l), D=r(d), z=r(b, d, l),
                delta_bias=0.5 * r(d))


SCAN_CASES = [(D, z, bias, softplus, last) for D in (False, True) for z in (False, True) for bias in (False, True)
              for softplus in (False, True) for last in (False, True)]


@pytest.mark.parametrize("use_D, use_z, use_bias, softplus, last", SCAN_CASES)
def test_selective_scan_matches_mamba_ssm_reference(use_D, use_z, use_bias, softplus, last, monkeypatch):
    """Values and gradients (through last_state too) against the reference, float64, 32 option sets
    on shapes with several batch chunks and a ragged last chunk."""
    import fastdiag.models.mamba as mamba

    monkeypatch.setattr(mamba, "_CHUNK_ELEMENTS", 3 * 5 * 6)   # chunks of 3 rows: batch 7 = 3 + 3 + 1
    seed = SCAN_CASES.index((use_D, use_z, use_bias, softplus, last))
    b, d, n, l = 7, 6, 5, [1, 3, 4, 9][seed % 4]
    inputs = _scan_inputs(b, d, n, l, seed, softplus=softplus)
    args = {k: v.requires_grad_() for k, v in inputs.items()}
    kwargs = dict(D=args["D"] if use_D else None, z=args["z"] if use_z else None,
                  delta_bias=args["delta_bias"] if use_bias else None, delta_softplus=softplus,
                  return_last_state=last)
    pos = [args[k] for k in ("u", "delta", "A", "B", "C")]
    got = M.selective_scan_fn(*pos, **kwargs)
    want = M.selective_scan_ref(*pos, **kwargs)
    got, want = (got, want) if last else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.float64 and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    weights = [torch.randn_like(w) for w in want]
    used = pos + [kwargs[k] for k in ("D", "z", "delta_bias") if kwargs[k] is not None]
    g_got = torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)), used)
    g_want = torch.autograd.grad(sum((g * w).sum() for g, w in zip(want, weights)), used)
    for gg, gw in zip(g_got, g_want):
        torch.testing.assert_close(gg, gw, rtol=1e-10, atol=1e-10)


def test_selective_scan_defaults_are_mamba_ssm_defaults():
    x = _scan_inputs(3, 4, 2, 3, seed=11)
    pos = [x[k] for k in ("u", "delta", "A", "B", "C")]
    torch.testing.assert_close(M.selective_scan_fn(*pos), M.selective_scan_ref(*pos), rtol=1e-12, atol=1e-12)
    # the default is no softplus: with it the same call gives a different answer
    assert not torch.allclose(M.selective_scan_fn(*pos), M.selective_scan_fn(*pos, delta_softplus=True))


def test_selective_scan_float32_and_bfloat16_compute_in_float32_like_mamba_ssm():
    x = _scan_inputs(5, 8, 4, 3, seed=12)
    want = M.selective_scan_ref(*(x[k] for k in ("u", "delta", "A", "B", "C")), D=x["D"], z=x["z"],
                               delta_softplus=True)
    got = M.selective_scan_fn(*(x[k].float() for k in ("u", "delta", "A", "B", "C")), D=x["D"].float(),
                           z=x["z"].float(), delta_softplus=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    low = M.selective_scan_fn(*(x[k].bfloat16() for k in ("u", "delta")), *(x[k].float() for k in ("A", "B", "C")))
    assert low.dtype == torch.bfloat16


def test_selective_scan_says_where_it_differs_from_mamba_ssm():
    x = _scan_inputs(2, 4, 3, 3, seed=13)
    u, delta, A, B, C = (x[k] for k in ("u", "delta", "A", "B", "C"))
    with pytest.raises(ValueError, match="B: expected a \\[batch, d_state, seqlen\\]"):
        M.selective_scan_fn(u, delta, A, torch.randn(4, 3, dtype=torch.float64), C)      # constant B [d, n]
    with pytest.raises(ValueError, match="C: expected"):
        M.selective_scan_fn(u, delta, A, B, C[:, None])                                    # grouped C
    with pytest.raises(TypeError, match="complex A"):
        M.selective_scan_fn(u, delta, A.to(torch.complex128), B, C)
    with pytest.raises(ValueError, match="D: expected shape \\[4\\]"):
        M.selective_scan_fn(u, delta, A, B, C, D=torch.ones(5, dtype=torch.float64))


# ---- the Triton scan (CUDA without mamba-ssm): exact in the interpreter, compiled for every target ----------

INTERPRETING = __import__("os").environ.get("TRITON_INTERPRET") == "1"
needs_triton_run = pytest.mark.skipif(not (INTERPRETING or torch.cuda.is_available()),
                                      reason="the Triton scan runs on CUDA or under TRITON_INTERPRET=1")


@needs_triton_run
@pytest.mark.parametrize("last", [False, True])
def test_triton_scan_matches_mamba_ssm_reference_in_float32(last, monkeypatch):
    """selective_scan_fn through the Triton kernels (on CPU tensors in the interpreter, on CUDA on a
    GPU): values and every gradient within 1e-5 of selective_scan_ref (float64), with D, z, Δ bias,
    softplus; the backward's row groups forced to 3 rows with a short last group (batch 7)."""
    import fastdiag.core.kernels.selective_scan_triton as scan
    import fastdiag.models.mamba as mamba

    monkeypatch.setattr(mamba, "_scan_function", lambda u: scan.TritonSelectiveScan)
    monkeypatch.setattr(scan, "TARGET_PROGRAMS", 3)     # 7 rows, 1 channel block: groups of 3, 3, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _scan_inputs(7, 24, 6, 5, seed=21 + last)
    ref = {k: v.clone().requires_grad_() for k, v in x.items()}
    f32 = {k: v.float().to(device).requires_grad_() for k, v in x.items()}
    names = ("u", "delta", "A", "B", "C")
    kwargs = lambda a: dict(D=a["D"], z=a["z"], delta_bias=a["delta_bias"], delta_softplus=True,  # noqa: E731
                            return_last_state=last)
    want = M.selective_scan_ref(*(ref[k] for k in names), **kwargs(ref))
    got = M.selective_scan_fn(*(f32[k] for k in names), **kwargs(f32))
    want, got = (want, got) if last else ((want,), (got,))
    weights = [torch.randn_like(w) for w in want]
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double().cpu(), w, rtol=1e-5, atol=1e-5)
    g_want = torch.autograd.grad(sum((w * c).sum() for w, c in zip(want, weights)), list(ref.values()))
    g_got = torch.autograd.grad(sum((g * c.float().to(device)).sum() for g, c in zip(got, weights)), list(f32.values()))
    for name, gg, gw in zip(ref, g_got, g_want):
        torch.testing.assert_close(gg.double().cpu(), gw, rtol=1e-5, atol=1e-5, msg=lambda m: f"d{name}: {m}")


@needs_triton_run
@pytest.mark.parametrize("target_programs", [1024, 2])
def test_triton_scan_members_are_independent_and_match_the_pytorch_scan(target_programs, monkeypatch):
    """Three members at once (each its own A): the Triton forward and backward equal the PyTorch
    scan's (the CPU path) member by member, including the last state's gradient; with one row per
    backward program, and with all of a member's rows in one (never more than a member has)."""
    import fastdiag.core.kernels.selective_scan_triton as scan
    from fastdiag.core.kernels.selective_scan_triton import TritonSelectiveScan

    monkeypatch.setattr(scan, "TARGET_PROGRAMS", target_programs)

    g = torch.Generator().manual_seed(5)
    K, b, l, d, n = 3, 4, 3, 40, 16
    r = lambda *s: torch.randn(*s, generator=g)   # noqa: E731
    inputs = [r(K, b, l, d), 0.05 + torch.rand(K, b, l, d, generator=g), -torch.exp(0.5 * r(K, d, n)),
              r(K, b, l, n), r(K, b, l, n)]
    gy, glast = r(K, b, l, d), r(K, b, d, n)
    outs = []
    for fn, device in ((M.mamba._SelectiveScanFn, "cpu"), (TritonSelectiveScan, "cuda" if torch.cuda.is_available() else "cpu")):
        xs = [x.to(device).requires_grad_() for x in inputs]
        y, last = fn.apply(*xs, True)
        grads = torch.autograd.grad((y * gy.to(device)).sum() + (last * glast.to(device)).sum(), xs)
        outs.append([t.cpu() for t in (y, last, *grads)])
    for want, got in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_scan_rejects_what_it_does_not_compute():
    from fastdiag.core.kernels import selective_scan_triton as scan

    x = [torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 4, 5), torch.zeros(1, 2, 3, 5),
         torch.zeros(1, 2, 3, 5)]
    with pytest.raises(TypeError, match="u: the Triton selective scan computes in float32"):
        scan.scan_forward(x[0].double(), *x[1:], False)
    with pytest.raises(ValueError, match="A, B, C: expected"):
        scan.scan_forward(*x[:2], torch.zeros(1, 5, 4), *x[3:], False)


_SCAN_TARGETS = r"""
import json, torch
from fastdiag import kernel_report as report
from fastdiag.core.kernels import selective_scan_triton as scan
K, b, l, d, n = 64, 512, 3, 512, 16        # 64 canonical Mamba members (d_inner 512, d_state 16, T = 3)
e = lambda *s: torch.empty(*s)
args = (e(K, b, l, d), e(K, b, l, d), e(K, d, n), e(K, b, l, n), e(K, b, l, n))
rows = []
for arch in (80, 86, 89, 90, 100, 120):
    gpu = report.GPUS[arch]
    for name, launch in (("forward", lambda: scan.scan_forward(*args, True)),
                         ("backward", lambda: scan.scan_backward(*args, e(K, b, l, d), e(K, b, d, n)))):
        fn, cargs = report._captured_launches(report.ReportCase(name, "", "float32", 4, launch, lambda _: 1), gpu)[0]
        compiled, _ = report._compile(fn, cargs, gpu)
        rows.append([arch, name, *report._ptxas_usage(compiled.asm["ptx"], arch)])
print(json.dumps(rows))
"""


def test_triton_scan_compiles_for_every_target_without_spills():
    """Both kernels as a launch on 64 canonical Mamba members would compile them, for sm_80, 86, 89,
    90, 100 and 120 (ptxas from the triton wheel; a subprocess without TRITON_INTERPRET): no spills."""
    import json
    import os
    import subprocess

    from fastdiag import kernel_report as report

    if report.tools_missing():
        pytest.skip(f"CUDA tools missing: {report.tools_missing()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SCAN_TARGETS], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 12
    assert [r for r in rows if r[3] != 0] == [], rows       # [arch, kernel, registers, spilled bytes]
    assert all(r[2] <= 255 for r in rows), rows


# ---- mamba-ssm detection --------------------------------------------------------------------------

def _fake_mamba_ssm(root, with_extension: bool):
    """A package laid out like mamba-ssm's main branch: it imports fine, and imports the compiled
    ``selective_scan_cuda`` optionally (None when absent), like selective_scan_interface.py there."""
    pkg = root / "mamba_ssm"
    (pkg / "modules").mkdir(parents=True)
    (pkg / "ops").mkdir()
    (pkg / "__init__.py").write_text('__version__ = "2.3.3.dev0"\nfrom mamba_ssm.modules.mamba_simple import Mamba\n')
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "selective_scan_interface.py").write_text(
        "try:\n    import selective_scan_cuda\nexcept ImportError:\n    selective_scan_cuda = None\n")
    (pkg / "modules" / "__init__.py").write_text("")
    (pkg / "modules" / "mamba_simple.py").write_text(
        "import torch.nn as nn\nfrom mamba_ssm.ops.selective_scan_interface import selective_scan_cuda\n\n"
        "class Mamba(nn.Module):\n    pass\n")
    if with_extension:
        (root / "selective_scan_cuda.py").write_text("def fwd(*args):\n    raise NotImplementedError\n")


@pytest.fixture
def isolated_imports(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m.split(".")[0] in ("mamba_ssm", "selective_scan_cuda")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("mamba_ssm", "selective_scan_cuda")]:
        del sys.modules[name]


def test_mamba_ssm_detection_without_the_package(isolated_imports):
    missing = M.mamba_ssm_missing()
    assert missing.startswith("mamba-ssm is not importable") and "mamba_ssm" in missing
    assert not M.mamba_ssm_available()


def test_mamba_ssm_detection_sees_a_package_without_its_cuda_extension(isolated_imports):
    _fake_mamba_ssm(isolated_imports, with_extension=False)
    import mamba_ssm   # noqa: F401  - the package itself imports fine, as on mamba-ssm's main branch

    missing = M.mamba_ssm_missing()
    assert "without its CUDA extension selective_scan_cuda" in missing and "MAMBA_KEEP_CUDA_BUILD" in missing
    assert not M.mamba_ssm_available()
    with pytest.warns(RuntimeWarning, match="using fastdiag.s Triton selective scan on cuda.*selective_scan_cuda"):
        assert not M.mamba.use_mamba_ssm("cuda")


def test_mamba_ssm_detection_with_the_extension_then_needs_cuda(isolated_imports, recwarn):
    _fake_mamba_ssm(isolated_imports, with_extension=True)
    expected = None if torch.cuda.is_available() else "CUDA is not available"
    assert M.mamba_ssm_missing() == expected
    assert not M.mamba.use_mamba_ssm("cpu") and not recwarn.list   # CPU: the PyTorch scan, silently
    assert not M.build("mamba", d_model=16, n_layers=1, device="cpu").uses_mamba_ssm
