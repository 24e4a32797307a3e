"""The modular-arithmetic task: targets, vocabulary, split (fastdiag.grokking.tasks)."""
import pytest
import torch

from fastdiag.grokking.tasks import OPS, all_pairs, is_prime, make_task

PYTHON_OPS = {
    "+": lambda a, b, p: (a + b) % p,
    "-": lambda a, b, p: (a - b) % p,
    "*": lambda a, b, p: (a * b) % p,
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("p", [7, 13])
def test_targets_match_python_arithmetic(op, p):
    x, y = all_pairs(op, p)
    assert x.dtype == torch.int64 and x.shape[1] == 3
    assert (x[:, 2] == p).all(), "the '=' token is p"
    seen = set()
    for (a, b, _), c in zip(x.tolist(), y.tolist()):
        seen.add((a, b))
        assert 0 <= c < p
        if op == "/":
            assert b != 0 and (c * b) % p == a
        else:
            assert c == PYTHON_OPS[op](a, b, p)
    expected = {(a, b) for a in range(p) for b in range(p) if op != "/" or b != 0}
    assert seen == expected


@pytest.mark.parametrize("op, n", [("+", 97 * 97), ("/", 97 * 96)])
def test_split_sizes_disjoint_and_seeded(op, n):
    task = make_task(op, 97, train_frac=0.5, seed=3)
    assert task.vocab_size == 98 and task.seq_len == 3 and task.eq_token == 97
    assert task.train_x.shape == (round(n / 2), 3) and task.test_x.shape[0] == n - round(n / 2)
    assert task.train_y.shape[0] == task.train_x.shape[0] and task.test_y.shape[0] == task.test_x.shape[0]
    train = {tuple(r) for r in task.train_x.tolist()}
    test = {tuple(r) for r in task.test_x.tolist()}
    assert not train & test and len(train | test) == n
    again = make_task(op, 97, train_frac=0.5, seed=3)
    assert torch.equal(again.train_x, task.train_x) and torch.equal(again.test_y, task.test_y)
    other = make_task(op, 97, train_frac=0.5, seed=4)
    assert not torch.equal(other.train_x, task.train_x)


def test_train_fraction():
    task = make_task("+", 11, train_frac=0.7, seed=0)
    assert task.train_x.shape[0] == round(0.7 * 121)


@pytest.mark.parametrize("p", [12, 15, 1])
def test_division_needs_a_prime(p):
    with pytest.raises(ValueError, match="p"):
        make_task("/", p)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown operation"):
        make_task("^", 7)
    with pytest.raises(ValueError, match="train_frac"):
        make_task("+", 7, train_frac=1.0)
    with pytest.raises(ValueError, match="empty"):
        make_task("+", 2, train_frac=0.01)


def test_is_prime():
    assert [n for n in range(30) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
