"""Bad input: a clear error naming the problem, or NaN statistics flagged on the device."""
import pytest
import torch

import fastdiag
from fastdiag.testing import random_probs


@pytest.mark.parametrize("probs,match", [
    (torch.rand(3, 4, 5), r"probs: expected shape \[B, H, Tq, Tk\]"),
    (torch.rand(1, 2, 3, 4, 5, 6), r"probs: expected shape"),
    (torch.ones(2, 3, 4, 4, dtype=torch.int64), r"probs: expected a floating-point tensor"),
    (torch.rand(0, 3, 4, 4), r"probs: every dimension must be non-empty"),
    ([[0.5, 0.5]], r"probs: expected a torch.Tensor"),
])
def test_bad_probs_named(probs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fastdiag.head_stats(probs)


def test_mismatched_mask_named():
    probs = random_probs((2, 3, 4, 4))
    with pytest.raises(ValueError, match=r"query_mask: expected shape \[2, 4\]"):
        fastdiag.head_stats(probs, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"query_mask: expected dtype torch.bool"):
        fastdiag.head_stats(probs, torch.ones(2, 4))


def test_unknown_backend_named():
    with pytest.raises(ValueError, match=r"backend: expected one of"):
        fastdiag.head_stats(random_probs((1, 2, 3, 3)), backend="cuda-magic")


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.25, 1.5])
def test_bad_values_give_flagged_nan_without_raising(backend, bad):
    probs = random_probs((2, 3, 4, 4), seed=2)
    probs[1, 2, 3, 0] = bad
    s = fastdiag.head_stats(probs, backend=backend)         # never raises in a training step
    assert not bool(s.valid())
    assert torch.isnan(s.sync()) and torch.isnan(s.entropy_spread())
    with pytest.raises(ValueError, match=r"probs: holds values outside \[0, 1\] or non-finite"):
        fastdiag.head_stats(probs, backend=backend, validate=True)


def test_bad_values_in_padded_rows_are_ignored():
    probs = random_probs((2, 3, 4, 4), seed=2)
    probs[1, :, 3] = float("nan")
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 3] = False
    s = fastdiag.head_stats(probs, mask, validate=True)
    assert bool(s.valid()) and torch.isfinite(s.sync())


def test_empty_mask_flagged_then_raises_with_validate():
    probs = random_probs((2, 3, 4, 4), seed=2)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    s = fastdiag.head_stats(probs, mask)
    assert not bool(s.valid()) and torch.isnan(s.entropy_spread())
    with pytest.raises(ValueError, match=r"query_mask: marks no valid query row"):
        fastdiag.head_stats(probs, mask, validate=True)


def test_headstats_add_rejects_mismatched_shapes():
    a = fastdiag.head_stats(random_probs((1, 2, 3, 3)))
    b = fastdiag.head_stats(random_probs((1, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"HeadStats \+: shapes differ"):
        a + b


def test_summarize_rejects_empty_and_wrong_types():
    with pytest.raises(ValueError, match=r"stats_per_layer: expected at least one"):
        fastdiag.summarize({})
    with pytest.raises(TypeError, match=r"expected HeadStats"):
        fastdiag.summarize({"x": 1.0})


@pytest.mark.parametrize("backend", ["torch", "reference", "auto"])
@pytest.mark.parametrize("where", ["one entry", "a row", "all"])
def test_negative_probabilities_are_named_never_an_index_error(backend, where):
    """A row of negative "probabilities" made a negative key count that indexed a table (IndexError).
    Checked, they raise a ValueError naming probs; unchecked, the statistics say they are invalid."""
    from fastdiag.core.diagnostics import head_stats
    p = torch.rand(2, 3, 5, 5, generator=torch.Generator().manual_seed(0)).softmax(-1)
    if where == "one entry":
        p[0, 1, 2, 3] = -0.5
    elif where == "a row":
        p[1, 0, 4] = -0.2
    else:
        p = -p
    with pytest.raises(ValueError, match="^probs: "):
        head_stats(p, backend=backend, validate=True)
    assert not bool(head_stats(p, backend=backend).valid())


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_qk_head_stats_names_a_non_finite_scale(scale):
    from fastdiag.core.qk import qk_head_stats
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="^scale: expected a finite number"):
        qk_head_stats(q, k, scale=scale)
