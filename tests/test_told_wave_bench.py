"""The told wave's benchmark (``kernels.bench_told_wave``): its rows on the CPU's interpreter with a fake clock, and
the region of the rule's constants that takes the faster arm."""
import itertools

import pytest
import torch

import kernels.bench as bench
import kernels.bench_told_wave as told_wave
from art_analysis.cli import main
from art_analysis.synthetic import synthetic_cache
from kernels.art_params import ARTParams
from kernels.art_wave import told_wave_length


def test_a_row_times_the_told_call_with_and_without_the_wave_and_the_forced_candidate(monkeypatch):
    clock = itertools.count(1)
    monkeypatch.setattr(bench, "graph_ms", lambda fn, rep_ms: float(next(clock)))
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    cache = synthetic_cache(batch=2, num_q_heads=4, num_kv_heads=2, seqlen=40 * 64, head_dim=64, seed=3)
    q, k, v = (x.half() for x in (cache.q, cache.k, cache.v))    # the interpreter's bf16 dot is wrong
    art = ARTParams(tau=1e-2, phi=1e-3, patience=2)
    row = told_wave.told_wave_row(q, k, v, data="synthetic", art=art, rep_ms=1, device=torch.device("cpu"),
                                  rounds=2)
    _, single = bench.art_decode(q, k, v, art=art, num_splits=1, return_stats=True)
    walks = single[..., 0]
    assert row["pairs"] == 4 and row["max_steps"] == 40 and row["longest_walk"] == int(walks.max()) < 40
    assert row["wave_steps"] == min(told_wave_length(row["longest_walk"]), 40)
    # each pair waves over its own walk and an eighth
    assert row["wave_blocks"] == sum(min(told_wave_length(int(walk)), row["wave_steps"]) for walk in walks.flatten())
    assert row["told_result_equals_single_walk"] == 1.0
    # the five calls in two interleaved rounds of the fake clock: 1-5, then 6-10
    assert {impl: row["ms_rounds"][impl] for impl in told_wave.IMPLS} == {
        impl: [1.0 + i, 6.0 + i] for i, impl in enumerate(told_wave.IMPLS)}
    assert row["ms"]["wave"] == 3.5 + told_wave.IMPLS.index("wave")
    told = told_wave.PairWalks.from_walks(walks)
    _, wave_steps = bench.art_decode(q, k, v, art=art, pair_walks=told, wave_steps=row["wave_steps"],
                                     return_stats=True)
    assert row["loaded_fraction"]["wave"] == bench.loaded_fraction(wave_steps, 40 * 64)
    _, walked = bench.art_decode(q, k, v, art=art, pair_walks=told, wave_steps=0, return_stats=True)
    assert row["loaded_fraction"]["told_no_wave"] == bench.loaded_fraction(walked, 40 * 64)
    assert set(row["loaded_fraction"]) == {"told", "told_no_wave", "wave"}


def _row(head_dim, pairs, wave_steps, longest, max_steps, wave_ms, walk_ms, rule_wave_steps=0):
    return {"head_dim": head_dim, "pairs": pairs, "wave_steps": wave_steps, "wave_blocks": pairs * wave_steps,
            "longest_walk": longest,
            "max_steps": max_steps, "rule_wave_steps": rule_wave_steps,
            "ms": {"wave": wave_ms, "told_no_wave": walk_ms, "told": min(wave_ms or walk_ms, walk_ms)}}


def test_the_region_holds_the_constants_whose_cost_model_takes_the_faster_arm_in_every_row():
    """On 132 multiprocessors: few pairs of long walks, where the wave wins (any blocks per step will do), many pairs
    where it loses (at most 6144 / (132 x (42 - extra)) blocks per step), and walks of 4 blocks where it wins (more
    than 2.91 / (4 - extra)): the region is the interval those bounds leave on the grid, and none past an extra of
    4 lone steps."""
    rows = [_row(128, 8, 48, 42, 512, 0.019, 0.053, rule_wave_steps=48), _row(128, 128, 48, 42, 512, 0.094, 0.068),
            _row(128, 8, 48, 4, 512, 0.010, 0.012), _row(64, 24, 136, 114, 512, 0.034, 0.0745),
            _row(64, 24, 48, 40, 512, None, 0.030)]
    # a validation row: outside the region's fit (it would leave no region at an extra of 0), counted apart
    rows.append({**_row(128, 8, 48, 2, 512, 0.010, 0.012), "fit": False})
    region = told_wave.decision_region(rows, 132)
    assert set(region) == {"64", "128"}
    assert region["128"]["0.0"] == [0.73, 1.105]
    assert region["128"]["3.0"] is None and region["128"]["4.0"] is None
    summary = told_wave.told_wave_summary(rows, 132)
    assert summary["rows_with_both_arms"] == 5 and summary["validation_rows"] == 1
    assert summary["rule_took_the_faster"] == 2        # the rows' plans: the first takes the wave, the others none
    # the committed constants (2.0 lone steps, 0.73 blocks per step at D = 128): wrong only on the short walks
    assert summary["model_took_the_faster"] == 3 and summary["model_took_the_faster_in_validation"] == 0
    assert summary["waves_past_one_tile"] == 1 and summary["waves_past_one_tile_faster"] == 1
    assert summary["told_over_faster_arm_max"] == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is present")
def test_the_told_wave_suite_says_it_needs_a_gpu(capsys):
    assert main(["bench", "--suite", "told-wave"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_a_run_writes_its_rows_and_summary_to_a_dated_file(monkeypatch, tmp_path):
    import datetime
    import json

    clock = itertools.count(1)
    monkeypatch.setattr(bench, "graph_ms", lambda fn, rep_ms: float(next(clock)))
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(told_wave, "checked_run_device", lambda suite, art, capture: torch.device("cpu"))
    monkeypatch.setattr(told_wave.torch.cuda, "get_device_name", lambda device: "CPU (interpreter)")
    monkeypatch.setattr(told_wave, "QUICK_CASES", (("synthetic", 4, 2, 64, (24 * 64,), (1, 2)),))

    def fp16_cache(**kwargs):   # the interpreter's bf16 dot is wrong
        return synthetic_cache(**{**kwargs, "dtype": torch.float16}, seed=1)

    payload = told_wave.run(tmp_path, art=ARTParams(tau=1e-2, phi=1e-3, patience=2), make_cache=fp16_cache,
                            quick=True)
    written = json.loads((tmp_path / f"{datetime.date.today().isoformat()}-told-wave.json").read_text())
    assert written["complete"] and written["suite"] == "told-wave" and written["device"] == "CPU (interpreter)"
    assert [(row["batch"], row["pairs"], row["fit"]) for row in written["rows"]] == [(1, 2, True), (2, 4, True)]
    assert written["summary"] == payload["summary"]
    assert written["summary"]["rows_with_both_arms"] == 2
