"""The told wave's A/B and the refit of its rule (:func:`kernels.split_plan.told_wave_steps`).

A call told each pair's walk takes a wave (:mod:`kernels.art_wave`) where the rule's cost model says it costs fewer
lone monitored steps than the told walk; the model's two constants per head dim (``WAVE_EXTRA_LONE_STEPS``,
``WAVE_BLOCKS_PER_LONE_STEP``) are fitted to timings of one GPU.  On each shape this benchmark times, in interleaved
rounds of CUDA-graph medians after an L2 emptied by a read (:func:`kernels.bench.time_interleaved`):

* ``dense``: ``art=None``; ``art``: the call told nothing (its default plan);
* ``told``: told each pair's walk (``pair_walks`` from a single-split call on the same inputs): the rule decides;
* ``told_no_wave``: the same with ``wave_steps=0``;
* ``wave``: the told call with the rule's candidate wave forced (``wave_steps``: the longest walk and an eighth more,
  :func:`kernels.art_wave.told_wave_length`, up to ``MAX_WAVE_STEPS``, the rule's own cap), each pair waving over
  its own walk and an eighth.

Each row records the walks (longest, median), the rule's and the candidate's wave, the blocks the candidate reads
(``wave_blocks``, all pairs together), each call's loaded fraction, and whether the told call's result steps equal
the single walks.  :func:`decision_region` then gives, per head dim, the
constants on a grid for which the cost model (:func:`kernels.split_plan.wave_pays`) takes the faster of ``wave`` and
``told_no_wave`` in every row of the fit's shapes, and the summary counts the rows where the committed constants do,
also among validation shapes that no fit has seen.  NOTES V84 and V92 refitted the rule this way from
one-off scripts.

``run(out_dir, art=..., make_cache=..., capture=None, quick=False)`` writes ``<out_dir>/<date>-told-wave.json``.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
from pathlib import Path
from typing import Callable

import torch
import triton

from .art_decode import ART_BLOCK_SIZE, art_decode, plan_decode
from .art_params import ARTParams
from .art_wave import MAX_WAVE_STEPS, WAVE_STEP_TILE, told_wave_length
from .bench import (ROUNDS, capture_queries, checked_run_device, loaded_fraction, structured_sequences,
                    tile_batch, tiled_capture, time_interleaved)
from .device_info import num_sms
from .pair_walks import PairWalks
from .results_io import input_file_record, source_revision, write_json_atomic
from .split_plan import WAVE_BLOCKS_PER_LONE_STEP, WAVE_EXTRA_LONE_STEPS, told_wave_blocks, wave_pays

# (data, q_heads, kv_heads, head_dim, lengths, batches): the shapes of V84's and V92's fits, then shapes that no fit
# has seen (rows marked "fit": false, left out of the region)
SYNTHETIC_CASES = (("synthetic", 32, 8, 128, (8192, 32768, 131072), (1, 2, 4, 8, 16)),
                   ("synthetic_d64", 9, 3, 64, (32768,), (1, 8, 32)))
VALIDATION_CASES = (("synthetic", 32, 8, 128, (24576,), (5, 10)), ("synthetic", 32, 8, 128, (49152,), (6, 12)),
                    ("synthetic", 32, 8, 128, (98304,), (3, 10)), ("synthetic_d64", 9, 3, 64, (24576,), (3,)),
                    ("synthetic_d64", 9, 3, 64, (49152,), (12, 24, 48)))
# (lengths, batches) of the captured layer, fitted and validated
CAPTURE_CASES = ((8192, 32768, 131072), (1, 2, 8, 32))
CAPTURE_VALIDATION = ((49152, 98304), (3,))
QUICK_CASES = (("synthetic", 32, 8, 128, (32768,), (1,)),)
IMPLS = ("dense", "art", "told", "told_no_wave", "wave")
# the grids decision_region searches: extra lone steps, and blocks per multiprocessor per lone step
EXTRA_GRID = tuple(x / 4 for x in range(0, 41))
BLOCKS_PER_STEP_GRID = tuple(x / 200 for x in range(60, 321))


def told_wave_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, data: str, art: ARTParams, rep_ms: int,
                  device: torch.device, rounds: int = ROUNDS) -> dict:
    """One shape's row: ``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]`` (bf16 on ``device``) timed in the calls of the
    module docstring (``ms`` and ``ms_rounds`` per call, ``None`` for a wave past ``MAX_WAVE_STEPS``), with ``pairs``,
    ``max_steps``, ``longest_walk``, ``walk_median``, ``rule_wave_steps`` (the told call's plan), ``wave_steps`` (the
    forced candidate, or None), ``wave_blocks`` (the blocks it reads), the loaded fractions of ``told``,
    ``told_no_wave`` and ``wave``, and ``told_result_equals_single_walk`` (the share of pairs)."""
    seqlen = k.shape[2]
    max_steps = math.ceil(seqlen / ART_BLOCK_SIZE)
    _, single = art_decode(q, k, v, art=art, num_splits=1, return_stats=True)
    walks = single[..., 0]
    told = PairWalks.from_walks(walks)
    longest = int(told.sorted_walks[-1])
    candidate = told_wave_length(longest)
    wave_steps = min(candidate, max_steps) if candidate <= MAX_WAVE_STEPS else None
    calls = {"dense": lambda: art_decode(q, k, v),
             "art": lambda: art_decode(q, k, v, art=art),
             "told": lambda: art_decode(q, k, v, art=art, pair_walks=told),
             "told_no_wave": lambda: art_decode(q, k, v, art=art, pair_walks=told, wave_steps=0)}
    if wave_steps is not None:
        calls["wave"] = lambda: art_decode(q, k, v, art=art, pair_walks=told, wave_steps=wave_steps)
    row = {"data": data, "batch": q.shape[0], "seqlen": seqlen, "q_heads": q.shape[1], "kv_heads": k.shape[1],
           "head_dim": q.shape[2], "pairs": walks.numel(), "max_steps": max_steps, "longest_walk": longest,
           "walk_median": int(told.sorted_walks[len(told.sorted_walks) // 2]),
           "rule_wave_steps": plan_decode(q, k, v, art=art, pair_walks=told).wave_steps, "wave_steps": wave_steps,
           "wave_blocks": None if wave_steps is None else told_wave_blocks(told.sorted_walks, max_steps)}
    _, steps, result = art_decode(q, k, v, art=art, pair_walks=told, return_stats=True, return_result_steps=True)
    row["told_result_equals_single_walk"] = float((result == walks).float().mean())
    fractions = {"told": loaded_fraction(steps, seqlen)}
    fractions["told_no_wave"] = loaded_fraction(
        art_decode(q, k, v, art=art, pair_walks=told, wave_steps=0, return_stats=True)[1], seqlen)
    if wave_steps is not None:
        fractions["wave"] = loaded_fraction(art_decode(q, k, v, art=art, pair_walks=told, wave_steps=wave_steps,
                                                       return_stats=True)[1], seqlen)
    row["loaded_fraction"] = fractions
    timings = time_interleaved(calls, rep_ms, rounds, device)
    row["ms"] = {impl: timings[impl].get("ms") if impl in timings else None for impl in IMPLS}
    row["ms_rounds"] = {impl: timings[impl].get("ms_rounds") for impl in timings}
    errors = {impl: timings[impl]["error"] for impl in timings if "error" in timings[impl]}
    if errors:
        row["errors"] = errors
    return row


def timed_both_arms(row: dict) -> bool:
    """Whether a row has both arms of the rule's decision timed: the forced wave and the told walk without one."""
    return row["ms"].get("wave") is not None and row["ms"].get("told_no_wave") is not None


def _wave_faster(row: dict) -> bool:
    """Whether the row's forced wave took less time than its told walk without one."""
    return row["ms"]["wave"] < row["ms"]["told_no_wave"]


def model_takes_wave(row: dict, sms: int, extra_lone_steps: float | None = None,
                     blocks_per_lone_step: float | None = None) -> bool:
    """Whether the rule's cost model (:func:`kernels.split_plan.wave_pays`, with trial constants where given) takes
    the row's candidate wave on ``sms`` multiprocessors, regardless of the rule's cap on the wave's length."""
    return wave_pays(row["wave_blocks"], row["longest_walk"], row["max_steps"], row["head_dim"], sms, row["pairs"],
                     extra_lone_steps, blocks_per_lone_step)


def decision_region(rows: list[dict], sms: int) -> dict[str, dict[str, list[float] | None]]:
    """Per head dim (``"64"``, ``"128"``) of the fit's rows (``"fit"``, default true) with both arms timed, and per
    extra on ``EXTRA_GRID``, the
    ``[least, most]`` blocks per lone step on ``BLOCKS_PER_STEP_GRID`` for which the cost model takes the faster arm
    in every one of those rows (None: no such value); a grid point outside the range may still fail, the region
    being an interval only where the rows' constraints make it one."""
    region = {}
    fitted = [row for row in rows if row.get("fit", True) and timed_both_arms(row)]
    for head_dim in sorted({row["head_dim"] for row in fitted}):
        timed = [row for row in fitted if row["head_dim"] == head_dim]
        per_extra = {}
        for extra in EXTRA_GRID:
            right = [per_step for per_step in BLOCKS_PER_STEP_GRID
                     if all(model_takes_wave(row, sms, extra, per_step) == _wave_faster(row) for row in timed)]
            per_extra[str(extra)] = [min(right), max(right)] if right else None
        region[str(head_dim)] = per_extra
    return region


def told_wave_summary(rows: list[dict], sms: int) -> dict:
    """``rows_with_both_arms``; ``rule_took_the_faster`` (the told call's own plan: a wave of at most
    ``MAX_WAVE_STEPS`` steps); ``model_took_the_faster`` (the cost model with the committed constants, uncapped),
    also among the validation rows alone (``validation_rows``, ``model_took_the_faster_in_validation``);
    ``told_over_faster_arm_max`` (the told call against the faster arm); ``waves_past_one_tile`` (rows whose
    candidate wave is longer than ``WAVE_STEP_TILE``) and how many of them the wave won; and the
    :func:`decision_region`."""
    timed = [row for row in rows if timed_both_arms(row)]
    long_waves = [row for row in timed if row["wave_steps"] > WAVE_STEP_TILE]
    validation = [row for row in timed if not row.get("fit", True)]
    return {
        "rows_with_both_arms": len(timed),
        "validation_rows": len(validation),
        "model_took_the_faster_in_validation": sum(model_takes_wave(row, sms) == _wave_faster(row)
                                                   for row in validation),
        "rule_took_the_faster": sum((row["rule_wave_steps"] > 0) == _wave_faster(row) for row in timed),
        "model_took_the_faster": sum(model_takes_wave(row, sms) == _wave_faster(row) for row in timed),
        "told_over_faster_arm_max": max((row["ms"]["told"] / min(row["ms"]["wave"], row["ms"]["told_no_wave"])
                                         for row in timed if row["ms"].get("told")), default=None),
        "waves_past_one_tile": len(long_waves),
        "waves_past_one_tile_faster": sum(_wave_faster(row) for row in long_waves),
        "committed_constants": {name: {str(head_dim): value for head_dim, value in constants.items()}
                                for name, constants in (("WAVE_EXTRA_LONE_STEPS", WAVE_EXTRA_LONE_STEPS),
                                                        ("WAVE_BLOCKS_PER_LONE_STEP", WAVE_BLOCKS_PER_LONE_STEP))},
        "decision_region": decision_region(rows, sms),
    }


def _inputs(quick: bool, capture, make_cache: Callable, device: torch.device):
    """``(data, batch, base, fit)`` in case order (the fit's, then the validation's): ``base`` the distinct rows a
    batch tiles (two synthetic sequences of ``make_cache``, or the captured layer's decode queries), made once per
    length and data; ``quick``: ``QUICK_CASES`` alone."""
    groups = [(QUICK_CASES, (), True)] if quick else [
        (SYNTHETIC_CASES, CAPTURE_CASES if capture else (), True),
        (VALIDATION_CASES, CAPTURE_VALIDATION if capture else (), False)]
    for cases, captured, fit in groups:
        for data, q_heads, kv_heads, head_dim, lengths, batches in cases:
            for seqlen in lengths:
                base = structured_sequences(make_cache, seqlen, device, q_heads, kv_heads, head_dim)
                for batch in batches:
                    yield data, batch, base, fit
                del base
                torch.cuda.empty_cache()
        if captured:
            lengths, batches = captured
            for seqlen in lengths:
                base = tiled_capture(capture, capture_queries(capture), seqlen, device)
                for batch in batches:
                    yield "smollm2_layer15_tiled", batch, base, fit
                del base
                torch.cuda.empty_cache()


def run(out_dir: str | os.PathLike, *, art: ARTParams, make_cache: Callable,
        capture: str | os.PathLike | None = None, quick: bool = False) -> dict:
    """Time every shape (``SYNTHETIC_CASES`` with ``make_cache``'s realistic preset and the captured layer
    ``capture`` tiled as ``CAPTURE_CASES``, then the validation's, ``VALIDATION_CASES`` and ``CAPTURE_VALIDATION``;
    ``quick``: ``QUICK_CASES``, one round) and write
    ``<out_dir>/<date>-told-wave.json`` (rewritten after each shape, ``"complete": false`` until the end); returns
    the payload, whose ``summary`` is :func:`told_wave_summary`."""
    device = checked_run_device("told-wave", art, capture)
    sms = num_sms(device)
    payload = {
        "suite": "told-wave",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "sm_count": sms,
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "source": source_revision(),
        "quick": quick,
        "art": dataclasses.asdict(art),
        "capture_file": None if capture is None else input_file_record(capture),
        "l2_flush": "read",
    }
    path = Path(out_dir) / f"{datetime.date.today().isoformat()}-told-wave.json"
    rows = []
    for data, batch, base, fit in _inputs(quick, capture, make_cache, device):
        q, k, v = tile_batch(base, batch)
        rows.append({**told_wave_row(q, k, v, data=data, art=art, rep_ms=50 if quick else 100, device=device,
                                     rounds=1 if quick else ROUNDS), "fit": fit})
        del q, k, v
        write_json_atomic(path, {**payload, "rows": rows, "complete": False})
    payload.update(rows=rows, complete=True, summary=told_wave_summary(rows, sms))
    write_json_atomic(path, payload)
    return payload
