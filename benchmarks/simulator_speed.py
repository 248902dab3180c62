"""Time and peak memory of the exact-mode simulator on a long cache (CPU).

Case: B=1, Hq=32, Hkv=8, S=131072, D=128, block 64 (bf16 cache), exact mode.
Writes ``benchmarks/results/<date>-simulator-cpu.json``.

    python benchmarks/simulator_speed.py [--seqlen 131072] [--repeats 3]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import torch

from art_analysis.blockwise import blockwise_attention
from art_analysis.synthetic import synthetic_cache
from kernels.results_io import write_json_atomic
from art_analysis.termination import ARTConfig, stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", default="exact", choices=("exact", "kernel"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                        help="folder for <date>-simulator-cpu.json (default: benchmarks/results)")
    args = parser.parse_args()
    for option, value in (("--seqlen", args.seqlen), ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} is not a folder")

    cache = synthetic_cache(1, 32, 8, args.seqlen, 128, preset="realistic", dtype=torch.bfloat16)
    rss_before = _rss_mib("VmRSS")
    _reset_peak_rss()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64, mode=args.mode)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    result = stop(trace, ARTConfig())
    stop_time = time.perf_counter() - start
    peak_mib = _rss_mib("VmHWM")
    row = dict(date=datetime.date.today().isoformat(), host=platform.node(), cpu_count=os.cpu_count(),
               torch=torch.__version__, torch_threads=torch.get_num_threads(), mode=args.mode,
               shape=dict(B=1, Hq=32, Hkv=8, S=args.seqlen, D=128, block_size=64, dtype="bfloat16"),
               seconds=times, median_seconds=sorted(times)[len(times) // 2], stop_seconds=stop_time,
               peak_rss_mib=peak_mib, rss_with_cache_mib=rss_before, peak_above_cache_mib=peak_mib - rss_before,
               mean_loaded_fraction=float(result.loaded_fraction.mean()))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{row['date']}-simulator-cpu.json"
    write_json_atomic(path, row)
    print(f"{args.mode} mode, S={args.seqlen}: median {row['median_seconds']:.2f} s over {args.repeats} runs, "
          f"stop() {stop_time:.3f} s, peak RSS {peak_mib:.0f} MiB (process with the cache loaded: "
          f"{rss_before:.0f} MiB) -> {path}")


def _rss_mib(field: str) -> float:
    """A memory field of /proc/self/status (``VmRSS``, ``VmHWM``) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak_rss() -> None:
    """Reset the peak RSS (VmHWM) so that it measures the simulation, not the cache generation."""
    Path("/proc/self/clear_refs").write_text("5")


if __name__ == "__main__":
    main()
