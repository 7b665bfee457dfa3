#!/usr/bin/env bash
# One device run for the Gated DeltaNet forward: GPU tests (stage 1 against the reference's
# chunk factors first, then end to end), compute-sanitizer memcheck on a small case,
# benchmark. Logs under $OUT (the device tool returns at most 8 files); every step under
# `timeout` so a hung kernel costs that step only.
#   run: source .gpuhost/prelude.sh && bash bench/device_gdn.sh   (carry .gpuhost, .artifacts)
set -o pipefail
export PRECAST_CACHE_DIR=${PRECAST_CACHE_DIR:-$PWD/.artifacts/cache}
OUT=${OUT:-/tmp/precast-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gdn.log"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rf -x -p no:cacheprovider \
  tests/test_gdn_stages_gpu.py tests/test_gdn_fwd_gpu.py ${PYTEST_ARGS:-} \
  > "$OUT/pytest_gdn.log" 2>&1
echo "pytest exit code: $?" | tee -a "$OUT/gdn.log"
grep -E "(passed|failed)" "$OUT/pytest_gdn.log" | tail -1 | tee -a "$OUT/gdn.log"
if [ -z "${SKIP_SANITIZER:-}" ]; then
  timeout "${SANITIZER_TIMEOUT:-120}" compute-sanitizer --tool memcheck --error-exitcode 3 \
    --report-api-errors no python3 tests/gpu_sanitize_gdn.py 2>&1 | tail -40 > "$OUT/sanitize_gdn.log"
  echo "compute-sanitizer memcheck exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/gdn.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-240}" python3 bench/bench_gdn.py ${BENCH_ARGS:-} 2>/tmp/bench_gdn_stderr.log \
    | tee -a "$OUT/gdn.log"
fi
