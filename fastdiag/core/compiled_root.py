"""A torch.nn module attached as the root keeps its step hooks out of torch.compile's graph.

`torch.compile(module)` calls a module's hooks outside the traced frame and compiles the frame of its
``forward`` — unless that forward sits in a file dynamo skips (every torch.nn module: ``nn.Sequential``,
``nn.TransformerEncoder``). Then it wraps the whole call, hooks included (``OptimizedModule._initialize``),
and the monitor's begin and end hooks, which must never be traced (`torch.compiler.disable`: they move
the step counter), are a graph break inside the compiled region; under ``fullgraph=True`` dynamo raised
in the user's step. Such a root gets an instance ``forward`` while attached: the class's own forward
behind a frame in this file, which dynamo compiles, so torch.compile takes the hooks-outside path as it
does for a root class of the user's own. torch.compile's wrappers around the root — handed to attach,
made before attach and not handed to it (`_wrappers_made_before`), or made while attached (seen by the
monitor's module registration hook) — are set up again at attach, and at detach, which removes the
attribute: a wrapper made while attached would otherwise go on compiling a frame that no longer runs
(under ``fullgraph=True``: no frame to compile, an error).
"""
from __future__ import annotations

import gc
import inspect
import types
import weakref

import torch


def _class_forward(self, *args, **kwargs):
    return type(self).forward(self, *args, **kwargs)


def _inlined_by_compile(module: torch.nn.Module) -> bool:
    # Imported here, not at the top: torch._dynamo takes 1.3 s to import and only attach needs it
    from torch._dynamo import trace_rules
    return isinstance(module.forward, types.MethodType) and trace_rules.check(module.forward)


class OwnFrame:
    """A root's instance ``forward`` (a method named ``forward`` with the class forward's signature: a
    deepcopy gets one bound to the copy, a pickle the class's own) and the torch.compile wrappers around
    it. A hook handle of the monitor: ``remove`` at detach."""

    def __init__(self, root: torch.nn.Module, wrappers: list):
        function = types.FunctionType(_class_forward.__code__, _class_forward.__globals__, "forward")
        function.__qualname__ = f"{type(root).__qualname__}.forward"
        function.__signature__ = inspect.signature(type(root).forward)
        self.root, self.forward = root, types.MethodType(function, root)
        self.wrappers: weakref.WeakSet = weakref.WeakSet([*wrappers, *_wrappers_made_before(root)])
        object.__setattr__(root, "forward", self.forward)
        self._set_up_wrappers()

    def adopt(self, wrapper: torch.nn.Module) -> None:
        """A torch.compile wrapper made around the root while attached (before its own set-up runs)."""
        self.wrappers.add(wrapper)

    def remove(self) -> None:
        if self.root.__dict__.get("forward") is self.forward:
            del self.root.__dict__["forward"]
            self._set_up_wrappers()

    def _set_up_wrappers(self) -> None:
        for wrapper in list(self.wrappers):
            initialize = getattr(wrapper, "_initialize", None)
            if callable(initialize):
                initialize()


def give_own_frame(root: torch.nn.Module, wrappers: list) -> OwnFrame | None:
    """For a root whose call torch.compile would inline hooks and all (see the module docstring): its
    `OwnFrame`, set; else None."""
    if "forward" in root.__dict__ or not _inlined_by_compile(root):
        return None
    return OwnFrame(root, wrappers)


def _wrappers_made_before(root: torch.nn.Module) -> list:
    """torch.compile's wrappers around ``root`` made before attach and not handed to it
    (``run = torch.compile(seq); attach(seq)``): each still inlines the root's call, hooks and all, and
    under ``fullgraph=True`` raised in the step. A wrapper holds the root in its ``_modules`` dict; found
    by the garbage collector's referrers (a scan of the heap, at attach of such a root only)."""
    from torch._dynamo.eval_frame import OptimizedModule

    found = []
    for holder in gc.get_referrers(root):
        if not (isinstance(holder, dict) and holder.get("_orig_mod") is root):
            continue
        for owner in gc.get_referrers(holder):   # the wrapper, or its materialised __dict__
            for wrapper in [owner] if isinstance(owner, OptimizedModule) else (
                    gc.get_referrers(owner) if isinstance(owner, dict) else []):
                if isinstance(wrapper, OptimizedModule) and wrapper._orig_mod is root and \
                        all(wrapper is not w for w in found):
                    found.append(wrapper)
    return found
