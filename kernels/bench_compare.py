"""Two runs of one GPU benchmark compared call by call: which calls got slower or faster than a baseline run, by more
than a threshold and more than the runs' own round-to-round spread.

A change to the kernel or to its plans is checked by rerunning the benchmark and comparing the new JSON with a
committed one (``benchmarks/results``; ``art-analysis bench-compare BASE.json NEW.json``).  Both must be results of
one suite of ``art-analysis bench`` (``decode``, ``decode-loop`` or ``flexprefill``) measured on the same device.
Given a folder as the baseline (``bench-compare benchmarks/results NEW.json``), the comparison takes the newest
complete run there of NEW's suite, device and ``quick`` setting (:func:`baseline_in`).

Rows are matched by what they time, not by their position: per suite and section, by the fields of ``ROW_KEYS``
(the data, the shape, the call).  A row whose plan changed (``PLAN_FIELDS``: block size, split count, follow step,
per-pair split threshold) is still the same call and is compared, with the change listed.  A row's time is its
``ms`` (the median of interleaved rounds, where the run kept rounds).  The ratio ``new_ms / base_ms`` counts as a
change only beyond ``max(threshold, noise)``, where ``noise`` is the larger of the two rows' round spreads
(``max / min - 1`` of ``ms_rounds``, :func:`kernels.bench.round_spread`): a card that drifts between a run's rounds
drifts between runs too.  Runs on different devices are refused (the ratios would measure the cards); different
software versions, quick runs and incomplete runs are named in the notes.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from .bench import round_spread, upper_median
from .results_io import flat_summary, read_result

ROW_KEYS = {
    "decode": {
        "rows": ("data", "batch", "seqlen", "q_heads", "kv_heads", "head_dim", "impl"),
        "dense_batches": ("batch", "seqlen", "q_heads", "kv_heads", "head_dim", "impl"),
        "paged": ("data", "batch", "seqlen", "impl", "page_size"),
        "split_study": ("data", "batch", "seqlen", "impl", "block_size", "num_splits"),
    },
    "decode-loop": {"loops": ("batch", "seqlen", "step", "impl")},
    "flexprefill": {"rows": ("data", "batch", "num_q_heads", "num_kv_heads", "seqlen", "head_dim", "dtype",
                             "block_size", "method", "gamma", "tau", "min_budget")},
}
PLAN_FIELDS = ("block_size", "num_splits", "follow_step", "pair_split_threshold")
# the summary entries printed side by side (every numeric entry of both summaries is in the comparison's JSON); a
# decode-loop's entries are named per loop ("<batch>x<seqlen> <entry>", kernels.results_io.flat_summary)
HEADLINES = {
    "decode": ("copy_ceiling_tb_per_s", "dense_over_best_peer_throughput_b16plus_min",
               "dense_over_best_peer_throughput_b16plus_median", "monitor_overhead_max",
               "monitor_overhead_rows_over_target", "art_rows_meeting_time_bound",
               "art_calibrated_rows_meeting_time_bound", "art_rows", "dense_batches_b16plus_min",
               "dense_batches_b16plus_below_target",
               "paged_art_over_contiguous_max"),
    "decode-loop": ("default_over_dense", "previous_step_over_dense", "calibrated_over_dense", "on_demand_over_dense"),
    "flexprefill": ("estimate_ms_at_128k_max", "kernel_ms_per_tile_over_sdpa_max_at_target_gammas",
                    "calls_with_at_most_30pct_kept_beating_sdpa", "calls_with_at_most_30pct_kept"),
}
DEFAULT_THRESHOLD = 0.03
# the peers timed in the same run: their ratio between the runs is the card's and the software's drift, not ours
PEER_CALLS = {"decode": ("impl", ("cudnn_sdpa", "flash_sdpa", "flex_attention")), "flexprefill": ("method", ("sdpa",))}


def load_run(path: str | os.PathLike) -> dict:
    """A benchmark result written by ``art-analysis bench``: the JSON object of ``path``, checked to be of a suite
    that :func:`compare_runs` knows (``ROW_KEYS``)."""
    payload = read_result(path, what="benchmark result")
    suite = payload.get("suite")
    if not isinstance(suite, str) or suite not in ROW_KEYS:
        raise ValueError(f"{path} is not a result of `art-analysis bench` (suite {suite!r}; expected one of "
                         f"{', '.join(ROW_KEYS)})")
    for section in ROW_KEYS[suite]:
        damaged = ValueError(f"benchmark result {path}: {section} must be a list of objects"
                             f"{' (loops, each with rows)' if suite == 'decode-loop' else ''}")
        rows = payload.get(section) or []
        if suite == "decode-loop" and isinstance(rows, list):   # loops, each with its rows
            if not all(isinstance(loop, dict) and isinstance(loop.get("rows"), list) for loop in rows):
                raise damaged
            rows = [row for loop in rows for row in loop["rows"]]
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise damaged
    for key in ("source", "summary"):
        if payload.get(key) is not None and not isinstance(payload[key], dict):
            raise ValueError(f"benchmark result {path}: {key} must be an object, got {payload[key]!r}")
    return payload


def baseline_in(folder: str | os.PathLike, new: dict, new_path: str | os.PathLike | None = None) -> Path:
    """The baseline for ``new`` (a payload of :func:`load_run`) among the results in ``folder``: the newest by
    ``date`` of the complete runs (not marked ``"complete": false``) of ``new``'s suite measured on ``new``'s device
    with its ``quick`` setting, other than ``new_path``.  Files that are not such results (A/B studies, damaged
    JSON, folders and links to nothing named ``*.json``) are passed over.  ``FileNotFoundError`` or ``ValueError``
    where ``folder`` is not a folder or holds no such run."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"baseline folder {folder} is not a folder")
    skip = Path(new_path).resolve() if new_path is not None else None
    found = []
    for path in folder.glob("*.json"):     # the newest by date, then by name (max below)
        if path.resolve() == skip:
            continue
        try:
            payload = load_run(path)
        except (ValueError, OSError):    # not a result, or not a readable file (a folder named *.json)
            continue
        if (payload["suite"] == new["suite"] and payload.get("device") == new.get("device")
                and payload.get("complete") is not False and payload.get("quick") == new.get("quick")):
            found.append((str(payload.get("date") or ""), path.name, path))
    if not found:
        raise ValueError(f"{folder} holds no complete {new['suite']!r} result measured on {new.get('device')!r}"
                         f"{' (quick)' if new.get('quick') else ''}: pass a baseline file, or run the baseline on "
                         "this device first")
    return max(found)[2]


def section_rows(payload: dict, section: str) -> list[dict]:
    """The timed rows of one section of a result; a decode-loop's ``loops`` flattened to rows that carry their loop's
    ``batch`` and ``seqlen``."""
    if payload["suite"] == "decode-loop":   # results before loops of several batch sizes name it once
        return [{"batch": loop.get("batch", payload.get("batch")), "seqlen": loop["seqlen"], **row}
                for loop in payload.get(section) or [] for row in loop["rows"]]
    return list(payload.get(section) or [])


def keyed_rows(rows: list[dict], fields: tuple[str, ...]) -> tuple[dict[tuple, dict], set[tuple]]:
    """``rows`` by the values of ``fields`` (``None`` where a row lacks one), and the keys that more than one row
    holds (a sweep that timed one call several times, as some tuning runs did): those are left out, since which of
    their rows stands for the call is not known."""
    keyed, repeated = {}, set()
    for row in rows:
        key = tuple(row.get(field) for field in fields)
        if key in keyed:
            repeated.add(key)
        keyed[key] = row
    return {key: row for key, row in keyed.items() if key not in repeated}, repeated


def _plan_change(base: dict, new: dict, key_fields: tuple[str, ...]) -> str:
    changes = [f"{field} {base.get(field)} -> {new.get(field)}" for field in PLAN_FIELDS
               if field not in key_fields and (field in base or field in new) and base.get(field) != new.get(field)]
    return ", ".join(changes)


def _timed_ms(row: dict) -> float | None:
    """A row's time, where it holds a positive finite one (a row that recorded an error holds none)."""
    ms = row.get("ms")
    return float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) and 0 < ms < math.inf else None


def compare_rows(base_rows: dict[tuple, dict], new_rows: dict[tuple, dict], fields: tuple[str, ...],
                 threshold: float) -> list[dict]:
    """One entry per call timed in both runs: its key fields, ``base_ms``, ``new_ms``, ``ratio`` (new over base),
    ``noise``, ``change`` (``"slower"``, ``"faster"``, ``"same"``, or ``"error"`` where one run timed it and the
    other recorded an error, then with ``error_in``: ``"base"`` or ``"new"``) and ``plan`` (the plan fields that
    differ, or ``""``)."""
    entries = []
    for key in base_rows.keys() & new_rows.keys():
        base, new = base_rows[key], new_rows[key]
        entry = {**dict(zip(fields, key)), "plan": _plan_change(base, new, fields)}
        base_ms, new_ms = _timed_ms(base), _timed_ms(new)
        if base_ms is None or new_ms is None:
            if base_ms is not None or new_ms is not None:
                entries.append({**entry, "base_ms": base_ms, "new_ms": new_ms, "change": "error",
                                "error_in": "new" if new_ms is None else "base",
                                "error": base.get("error") or new.get("error")})
            continue
        ratio = new_ms / base_ms
        noise = max(round_spread(base), round_spread(new))
        margin = max(threshold, noise)
        change = "slower" if ratio > 1 + margin else "faster" if ratio < 1 / (1 + margin) else "same"
        entries.append({**entry, "base_ms": base_ms, "new_ms": new_ms, "ratio": ratio, "noise": noise,
                        "change": change})
    return sorted(entries, key=lambda e: -e.get("ratio", math.inf))


def compare_runs(base: dict, new: dict, threshold: float = DEFAULT_THRESHOLD, *, base_name: str = "base",
                 new_name: str = "new") -> dict:
    """Compare two results of one suite (payloads of :func:`load_run`), ``new`` against ``base``.

    Returns ``{"suite", "threshold", "base", "new"`` (each: file name, device, date, versions, source, quick,
    complete), ``"notes"`` (what differs between the runs besides the code), ``"rows"`` (per section, the entries of
    :func:`compare_rows`), ``"only_in_base"``, ``"only_in_new"`` (per section, the keys of calls timed in one run),
    ``"counts"`` (slower / faster / same / error over every section), ``"regressions"`` (the calls that the new run
    lost against the baseline: slower, an error where the baseline timed it, or not timed at all; a regression
    check fails on any), ``"peer_ratio_median"`` (the upper median of
    the peers' ratios, ``PEER_CALLS``: how far the card and the peers' software moved between the runs; ``None``
    where the suite times no peer) and ``"summary"`` (``{entry: [base, new]}`` for the numeric entries of both
    summaries)``}``."""
    if not threshold >= 0 or not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite ratio >= 0 (e.g. 0.03 for 3 %), got {threshold!r}")
    if base["suite"] != new["suite"]:
        raise ValueError(f"{base_name} is a {base['suite']!r} result and {new_name} a {new['suite']!r} one: compare "
                         "results of one suite")
    if base.get("device") != new.get("device"):
        raise ValueError(f"{base_name} was measured on {base.get('device')!r} and {new_name} on {new.get('device')!r}: "
                         "their ratios would compare the devices; rerun the baseline on the new run's device")
    suite = base["suite"]
    notes = []
    for field in ("versions", "quick", "l2_flush", "art"):
        if base.get(field) != new.get(field):
            notes.append(f"{field} differ: {base.get(field)} -> {new.get(field)}")
    for name, payload in ((base_name, base), (new_name, new)):
        if payload.get("complete") is False:
            notes.append(f"{name} is an incomplete run (its summary may be missing)")
    rows, only_base, only_new = {}, {}, {}
    for section, fields in ROW_KEYS[suite].items():
        base_rows, base_repeated = keyed_rows(section_rows(base, section), fields)
        new_rows, new_repeated = keyed_rows(section_rows(new, section), fields)
        for name, repeated in ((base_name, base_repeated), (new_name, new_repeated)):
            if repeated:
                notes.append(f"{name} {section}: {len(repeated)} calls timed in several rows, left out")
        if not base_rows and not new_rows:
            continue
        rows[section] = compare_rows(base_rows, new_rows, fields, threshold)
        only_base[section] = [dict(zip(fields, key)) for key in base_rows.keys() - new_rows.keys()]
        only_new[section] = [dict(zip(fields, key)) for key in new_rows.keys() - base_rows.keys()]
    counts = {change: sum(e["change"] == change for entries in rows.values() for e in entries)
              for change in ("slower", "faster", "same", "error")}
    regressions = {"slower": counts["slower"],
                   "error_in_new": sum(e.get("error_in") == "new" for entries in rows.values() for e in entries),
                   "only_in_base": sum(len(keys) for keys in only_base.values())}
    field, peers = PEER_CALLS.get(suite, (None, ()))
    peer_ratios = [e["ratio"] for entries in rows.values() for e in entries if e.get(field) in peers and "ratio" in e]
    base_summary, new_summary = flat_summary(base), flat_summary(new)
    summary = {key: [base_summary[key], new_summary[key]] for key in base_summary if key in new_summary
               and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in
                       (base_summary[key], new_summary[key]))}
    return {"suite": suite, "threshold": threshold,
            "base": _header(base, base_name), "new": _header(new, new_name), "notes": notes, "rows": rows,
            "only_in_base": only_base, "only_in_new": only_new, "counts": counts, "regressions": regressions,
            "peer_ratio_median": upper_median(peer_ratios), "summary": summary}


def _header(payload: dict, name: str) -> dict:
    return {"file": name, **{field: payload.get(field) for field in ("device", "date", "versions", "source", "quick",
                                                                      "complete")}}


def headline_entries(comparison: dict) -> list[dict]:
    """The ``HEADLINES`` of a comparison's suite that both summaries hold, as ``{"entry", "base", "new"}`` rows (a
    decode-loop's once per loop, in the summary's order)."""
    names = HEADLINES[comparison["suite"]]
    return [{"entry": key, "base": base, "new": new} for key, (base, new) in comparison["summary"].items()
            if any(key == name or key.endswith(f" {name}") for name in names)]
