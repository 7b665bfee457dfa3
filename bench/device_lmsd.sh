#!/usr/bin/env bash
# One device run for LMSD: GPU tests, compute-sanitizer memcheck, benchmark. Logs under $OUT.
#   run: source .gpuhost/prelude.sh && bash bench/device_lmsd.sh   (carry .gpuhost and .artifacts)
set -o pipefail
export PRECAST_CACHE_DIR=${PRECAST_CACHE_DIR:-$PWD/.artifacts/cache}
OUT=${OUT:-/tmp/precast-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -m precast info | tail -2
python3 -m pytest -q -rf -p no:cacheprovider tests/test_lmsd_gpu.py tests/test_reference_lmsd.py \
  ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -30
if [ -z "${SKIP_SANITIZER:-}" ]; then
  compute-sanitizer --tool memcheck --report-api-errors no python3 tests/gpu_sanitize_lmsd.py 2>&1 | tee "$OUT/memcheck.log" | tail -6
fi
python3 bench/bench_lmsd.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
python3 -m precast quickstart 2>&1 | tee "$OUT/quickstart.log" | tail -12
