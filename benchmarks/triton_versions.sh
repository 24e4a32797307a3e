#!/usr/bin/env bash
# The kernels under another triton: a throw-away venv (outside the repository) with triton $TRITON
# (default 3.6.0, the GPU image's) beside torch 2.13.0 (a CPU wheel), the repository installed
# --no-deps, then the kernel report (compiled for GPU targets, no GPU needed) and the interpreter
# kernel tests. pyproject's triton bounds name the versions this script has been run with.
#
#   benchmarks/triton_versions.sh [--report-only | --tests-only | --matrix]     (VENV=/tmp/fastdiag-triton36 TRITON=3.6.0)
#
# --matrix: benchmarks/kernel_matrix.py --quick (every generation, the heavy variants) under that triton.
#
# numpy < 2.4: triton 3.6's interpreter fails on `range(..., tl.num_programs(0))` with numpy 2.4
# (its interpreter.py builds the program count as a numpy scalar that numpy 2.4 no longer accepts
# as a range bound); the GPU image's numpy is older, so this pins what the image has.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON=${TRITON:-3.6.0}
VENV=${VENV:-/tmp/fastdiag-triton${TRITON//./}}
MODE=${1:-all}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q "triton==$TRITON" 'numpy<2.4' scipy click matplotlib tqdm pytest hypothesis
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . 2>/dev/null || "$VENV/bin/pip" install -q --no-deps .
fi
"$VENV/bin/python" -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
if [ "$MODE" = "--matrix" ]; then
  exec "$VENV/bin/python" benchmarks/kernel_matrix.py --quick
fi
if [ "$MODE" != "--tests-only" ]; then
  echo "== kernel report (triton $TRITON)"
  "$VENV/bin/python" -m fastdiag.cli bench --kernel-report --json "${REPORT_JSON:-$VENV/kernel_report.json}"
fi
if [ "$MODE" != "--report-only" ]; then
  echo "== interpreter kernel tests (triton $TRITON)"
  TRITON_INTERPRET=1 "$VENV/bin/python" -m pytest -q -x -p no:cacheprovider tests/test_head_stats.py tests/test_qk_stats.py
  "$VENV/bin/python" -m pytest -q -x -p no:cacheprovider tests/test_kernel_report.py
fi
