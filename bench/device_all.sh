#!/usr/bin/env bash
# The end-of-issue device run: HSTU attention (GPU tests, memcheck, racecheck, benchmark with
# the peer column) and the LMSD GPU tests, in one call (each call costs a cold start).
#   run: source .gpuhost/prelude.sh && bash bench/device_all.sh  (carry .gpuhost .artifacts .peer)
export PRECAST_CACHE_DIR=${PRECAST_CACHE_DIR:-$PWD/.artifacts/cache}
OUT=${OUT:-/tmp/precast-out}; mkdir -p "$OUT"
timeout 180 python3 -m pytest -q -rf -p no:cacheprovider tests/test_lmsd_gpu.py 2>&1 | tee "$OUT/pytest_lmsd.log" | tail -3
timeout 240 python3 -m precast quickstart > "$OUT/quickstart.log" 2>&1; tail -12 "$OUT/quickstart.log"
bash bench/device_attention.sh
