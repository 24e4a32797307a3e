"""The one rule for which keys are masked and which query rows count (fastdiag/core/kernels/rows.py),
and every path that reads it — attach's softmax and SDPA paths, MultiheadAttention, fastdiag.qk and
the float64 references — against float64 on fresh random inputs with masks. Padding is what the
masks say, never what a probability underflowed to."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdiag
from fastdiag.core.kernels import rows
from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
from fastdiag.qk import qk_head_stats

from fastdiag.testing import rel_err

from tests.helpers import assert_stats_close

FILLS = [float("-inf"), torch.finfo(torch.float32).min, -1e30, -1e9, -1e6, -1e4]


def _hs(probs, real=None):
    return fastdiag.head_stats(probs.double(), real, backend="reference")


# ---- the rule itself -------------------------------------------------------------------------------

@pytest.mark.parametrize("fill", FILLS + [-65500.0])
def test_every_masking_fill_in_use_masks_and_sharp_real_scores_do_not(fill):
    dtype = torch.float16 if fill == -65500.0 else torch.float32
    values = torch.tensor([fill, fill + 3000.0 if abs(fill) < 1e5 else fill, 0.0, -200.0, -900.0, 150.0,
                           float("nan")], dtype=dtype)
    assert rows.masked(values).tolist() == [True, True, False, False, False, False, False]
    assert rows.masked(torch.tensor([True, False])).tolist() == [False, True]
    assert rows.masked(torch.tensor([-1e4 / 64 ** 0.5 + 200.0])).item()     # a -1e4 fill scaled by 1/√d after


def _sharp_padded_batch(seed, b=3, h=4, t=9, d=8, fill=-1e4):
    """q, k and an additive mask: a key-padding mask (right, left, none) as ``fill`` on top of a score
    term (a position bias) that puts the real key 4 300 below the others — far beyond float32's
    underflow, so it gets exactly 0 in every row and head — and the real-token mask."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, h, t, d, generator=g)
    real = torch.ones(b, t, dtype=torch.bool)
    real[0, -2:] = False
    real[1, :3] = False
    bias = torch.zeros(t)
    bias[4] = -300.0
    mask = (torch.zeros(b, 1, 1, t) + bias).masked_fill(~real[:, None, None, :], fill)
    return q, k, mask, real


@pytest.mark.parametrize("fill", FILLS)
def test_rows_are_read_from_the_mask_never_from_exact_zeros_in_p(fill):
    q, k, mask, real = _sharp_padded_batch(1, fill=fill)
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + mask
    probs = scores.softmax(-1)
    underflowed = (probs == 0) & ~rows.masked(scores)
    assert underflowed.all(1).all(1).any()      # a real key got exactly 0 in every row and head: the trap
    hidden = rows.masked(scores)
    assert torch.equal(rows.self_attention_rows(hidden), real)
    # the same rule from the mask alone (SDPA), on the mask's own broadcast shape
    hidden_from_mask = rows.hidden_keys(mask, 3, 4, 9, 9)
    assert hidden_from_mask.shape == (3, 1, 9, 9)
    assert torch.equal(rows.self_attention_rows(hidden_from_mask), real)


def test_valid_rows_on_a_broadcast_mask_equals_the_rule_written_out():
    g = torch.Generator().manual_seed(2)
    for is_causal in (False, True):
        mask = torch.randn(2, 1, 7, 7, generator=g).masked_fill(torch.rand(2, 1, 7, 7, generator=g) > 0.6, -1e4)
        mask[1, :, 3] = -1e6                                          # row 3 of sequence 1 sees nothing
        written_out = rows.visible_keys(mask, is_causal, (2, 4, 7, 7))
        assert torch.equal(rows.valid_rows(mask, is_causal, (2, 4, 7, 7), None), rows.sees_a_key(~written_out))


@pytest.mark.parametrize("case, flagged", [("xlnet left", True), ("xlnet right 2", True), ("xlnet right 1", True),
                                           ("causal", False),
                                           ("causal padded", False), ("image prefix then causal text", False),
                                           ("bidirectional", False)])
def test_a_position_seen_only_by_itself_is_flagged_only_where_it_can_be_padding(case, flagged):
    t = 8
    seen = torch.ones(t, t, dtype=torch.bool)
    if case.startswith("xlnet"):                # a padded key is seen by its own query only
        pads = {"xlnet left": [0, 1, 2], "xlnet right 2": [6, 7], "xlnet right 1": [7]}[case]
        for p in pads:
            seen[:, p] = False
            seen[p, p] = True
    elif case.startswith("causal"):
        seen = seen.tril()
        if case == "causal padded":
            seen[:, :2] = False
    elif case.startswith("image"):              # GIT: 3 image tokens see each other, text is causal
        seen = seen.tril()
        seen[:3, :3] = True
    assert bool(rows.seen_only_by_itself(~seen[None, None])) is flagged


# ---- every path reads it: exact against float64 of what the model computed -------------------------

class SharpAttention(nn.Module):
    """Hand-written self-attention with a finite additive padding mask and sharp logits: its softmax
    gives real keys exactly 0 (the last causal key, seen by one row only, in every head)."""

    def __init__(self, fill, causal, use_sdpa=False):
        super().__init__()
        self.fill, self.causal, self.use_sdpa = fill, causal, use_sdpa
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("position_bias", torch.zeros(9))   # a score term: key 4 far below the others
        self.position_bias[4] = -300.0

    def forward(self, x, real):
        b, t = x.shape[:2]
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.qkv(x).split(16, -1))
        mask = self.position_bias.expand(b, 1, 1, t).masked_fill(~real[:, None, None, :], self.fill)
        if self.causal:
            mask = mask.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), self.fill)
        self.seen = (q.detach(), k.detach(), mask)
        if self.use_sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = (q @ k.transpose(-1, -2) / 2 + mask).softmax(-1) @ v
        return out.transpose(1, 2).reshape(b, t, 16)


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["softmax", "sdpa"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("fill", [-1e4, -1e30, torch.finfo(torch.float32).min])
def test_sharp_attention_keeps_every_real_row_on_every_path(fill, causal, use_sdpa):
    torch.manual_seed(0)
    model, x = SharpAttention(fill, causal, use_sdpa), torch.randn(3, 9, 16)
    real = torch.ones(3, 9, dtype=torch.bool)
    real[0, -2:] = False
    real[1, :3] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastdiag.attach(model, every=1) as monitor:
            model(x, real)
    q, k, mask = model.seen
    probs32 = (q @ k.transpose(-1, -2) / 2 + mask).softmax(-1)
    trap = ((probs32 == 0) | (mask <= rows.MASKED_AT)).all(1).all(1) & real   # a real key at 0 in every row
    assert trap.any()
    want_rows = real & rows.sees_a_key(rows.masked(mask.expand(3, 4, 9, 9)))
    want = _hs((q.double() @ k.double().transpose(-1, -2) / 2 + mask.double()).softmax(-1), want_rows)
    got = monitor.latest_stats()["<root>"]
    assert got.rows.item() == want_rows.sum().item() == 22
    assert_stats_close(got, want)


def test_multihead_attention_reads_the_same_rule_from_a_finite_float_mask():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.normal_(0, 3.0)
    x = torch.randn(2, 7, 16)
    real = torch.ones(2, 7, dtype=torch.bool)
    real[1, -3:] = False
    mask = torch.zeros(2 * 4, 7, 7).masked_fill(~real.repeat_interleave(4, 0)[:, None, :], -1e4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastdiag.attach(mha, every=1) as monitor:
            mha(x, x, x, attn_mask=mask)
    wq, wk = mha.in_proj_weight[:16].double(), mha.in_proj_weight[16:32].double()
    bq, bk = mha.in_proj_bias[:16].double(), mha.in_proj_bias[16:32].double()
    q = (x.double() @ wq.T + bq).view(2, 7, 4, 4).transpose(1, 2)
    k = (x.double() @ wk.T + bk).view(2, 7, 4, 4).transpose(1, 2)
    probs = (q @ k.transpose(-1, -2) / 2 + mask.double().view(2, 4, 7, 7)).softmax(-1)
    got = monitor.latest_stats()["<root>"]
    assert got.rows.item() == 11
    assert_stats_close(got, _hs(probs, real))


def test_qk_head_stats_and_its_float64_reference_read_the_same_rule():
    q, k, mask, real = _sharp_padded_batch(4, fill=-1e6)
    got = qk_head_stats(q, k, mask, query_mask=real, backend="torch")
    want = qk_stats_ref(q.double(), k.double(), mask.double(), query_mask=real)
    assert got.rows.item() == want[2].item() == real.sum().item()
    fully_masked = mask.expand(3, 1, 9, 9).clone()
    fully_masked[2, :, 4] = -1e6                                   # a row that sees no key: out on both
    got = qk_head_stats(q, k, fully_masked, backend="torch")
    assert got.rows.item() == qk_stats_ref(q, k, fully_masked)[2].item() == 27 - 1


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["gpt2", "llama (GQA)"])
def test_hugging_face_models_with_sharp_attention_count_every_real_row(arch, impl):
    """Weights at std 4: the models' float32 softmaxes give real keys exactly 0 (before: gpt2 eager
    counted 18 of 20 rows, llama 18). Every real row counts, eager and SDPA alike, padded or not, and
    the statistics are those of float64 of the probabilities the model used."""
    from tests.hf_matrix import attached_unchanged, build, inputs, reference, sharpen
    model = sharpen(build(arch, impl), 4.0, seed=0)
    traps = []
    for padded, real_rows in ((False, 20), (True, 15)):
        batch = inputs(arch, padded)
        if impl == "eager":   # the trap: some real key of some sequence is 0 in every row and head
            with torch.no_grad():
                probs = model(**batch, output_attentions=True).attentions
            real = batch["attention_mask"].bool()[:, None, None, :]
            traps += [bool((((p == 0) | ~real).all(1).all(1) & real[:, 0, 0]).any()) for p in probs]
        model.zero_grad(set_to_none=True)
        monitor, problems = attached_unchanged(model, lambda m: m(**batch).logits)
        assert not problems
        got = list(monitor.latest_stats().values())
        want = reference(arch, model, batch)
        assert [g.rows.item() for g in got] == [real_rows] * len(want)
        for g, w in zip(got, want):   # 1e-4 (the bar); σ_l below 1e-6 (README) to 1e-10 absolute
            assert rel_err(g.gram, w.gram) <= 1e-4
            assert abs(g.sync().item() - w.sync().item()) <= 1e-4 * abs(w.sync().item())
            sigma = w.entropy_spread().item()
            assert abs(g.entropy_spread().item() - sigma) <= (1e-4 * sigma if sigma >= 1e-6 else 1e-9)
    assert impl == "sdpa" or any(traps)


def test_git_unpadded_is_exact_and_not_taken_for_xlnet_padding():
    """GIT: a bidirectional image prefix, then causal text; the last text key is seen by its own row
    only, as XLNet's padding is, but it is no padding: no warning, every row counted, exact."""
    transformers = pytest.importorskip("transformers")
    from tests.hf_matrix import sharpen
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8, attention_dropout=0.0)
    config = transformers.GitConfig(vision_config=vision, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, vocab_size=64, max_position_embeddings=64,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = sharpen(transformers.GitForCausalLM._from_config(config, attn_implementation="eager"), seed=0)
    ids, pixels = torch.randint(2, 64, (2, 6)), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pixels, output_attentions=True).attentions
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastdiag.attach(model, every=1, strict=True) as monitor:
            model(input_ids=ids, pixel_values=pixels)
            assert monitor.coverage()["all_rows"] == {}
    text_layers = {n: s for n, s in monitor.latest_stats().items() if n.startswith("git.encoder.")}
    assert len(text_layers) == len(want) == 2
    for got, probs in zip(text_layers.values(), want):
        assert got.rows.item() == probs.shape[0] * probs.shape[2]
        assert_stats_close(got, _hs(probs))


# ---- named where the rows cannot be decided ----------------------------------------------------------

class TokenIdAttention(nn.Module):
    """Queries and keys built inside the module from a token-id argument (no floating-point input to
    trace them to): whether it is self-attention is not known."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv = nn.Embedding(32, 16), nn.Linear(16, 48)

    def forward(self, ids, real):
        b, t = ids.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.qkv(self.embed(ids)).split(16, -1))
        mask = torch.zeros(b, 1, 1, t).masked_fill(~real[:, None, None, :], float("-inf"))
        self.seen = (q.detach(), k.detach(), mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MemoryPrefixAttention(nn.Module):
    """Transformer-XL style: keys and values over a memory prefix and the input, k = cat(memory, x)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.memory = nn.Linear(16, 48), nn.Parameter(torch.randn(3, 16))

    def forward(self, x, real):
        b, t = x.shape[:2]
        q = self.qkv(x)[..., :16].view(b, t, 4, 4).transpose(1, 2)
        kv = self.qkv(torch.cat([self.memory.expand(b, 3, 16), x], 1))[..., 16:]
        k, v = (z.view(b, t + 3, 4, 4).transpose(1, 2) for z in kv.split(16, -1))
        mask = torch.zeros(b, 1, 1, t + 3)
        mask[..., 3:] = mask[..., 3:].masked_fill(~real[:, None, None, :], float("-inf"))
        return (q @ k.transpose(-1, -2) / 2 + mask).softmax(-1) @ v


def _padded(b=2, t=6):
    real = torch.ones(b, t, dtype=torch.bool)
    real[0, -2:] = False
    return real


@pytest.mark.parametrize("case", ["token ids", "memory prefix"])
def test_rows_that_cannot_be_decided_are_named_once_at_the_first_read(case):
    torch.manual_seed(0)
    real = _padded()
    if case == "token ids":
        model, args = TokenIdAttention(), (torch.randint(0, 32, (2, 6)), real)
    else:
        model, args = MemoryPrefixAttention(), (torch.randn(2, 6, 16), real)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            model(*args)
            model(*args)
            assert not [w for w in caught if "fastdiag" in str(w.message)]   # nothing said in the step
            monitor.latest()
            coverage = monitor.coverage()
    named = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
    assert len(named) == 1 and f"layer '<root>' ({type(model).__name__})" in named[0]
    assert ("not known" if case == "token ids" else "keys outnumber its queries") in named[0]
    assert list(coverage["all_rows"]) == ["<root>"]
    with pytest.raises(RuntimeError, match=type(model).__name__):
        with fastdiag.attach(model, every=1, strict=True) as monitor:
            model(*args)
            monitor.latest()


def test_unpadded_calls_of_unknown_provenance_are_not_named_and_a_mask_for_the_module_decides():
    """No mask hides a position: nothing could have been counted wrongly, nothing is said. A mask handed
    in for the module itself (within=) says it is self-attention: its padded rows are left out, exactly."""
    torch.manual_seed(0)
    model, ids = TokenIdAttention(), torch.randint(0, 32, (2, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastdiag.attach(model, every=1, strict=True) as monitor:
            model(ids, torch.ones(2, 6, dtype=torch.bool))
            assert monitor.coverage()["all_rows"] == {}
            real = _padded()
            monitor.set_padding(real, within=model)
            model(ids, real)
            assert monitor.coverage()["all_rows"] == {}
    q, k, mask = model.seen
    probs = (q.double() @ k.double().transpose(-1, -2) / 2 + mask.double()).softmax(-1)
    got = monitor.latest_stats()["<root>"]
    assert got.rows.item() == 10
    assert_stats_close(got, _hs(probs, real))


def test_compiled_hugging_face_llama_names_its_layers_only_when_padded():
    """torch.compile(fullgraph=True): provenance is not traced, so a padded batch's padding rows cannot be
    told; the layers are named at the first read after a padded pass (the flag leaves the graph with the
    statistics), not after an unpadded one (before: counted with no warning, error 0.54)."""
    from tests.hf_matrix import build, inputs
    torch._dynamo.reset()
    model = build("llama (GQA)", "sdpa")
    compiled = torch.compile(model, backend=lambda gm, example_inputs: gm.forward, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdiag.attach(model, every=1) as monitor:
            compiled(**inputs("llama (GQA)", padded=False))
            assert monitor.coverage()["all_rows"] == {}
            compiled(**inputs("llama (GQA)", padded=True))
            assert not [w for w in caught if "fastdiag" in str(w.message)]
            all_rows = monitor.coverage()["all_rows"]
    named = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
    assert set(all_rows) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert len(named) == 2 and all("(LlamaAttention)" in m and "not known" in m for m in named)


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["softmax", "sdpa"])
def test_a_token_drop_mask_leaves_out_the_tokens_row_and_coverage_counts_it(use_sdpa):
    """A real token whose key the mask hides from every query is what padding is to a mask: its query
    row is left out (README, "Which query rows are padding"), and coverage()["padding_rows"] counts the
    rows left out that way, so a reader of s̄ can see it."""
    torch.manual_seed(0)
    model, x = SharpAttention(float("-inf"), causal=False, use_sdpa=use_sdpa), torch.randn(3, 9, 16)
    real = torch.ones(3, 9, dtype=torch.bool)
    real[2, 5] = False                           # token 5 of sequence 2 dropped: a real token, hidden
    with fastdiag.attach(model, every=1) as monitor:
        model(x, torch.ones(3, 9, dtype=torch.bool))
        assert monitor.coverage()["padding_rows"] == {}
        model(x, real)
        assert monitor.coverage()["padding_rows"] == {"<root>": 1}
    q, k, mask = model.seen
    want = _hs((q.double() @ k.double().transpose(-1, -2) / 2 + mask.double()).softmax(-1), real)
    got = monitor.latest_stats()["<root>"]
    assert got.rows.item() == 26
    assert_stats_close(got, want)


class _ShiftedKey(nn.Module):
    """Self-attention whose token 2 is huge and aligned with every other (k = -x): its key scores -1388 to
    -1516 in every row, an ordinary distribution shifted below -1000 (softmax is shift-invariant), or, with
    ``fill``, a padded batch whose mask is that fill (added before the 1/sqrt(d) scale when ``prescaled``)."""

    def __init__(self, eager, fill=None, prescaled=False):
        super().__init__()
        self.eager, self.fill, self.prescaled, self.num_heads = eager, fill, prescaled, 2

    def forward(self, x, real=None):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in (x, -x, x))
        scale = (c // 2) ** -0.5
        mask = None if real is None else torch.zeros(b, 1, 1, t).masked_fill(~real.view(b, 1, 1, t), self.fill)
        self.seen = (q.detach(), k.detach(), mask)
        if not self.eager:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, c)
        scores = q @ k.transpose(-1, -2)
        if mask is not None and self.prescaled:
            scores = scores + mask
        scores = scores * scale
        if mask is not None and not self.prescaled:
            scores = scores + mask
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)


def test_rows_decided_by_scores_between_minus_5000_and_minus_1000_are_named_not_silently_dropped():
    """On the softmax path only the scores are seen, and a score at most -1000 reads as masked: a real key
    whose score is that low in every row (no mask anywhere) read as a padding position and its row was left
    out with no word (5 of 6 rows, σ_l 20 % off; found by verify39). Where the deciding scores are finite
    and above -5000 — where a -1e4 fill scaled by 1/√d lies too — the layer is now named (all_rows;
    strict=True raises); SDPA reads no scores, counts the row and is exact; masks below -5000 stay quiet."""
    torch.manual_seed(0)
    x = torch.randn(1, 6, 8) * 0.3 + 3.0
    x[0, 2] = 250.0 + torch.randn(8)
    for eager in (True, False):
        model = _ShiftedKey(eager)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fastdiag.attach(model, every=1) as monitor:
                model(x)
                monitor.latest()
                coverage = monitor.coverage()
        named = [str(w.message) for w in caught if "fastdiag" in str(w.message)]
        if eager:
            assert len(named) == 1 and "between -5000 and -1000" in named[0] and "'<root>' (_ShiftedKey)" in named[0]
            assert list(coverage["all_rows"]) == ["<root>"]
        else:
            assert named == [] and coverage["all_rows"] == {}
            q, k, _ = model.seen
            got = monitor.latest_stats()["<root>"]
            assert got.rows.item() == 6
            assert_stats_close(got, _hs((q.double() @ k.double().transpose(-1, -2) * 0.5).softmax(-1)))
    with pytest.raises(RuntimeError, match="between -5000 and -1000"):
        with fastdiag.attach(_ShiftedKey(True), every=1, strict=True) as monitor:
            monitor.model(x)
            monitor.latest()
    # a padded batch: a -1e4 fill scaled after (-2500 at d 16) is named, the fills below -5000 are quiet
    y, real = torch.randn(2, 6, 32), _padded()
    for fill, prescaled, loud in ((-1e4, True, True), (-1e4, False, False), (torch.finfo(torch.float32).min, False, False)):
        model = _ShiftedKey(True, fill, prescaled)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fastdiag.attach(model, every=1) as monitor:
                model(y, real)
                monitor.latest()
        assert any("between -5000 and -1000" in str(w.message) for w in caught) == loud, (fill, prescaled)
        assert monitor.latest_stats()["<root>"].rows.item() == int(real.sum())
