#!/usr/bin/env bash
# One script for a lent GPU: decisive numbers in at most 8 minutes, nothing downloaded, every stage
# flushing JSON lines to $OUT/results.jsonl as it goes (a stage cut off by its timeout keeps what it
# finished; the next stage still runs).
#
#   OUT=dir benchmarks/gpu_check.sh [--dry-run]
#
# Stages and timeouts (seconds, 475 in all, under the 600-s command limit with room for the start):
#   machine 15 · tests 120 (the device tests, stopped at the fifth failure, one summary line) · kernels 100 (head_stats
#   against a device copy and a read-only pass, bf16/fp32, GPT-2-small and long-context; Q/K pass 1 + 2
#   against the SDPA flash forward) · accuracy 60 (bf16/fp32 against float64 at model size) · attach
#   120 (HF GPT-2-small sdpa and a nanoGPT, every=1 and every=10 against bare, alternated blocks,
#   medians) · int64 40 (last: it may fault) · clocks after 10.
# STAGES="name:seconds ..." replaces the stage list after the tests; besides the four above: tune (Q/K pass 2's
# kernels — per-head and each of its plans (the head pairs at [1, 32, 4096, 128]), batched, 0c79385's — beside the SDPA forward, then head_stats tiles, timed on the device), probe (the SDPA backend chosen, cuDNN's LSE), ncu (Nsight Compute on
# one launch of each fused kernel, report in $OUT/ncu.txt), experiments (benchmarks/gpu_experiments.py, a call
# of its own: STAGES="experiments:400" — the canonical step eager / graphed / bare loop, ensemble packs of
# 1/8/64/256 in runs per hour, the Mamba step with the Triton and the PyTorch scan against a parameter-matched
# transformer).
# --dry-run: the same stages on CPU, tiny shapes, kernels under TRITON_INTERPRET=1 — CI runs it
# (tests/test_gpu_check.py) so the script is proven before any GPU sees it. The dry run runs the
# gpu_stages.py stages in one process (timeout: the sum of theirs), after the experiments stage: a
# Python start-up with torch and Triton costs seconds of CI's CPU, and on CPU no stage can fault a device.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=""
case "${1:-}" in
  --dry-run) DRY="--dry-run" ;;
  "") ;;
  *) echo "gpu_check.sh: unknown argument '$1' (only --dry-run)" >&2; exit 2 ;;
esac
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export OUT PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -n "$DRY" ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
: > "$OUT/results.jsonl"

line() {   # stage, then key=value pairs (values JSON) -> one JSON line in results.jsonl
  local stage=$1; shift
  local body="\"stage\": \"$stage\", \"dry_run\": $([ -n "$DRY" ] && echo true || echo false)"
  for kv in "$@"; do body="$body, \"${kv%%=*}\": ${kv#*=}"; done
  echo "{$body}" | tee -a "$OUT/results.jsonl"
}

clocks() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 10 nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader 2>&1 | head -1
  else
    echo "no nvidia-smi"
  fi
}

echo "== machine"
versions=$(timeout 15 $PY -c "import torch, triton, sys; print(f'python {sys.version.split()[0]} torch {torch.__version__} triton {triton.__version__} cuda {torch.cuda.is_available()} ' + (torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'))" 2>&1 | tail -1)
line machine "versions=\"$versions\"" "clocks_before=\"$(clocks)\"" "date=\"$(date -u +%FT%TZ)\""

echo "== tests (five failures stop them; the summary line is kept)"
TESTS="tests/test_gpu.py tests/test_qk_gpu.py tests/test_attach_gpu.py tests/test_gpu_experiments.py"   # the device tests; the interpreter ones ran in CI
# on the GPU machine (16 cores) pytest-xdist spreads the Triton and inductor compiles over 8 workers
PARALLEL=""
[ -z "$DRY" ] && $PY -c "import xdist" 2>/dev/null && PARALLEL="-n 8"
timeout 120 $PY -m pytest $PARALLEL --maxfail=5 -q -rfE --durations=8 -p no:cacheprovider -o addopts="" $TESTS > "$OUT/tests.txt" 2>&1
tests_rc=$?
summary=$(grep -E "passed|failed|skipped|error" "$OUT/tests.txt" | tail -1 | tr -d '"')
line tests "rc=$tests_rc" "summary=\"${summary:-cut off before a summary (timeout 120 s)}\""

stage_failed() {   # name, limit, rc, its stderr file: a JSON line when the stage was cut off or failed
  [ "$3" = 124 ] && line "$1" "rc=124" "error=\"cut off at $2 s\""
  [ "$3" != 0 ] && [ "$3" != 124 ] && line "$1" "rc=$3" "error=\"$(tail -1 "$4" | tr -d '"\\')\""
}

DEFAULT_STAGES="kernels:100 accuracy:60 attach:120 int64:40"
DRY_STAGES=""; DRY_LIMIT=0
for stage in ${STAGES:-$DEFAULT_STAGES}; do
  name=${stage%%:*}; limit=${stage##*:}
  if [ -n "$DRY" ] && [ "$name" != experiments ]; then   # the dry run's gpu_stages.py stages: one process, below
    DRY_STAGES="$DRY_STAGES $name"; DRY_LIMIT=$((DRY_LIMIT + limit)); continue
  fi
  echo "== $name (timeout $limit s)"
  if [ "$name" = ncu ]; then
    # Nsight Compute on one launch of each fused kernel: speed of light, memory, occupancy, stalls
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    if [ -z "$DRY" ] && [ -n "$NCU" ]; then
      timeout "$limit" "$NCU" --clock-control none --kernel-name regex:'_(head|qk)_stats_kernel|_qk_lse_kernel|_qk_heads_kernel' \
        --launch-count 6 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats --section LaunchStats $PY benchmarks/gpu_stages.py ncu > "$OUT/ncu.txt" 2> "$OUT/ncu.err"
      rc=$?
      # shared-memory wavefronts per instruction kind, to set beside the kernel report's count
      # (benchmarks/predict_measured.py): a separate run, so an unknown metric cannot cost the report above
      timeout "$limit" "$NCU" --clock-control none --kernel-name regex:'_(head|qk)_stats_kernel|_qk_lse_kernel|_qk_heads_kernel' \
        --launch-count 6 --section MemoryWorkloadAnalysis_Tables --metrics \
smsp__sass_inst_executed_op_ldsm.sum,smsp__sass_inst_executed_op_shared_ld.sum,smsp__sass_inst_executed_op_shared_st.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,sm__cycles_active.avg \
        $PY benchmarks/gpu_stages.py ncu > "$OUT/ncu-wavefronts.txt" 2>> "$OUT/ncu.err" || true
    else
      timeout "$limit" $PY benchmarks/gpu_stages.py ncu $DRY 2> "$OUT/ncu.err"
      rc=$?
    fi
  elif [ "$name" = experiments ]; then
    timeout "$limit" $PY benchmarks/gpu_experiments.py $DRY 2> "$OUT/$name.err"
    rc=$?
  else
    timeout "$limit" $PY benchmarks/gpu_stages.py "$name" $DRY 2> "$OUT/$name.err"
    rc=$?
  fi
  stage_failed "$name" "$limit" "$rc" "$OUT/$name.err"
done
if [ -n "$DRY_STAGES" ]; then
  echo "==$DRY_STAGES (one process, timeout $DRY_LIMIT s)"
  timeout "$DRY_LIMIT" $PY benchmarks/gpu_stages.py $DRY_STAGES $DRY 2> "$OUT/stages.err"
  stage_failed stages "$DRY_LIMIT" "$?" "$OUT/stages.err"
fi

line machine "clocks_after=\"$(clocks)\""
failed=$(grep -c '"error"' "$OUT/results.jsonl")
echo "gpu_check: $(wc -l < "$OUT/results.jsonl") result lines in $OUT/results.jsonl, tests rc=$tests_rc, stages with errors: $failed"
[ "$tests_rc" = 0 ] || [ "$tests_rc" = 5 ] || exit 1
[ "$failed" = 0 ]
