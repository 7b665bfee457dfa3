#!/usr/bin/env bash
# One device run for HSTU attention: GPU tests, compute-sanitizer memcheck + racecheck on a
# small case, benchmark. Logs under $OUT.
#   run: source .gpuhost/prelude.sh && bash bench/device_attention.sh   (carry .gpuhost, .artifacts
#   and, for the peer column, .peer)
set -o pipefail
export PRECAST_CACHE_DIR=${PRECAST_CACHE_DIR:-$PWD/.artifacts/cache}
export PYTHONPATH="$PWD/.peer${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/precast-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -rf -p no:cacheprovider tests/test_hstu_attention_gpu.py ${PYTEST_ARGS:-} 2>&1 \
  | tee "$OUT/pytest_attention.log" | tail -25
if [ -z "${SKIP_SANITIZER:-}" ]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 3 python3 tests/gpu_sanitize_hstu_attention.py 2>&1 \
      | tee "$OUT/$tool.log" | tail -4
    echo "compute-sanitizer $tool exit code: ${PIPESTATUS[0]}"
  done
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 bench/bench_hstu_attention.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_attention.log"
fi
