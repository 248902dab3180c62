"""ART in a decode loop on a captured layer: each decode step's call is told the longest walk of the step before.

The decode benchmark (:mod:`kernels.bench`) times every shape on fixed inputs, and its ``art_calibrated`` rows take
the longest walk of an earlier call on the *same* inputs.  A decode loop has only its previous step's.  This
benchmark replays a captured layer's decode steps in order (:func:`kernels.bench.tiled_capture` with ``step``:
batch row ``b`` walks captured sequence ``b % B0`` tiled to the length, with that sequence's query of the step; the
cache is the same ``seqlen`` tokens at every step, where the model's step ``t`` attended to ``C + t + 1``, so at
``seqlen = C`` the step's newest ``t + 1`` tokens are left out) and times, at every step, four calls on the same
inputs:

* ``art_dense``: ``art=None`` at its defaults;
* ``art``: the thresholds at the default split rule (no hint);
* ``art_previous_step``: ``longest_stop_steps`` from a :class:`kernels.walk_hint.LongestWalkHint` that recorded
  the previous step's ``art_previous_step`` call (none at the first step): what a decode loop gets;
* ``art_calibrated``: ``longest_stop_steps`` from a single-split call on this step's inputs (the best the hint
  can do).

Each row keeps the step's split count and loaded fraction; the summary per length adds the steps up (the layer's
attention time over the loop) and counts the steps whose previous-step hint chose the calibrated split count.
Times are CUDA-graph medians in interleaved rounds, each call after an L2 emptied by a read (:func:`kernels.bench.time_interleaved`).

``run(out_dir, capture, art=...)`` writes ``<out_dir>/<date>-art-decode-loop.json``.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import platform
from pathlib import Path

import torch
import triton

from .art_decode import art_decode
from .art_params import ARTParams
from .bench import ROUNDS, decode_query_shape, default_follow_step, loaded_fraction, tiled_capture, time_interleaved
from .results_io import input_file_record, write_json_atomic
from .walk_hint import LongestWalkHint

LOOP_BATCH = 32
LOOP_LENGTHS = (8192, 32768)
IMPLS = ("art_dense", "art", "art_previous_step", "art_calibrated")


def decode_loop(path: str | os.PathLike, batch: int, seqlen: int, *, art: ARTParams, rep_ms: int,
                device: torch.device, rounds: int = ROUNDS) -> list[dict]:
    """One row per (decode step, implementation) of the captured layer at ``path`` tiled to ``seqlen`` tokens for
    ``batch`` rows: ``step``, ``impl``, the timing of :func:`kernels.bench.time_interleaved` (``ms``, ...),
    ``num_splits``, ``follow_step`` and ``loaded_fraction`` (ART rows), and ``longest_stop_steps`` (the hint passed,
    or None)."""
    hint = LongestWalkHint()
    rows = []
    for step in range(decode_query_shape(path)[2]):
        q, k, v = tiled_capture(path, batch, seqlen, device, step=step)
        _, single = art_decode(q, k, v, art=art, num_splits=1, return_stats=True)
        hints = {"art": None, "art_previous_step": hint.steps, "art_calibrated": int(single[..., 0].max())}
        calls = {"art_dense": lambda: art_decode(q, k, v)}
        calls.update({impl: (lambda given=given: art_decode(q, k, v, art=art, longest_stop_steps=given))
                      for impl, given in hints.items()})
        timings = time_interleaved(calls, rep_ms, rounds, device)
        for impl in IMPLS:
            row = {"step": step, "impl": impl, **timings[impl]}
            if impl in hints:
                _, steps = art_decode(q, k, v, art=art, longest_stop_steps=hints[impl], return_stats=True,
                                      walk_hint=hint if impl == "art_previous_step" else None)
                row.update(longest_stop_steps=hints[impl], num_splits=steps.shape[-1],
                           follow_step=default_follow_step(q, k, art, hints[impl]),
                           loaded_fraction=loaded_fraction(steps, seqlen))
            rows.append(row)
    return rows


def loop_summary(rows: list[dict]) -> dict:
    """Per implementation, the sum of its steps' ``ms`` (``total_ms``), each ART total over ``art_dense``'s
    (``default_over_dense``, ``previous_step_over_dense``, ``calibrated_over_dense``), and the steps whose
    previous-step hint took the calibrated split count (``previous_step_same_splits`` of ``steps``)."""
    totals = {impl: sum(r["ms"] for r in rows if r["impl"] == impl) for impl in IMPLS}
    splits = {(r["step"], r["impl"]): r["num_splits"] for r in rows if "num_splits" in r}
    steps = sorted({r["step"] for r in rows})
    return {"total_ms": totals,
            "default_over_dense": totals["art"] / totals["art_dense"],
            "previous_step_over_dense": totals["art_previous_step"] / totals["art_dense"],
            "calibrated_over_dense": totals["art_calibrated"] / totals["art_dense"],
            "previous_step_same_splits": sum(splits[(s, "art_previous_step")] == splits[(s, "art_calibrated")]
                                             for s in steps),
            "steps": len(steps)}


def run(out_dir: str | os.PathLike, capture: str | os.PathLike, *, art: ARTParams, quick: bool = False) -> dict:
    """Run the decode loop on ``capture`` (a captured layer's safetensors ``k, v, decode_q``) at ``LOOP_BATCH``
    rows and each of ``LOOP_LENGTHS`` (``quick``: the first length, one round) and write
    ``<out_dir>/<date>-art-decode-loop.json``; returns the payload."""
    if not torch.cuda.is_available():
        raise RuntimeError("the decode-loop benchmark needs a CUDA device")
    if not isinstance(art, ARTParams):
        raise TypeError(f"art must be an ARTParams, got {type(art).__name__}")
    if not Path(capture).is_file():
        raise FileNotFoundError(f"the captured layer {capture} is not a file")
    device = torch.device("cuda")
    lengths, rounds = (LOOP_LENGTHS[:1], 1) if quick else (LOOP_LENGTHS, ROUNDS)
    payload = {
        "suite": "decode-loop",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "quick": quick,
        "capture": Path(capture).name,
        "capture_file": input_file_record(capture),
        "batch": LOOP_BATCH,
        "art": dataclasses.asdict(art),
        "l2_flush": "read",
    }
    path = Path(out_dir) / f"{datetime.date.today().isoformat()}-art-decode-loop.json"
    loops = []
    for seqlen in lengths:
        rows = decode_loop(capture, LOOP_BATCH, seqlen, art=art, rep_ms=50 if quick else 100, device=device,
                           rounds=rounds)
        loops.append({"seqlen": seqlen, "rows": rows, "summary": loop_summary(rows)})
        torch.cuda.empty_cache()
        write_json_atomic(path, {**payload, "loops": loops, "complete": False})
    payload.update(loops=loops, complete=True,
                   summary={str(loop["seqlen"]): loop["summary"] for loop in loops})
    write_json_atomic(path, payload)
    return payload
