"""The chunked single-pass PyTorch path of `fastdiag.head_stats` (the CPU default; on CUDA the
`"torch"` backend): the sums of `head_stats_ref` (its module docstring: the precision argument and
the row entropy taken relative to log n) in cache-sized chunks, float64 final sums."""
from __future__ import annotations

import math

import torch

from .constants import exact_fp32_matmul
from .head_stats_ref import row_validity, causal_keys

# Elements per chunk: on the CPU a chunk and its two work buffers stay in the core's L2/L3 cache; on
# CUDA (the torch backend there is a fallback) a chunk bounds the float64 copy its Gram is computed
# from (`_gram`) to 128 MB; elsewhere one chunk is the whole problem.
_CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 24}
# log(n p) is taken as log1p(n p − 1) (the faster of torch's two logs here, exact at n p ≈ 1).
# n p − 1 rounds to −1 for n p < 2⁻²⁵; the floor keeps log1p finite there, and moves such a term
# p·log(n p) by at most 2⁻²⁴/(e·n), the size of the rounding of n p − 1 itself.
_Z_FLOOR = -1 + 2.0 ** -24
_SHORT_ROW_KEYS = 16   # rows this short are laid out keys-major


def _fast_fp32_gram():
    """oneDNN's inner product computes the H×H Gram of a contiguous float32 ``[H, M]`` chunk about
    twice as fast as MKL's sgemm does for this tall-skinny shape (float32 products and sums either
    way). It is private to torch (inductor's), so `torch.bmm` stands in where it is missing."""
    try:
        op = torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None
    return op if torch.backends.mkldnn.is_available() else None


_LINEAR = _fast_fp32_gram()


def _gram(heads: torch.Tensor) -> torch.Tensor:
    """``heads [P, H, M]`` contiguous -> Gram ``[P, H, H]`` in the input dtype."""
    if heads.is_cuda:
        # float64: cuBLAS sums a chunk's ~10^6 columns in one fp32 chain (2e-5..6e-5 relative lost at
        # 66K columns on an H200); the result is summed in float64 by the caller anyway
        h64 = heads.double()
        return torch.bmm(h64, h64.transpose(1, 2))
    # inductor cannot lower the oneDNN op: compiled graphs take bmm
    if (heads.shape[0] == 1 and heads.dtype == torch.float32 and heads.device.type == "cpu" and _LINEAR is not None
            and not torch.compiler.is_compiling()):
        return _LINEAR(heads[0], heads[0], None, "none", [], "")[None]
    return torch.bmm(heads, heads.transpose(1, 2))


def _chunk_rows(budget: int, h: int, r0: int, tq: int, tk: int, offset: int, causal: bool) -> int:
    """Rows from ``r0`` whose keys fill about ``budget`` elements; with causal rows only the keys up to
    the chunk's last row count, so early rows come in larger chunks."""
    rows = max(1, budget // (h * tk))
    if causal:
        a = max(0, r0 + offset)        # keys of rows r0..r0+R-1 are at most a + R
        rows = max(rows, int((math.sqrt(a * a + 4 * budget / h) - a) / 2))
    return min(rows, tq - r0)


def _plan(n: int, b: int, h: int, tq: int, tk: int, budget: int, causal: bool):
    """(problems, batch entries, first row, row count) chunks covering ``[N, B, Tq]``: several whole
    problems, several whole batch entries of one problem, or rows of one entry."""
    per_problem = b * tq * h * tk
    if per_problem <= budget:                                          # grokking: T = 3
        step = budget // per_problem
        return [(slice(i, min(n, i + step)), slice(0, b), 0, tq) for i in range(0, n, step)]
    if tq * h * tk <= budget:
        step = budget // (tq * h * tk)
        return [(slice(i, i + 1), slice(j, min(b, j + step)), 0, tq) for i in range(n) for j in range(0, b, step)]
    offset, plan = causal_keys(tq, tk), []
    r0 = 0
    while r0 < tq:
        rows = _chunk_rows(budget, h, r0, tq, tk, offset, causal)
        plan.extend((slice(i, i + 1), slice(j, j + 1), r0, rows) for i in range(n) for j in range(b))
        r0 += rows
    return plan


def _zero(region: torch.Tensor) -> bool:
    """Every entry exactly 0 (NaN and ±inf are not; -0.0 is)."""
    if region.numel() == 0:
        return True
    if region[(0,) * region.dim()].item() != 0:                          # dense rows fail here at once
        return False
    return torch.amax(region).item() == 0 and torch.amin(region).item() == 0


def _expand(first: list[int], count: list[int], device) -> torch.Tensor:
    """``[first_i, first_i + 1, ..., first_i + count_i - 1 for each i]`` as one tensor."""
    first_t = torch.tensor(first, dtype=torch.long, device=device)
    count_t = torch.tensor(count, dtype=torch.long, device=device)
    start = count_t.cumsum(0) - count_t
    return torch.repeat_interleave(first_t - start, count_t) + torch.arange(sum(count), device=device)


def _log_of_counts(keys: int, device) -> torch.Tensor:
    """``log max(n, 1)`` for key counts ``n = 0..keys``, float64: a row's count indexes it (a float64
    log per row costs more than the rest of the final sums)."""
    return torch.arange(keys + 1, dtype=torch.float64, device=device).clamp_min_(1).log_()


def _segment_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive runs of ``values`` (float64) of these ``lengths``."""
    totals = torch.cat([values.new_zeros(1), values.cumsum(0)])
    ends = lengths.cumsum(0)
    return totals[ends] - totals[ends - lengths]


class _Chunk:
    """One chunk's entries ``[P, H, ...]`` in a reusable float32 buffer, head-major (fresh large
    allocations page-fault on every chunk), with its rows as a matrix: ``[rows, K]`` for long rows;
    for short rows (grokking: T = 3) keys-major ``[P·H, K, rows]``, so that the per-row sums and
    broadcasts run along contiguous memory instead of K-element rows."""

    def __init__(self, x: torch.Tensor, keep: torch.Tensor | None, buffer: torch.Tensor, zero: torch.Tensor):
        p, g, h, r, k = x.shape                                         # x: [P, G, H, R, K]
        self.p, self.h, self.k, self.rows = p, h, k, p * h * g * r
        self.keys_major = k < _SHORT_ROW_KEYS
        order = (0, 2, 4, 3, 1) if self.keys_major else (0, 2, 1, 3, 4)   # keys-major: batch innermost (faster copy)
        data = buffer[:x.numel()].view([x.shape[i] for i in order])
        if keep is None:
            data.copy_(x.permute(order))
        else:                                                          # where, not multiply: padded rows may hold NaN
            keep = keep[:, :, None, :, None].expand(p, g, 1, r, 1).permute(order)
            if torch.compiler.is_compiling():                          # inductor rejects where(out=) on this view
                data.copy_(torch.where(keep, x.permute(order), zero))
            else:
                torch.where(keep, x.permute(order), zero, out=data)
        self.flat = data.view(p, -1)
        self.matrix = data.view(p * h, k, g * r) if self.keys_major else data.view(-1, k)

    def like(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:self.matrix.numel()].view(self.matrix.shape)

    def row_sums(self, t: torch.Tensor, ones: torch.Tensor, out: torch.Tensor) -> None:
        if self.keys_major:                                            # key planes are contiguous: adds beat sum(dim=1)
            sums = out.view(self.p * self.h, -1)
            if self.k == 1:
                sums.copy_(t[:, 0])
            else:
                torch.add(t[:, 0], t[:, 1], out=sums)
            for key in range(2, self.k):
                sums.add_(t[:, key])
        else:
            torch.mv(t, ones[:self.k], out=out)

    def per_row(self, v: torch.Tensor) -> torch.Tensor:
        return v.view(self.p * self.h, 1, -1) if self.keys_major else v.view(-1, 1)


def head_stats_torch(probs: torch.Tensor, query_mask: torch.Tensor | None = None, causal: bool = False):
    """`_head_stats_torch` with float32 products computed in float32 whatever the user's matmul
    precision setting (TF32 or bf16 inside would cost three digits; `exact_fp32_matmul`)."""
    with exact_fp32_matmul():
        return _head_stats_torch(probs, query_mask, causal)


def _head_stats_torch(probs: torch.Tensor, query_mask: torch.Tensor | None = None, causal: bool = False):
    """Fast path: one chunked pass over P (cache-sized chunks: Gram, range check, entropy), float64
    final sums. ``causal``: keys after the causal diagonal are zero and are not read. Without the hint
    a chunk's keys after its last row's diagonal are skipped too when they are all exactly zero (one
    read; on the CPU, where reading a value costs no device sync), so causal P takes the same path, and
    gives the same numbers, with and without the hint.

    Per chunk, for rows of ``n`` non-zero keys (all ``K`` when the chunk holds no zero), in float32:
    ``z = p − 1/n`` on the non-zero keys (0 elsewhere), ``e = Σ z`` and ``kl = Σ p log1p(n z)``;
    then in float64 ``h = log n · (1 + e) − kl`` (see the module docstring)."""
    n, b, h, tq, tk = probs.shape
    device = probs.device
    valid = None if query_mask is None else row_validity(probs, query_mask)
    work_dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    budget = _CHUNK_ELEMENTS.get(device.type, probs.numel())
    offset = causal_keys(tq, tk)
    # Branches on the data (a zero check, a dense-chunk shortcut) read values on the host: on the CPU
    # only — on a GPU that would sync every call, and a compiled graph cannot branch on data.
    read_data = device.type == "cpu" and not torch.compiler.is_compiling()
    work = dict(dtype=work_dtype, device=device)
    capacity = min(probs.numel(), max(budget, h * tk))                # one row may exceed the budget
    data_buf, z_buf = (torch.empty(capacity, **work) for _ in range(2))
    ones = torch.ones(tk, **work)
    zero = torch.zeros(1, **work)                                        # 1-d: where() then promotes bf16 to float32
    counts, excess, kl = (torch.empty(n * b * h * tq, **work) for _ in range(3))
    grams, gram_first, gram_count, in_range = [], [], [], []
    seg_first, seg_count, seg_rows = [], [], []
    done = 0
    queue = list(reversed(_plan(n, b, h, tq, tk, budget, causal=True)))   # dense rows are re-split below
    while queue:
        problems, batch, r0, rows = queue.pop()
        keys = max(0, min(tk, r0 + rows + offset))                      # the last row's visible keys
        x = probs[problems, batch, :, r0:r0 + rows]                     # [P, G, H, R, Tk]
        if keys < tk and not causal and (not read_data or not _zero(x[..., keys:])):
            dense_rows = _chunk_rows(budget, h, r0, tq, tk, offset, causal=False)
            if dense_rows < rows:                                       # sized for causal rows: too large
                queue += [(problems, batch, r0 + dense_rows, rows - dense_rows), (problems, batch, r0, dense_rows)]
                continue
            keys = tk
        if keys == 0:
            continue                                                    # rows that see no key
        keep = None if query_mask is None else valid[problems, batch, r0:r0 + rows]
        c = _Chunk(x[..., :keys], keep, data_buf, zero)
        grams.append(_gram(c.flat.view(c.p, h, -1)))
        gram_first.append(problems.start)
        gram_count.append(c.p)
        lo, hi = torch.amin(c.flat, dim=1), torch.amax(c.flat, dim=1)  # NaN propagates
        in_range.append((lo >= 0) & (hi <= 1))
        x2, z = c.matrix, c.like(z_buf)
        out = slice(done, done + c.rows)
        # z = p − 1/n is exact (Sterbenz) on the non-zero keys, so Σ z = Σp − 1 keeps every digit, and
        # n z = n p − 1 is exact to float32 rounding of a small number: log1p(n z) = log(n p).
        if read_data and lo.min().item() > 0:                           # no zero: every row has K keys
            counts[out].fill_(c.k)
            torch.sub(x2, 1.0 / c.k, out=z)
            c.row_sums(z, ones, excess[out])
            z.mul_(c.k)
        else:
            nonzero = torch.sign(x2, out=z)
            c.row_sums(nonzero, ones, counts[out])
            keys_n = c.per_row(counts[out]).clamp_min(1)                # rows without keys: z = 0
            torch.addcdiv(x2, nonzero, keys_n, value=-1, out=z)         # in place over the signs
            c.row_sums(z, ones, excess[out])
            z.mul_(keys_n)
        z.clamp_min_(_Z_FLOOR).log1p_().mul_(x2)                        # p log(n p), 0 where p = 0
        c.row_sums(z, ones, kl[out])                                    # Σ p log(n p): small terms
        seg_first.append(problems.start * h)
        seg_count.append(c.p * h)
        seg_rows.append(c.rows // (c.p * h))
        done += c.rows
    if query_mask is None:
        rows = torch.full((n,), b * tq, dtype=torch.float32, device=device)
    else:
        rows = valid.sum(dim=(1, 2)).to(torch.float32)
    f64 = dict(dtype=torch.float64, device=device)
    if not grams:                                                       # no row sees a key
        return torch.zeros(n, h, h, device=device), torch.zeros(n, h, **f64), rows, torch.zeros(n, device=device)
    # float64 log n, exact; clamped: negative entries (invalid input, flagged) make negative counts
    log_keys = _log_of_counts(tk, device).index_select(0, counts[:done].int().clamp_(0, tk))
    row_entropy = torch.addcmul(log_keys, excess[:done].double(), log_keys).sub_(kl[:done])
    if len(set(seg_rows)) == 1:                                         # e.g. one chunk (grokking)
        seg_entropy = row_entropy.view(-1, seg_rows[0]).sum(-1)
    else:
        lengths = torch.tensor(seg_rows, dtype=torch.long, device=device).repeat_interleave(
            torch.tensor(seg_count, dtype=torch.long, device=device))
        seg_entropy = _segment_sums(row_entropy, lengths)
    if gram_count == [n]:                                               # one chunk: problems 0..N-1 in order
        return grams[0].float(), seg_entropy.view(n, h), rows, (~in_range[0]).float()
    gram, entropy = torch.zeros(n, h, h, **f64), torch.zeros(n * h, **f64)
    invalid = torch.zeros(n, dtype=torch.float32, device=device)
    owner = _expand(gram_first, gram_count, device)
    gram.index_add_(0, owner, torch.cat(grams).double())
    invalid.index_add_(0, owner, (~torch.cat(in_range)).float())
    entropy.index_add_(0, _expand(seg_first, seg_count, device), seg_entropy)
    return gram.float(), entropy.view(n, h), rows, (invalid > 0).to(torch.float32)
