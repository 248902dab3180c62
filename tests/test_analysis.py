import json

import numpy as np
import pytest
import torch

from art_analysis.analysis.convergence import error_curve
from art_analysis.analysis.misalignment import misaligned_fraction, token_scores
from art_analysis.blockwise import blockwise_attention
from art_analysis.cli import main
from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import ARTConfig


@pytest.fixture(scope="module")
def trace():
    cache = synthetic_cache(1, 4, 2, 1000, 16, preset="realistic", seed=2)
    return blockwise_attention(cache.q, cache.k, cache.v, block_size=100, order="sequential")


def test_error_curve_matches_its_definition(trace):
    loaded, error = error_curve(trace)
    assert torch.allclose(loaded[0, 0], torch.arange(1, 11, dtype=torch.float64) / 10)
    final = trace.final_out[0, 1]
    assert torch.isclose(error[0, 1, 3], (trace.partial_out[0, 1, 3] - final).norm() / final.norm())
    assert torch.all(error[..., -1] == 0)


def test_misaligned_fraction_against_brute_force():
    gen = torch.Generator().manual_seed(0)
    score, contribution = torch.rand(3, 50, generator=gen), torch.rand(3, 50, generator=gen)
    got = misaligned_fraction(score, contribution, top=0.2)
    for h in range(3):
        top_c = set(contribution[h].argsort(descending=True)[:10].tolist())
        top_s = set(score[h].argsort(descending=True)[:10].tolist())
        assert got[h] == len(top_c - top_s) / 10
    assert torch.all(misaligned_fraction(score, score) == 0)


def test_token_scores_are_weights_and_weighted_value_norms():
    cache = synthetic_cache(1, 4, 2, 64, 8, seed=1)
    score, contribution = token_scores(cache.q[0], cache.k[0], cache.v[0], 60)
    assert score.shape == (2, 60)
    weights = torch.softmax(cache.k[0, 1, :60].double() @ cache.q[0, 2].double() / 8 ** 0.5, -1)
    weights3 = torch.softmax(cache.k[0, 1, :60].double() @ cache.q[0, 3].double() / 8 ** 0.5, -1)
    assert torch.allclose(score[1], torch.maximum(weights, weights3))
    norms = cache.v[0, 1, :60].double().norm(dim=-1)
    assert torch.allclose(contribution[1], torch.maximum(weights * norms, weights3 * norms))


def test_simulate_command_prints_the_rule_table(capsys, tmp_path):
    out = tmp_path / "table.json"
    assert main(["simulate", "--seqlen", "512", "--heads", "4/2", "--head-dim", "16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Oracle(eps=0.01, head)" in printed and "loaded_fraction" in printed
    rows = json.loads(out.read_text())
    assert rows[0]["rule"] == ARTConfig().name
    assert all(0 < r["loaded_fraction"] <= 1 for r in rows)


def test_simulate_command_reports_bad_input(capsys):
    assert main(["simulate", "--heads", "4/3", "--seqlen", "64"]) == 2
    assert "num_q_heads % num_kv_heads" in capsys.readouterr().err
    # the capture's own options are refused on a synthetic cache, not ignored
    assert main(["simulate", "--seqlen", "64", "--step", "0"]) == 2
    assert "--step chooses within a capture; pass --capture DIR" in capsys.readouterr().err
    # sizes past what PyTorch can index are an error, not a traceback
    assert main(["simulate", "--seqlen", str(2 ** 70)]) == 2
    assert "a number is too large" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is present")
def test_bench_command_explains_that_it_needs_a_gpu(capsys):
    assert main(["bench", "--suite", "decode"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_art_options_override_only_what_is_given():
    from art_analysis.cli import build_parser
    from art_analysis.cli.art_options import art_config_from_args

    def config(*argv):
        return art_config_from_args(build_parser().parse_args(["simulate", *argv]))

    assert config().name == ARTConfig().name
    paper = config("--paper", "--patience", "3")
    assert (paper.tau, paper.patience, paper.probe_source) == (1e-7, 3, "accumulator")
    assert config("--tau", "0.5", "--group", "head").name == ARTConfig(tau=0.5, group="head").name


def test_analysis_inputs_are_checked():
    from art_analysis.analysis.bounds import truncation_report

    cache = synthetic_cache(1, 4, 2, 100, 8)
    with pytest.raises(ValueError, match="seqlen"):
        token_scores(cache.q[0], cache.k[0], cache.v[0], 101)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        token_scores(cache.q[0, :3], cache.k[0], cache.v[0], 50)
    lens = torch.tensor([60])
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=16, cache_seqlens=lens)
    with pytest.raises(ValueError, match="lengths the trace was built with"):
        truncation_report(trace, cache.q, cache.k, cache.v, torch.zeros(1, 4, dtype=torch.long))
    report = truncation_report(trace, cache.q, cache.k, cache.v, torch.zeros(1, 4, dtype=torch.long), lens)
    assert torch.all(report.rho > 0)


def test_summaries_name_a_wrong_collection_of_traces_or_rules():
    from art_analysis.analysis.ablation import ablation_table
    from art_analysis.analysis.bounds import bound_table
    from art_analysis.analysis.sensitivity import baseline_sweep, pareto_front, threshold_grid
    from art_analysis.rules_summary import summarize
    from art_analysis.termination import Oracle, sweep

    cache = synthetic_cache(1, 4, 2, 512, 16, seed=3)
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64)
    rule = ARTConfig(tau=1e-3, phi=1e-4, patience=2)
    # one trace is taken as a list of one
    assert summarize(trace, [rule]) == summarize([trace], [rule])
    with pytest.raises(ValueError, match="traces must hold at least one BlockTrace"):
        summarize([], [rule])
    with pytest.raises(TypeError, match="traces must hold BlockTraces .* got Tensor"):
        summarize([trace, cache.q], [rule])
    with pytest.raises(TypeError, match=r"for one rule, use stop\(trace, rule\) or sweep\(trace, \[rule\]\)"):
        sweep(trace, rule)
    with pytest.raises(TypeError, match="base must be an ARTConfig .* got Oracle"):
        threshold_grid([trace], [1e-3], [1e-4], [2], base=Oracle(0.01))
    with pytest.raises(TypeError, match="base must be an ARTConfig .* got Oracle"):
        ablation_table([trace], base=Oracle(0.01))
    with pytest.raises(TypeError, match="rules must map a name to each rule"):
        bound_table(cache, [rule])
    grid = threshold_grid([trace], [1e-3, 1e-2], [1e-4], [2])
    # a sweep's values as a NumPy array or a tensor are a grid; a single number or a string is named
    assert threshold_grid([trace], np.array([1e-3, 1e-2]), [1e-4], torch.tensor([2])).equals(grid)
    with pytest.raises(TypeError, match=r"taus must be a sequence, e.g. \[1e-3, 1e-2\], got 0.001"):
        threshold_grid([trace], 1e-3, [1e-4], [2])
    with pytest.raises(TypeError, match=r"patiences must be a sequence, e.g. \[4, 16\], got tensor\(2\)"):
        threshold_grid([trace], [1e-3], [1e-4], torch.tensor(2))
    with pytest.raises(TypeError, match=r"eps must be a sequence, e.g. \[0.01, 0.001\], got 0.1"):
        baseline_sweep([trace], eps=0.1)
    with pytest.raises(ValueError, match=r"rows lack the column\(s\) \['family'\]: pass by=None"):
        pareto_front(grid)
    assert len(pareto_front(grid, by=None)) >= 1


def test_studies_check_their_decode_inputs_and_settings_before_any_work():
    from art_analysis.analysis.convergence import convergence_curves, recent_window_curves
    from art_analysis.analysis.inputs import decode_inputs
    from art_analysis.analysis.misalignment import misalignment_rates

    cache = synthetic_cache(1, 4, 2, 256, 16, seed=4)
    call = (cache.q, cache.k, cache.v, None, None, 0, 1)
    assert decode_inputs([call])[0].cache_seqlens.tolist() == [256]           # None: the whole cache
    nan_k = cache.k.clone()
    nan_k[0, 1, 7, 3] = float("nan")
    cases = [((cache.q, nan_k, cache.v, None, None, 0, 1), ValueError, "NaN or Inf"),
             ((cache.q.long(), cache.k, cache.v, None, None, 0, 1), TypeError, "q must be a floating-point"),
             ((cache.q, cache.k, cache.v, torch.tensor([300]), None, 0, 1), ValueError, r"\[1, S=256\]"),
             ((cache.q, cache.k, cache.v, None, None, 0, 1, -0.5), ValueError, "sm_scale must be a positive")]
    for bad, error, message in cases:
        for study in (convergence_curves, recent_window_curves, misalignment_rates):
            with pytest.raises(error, match=message):
                study([bad])
    for fractions in ([float("nan")], [-0.5], [2.0], [], "0.5"):
        with pytest.raises(ValueError, match=r"fractions must be loaded fractions in \[0, 1\]"):
            convergence_curves([call], fractions=fractions)
        with pytest.raises(ValueError, match=r"fractions must be loaded fractions in \[0, 1\]"):
            recent_window_curves([call], fractions=fractions)
    for sinks in ((), 4, "4"):
        with pytest.raises(ValueError, match="sink_tokens must be a non-empty list of ints >= 0"):
            recent_window_curves([call], sink_tokens=sinks)
    with pytest.raises(TypeError, match=r"ks must be a sequence, e.g. \[0.05, 0.1\], got 0.1"):
        misalignment_rates([call], ks=0.1)
    for orders in ("sequential", 5):
        with pytest.raises(TypeError, match=r"orders must be a sequence, e.g. \['sequential', 'sink_recency'\]"):
            convergence_curves([call], orders=orders)
    with pytest.raises(ValueError, match="each of sink_tokens must be >= 0"):
        recent_window_curves([call], sink_tokens=(4, -1))
    with pytest.raises(TypeError, match="each of sink_tokens must be an int"):
        recent_window_curves([call], sink_tokens=(1.5,))
    # an array of NumPy ints (a sweep's values) is taken; a repeated size gives its rows once
    swept = recent_window_curves([call], fractions=[0.5], sink_tokens=np.array([0, 4, 4]))
    assert sorted(swept["window"].unique()) == ["recent", "sink4+recent"]
    assert len(swept) == 2 * len(recent_window_curves([call], fractions=[0.5], sink_tokens=[0]))
    # a sink longer than the sequence keeps all of it: the exact output, every token loaded
    whole = recent_window_curves([call], fractions=[0.0, 0.5], sink_tokens=[10 ** 6])
    assert whole["window"].unique().tolist() == ["sink1000000+recent"]
    assert whole["loaded_fraction"].tolist() == [1.0, 1.0] and float(whole["error_q75"].max()) < 1e-12
