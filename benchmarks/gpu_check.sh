#!/usr/bin/env bash
# One script for a lent GPU (see README "GPU check"): the kernel tests compiled for real (bf16
# included), the no-host-sync checks, the kernel report (the compile-time estimate of each kernel's
# ceiling) and then `fastdiag bench --json` beside it, so the first run shows how far the estimate was
# from the truth. Everything lands under $OUT.
# The GPU image has torch, triton, pytest, hypothesis, click, scipy and matplotlib; nothing is
# downloaded. The package is put on PYTHONPATH as a copy laid out the way setuptools installs it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
SITE=$(mktemp -d)
cp -r fastdiag "$SITE/fastdiag"
cp -r kernels "$SITE/fastdiag/kernels"
cp -r models "$SITE/fastdiag/models"
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}

{
  echo "== machine"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"

echo "== kernel and GPU tests (compiled Triton, bf16 included)"
timeout 240 $PY -m pytest -q -p no:cacheprovider --rootdir=. -c /dev/null -o addopts="" \
  tests/test_head_stats.py tests/test_bad_input.py tests/test_compile.py tests/test_gpu.py tests/test_qk_gpu.py tests/test_kernel_report.py \
  2>&1 | tee "$OUT/tests.txt" | tail -n 25
tests_rc=${PIPESTATUS[0]}

echo "== ensemble step scan (per-member step time against K)"
timeout 90 $PY benchmarks/ensemble_step_scan.py 2>&1 | tee "$OUT/ensemble_scan.txt"

echo "== kernel report (compiled for sm_90: registers, spills, SASS per element, issue-bound ceiling)"
timeout 300 $PY -m fastdiag.cli bench --kernel-report --json "$OUT/kernel_report.json" 2>&1 | tee "$OUT/kernel_report.txt"

echo "== bench (measured: compare %copy with the report's ceiling)"
timeout 360 $PY -m fastdiag.cli bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -n 30
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc bench rc=$bench_rc" | tee "$OUT/status.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
