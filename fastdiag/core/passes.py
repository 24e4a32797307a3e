"""The state of one measured forward pass of an attached model, created fresh when the pass begins
(`fastdiag.core.monitor.Monitor._begin`) and read once when it ends: nothing of a pass leaks into
the next. Unmeasured passes share `IDLE`, which nothing writes (every hook returns before)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fastdiag.core.plan import Plan, PlanRecorder


@dataclass(eq=False)
class PassState:
    plan: Plan | None = None                 # lean: the plan this pass follows (None: careful)
    recorder: PlanRecorder | None = None     # careful: what it learns for the next passes
    stack: list = field(default_factory=list)        # (name, call number) of the hooked modules running
    pending: dict = field(default_factory=dict)      # layer key -> HeadStats of this pass
    how: dict = field(default_factory=dict)          # measured module -> how
    refused: dict = field(default_factory=dict)      # attention calls that cannot be measured -> why
    undecided: dict = field(default_factory=dict)    # (layer, why) -> device flag: its padding rows may count
    padding_rows: dict = field(default_factory=dict)  # layer -> device count of rows left out as padding positions
    called: set = field(default_factory=set)         # hooked modules whose forward ran
    candidates: dict = field(default_factory=dict)   # softmaxes not yet multiplied with values
    ops: dict = field(default_factory=dict)          # (module, call) -> attention ops in that call
    lse: dict = field(default_factory=dict)          # module -> why its log-domain probabilities (logsumexp,
                                                     # or log_softmax under torch.compile) are not measured
    foreign: dict = field(default_factory=dict)      # (calling module, foreign model class) -> its attention's class
    read_own: set = field(default_factory=set)       # compiled: modules with an attention op read as their own
    unread: set = field(default_factory=set)         # compiled: modules with an attention op not read so
    padding_used: bool = False                       # a handed-in mask matched an attention call
    compiled_calls: int = 0                          # hooked module calls so far in a compiled pass
    fast_path: set = field(default_factory=set)      # compiled: eval fast-path modules whose mode stayed on
    # lean passes
    runs: dict = field(default_factory=dict)         # module -> calls so far
    events: dict = field(default_factory=dict)       # call -> (planned events, events seen so far)
    undo: dict = field(default_factory=dict)         # call -> what its post-hook restores
    careful: int = 0                                 # depth of module calls handled carefully
    off_plan: bool = False                           # something unexpected: the plan is dropped


IDLE = PassState()
