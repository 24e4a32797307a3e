"""How `fastdiag.attach` sees attention in a model and turns one call into `HeadStats`.

During a measured forward pass the monitor enters `AttentionMode`, a `torch.overrides.TorchFunctionMode`
(thread-local: other threads' attention is not seen). It sees every torch call the model makes,
however the function was reached (``F.scaled_dot_product_attention``, the same function imported
by name, ``torch.softmax``, ``Tensor.softmax``), and hands two kinds to the monitor:

- **probabilities**: a softmax over the last dimension of a ``[B, H, Tq, Tk]`` tensor. Its output
  is what the model multiplies V by (Hugging Face eager attention with every bias, softcap, ALiBi
  or mask it added; nanoGPT's manual path; any hand-written attention): `head_stats` of that very
  tensor. Nothing is re-derived, so whatever produced the scores is measured exactly.
- **SDPA**: ``scaled_dot_product_attention`` never forms the probabilities, so `sdpa_with_stats`
  (`fastdiag.qk`) runs the attention op unchanged, keeps its row log-sum-exp where it can, and
  re-derives the statistics from Q, K, the mask, ``is_causal`` and
  ``scale`` (`qk_head_stats`: a fused Triton kernel on CUDA, cache-sized chunks on CPU).

Two structural kinds keep their own adapters: fastdiag's models (class attribute
``records_head_stats``: the module computes its statistics itself) and `torch.nn.MultiheadAttention`
(a pre-hook re-projects Q and K with the module's weights, whatever path torch takes inside).

**Masks and padding rows (docs/attach.md, "Padding").** One rule, `fastdiag.core.kernels.rows`, on
every path: a key is masked where a bool mask is False or a mask value (eager: the score the mask was
added into) is −inf or ≤ −1000 — never where a probability underflowed to 0. A query row counts when
it sees an unmasked key in every head, and, in self-attention (queries and keys from the same input
of the call, `Provenance`), when its own position is not a padding key (a key no query of that
sequence may see). Eager, SDPA and MultiheadAttention give the same rows on the same batch.
"""
from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.weak import WeakIdKeyDictionary

from fastdiag.core.kernels import rows as row_rule
from fastdiag.core.qk import CHUNK_BYTES, qk_head_stats, unpack_query_heads
from fastdiag.core.stats import HeadStats



# ---- structural facts -------------------------------------------------------------------------

def sink_logits(module) -> int | None:
    """Heads of a module's attention-sink logits (a 1-D ``sinks`` tensor, one logit per head, which the
    module concatenates to its scores as a last column before the softmax: Hugging Face gpt-oss), else None."""
    sinks = getattr(module, "sinks", None)
    return sinks.numel() if isinstance(sinks, torch.Tensor) and sinks.dim() == 1 else None


# ---- torch.nn.MultiheadAttention ----------------------------------------------------------------

_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
             "average_attn_weights", "is_causal")


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A torch.nn mask (bool: True = masked out) as an additive float mask in ``dtype``."""
    mask = row_rule.additive_mask(mask, dtype, true_attends=False)
    return None if mask is None else mask.to(dtype)


def mha_head_stats(module: torch.nn.MultiheadAttention, args: tuple, kwargs: dict,
                   backend: str = "auto", chunk_bytes: int = CHUNK_BYTES,
                   padding=None, autocast: torch.dtype | None = None) -> HeadStats:
    """The statistics `module(*args, **kwargs)` computes in its softmax, from Q and K re-projected
    with the module's weights (`mha_forward_head_stats`)."""
    call = dict(zip(_MHA_ARGS, args), **kwargs)
    self_attention = call["query"] is call["key"]
    query, key = call["query"], call["key"]
    if query.dim() == 3 and module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    separate = not module._qkv_same_embed_dim
    forward = dict(query=query, key=key, num_heads=module.num_heads, in_proj_weight=module.in_proj_weight,
                   in_proj_bias=module.in_proj_bias, bias_k=module.bias_k, add_zero_attn=module.add_zero_attn,
                   key_padding_mask=call.get("key_padding_mask"), attn_mask=call.get("attn_mask"),
                   is_causal=call.get("is_causal", False), use_separate_proj_weight=separate,
                   q_proj_weight=module.q_proj_weight if separate else None,
                   k_proj_weight=module.k_proj_weight if separate else None)
    return mha_forward_head_stats(forward, self_attention, backend, chunk_bytes, padding, autocast)


MHA_FORWARD_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
                    "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias",
                    "training", "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight",
                    "q_proj_weight", "k_proj_weight", "v_proj_weight", "static_k", "static_v",
                    "average_attn_weights", "is_causal")


def mha_forward_head_stats(call: dict, self_attention: bool, backend: str = "auto",
                           chunk_bytes: int = CHUNK_BYTES, padding=None,
                           autocast: torch.dtype | None = None) -> HeadStats:
    """The statistics ``F.multi_head_attention_forward(**call)`` computes in its softmax (what
    `torch.nn.MultiheadAttention` runs), from Q and K re-projected with the call's weights: inputs
    ``[T, N, E]`` (or unbatched ``[T, E]``), ``in_proj_weight`` or the separate ``q_proj_weight`` /
    ``k_proj_weight``, ``in_proj_bias``, ``bias_k``, ``add_zero_attn``, ``attn_mask`` (bool: True =
    masked; float: added; 2-D or ``[N·H, Tq, Tk]``), ``key_padding_mask``, ``is_causal``.

    ``self_attention``: a query row whose position is a padding key (``key_padding_mask``, or an
    ``attn_mask`` that hides it from every query: `rows.self_attention_rows`) is left out, and so is one that ``padding(N, T, device)`` (the monitor's handed-in mask for this call, bool
    ``[N, T]``, True = real token, or None) marks. ``autocast``: the dtype the caller's autocast runs the
    projections in (Q and K are re-projected in it, as torch computes them; the statistics accumulate
    in fp32)."""
    query, key = as_autocast_casts(call["query"].detach(), autocast), as_autocast_casts(call["key"].detach(), autocast)
    kpm, attn_mask, is_causal = call.get("key_padding_mask"), call.get("attn_mask"), call.get("is_causal", False)
    if query.dim() == 2:  # unbatched [T, E]
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        kpm = None if kpm is None else kpm.unsqueeze(0)
    tq, n, e = query.shape
    heads = call["num_heads"]
    hd = e // heads
    if call.get("use_separate_proj_weight"):
        wq, wk = call["q_proj_weight"], call["k_proj_weight"]
    else:
        wq, wk = call["in_proj_weight"][:e], call["in_proj_weight"][e:2 * e]
    bias = call.get("in_proj_bias")
    bq, bk = (None, None) if bias is None else (bias[:e], bias[e:2 * e])
    wq, wk = as_autocast_casts(wq.detach(), autocast), as_autocast_casts(wk.detach(), autocast)
    bq, bk = (None if b is None else as_autocast_casts(b.detach(), autocast) for b in (bq, bk))
    q = F.linear(query, wq, bq)
    k = F.linear(key, wk, bk)
    extra = 0
    if call.get("bias_k") is not None:
        k = torch.cat([k, call["bias_k"].detach().expand(1, n, e)])
        extra += 1
    q = q.reshape(tq, n, heads, hd).permute(1, 2, 0, 3)       # [N, H, Tq, hd]
    k = k.reshape(-1, n, heads, hd).permute(1, 2, 0, 3)       # [N, H, Tk, hd]
    if call.get("add_zero_attn"):
        k = torch.cat([k, k.new_zeros(n, heads, 1, hd)], dim=2)
        extra += 1
    tk = k.shape[2]
    mask = _additive(attn_mask, q.dtype)
    if mask is None and is_causal:  # torch itself refuses this; keep the meaning of the hint
        mask = _additive(torch.ones(tq, tk - extra, dtype=torch.bool, device=q.device).triu(1), q.dtype)
    if mask is not None:
        mask = mask.reshape(n, heads, tq, -1) if mask.dim() == 3 else mask.reshape(1, 1, tq, -1)
    kpm = _additive(kpm, q.dtype)
    if kpm is not None:
        kpm = kpm.reshape(n, 1, 1, -1)
        mask = kpm if mask is None else mask + kpm
    query_mask = None
    if self_attention:
        if mask is not None:   # the rule of every path: a position no query may see is padding, its row too
            query_mask = row_rule.self_attention_rows(row_rule.hidden_keys(mask, n, heads, tq, tq)).expand(n, tq)
        handed_in = None if padding is None else padding(n, tq, q.device)
        if handed_in is not None:
            query_mask = handed_in if query_mask is None else query_mask & handed_in
    if mask is not None and extra:
        mask = F.pad(mask, (0, extra))
    return qk_head_stats(q, k, mask, backend=backend, chunk_bytes=chunk_bytes, query_mask=query_mask)


# ---- the torch function mode ------------------------------------------------------------------

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA = F.scaled_dot_product_attention
_SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}
_LOGSUMEXPS = {torch.logsumexp, torch.Tensor.logsumexp}
_LOG_SOFTMAXES = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax, torch.special.log_softmax}
_LOG_DOMAIN = _LOGSUMEXPS | _LOG_SOFTMAXES
_EXPS = {torch.exp, torch.Tensor.exp}
_MHA_FORWARD = F.multi_head_attention_forward
_HANDED_OVER = _SOFTMAXES | {_MHA_FORWARD}   # besides SDPA: what the mode hands to `AttentionCalls` as it runs


def is_flex_attention(func) -> bool:
    """``torch.nn.attention.flex_attention`` reaches a function mode as its higher-order operator
    (eager or not): its probabilities are never formed, so the module calling it is named."""
    return isinstance(func, torch._ops.HigherOrderOperator) and func.name() == "flex_attention"


def softmax_dim(args: tuple, kwargs: dict) -> int | None:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return dim if isinstance(dim, int) else None


def softmax_input(args: tuple, kwargs: dict):
    """The tensor a softmax call reads, passed by position or by keyword (``input=``, ``self=``)."""
    return args[0] if args else kwargs.get("input", kwargs.get("self"))


def _in_compiled_graph() -> bool:
    """Whether the call comes from a torch.compile graph run by Python (backends "eager", "aot_eager",
    custom ones returning ``gm.forward``). The mode was traced into that graph already: its
    statistics are in the graph, so the graph's own ops must not be measured a second time.

    Read from the stack because torch documents no way to ask it: `torch.compiler.is_compiling()` and
    `torch.compiler.is_dynamo_compiling()` are True while Dynamo traces, and False while the graph it
    produced runs (checked on torch 2.13: a function mode entered around a compiled function sees the
    graph's ``torch.softmax`` at run time with both False). The graph's code is FX-generated, and FX
    names the file of generated code ``<eval_with_key>.N``."""
    if tracing():
        return False
    frame = sys._getframe(2)
    for _ in range(3):  # the graph's code, or F.softmax and handle_torch_function called by it
        if frame is None:
            return False
        if frame.f_code.co_filename.startswith("<eval_with_key>"):
            return True
        frame = frame.f_back
    return False


def tracing() -> bool:
    """`torch.compiler.is_compiling()`, read by dynamo once per trace as a constant (marked at attach:
    `calls.stack_reader_ready`). Called plainly in `AttentionMode.__torch_function__` while dynamo traced it, it made
    ``Tensor.dim()`` come back None in a graph that builds an ``nn.Linear`` (a teacher or a lazily made
    layer created in a compiled forward: the user's step raised TypeError; torch 2.13,
    `tests/test_attach_compile.py`). A marked ``functools.partial`` of it, one Python call fewer, still
    raised there."""
    return torch.compiler.is_compiling()


_OWN = threading.local()  # depth of fastdiag's own statistics computations running in this thread


def own_statistics(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``: fastdiag's own statistics computation, whose softmaxes no
    `AttentionMode` (another monitor's, nested) takes for the model's attention. Under torch.compile
    each graph has one mode traced into it, so there is nothing to mark."""
    if tracing():
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    _OWN.depth = getattr(_OWN, "depth", 0) + 1
    try:
        # fastdiag's own arithmetic never runs in the caller's reduced precision: inside a
        # torch.autocast region its score matmuls would be cast to bf16/fp16 (σ_l off by up to 0.5
        # against float64 of the same q and k). The statistics read the tensors the model passed, as
        # they are, and accumulate in float32 or better.
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    finally:
        _OWN.depth -= 1


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts lower-precision ops to on ``device_type`` now, or None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def as_autocast_casts(value, dtype: torch.dtype | None):
    """``value`` as autocast hands it to a lower-precision op (SDPA, linear): floating tensors other
    than float64 in ``dtype``; anything else unchanged."""
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point() \
            and value.dtype != torch.float64:
        return value.to(dtype)
    return value


def outer_attention_mode() -> bool:
    """Whether another monitor's `AttentionMode` is entered outside the one now handling a call
    (nested monitors on one model)."""
    return any(isinstance(mode, AttentionMode) for mode in _get_current_function_mode_stack())


def sdpa_reissued_with_stats(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                             enable_gqa=False, *, query_mask=None, backend="auto", chunk_bytes=CHUNK_BYTES,
                             packed_query_heads=None):
    """`sdpa_with_stats` for nested monitors: the output from ``F.scaled_dot_product_attention``
    itself, so that the outer monitor's mode sees the model's call (a fused op with its LSE would
    hide it), and the statistics from Q and K with our own row log-sum-exp."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    if packed_query_heads:
        query, attn_mask, _ = unpack_query_heads(query, attn_mask, None, packed_query_heads)
    stats = qk_head_stats(query, key, attn_mask, is_causal, scale, backend, chunk_bytes, query_mask=query_mask)
    return out, stats


def _computing_own_statistics() -> bool:
    return not tracing() and getattr(_OWN, "depth", 0) > 0


# products and where their two operands are: positions, then keyword names
_PRODUCTS = {torch.matmul: ((0, 1), ("input", "other")), torch.Tensor.matmul: ((0, 1), ("self", "other")),
             torch.Tensor.__matmul__: ((0, 1), ("self", "other")), torch.bmm: ((0, 1), ("input", "mat2")),
             torch.Tensor.bmm: ((0, 1), ("self", "mat2")), torch.baddbmm: ((1, 2), ("batch1", "batch2")),
             torch.Tensor.baddbmm: ((1, 2), ("batch1", "batch2")), torch.einsum: ((1, 2), ())}


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


_TRANSPOSES = {torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes, torch.swapdims,
               torch.Tensor.swapdims}
_PERMUTES = {torch.permute, torch.Tensor.permute}
_MT = torch.Tensor.mT.__get__


def _operands(func, args, kwargs, product):
    """The two multiplied operands of a product call (`_PRODUCTS`)."""
    (i, j), (name_a, name_b) = product[0], product[1] or (None, None)
    flat = list(args)
    if func is torch.einsum and len(args) == 2 and isinstance(args[1], (list, tuple)):
        flat = [args[0], *args[1]]
    a = flat[i] if i < len(flat) else kwargs.get(name_a)
    b = flat[j] if j < len(flat) else kwargs.get(name_b)
    return a, b


def _layout(lead: tuple, rows, key) -> tuple | None:
    """The softmax output's axes as ``(batch, heads, query, key)``, read from the operand a product
    multiplies values with: its query and key axes, and its leading (batch-like) axes in order — two
    axes, or one that merges two (a ``[B·H, Tq, Tk]`` bmm), or rows that merge all three
    (``[B·H·Tq, Tk]`` times a memory of values shared by every row). One leading axis not known, with
    the query and key axes in place, is a ``[B·H]`` merge of ``[B, H]`` in order. None where it cannot
    be read."""
    if not lead and isinstance(rows, tuple) and len(rows) == 3:
        lead, rows = rows[:2], rows[2]        # [B·H·Tq, Tk]: the rows merge batch, heads and queries in order
    elif len(lead) == 1 and isinstance(lead[0], tuple):
        lead = lead[0]
    elif len(lead) == 1 and lead[0] is None and (rows, key) == (2, 3):
        lead = (0, 1)
    layout = (*lead, rows, key)
    if len(layout) != 4 or not all(isinstance(a, int) for a in layout) or len(set(layout)) != 4:
        return None
    return layout


class Provenance:
    """Which inputs of which module call each tensor of a measured pass derives from: the fact that
    decides self-attention (queries and keys computed from the same input of the attention module's
    call), where shapes would only guess (Tq = Tk in cross-attention, Perceiver's latents, a
    ``context=`` argument). A module call's floating-point tensor arguments are seeded with labels
    (call, argument); every torch call of the pass hands the union of its inputs' labels to its
    outputs; a product (matmul, bmm, baddbmm, einsum) also records its two operands' labels, so scores
    know the labels of their queries and of their keys. Nothing is known under torch.compile."""

    def __init__(self):
        self._reset()

    def clear(self):
        # an unmeasured pass leaves them empty: three fresh weak dicts twice a pass cost ~25 µs each time
        if self.labels or self.products or self.candidates or self.candidate_rows:
            self._reset()

    def _reset(self):
        self.labels = WeakIdKeyDictionary()    # tensor -> frozenset of (call, argument)
        self.products = WeakIdKeyDictionary()  # tensor -> frozenset of (query labels, key labels)
        # tensor -> {softmax candidate it carries: which axis of the softmax output each of its axes is}
        self.candidates = WeakIdKeyDictionary()
        self.candidate_rows: dict[int, int] = {}  # candidate -> its probabilities' rows (numel / key axis)
        self.key_axis: dict[int, int] = {}        # candidate -> the axis its softmax normalised
        self.log_probs = WeakIdKeyDictionary()    # log_softmax output over 4-D scores -> (those scores, its axis)

    def mark_candidate(self, probs: torch.Tensor, candidate: int, key_axis: int = -1) -> None:
        """``probs`` (a softmax output over ``key_axis``) is attention if it, or a tensor with its rows
        made from it (a dropout, a cast, the sink column sliced off, a transpose, a reshape), is then
        multiplied with values along that axis: `propagate` returns the candidate, and the layout the
        product reads it in, when that product runs."""
        key_axis %= probs.dim()
        self.candidates[probs] = {candidate: tuple(range(probs.dim()))}
        self.key_axis[candidate] = key_axis
        self.candidate_rows[candidate] = probs.numel() // max(1, probs.shape[key_axis])

    def seed(self, call: int, args: tuple, kwargs: dict) -> None:
        for slot, value in (*enumerate(args), *kwargs.items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                self.labels[value] = self.labels.get(value, frozenset()) | {(call, slot)}

    def propagate(self, func, args: tuple, kwargs: dict, out) -> dict:
        """Hands labels, products and softmax candidates on to ``out``; returns the candidates this
        call confirms as attention, each with its layout (`_layout`)."""
        if tracing():
            return {}
        inputs = list(_tensors(args, kwargs))
        labels = frozenset().union(*(self.labels.get(t, ()) for t in inputs))
        product = _PRODUCTS.get(func)
        if product is not None:
            a, b = _operands(func, args, kwargs, product)
            products = frozenset({tuple(self.labels.get(t, frozenset()) if isinstance(t, torch.Tensor)
                                        else frozenset() for t in (a, b))})
        else:
            products = frozenset().union(*(self.products.get(t, ()) for t in inputs))
        confirmed = self._confirmed(func, args, kwargs, product) if self.candidates else {}
        carrier = None if product is not None or not self.candidates else \
            next((t for t in inputs if t in self.candidates), None)
        for o in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(o, torch.Tensor):
                if labels:
                    self.labels[o] = labels
                if products:
                    self.products[o] = products
                if carrier is not None:
                    kept = {c: axes for c, axes in ((c, self._carried(func, args, kwargs, carrier, o, c, axes))
                                                    for c, axes in self.candidates[carrier].items()) if axes}
                    if kept:
                        self.candidates[o] = kept
        return confirmed

    def _carried(self, func, args, kwargs, src: torch.Tensor, out: torch.Tensor, candidate: int, axes: tuple):
        """Which axis of the softmax output each axis of ``out`` is, ``out`` made from ``src`` (whose axes
        are ``axes``) by ``func``; None where ``out`` no longer has the candidate's rows. A merged leading
        axis (``[B·H, Tq, Tk]``) is the tuple of the axes it merges; None marks an axis not known."""
        if out.dim() < 2 or out.shape[-1] == 0:
            return None
        if func in _TRANSPOSES and out.dim() == src.dim():
            d0, d1 = (args[1], args[2]) if len(args) >= 3 else (kwargs.get("dim0"), kwargs.get("dim1"))
            if isinstance(d0, int) and isinstance(d1, int):
                moved = list(axes)
                moved[d0], moved[d1] = moved[d1], moved[d0]
                return tuple(moved)
            return None
        if func in _PERMUTES and out.dim() == src.dim():
            dims = args[1:] if len(args) > 2 else (args[1] if len(args) == 2 else kwargs.get("dims"))
            dims = tuple(dims) if isinstance(dims, (list, tuple, torch.Size)) else None
            if dims is None or len(dims) != len(axes) or not all(isinstance(d, int) for d in dims):
                return None
            return tuple(axes[d] for d in dims)
        if func is _MT and out.dim() == src.dim():
            return (*axes[:-2], axes[-1], axes[-2])
        if out.shape == src.shape:
            return axes
        if out.dim() == src.dim() and out.shape[:-1] == src.shape[:-1]:
            return axes                      # a slice of the last axis (an attention sink's column)
        if out.dim() == 2 and src.dim() in (3, 4) and out.shape[-1] == src.shape[-1] and out.numel() == src.numel():
            rows = tuple(a for axis in axes[:-1] for a in (axis if isinstance(axis, tuple) else (axis,)))
            return (rows, axes[-1])          # every row in one axis: [B·H·Tq, Tk] for a shared memory of values
        if out.shape[-2:] == src.shape[-2:] and out.numel() == src.numel():
            if out.dim() == 3 and src.dim() == 4:
                return ((axes[0], axes[1]), axes[2], axes[3])     # [B, H] merged for a bmm
            if out.dim() == 4 and src.dim() == 3 and isinstance(axes[0], tuple):
                return (*axes[0], axes[1], axes[2])
            return (None,) * (out.dim() - 2) + tuple(axes[-2:])
        if axes[-1] == self.key_axis[candidate] and out.numel() // out.shape[-1] == self.candidate_rows[candidate]:
            return (None,) * (out.dim() - 1) + (axes[-1],)
        return None

    def _confirmed(self, func, args, kwargs, product) -> dict:
        """The softmax candidates this call multiplies with values along their key axis — an operand
        of a matmul / bmm whose contracted axis (the first operand's last, the second's second-to-last)
        is that axis, or an einsum operand whose key subscript is summed over — each with its layout."""
        if product is None:
            return {}
        found = {}
        if func is torch.einsum:
            operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
            equation = args[0] if args and isinstance(args[0], str) else ""
            inputs, _, output = equation.replace(" ", "").partition("->")
            subscripts = inputs.split(",")
            for index, (letters, operand) in enumerate(zip(subscripts, operands)):
                if not isinstance(operand, torch.Tensor) or operand not in self.candidates or not output \
                        or len(letters) != operand.dim() or not letters.isalpha():
                    continue
                others = "".join(s for i, s in enumerate(subscripts) if i != index)
                for c, axes in self.candidates[operand].items():
                    keys = [l for l, a in zip(letters, axes) if a == self.key_axis[c]]
                    if len(keys) != 1 or keys[0] in output:
                        continue
                    rows = [a for l, a in zip(letters, axes) if l in output and l not in others]
                    lead = tuple(a for l, a in zip(letters, axes) if l in output and l in others)
                    found[c] = _layout(lead, rows[0], self.key_axis[c]) if len(rows) == 1 else None
            return found
        first, second = _operands(func, args, kwargs, product)
        for operand, contracted, rows in ((first, -1, -2), (second, -2, -1)):
            if not isinstance(operand, torch.Tensor) or operand.dim() < 2 or operand not in self.candidates:
                continue
            for c, axes in self.candidates[operand].items():
                if axes[contracted] == self.key_axis[c]:
                    found[c] = _layout(axes[:-2], axes[rows], axes[contracted])
        return found

    @staticmethod
    def _of(labels, call: int) -> frozenset:
        return frozenset(slot for c, slot in labels if c == call)

    def same_input(self, call: int, query: torch.Tensor, key: torch.Tensor) -> bool | None:
        """Whether query and key derive from the same arguments of module call ``call`` (True: self-
        attention), from different ones (False), or None when it is not known."""
        if tracing():
            return None
        q, k = self._of(self.labels.get(query, ()), call), self._of(self.labels.get(key, ()), call)
        if not q or not k:
            return None
        return q == k

    def scores_of_same_input(self, call: int, scores: torch.Tensor) -> bool | None:
        """`same_input` for scores: True when one of the products they are made of multiplies queries
        and keys from the same arguments of ``call``."""
        if tracing():
            return None
        verdicts = set()
        for q, k in self.products.get(scores, ()):
            q, k = self._of(q, call), self._of(k, call)
            if q and k:
                verdicts.add(q == k)
        return True if True in verdicts else (False if verdicts else None)


class AttentionMode(TorchFunctionMode):
    """Entered around a measured forward pass: passes SDPA calls and softmaxes over ``[B, H, Tq, Tk]``
    scores to ``calls`` (`fastdiag.core.calls.AttentionCalls`: ``on_sdpa(call) -> out``,
    ``on_probs(scores, probs)``, ...); every other call runs as it would."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls
        self.busy = False  # measuring: the statistics' own softmax is not the model's attention
        self.lean = False  # a lean pass's planned call (fastdiag.core.plan): no provenance, SDPA and softmax only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not tracing() and self.lean and (
                self.busy or (func is not _SDPA and func not in _SOFTMAXES) or _computing_own_statistics()):
            return func(*args, **kwargs)
        # fastdiag's statistics never call SDPA: an SDPA call inside them is the model's own, re-issued
        # by an inner monitor's adapter, and measured here too; their softmaxes are never attention
        if self.busy or (func is not _SDPA and (func not in _HANDED_OVER or _computing_own_statistics())) \
                or _in_compiled_graph():
            out = func(*args, **kwargs)
            if not self.busy and not tracing() and not _computing_own_statistics():
                confirmed = self.calls.provenance.propagate(func, args, kwargs, out)
                if confirmed:
                    self.calls.confirm(confirmed)
                scores = softmax_input(args, kwargs)
                if func in _LOG_DOMAIN and _in_compiled_graph():
                    pass    # a compiled graph's own op, run by Python: named while traced (below), not again
                elif func in _LOGSUMEXPS and isinstance(scores, torch.Tensor) and scores.dim() == 4 \
                        and softmax_dim(args, kwargs) in (-1, 3):
                    self.calls.on_logsumexp()
                elif is_flex_attention(func):
                    self.calls.on_flex_attention()
                elif func in _LOG_SOFTMAXES and isinstance(out, torch.Tensor) and out.dim() == 4 \
                        and softmax_dim(args, kwargs) in range(-4, 4):
                    self.calls.provenance.log_probs[out] = (scores, softmax_dim(args, kwargs) % 4)
                elif func in _EXPS and isinstance(scores, torch.Tensor) and scores in self.calls.provenance.log_probs:
                    # exp(log_softmax(s)): probabilities formed in two steps, measured as the softmax's
                    self.busy = True
                    try:
                        self.calls.on_exp_of_log_softmax(*self.calls.provenance.log_probs[scores], out)
                    finally:
                        self.busy = False
            elif not self.busy and func in _LOG_DOMAIN and tracing():
                scores = softmax_input(args, kwargs)
                if isinstance(scores, torch.Tensor) and scores.dim() == 4 \
                        and softmax_dim(args, kwargs) in ((-1, 3) if func in _LOGSUMEXPS else range(-4, 4)):
                    # traced: no provenance, so exp(s − logsumexp) and log_softmax(s).exp() are named, not measured
                    self.calls.on_logsumexp(traced_log_softmax=func in _LOG_SOFTMAXES)
            return out
        self.busy = True
        try:
            if func is _SDPA:
                out = self.calls.on_sdpa(dict(zip(SDPA_ARGS, args), **kwargs))
                if not self.lean:
                    self.calls.provenance.propagate(func, args, kwargs, out)
                return out
            if func is _MHA_FORWARD:
                out = self.calls.on_mha_forward(args, kwargs)
                if not self.lean:
                    self.calls.provenance.propagate(func, args, kwargs, out)
                return out
            out = func(*args, **kwargs)
            if not self.lean:
                self.calls.provenance.propagate(func, args, kwargs, out)
            if func in _SOFTMAXES and isinstance(out, torch.Tensor) and out.dim() == 4 \
                    and softmax_dim(args, kwargs) in (-1, 3):
                self.calls.on_probs(softmax_input(args, kwargs), out)
            elif func in _SOFTMAXES and isinstance(out, torch.Tensor) and out.dim() == 4 \
                    and softmax_dim(args, kwargs) in range(-4, 4):   # another axis: read from the product with V
                self.calls.on_probs(softmax_input(args, kwargs), out, key_axis=softmax_dim(args, kwargs) % 4)
            elif func in _SOFTMAXES and isinstance(out, torch.Tensor) and softmax_dim(args, kwargs) in (-1, out.dim() - 1):
                self.calls.on_softmax_elsewhere(out)
            return out
        finally:
            self.busy = False


# ---- structural detection ---------------------------------------------------------------------

def is_zoo(module) -> bool:
    return bool(getattr(type(module), "records_head_stats", False))


def is_mha(module) -> bool:
    return isinstance(module, torch.nn.MultiheadAttention)


def is_torch_builtin(module) -> bool:
    return type(module).__module__.startswith("torch.nn.modules")


_SCRIPTED_ATTENTION_OPS = ("softmax", "_softmax", "log_softmax", "_log_softmax", "scaled_dot_product_attention",
                           "_native_multi_head_attention")


def is_scripted(module) -> bool:
    """A TorchScript module (``torch.jit.script`` / ``trace``): its ops run where no hook or function mode sees them."""
    return isinstance(module, torch.jit.ScriptModule)


def scripted_attention(module) -> bool:
    """Whether a TorchScript module's forward (submodules inlined, every branch) takes a softmax or runs an
    attention op."""
    def ops(block):
        for node in block.nodes():
            yield node.kind()
            for inner in node.blocks():
                yield from ops(inner)
    try:
        graph = module.inlined_graph
    except (AttributeError, RuntimeError):   # no forward compiled: nothing it runs is known
        return True
    return any(kind.startswith("aten::") and kind[6:] in _SCRIPTED_ATTENTION_OPS for kind in ops(graph))


def module_heads(module) -> int | None:
    """The head count a module states about itself (``num_heads``, ``num_attention_heads``,
    ``n_heads``, ``n_head``), or None."""
    for attribute in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
        value = getattr(module, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def named_attention(module) -> bool:
    """A class named like attention (``LlamaAttention``, ``CausalSelfAttention``, ``Attention``)."""
    return "attention" in type(module).__name__.lower() and not is_torch_builtin(module)


