#!/usr/bin/env bash
# FlexPrefill on one CUDA GPU: the bf16 correctness tests at real sizes (pytest -m gpu), then the
# benchmark.  Logs and the JSON go to $OUT when set (the device runner), else benchmarks/results.
# A captured layer (.carry/smollm2_prefill.safetensors, keys q15/k15/v15) is benchmarked too when present;
# make it with `art-analysis capture --prefill-layers 0,15,29 ...` and then
# `art-analysis flexprefill --capture DIR --export-prefill .carry/smollm2_prefill.safetensors`
# (the run used a 4096-token stdlib context).
# The JSON names the commit it measured (``source``): from git in a checkout; on a copy of the tree without its
# history, from ART_SOURCE_COMMIT (e.g. ART_SOURCE_COMMIT=$(git rev-parse HEAD) where the copy is made).
set -uo pipefail
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu tests/test_block_sparse.py 2>&1 | tee "$out_dir/flexprefill_gpu_tests.log"
capture=.carry/smollm2_prefill.safetensors
extra=()
[ -f "$capture" ] && extra=(--capture "$capture" --capture-layer 15)
python3 -m kernels.bench_flexprefill --out "$out_dir" --sweep-configs "${extra[@]}" 2>&1 | tee "$out_dir/flexprefill_bench.log"
