"""Comparing two benchmark results call by call (``kernels.bench_compare``, ``art-analysis bench-compare``)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from art_analysis.cli import main
from kernels.bench_compare import baseline_in, compare_runs, headline_entries, load_run

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _row(impl: str, batch: int, ms: float, rounds=None, **fields) -> dict:
    row = dict(data="synthetic", batch=batch, seqlen=8192, q_heads=32, kv_heads=8, head_dim=128, impl=impl, ms=ms,
               **fields)
    if rounds is not None:
        row["ms_rounds"] = rounds
    return row


def _decode(rows: list[dict], **fields) -> dict:
    return {"suite": "decode", "device": "NVIDIA H200", "date": "2026-12-05T00:00:00+00:00",
            "versions": {"torch": "2.11"}, "quick": False, "complete": True, "rows": rows,
            "summary": {"art_rows_meeting_time_bound": 15, "art_rows": 26, "monitor_overhead_max": 0.008,
                        "b1_s32k": {"art_dense_ms": 0.04}, "complete_flag": True}, **fields}


def test_calls_are_matched_by_what_they_time_and_a_change_counts_beyond_the_threshold_and_the_noise():
    base = _decode([
        _row("cudnn_sdpa", 8, 1.00, [1.00, 1.01]),
        _row("art", 8, 1.00, [1.00, 1.01], num_splits=4),
        _row("art", 32, 2.00, [2.00, 2.12]),                 # spreads 6 % over its rounds
        _row("art_dense", 32, 1.00),
        _row("art_never", 8, 1.00),
        _row("flash_sdpa", 8, 1.00),
        _row("flash_sdpa", 32, 0.0),
    ])
    new = _decode(list(reversed([
        _row("cudnn_sdpa", 8, 0.98, [0.98, 0.99]),
        _row("art", 8, 1.05, [1.05, 1.055], num_splits=2),   # 5 % slower, 1 % noise, plan changed
        _row("art", 32, 2.10, [2.10, 2.11]),                 # 5 % slower, within the base row's 6 % spread
        _row("art_dense", 32, 0.90),                         # 10 % faster
        {**{k: v for k, v in _row("art_never", 8, 0.0).items() if k != "ms"}, "error": "out of memory"},
        _row("flash_sdpa", 8, 1.00),
        _row("art_dense", 64, 3.0),                          # timed in the new run only
        _row("flash_sdpa", 32, None),                        # no time in either run: not compared
    ])))
    comparison = compare_runs(base, new, threshold=0.03)
    entries = {(e["impl"], e["batch"]): e for e in comparison["rows"]["rows"]}
    assert entries["art", 8]["change"] == "slower" and entries["art", 8]["ratio"] == pytest.approx(1.05)
    assert entries["art", 8]["plan"] == "num_splits 4 -> 2"
    assert entries["art", 32]["change"] == "same" and entries["art", 32]["noise"] == pytest.approx(0.06)
    assert entries["art_dense", 32]["change"] == "faster"
    assert entries["art_never", 8]["change"] == "error" and entries["art_never", 8]["error"] == "out of memory"
    assert entries["cudnn_sdpa", 8]["change"] == "same" and entries["cudnn_sdpa", 8]["plan"] == ""
    assert comparison["counts"] == {"slower": 1, "faster": 1, "same": 3, "error": 1}
    assert entries["art_never", 8]["error_in"] == "new"
    assert comparison["regressions"] == {"slower": 1, "error_in_new": 1, "only_in_base": 0}
    assert comparison["only_in_new"]["rows"] == [dict(data="synthetic", batch=64, seqlen=8192, q_heads=32, kv_heads=8,
                                                      head_dim=128, impl="art_dense")]
    assert comparison["only_in_base"]["rows"] == []
    assert comparison["peer_ratio_median"] == pytest.approx(1.0)     # cuDNN 0.98, flash 1.00: the upper one
    # a call with an error first, then the slowest first
    assert [e["impl"] for e in comparison["rows"]["rows"]][:2] == ["art_never", "art"]
    # numbers of both summaries side by side; dicts and flags are left out
    assert comparison["summary"] == {"art_rows_meeting_time_bound": [15, 15], "art_rows": [26, 26],
                                     "monitor_overhead_max": [0.008, 0.008]}
    assert [h["entry"] for h in headline_entries(comparison)] == ["art_rows_meeting_time_bound", "art_rows",
                                                                   "monitor_overhead_max"]
    # a looser threshold takes the 5 % change as the same
    assert compare_runs(base, new, threshold=0.06)["counts"]["slower"] == 0


def test_runs_that_cannot_be_compared_are_refused_with_the_reason():
    base = _decode([_row("art", 8, 1.0)])
    with pytest.raises(ValueError, match="measured on 'NVIDIA H200' and new on 'NVIDIA H100"):
        compare_runs(base, {**base, "device": "NVIDIA H100 80GB HBM3"})
    with pytest.raises(ValueError, match="'decode' result and new a 'flexprefill'"):
        compare_runs(base, {**base, "suite": "flexprefill"})
    with pytest.raises(ValueError, match="threshold must be a finite ratio >= 0"):
        compare_runs(base, base, threshold=-0.01)
    with pytest.raises(ValueError, match="threshold"):
        compare_runs(base, base, threshold=float("nan"))


def test_notes_name_what_differs_besides_the_code_and_repeated_calls_are_left_out():
    base = _decode([_row("art", 8, 1.0), _row("art", 8, 1.1), _row("art", 32, 1.0)])
    new = _decode([_row("art", 8, 1.0), _row("art", 32, 1.0)], versions={"torch": "2.12"}, quick=True,
                  complete=False)
    comparison = compare_runs(base, new, base_name="a.json", new_name="b.json")
    assert [(e["batch"], e["change"]) for e in comparison["rows"]["rows"]] == [(32, "same")]
    assert comparison["notes"] == ["versions differ: {'torch': '2.11'} -> {'torch': '2.12'}",
                                   "quick differ: False -> True",
                                   "b.json is an incomplete run (its summary may be missing)",
                                   "a.json rows: 1 calls timed in several rows, left out"]


def test_decode_loops_are_compared_step_by_step_and_their_summaries_per_loop():
    def loop_run(scale: float, named_batch: bool) -> dict:
        loops = [{"seqlen": 8192, "rows": [{"step": step, "impl": impl, "ms": scale * (step + 1)}
                                           for step in range(2) for impl in ("art_dense", "art")],
                  "summary": {"default_over_dense": scale, "total_ms": {"art": 1.0}}}]
        if named_batch:
            loops[0]["batch"] = 32
        return {"suite": "decode-loop", "device": "NVIDIA H200", "batch": None if named_batch else 32, "loops": loops,
                "summary": {"32x8192": loops[0]["summary"]}}

    # an earlier result named the batch once for the run, a later one per loop
    comparison = compare_runs(loop_run(1.0, named_batch=False), loop_run(1.2, named_batch=True))
    assert {(e["batch"], e["step"], e["impl"]) for e in comparison["rows"]["loops"]} == {
        (32, step, impl) for step in range(2) for impl in ("art_dense", "art")}
    assert all(e["ratio"] == pytest.approx(1.2) and e["change"] == "slower" for e in comparison["rows"]["loops"])
    assert comparison["peer_ratio_median"] is None
    assert headline_entries(comparison) == [{"entry": "32x8192 default_over_dense", "base": 1.0, "new": 1.2}]


def test_load_run_takes_only_results_of_the_bench_suites(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load_run(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_run(broken)
    broken.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"broken.json is not JSON text \(not UTF-8: invalid start byte at byte 0\)"):
        load_run(broken)
    path = tmp_path / "other.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="other.json holds a list, not a JSON object"):
        load_run(path)
    for payload, shown in (({"suite": "decode-ab"}, "'decode-ab'"), ({"suite": {"a": 1}}, "{'a': 1}")):
        path.write_text(json.dumps(payload))
        with pytest.raises(ValueError, match=f"not a result of `art-analysis bench` \\(suite {shown}"):
            load_run(path)
    for payload, message in (({"suite": "decode", "rows": {"a": 1}}, "rows must be a list of objects"),
                             ({"suite": "decode", "paged": [1]}, "paged must be a list of objects"),
                             ({"suite": "decode-loop", "loops": [{"seqlen": 8}]},
                              r"loops must be a list of objects \(loops, each with rows\)"),
                             ({"suite": "decode", "source": "abc123"}, "source must be an object, got 'abc123'"),
                             ({"suite": "decode", "summary": [1, 2]}, r"summary must be an object, got \[1, 2\]")):
        path.write_text(json.dumps(payload))
        with pytest.raises(ValueError, match=message):
            load_run(path)


def test_two_committed_decode_runs_compare_every_call_both_timed():
    base = load_run(RESULTS / "2026-12-04-art-decode.json")
    new = load_run(RESULTS / "2026-12-05-art-decode-v67.json")
    comparison = compare_runs(base, new)
    for section in ("rows", "paged", "split_study"):
        timed_in_both = ({_key(r, section) for r in base[section] if "ms" in r}
                         & {_key(r, section) for r in new[section] if "ms" in r})
        assert len(comparison["rows"][section]) == len(timed_in_both) > 0
    row = next(e for e in comparison["rows"]["rows"] if e["impl"] == "art" and e["batch"] == 32
               and e["seqlen"] == 8192 and e["data"] == "synthetic")
    base_ms = next(r["ms"] for r in base["rows"] if _key(r, "rows") == _key(row, "rows"))
    new_ms = next(r["ms"] for r in new["rows"] if _key(r, "rows") == _key(row, "rows"))
    assert row["ratio"] == pytest.approx(new_ms / base_ms)
    assert comparison["summary"]["art_rows_meeting_time_bound"] == [15, 15]


def _key(row: dict, section: str) -> tuple:
    fields = {"rows": ("data", "batch", "seqlen", "head_dim", "impl"),
              "paged": ("batch", "seqlen", "impl", "page_size"),
              "split_study": ("batch", "seqlen", "impl", "block_size", "num_splits")}[section]
    return tuple(row.get(f) for f in fields) + ((row.get("data"),) if section != "rows" else ())


def test_cli_prints_the_changed_calls_writes_the_comparison_and_can_fail_on_a_slower_call(tmp_path, capsys):
    base = _decode([_row("art", 8, 1.0), _row("art_dense", 8, 2.0)])
    new = copy.deepcopy(base)
    new["rows"][0]["ms"] = 1.2
    paths = []
    for name, payload in (("base.json", base), ("new.json", new)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(payload))
    out = tmp_path / "comparison.json"
    assert main(["bench-compare", str(paths[0]), str(paths[1]), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "slower 1, faster 0, same 1" in printed
    changed = printed.split("calls changed")[1]
    assert "art " in changed and "1.200" in changed and "art_dense" not in changed
    assert json.loads(out.read_text())["counts"]["slower"] == 1
    assert main(["bench-compare", str(paths[0]), str(paths[1]), "--fail-on-slower"]) == 1
    assert "regression check failed: 1 slower, 0 with an error" in capsys.readouterr().out
    assert main(["bench-compare", str(paths[0]), str(paths[0]), "--fail-on-slower", "--all"]) == 0
    assert "every compared call" in capsys.readouterr().out
    # a call that errors in the new run, or that the new run lacks, fails the check as a slower one does
    errored, shorter, fixed = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    errored["rows"][0] = {**{k: v for k, v in base["rows"][0].items() if k != "ms"}, "error": "out of memory"}
    shorter["rows"] = shorter["rows"][1:]
    fixed["rows"][0] = errored["rows"][0]
    for name, payload in (("errored.json", errored), ("shorter.json", shorter), ("fixed.json", fixed)):
        (tmp_path / name).write_text(json.dumps(payload))
    assert main(["bench-compare", str(paths[0]), str(tmp_path / "errored.json"), "--fail-on-slower"]) == 1
    assert "1 with an error in the new run only" in capsys.readouterr().out
    assert main(["bench-compare", str(paths[0]), str(tmp_path / "shorter.json"), "--fail-on-slower"]) == 1
    assert "1 timed in the baseline and missing from the new run" in capsys.readouterr().out
    # the baseline's error, timed in the new run, is no regression
    assert main(["bench-compare", str(tmp_path / "fixed.json"), str(paths[0]), "--fail-on-slower"]) == 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**base, "device": "NVIDIA H100 80GB HBM3"}))
    assert main(["bench-compare", str(paths[0]), str(other)]) == 2
    assert "rerun the baseline on the new run's device" in capsys.readouterr().err


def test_a_folder_as_baseline_gives_the_newest_complete_run_of_the_same_suite_device_and_quick_setting(tmp_path,
                                                                                                       capsys):
    new = _decode([_row("art", 8, 1.2)], device="NVIDIA H100 80GB HBM3", date="2026-12-06T00:00:00+00:00")
    folder = tmp_path / "results"
    folder.mkdir()
    files = {
        "a-h100-old.json": {**new, "date": "2026-12-01T00:00:00+00:00", "rows": [_row("art", 8, 1.0)]},
        "b-h100-newer.json": {**new, "date": "2026-12-03T00:00:00+00:00", "rows": [_row("art", 8, 1.1)]},
        "c-h100-cut-short.json": {**new, "date": "2026-12-04T00:00:00+00:00", "complete": False},
        "d-h100-quick.json": {**new, "date": "2026-12-04T00:00:00+00:00", "quick": True},
        "e-h200.json": {**new, "date": "2026-12-05T00:00:00+00:00", "device": "NVIDIA H200"},
        "f-flexprefill.json": {**new, "suite": "flexprefill", "date": "2026-12-05T00:00:00+00:00"},
        "g-ab-study.json": {"suite": "decode-ab", "device": new["device"], "date": "2026-12-05"},
        "h-list.json": [1, 2],
    }
    for name, payload in files.items():
        (folder / name).write_text(json.dumps(payload))
    (folder / "i-damaged.json").write_text("{")
    (folder / "j-folder.json").mkdir()                          # neither a folder nor a link to nothing is a result
    (folder / "k-dangling.json").symlink_to(tmp_path / "nowhere.json")
    (folder / "l-not-text.json").write_bytes(b"\xff\xfe{")
    new_path = folder / "z-new.json"          # the new run itself lies in the folder and is not its own baseline
    new_path.write_text(json.dumps(new))
    assert baseline_in(folder, new, new_path) == folder / "b-h100-newer.json"
    # a flexprefill result is written whole and carries no "complete" flag
    assert baseline_in(folder, files["f-flexprefill.json"], new_path) == folder / "f-flexprefill.json"
    assert baseline_in(folder, {**new, "quick": True}, new_path) == folder / "d-h100-quick.json"
    with pytest.raises(ValueError, match="holds no complete 'decode' result measured on 'NVIDIA A100'"):
        baseline_in(folder, {**new, "device": "NVIDIA A100"}, new_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        baseline_in(new_path, new)
    assert main(["bench-compare", str(folder), str(new_path)]) == 0
    printed = capsys.readouterr().out
    assert "base: b-h100-newer.json" in printed and "slower 1," in printed    # 1.2 against 1.1 ms
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**new, "device": "NVIDIA A100"}))
    assert main(["bench-compare", str(folder), str(other)]) == 2
    assert "run the baseline on this device first" in capsys.readouterr().err
