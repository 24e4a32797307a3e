"""A torch.nn module attached as the root keeps its step hooks out of torch.compile's graph.

`torch.compile(module)` calls a module's hooks outside the traced frame and compiles the frame of its
``forward`` — unless that forward sits in a file dynamo skips (every torch.nn module: ``nn.Sequential``,
``nn.TransformerEncoder``). Then it wraps the whole call, hooks included (``OptimizedModule._initialize``),
and the monitor's begin and end hooks, which must never be traced (`torch.compiler.disable`: they move
the step counter), are a graph break inside the compiled region; under ``fullgraph=True`` dynamo raised
in the user's step. Such a root gets an instance ``forward`` at attach: the class's own forward behind a
frame in this file, which dynamo compiles, so torch.compile takes the hooks-outside path as it does for a
root class of the user's own. Wrappers made before attach (``attach(torch.compile(seq))``, or one not handed to attach) are set
up again. It stays after detach: a wrapper made while attached compiles that frame (without it,
``fullgraph=True`` finds no frame to compile and raises), and it computes what the class's forward does.
"""
from __future__ import annotations

import gc
import inspect
import types

import torch


def _class_forward(self, *args, **kwargs):
    return type(self).forward(self, *args, **kwargs)


def _inlined_by_compile(module: torch.nn.Module) -> bool:
    # Imported here, not at the top: torch._dynamo takes 1.3 s to import and only attach needs it
    from torch._dynamo import trace_rules
    return isinstance(module.forward, types.MethodType) and trace_rules.check(module.forward)


def give_own_frame(root: torch.nn.Module, wrappers: list) -> bool:
    """For a root whose call torch.compile would inline hooks and all (see the module docstring): set
    its instance ``forward`` and set up the ``wrappers`` (torch.compile's, around it) again. Whether it did.

    The instance forward is a method named ``forward`` with the class forward's signature: a copy
    (``copy.deepcopy``) gets one bound to the copy, a pickle (``getattr(copy, "forward")``) the class's."""
    if "forward" in root.__dict__ or not _inlined_by_compile(root):
        return False
    function = types.FunctionType(_class_forward.__code__, _class_forward.__globals__, "forward")
    function.__qualname__ = f"{type(root).__qualname__}.forward"
    function.__signature__ = inspect.signature(type(root).forward)
    object.__setattr__(root, "forward", types.MethodType(function, root))
    for wrapper in [*wrappers, *(w for w in _wrappers_made_before(root) if all(w is not h for h in wrappers))]:
        initialize = getattr(wrapper, "_initialize", None)
        if callable(initialize):
            initialize()
    return True


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
