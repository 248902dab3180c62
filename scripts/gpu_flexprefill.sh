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
# the committed results, kept aside (a run of the same date without $OUT replaces one): the new one is compared call
# by call at the end with their newest complete run on the same device (flexprefill_compare.log / .json;
# `art-analysis bench-compare`)
baseline_dir=$(mktemp -d)
cp benchmarks/results/*.json "$baseline_dir/" 2>/dev/null
python3 -m kernels.bench_flexprefill --out "$out_dir" --sweep-configs "${extra[@]}" 2>&1 \
    | tee "$out_dir/flexprefill_bench.log"
new_result=$(ls "$out_dir"/*-flexprefill.json 2>/dev/null | sort | tail -n 1)
if [ -n "$new_result" ]; then
    python3 -c 'import sys; from art_analysis.cli import main; sys.exit(main())' bench-compare \
        "$baseline_dir" "$new_result" --json "$out_dir/flexprefill_compare.json" 2>&1 \
        | tee "$out_dir/flexprefill_compare.log"
fi
