import numpy as np
import pytest
import torch

from art_analysis.blockwise import BlockTrace, blockwise_attention
from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import (ARTConfig, FixedBudget, MassCoverage, Oracle, kernel_walk_steps,
                                      mma_probe_dims, one_minus_cos, replay_kernel_walks, stop, sweep)


def hand_trace(outputs, kv_heads=1, steps_per_kv=None, accumulator=None, block_mass=None):
    """A BlockTrace whose partial outputs are the given ``[B, Hq, T, D]`` vectors (64-token blocks)."""
    outputs = torch.as_tensor(outputs, dtype=torch.float64)
    batch, heads, steps, dim = outputs.shape
    block_ids = torch.arange(steps).expand(batch, kv_heads, steps).clone()
    if steps_per_kv is not None:
        for (b, kv), n in steps_per_kv.items():
            block_ids[b, kv, n:] = -1
    tokens = torch.where(block_ids >= 0, 64, 0)
    zeros = torch.zeros(batch, heads, steps, dtype=torch.float64)
    mass = zeros + 1.0 / steps if block_mass is None else torch.as_tensor(block_mass, dtype=torch.float64)
    return BlockTrace(partial_out=outputs, accumulator=outputs if accumulator is None else accumulator,
                      running_max=zeros, running_sum=zeros + 1, block_mass=mass, block_contribution=zeros,
                      block_ids=block_ids, block_tokens=tokens, num_steps=(block_ids >= 0).sum(-1).amax(-1),
                      final_out=outputs[:, :, -1], block_size=64, sm_scale=1.0, mode="exact")


def scaled_walk(scales, direction=(1.0, 0.0)):
    """One head whose output at step t is scales[t] * direction: ``[1, 1, T, 2]``."""
    return torch.tensor([[[[s * direction[0], s * direction[1]] for s in scales]]])


def test_art_stops_at_the_step_where_patience_is_reached():
    # Relative scale changes: steps 1, 2 unstable (50%, 33%); steps 3.. change by 1e-6.
    scales = [1.0, 1.5, 2.0, 2.000002, 2.000004, 2.000006, 2.000008, 2.00001, 2.000012]
    trace = hand_trace(scaled_walk(scales))
    result = stop(trace, ARTConfig(tau=1e-4, phi=1e-3, patience=3))
    assert result.stop_step.item() == 5  # stable at steps 3, 4, 5
    assert stop(trace, ARTConfig(tau=1e-4, phi=1e-3, patience=1)).stop_step.item() == 3
    assert stop(trace, ARTConfig(tau=1e-4, phi=1e-3, patience=6)).stop_step.item() == 8
    # Patience 7 is never reached: the walk visits every block.
    assert stop(trace, ARTConfig(tau=1e-4, phi=1e-3, patience=7)).stop_step.item() == 8


def test_patience_counter_resets_on_an_unstable_step():
    scales = [1.0, 1.0, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5]
    trace = hand_trace(scaled_walk(scales))
    # Steps 1, 2 stable, step 3 unstable (reset), then 4, 5, 6 stable.
    assert stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=3)).stop_step.item() == 6
    assert stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=2)).stop_step.item() == 2


def test_min_steps_keeps_early_steps_from_counting():
    trace = hand_trace(scaled_walk([1.0] * 10))
    assert stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=2, min_steps=1)).stop_step.item() == 2
    assert stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=2, min_steps=5)).stop_step.item() == 6
    assert stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=2, min_steps=0)).stop_step.item() == 2


def test_direction_test_catches_a_rotation_the_scale_test_misses():
    angles = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3])
    walk = torch.stack([torch.cos(angles), torch.sin(angles)], -1)[None, None]
    trace = hand_trace(walk)
    both = ARTConfig(tau=1e-3, phi=1e-3, patience=3)
    assert stop(trace, both).stop_step.item() == 6   # rotation at step 3 resets the counter
    no_direction = ARTConfig(tau=1e-3, phi=1e-3, patience=3, use_direction=False)
    assert stop(trace, no_direction).stop_step.item() == 3  # norms never change
    no_scale = ARTConfig(tau=1e-3, phi=1e-3, patience=3, use_scale=False)
    assert stop(trace, no_scale).stop_step.item() == 6


def test_one_minus_cos_keeps_its_precision_near_one_in_fp32():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=gen, dtype=torch.float64)
    noise = torch.randn(256, 128, generator=gen, dtype=torch.float64) / 128 ** 0.5
    y = x * 1.003 + 1.5e-3 * x.norm(dim=-1, keepdim=True) * noise
    exact = 1 - (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))              # ~1e-6, in float64
    x32, y32 = x.float(), y.float()
    stable = one_minus_cos(x32, y32, x32.norm(dim=-1), y32.norm(dim=-1)).double()
    quotient = 1 - (x32 * y32).sum(-1) / (x32.norm(dim=-1) * y32.norm(dim=-1))
    stable_error = ((stable - exact).abs() / exact).max()
    assert exact.median() < 3e-6 and stable_error < 1e-3
    assert ((quotient.double() - exact).abs() / exact).median() > 20 * stable_error   # the quotient's cancellation
    zero = torch.zeros(3, 128)
    assert one_minus_cos(zero, x32[:3], zero.norm(dim=-1), x32[:3].norm(dim=-1)).tolist() == [1.0, 1.0, 1.0]


def test_absolute_scale_and_accumulator_probe():
    outputs = scaled_walk([1.0] * 6)
    accumulator = scaled_walk([10.0, 20.0, 20.05, 20.1, 20.15, 20.2])
    trace = hand_trace(outputs, accumulator=accumulator)
    relative = ARTConfig(tau=3e-3, phi=1e-3, patience=2, probe_source="accumulator")
    absolute = ARTConfig(tau=3e-3, phi=1e-3, patience=2, probe_source="accumulator", scale="absolute")
    assert stop(trace, relative).stop_step.item() == 3     # 0.05 / 20 = 2.5e-3 < tau from step 2
    assert stop(trace, absolute).stop_step.item() == 5     # |0.05| > tau: never stable
    assert stop(trace, ARTConfig(tau=3e-3, phi=1e-3, patience=2)).stop_step.item() == 2


def test_mma_probe_dims_see_only_their_dims():
    assert mma_probe_dims(16).tolist() == [0, 1, 8, 9]
    assert mma_probe_dims(128).numel() == 32
    walk = torch.zeros(1, 1, 6, 16, dtype=torch.float64)
    walk[..., 0] = 1.0
    walk[0, 0, 2:, 4] = 5.0  # a jump at step 2 in a dim outside the mma probe
    trace = hand_trace(walk)
    full = ARTConfig(tau=1e-3, phi=1e-3, patience=2)
    mma = ARTConfig(tau=1e-3, phi=1e-3, patience=2, probe_dims="mma")
    explicit = ARTConfig(tau=1e-3, phi=1e-3, patience=2, probe_dims=torch.tensor([4]))
    assert stop(trace, mma).stop_step.item() == 2
    assert stop(trace, full).stop_step.item() == 4
    assert stop(trace, explicit).stop_step.item() == 4


def test_group_all_waits_for_every_head_and_head_lets_each_stop():
    fast = [1.0] * 10
    slow = [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    walk = torch.cat([scaled_walk(fast), scaled_walk(slow)], dim=1)   # two query heads, one KV head
    trace = hand_trace(walk)
    per_head = stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=2, group="head")).stop_step
    assert per_head.tolist() == [[2, 6]]
    grouped = stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=2, group="all")).stop_step
    assert grouped.tolist() == [[6, 6]]
    # A head that is done stays done: the fast head becoming unstable later does not matter.
    fast_then_jump = [1.0, 1.0, 1.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0]
    trace = hand_trace(torch.cat([scaled_walk(fast_then_jump), scaled_walk(slow)], dim=1))
    assert stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=2)).stop_step.tolist() == [[6, 6]]


def test_groups_are_formed_per_kv_head():
    walks = [scaled_walk([1.0] * 8), scaled_walk([1.0] * 8),
             scaled_walk([1, 2, 3, 4, 5, 6, 6, 6]), scaled_walk([1.0] * 8)]
    trace = hand_trace(torch.cat(walks, dim=1), kv_heads=2)
    assert stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=2)).stop_step.tolist() == [[2, 2, 7, 7]]


def test_padded_steps_never_count_and_stop_is_clamped_to_the_walk():
    walk = torch.cat([scaled_walk([1.0] * 6), scaled_walk([1.0] * 6)], dim=0)  # B=2
    trace = hand_trace(walk, steps_per_kv={(1, 0): 3})
    result = stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=3))
    assert result.stop_step.tolist() == [[3], [2]]
    assert result.loaded_fraction.tolist() == [[4 / 6], [1.0]]


def test_a_single_block_walk_stops_at_step_zero():
    cache = synthetic_cache(1, 4, 2, 50, 16)
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64)
    assert trace.partial_out.shape[2] == 1
    for rule in (ARTConfig(), ARTConfig(patience=1, min_steps=0), Oracle(0.0), MassCoverage(0.5), FixedBudget(3)):
        result = stop(trace, rule)
        assert torch.all(result.stop_step == 0) and torch.all(result.loaded_fraction == 1.0)


def test_zero_thresholds_never_stop():
    cache = synthetic_cache(2, 4, 2, 2048, 32, preset="peaked")
    for mode in ("exact", "kernel"):
        trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64, mode=mode)
        for rule in (ARTConfig(tau=0.0, phi=0.0, patience=1), ARTConfig.paper(tau=0.0, phi=0.0),
                     ARTConfig(tau=0.0, phi=0.0, patience=1, group="head")):
            result = stop(trace, rule)
            assert torch.equal(result.stop_step, trace.steps_per_head - 1)
            assert torch.all(result.loaded_fraction == 1.0)
            assert torch.all(result.rel_error == 0)


def test_oracle_is_the_first_step_after_which_the_error_stays_below_eps():
    cache = synthetic_cache(1, 4, 2, 1024, 16, preset="realistic", seed=3)
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=32)
    for eps in (0.3, 0.05, 0.01, 0.0):
        result = stop(trace, Oracle(eps))
        deviation = (trace.partial_out - trace.final_out[:, :, None]).norm(dim=-1)
        errors = deviation / trace.final_out.norm(dim=-1)[..., None]
        for h in range(4):
            t = int(result.stop_step[0, h])
            assert torch.all(errors[0, h, t:] <= eps)
            if t > 0:
                assert errors[0, h, t - 1] > eps
        assert torch.all(result.rel_error <= eps + 1e-15)


def test_mass_coverage_and_fixed_budget():
    mass = torch.tensor([[[0.5, 0.2, 0.2, 0.05, 0.05]]], dtype=torch.float64)
    trace = hand_trace(scaled_walk([1.0, 2.0, 3.0, 4.0, 5.0]), block_mass=mass)
    assert stop(trace, MassCoverage(0.5)).stop_step.item() == 0
    assert stop(trace, MassCoverage(0.85)).stop_step.item() == 2
    assert stop(trace, MassCoverage(1.0)).stop_step.item() == 4
    assert stop(trace, FixedBudget(2)).stop_step.item() == 1
    assert stop(trace, FixedBudget(50)).stop_step.item() == 4


def test_stop_result_output_and_errors():
    cache = synthetic_cache(1, 2, 1, 512, 16, seed=7)
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64, order="sequential")
    result = stop(trace, FixedBudget(3))
    # Attention over the first 3 blocks only.
    k, v, q = cache.k[0, 0, :192].double(), cache.v[0, 0, :192].double(), cache.q[0].double()
    expected = torch.softmax(q @ k.T / 4.0, dim=-1) @ v
    assert torch.allclose(result.output[0], expected, atol=1e-12)
    assert torch.allclose(result.loaded_fraction, torch.full((1, 2), 192 / 512, dtype=torch.float64))
    rel = (expected - trace.final_out[0]).norm(dim=-1) / trace.final_out[0].norm(dim=-1)
    assert torch.allclose(result.rel_error[0], rel)
    cos = torch.nn.functional.cosine_similarity(expected, trace.final_out[0], dim=-1)
    assert torch.allclose(result.cos_error[0], 1 - cos)


def test_sweep_equals_rules_evaluated_one_at_a_time():
    cache = synthetic_cache(2, 6, 2, 3000, 32, preset="realistic")
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64, mode="kernel")
    rules = [ARTConfig(), ARTConfig.paper(), ARTConfig(tau=1e-3, phi=1e-4, patience=4, group="head"),
             ARTConfig(use_scale=False), ARTConfig(use_direction=False), ARTConfig(patience=1),
             ARTConfig(probe_dims="mma", probe_source="accumulator"), Oracle(0.02), MassCoverage(0.9),
             MassCoverage(0.8, group="all"), FixedBudget(5)]
    result = sweep(trace, rules)
    assert result.stop_step.shape == (len(rules), 2, 6)
    for i, rule in enumerate(rules):
        single = stop(trace, rule)
        assert torch.equal(result.stop_step[i], single.stop_step)
        assert torch.equal(result.loaded_fraction[i], single.loaded_fraction)
        assert torch.equal(result.rel_error[i], single.rel_error)
    rows = result.rows()
    assert len(rows) == len(rules) * 2 * 6
    assert rows[0]["rule"] == rules[0].name and rows[0]["b"] == 0 and rows[0]["head"] == 0


def test_paper_preset_and_kernel_params():
    paper = ARTConfig.paper()
    assert (paper.tau, paper.phi, paper.patience, paper.probe_source, paper.scale) == \
        (1e-7, 1e-3, 5, "accumulator", "absolute")
    params = ARTConfig(tau=2e-4, phi=3e-5, patience=6, probe_dims="mma").kernel_params()
    assert (params.tau, params.phi, params.patience, params.probe_dims) == (2e-4, 3e-5, 6, "mma")
    with pytest.raises(ValueError, match="group='all'"):
        ARTConfig(group="head").kernel_params()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tau=-1.0), "tau"), (dict(phi=float("nan")), "phi"), (dict(patience=0), "patience"),
    (dict(min_steps=-1), "min_steps"), (dict(probe_source="value"), "probe_source"),
    (dict(probe_dims="half"), "probe_dims"), (dict(scale="log"), "scale"), (dict(group="any"), "group"),
    (dict(use_scale=False, use_direction=False), "at least one"),
    (dict(use_scale="no"), "use_scale must be True or False, got 'no'"),
    (dict(tau=True), "tau must be a finite number >= 0, got True"),
    (dict(patience=2 ** 70), r"patience must fit an int64 \(at most 2\*\*63 - 1\), got 1180591620717411303424"),
    (dict(min_steps=10 ** 30), "min_steps must fit an int64"),
    (dict(probe_dims=np.array([0, 1])), r"probe_dims must be one of \('full', 'mma'\) or an index tensor, got array"),
])
def test_bad_config_gets_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ARTConfig(**kwargs)


def test_the_kernels_replay_refuses_a_rule_or_order_the_kernel_does_not_run():
    cache = synthetic_cache(1, 4, 2, 256, 16, seed=1)
    args = (cache.q, cache.k, cache.v)
    with pytest.raises(TypeError, match="rule must be an ARTConfig .*got Oracle"):
        replay_kernel_walks(*args, Oracle(0.01))
    with pytest.raises(ValueError, match="group='all'"):
        replay_kernel_walks(*args, ARTConfig(group="head"))
    with pytest.raises(ValueError, match=r"order must be one the kernel walks, \('sequential', 'sink_recency'\), "
                                         r"got 'recency'"):
        replay_kernel_walks(*args, ARTConfig(), order="recency")
    assert replay_kernel_walks(*args, ARTConfig(patience=2), block_size=16).shape == (1, 2)


def test_the_largest_counts_stop_where_no_rule_can_stop():
    cache = synthetic_cache(1, 4, 2, 256, 16, seed=1)
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=16)
    for rule in (ARTConfig(patience=2 ** 63 - 1), ARTConfig(min_steps=2 ** 63 - 1), FixedBudget(2 ** 63 - 1)):
        assert stop(trace, rule).stop_step.tolist() == [[15] * 4]                 # the last of 16 steps
    with pytest.raises(ValueError, match="steps must fit an int64"):
        FixedBudget(2 ** 80)


@pytest.mark.parametrize("kwargs, message", [
    (dict(patience=True), "patience must be an int, got bool"), (dict(patience=2.0), "patience must be an int"),
    (dict(min_steps=False), "min_steps must be an int, got bool"),
])
def test_counts_given_as_bools_or_floats_are_refused(kwargs, message):
    with pytest.raises(TypeError, match=message):
        ARTConfig(**kwargs)
    with pytest.raises(TypeError, match="steps must be an int, got bool"):
        FixedBudget(True)


def test_thresholds_take_any_real_number_and_hold_floats():
    config = ARTConfig(tau=np.float32(0.25), phi=np.float64(1e-3))
    assert (config.tau, config.phi) == (0.25, 1e-3) and type(config.tau) is float
    assert type(config.kernel_params().tau) is float
    assert Oracle(np.float32(0.5)).eps == 0.5
    with pytest.raises(ValueError, match="eps must be a finite number >= 0, got True"):
        Oracle(True)


def test_bad_baselines_and_rules():
    with pytest.raises(ValueError, match="gamma"):
        MassCoverage(0.0)
    for bad in (True, float("nan"), "0.5", torch.tensor(0.5), np.float32(1.5)):
        with pytest.raises(ValueError, match=r"gamma must lie in \(0, 1\]"):
            MassCoverage(bad)
    held = MassCoverage(np.float32(0.5)).gamma                       # a NumPy scalar of a sweep, held as a float
    assert held == 0.5 and type(held) is float
    # NumPy integers of a sweep (np.arange, np.array) are held as ints; a bool or a float is still refused
    swept = ARTConfig(patience=np.int64(4), min_steps=np.int32(2))
    assert (swept.patience, swept.min_steps) == (4, 2) and type(swept.patience) is type(swept.min_steps) is int
    assert swept.kernel_params().patience == 4 and type(FixedBudget(np.int64(3)).steps) is int
    for bad in (True, 4.0, np.float64(4.0)):
        with pytest.raises(TypeError, match="patience must be an int"):
            ARTConfig(patience=bad)
    with pytest.raises(ValueError, match="steps"):
        FixedBudget(0)
    with pytest.raises(ValueError, match="eps"):
        Oracle(-0.1)
    trace = hand_trace(scaled_walk([1.0, 2.0]))
    with pytest.raises(TypeError, match="unknown stopping rule"):
        stop(trace, "art")
    with pytest.raises(ValueError, match="probe_dims"):
        stop(trace, ARTConfig(probe_dims=torch.tensor([5])))
    with pytest.raises(TypeError, match="result must be the StopResult of `stop`, got NoneType"):
        kernel_walk_steps(None, 2)
    with pytest.raises(TypeError, match="kv_heads must be an int, got float"):
        kernel_walk_steps(stop(trace, ARTConfig()), 1.0)


def test_kernel_walk_steps_are_the_group_stop_plus_one_per_kv_head():
    # two KV heads of two query heads: the first group converges (steps 1-3 stable), the second never does
    calm = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    restless = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
    trace = hand_trace(torch.cat([scaled_walk(calm), scaled_walk(calm), scaled_walk(restless),
                                  scaled_walk(calm)], dim=1), kv_heads=2)
    result = stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=3))
    assert result.stop_step.tolist() == [[3, 3, 5, 5]]
    assert kernel_walk_steps(result, 2).tolist() == [[4, 6]]
    assert result.group_size == 2
    # the query heads' count (or any other) is refused: the trace has 2 KV heads of 2 query heads
    for wrong in (3, 4, 1):
        with pytest.raises(ValueError, match="kv_heads must be the trace's 2 KV heads"):
            kernel_walk_steps(result, wrong)
    per_head = stop(trace, ARTConfig(tau=1e-3, phi=1e-3, patience=3, group="head"))
    with pytest.raises(ValueError, match="group='all'"):
        kernel_walk_steps(per_head, 2)

