"""Time a KV capture on the CPU and record its peak memory.

Runs `capture_kv` on the embedded SmolLM2 model (stdlib text, 8192 context tokens, 8 decode
steps, prefill queries of the first, middle and last layer by default) and writes one JSON to
`benchmarks/results/<date>-capture-cpu.json` with: model load time, capture time (prefill +
decode) in wall-clock and in CPU seconds of this process, save time, peak resident memory
during the capture, the machine's CPU count, torch threads and load average (other processes
on the machine slow the wall-clock time down; the CPU seconds are less sensitive to them).

    python benchmarks/capture_speed.py [--context 8192] [--decode-steps 8] [--repeats 1]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import torch

from art_analysis.capture import capture_kv, model_dims
from art_analysis.cli.output_paths import check_output_file
from art_analysis.corpus import long_text
from art_analysis.models import load_model
from kernels.results_io import write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results"


class PeakRSS:
    """Samples this process's resident memory (Linux /proc) in a thread; `peak` in bytes."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.peak = self.current()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="timed captures (the best and all are reported)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/<date>-capture-cpu.json)")
    args = parser.parse_args(argv)
    for option, value in (("--context", args.context), ("--decode-steps", args.decode_steps),
                          ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    try:
        check_output_file(args.out, "--out")
    except ValueError as exc:
        parser.error(str(exc))

    start = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - start
    dims = model_dims(loaded.model)
    prefill_layers = sorted({0, dims["num_layers"] // 2, dims["num_layers"] - 1})
    text = long_text("stdlib", seed=0, length=args.context, tokenizer=loaded.tokenizer)
    capture_kv(loaded, text=text, context_tokens=64, decode_steps=1, progress=False)  # warm-up

    rows = []
    for _ in range(args.repeats):
        load_before = os.getloadavg()
        rss_before = PeakRSS.current()
        with PeakRSS() as rss:
            start, cpu_start = time.perf_counter(), time.process_time()
            capture = capture_kv(loaded, text=text, context_tokens=args.context, decode_steps=args.decode_steps,
                                 prefill_layers=prefill_layers, progress=False)
            capture_s, capture_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            capture.save(Path(tmp) / "capture")
            save_s = time.perf_counter() - start
        rows.append({"capture_s": capture_s, "capture_cpu_s": capture_cpu_s, "save_s": save_s,
                     "peak_rss_gib": rss.peak / 2**30,
                     "rss_before_gib": rss_before / 2**30, "capture_gib": capture.nbytes / 2**30,
                     "loadavg_1min_before": load_before[0], "loadavg_1min_after": os.getloadavg()[0]})
        print(json.dumps(rows[-1]))
        del capture

    import transformers

    payload = {
        "benchmark": "capture_speed",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model, "model_dims": dims, "context_tokens": args.context,
        "decode_steps": args.decode_steps, "prefill_layers": prefill_layers,
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model_load_s": load_s,
        "best_capture_s": min(r["capture_s"] for r in rows),
        "target_capture_s": 40.0,
        "rows": rows,
    }
    out = args.out or RESULTS / f"{datetime.date.today().isoformat()}-capture-cpu.json"
    write_json_atomic(out, payload)
    print(f"model load {load_s:.1f} s; best capture {payload['best_capture_s']:.1f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
