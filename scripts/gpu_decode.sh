#!/usr/bin/env bash
# The ART decode kernel on one CUDA GPU, in one call: the bf16 tests at real sizes and the default builds' step
# schedule (pytest -m gpu), compute-sanitizer memcheck on a representative run (paged and contiguous, ragged, ART
# with splits), then the benchmark (JSON + figure).  Output goes to $OUT when set (the device runner), else to
# benchmarks/results and figures.  QUICK=1 runs the short benchmark; SKIP_TESTS=1 skips the tests
# and memcheck; SKIP_BENCH=1 stops after them; TESTS_K=<pytest -k expression> runs only the GPU tests it selects
# (TESTS_K='per_pair or on_the_gpu' SKIP_BENCH=1: those tests and memcheck, a short call); TOLD_WAVE=1 runs the
# told-wave suite (kernels/bench_told_wave.py: the told wave's arms and its rule's refit) in place of the decode
# benchmark.  The captured layer
# $CAPTURE (default .carry/smollm2_layer15_ctx8192.safetensors: k, v, decode_q) is benchmarked when present (send it
# with the device runner's carry).  A capture folder stored in float16 holds such files, one per layer; make one on
# the CPU with
#   art-analysis capture --context 8192 --decode-steps 8 --source stdlib --dtype float16 --out captures/smollm2-8k
#   cp captures/smollm2-8k/layer_015.safetensors .carry/smollm2_layer15_ctx8192.safetensors
# A capture of several sequences (add --seed 1 --batch 8) gives each batch row of the tiled layer its own
# sequence (kernels.bench.tiled_capture). Such a layer (48 MiB; 40 MiB packed) travels packed:
#   python scripts/pack_capture_layer.py pack captures/smollm2-8k/layer_015.safetensors .carry/layer15.xz
# and on the GPU machine, before this script:
#   python3 scripts/pack_capture_layer.py unpack .carry/layer15.xz .carry/smollm2_layer15_ctx8192.safetensors
# The run ends with `art-analysis bench-compare` of its result against the newest complete committed run measured on
# the same device (none: the comparison says so). A run cut short
# (the JSON says "complete": false) is finished by a second call with RESUME_FROM=<that JSON> (bench --resume).
# The JSON names the commit it measured (``source``): ART_SOURCE_COMMIT where set (on a copy of the tree, whose own
# git history may not be the tree's: ART_SOURCE_COMMIT=$(git rev-parse HEAD) where the copy is made), else git's.
set -uo pipefail
out_dir="${OUT:-benchmarks/results}"
figure="${OUT:-figures}/kernel_speed.png"
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    | tee "$out_dir/decode_gpu_state.txt"
select=()
[ -n "${TESTS_K:-}" ] && select=(-k "$TESTS_K")
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    python3 -m pytest -q -m gpu -s "${select[@]}" tests/test_art_decode.py tests/test_art_decode_errors.py \
        tests/test_walk_hint.py tests/test_kernel_attention.py tests/test_art_wave.py \
        tests/test_art_decode_compiles.py 2>&1 | tee "$out_dir/decode_gpu_tests.log"
fi
memcheck_run='
import torch
from kernels.art_decode import art_decode
from kernels.art_params import ARTParams
torch.manual_seed(0)
q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16)
pages = torch.randn(2, 200, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
table = torch.randperm(200, device="cuda", dtype=torch.int32)[:150].view(3, 50)
lengths = torch.tensor([1, 799, 513], device="cuda", dtype=torch.int32)
table64 = torch.randperm(50, device="cuda", dtype=torch.int32)[:39].view(3, 13)
kv = torch.randn(2, 3, 8, 799, 128, device="cuda", dtype=torch.bfloat16)
for art in (None, ARTParams(tau=1e-3, phi=1e-4, patience=2)):
    for splits in (1, 4):
        out = art_decode(q, pages[0], pages[1], cache_seqlens=lengths, block_table=table, art=art, num_splits=splits)
        # pages of 64 tokens: whole 64-token blocks per page, one page-table entry per block
        out = art_decode(q, pages[0].view(50, 64, 8, 128), pages[1].view(50, 64, 8, 128), cache_seqlens=lengths,
                         block_table=table64, art=art, num_splits=splits, block_size=64)
        # contiguous 64-token blocks: descriptors made in the kernel (one split), pointer loads (leader scheme)
        out = art_decode(q, kv[0], kv[1], cache_seqlens=lengths, art=art, num_splits=splits, block_size=64)
        # uniform lengths: one scalar length, descriptors made on the host and bounded at the length
        out = art_decode(q, kv[0], kv[1], cache_seqlens=torch.full_like(lengths, 513), art=art, num_splits=splits,
                         block_size=64)
# deferred followers: released at step 3 of the leader (ragged, pointer loads) or waiting for a leader that stops;
# the combine records the splits it kept (result steps)
for follow in (3, 40):
    out, taken = art_decode(q, kv[0], kv[1], cache_seqlens=lengths, art=ARTParams(tau=1e-3, phi=1e-4, patience=2),
                            num_splits=4, follow_step=follow, block_size=64, return_result_steps=True)
# per-pair splits (the plan forced: small shapes take several splits anyway): pairs told they walk long take 4
# splits at once, the others walk alone with empty followers (ragged and uniform lengths, 128- and 64-dim tiles)
import kernels.art_decode as launcher
from kernels.pair_walks import PairWalks
launcher.choose_pair_splits = lambda *args: (4, 3)
expected = torch.tensor([[1, 9, 2, 5, 3, 13, 1, 4]] * 3, device="cuda")
for lengths_now in (lengths, torch.full_like(lengths, 799)):
    out = art_decode(q, kv[0], kv[1], cache_seqlens=lengths_now, art=ARTParams(tau=1e-3, phi=1e-4, patience=2),
                     pair_walks=PairWalks.from_walks(expected), block_size=64)
# 64-dim tiles through host descriptors (one warp), and the default split count; the dense plan (two warps)
q64 = torch.randn(3, 9, 64, device="cuda", dtype=torch.bfloat16)
kv64 = torch.randn(2, 3, 3, 799, 64, device="cuda", dtype=torch.bfloat16)
for art in (None, ARTParams(tau=1e-3, phi=1e-4, patience=2)):
    for splits in (1, 4, None):
        out = art_decode(q64, kv64[0], kv64[1], art=art, num_splits=splits, block_size=64)
    out = art_decode(q64, kv64[0], kv64[1], art=art)
out = art_decode(q64, kv64[0], kv64[1], art=ARTParams(tau=1e-3, phi=1e-4, patience=2),
                 pair_walks=PairWalks.from_walks(expected[:, :3]), block_size=64)
# the dense plan on pages of 128 tokens at D = 64: 64-token blocks through page descriptors, ragged
pages64 = torch.randn(2, 24, 128, 3, 64, device="cuda", dtype=torch.bfloat16)
table128 = torch.randperm(24, device="cuda", dtype=torch.int32)[:21].view(3, 7)
out = art_decode(q64, pages64[0], pages64[1], cache_seqlens=lengths, block_table=table128)
# a wave before the walk: ragged with deferred followers after it, paged (pages of 16), uniform 64-dim tiles
loose = ARTParams(tau=1e-3, phi=1e-4, patience=2)
out, taken = art_decode(q, kv[0], kv[1], cache_seqlens=lengths, art=loose, num_splits=4, follow_step=3, block_size=64,
                        wave_steps=5, return_result_steps=True)
out = art_decode(q, pages[0], pages[1], cache_seqlens=lengths, block_table=table, art=loose, wave_steps=8)
out = art_decode(q64, kv64[0], kv64[1], art=loose, num_splits=1, wave_steps=13)
# a wave of more than one step tile (WAVE_STEP_TILE = 128), ragged: the monitor and the finish loop over the tiles
kv_long = torch.randn(2, 2, 3, 150 * 64 + 17, 64, device="cuda", dtype=torch.bfloat16)
out = art_decode(q64[:2], kv_long[0], kv_long[1], cache_seqlens=torch.tensor([150 * 64 + 17, 9000], device="cuda",
                 dtype=torch.int32), art=loose, wave_steps=150)
# on-demand followers: released from the first chunk (or never), ragged at D = 128 and uniform at D = 64
for release in (0, 24):
    out = art_decode(q, kv[0], kv[1], cache_seqlens=lengths, art=ARTParams(tau=1e-3, phi=1e-4, patience=2),
                     num_splits=4, release_walks=release, block_size=64)
    out = art_decode(q64, kv64[0], kv64[1], art=ARTParams(tau=1e-3, phi=1e-4, patience=2), num_splits=4,
                     follow_step=3, release_walks=release, block_size=64)
torch.cuda.synchronize()
print("memcheck run finished", bool(torch.isfinite(out).all()))
'
if [ "${SKIP_TESTS:-0}" = 1 ]; then
    :
elif command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck python3 -c "$memcheck_run" 2>&1 | tail -n 20 | tee "$out_dir/decode_memcheck.log"
else
    echo "compute-sanitizer not found" | tee "$out_dir/decode_memcheck.log"
fi
capture=${CAPTURE:-.carry/smollm2_layer15_ctx8192.safetensors}
extra=()
[ -f "$capture" ] && extra=(--capture "$capture")
[ "${QUICK:-0}" = 1 ] && extra+=(--quick)
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
cli() { python3 -c 'import sys; from art_analysis.cli import main; sys.exit(main())' "$@"; }
if [ "${TOLD_WAVE:-0}" = 1 ]; then
    cli bench --suite told-wave --out "$out_dir" "${extra[@]}" 2>&1 | tee "$out_dir/told_wave.log"
    exit 0
fi
# the committed results, kept aside (a run of the same date without $OUT replaces one): the new run is compared call
# by call at the end with their newest complete run on the same device (decode_compare.log / .json)
baseline_dir=$(mktemp -d)
cp benchmarks/results/*.json "$baseline_dir/" 2>/dev/null
# RESUME_FROM=<an incomplete *-art-decode.json of an earlier call>: its shapes are kept and only the rest are timed
if [ -n "${RESUME_FROM:-}" ]; then
    case "$(basename "$RESUME_FROM")" in
        *-art-decode.json) cp "$RESUME_FROM" "$out_dir/" && extra+=(--resume) ;;
        *) echo "RESUME_FROM=$RESUME_FROM: bench --resume continues a result named <date>-art-decode.json; keep the" \
               "name the earlier call wrote" >&2; exit 2 ;;
    esac
fi
cli bench --suite decode --out "$out_dir" --figure "$figure" "${extra[@]}" 2>&1 | tee "$out_dir/decode_bench.log"
new_result=$(ls "$out_dir"/*-art-decode.json 2>/dev/null | sort | tail -n 1)
if [ -n "$new_result" ]; then
    cli bench-compare "$baseline_dir" "$new_result" --json "$out_dir/decode_compare.json" 2>&1 \
        | tee "$out_dir/decode_compare.log"
fi
