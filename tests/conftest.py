import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

# The fused kernel runs in Triton's interpreter on machines without CUDA; this must be set before
# anything imports triton.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two threads at most, and one per process when pytest-xdist runs several workers (`make test`): the
# workers already fill the cores, and a second thread each would only oversubscribe them.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(1 if _XDIST_WORKERS > 1 else min(2, torch.get_num_threads()))

# A test run started in the background (`cmd &`, nohup) inherits SIGINT ignored, and so would every
# process the signal tests start; those tests check what a user's Ctrl-C does, so give it back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


import pytest  # noqa: E402


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` (every builtin of tl, tl.tensor, tl.math, found
    by `inspect.getmembers`) when a kernel launches, and again on *every call of a @triton.jit helper*
    inside it, never undoing the second: 37 % of an interpreted head_stats test went there (46 of 127 s,
    H 12, T 130, cProfile). Here a helper's call skips the patch when the launch already patched the
    language modules its globals see; everything else is Triton's own code. Triton 3.6 and 3.9 both have
    this structure; where it differs, nothing is changed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    import inspect

    patched: dict[int, int] = {}                  # id(language module) -> launches that patched it
    langs_seen: dict = {}                         # fn -> its language modules (a module's imports stay put)

    def langs_of(fn) -> set[int]:
        langs = langs_seen.get(fn)
        if langs is None:        # 5 % of an interpreted head_stats call went to this scan, once per helper call
            langs = langs_seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                               if inspect.ismodule(v) and v.__name__.startswith("triton.language"))
        return langs

    def patch_once(fn):
        langs = langs_of(fn)
        if langs and all(patched.get(lang) for lang in langs):
            return interpreter._LangPatchScope()     # inside a launch that patched them: nothing to do
        scope = patch_lang(fn)
        restore = scope.restore

        def restore_and_forget() -> None:
            restore()
            for lang in langs:
                patched[lang] -= 1
        for lang in langs:
            patched[lang] = patched.get(lang, 0) + 1
        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()

try:
    from xdist.scheduler import LoadScopeScheduling  # noqa: E402
except ImportError:                  # without pytest-xdist (the dev extra) the suite runs in one process
    LoadScopeScheduling = None

from fastdiag.grokking.config import RunConfig  # noqa: E402
from fastdiag.core.monitor import _MONITORS  # noqa: E402
from fastdiag.grokking.train import train_run  # noqa: E402

# A configuration small enough for CI that still shows the phenomenon: a 2-layer, 4-head, width-64
# transformer on a + b mod 31 with 70 % of the pairs for training, lr 3e-3, batch 128 (6 steps per
# epoch). Seed 0 at λ = 1 memorises at epoch ~50 and groks at 100 (stopping 20 epochs later); at λ = 0
# it memorises by epoch 30 and is still far from generalising at the 160-epoch horizon (test accuracy
# 0.64 from epoch 130 on, 0.47-0.65 to epoch 300: measured). Seed and λ are left to each run.
SMALL_GROK = dict(arch="transformer", preset="custom", n_layers=2, n_heads=4, d_model=64, d_ff=256, op="+",
                  p=31, train_frac=0.7, lr=3e-3, batch_size=128, epochs=160, eval_every=10, patience=20,
                  device="cpu")


# ---------------------------------------------------------------- one build per expensive fixture
# `make test` runs the suite on pytest-xdist workers (`-n auto --dist loadgroup`), test by test, except
# that the tests sharing one of this suite's session-scoped fixtures (a trained run, …) go to one worker
# as one unit, and so do the tests of a module with a module-scoped fixture: such a fixture is then
# built once, not once per worker. Only the workers know which fixtures a test uses (the controller
# collects nothing), so each worker writes its units to a folder the controller named, and the
# controller's scheduler reads them; it sends the units holding a `slow` test first. (xdist's own
# loadgroup reads `xdist_group` marks from node ids that pytest 9 no longer lets a plugin change; the
# marks are honoured here instead.)


UNITS_DIR = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller: tell each worker where to write its units."""
    if UNITS_DIR not in node.config.stash:
        node.config.stash[UNITS_DIR] = tempfile.mkdtemp(prefix="fastdiag-xdist-units-")
    node.workerinput["fastdiag_units_dir"] = node.config.stash[UNITS_DIR]


def pytest_collection_modifyitems(config, items):
    """Worker: write {node id: unit} for the tests that must share a worker."""
    units_dir = getattr(config, "workerinput", {}).get("fastdiag_units_dir")
    if units_dir is None:
        return
    units = {item.nodeid: unit for item in items if (unit := _shared_unit(item)) is not None}
    slow = [units.get(item.nodeid, item.nodeid) for item in items if item.get_closest_marker("slow")]
    path = Path(units_dir) / f"{config.workerinput['workerid']}.json"
    path.with_suffix(".tmp").write_text(json.dumps({"units": units, "slow": slow}))
    path.with_suffix(".tmp").replace(path)             # whole, before this worker reports its collection


def _shared_unit(item) -> str | None:
    for mark in item.iter_markers("xdist_group"):
        return "group:" + str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    info = getattr(item, "_fixtureinfo", None)
    for name in info.names_closure if info is not None else ():
        defs = info.name2fixturedefs.get(name)
        if not defs or not _suite_fixture(defs[-1], item.config.rootpath):
            continue
        if defs[-1].scope == "session":
            return "session:" + name
        if defs[-1].scope in ("package", "module"):
            return "module:" + item.nodeid.split("::")[0]
    return None


def _suite_fixture(fixturedef, rootpath: Path) -> bool:
    """A fixture of this suite (its conftests and modules), not one of pytest's or a plugin's
    (tmp_path_factory, …), which are cheap and live in the installed packages."""
    source = Path(fixturedef.func.__code__.co_filename).resolve()
    return rootpath.resolve() in source.parents and "site-packages" not in source.parts


if LoadScopeScheduling is not None:
    class SharedFixtureScheduling(LoadScopeScheduling):
        """xdist's scheduling by scope (a scope is a unit of work sent to one worker), with a test's
        scope its shared-fixture unit, else the test itself. The units holding a ``slow`` test are sent
        first (then xdist's order: the units of most tests first), so that the suite does not end with
        one worker on a long end-to-end test while the other has nothing left to do."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._units: dict[str, str] | None = None
            self._slow: set[str] = set()

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:           # every worker has collected (and written) by now
                self._units = {}
                for path in Path(self.config.stash[UNITS_DIR]).glob("*.json"):
                    written = json.loads(path.read_text())
                    self._units.update(written["units"])
                    self._slow.update(written["slow"])
            return self._units.get(nodeid, nodeid)

        def _assign_work_unit(self, node) -> None:
            if self._slow:
                first = next((scope for scope in self.workqueue if scope in self._slow), None)
                if first is None:
                    self._slow.clear()        # all sent
                else:
                    self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup" and UNITS_DIR in config.stash:
        return SharedFixtureScheduling(config, log)
    return None


def pytest_unconfigure(config):
    if UNITS_DIR in config.stash:
        shutil.rmtree(config.stash[UNITS_DIR], ignore_errors=True)


@pytest.fixture(autouse=True)
def detach_everything():
    """A failing test must not leave a monitor attached (SDPA patched) for the tests after it."""
    yield
    for monitor in list(_MONITORS.values()):
        monitor.detach()


@pytest.fixture
def one_thread():
    """Training tests run one torch thread: on a shared 2-core machine two threads per process
    slow tiny models down several times."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def small_grok_runs():
    """Two real single runs of `SMALL_GROK`, seed 0, [λ = 1 (groks), λ = 0 (memorises)], trained once per
    session at one thread (about a minute) and shared by the tests that need a trained run."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [train_run(RunConfig(seed=0, weight_decay=wd, **SMALL_GROK)) for wd in (1.0, 0.0)]
    finally:
        torch.set_num_threads(previous)


# ---------------------------------------------------------------- progress with an estimate
# `make test` prints, besides pytest's dots, a line every PROGRESS_EVERY finished tests (and at most a
# minute apart while tests finish): done/total, elapsed, and an estimate of the rest from the pace so
# far (rough: the slow end-to-end tests are spread over the run). A run of fewer than PROGRESS_FROM
# tests (one file, `-k`) prints nothing extra.
PROGRESS_EVERY, PROGRESS_FROM, PROGRESS_SECONDS = 100, 200, 60.0


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class SuiteProgress:
    def __init__(self, config) -> None:
        self.config = config
        self.total = 0
        self.done = 0
        self.started = time.perf_counter()
        self.last_line = (0, self.started)

    def count(self, n: int) -> None:
        self.total = max(self.total, n)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session) -> None:
        self.count(len(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self.count(len(ids))               # the controller: every worker collects the whole suite

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "teardown":
            return
        self.done += 1
        now = time.perf_counter()
        if self.total < PROGRESS_FROM or self.done >= self.total:
            return
        if self.done - self.last_line[0] < PROGRESS_EVERY and now - self.last_line[1] < PROGRESS_SECONDS:
            return
        self.last_line = (self.done, now)
        elapsed = now - self.started
        left = elapsed * (self.total - self.done) / self.done
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            if reporter._tw.width_of_current_line:          # after a row of dots
                reporter.write("\n")
            reporter.write_line(f"[{self.done}/{self.total} tests, {_minutes(elapsed)} elapsed, "
                                f"about {_minutes(left)} left at this pace]")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):            # the controller (or a run without workers) only
        config.pluginmanager.register(SuiteProgress(config), "fastdiag-suite-progress")
