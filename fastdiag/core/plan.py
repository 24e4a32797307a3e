"""The plan of a measured pass: where the attention of an attached model is, learnt on a careful pass.

The first measured training pass is careful: every torch call of the forward goes through the
`AttentionMode` and its provenance bookkeeping (`fastdiag.core.adapters.Provenance`), which is what
finds attention in any module and decides self-attention from data flow. That costs host time on
every op of the model. When such a pass found nothing it could not measure (no refusal, no softmax
left unconfirmed, no row of unknown provenance, no compiled region, no other monitor), it leaves a
`Plan`: for each module whose calls did attention, each call's argument signature and, in order,
each attention op's signature and self-attention verdict; and how often every hooked module ran.

Later measured passes with the same training flag and autocast state are lean: only the planned
module calls enter the mode, which there passes every call through but SDPA and softmax, and the
verdicts come from the plan instead of provenance. Anything else — a module call whose tensor
arguments differ (shapes, dtypes, devices, which arguments are the same tensor), a hooked module run
more often than planned, an attention op of another signature or one too many or too few — is
handled carefully from that module call on (or, found at the op, with its rows counted as of unknown
provenance and said so in ``coverage()``), and the plan is dropped: the next measured pass is careful.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def call_signature(args: tuple, kwargs: dict) -> tuple:
    """What a module call's data flow can depend on, cheaply: each argument's slot and, for tensors,
    shape, dtype, device, whether it requires grad and the first slot holding the same tensor (self-
    versus cross-attention); plain values as they are; other objects by type."""
    signature, first = [], {}
    for slot, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            signature.append((slot, value.shape, value.dtype, value.device, value.requires_grad,
                              first.setdefault(id(value), slot)))
        elif value is None or isinstance(value, (bool, int, float, str)):
            signature.append((slot, value))
        else:
            signature.append((slot, type(value)))
    return tuple(signature)


def sdpa_signature(call: dict) -> tuple:
    q, k, mask = call.get("query"), call.get("key"), call.get("attn_mask")
    return ("sdpa", getattr(q, "shape", None), getattr(q, "dtype", None), getattr(k, "shape", None),
            None if not isinstance(mask, torch.Tensor) else (mask.shape, mask.dtype),
            call.get("is_causal", False), call.get("dropout_p", 0.0), call.get("scale"), call.get("enable_gqa", False))


def softmax_signature(scores: torch.Tensor) -> tuple:
    return ("softmax", scores.shape, scores.dtype)


@dataclass(frozen=True)
class Event:
    op: tuple             # `sdpa_signature` / `softmax_signature`
    same_input: bool | None


@dataclass(frozen=True)
class Plan:
    calls: dict           # planned module name -> [(call signature, (Event, ...)), ...] in call order
    runs: dict            # every hooked module that ran -> how often

    def expected(self, name: str, index: int, args: tuple, kwargs: dict):
        """(events, on plan) for call ``index`` of module ``name``: its planned attention events, or
        () for a module with none; on plan False when the call is not what the plan expects."""
        planned = self.calls.get(name)
        if planned is None:
            return (), index < self.runs.get(name, 0)
        if index >= len(planned):
            return (), False
        signature, events = planned[index]
        return events, signature == call_signature(args, kwargs)


class PlanRecorder:
    """Collects a careful pass's module calls and attention events; `plan` turns them into a Plan."""

    def __init__(self):
        self.modules: dict[int, tuple] = {}     # call -> (name, call signature)
        self.runs: dict[str, int] = {}
        self.events: dict[int, list] = {}       # call -> [Event, ...]
        self.spoilt = False

    def module_call(self, name: str, call: int, args: tuple, kwargs: dict) -> None:
        self.runs[name] = self.runs.get(name, 0) + 1
        self.modules[call] = (name, call_signature(args, kwargs))

    def event(self, call: int, op: tuple, same_input: bool | None) -> None:
        if call < 0:
            self.spoilt = True
        else:
            self.events.setdefault(call, []).append(Event(op, same_input))

    def plan(self) -> Plan | None:
        if self.spoilt or not self.events:
            return None
        planned = {self.modules[call][0] for call in self.events}
        calls: dict[str, list] = {}
        for call, (name, signature) in sorted(self.modules.items()):
            if name in planned:
                calls.setdefault(name, []).append((signature, tuple(self.events.get(call, ()))))
        return Plan(calls, dict(self.runs))
