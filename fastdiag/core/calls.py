"""The attention calls of a measured forward pass: what `adapters.AttentionMode` hands over (SDPA
calls, softmaxes, logsumexp, flex attention) turned into layer statistics or a named refusal.

`Monitor` keeps attach, hooks, lifecycle and records; it owns one `AttentionCalls` and gives it a
fresh `passes.PassState` at the start of every measured pass (``calls.state``). Everything a call
decides (which module ran it, self- or cross-attention from `adapters.Provenance`, which rows count,
the handed-in padding of `Monitor.set_padding`, the lean pass's plan events) is read and written
here, so the mode talks to this object only and nothing travels back up to the monitor but the
one-time warnings it says through ``warn_once``.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdiag.core import adapters, passes
from fastdiag.core.diagnostics import head_stats
from fastdiag.core.kernels import rows as row_rule
from fastdiag.core.plan import Event, sdpa_signature, softmax_signature
from fastdiag.core.qk import sdpa_with_stats
from fastdiag.core.stats import HeadStats

__all__ = ["AttentionCalls", "ROOT"]

ROOT = "<root>"   # the attached module's own name, everywhere (its children have their own)

IN_PLACE = (0, 1, 2, 3)   # a softmax output read as written: [B, H, Tq, Tk]


@dataclass(eq=False)
class Candidate:
    """A softmax of a measured pass, waiting for its product with values (or confirmed at once)."""
    name: str                     # the module whose call took it
    call: int                     # that module call's number
    stats: HeadStats | None       # its statistics read as written, or None: it cannot be measured so
    how: str                      # how it is measured, or (stats None) why it is not
    shape: tuple                  # the softmax output's shape
    key_axis: int = 3             # the axis the softmax normalised
    measure: object = None        # layout -> (stats, how): the statistics read in another layout

# Why a layer's padding rows could not be told from a call (coverage()["all_rows"], and a warning naming
# the layer at the first read where they could have mattered: its masks hide a position, or a mask was
# handed in).
UNKNOWN_PROVENANCE = ("whether its queries and keys come from the same input is not known (torch.compile, or "
                      "queries and keys not computed in the module from its floating-point inputs, e.g. from "
                      "token ids), so its padding rows cannot be told: every row that sees a key is counted, "
                      "padding rows included; monitor.set_padding(attention_mask, within=<this module>) says "
                      "it is self-attention over that mask")
KEYS_BEYOND_QUERIES = ("its keys outnumber its queries (a memory prefix: k = cat(memory, x)), so which key is a "
                       "query's own position is not known and its padding rows cannot be told: every row that "
                       "sees a key is counted, padding rows included")
LOW_SCORES = ("some query rows were left out only because every score of theirs (or of their own key, in every row) "
              "lies between -5000 and -1000: read as an additive mask (a -1e4 fill scaled by 1/sqrt(d)), but real "
              "logits that low give the same scores, so they may be real rows dropped; where no mask was added, "
              "attn_implementation='sdpa' (the mask itself is read there) measures them")
SEEN_ONLY_BY_ITSELF = ("its mask lets positions be seen by their own query row only (XLNet's padding: a padded "
                       "query attends to itself): they cannot be told from real tokens and are counted; "
                       "monitor.set_padding(attention_mask) leaves them out")


# torch.nn modules that take a softmax: made on the fly in a module's forward, they are its own code
_SOFTMAX_MODULES = (torch.nn.Softmax, torch.nn.LogSoftmax, torch.nn.Softmin, torch.nn.Softmax2d)


def stack_reader_ready() -> bool:
    """At attach: marks the two functions torch.compile runs while it traces and keeps the results of as
    constants of the graph (``torch.compiler.assume_constant_result``): `adapters.tracing` and
    `_traced_verdict`. At attach, not at import: marking imports torch._dynamo (1.3 s), which a command
    that never attaches does not need. Whether dynamo's module stack is read (`_traced_verdict`)."""
    for fn in (adapters.tracing, _traced_verdict):
        if not getattr(fn, "_dynamo_marked_constant", False):
            torch.compiler.assume_constant_result(fn)
    return True


def _traced_verdict(calls: "AttentionCalls", name: str) -> tuple | None:
    """Run by torch.compile while it traces an attention op that the pass's module stack gives to module
    ``name`` of this model (`stack_reader_ready`): dynamo's own stack of the module calls it traces through
    (innermost last, each keyed by the module's id; the compiled frame's module is not on it) says whether
    the op ran inside another model's module — a teacher reached through a global or a closure, which
    nothing hooks (`AttentionCalls.verdict`). The result is part of the graph: the stack is the traced
    code's, the same on every run of it. Dynamo's stack is its own, not a public API: where it cannot be
    read, None (nothing concluded)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx().output.current_tx      # the innermost (inlining) translator
        stack = [(int(key.split("@")[0]), cls) for key, (_, cls) in tx.nn_module_stack.items()]
        frame = tx.output.root_tx.f_locals.get("self")
        if not all(isinstance(cls, type) for _, cls in stack):
            return None
        if isinstance(frame, torch.nn.Module):
            stack.insert(0, (id(frame), type(frame)))
        elif not any(ident in calls.ids for ident, _ in stack):
            return None     # a frame of no module, this model's modules not on its stack: nothing to go by
        return calls.verdict(stack)
    except Exception:   # noqa: BLE001 - another torch's dynamo: no conclusion, never a failed trace
        return None


def _class_name(foreign) -> str:
    """A foreign entry of the module stack: the module (global hooks, eager) or its class name (the hooks
    of a model held by this one, `Monitor._hook_held`, traced into compiled graphs)."""
    return foreign if isinstance(foreign, str) else type(foreign).__name__


class AttentionCalls:
    """Handles the attention ops of an attached model's measured passes (`adapters.AttentionMode`
    calls ``on_sdpa``, ``on_probs``, ``on_softmax_elsewhere``, ``on_logsumexp``,
    ``on_flex_attention``, ``confirm``). ``modules``: name → module of the attached model;
    ``kinds``: the modules measured structurally (zoo, MultiheadAttention), which measure themselves;
    ``selected``: the names the user selected; ``sinks``: modules with attention-sink logits → heads."""

    def __init__(self, modules: dict, kinds: dict, selected: set, sinks: dict, backend: str, chunk_bytes: int,
                 warn_once):
        self.modules, self.kinds, self.selected, self.sinks = modules, kinds, selected, sinks
        self.backend, self.chunk_bytes = backend, chunk_bytes
        self._warn_once = warn_once
        self.state = passes.IDLE                  # the measured pass in progress (the monitor sets it)
        self.provenance = adapters.Provenance()   # which module inputs this pass's tensors derive from
        self.padding: list[tuple[str | None, torch.Tensor]] = []  # this step's real-token masks [B, T], each
        #                                  with the module (name) whose attention it belongs to, None = any
        # layers whose padding rows may have been counted (XLNet's padding, unknown provenance, a memory
        # prefix): (name, why) -> a device flag, read at the next host read (`Monitor._read_suspects`),
        # never in a step
        self.suspects: dict[tuple[str, str], torch.Tensor] = {}
        self.suspects_named: set[str] = set()
        self.candidate_ids = itertools.count()
        self.warned_softmax: set[str] = set()
        self.warned_foreign: set[tuple] = set()
        self.read_stack = False     # `_traced_verdict` is marked for torch.compile (the monitor, at attach)
        self.ids = {id(m) for m in modules.values()}   # this model's modules, by id: all others are another's

    def with_padding(self, rows: torch.Tensor | None, b: int, t: int, device: torch.device,
                      name: str) -> torch.Tensor | None:
        """``rows`` and the handed-in padding of a self-attention call in module ``name`` with batch
        ``b`` and ``t`` query rows, on the call's device."""
        for within, padding in self.padding:
            if not self._applies(within, name, explicit=False) or padding.shape != (b, t):
                continue
            self.state.padding_used = True
            try:
                padding = padding.to(device=device, non_blocking=True)
            except RuntimeError as error:   # a device it cannot come from: never break the step
                self._warn_once(("padding", str(padding.device)), f"set_padding's mask on {padding.device} cannot be "
                                f"read on {device} ({error}): its padding rows are not left out")
                continue
            rows = padding if rows is None else rows & padding
        return rows

    def unconfirmed(self) -> None:
        """End of a measured pass: a softmax never multiplied with values along its key axis is no
        attention (a heat map, a router): not a layer, named once; attention written as
        exp(s − logsumexp) in a module with no statistics is named as unmeasured."""
        if self.state.candidates:
            self.state.recorder = None    # no plan from a pass that met softmaxes it could not place
        for entry in self.state.candidates.values():
            name = entry.name
            if name in self.warned_softmax:
                continue
            self.warned_softmax.add(name)
            axis = "the last axis" if entry.key_axis == len(entry.shape) - 1 else f"dim {entry.key_axis}"
            warnings.warn(f"fastdiag.attach: module {name!r} ({type(self.modules[name]).__name__}) takes a softmax "
                          f"over {axis} of 4-D (or larger) scores whose output is never multiplied with values "
                          "along that axis: not attention, not recorded", RuntimeWarning, stacklevel=4)
        self.state.candidates = {}
        for (caller, outer), inner in self.state.foreign.items():
            if (caller, outer) in self.warned_foreign:
                continue
            self.warned_foreign.add((caller, outer))
            where = "" if caller is None else f" called by {caller!r} ({type(self.modules[caller]).__name__})"
            warnings.warn(f"fastdiag.attach: attention in {inner}, part of {outer}: a module outside the attached "
                          f"model{where}, is not recorded as a layer of this model; attach that model itself to "
                          "measure it as its own", RuntimeWarning, stacklevel=4)
        for name, reason in self.state.lse.items():
            if name not in self.state.how:
                self.refuse(name, reason)

    def _planned_event(self, module_call: int, op: tuple):
        """The plan's `Event` for the next attention op of the lean call ``module_call``, or None where
        the op is not the one planned (the pass is off the plan)."""
        state = self.state
        events, seen = state.events[module_call]
        index = seen[0]
        seen[0] += 1
        if index < len(events) and events[index].op == op:
            return events[index]
        state.off_plan = True
        return None

    def _event(self, module_call: int, op: tuple):
        """An attention op of ``module_call``: False on a careful pass or in a module call handled
        carefully (`_learn_op` it then); on a lean pass the plan's `Event`, or one with an unknown
        self-attention verdict where the op is not the one planned (the plan is dropped)."""
        state = self.state
        if state.plan is None or state.careful and module_call not in state.events:
            return False
        event = self._planned_event(module_call, op) if module_call in state.events else None
        if event is None:
            state.off_plan = True
            return Event(op, None)
        return event

    def _learn_op(self, module_call: int, op: tuple, same_input: bool | None) -> bool | None:
        """A careful pass's attention op, for the plan of the lean passes after it; returns ``same_input``."""
        recorder = self.state.recorder
        if recorder is not None:
            recorder.event(module_call, op, same_input)
        return same_input

    def refuse(self, name: str, reason: str) -> None:
        """An attention call in module ``name`` that cannot be measured exactly: the module gets no
        statistics this pass, and is named with ``reason`` after it (`_check_coverage`)."""
        self.state.refused.setdefault(name, reason)

    def add(self, name: str, stats: HeadStats, how: str) -> None:
        key, i = name, 1
        while key in self.state.pending:  # a module called twice in one pass: "name#1", "name#2", ...
            key = f"{name}#{i}"
            i += 1
        self.state.pending[key] = stats
        self.state.how[name] = how

    def enclosing_compiled(self) -> None:
        """End of a compiled pass (no global hooks there: another model's modules are not on the stack):
        an attention op in the code of a module that contains another module doing attention on this
        pass may be another model's, run by it (a teacher called by the root), so that module is named,
        not recorded."""
        busy = set(self.state.how) | set(self.state.refused)
        for name in list(self.state.how):
            if name in self.state.read_own and name not in self.state.unread:
                continue    # each of its attention ops traced with no other model's module around it (`verdict`)
            if any(other != name and (name == ROOT or other.startswith(name + ".")) for other in busy):
                self.refuse(name, "under torch.compile an attention op in its own code, beside attention in the "
                                  "modules it contains, cannot be told from another model's attention run by it "
                                  "(a teacher outside the module tree): not recorded; an eager pass tells them")
        unverified = [n for n in self.state.how if n in self.state.unread and n not in self.state.refused]
        if unverified:      # recorded, but whose attention it was could not be read: said, never silent
            shown = ", ".join(repr(n) for n in unverified[:4]) + (f" and {len(unverified) - 4} more" if len(unverified) > 4 else "")
            self._warn_once(("unverified owner",), f"layers {shown}: under torch.compile the traced module stack "
                            "could not be read (another torch) or held none of this model's modules (the op traced in "
                            "a frame of its own after a graph break), so their attention ops are recorded as their own "
                            "without the "
                            "check that tells another model's attention run by them (a teacher outside the module "
                            "tree, reached through a global or a closure; one held in an attribute is told anyway); "
                            "an eager pass checks them")

    def _attention_call(self) -> tuple[str, int] | None:
        """(name, call number) of the module running an attention op now, if it is to be measured
        here (not a structural kind measuring itself, not outside the model, selected)."""
        stack = self.state.stack
        if not stack:
            return None
        name, call = stack[-1]
        if name is None:   # a model outside the attached one, run inside it: its attention is not ours
            outer = len(stack) - 1
            while outer > 0 and stack[outer - 1][0] is None:
                outer -= 1
            caller = stack[outer - 1][0] if outer > 0 else None
            self.state.foreign.setdefault((caller, _class_name(stack[outer][1])), _class_name(call))
            return None
        if name in self.kinds or name not in self.selected or name in self.state.fast_path:
            return None
        verdict = _traced_verdict(self, name) if self.read_stack and torch.compiler.is_compiling() else None
        if verdict:         # another model's module ran it: its attention, named as such (`unconfirmed`)
            self.state.foreign.setdefault((name, verdict[0]), verdict[1])
            return None
        if verdict is not None:
            self.state.read_own.add(name)
        elif torch.compiler.is_compiling() or self.state.compiled_calls:
            self.state.unread.add(name)
        return name, call

    def verdict(self, stack: list) -> tuple:
        """While tracing (`_traced_verdict`): an attention op run inside dynamo's module ``stack`` (module id,
        class; innermost last; the compiled frame's module first). A module outside this model entered
        inside the innermost of its modules there (those around it are a model running this one; with none
        there, the frame runs inside the calling module's call: all of it is), but for a torch.nn softmax
        made on the fly (``nn.Softmax(-1)(s)``: the caller's own code), makes it another model's attention:
        (its outermost module's class, its innermost's); () where none does."""
        inner = max((i for i, (ident, _) in enumerate(stack) if ident in self.ids), default=-1)
        foreign = [cls for ident, cls in stack[inner + 1:] if not issubclass(cls, _SOFTMAX_MODULES)]
        return (foreign[0].__name__, foreign[-1].__name__) if foreign else ()

    @staticmethod
    def _applies(within: str | None, name: str, explicit: bool) -> bool:
        """Whether a mask handed in for ``within`` applies to module ``name`` (``explicit``: only a mask
        handed in for that module or one containing it, not one for every module)."""
        if within is None:
            return not explicit
        return name == within or within == ROOT or name.startswith(within + ".")

    def _handed_in(self, name: str, b: int, t: int, explicit: bool) -> bool:
        return any(self._applies(within, name, explicit) and padding.shape == (b, t) for within, padding in self.padding)

    def _self_attention(self, name: str, same_input: bool | None, b: int, tq: int, tk: int) -> bool:
        """Whether the padding rules of self-attention apply to a call: its queries and keys derive
        from the same input of the module's call (`adapters.Provenance`), never a guess from shapes,
        or, where that is not known, the user handed in a mask for this very module (``within=``)."""
        if same_input is None and tq == tk and self._handed_in(name, b, tq, explicit=True):
            return True
        return bool(same_input) and tq == tk

    def _padding_positions(self, name: str, hidden: torch.Tensor, b: int, t: int) -> None:
        """Counts the query rows of a self-attention call left out because their own position is a key
        its mask hides from every query: padding, or a token-drop mask's real token, which the mask
        cannot tell apart (``coverage()["padding_rows"]``). A device count in the pass's state."""
        count = adapters.own_statistics(lambda: (~row_rule.real_positions(hidden)).expand(b, t).sum())
        counts = self.state.padding_rows
        counts[name] = count if name not in counts else counts[name] + count

    def _undecided(self, name: str, same_input: bool | None, hidden: torch.Tensor | None, b: int, tq: int,
                   tk: int) -> None:
        """A call whose padding rows cannot be told (`_self_attention` said no without knowing): named
        where they could have mattered — its masks (``hidden``, True = masked) hide a key from every query
        row, or a mask of its shape was handed in: a device flag in the pass's state (it leaves a compiled
        graph as the statistics do), read at the first host read after the pass."""
        if same_input is None and tq == tk:
            why = UNKNOWN_PROVENANCE
        elif same_input and 1 < tq < tk:
            why = KEYS_BEYOND_QUERIES
        else:
            return
        if self._handed_in(name, b, tq, explicit=False):
            flag = torch.ones((), dtype=torch.bool, device=hidden.device if hidden is not None else None)
        elif hidden is not None:
            flag = adapters.own_statistics(lambda: hidden.all(-2).all(1).any())
        else:
            return
        key = (name, why)
        self.state.undecided[key] = flag if key not in self.state.undecided else self.state.undecided[key] | flag

    # ---- called by adapters.AttentionMode during a measured pass --------------------------------

    def on_sdpa(self, call: dict):
        """An SDPA call: the original op, and its statistics re-derived from Q and K."""
        where = self._attention_call()
        if where is None:
            return F.scaled_dot_product_attention(**call)
        name, module_call = where
        query, key = call.get("query"), call.get("key")
        event = self._event(module_call, sdpa_signature(call))
        if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)) or query.dim() < 4 \
                or key.dim() < 4:
            # [B·H, T, D] or [T, D]: torch reads no heads there, and a batch of B·H single heads is not
            # this layer's heads (s̄ would be NaN, σ_l 0): named, never guessed
            shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
            self.refuse(name, f"scaled_dot_product_attention on a {len(shape)}-D query {shape}: heads folded "
                               "into the batch (or absent) cannot be read from the call; pass [B, H, T, D]")
            return F.scaled_dot_product_attention(**call)
        query_passed, key_passed = query, key
        dtype = adapters.autocast_dtype(query.device.type)
        if dtype is not None:
            # Exactly what autocast hands the op (bit-identical output); the statistics then read the
            # tensors the op used, and run outside the caller's autocast (adapters.own_statistics).
            call = {k: adapters.as_autocast_casts(v, dtype) for k, v in call.items()}
            query, key = call["query"], call["key"]
        attn_mask = call.get("attn_mask")
        packed = self._packed_query_heads(name, call)
        if packed == 0:
            self.refuse(name, f"grouped-query decode call with query {tuple(query.shape)} and a mask of shape "
                               f"{tuple(attn_mask.shape)} that does not unpack to its heads")
            return F.scaled_dot_product_attention(**call)
        rows = None
        if event is False and (query.dim() != 4 or packed):
            self._learn_op(module_call, sdpa_signature(call), None)
        if query.dim() == 4 and not packed:
            b, h, tq, _ = query.shape
            tk = key.shape[-2]
            same_input = event.same_input if event is not False else \
                self._learn_op(module_call, sdpa_signature(call), self.provenance.same_input(module_call, query_passed, key_passed))
            hidden = None if attn_mask is None else row_rule.hidden_keys(attn_mask, b, h, tq, tk)
            if self._self_attention(name, same_input, b, tq, tk):
                if hidden is not None:   # the rule of every path (row_rule), read from the mask
                    rows = row_rule.self_attention_rows(hidden).expand(b, tq)
                    self._padding_positions(name, hidden, b, tq)
                with_padding = self.with_padding(rows, b, tq, query.device, name)
                if with_padding is rows and hidden is not None:  # no handed-in padding for this call
                    self.suspect(name, adapters.own_statistics(row_rule.seen_only_by_itself, hidden),
                                 SEEN_ONLY_BY_ITSELF)
                rows = with_padding
            else:
                self._undecided(name, same_input, hidden, b, tq, tk)
        measure = adapters.sdpa_reissued_with_stats if adapters.outer_attention_mode() else sdpa_with_stats
        out, stats = adapters.own_statistics(measure, **call, query_mask=rows, backend=self.backend,
                                             chunk_bytes=self.chunk_bytes, packed_query_heads=packed)
        self._add_op(name, module_call, stats, "sdpa")
        return out

    def _packed_query_heads(self, name: str, call: dict) -> int | None:
        """H when the call packs a one-token query's H heads as ``[B, Hkv, H / Hkv, D]`` rows (Hugging
        Face's grouped-query decode, ``pack_gqa``): the module says H (its config) and groups
        (``num_key_value_groups``), and only that packing gives Hkv query heads in such a module.
        0 when it is packed but its mask cannot be unpacked; None when not packed."""
        module = self.modules.get(name)
        groups = getattr(module, "num_key_value_groups", None)
        heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
        query, key = call["query"], call["key"]
        if not (isinstance(groups, int) and isinstance(heads, int) and groups > 1 and query.dim() == 4
                and not call.get("enable_gqa") and query.shape[1] * groups == heads
                and key.shape[1] == query.shape[1] and query.shape[2] == groups):
            return None
        mask = call.get("attn_mask")
        if mask is not None:
            mask4 = mask.shape if mask.dim() >= 4 else (1,) * (4 - mask.dim()) + tuple(mask.shape)
            if mask.dim() > 4 or not (mask4[-2] == 1 or (mask4[-3] == query.shape[1] and mask4[-2] == groups)):
                return 0
        return heads

    def on_probs(self, scores: torch.Tensor, probs: torch.Tensor, key_axis: int = 3) -> None:
        """A softmax over axis ``key_axis`` of 4-D scores (3: ``[B, H, Tq, Tk]`` as written; another, such
        as scores ``[B, H, Tk, Tq]`` normalised over dim 2: the layout is read from the product with values
        alone): the probabilities the model uses, measured as they are, in the layout the product with
        values reads them in (`_confirm_entry`)."""
        where = self._attention_call()
        if where is None:
            return
        name, module_call = where
        event = self._event(module_call, softmax_signature(scores))
        if probs.numel() == 0:
            b, h, tq, tk = probs.shape
            if b == 0 and min(h, tq, tk) > 0 and key_axis == 3:  # an empty batch: no rows, exactly (as SDPA's)
                zeros = torch.zeros(h, h, dtype=torch.float64, device=probs.device)
                entry = Candidate(name, module_call, HeadStats(zeros, zeros[0], zeros[0, 0], zeros[0, 0]),
                                  "probabilities", tuple(probs.shape))
                if event is False:
                    self._learn_op(module_call, softmax_signature(scores), None)
                    self._candidate(entry, probs)
                else:
                    self._confirm_entry(entry)
            else:
                self.refuse(name, f"a softmax over empty scores {tuple(probs.shape)}")
            return
        if key_axis == 3 and torch.compiler.is_compiling():
            unconfirmed = self._unconfirmed_compiled_layout(name, tuple(probs.shape))
            if unconfirmed is not None:
                self.refuse(name, unconfirmed)
                return
        if event is not False:
            same_input = event.same_input
        elif key_axis == 3:
            same_input = self._learn_op(module_call, softmax_signature(scores),
                                        self.provenance.scores_of_same_input(module_call, scores))
        else:   # the lean passes' plan knows the [B, H, Tq, Tk] softmax only
            same_input, self.state.recorder = self.provenance.scores_of_same_input(module_call, scores), None

        def measure(layout: tuple) -> tuple:
            return self._probs_stats(name, scores.permute(layout), probs.permute(layout), same_input)

        if key_axis == 3:
            entry = Candidate(name, module_call, *self._probs_stats(name, scores, probs, same_input),
                              tuple(probs.shape), key_axis, measure)
        else:
            entry = Candidate(name, module_call, None, f"a softmax over dim {key_axis} of scores {tuple(probs.shape)} "
                              "whose product with values does not say which axis holds the queries and which the heads",
                              tuple(probs.shape), key_axis, measure)
        if event is False:
            self._candidate(entry, probs)
        else:   # a lean pass: the plan says this softmax is multiplied with values
            self._confirm_entry(entry)

    def _unconfirmed_compiled_layout(self, name: str, shape: tuple) -> str | None:
        """Under torch.compile the product with values is not tracked, so a softmax over the last axis
        of 4-D scores is read as written, ``[B, H, Tq, Tk]``, only where its shape confirms it: the
        module states its head count H (`adapters.module_heads`, or its ``config.num_attention_heads``)
        and dim 1 alone of dims 0–2 has H (the keys are the softmax's axis; batch and queries swapped
        give the same statistics). None then; otherwise why the layout is not confirmed."""
        module = self.modules.get(name)
        heads = adapters.module_heads(module)
        if heads is None:
            heads = adapters.module_heads(getattr(module, "config", None))
        if heads is None:
            why = ("the module states no head count (num_heads, num_attention_heads, n_heads, n_head, or "
                   "config.num_attention_heads) to confirm it by")
        else:
            fits = [axis for axis in range(3) if shape[axis] == heads]
            if fits == [1]:
                return None
            if 1 not in fits:
                why = f"its dim 1 is not the module's {heads} heads"
            else:
                axes = ", ".join(map(str, fits[:-1])) + f" and {fits[-1]}"
                why = (f"dims {axes} each have the module's {heads} heads (Tq = H or B = H), so which holds "
                       "the heads cannot be told")
        return (f"under torch.compile the product with values is not tracked, so the layout of its softmax over "
                f"{shape} (assumed [B, H, Tq, Tk]) is not confirmed: {why}; not recorded (an eager pass reads "
                "the layout from the product with values)")

    def on_exp_of_log_softmax(self, scores: torch.Tensor, key_axis: int, probs: torch.Tensor) -> None:
        """``exp(log_softmax(scores))`` over 4-D scores: probabilities formed in two steps, measured as a
        softmax's (`on_probs`). The lean passes' plan hands over softmaxes only: no plan from this pass."""
        if self._attention_call() is not None:
            self.state.recorder = None
        self.on_probs(scores, probs, key_axis)

    def _probs_stats(self, name: str, scores: torch.Tensor, probs: torch.Tensor, same_input: bool | None) -> tuple:
        """(`HeadStats`, how) of probabilities ``probs`` ``[B, H, Tq, Tk]`` formed from ``scores``."""
        b, h, tq, tk = probs.shape
        # Masked keys are read from the scores the model's mask was added into (row_rule: -inf, HF's
        # finfo.min, XLNet -1e30, Funnel -1e6, MarkupLM -1e4), never from zeros in P: a sharp softmax
        # gives real keys exactly 0 (float32 at a logit gap of 104), and a real key is not padding.
        scores = scores.detach()
        # An attention sink (a per-head logit concatenated as the last score column, gpt-oss) is in the
        # measured distribution, but it is no key: the padding rules read the real keys only.
        sink = name in self.sinks and self.sinks[name] == h and tk > 1
        if sink:
            scores = scores[..., :-1]
        hidden = row_rule.masked(scores)
        rows = row_rule.sees_a_key(hidden)
        self_attention = self._self_attention(name, same_input, b, tq, hidden.shape[-1])
        if self_attention:
            from_mask = rows & row_rule.real_positions(hidden)
        self.suspect(name, adapters.own_statistics(row_rule.decided_by_low_scores, scores, hidden,
                                                   from_mask if self_attention else rows, self_attention), LOW_SCORES)
        if self_attention:
            self._padding_positions(name, hidden, b, tq)
            rows = self.with_padding(from_mask, b, tq, probs.device, name)
            if rows is from_mask:  # no handed-in padding for this call
                self.suspect(name, adapters.own_statistics(row_rule.seen_only_by_itself, hidden), SEEN_ONLY_BY_ITSELF)
        else:
            self._undecided(name, same_input, hidden, b, tq, hidden.shape[-1])
        stats = adapters.own_statistics(head_stats, probs.detach(), rows, backend=self.backend)
        return stats, "probabilities with sink" if sink else "probabilities"

    def on_mha_forward(self, args: tuple, kwargs: dict):
        """``F.multi_head_attention_forward`` called by a module's own code (open_clip, WavLM): the
        original op, and its statistics from Q and K re-projected with the call's weights, as for
        `torch.nn.MultiheadAttention` (`adapters.mha_forward_head_stats`). Inside an
        ``nn.MultiheadAttention`` it is that module's call, measured by its own pre-hook."""
        out = F.multi_head_attention_forward(*args, **kwargs)
        where = self._attention_call()
        if where is None:
            return out
        name, module_call = where
        self.state.recorder = None   # the lean passes' plan knows SDPA calls and softmaxes only
        call = dict(zip(adapters.MHA_FORWARD_ARGS, args), **kwargs)
        query, key = call["query"], call["key"]
        if call.get("static_k") is not None:
            self.refuse(name, "multi_head_attention_forward with static_k: keys handed in already projected "
                              "and split into heads are not re-derived")
            return out
        same_input = query is key or self._self_attention(name, self.provenance.same_input(module_call, query, key),
                                                           query.shape[1] if query.dim() == 3 else 1,
                                                           query.shape[0], key.shape[0])
        dtype = adapters.autocast_dtype(query.device.type)

        def padding(n: int, t: int, device) -> torch.Tensor | None:
            return self.with_padding(None, n, t, device, name)

        stats = adapters.own_statistics(adapters.mha_forward_head_stats, call, bool(same_input), self.backend,
                                        self.chunk_bytes, padding, dtype)
        self._add_op(name, module_call, stats, "mha_forward")
        return out

    def on_softmax_elsewhere(self, probs: torch.Tensor) -> None:
        """A softmax over the last axis of a tensor that is not 4-D (ProphetNet's 5-D n-gram streams):
        if it is attention (multiplied with values), its layout cannot be read, and its module is named."""
        where = self._attention_call()
        if where is not None and probs.dim() > 4:
            self._candidate(Candidate(*where, None, f"a softmax over {probs.dim()}-D scores {tuple(probs.shape)}: "
                                                    "no [B, H, Tq, Tk] layout to read heads and rows from",
                                      tuple(probs.shape), probs.dim() - 1), probs)

    def on_logsumexp(self, traced_log_softmax: bool = False) -> None:
        """``logsumexp`` over the last axis of 4-D scores: attention written as exp(s − logsumexp)
        forms its probabilities without a softmax; its module is named unless measured otherwise. So is
        a ``log_softmax`` over 4-D scores traced by torch.compile (``traced_log_softmax``), where the
        exp taken of it and its product with values are not followed (eager measures log_softmax().exp())."""
        where = self._attention_call()
        if where is not None:
            self.state.lse.setdefault(where[0], (
                "under torch.compile it takes a log_softmax over [B, H, Tq, Tk] scores, whose exp and product "
                "with values are not followed there: attention written as log_softmax(s).exp() is not "
                "measured (an eager pass measures it)") if traced_log_softmax else (
                "it takes logsumexp over [B, H, Tq, Tk] scores with no softmax or SDPA: "
                "attention written as exp(s − logsumexp) cannot be measured"))

    def on_flex_attention(self) -> None:
        """``flex_attention`` (a fused kernel with score_mod / block_mask): no probabilities and no
        SDPA call to re-derive them from, so its module, whatever its class name, is named."""
        where = self._attention_call()
        if where is not None:
            self.refuse(where[0], "it calls flex_attention, whose probabilities (score_mod, block_mask) are never "
                                   "formed and cannot be re-derived: not measured")

    def _candidate(self, entry: "Candidate", probs: torch.Tensor) -> None:
        """A softmax in module ``entry.name``: attention once its output is multiplied with values along
        its key axis (`adapters.Provenance`), in the layout that product reads; ``entry.stats`` None:
        attention whose layout is unreadable (``entry.how`` says why). Under torch.compile nothing is
        tracked: it counts as attention at once, read as written."""
        if torch.compiler.is_compiling():
            self._confirm_entry(entry)
            return
        candidate = next(self.candidate_ids)
        self.state.candidates[candidate] = entry
        self.provenance.mark_candidate(probs, candidate, entry.key_axis)

    def confirm(self, candidates: dict) -> None:
        """Softmax outputs just multiplied with values along their key axis (candidate → the layout the
        product reads them in, `adapters._layout`): attention."""
        for candidate in sorted(candidates):
            entry = self.state.candidates.pop(candidate, None)
            if entry is not None:
                self._confirm_entry(entry, candidates[candidate], read=True)

    def _confirm_entry(self, entry: "Candidate", layout: tuple | None = IN_PLACE, read: bool = False) -> None:
        """Record a confirmed softmax in ``layout`` (its axes as batch, heads, query, key). The head axis
        is the one the product reads as heads (the second batch-like axis), or, where the module states
        its head count and only the other batch-like axis has it, that one; where neither has it the
        module is named. A softmax whose product with values cannot be read (None) is named too."""
        name, stats, how, shape = entry.name, entry.stats, entry.how, entry.shape
        if layout is None and entry.measure is not None:
            heads = adapters.module_heads(self.modules.get(name))
            if entry.key_axis == 3 and heads is not None and shape[1] != heads:
                how = (f"a softmax over {shape} whose dim 1 is not the module's {heads} heads, multiplied with "
                       "values in a layout that does not say which axis holds them (a [B, T, H, window] layout)")
            elif entry.key_axis == 3:
                how = (f"a softmax over {shape} multiplied with values in a layout that does not say which axes "
                       "hold the batch, the heads and the queries (a flattened map, a gathered window of values)")
            self.refuse(name, how)
            return
        if entry.measure is not None and layout is not None:
            heads = adapters.module_heads(self.modules.get(name))
            if heads is not None and shape[layout[1]] != heads:
                if not read or shape[layout[0]] != heads:
                    self.refuse(name, f"a softmax over {shape} whose head axis (dim {layout[1]}) is not the module's "
                                      f"{heads} heads (a [B, T, H, window] or other layout)")
                    return
                layout = (layout[1], layout[0], *layout[2:])
            if layout != IN_PLACE:
                self.state.recorder = None   # the lean passes' plan reads softmaxes as written
                stats, how = entry.measure(layout)
        if stats is None:
            self.refuse(name, how)
        else:
            self._add_op(name, entry.call, stats, how)

    def _add_op(self, name: str, call: int, stats: HeadStats, how: str) -> None:
        """One attention op of module ``name``'s call ``call``: a second one in the same call (partial
        or factored softmaxes: BigBird block-sparse, Nyströmformer) makes the module unmeasured."""
        if call >= 0:
            ops = self.state.ops[(name, call)] = self.state.ops.get((name, call), 0) + 1
            if ops > 1:
                self.refuse(name, f"{ops} attention ops (softmaxes or SDPA calls) in one call: partial, "
                                   "block-sparse or factored attention is not one [B, H, Tq, Tk] map")
        self.add(name, stats, how)

    def suspect(self, name: str, flag: torch.Tensor, why: str) -> None:
        """Layer ``name`` may have had padding rows counted, for reason ``why``, where ``flag`` (a device
        bool) is True: said at the next host read (`Monitor._read_suspects`)."""
        key = (name, why)
        if name not in self.suspects_named and not torch.compiler.is_compiling():
            self.suspects[key] = flag if key not in self.suspects else self.suspects[key] | flag

