"""The modular-arithmetic task of the grokking experiments (docs/experiments.md).

Every pair (a, b) with a, b in [0, p) (b != 0 for ÷) becomes the sequence ``[a, b, =]`` with target
``c = a ∘ b mod p``; the "=" token is ``p``, so the vocabulary has ``p + 1`` tokens. The pairs are
split into train / test halves (``train_frac``) by a seeded permutation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdiag.grokking.config import OPS

SEQ_LEN = 3
# Peak host bytes per (a, b) pair while the task is built: a, b, the "=" column and the stacked
# [N, 3] sequences (int64), the targets and their temporaries, the permutation and the split copies:
# about ten int64 values per pair. The pairs grow as p², so this, not the model, bounds p.
TASK_BYTES_PER_PAIR = 80


def task_shape(p: int) -> tuple[int, int]:
    """(vocabulary size, sequence length) of the task mod ``p``: tokens 0..p-1 and "=", ``[a, b, =]``."""
    return p + 1, SEQ_LEN


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def available_memory() -> int | None:
    """Bytes of memory available now (Linux), else None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return None


def max_modulus(memory: int) -> int:
    """The largest p whose p² pairs fit in ``memory`` bytes while the task is built."""
    return math.isqrt(memory // TASK_BYTES_PER_PAIR)


def check_task(op: str, p: int, memory: int | None = None) -> None:
    """Raise ValueError now, before anything is allocated, for a task that cannot be built: an unknown
    operation, p < 2, ÷ with a composite p, or more pairs than ``memory`` (default: available now) holds."""
    if op not in OPS:
        raise ValueError(f"op: unknown operation {op!r}; expected one of {' '.join(OPS)}")
    if not isinstance(p, int) or isinstance(p, bool) or p < 2:
        raise ValueError(f"p: modulus must be an integer >= 2, got {p!r}")
    if op == "/" and not is_prime(p):
        raise ValueError(f"p: division mod {p} needs a prime modulus (not every b has an inverse)")
    memory = available_memory() if memory is None else memory
    if memory is not None and p > max_modulus(memory):
        raise ValueError(f"p: {p} gives p² = {p * p:.3g} pairs, about {p * p * TASK_BYTES_PER_PAIR / 2**30:.0f} GiB "
                         f"to build the task, but {memory / 2**30:.1f} GiB of memory is available "
                         f"(largest p here: {max_modulus(memory)})")


def apply_op(op: str, a: torch.Tensor, b: torch.Tensor, p: int) -> torch.Tensor:
    """``a ∘ b mod p`` elementwise on int64 tensors (÷: a · b^(p−2), Fermat's inverse; p prime)."""
    if op == "+":
        return (a + b) % p
    if op == "-":
        return (a - b) % p
    if op == "*":
        return (a * b) % p
    if op == "/":
        inverse = torch.tensor([pow(int(x), p - 2, p) if x else 0 for x in range(p)], dtype=torch.int64)
        return (a * inverse.to(b.device)[b]) % p
    raise ValueError(f"op: unknown operation {op!r}; expected one of {' '.join(OPS)}")


@dataclass(frozen=True)
class Task:
    op: str
    p: int
    train_x: torch.Tensor   # [N_train, 3] int64
    train_y: torch.Tensor   # [N_train] int64
    test_x: torch.Tensor    # [N_test, 3]
    test_y: torch.Tensor    # [N_test]

    @property
    def vocab_size(self) -> int:
        return task_shape(self.p)[0]

    @property
    def seq_len(self) -> int:
        return task_shape(self.p)[1]

    @property
    def eq_token(self) -> int:
        return self.p


def all_pairs(op: str, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All sequences ``[a, b, p]`` and targets, in (a, b) lexicographic order."""
    check_task(op, p)
    a = torch.arange(p).repeat_interleave(p)
    b = torch.arange(p).repeat(p)
    if op == "/":
        keep = b != 0
        a, b = a[keep], b[keep]
    x = torch.stack([a, b, torch.full_like(a, p)], dim=1)
    return x, apply_op(op, a, b, p)


def make_task(op: str = "+", p: int = 97, train_frac: float = 0.5, seed: int = 0,
              device: str | torch.device = "cpu") -> Task:
    """The seeded train/test split of all pairs, as tensors on ``device``."""
    if not 0.0 < train_frac < 1.0:
        raise ValueError(f"train_frac: must be in (0, 1), got {train_frac}")
    x, y = all_pairs(op, p)
    n = x.shape[0]
    n_train = int(round(train_frac * n))
    if not 0 < n_train < n:
        raise ValueError(f"train_frac: {train_frac} of {n} examples leaves an empty train or test half")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    train, test = perm[:n_train], perm[n_train:]
    return Task(op=op, p=p, train_x=x[train].to(device), train_y=y[train].to(device),
                test_x=x[test].to(device), test_y=y[test].to(device))
