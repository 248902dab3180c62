"""ART in a decode loop on a captured layer: each decode step's call is told the walks of the step before.

The decode benchmark (:mod:`kernels.bench`) times every shape on fixed inputs, and its ``art_calibrated`` rows take
the longest walk of an earlier call on the *same* inputs.  A decode loop has only its previous step's.  This
benchmark replays a captured layer's decode steps in order (:func:`kernels.bench.tiled_capture` with ``step``:
batch row ``b`` walks captured sequence ``b % B0`` tiled to the length, with that sequence's query of the step; the
cache is the same ``seqlen`` tokens at every step, where the model's step ``t`` attended to ``C + t + 1``, so at
``seqlen = C`` the step's newest ``t + 1`` tokens are left out) and times, at every step, five calls on the same
inputs:

* ``art_dense``: ``art=None`` at its defaults;
* ``art``: the thresholds at the default split rule (no hint);
* ``art_previous_step``: the plan that a :class:`kernels.walk_hint.LongestWalkHint` which recorded the previous
  step's ``art_previous_step`` call gives (:func:`kernels.split_plan.hint_plan`; none at the first step): a wave
  where :func:`kernels.split_plan.told_wave_steps` takes one, else each pair's walk as ``pair_walks``, or on-demand
  followers where those walks are lopsided: what a decode loop gets;
* ``art_calibrated``: ``pair_walks`` from a single-split call on this step's inputs (the best the hint can do);
* ``art_on_demand``: on-demand followers at :func:`kernels.split_plan.on_demand_plan`'s plan for the length (no hint:
  each leader releases its followers once few walks of the launch are left).

Each row keeps the step's split count, per-pair split threshold, loaded fraction and the share of pairs whose
output stopped before the walk's end (against the single walks': what the plan keeps of the rule's stops, which
under on-demand followers depends on when the leaders release); the summary per loop adds the steps up (the
layer's attention time over the loop) and counts the steps whose previous-step hint chose the
calibrated split count.  The loops (``LOOP_CASES``) are B = 32 at 8k and 32k, where the split plan takes several
splits, and B = 128 at 32k, where it takes one and the walks expected to run long take per-pair splits
(:mod:`kernels.pair_walks`).  Times are CUDA-graph medians in interleaved rounds, each call after an L2 emptied by
a read (:func:`kernels.bench.time_interleaved`).

``run(out_dir, capture, art=...)`` writes ``<out_dir>/<date>-art-decode-loop.json``.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
from pathlib import Path

import torch
import triton

from .art_decode import ART_BLOCK_SIZE, art_decode, plan_decode
from .art_params import ARTParams
from .bench import (ROUNDS, checked_run_device, decode_query_shape, loaded_fraction, stopped_share, tiled_capture,
                    time_interleaved)
from .pair_walks import PairWalks
from .results_io import input_file_record, source_revision, write_json_atomic
from .split_plan import hint_plan, on_demand_plan
from .walk_hint import LongestWalkHint

LOOP_CASES = ((32, 8192), (32, 32768), (128, 32768))   # (batch, seqlen)
IMPLS = ("art_dense", "art", "art_previous_step", "art_calibrated", "art_on_demand")


def decode_loop(path: str | os.PathLike, batch: int, seqlen: int, *, art: ARTParams, rep_ms: int,
                device: torch.device, rounds: int = ROUNDS) -> list[dict]:
    """One row per (decode step, implementation) of the captured layer at ``path`` tiled to ``seqlen`` tokens for
    ``batch`` rows: ``step``, ``impl``, the timing of :func:`kernels.bench.time_interleaved` (``ms``, ...),
    ``num_splits``, ``follow_step``, ``pair_split_threshold`` (None without per-pair splits) of the call's plan
    (:func:`kernels.art_decode.plan_decode`), ``loaded_fraction`` and ``stopped_pairs`` next to
    ``single_stopped_pairs`` (:func:`kernels.bench.stopped_share` of the call's result steps and of the single walks)
    (ART rows), ``pair_walks`` (the ``[B, Hkv]`` walks the call was told, or its hint held, as lists, or None) with
    their longest, ``longest_stop_steps``, ``wave_steps`` (the plan's wave, 0 for none), and ``on_demand`` (whether
    the plan took on-demand followers, then with their ``release_walks``); the on-demand rows instead ``num_splits``,
    ``follow_step``, ``release_walks``, ``loaded_fraction`` and the stopped shares."""
    hint = LongestWalkHint()
    blocks = math.ceil(seqlen / ART_BLOCK_SIZE)
    on_demand = on_demand_plan(blocks, device, art)
    rows = []
    for step in range(decode_query_shape(path)[2]):
        q, k, v = tiled_capture(path, batch, seqlen, device, step=step)
        _, single = art_decode(q, k, v, art=art, num_splits=1, return_stats=True)
        single_stopped = stopped_share(single[..., 0], blocks)
        hinted = hint.pair_walks
        plans = {"art": {},
                 "art_previous_step": {} if hinted is None else hint_plan(hinted, blocks, k.shape[-1], device, art),
                 "art_calibrated": {"pair_walks": PairWalks.from_walks(single[..., 0])}}
        calls = {"art_dense": lambda: art_decode(q, k, v)}
        calls.update({impl: (lambda plan=plan: art_decode(q, k, v, art=art, **plan)) for impl, plan in plans.items()})
        calls["art_on_demand"] = lambda: art_decode(q, k, v, art=art, **on_demand)
        timings = time_interleaved(calls, rep_ms, rounds, device)
        for impl in IMPLS:
            row = {"step": step, "impl": impl, **timings[impl]}
            if impl in plans:
                keywords = dict(plans[impl], walk_hint=hint if impl == "art_previous_step" else None)
                plan = plan_decode(q, k, v, art=art, **keywords)       # before the call records into the hint
                _, steps, taken = art_decode(q, k, v, art=art, return_stats=True, return_result_steps=True, **keywords)
                told = hinted if impl == "art_previous_step" else plans[impl].get("pair_walks")
                row.update(longest_stop_steps=None if told is None else told.sorted_walks[-1],
                           pair_walks=None if told is None else told.walks.tolist(), wave_steps=plan.wave_steps,
                           num_splits=plan.num_splits,
                           on_demand=plan.on_demand, follow_step=plan.follow_step,
                           pair_split_threshold=plan.pair_threshold, loaded_fraction=loaded_fraction(steps, seqlen),
                           stopped_pairs=stopped_share(taken, blocks), single_stopped_pairs=single_stopped)
                if plan.on_demand:
                    row.update(release_walks=plan.release_walks)
            elif impl == "art_on_demand":
                _, steps, taken = art_decode(q, k, v, art=art, return_stats=True, return_result_steps=True,
                                             **on_demand)
                row.update(on_demand, loaded_fraction=loaded_fraction(steps, seqlen),
                           stopped_pairs=stopped_share(taken, blocks), single_stopped_pairs=single_stopped)
            rows.append(row)
    return rows


def loop_summary(rows: list[dict]) -> dict:
    """Per implementation, the sum of its steps' ``ms`` (``total_ms``), each ART total over ``art_dense``'s
    (``default_over_dense``, ``previous_step_over_dense``, ``calibrated_over_dense``, ``on_demand_over_dense``), the
    steps whose previous-step hint took the calibrated split count (``previous_step_same_splits`` of ``steps``), and
    those whose hint took on-demand followers (``previous_step_on_demand``), and per ART implementation the mean
    over the steps of the share of pairs whose output stopped (``stopped_pairs_mean``)."""
    totals = {impl: sum(r["ms"] for r in rows if r["impl"] == impl) for impl in IMPLS}
    stopped = {impl: [r["stopped_pairs"] for r in rows if r["impl"] == impl and "stopped_pairs" in r] for impl in IMPLS}
    splits = {(r["step"], r["impl"]): r["num_splits"] for r in rows if "num_splits" in r}
    steps = sorted({r["step"] for r in rows})
    return {"total_ms": totals,
            "default_over_dense": totals["art"] / totals["art_dense"],
            "previous_step_over_dense": totals["art_previous_step"] / totals["art_dense"],
            "calibrated_over_dense": totals["art_calibrated"] / totals["art_dense"],
            "on_demand_over_dense": totals["art_on_demand"] / totals["art_dense"],
            "previous_step_same_splits": sum(splits[(s, "art_previous_step")] == splits[(s, "art_calibrated")]
                                             for s in steps),
            "previous_step_on_demand": sum(bool(r.get("on_demand")) for r in rows if r["impl"] == "art_previous_step"),
            "stopped_pairs_mean": {impl: sum(shares) / len(shares) for impl, shares in stopped.items() if shares},
            "steps": len(steps)}


def run(out_dir: str | os.PathLike, capture: str | os.PathLike, *, art: ARTParams, quick: bool = False) -> dict:
    """Run the decode loop on ``capture`` (a captured layer's safetensors ``k, v, decode_q``) at each
    ``(batch, seqlen)`` of ``LOOP_CASES`` (``quick``: the first, one round) and write
    ``<out_dir>/<date>-art-decode-loop.json``; returns the payload (``summary`` keyed ``"<batch>x<seqlen>"``)."""
    device = checked_run_device("decode-loop", art, capture)
    cases, rounds = (LOOP_CASES[:1], 1) if quick else (LOOP_CASES, ROUNDS)
    payload = {
        "suite": "decode-loop",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "source": source_revision(),
        "quick": quick,
        "capture": Path(capture).name,
        "capture_file": input_file_record(capture),
        "art": dataclasses.asdict(art),
        "l2_flush": "read",
    }
    path = Path(out_dir) / f"{datetime.date.today().isoformat()}-art-decode-loop.json"
    loops = []
    for batch, seqlen in cases:
        rows = decode_loop(capture, batch, seqlen, art=art, rep_ms=50 if quick else 100, device=device,
                           rounds=rounds)
        loops.append({"batch": batch, "seqlen": seqlen, "rows": rows, "summary": loop_summary(rows)})
        torch.cuda.empty_cache()
        write_json_atomic(path, {**payload, "loops": loops, "complete": False})
    payload.update(loops=loops, complete=True,
                   summary={f"{loop['batch']}x{loop['seqlen']}": loop["summary"] for loop in loops})
    write_json_atomic(path, payload)
    return payload
