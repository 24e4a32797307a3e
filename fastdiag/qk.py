"""Head statistics straight from Q and K: ``fastdiag.qk`` is the public name of `fastdiag.core.qk`,
the same module object (so patching one patches the other)."""
import sys

from fastdiag.core import qk as _qk

sys.modules[__name__] = _qk
