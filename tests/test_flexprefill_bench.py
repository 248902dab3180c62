"""`kernels.bench_flexprefill.summarise`: the targets checked on hand-made rows; the module's command line."""
from __future__ import annotations

import pytest
import torch

from kernels.bench_flexprefill import TARGET_GAMMAS, summarise


def sparse_row(gamma, ratio, seqlen=32768):
    return {"method": "kernel_sparse", "data": "structured", "seqlen": seqlen, "gamma": gamma,
            "ms_per_tile_over_sdpa": ratio}


def test_summary_reports_the_per_tile_target_at_the_target_gammas_and_over_all():
    rows = [
        {"method": "sdpa", "data": "structured", "seqlen": 32768, "ms": 10.0},
        {"method": "kernel_all_tiles", "data": "structured", "seqlen": 32768, "ms": 11.0},
        {"method": "estimate", "data": "structured", "seqlen": 131072, "gamma": 0.9, "ms": 4.5},
        {"method": "estimate", "data": "structured", "seqlen": 131072, "gamma": 0.85, "ms": 4.9},
        {"method": "estimate", "data": "structured", "seqlen": 65536, "gamma": 0.9, "ms": 9.0},  # not 128k
        sparse_row(0.85, 1.25), sparse_row(TARGET_GAMMAS[0], 1.15), sparse_row(TARGET_GAMMAS[1], 1.18),
        {"method": "flexprefill", "data": "structured", "seqlen": 32768, "kept_fraction": 0.2, "speedup_vs_sdpa": 3.0},
        {"method": "flexprefill", "data": "structured", "seqlen": 65536, "kept_fraction": 0.3, "speedup_vs_sdpa": 0.9},
        {"method": "flexprefill", "data": "structured", "seqlen": 65536, "kept_fraction": 0.5, "speedup_vs_sdpa": 0.5},
        {"method": "flexprefill", "data": "structured", "seqlen": 16384, "kept_fraction": 0.1, "speedup_vs_sdpa": 0.8},
    ]
    summary = summarise(rows)
    assert summary["kernel_all_tiles_over_sdpa"] == {"structured@32768": 1.1}
    assert summary["estimate_ms_at_128k_max"] == 4.9
    assert summary["kernel_ms_per_tile_over_sdpa_max_at_target_gammas"] == 1.18
    assert summary["kernel_ms_per_tile_over_sdpa_max"] == 1.25
    assert summary["target_gammas"] == list(TARGET_GAMMAS)
    assert summary["calls_with_at_most_30pct_kept"] == 2
    assert summary["calls_with_at_most_30pct_kept_beating_sdpa"] == 1


def test_target_rows_state_each_target_and_whether_it_was_met(capsys):
    from art_analysis.cli.bench import _print_summaries
    from kernels.bench_flexprefill import target_rows

    rows = [
        {"method": "estimate", "data": "structured", "seqlen": 131072, "gamma": 0.9, "ms": 4.2},
        sparse_row(TARGET_GAMMAS[0], 1.05), sparse_row(TARGET_GAMMAS[1], 1.1),
        {"method": "flexprefill", "data": "structured", "seqlen": 32768, "kept_fraction": 0.2, "speedup_vs_sdpa": 3.0},
        {"method": "flexprefill", "data": "structured", "seqlen": 65536, "kept_fraction": 0.3, "speedup_vs_sdpa": 0.9},
    ]
    summary = summarise(rows)
    targets = target_rows(summary)
    assert [(t["measured"], t["met"]) for t in targets] == [
        ("max 4.20 ms", True), ("max 1.10x", True), ("1 of 2 calls", False)]
    assert targets[1]["target"] == "sparse kernel per computed tile <= 1.2x SDPA, gamma 0.9/0.95"
    # a quick run measures no 128k estimate and no 32k call
    quick = summarise([r for r in rows if r["method"] not in ("estimate", "flexprefill")])
    assert [t["met"] for t in target_rows(quick)] == [None, True, None]
    _print_summaries({"flexprefill": summary})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "flexprefill targets:" and printed[-1].endswith("no") and "1 of 2 calls" in printed[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_the_module_says_it_needs_a_gpu_as_a_usage_error(capsys):
    from kernels.bench_flexprefill import main

    with pytest.raises(SystemExit) as exit_:
        main(["--quick"])
    assert exit_.value.code == 2
    assert "the FlexPrefill benchmark times Triton kernels on a CUDA GPU and none is available here" in \
        capsys.readouterr().err
