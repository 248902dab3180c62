"""The fluid walk model (``kernels.walk_model``) for the single-split ART rows of a decode run that did not record
its walks.  Each row's walks are replayed on the CPU by the simulator (kernel mode, bf16 inputs as on the GPU), the
replay is compared with the row's recorded leader steps (mean and longest walk), and the model is evaluated at the
run's lone step and the row's dense throughput.  Also reported: the lone step at which the model would meet the
row's time bound.

    python benchmarks/art_decode_walk_model.py benchmarks/results/2026-12-01-art-decode.json \\
        --capture .carry/smollm2_layer15_ctx8192.safetensors \\
        --out benchmarks/results/2026-12-01-art-decode-walk-model.json

(the capture: see ``scripts/gpu_decode.sh``).  Rows of the capture are skipped without it.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from art_analysis.cli.output_paths import check_output_file  # noqa: E402
from art_analysis.synthetic import synthetic_cache  # noqa: E402
from art_analysis.termination import ARTConfig, replay_kernel_walks  # noqa: E402
from kernels.bench import distinct_inputs, steps_histogram, walk_model_ms  # noqa: E402
from kernels.results_io import read_result, write_json_atomic  # noqa: E402

CPU = torch.device("cpu")


def needed_step_us(walks: list[int], lone: dict, row: dict, bandwidth: float, sms: int) -> float | None:
    """The slowest lone step (us) at which the model meets the row's time bound (bisection to 1e-4 us), None if
    no step does (the bandwidth and the fixed time alone exceed it).  bf16 blocks, as in the run."""

    def time_ms(step_us: float) -> float:
        return walk_model_ms(walks, {**lone, "step_us": step_us}, row["head_dim"], 2, bandwidth, sms)

    low, high = 1e-4, 100.0
    if time_ms(low) > row["time_bound_ms"]:
        return None
    while high - low > 1e-4:
        mid = (low + high) / 2
        low, high = (mid, high) if time_ms(mid) <= row["time_bound_ms"] else (low, mid)
    return low


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a decode benchmark JSON (kernels.bench)")
    parser.add_argument("--capture", type=Path, default=None, help="the captured layer the run benchmarked")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        run = read_result(args.run, ("suite",), what="decode benchmark run")
        check_output_file(args.out, "--out")
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if run["suite"] != "decode":
        parser.error(f"{args.run} is a result of the suite {run['suite']!r}, not 'decode'")
    lacking = [key for key in ("art", "rows", "lone_walk") if key not in run]
    if lacking:
        parser.error(f"{args.run} lacks {', '.join(lacking)}: the walk model needs a decode run of 2026-12-01 or "
                     "later, which times the lone walk")
    if args.capture is not None and not args.capture.is_file():
        parser.error(f"--capture {str(args.capture)!r} is not a file")
    config = ARTConfig(**{name: run["art"][name] for name in ("tau", "phi", "patience", "min_steps", "probe_source",
                                                             "probe_dims", "scale", "use_scale", "use_direction")})
    rows = {(r["data"], r["batch"], r["seqlen"], r["impl"]): r for r in run["rows"]}
    targets = [r for r in run["rows"] if r["impl"] in ("art", "art_calibrated") and r.get("num_splits") == 1
               and "time_bound_ms" in r]
    replays, results = {}, []
    for row in tqdm(targets, desc="walk model"):
        key = (row["data"], row["seqlen"])
        if key not in replays:
            replayable = row["data"] == "synthetic" or args.capture is not None
            replays[key] = replay_kernel_walks(*distinct_inputs(row["data"], row["seqlen"], CPU, synthetic_cache,
                                                                args.capture), config) if replayable else None
        if replays[key] is None:
            continue
        distinct = replays[key]
        walks_by_pair = distinct[torch.arange(row["batch"]) % distinct.shape[0]]         # [B, Hkv], launch order
        walks = walks_by_pair.flatten().tolist()
        dense = rows[(row["data"], row["batch"], row["seqlen"], "art_dense")]
        nbytes = 2 * row["batch"] * row["kv_heads"] * row["seqlen"] * row["head_dim"] * 2
        bandwidth = nbytes / dense["ms"] / 1e9
        lone = run["lone_walk"][row["data"]]
        model_ms = walk_model_ms(walks, lone, row["head_dim"], 2, bandwidth, run["sm_count"])
        results.append({
            "data": row["data"], "batch": row["batch"], "seqlen": row["seqlen"], "impl": row["impl"],
            "replay_steps_mean": sum(walks) / len(walks), "replay_steps_max": max(walks),
            "run_steps_mean": row["leader_steps_mean"], "run_steps_max": row["leader_steps_max"],
            "walk_steps_histogram": steps_histogram(walks),
            "ms": row["ms"], "time_bound_ms": row["time_bound_ms"], "meets_time_bound": row["meets_time_bound"],
            "model_ms": model_ms, "ms_over_model": row["ms"] / model_ms,
            "model_meets_time_bound": model_ms <= row["time_bound_ms"],
            "step_us": lone["step_us"], "step_us_for_the_bound": needed_step_us(walks, lone, row, bandwidth,
                                                                                 run["sm_count"])})
    payload = {"suite": "decode-walk-model", "run": args.run.name,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "model": "kernels.walk_model.shared_bandwidth_ms", "rows": results}
    write_json_atomic(args.out, payload, indent=1)
    for r in results:
        print(f"{r['data'][:9]:9} {r['batch']:4} x {r['seqlen'] // 1024:3}k {r['impl']:14} ms {r['ms']:.4f} "
              f"bound {r['time_bound_ms']:.4f} model {r['model_ms']:.4f} ({r['ms_over_model']:.2f}x) "
              f"step for the bound {r['step_us_for_the_bound'] or float('nan'):.2f} us | walks mean / max: replay "
              f"{r['replay_steps_mean']:.1f} / {r['replay_steps_max']}, "
              f"run {r['run_steps_mean']:.1f} / {r['run_steps_max']}")
    return payload


if __name__ == "__main__":
    main()
