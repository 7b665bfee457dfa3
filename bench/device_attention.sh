#!/usr/bin/env bash
# One device run for HSTU attention forward and backward: GPU tests, compute-sanitizer
# memcheck + racecheck on small cases, benchmarks. Logs under $OUT (few files: the device
# tool returns a limited number). Every step runs under `timeout`, so a hung kernel costs
# that step, not the whole run.
#   run: source .gpuhost/prelude.sh && bash bench/device_attention.sh   (carry .gpuhost, .artifacts
#   and, for the peer column, .peer)
set -o pipefail
export PRECAST_CACHE_DIR=${PRECAST_CACHE_DIR:-$PWD/.artifacts/cache}
export PYTHONPATH="$PWD/.peer${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/precast-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/sanitizers.log"
# -v: the log shows how far a hung run got.
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rf -p no:cacheprovider \
  tests/test_hstu_attention_gpu.py tests/test_hstu_attention_bwd_gpu.py ${PYTEST_ARGS:-} \
  > "$OUT/pytest_attention.log" 2>&1
echo "pytest exit code: $?"
grep -E "(passed|failed)" "$OUT/pytest_attention.log" | tail -1
grep -E "^FAILED" "$OUT/pytest_attention.log" | head -20
if [ -z "${SKIP_SANITIZER:-}" ]; then
  for script in gpu_sanitize_hstu_attention gpu_sanitize_hstu_attention_bwd; do
    for tool in memcheck racecheck; do
      # API errors not reported: torch/cuBLAS probe driver entry points with
      # cuGetProcAddress and count as ~34 "errors"; kernel access errors still do.
      timeout "${SANITIZER_TIMEOUT:-120}" compute-sanitizer --tool $tool --error-exitcode 3 \
        --report-api-errors no \
        python3 tests/$script.py 2>&1 | tail -100 > "$OUT/sanitize_tmp.log"
      echo "compute-sanitizer $tool $script exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/sanitizers.log"
      tail -3 "$OUT/sanitize_tmp.log" | tee -a "$OUT/sanitizers.log"
      rm "$OUT/sanitize_tmp.log"
    done
  done
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  # (stderr: the peer's autotuning warnings)
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/bench_hstu_attention.py ${BENCH_ARGS:-} \
    2>/tmp/bench_stderr.log | tee "$OUT/bench_attention.log"
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/bench_hstu_attention_bwd.py ${BENCH_ARGS:-} \
    2>>/tmp/bench_stderr.log | tee -a "$OUT/bench_attention.log"
fi
