"""`make test`'s scheduling (tests/conftest.py): on pytest-xdist workers, the tests that share one of the
suite's session- or module-scoped fixtures run on one worker, so the fixture is built once, while the
other tests are spread test by test. Checked on a real two-worker pytest run of a small suite that
uses this conftest."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CONFTEST = Path(__file__).with_name("conftest.py")

# Appended to a copy of the suite's conftest: fixtures that note each build, and a note of the worker
# that ran each test.
FIXTURES = '''

import os
from pathlib import Path

import pytest


def _note(kind, text):
    with open(Path(os.environ["NOTES"]) / kind, "a") as fh:
        fh.write(text + "\\n")


@pytest.fixture(scope="session")
def expensive():
    _note("builds", "session " + os.environ.get("PYTEST_XDIST_WORKER", "-"))


@pytest.fixture(autouse=True)
def _worker(request):
    _note("started", request.node.nodeid + " " + os.environ.get("PYTEST_XDIST_WORKER", "-"))
    yield
    _note("ran", request.node.nodeid + " " + os.environ.get("PYTEST_XDIST_WORKER", "-"))
'''

# Two files use the session fixture; a third has a module-scoped one; the rest share nothing (and take
# a moment each, so that both workers get some of them); the last file collected holds a `slow` test.
TESTS = {
    "test_uses_a.py": "def test_a{i}(expensive):\n    pass\n",
    "test_uses_b.py": "def test_b{i}(expensive):\n    pass\n",
    "test_module.py": "def test_m{i}(per_module):\n    pass\n",
    "test_free.py": "def test_f{i}():\n    time.sleep(0.3)\n",
    "test_zz_long.py": "@pytest.mark.slow\ndef test_long{i}():\n    time.sleep(0.3)\n",
}
MODULE_FIXTURE = '''
@pytest.fixture(scope="module")
def per_module():
    _note("builds", "module " + os.environ.get("PYTEST_XDIST_WORKER", "-"))
'''


@pytest.mark.slow
def test_tests_sharing_a_fixture_run_on_one_worker_and_the_rest_spread(tmp_path):
    suite, notes = tmp_path / "suite", tmp_path / "notes"
    suite.mkdir()
    notes.mkdir()
    (suite / "conftest.py").write_text(CONFTEST.read_text(encoding="utf-8") + FIXTURES, encoding="utf-8")
    for name, body in TESTS.items():
        head = "import os\nimport time\nfrom pathlib import Path\n\nimport pytest\n\nfrom conftest import _note\n"
        if name == "test_module.py":
            head += MODULE_FIXTURE
        (suite / name).write_text(head + "\n\n" + "\n\n".join(body.format(i=i) for i in range(1 if "long" in name else 6)))
    # the outer run's xdist variables would tell this run's controller it is a worker
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "--rootdir", str(suite), str(suite)],
                          cwd=suite, env={**env, "NOTES": str(notes)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    builds = (notes / "builds").read_text().split("\n")[:-1]
    assert sorted(b.split()[0] for b in builds) == ["module", "session"], builds      # each built once
    ran = dict(line.rsplit(" ", 1) for line in (notes / "ran").read_text().splitlines())
    assert len(ran) == 25
    workers = {prefix: {w for test, w in ran.items() if test.startswith(f"test_{prefix}")}
               for prefix in ("uses_", "module", "free")}
    assert len(workers["uses_"]) == 1 and len(workers["module"]) == 1, workers
    assert workers["free"] == {"gw0", "gw1"}, workers                               # the rest spread
    # the slow test, collected last, is sent first: it is the first test of its worker
    started = [line.rsplit(" ", 1) for line in (notes / "started").read_text().splitlines()]
    worker = ran["test_zz_long.py::test_long0"]
    assert [test for test, w in started if w == worker][0] == "test_zz_long.py::test_long0", started
