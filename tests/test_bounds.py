from dataclasses import fields

import pandas as pd
import pytest
import torch

from art_analysis.analysis.bounds import TruncationReport, bound_rules, bound_table, truncation_report
from art_analysis.analysis.inputs import DecodeInput
from art_analysis.blockwise import blockwise_attention
from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import ARTConfig, FixedBudget, stop


@pytest.mark.parametrize("mode", ["exact", "kernel"])
@pytest.mark.parametrize("preset", ["diffuse", "realistic", "peaked"])
def test_identity_holds_and_bounds_are_ordered(mode, preset):
    cache = synthetic_cache(2, 6, 2, 1000, 16, preset=preset, seed=3)
    lens = torch.tensor([1000, 777])
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64, cache_seqlens=lens, mode=mode)
    for rule in (FixedBudget(1), FixedBudget(4), ARTConfig(tau=1e-3, phi=1e-4, patience=2, group="head")):
        result = stop(trace, rule)
        report = truncation_report(trace, cache.q, cache.k, cache.v, result.stop_step, lens)
        scale = report.error.max().clamp(min=1.0)
        assert report.identity_residual.max() < 1e-10 * scale
        # The truncated output is exactly the simulator's partial output at the stop step.
        assert torch.allclose(report.error, (result.output.double() - trace.final_out.double()).norm(dim=-1),
                              atol=2e-5 if mode == "kernel" else 1e-10)
        assert torch.all(report.error <= report.bound_mean * (1 + 1e-9) + 1e-12)
        assert torch.all(report.bound_mean <= report.bound_max_value * (1 + 1e-9) + 1e-12)
        # The certified rho never underestimates the true one (kernel mode rounds m and l in fp32).
        assert torch.all(report.rho <= report.rho_certified * (1 + 1e-4) + 1e-12)
        assert torch.all(report.error <= report.bound_certified * (1 + 1e-4) + 1e-12)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_garbage_past_the_lengths_changes_no_report(garbage):
    cache = synthetic_cache(2, 6, 2, 400, 16, seed=5)
    lens = torch.tensor([300, 357])
    past = (torch.arange(400) >= lens[:, None])[:, None, :, None]
    reports, tables = {}, {}
    for fill in (garbage, 0.0):
        k, v = cache.k.masked_fill(past, fill), cache.v.masked_fill(past, fill)
        trace = blockwise_attention(cache.q, k, v, block_size=64, cache_seqlens=lens)
        reports[fill] = truncation_report(trace, cache.q, k, v, stop(trace, FixedBudget(2)).stop_step, lens)
        tables[fill] = bound_table([DecodeInput(cache.q, k, v, lens, None, 0, 1)], bound_rules())
    for field in fields(TruncationReport):
        assert torch.equal(getattr(reports[garbage], field.name), getattr(reports[0.0], field.name)), field.name
    pd.testing.assert_frame_equal(tables[garbage], tables[0.0], check_exact=True)


def test_truncation_report_refuses_inputs_and_stops_that_are_not_the_traces():
    cache = synthetic_cache(2, 6, 2, 300, 16, seed=2)
    lens = torch.tensor([300, 200])
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64, cache_seqlens=lens)
    stop_step = stop(trace, FixedBudget(2)).stop_step
    with pytest.raises(ValueError, match="must be the inputs that produced the trace"):
        truncation_report(trace, cache.q * 2, cache.k, cache.v, stop_step, lens)
    with pytest.raises(ValueError, match=r"q must be the trace's \[B, Hq, D\]=\(2, 6, 16\)"):
        truncation_report(trace, cache.q[:, :4], cache.k, cache.v, stop_step, lens)
    with pytest.raises(ValueError, match="Hq % Hkv must be 0"):
        truncation_report(trace, cache.q[:, :3], cache.k, cache.v, stop_step, lens)
    with pytest.raises(ValueError, match="q holds NaN"):
        truncation_report(trace, cache.q.clone().index_fill_(1, torch.tensor([0]), float("nan")), cache.k, cache.v,
                          stop_step, lens)
    with pytest.raises(ValueError, match="cache_seqlens"):
        truncation_report(trace, cache.q, cache.k, cache.v, stop_step, torch.tensor([300, 301]))
    with pytest.raises(ValueError, match="q must be the trace's"):
        truncation_report(trace, cache.q, cache.k[:, :1], cache.v[:, :1], stop_step, lens)
    with pytest.raises(TypeError, match="stop_step must be an int tensor"):
        truncation_report(trace, cache.q, cache.k, cache.v, stop_step.double(), lens)
    # sequence 1 walks 4 blocks (200 tokens): steps 0-3
    for bad in (-1, 4):
        too_far = stop_step.clone()
        too_far[1, 0] = bad
        with pytest.raises(ValueError, match="stop_step must lie within each head's walk"):
            truncation_report(trace, cache.q, cache.k, cache.v, too_far, lens)
    last = stop_step.clone()
    last[1] = 3
    truncation_report(trace, cache.q, cache.k, cache.v, last, lens)


def test_full_walk_has_zero_error_and_zero_bounds():
    cache = synthetic_cache(1, 4, 2, 300, 8)
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=32)
    report = truncation_report(trace, cache.q, cache.k, cache.v, trace.steps_per_head - 1)
    assert torch.all(report.rho == 0) and torch.all(report.rho_certified == 0)
    assert torch.all(report.error < 1e-12) and torch.all(report.bound_certified == 0)


def test_rho_matches_the_unvisited_block_mass():
    cache = synthetic_cache(1, 2, 1, 640, 8, seed=9)
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64)
    stop_step = torch.full((1, 2), 3)
    report = truncation_report(trace, cache.q, cache.k, cache.v, stop_step)
    assert torch.allclose(report.rho, 1 - trace.block_mass[..., :4].sum(-1), atol=1e-12)


def test_block_score_bounds_cover_every_score_of_their_block():
    from art_analysis.policies.quest import block_score_bounds

    cache = synthetic_cache(2, 6, 2, 300, 16, seed=4)
    lens = torch.tensor([300, 100])
    bounds = block_score_bounds(cache.q, cache.k, cache.v, block_size=64, cache_seqlens=lens)
    assert bounds.shape == (2, 6, 5)
    scores = torch.einsum("bhd,bhsd->bhs", cache.q.double(), cache.k.double().repeat_interleave(3, dim=1))
    for b in range(2):
        for block in range(5):
            part = slice(block * 64, min(block * 64 + 64, int(lens[b])))
            if part.start >= part.stop:
                assert torch.all(bounds[b, :, block] == 0)
                continue
            assert torch.all(bounds[b, :, block] >= scores[b, :, part].amax(-1) - 1e-9)
