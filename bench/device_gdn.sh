#!/usr/bin/env bash
# One device run for the Gated DeltaNet forward and backward: GPU tests (stage 1 against the
# reference's chunk factors first, then the forward end to end, then the backward),
# compute-sanitizer memcheck on small forward and backward cases and racecheck on the
# backward, benchmarks. Logs under $OUT (the device tool returns at most 8 files); every
# step under `timeout` so a hung kernel costs that step only.
#   run: source .gpuhost/prelude.sh && bash bench/device_gdn.sh   (carry .gpuhost, .artifacts)
# RACECHECK_BATCHES=ragged: the backward racecheck on the small batch only (both batches take
# ~5 minutes; give them SANITIZER_TIMEOUT=300); SKIP_SANITIZER / SKIP_BENCH skip those steps.
set -o pipefail
export PRECAST_CACHE_DIR=${PRECAST_CACHE_DIR:-$PWD/.artifacts/cache}
OUT=${OUT:-/tmp/precast-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gdn.log"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -rf -p no:cacheprovider \
  tests/test_gdn_stages_gpu.py tests/test_gdn_fwd_gpu.py tests/test_gdn_bwd_gpu.py \
  ${PYTEST_ARGS:-} > "$OUT/pytest_gdn.log" 2>&1
echo "pytest exit code: $?" | tee -a "$OUT/gdn.log"
grep -E "(passed|failed)" "$OUT/pytest_gdn.log" | tail -1 | tee -a "$OUT/gdn.log"
if [ -z "${SKIP_SANITIZER:-}" ]; then
  for script in gpu_sanitize_gdn gpu_sanitize_gdn_bwd; do
    timeout "${SANITIZER_TIMEOUT:-120}" compute-sanitizer --tool memcheck --error-exitcode 3 \
      --report-api-errors no python3 tests/$script.py 2>&1 | tail -20 >> "$OUT/sanitize_gdn.log"
    echo "memcheck $script exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/gdn.log"
  done
  timeout "${SANITIZER_TIMEOUT:-120}" compute-sanitizer --tool racecheck --error-exitcode 3 \
    python3 tests/gpu_sanitize_gdn_bwd.py ${RACECHECK_BATCHES:-} 2>&1 | tail -20 >> "$OUT/sanitize_gdn.log"
  echo "racecheck gpu_sanitize_gdn_bwd exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/gdn.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-240}" python3 bench/bench_gdn.py ${BENCH_ARGS:-} 2>/tmp/bench_gdn_stderr.log \
    | tee -a "$OUT/gdn.log"
  timeout "${BENCH_TIMEOUT:-420}" python3 bench/bench_gdn_bwd.py --stages ${BENCH_BWD_ARGS:-} \
    2>/tmp/bench_gdn_bwd_stderr.log | tee -a "$OUT/gdn.log"
  tail -5 /tmp/bench_gdn_bwd_stderr.log >> "$OUT/gdn.log"
fi
