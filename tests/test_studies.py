"""The capture studies on caches where the answer is known, and their command-line front ends."""
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from art_analysis.analysis.ablation import ablation_table, ablation_variants
from art_analysis import policies
from art_analysis.analysis.bounds import bound_summary, bound_table, truncation_report
from art_analysis.analysis.composition import compose_with_art
from art_analysis.analysis.convergence import convergence_curves, error_at, error_curve, recent_window_curves
from art_analysis.analysis.inputs import DecodeInput, decode_inputs, traces
from art_analysis.analysis.misalignment import misaligned_fraction, misaligned_tokens, misalignment_rates, token_scores
from art_analysis.analysis.sensitivity import (baseline_sweep, choose_setting, pareto_front, pick_default,
                                               threshold_grid)
from art_analysis.cli import main
from art_analysis.analysis.bounds import bound_rules
from art_analysis.blockwise import blockwise_attention
from art_analysis.policies.compose import simulate_policy
from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import ARTConfig, FixedBudget, MassCoverage, Oracle, stop

CAPTURED_LAYER = Path(__file__).parent / "fixtures" / "smollm2_layer15_ctx1024.safetensors"
SCALE = 0.7     # a model's softmax scale that is not D ** -0.5 (0.25 for the caches' D = 16)


def sink_only_cache(seqlen=640, dim=8, kv_heads=2, group=2, sink_tokens=4):
    """Every query attends to the first ``sink_tokens`` tokens only (the rest have exp(logit) = 0 in float64)."""
    gen = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(1, kv_heads, 1, dim, generator=gen), dim=-1)
    q = (direction.expand(1, kv_heads, group, dim) * dim ** 0.5).reshape(1, kv_heads * group, dim)
    k = torch.randn(1, kv_heads, seqlen, dim, generator=gen) * 0.1
    k[:, :, :sink_tokens] = direction * 2000.0          # logit ~ 2000 * sqrt(D) / sqrt(D)
    v = torch.randn(1, kv_heads, seqlen, dim, generator=gen)
    return DecodeInput(q.double(), k.double(), v.double(), torch.tensor([seqlen]), None, 0, 1)


@pytest.fixture(scope="module")
def realistic():
    return synthetic_cache(1, 4, 2, 1000, 16, preset="realistic", seed=2)


@pytest.fixture(scope="module")
def walks(realistic):
    return traces(realistic, block_size=100)


@pytest.fixture(scope="module")
def scaled(realistic):
    """The realistic cache as the decode call of a model whose softmax scale is ``SCALE``."""
    return decode_inputs(realistic)[0]._replace(sm_scale=SCALE)


def captured_inputs(steps=2):
    tensors = load_file(str(CAPTURED_LAYER))
    k, v, decode_q = tensors["k"].double(), tensors["v"].double(), tensors["decode_q"].double()
    context = k.shape[2] - decode_q.shape[2]
    return [DecodeInput(decode_q[:, :, t], k, v, torch.tensor([context + t + 1]), None, 15, 30) for t in range(steps)]


# ----------------------------------------------------------------------------- inputs
def test_decode_inputs_accept_every_source(realistic):
    (call,) = decode_inputs(realistic)
    assert call.layer == 0 and call.num_layers == 1 and int(call.cache_seqlens[0]) == 1000
    assert decode_inputs([tuple(call)])[0].layer == 0
    with pytest.raises(TypeError, match="source must be"):
        decode_inputs("captures/x")
    with pytest.raises(TypeError, match="DecodeInput"):
        decode_inputs([(1, 2)])


def test_decode_inputs_carry_the_softmax_scale_into_their_walks(realistic, scaled):
    call = decode_inputs(realistic)[0]
    assert call.sm_scale is None
    assert decode_inputs([tuple(scaled)])[0].sm_scale == SCALE                  # 8-tuples
    assert decode_inputs([tuple(scaled)[:7]])[0].sm_scale is None               # 7-tuples: D ** -0.5
    expected = blockwise_attention(call.q, call.k, call.v, block_size=100, cache_seqlens=call.cache_seqlens,
                                   sm_scale=SCALE)
    trace = scaled.trace(block_size=100)
    assert trace.sm_scale == SCALE and torch.equal(trace.partial_out, expected.partial_out)
    assert torch.equal(traces([scaled], block_size=100)[0].final_out, expected.final_out)
    assert not torch.allclose(trace.final_out, call.trace(block_size=100).final_out)


# ----------------------------------------------------------------------------- convergence
def test_all_mass_in_the_sink_gives_zero_error_after_step_zero():
    call = sink_only_cache()
    for order in ("sink_recency", "sequential"):
        _, error = error_curve(call.trace(order=order))
        assert torch.all(error == 0), order
    curves = convergence_curves([call], orders=("sink_recency", "recency"), fractions=[0.0, 0.1, 0.5, 1.0])
    sink_first = curves[curves["order"] == "sink_recency"].set_index("loaded_fraction")
    assert sink_first.loc[0.0, "error_median"] == 1.0            # nothing loaded yet
    assert (sink_first.loc[[0.1, 0.5, 1.0], "error_q75"] == 0).all()
    newest_first = curves[curves["order"] == "recency"].set_index("loaded_fraction")
    assert newest_first.loc[0.5, "error_median"] > 0.5            # the sink is read last
    assert newest_first.loc[1.0, "error_median"] == 0


def test_recent_window_without_the_sink_misses_it_and_with_it_is_exact():
    window = recent_window_curves([sink_only_cache()], fractions=[0.25, 0.5, 1.0], sink_tokens=(0, 4))
    recent = window[window["window"] == "recent"].set_index("loaded_fraction")
    assert (recent.loc[[0.25, 0.5], "error_q25"] > 0.5).all()
    assert recent.loc[1.0, "error_q75"] < 1e-12
    with_sink = window[window["window"] == "sink4+recent"]
    assert (with_sink["error_q75"] < 1e-12).all()
    assert with_sink["loaded_fraction"].iloc[0] == pytest.approx((160 + 4) / 640)


@pytest.mark.parametrize("sm_scale", [None, SCALE])
def test_recent_window_matches_direct_attention_over_the_window(realistic, sm_scale):
    window = recent_window_curves([decode_inputs(realistic)[0]._replace(sm_scale=sm_scale)], fractions=[0.3],
                                  sink_tokens=(0, 4))
    q, k, v = realistic.q.double(), realistic.k.double(), realistic.v.double()
    keep = torch.zeros(1000, dtype=torch.bool)
    keep[-300:] = True
    keep[:4] = True
    logits = torch.einsum("bhd,bhsd->bhs", q, k.repeat_interleave(2, 1)) * (0.25 if sm_scale is None else sm_scale)
    full = torch.einsum("bhs,bhsd->bhd", torch.softmax(logits, -1), v.repeat_interleave(2, 1))
    part = torch.einsum("bhs,bhsd->bhd", torch.softmax(logits.masked_fill(~keep, float("-inf")), -1),
                        v.repeat_interleave(2, 1))
    error = ((part - full).norm(dim=-1) / full.norm(dim=-1)).flatten()
    row = window[window["window"] == "sink4+recent"].iloc[0]
    assert row["error_mean"] == pytest.approx(float(error.mean()), rel=1e-9)
    assert row["error_median"] == pytest.approx(float(error.quantile(0.5)), rel=1e-9)


def test_convergence_quantiles_are_over_heads(walks, realistic):
    fractions = torch.tensor([0.0, 0.35, 1.0], dtype=torch.float64)
    at = error_at(walks[0], fractions)
    assert at[:, 0].eq(1).all() and at[:, 2].eq(0).all()
    _, error = error_curve(walks[0])
    assert torch.equal(at[:, 1], error[..., 2].flatten())        # 0.3 <= 0.35 < 0.4
    curves = convergence_curves(realistic, orders=("sink_recency",), fractions=fractions, block_size=100)
    assert curves["error_median"].tolist()[1] == pytest.approx(float(at[:, 1].quantile(0.5)))
    assert list(curves.columns[:2]) == ["layer", "order"] and (curves["heads"] == 4).all()
    with pytest.raises(ValueError, match="orders"):
        convergence_curves(realistic, orders=("random",))


def test_convergence_curves_walk_at_the_inputs_softmax_scale(scaled):
    fractions = torch.tensor([0.2, 0.5], dtype=torch.float64)
    expected = error_at(blockwise_attention(scaled.q, scaled.k, scaled.v, block_size=100, sm_scale=SCALE), fractions)
    curves = convergence_curves([scaled], orders=("sink_recency",), fractions=fractions, block_size=100)
    assert curves["error_mean"].tolist() == pytest.approx(expected.mean(0).tolist(), rel=1e-12)
    default = convergence_curves([scaled._replace(sm_scale=None)], orders=("sink_recency",), fractions=fractions,
                                 block_size=100)
    assert default["error_mean"].tolist() != pytest.approx(curves["error_mean"].tolist(), rel=1e-3)


# ----------------------------------------------------------------------------- misalignment
def test_a_planted_high_value_low_attention_token_is_flagged():
    cache = synthetic_cache(1, 4, 2, 500, 16, value_outliers=0, heavy_hitters=0, seed=3)
    call = decode_inputs(cache)[0]
    weights = torch.softmax(torch.einsum("hd,hsd->hs", cache.q[0, :2], cache.k[0, 0].expand(2, -1, -1)) / 4, -1)
    planted = int(weights.amax(0).argsort()[100])                 # a token the scores rank low
    v = cache.v.clone()
    v[0, 0, planted] *= 1e4
    tokens = misaligned_tokens([call._replace(v=v)], top=0.2)
    row = tokens[(tokens["kv_head"] == 0) & (tokens["token"] == planted)].iloc[0]
    assert row["misaligned"] and row["top_contribution"] and row["score_rank"] > 0.2
    assert tokens[(tokens["kv_head"] == 1)]["token"].nunique() == 500


def test_aligned_rankings_have_no_misalignment_and_full_recall():
    cache = synthetic_cache(1, 4, 2, 300, 16, seed=4)
    v = torch.nn.functional.normalize(cache.v, dim=-1)            # equal value norms: contribution ~ score
    call = decode_inputs(cache)[0]._replace(v=v)
    rates = misalignment_rates([call], ks=(0.05, 0.2))
    assert (rates["misaligned_rate"] == 0).all()
    assert (rates["recall@0.05"] == 1).all() and (rates["recall@0.2"] == 1).all()
    assert list(rates["kv_head"]) == [0, 1]
    with pytest.raises(ValueError, match="top"):
        misalignment_rates([call], top=0)
    with pytest.raises(ValueError, match="layer 3"):
        misaligned_tokens([call], layer=3)


def test_misalignment_scores_at_the_inputs_softmax_scale(scaled):
    score, contribution = token_scores(scaled.q[0], scaled.k[0], scaled.v[0], 1000, sm_scale=SCALE)
    tokens = misaligned_tokens([scaled])
    assert torch.equal(torch.tensor(tokens["score"].to_numpy()), score.flatten())
    assert torch.equal(torch.tensor(tokens["contribution"].to_numpy()), contribution.flatten())
    rates = misalignment_rates([scaled], top=0.05)
    assert rates["misaligned_rate"].tolist() == misaligned_fraction(score, contribution, 0.05).tolist()
    default, _ = token_scores(scaled.q[0], scaled.k[0], scaled.v[0], 1000)
    assert not torch.allclose(score, default)
    with pytest.raises(TypeError, match="seqlen must be an int, got float"):
        token_scores(scaled.q[0], scaled.k[0], scaled.v[0], 3.5)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        token_scores(scaled.q[0].tolist(), scaled.k[0], scaled.v[0], 1000)
    with pytest.raises(TypeError, match="trace must be the BlockTrace of q, k, v .*got str"):
        truncation_report("x", scaled.q, scaled.k, scaled.v, torch.zeros(1, 4, dtype=torch.long))


# ----------------------------------------------------------------------------- sensitivity
def test_threshold_grid_rows_equal_single_evaluations(walks):
    grid = threshold_grid(walks, [1e-3, 1e-5], [1e-4], [2, 4])
    assert list(zip(grid["tau"], grid["patience"])) == [(1e-3, 2), (1e-3, 4), (1e-5, 2), (1e-5, 4)]
    rule = ARTConfig(tau=1e-5, phi=1e-4, patience=4)
    single = stop(walks[0], rule)
    oracle = stop(walks[0], Oracle(0.01))
    assert grid["loaded_fraction"].iloc[3] == pytest.approx(float(single.loaded_fraction.mean()))
    assert grid["false_stop_rate"].iloc[3] == pytest.approx(
        float((single.stop_step < oracle.stop_step).double().mean()))
    best = pick_default(grid, max_p99_error=1.0)
    assert best["loaded_fraction"] == grid["loaded_fraction"].min()
    with pytest.raises(ValueError, match="no setting"):
        pick_default(grid, max_p99_error=-1.0)
    assert choose_setting(grid, max_p99_error=-1.0)["within_bound"] is False
    with pytest.raises(ValueError, match="the grid's table is empty"):
        choose_setting(grid.iloc[:0])
    for bound in (float("nan"), "0.1"):             # NaN would meet no setting and fall back without a word
        with pytest.raises(ValueError, match="max_p99_error must be a finite number"):
            choose_setting(grid, max_p99_error=bound)
    with pytest.raises(TypeError, match="rows must be the DataFrame of threshold_grid, got list"):
        choose_setting([1, 2])
    with pytest.raises(ValueError, match=r"rows lack the column\(s\) \['rel_error_p99'\] of threshold_grid"):
        choose_setting(grid.drop(columns="rel_error_p99"))


def test_false_stops_are_the_heads_stopped_before_the_oracle(walks):
    grid = threshold_grid(walks, [1.0], [1.0], [1], base=ARTConfig(min_steps=0))
    stops = stop(walks[0], ARTConfig(tau=1.0, phi=1.0, patience=1, min_steps=0)).stop_step
    assert torch.all(stops == 1)                                   # the first step with a previous probe
    early = stops < stop(walks[0], Oracle(0.01)).stop_step
    assert grid["false_stop_rate"].iloc[0] == pytest.approx(float(early.double().mean()))
    assert grid["false_stop_rate"].iloc[0] > 0


def test_baseline_sweep_and_pareto_front(walks):
    sweep = baseline_sweep(walks, eps=(0.1, 0.01), gammas=(0.9,), steps=(1, 10))
    assert list(sweep["family"]) == ["Oracle", "Oracle", "MassCoverage", "FixedBudget", "FixedBudget"]
    assert sweep.set_index("parameter").loc[10, "loaded_fraction"] == 1.0
    coverage = stop(walks[0], MassCoverage(0.9))
    assert sweep["loaded_fraction"].iloc[2] == pytest.approx(float(coverage.loaded_fraction.mean()))
    rows = pd.DataFrame(dict(family=["a"] * 4 + ["b"], loaded_fraction=[0.1, 0.2, 0.3, 0.4, 0.5],
                             rel_error_p99=[0.5, 0.6, 0.1, 0.2, 0.9]))
    front = pareto_front(rows)
    assert list(front.index) == [0, 2, 4]


# ----------------------------------------------------------------------------- ablation
def test_ablation_rows_are_their_variants(walks):
    table = ablation_table(walks)
    variants = ablation_variants()
    assert list(table["variant"]) == list(variants)
    for _, row in table.iterrows():
        expected = stop(walks[0], variants[row["variant"]]).loaded_fraction.mean()
        assert row["loaded_fraction"] == pytest.approx(float(expected))
    assert variants["mma_probe"].probe_dims == "mma" and variants["no_patience"].patience == 1
    assert table["loaded_vs_full"].iloc[0] == 1.0
    patience_one = table.set_index("variant").loc["no_patience"]
    assert patience_one["loaded_fraction"] <= table["loaded_fraction"].iloc[0]


# ----------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("preset", ["diffuse", "realistic", "peaked"])
def test_bounds_hold_on_random_caches(preset):
    cache = synthetic_cache(2, 6, 2, 700, 16, preset=preset, seed=7)
    calls = [decode_inputs(cache)[0]._replace(cache_seqlens=torch.tensor([700, 333]))]
    rules = {"art": ARTConfig(tau=1e-2, phi=1e-4, patience=2), "fixed_2": FixedBudget(2), "mass": MassCoverage(0.8)}
    table = bound_table(calls, rules)
    assert len(table) == 3 * 2 * 6
    assert table[["bound_mean_holds", "bound_max_value_holds", "bound_certified_holds"]].all().all()
    assert (table["identity_residual"] < 1e-10).all()
    summary = bound_summary(table).set_index("rule")
    assert summary.loc["fixed_2", "truncated"] == 12 and summary.loc["fixed_2", "bound_mean_holds"] == 1.0
    assert summary.loc["fixed_2", "bound_mean_tightness_median"] >= 1.0


def test_bounds_hold_on_a_captured_layer():
    table = bound_table(captured_inputs(), bound_rules(ARTConfig()))
    truncated = table[table["rho"] > 0]
    assert len(truncated) > 0
    assert table[["bound_mean_holds", "bound_max_value_holds", "bound_certified_holds"]].all().all()


def test_bound_table_walks_at_the_inputs_softmax_scale(scaled):
    rule = FixedBudget(3)
    table = bound_table([scaled], {"fixed_3": rule}, block_size=100)
    trace = blockwise_attention(scaled.q, scaled.k, scaled.v, block_size=100, sm_scale=SCALE)
    report = truncation_report(trace, scaled.q, scaled.k, scaled.v, stop(trace, rule).stop_step)
    assert table["error"].tolist() == pytest.approx(report.error.flatten().tolist(), rel=1e-12)
    assert table["rho"].tolist() == pytest.approx(report.rho.flatten().tolist(), rel=1e-12)
    default = bound_table([scaled._replace(sm_scale=None)], {"fixed_3": rule}, block_size=100)
    assert default["error"].tolist() != pytest.approx(table["error"].tolist(), rel=1e-3)


def test_a_violated_bound_is_reported():
    table = bound_table(captured_inputs(1), {"fixed_1": FixedBudget(1)})
    table.loc[0, "bound_mean_holds"] = False
    assert bound_summary(table)["bound_mean_holds"].iloc[0] < 1
    with pytest.raises(ValueError, match=r"rows lack the column\(s\) \['rule'\] of bound_table"):
        bound_summary(table.drop(columns="rule"))
    with pytest.raises(TypeError, match="art must be an ARTConfig .*got str"):
        bound_rules("x")


# ----------------------------------------------------------------------------- composition
def test_composition_table_per_policy(realistic):
    table = compose_with_art(realistic, ["dense", "streaming:budget=0.5"],
                             art=ARTConfig(tau=1e-2, phi=1e-4, patience=2))
    assert list(table["policy"]) == ["dense", "streaming:budget=0.5"]
    dense = table.iloc[0]
    assert dense["kept_fraction"] == 1 and dense["policy_error"] == 0
    assert dense["loaded_fraction"] == pytest.approx(dense["art_loaded_of_kept"])
    with pytest.raises(ValueError, match="policy spec"):
        compose_with_art(realistic, [])
    for art in ("x", ARTConfig().kernel_params()):                 # named before the first walk
        with pytest.raises(TypeError, match=r"art must be an ARTConfig \(or None for ARTConfig\(\)\), got"):
            compose_with_art(realistic, ["dense"], art=art)


def test_composition_walks_and_scores_at_the_inputs_softmax_scale(scaled):
    art = ARTConfig(tau=1e-2, phi=1e-4, patience=2)
    table = compose_with_art([scaled], ["coverage:gamma=0.8"], art=art, block_size=100).iloc[0]
    policy = policies.make("coverage", gamma=0.8, sm_scale=SCALE)
    dense = blockwise_attention(scaled.q, scaled.k, scaled.v, block_size=100, sm_scale=SCALE).final_out
    walk = simulate_policy(policy, scaled.q, scaled.k, scaled.v, queries=scaled.queries, block_size=100,
                           sm_scale=SCALE)
    result = stop(walk.trace, art)
    total = (result.output - dense).norm(dim=-1) / dense.norm(dim=-1)
    assert table["total_error"] == pytest.approx(float(total.mean()), rel=1e-12)
    kept = walk.trace.block_tokens.sum(-1).double().repeat_interleave(2, dim=1) / 1000
    assert table["kept_fraction"] == pytest.approx(float(kept.mean()), rel=1e-12)
    default = compose_with_art([scaled._replace(sm_scale=None)], ["coverage:gamma=0.8"], art=art,
                               block_size=100).iloc[0]
    assert default["kept_fraction"] != pytest.approx(table["kept_fraction"], rel=1e-3)


def test_composition_takes_policy_objects_and_a_list_of_specs_only(realistic):
    art = ARTConfig(tau=1e-2, phi=1e-4, patience=2)
    policy = policies.make("streaming", budget=0.5, sink_tokens=64)
    table = compose_with_art(realistic, ["dense", policy], art=art)
    assert list(table["policy"]) == ["dense", policy.spec]
    by_spec = compose_with_art(realistic, ["dense", policy.spec], art=art)
    pd.testing.assert_frame_equal(table, by_spec)
    with pytest.raises(TypeError, match=r"a list of policy specs, e.g. \['snapkv:budget=0.2'\], not one string"):
        compose_with_art(realistic, "snapkv:budget=0.2")
    with pytest.raises(ValueError, match=r"order must be one of \('sequential', 'recency', 'sink_recency'\)"):
        compose_with_art(realistic, ["dense"], order="importance")


# ----------------------------------------------------------------------------- commands
FIGURES = ("convergence", "recent_window", "misalignment", "misalignment_rates", "sensitivity_heatmaps",
           "sensitivity_patience", "pareto", "false_stops", "ablation", "bounds", "composition")


def test_figures_command_writes_every_figure_and_table(tmp_path, capsys):
    (tmp_path / "no-results").mkdir()
    assert main(["figures", "--synthetic", "realistic", "--quick", "--benchmarks", str(tmp_path / "no-results"),
                 "--out", str(tmp_path)]) == 0
    for name in FIGURES:
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000, name
        assert (tmp_path / f"{name}.pdf").stat().st_size > 1_000, name
    studies = json.loads((tmp_path / "studies.json").read_text())
    assert {"convergence", "grid", "ablation", "bounds_summary", "composition", "chosen"} <= set(studies)
    assert all(row["bound_mean_holds"] == 1.0 for row in studies["bounds_summary"])
    assert "truncation bounds" in capsys.readouterr().out
    assert not list(tmp_path.glob(".*tmp*"))


def test_figures_command_names_a_damaged_benchmark_result_before_writing_anything(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    (results / "2026-12-01-art-decode.json").write_text("{\"rows\": []}")
    (results / "2026-12-02-art-decode.json").write_text("{\"rows\": [")
    out = tmp_path / "out"
    assert main(["figures", "--synthetic", "realistic", "--quick", "--benchmarks", str(results),
                 "--out", str(out)]) == 2
    assert "stored art-decode result" in (err := capsys.readouterr().err) and "2026-12-02-art-decode.json" in err
    assert "is not valid JSON" in err
    assert not any(out.iterdir())
    (results / "2026-12-02-art-decode.json").write_text("{\"summary\": {}}")
    assert main(["figures", "--synthetic", "realistic", "--quick", "--benchmarks", str(results),
                 "--out", str(out)]) == 2
    assert "2026-12-02-art-decode.json lacks rows" in capsys.readouterr().err


def _no_work(*args, **kwargs):
    raise AssertionError("the work started before the inputs were checked")


DECODE_ROW = {"impl": "art", "data": "synthetic", "batch": 1, "seqlen": 4096, "ms": 0.1, "tb_per_s": 1.0,
              "loaded_fraction": 0.5}
DECODE_RESULT = {"suite": "decode", "device": "GPU", "date": "2026-12-05", "copy_ceiling_tb_per_s": 3.0,
                 "rows": [DECODE_ROW]}


@pytest.mark.parametrize("kind, payload, message", [
    ("art-decode", {"rows": [{"foo": 1}]}, "lacks copy_ceiling_tb_per_s, device, date, suite"),
    ("art-decode", {**DECODE_RESULT, "suite": "flexprefill"}, "is a result of the suite 'flexprefill', not 'decode'"),
    ("art-decode", {**DECODE_RESULT, "rows": [{**DECODE_ROW, "impl": "art_dense"}, {"impl": "art", "ms": 0.1}]},
     ": rows[1] lacks data, batch, seqlen, tb_per_s"),
    ("art-decode", {**DECODE_RESULT, "rows": [{k: v for k, v in DECODE_ROW.items() if k != "loaded_fraction"}]},
     ": rows[0] lacks loaded_fraction"),
    ("art-decode", {**DECODE_RESULT, "paged": [{"impl": "art", "page_size": 64, "over_contiguous": 1.1}]},
     ": paged[0] lacks batch, seqlen"),
    ("art-decode-loop", {"suite": "decode-loop", "loops": [{"seqlen": 8192, "rows": [{"impl": "art", "ms": 0.1}]}]},
     ": loops[0].rows[0] lacks step"),
    ("art-decode-walk-persistence", {"walks": [], "summary": {"rank_correlation": 0.5}},
     ": summary lacks split_choice_agreement"),
    ("flexprefill", {"suite": "flexprefill", "rows": [{"method": "sdpa", "data": "structured", "seqlen": 1024}]},
     ": rows[0] lacks ms"),
    ("flexprefill", {"suite": "flexprefill", "rows": [{"method": "sdpa", "data": "structured", "seqlen": 1024,
                                                       "ms": None}]},
     ": rows[0].ms must be a finite number, got None"),
    ("flexprefill", {"suite": "flexprefill", "rows": [{"method": "flexprefill", "data": "structured",
                                                       "seqlen": 1024, "ms": 1.0, "gamma": "0.9"}]},
     ": rows[0].gamma must be a finite number, got '0.9'"),
    ("art-decode", {**DECODE_RESULT, "copy_ceiling_tb_per_s": True}, ": copy_ceiling_tb_per_s must be a finite number"),
    ("art-decode", {**DECODE_RESULT, "rows": [{**DECODE_ROW, "loaded_fraction": "half"}]},
     ": rows[0].loaded_fraction must be a finite number, got 'half'"),
])
def test_benchmark_results_are_checked_for_every_entry_their_figures_read(kind, payload, message, tmp_path,
                                                                          monkeypatch, capsys):
    from art_analysis.cli import figures
    from art_analysis.cli.figures import read_benchmark_results

    results = tmp_path / "results"
    results.mkdir()
    (results / f"2099-01-01-{kind}.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=f"stored {kind} result .*2099-01-01-{kind}.json"):
        read_benchmark_results(results)
    monkeypatch.setattr(figures, "synthetic_cache", _no_work)
    out = tmp_path / "out"
    assert main(["figures", "--synthetic", "realistic", "--quick", "--benchmarks", str(results),
                 "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not any(out.iterdir())


def test_an_incomplete_benchmark_result_is_named_in_a_note(tmp_path, capsys):
    from art_analysis.cli.figures import read_benchmark_results

    results = tmp_path / "results"
    results.mkdir()
    (results / "2099-01-01-art-decode.json").write_text(json.dumps({**DECODE_RESULT, "complete": False}))
    assert read_benchmark_results(results)["art-decode"]["complete"] is False
    assert f"note: {results / '2099-01-01-art-decode.json'} is an incomplete run" in capsys.readouterr().out


def test_a_benchmarks_folder_that_is_not_one_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    from art_analysis.cli import figures, reproduce
    from art_analysis.cli.report import _gpu_section
    from kernels.results_io import RESULTS_DIR

    monkeypatch.setattr(figures, "synthetic_cache", _no_work)
    monkeypatch.setattr(reproduce, "synthetic_cache", _no_work)
    (tmp_path / "file").write_text("")
    for benchmarks in (tmp_path / "typo", tmp_path / "file"):
        for command in (["figures", "--synthetic", "realistic"], ["reproduce", "--synthetic-only"]):
            assert main([*command, "--quick", "--benchmarks", str(benchmarks), "--out", str(tmp_path / "out")]) == 2
            assert f"error: --benchmarks '{benchmarks}' is not a folder" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)                       # outside a checkout the default folder is missing: no figures
    assert figures.read_benchmark_results(RESULTS_DIR) == {}
    lines = "\n".join(_gpu_section({"flexprefill": [], "benchmarks": {}}))
    assert "No GPU results in the `--benchmarks` folder" in lines and "benchmarks/results" not in lines


def test_studies_refuse_inputs_too_short_for_the_policy_study_before_any_work(monkeypatch):
    from art_analysis.analysis.composition import DEFAULT_POLICIES
    from art_analysis.cli import figures

    def inputs(seqlen):
        gen = torch.Generator().manual_seed(0)
        return [DecodeInput(torch.randn(1, 4, 8, generator=gen), torch.randn(1, 2, seqlen, 8, generator=gen),
                            torch.randn(1, 2, seqlen, 8, generator=gen), torch.tensor([seqlen]),
                            torch.randn(1, 4, 2, 8, generator=gen), layer, 2) for layer in (0, 1)]

    monkeypatch.setattr(figures, "tqdm", _no_work)
    with pytest.raises(ValueError, match=r"short holds 159 cached tokens at decode step -1; the study of the "
                                         r"built-in KV-selection policies needs at least 160 "):
        figures.run_studies(inputs(159), "short")
    assert len(compose_with_art(inputs(160))) == len(DEFAULT_POLICIES)      # the minimum is exact


@pytest.mark.parametrize("argv, message", [
    (["evaluate", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["evaluate", "--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
    (["evaluate", "--backend", "kernel", "--group", "head"], "leave out --group head or use --backend simulator"),
    (["evaluate", "--backend", "kernel_single_walk", "--block-size", "32"],
     "walks 64-token blocks in the sink_recency order; got --block-size 32 --order sink_recency"),
    (["evaluate", "--backend", "kernel", "--order", "importance"], "got --block-size 64 --order importance"),
    (["capture", "--depth", "2", "--source", "passkey"], "--depth must lie in [0, 1], got 2.0"),
    (["reproduce", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["reproduce", "--decode-steps", "0"], "--decode-steps must be >= 1, got 0"),
    (["reproduce", "--context", "0"], "--context must be at least 256 tokens, got 0"),
])
def test_commands_check_their_options_before_loading_the_model(argv, message, tmp_path, monkeypatch, capsys):
    from art_analysis import models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(models, "load_model", no_model)
    out = ["--out", str(tmp_path / "out")] if argv[0] in ("capture", "reproduce") else []
    assert main(argv + out) == 2
    assert message in capsys.readouterr().err


def test_commands_check_the_context_against_the_models_positions_before_loading_it(tmp_path, monkeypatch, capsys):
    from art_analysis import models

    def loaded(*args, **kwargs):
        raise ValueError("past the position check")

    monkeypatch.setattr(models, "load_model", loaded)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 300}))
    out = ["--model", str(model), "--out", str(tmp_path / "out")]
    # (options that need 301 positions, their message), then options that need exactly 300
    for over, message, fits in (
            (["capture", "--context", "301", *out], "--context 301 needs 301 positions", ["capture", "--context",
                                                                                          "300", *out]),
            (["evaluate", "--model", str(model), "--context", "290", "--max-new-tokens", "12"],
             "--context 290 with --max-new-tokens 12 needs 301 positions",
             ["evaluate", "--model", str(model), "--context", "290", "--max-new-tokens", "11"]),
            (["reproduce", "--context", "292", *out], "--context 292 with the retrieval's 10 new tokens needs 301 "
                                                      "positions", ["reproduce", "--context", "291", *out])):
        assert main(over) == 2
        assert f"{message}, past the model's maximum (max_position_embeddings=300)" in capsys.readouterr().err
        assert main(fits) == 2
        assert "past the position check" in capsys.readouterr().err


def test_capture_layer_lists_are_indices(capsys):
    with pytest.raises(SystemExit):
        main(["capture", "--prefill-layers", "0,-1", "--out", "x"])
    assert "layer indices must be >= 0, got '0,-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["capture", "--prefill-layers", ",,", "--out", "x"])
    assert "layer indices like 0,15,29, got ',,'" in capsys.readouterr().err


def test_figures_command_needs_one_source(capsys):
    assert main(["figures"]) == 2
    assert "exactly one of --capture" in capsys.readouterr().err
    assert main(["figures", "--synthetic", "realistic", "--step", "3"]) == 2
    assert "--step chooses a decode step of a capture; pass --capture DIR" in capsys.readouterr().err


def test_reproduce_quick_writes_every_expected_file(tmp_path, capsys):
    from art_analysis.cli.report import render_report

    assert main(["reproduce", "--quick", "--synthetic-only", "--out", str(tmp_path)]) == 0
    expected = FIGURES + ("flexprefill_patterns", "flexprefill_kept_vs_gamma", "flexprefill_error_vs_gamma")
    for name in expected:
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000, name
        assert (tmp_path / f"{name}.pdf").exists(), name
    report = (tmp_path / "REPORT.md").read_text()
    for heading in ("## The project defaults", "## Stopping rules", "## Convergence", "## Attention score",
                    "## Ablations", "## Truncation error", "## KV-selection policies", "## Retention",
                    "## FlexPrefill", "## GPU benchmarks"):
        assert heading in report, heading
    assert "hold for every head" in report
    results = json.loads((tmp_path / "reproduce.json").read_text())
    assert results["second_source"] == "synthetic-realistic-seed1" and results["second_check"]
    assert set(pd.DataFrame(results["studies"]["convergence"])["order"]) == {
        "sequential", "recency", "sink_recency", "importance"}
    assert render_report(results) == report                      # the report re-renders from the JSON
    assert not list(tmp_path.glob(".*tmp*"))


def test_reproduce_quick_on_the_model_runs_the_whole_pipeline(loaded, monkeypatch, tmp_path):
    from art_analysis import models

    monkeypatch.setattr(models, "load_model", lambda name: loaded)
    out = tmp_path / "figures"
    assert main(["reproduce", "--quick", "--context", "512", "--captures", str(tmp_path / "captures"),
                 "--out", str(out)]) == 0
    results = json.loads((out / "reproduce.json").read_text())
    assert (results["main_source"], results["second_source"]) == ("smollm2-stdlib", "smollm2-docs")
    assert sorted(p.name for p in (tmp_path / "captures").iterdir()) == [
        "smollm2-docs-s0-c512-d4", "smollm2-stdlib-s0-c512-d4-p0_15_29"]
    retention = pd.DataFrame(results["retention"])
    assert set(retention["task"]) == {"passkey", "niah"} and set(retention["order"]) == {"sink_recency", "importance"}
    dense = retention[retention["rule"] == "dense"]
    assert (dense["token_agreement"] == 1).all() and (dense["kl_max"] == 0).all()
    assert (out / "retention.png").exists() and (out / "retention.pdf").exists()
    layers = {row["layer"] for row in results["studies"]["misalignment_rates"]}
    assert layers == set(range(loaded.config.num_hidden_layers))
    assert "## Retention: retrieval with the rule inside decoding" in (out / "REPORT.md").read_text()


def test_benchmark_figures_and_summaries_take_the_newest_result_of_each_suite(tmp_path):
    """``reproduce`` draws the kernel-speed, decode-loop and walk-persistence figures from the newest results of
    their kinds, and lists each suite's summary in the report: the decode loop's per loop (``"<batch>x<seqlen>
    <key>"``, without the per-implementation totals); an older loop result and a kept copy (``-v1``) are not read."""
    from art_analysis.cli.figures import draw_benchmark_figures, read_benchmark_results
    from art_analysis.cli.reproduce import _benchmark_summaries
    from art_analysis.cli.report import _gpu_section

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    folder = tmp_path / "results"
    folder.mkdir()
    loop = json.loads((results / "2026-12-04-art-decode-loop.json").read_text())
    (folder / "2026-12-04-art-decode-loop.json").write_text(json.dumps(loop))
    stale = {**loop, "summary": {"1x1": {"default_over_dense": 9.0}}}
    for name in ("2026-12-01-art-decode-loop.json", "2026-12-05-art-decode-loop-v1.json"):
        (folder / name).write_text(json.dumps(stale))
    for name in ("2026-12-04-art-decode.json", "2026-12-02-art-decode-walk-persistence.json"):
        (folder / name).write_text((results / name).read_text())

    figures = draw_benchmark_figures(read_benchmark_results(folder), tmp_path)
    assert set(figures) == {"kernel_speed", "decode_loop", "walk_persistence"}
    for name in figures:
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000 and (tmp_path / f"{name}.pdf").exists(), name

    summaries = _benchmark_summaries(folder)
    assert set(summaries) == {"art-decode", "art-decode-loop"}
    flat = summaries["art-decode-loop"]["summary"]
    expected = {f"{shape} {key}": value for shape, numbers in loop["summary"].items() for key, value in numbers.items()
                if key != "total_ms"}
    assert flat == expected and "32x32768 on_demand_over_dense" in flat
    lines = "\n".join(_gpu_section({"flexprefill": [], "benchmarks": summaries}))
    assert "`2026-12-04-art-decode-loop.json`" in lines and "128x32768 calibrated_over_dense = " in lines
    assert "1x1" not in lines
