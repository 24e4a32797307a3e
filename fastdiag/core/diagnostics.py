"""`head_stats`: attention probabilities -> `HeadStats`, on the backend that fits the device."""
from __future__ import annotations

import os

import torch

from fastdiag.core.kernels import head_stats_ref, head_stats_torch
from fastdiag.core.stats import HeadStats

BACKENDS = ("auto", "reference", "torch", "triton")


def triton_available() -> bool:
    """True when the fused kernel can run: a CUDA device with triton, or the Triton interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_inputs(probs, query_mask):
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs: expected a torch.Tensor, got {type(probs).__name__}")
    if not probs.is_floating_point():
        raise TypeError(f"probs: expected a floating-point tensor (fp32, bf16, fp16, fp64), got {probs.dtype}")
    if probs.layout != torch.strided:
        raise TypeError(f"probs: expected a dense (strided) tensor, got layout {probs.layout}")
    if probs.dim() not in (4, 5):
        raise ValueError(f"probs: expected shape [B, H, Tq, Tk] or [N, B, H, Tq, Tk], got {tuple(probs.shape)}")
    stacked = probs.dim() == 5
    p5 = probs if stacked else probs.unsqueeze(0)
    n, b, h, tq, tk = p5.shape
    if min(b, h, tq, tk) == 0 or n == 0:
        raise ValueError(f"probs: every dimension must be non-empty, got {tuple(probs.shape)}")
    m3 = None
    if query_mask is not None:
        if not isinstance(query_mask, torch.Tensor):
            raise TypeError(f"query_mask: expected a bool torch.Tensor, got {type(query_mask).__name__}")
        if query_mask.dtype != torch.bool:
            raise TypeError(f"query_mask: expected dtype torch.bool (True = valid query row), got {query_mask.dtype}")
        if query_mask.device != probs.device:
            raise ValueError(f"query_mask: on {query_mask.device}, probs on {probs.device}")
        if query_mask.dim() == 2:
            expected = (b, tq)
            m3 = query_mask.unsqueeze(0)
        elif query_mask.dim() == 3 and stacked:
            expected = (n, b, tq)
            m3 = query_mask
        else:
            expected = (n, b, tq) if stacked else (b, tq)
        if tuple(query_mask.shape) != expected:
            raise ValueError(f"query_mask: expected shape {list(expected)} for probs of shape "
                             f"{tuple(probs.shape)}, got {tuple(query_mask.shape)}")
    return p5, m3, stacked


def head_stats(probs: torch.Tensor, query_mask: torch.Tensor | None = None, backend: str = "auto",
               validate: bool = False, causal: bool = False) -> HeadStats:
    """Sufficient statistics of attention heads from post-softmax probabilities.

    probs: ``[B, H, Tq, Tk]``, or ``[N, B, H, Tq, Tk]`` for N independent problems (layers,
        ensemble members) in one call; fp32, bf16, fp16 or fp64; any strides.
    query_mask: bool ``[B, Tq]`` (or ``[N, B, Tq]``), True = valid query row; padded rows are left out.
    backend: ``"auto"`` (fused Triton kernel on CUDA, vectorised PyTorch elsewhere), ``"triton"``,
        ``"torch"`` or ``"reference"`` (float64, the ground truth).
    validate: check the values and raise ValueError on entries outside [0, 1], non-finite values or
        an all-padded mask. This syncs with the host. Without it, bad values never raise: the
        derived statistics come out NaN and ``HeadStats.valid()`` is False, found on the device.

    causal: a hint that keys after the causal diagonal (``k > q + Tk - Tq``) are zero, as in a
        causal mask: the fast backends skip reading them (about half of a square P). The results are
        the same as without the hint when it holds; entries it skips are not checked.

    Precision: ``entropy_sum`` is float64 and every backend keeps s̄, σ_H, the per-layer values and the
    head entropies within 1e-5 relative of float64 for fp32 inputs (1e-3 for bf16/fp16, against
    float64 of the same rounded values) whenever σ ≥ 1e-6, near-uniform attention included: each
    row's entropy is accumulated relative to the log of its key count (see `head_stats_ref`). The
    torch path counts each row's non-zero keys; the Triton kernel takes the keys a row may see (all,
    or the causal ones with ``causal=True``), so on rows with other masked keys (padding masks) and
    near-uniform attention its σ is within 2e-4 instead.

    Gradients do not flow through the statistics (they are diagnostics).
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    p5, m3, stacked = _check_inputs(probs, query_mask)
    p5 = p5.detach()
    if backend == "auto":
        backend = "triton" if p5.is_cuda and triton_available() else "torch"
    if backend == "reference":
        sums = head_stats_ref(p5, m3)
    elif backend == "torch":
        sums = head_stats_torch(p5, m3, causal)
    else:
        sums = run_triton("head_stats_triton", "head_stats_op", "head_stats_triton", p5, m3, causal)
    stats = HeadStats(*sums)
    if not stacked:
        stats = stats[0]
    if validate:
        _raise_if_invalid(stats)
    return stats


def run_triton(kernel_module: str, op: str, launcher: str, *args):
    """Run a Triton kernel of ``fastdiag.core.kernels.<kernel_module>`` on ``args`` (the first a tensor):
    its `torch.library` op ``op`` on CUDA tensors (one node for torch.compile and CUDA graphs), its
    raw ``launcher`` on CPU tensors under TRITON_INTERPRET=1 (the interpreter cannot run behind
    torch.library's wrappers). The kernel module is imported here, on first use: it imports triton."""
    if not triton_available():
        raise ValueError("backend: 'triton' needs triton and a CUDA device, or TRITON_INTERPRET=1 "
                         "set before import to run the kernels in the interpreter")
    kernel = kernel_module_named(kernel_module)
    if args[0].is_cuda:
        return getattr(kernel, op)(*args)
    if not kernel.INTERPRETING:
        raise ValueError("backend: 'triton' on a CPU tensor needs TRITON_INTERPRET=1 set before import")
    return getattr(kernel, launcher)(*args)


def kernel_module_named(name: str):
    """``fastdiag.core.kernels.<name>`` by import statements, not `importlib.import_module`: torch.compile
    traces an import statement (a first call inside a compiled graph imports here), but refuses
    importlib's internals (fullgraph=True then fails)."""
    if name == "head_stats_triton":
        from fastdiag.core.kernels import head_stats_triton as module
    elif name == "qk_stats_triton":
        from fastdiag.core.kernels import qk_stats_triton as module
    else:
        raise ValueError(f"kernel_module: expected 'head_stats_triton' or 'qk_stats_triton', got {name!r}")
    return module


def _raise_if_invalid(stats: HeadStats) -> None:
    if bool((stats.invalid > 0).any()):
        raise ValueError("probs: holds values outside [0, 1] or non-finite values in valid rows")
    if bool((stats.rows == 0).any()):
        raise ValueError("query_mask: marks no valid query row for at least one problem")
