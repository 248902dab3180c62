"""The ART wave (``art_decode(..., wave_steps=W)``, ``kernels.art_wave``) against the simulator: the pairs it
finishes stop where the simulator's kernel-mode walk stops, with its output; the others are walked after it as
without a wave; stats count the wave's blocks; outputs are fully written; ragged lengths, pages and both orders.

CPU runs use the Triton interpreter on small fp16/fp32 shapes; the ``gpu`` tests repeat the checks at real sizes in
bf16 (``pytest -m gpu``).
"""
from __future__ import annotations

import pytest
import torch

import kernels.art_decode as art_decode_module
import kernels.split_plan as split_plan_module
from art_analysis.termination import ARTConfig
from kernels.art_decode import art_decode, plan_decode
from kernels.art_wave import MAX_WAVE_STEPS, told_wave_length, wave_workspace_bytes
from kernels.pair_walks import PairWalks
from kernels.paged_cache import to_paged
from kernels.split_plan import hint_plan, told_wave_blocks, told_wave_steps
from kernels.walk_hint import LongestWalkHint
from test_art_decode import (ART_CONFIGS, CPU, assert_paged_agrees, assert_stop_agreement, assert_within_flash_oracle,
                             captured_inputs, compare_stop_steps, simulator_stop, synthetic_inputs)

LOOSE = ARTConfig(tau=1e-3, phi=1e-4, patience=2)


def _walks_and_results(q, k, v, config, wave_steps, **kwargs):
    """``(single walks [B, Hkv], wave call's (out, lse, steps, result_steps))`` of one call with a wave and the
    single-split call without one."""
    params = config.kernel_params()
    _, single = art_decode(q, k, v, art=params, num_splits=1, return_stats=True, **kwargs)
    waved = art_decode(q, k, v, art=params, wave_steps=wave_steps, return_lse=True, return_stats=True,
                       return_result_steps=True, **kwargs)
    return single[..., 0], waved


@pytest.mark.parametrize("wave_steps", [3, 10])
def test_stop_steps_and_outputs_match_the_simulator(wave_steps):
    """A wave shorter than the earliest stop and one around the stops: each pair's result steps are the simulator's
    stop + 1 and its output the simulator's, whether the wave or the walk after it finished it.  The monitor takes
    the dims in chunks (``WAVE_DIM_CHUNK``): two at D = 64, four at D = 128."""
    cases = [synthetic_inputs(3, 8, 2, 2400, 64, torch.float32, CPU, seed=seed) + (None,) for seed in range(2)]
    cases.append(synthetic_inputs(2, 6, 2, 1500, 64, torch.float16, CPU, seed=7, preset="peaked") + (None,))
    cases.append(synthetic_inputs(2, 8, 2, 1200, 128, torch.float32, CPU, seed=5) + (None,))
    assert_stop_agreement(*compare_stop_steps(cases, ART_CONFIGS, wave_steps=wave_steps), f"wave of {wave_steps}")


def test_a_wave_over_whole_walks_stops_where_the_simulator_does():
    cases = [synthetic_inputs(2, 6, 2, 1500, 64, torch.float16, CPU, seed=7, preset="peaked") + (None,)]
    assert_stop_agreement(*compare_stop_steps(cases, ART_CONFIGS, wave_steps=24), "wave of every block")


def test_a_wave_longer_than_a_step_tile_carries_each_heads_state_and_stable_run_from_tile_to_tile(monkeypatch):
    """A wave of 40 steps judged 16 steps at a time (``WAVE_STEP_TILE``; 128 by default): the same outputs, ``lse``,
    stats and result steps bit for bit as in one tile, and the simulator's stops, including stable runs of 16 steps
    that span two tiles (``patience=16``: stops at steps 22-39)."""
    import kernels.art_wave as art_wave_module

    q, k, v = synthetic_inputs(2, 8, 2, 48 * 64, 64, torch.float32, CPU, seed=11)
    configs = (ARTConfig(tau=1e-2, phi=1e-4, patience=4), ARTConfig(tau=2e-2, phi=1e-4, patience=16), ART_CONFIGS[3])
    one_tile = [art_decode(q, k, v, art=config.kernel_params(), wave_steps=40, return_lse=True, return_stats=True,
                           return_result_steps=True) for config in configs]
    monkeypatch.setattr(art_wave_module, "WAVE_STEP_TILE", 16)
    for config, expected in zip(configs, one_tile):
        tiled = art_decode(q, k, v, art=config.kernel_params(), wave_steps=40, return_lse=True, return_stats=True,
                           return_result_steps=True)
        assert all(torch.equal(a, b) for a, b in zip(tiled, expected)), config
    assert 16 < int(one_tile[1][3].min()) and int(one_tile[1][3].max()) <= 40    # stops in later tiles
    assert_stop_agreement(*compare_stop_steps([(q, k, v, None)], configs, wave_steps=40), "wave of 40 in tiles of 16")


def test_stop_steps_match_the_simulator_on_a_captured_layer_in_both_orders():
    q, k, v, seqlens = captured_inputs(CPU, torch.float32)
    for order, configs in (("sink_recency", ART_CONFIGS[:2]), ("sequential", ART_CONFIGS[2:3])):
        assert_stop_agreement(*compare_stop_steps([(q, k, v, seqlens)], configs, order=order, wave_steps=12),
                              f"captured SmolLM2 layer 15, wave of 12, {order}")


@pytest.mark.parametrize("num_splits, follow_step", [(1, None), (3, 0), (4, 6)])
def test_the_pairs_the_wave_does_not_finish_are_walked_as_without_it(num_splits, follow_step):
    """A pair that stops within the wave takes the wave's output and result; any other gets the call's walk without
    a wave (the same output, bit for bit, and the same leader steps plus the wave's blocks)."""
    q, k, v = synthetic_inputs(4, 8, 2, 3000, 64, torch.float32, CPU, seed=3)
    params = LOOSE.kernel_params()
    plain = art_decode(q, k, v, art=params, num_splits=num_splits, follow_step=follow_step, return_lse=True,
                       return_stats=True, return_result_steps=True)
    walks = art_decode(q, k, v, art=params, num_splits=1, return_stats=True)[1][..., 0]
    wave_steps = int(walks.float().median())
    out, lse, steps, result = art_decode(q, k, v, art=params, num_splits=num_splits, follow_step=follow_step,
                                         wave_steps=wave_steps, return_lse=True, return_stats=True,
                                         return_result_steps=True)
    finished = walks <= wave_steps
    assert finished.any() and not finished.all()
    heads = finished.repeat_interleave(4, dim=1)
    assert torch.equal(out[~heads], plain[0][~heads]) and torch.equal(lse[~heads], plain[1][~heads])
    torch.testing.assert_close(out[heads], plain[0][heads], rtol=1e-5, atol=1e-6)
    assert torch.equal(result, torch.where(finished, walks, plain[3]))
    # the wave read min(W, blocks) blocks of every pair: counted in the leader's steps
    assert torch.equal(steps[..., 0], torch.where(finished, wave_steps, plain[2][..., 0] + wave_steps))
    assert torch.equal(steps[..., 1:], torch.where(finished[..., None], 0, plain[2][..., 1:]))
    plan = plan_decode(q, k, v, art=params, num_splits=num_splits, follow_step=follow_step, wave_steps=wave_steps)
    assert plan.wave_steps == wave_steps
    assert torch.equal(plan.result_steps(walks), result)


def test_a_walk_within_the_wave_that_does_not_stop_returns_the_dense_output():
    lengths = torch.tensor([1, 63, 65, 1027], dtype=torch.int32)
    q, k, v = synthetic_inputs(4, 4, 2, 1027, 64, torch.float32, CPU, seed=13)
    never = ARTConfig(tau=0.0, phi=0.0, patience=2).kernel_params()
    dense = art_decode(q, k, v, cache_seqlens=lengths, block_size=64, num_splits=1, return_lse=True)
    out, lse, steps, result = art_decode(q, k, v, cache_seqlens=lengths, art=never, wave_steps=17, return_lse=True,
                                         return_stats=True, return_result_steps=True)
    blocks = (lengths.long() + 63) // 64
    assert torch.equal(result, blocks[:, None].expand(-1, 2).to(result.dtype))
    assert torch.equal(steps.sum(-1), blocks[:, None].expand(-1, 2).to(steps.dtype))
    torch.testing.assert_close(out, dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, dense[1], rtol=1e-6, atol=1e-6)
    assert_within_flash_oracle(out, q, k, v, lengths)


def test_a_block_of_infinite_scores_after_the_first_adds_nothing_in_the_wave_as_in_the_walk():
    """An infinite key makes a block's scores all -inf: the walk, whose running maximum is finite by then, adds
    nothing for it, and the wave, which attends each block from an empty state, must not turn it into NaN."""
    q, k, v = synthetic_inputs(1, 4, 1, 640, 64, torch.float32, CPU, seed=3)
    dim = int(torch.nonzero((q[0] > 0).all(0))[0])
    k[0, 0, 576:, dim] = float("-inf")          # block 9: traversal step 1 under sink_recency
    params = LOOSE.kernel_params()
    walked = art_decode(q, k, v, art=params, num_splits=1, return_lse=True, return_result_steps=True)
    for wave_steps in (2, 12):                  # the pair walks after the wave, or the wave holds the whole walk
        waved = art_decode(q, k, v, art=params, num_splits=1, wave_steps=wave_steps, return_lse=True,
                           return_result_steps=True)
        assert torch.isfinite(waved[0]).all() and torch.equal(waved[2], walked[2])
        torch.testing.assert_close(waved[0], walked[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(waved[1], walked[1], rtol=1e-6, atol=1e-6)


def test_ragged_lengths_and_shuffled_pages_give_the_contiguous_wave():
    lengths = torch.tensor([1, 63, 65, 1027], dtype=torch.int32)
    q, k, v = synthetic_inputs(4, 6, 2, 1027, 64, torch.float16, CPU, seed=13)
    params = LOOSE.kernel_params()
    contiguous = art_decode(q, k, v, cache_seqlens=lengths, art=params, num_splits=2, block_size=64, wave_steps=5,
                            return_lse=True, return_stats=True)
    expected, _ = simulator_stop(q, k, v, lengths, LOOSE, "sink_recency")
    _, _, _, result = art_decode(q, k, v, cache_seqlens=lengths, art=params, num_splits=1, wave_steps=5,
                                 return_stats=True, return_lse=True, return_result_steps=True)
    assert torch.equal(result.long(), expected)
    past = torch.arange(k.shape[2])[None, :] >= lengths[:, None].long()
    k_past, v_past = (x.masked_fill(past[:, None, :, None], float("nan")) for x in (k, v))
    for page_size in (1, 16, 48, 64):
        k_pages, v_pages, table = to_paged(k_past, v_past, page_size, seed=page_size)
        paged = art_decode(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, art=params, num_splits=2,
                           block_size=64, wave_steps=5, return_lse=True, return_stats=True)
        assert_paged_agrees(paged, contiguous, page_size, 64)


def test_outputs_fully_written_over_nan_poisoned_buffers(monkeypatch):
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)

    q, k, v = synthetic_inputs(3, 4, 2, 900, 64, torch.float16, CPU, seed=5)
    seqlens = torch.tensor([900, 1, 130], dtype=torch.int32)
    params = LOOSE.kernel_params()
    calls = [dict(num_splits=splits, wave_steps=wave) for splits in (1, 3) for wave in (2, 6)]
    clean = [art_decode(q, k, v, cache_seqlens=seqlens, art=params, return_lse=True, return_stats=True,
                        return_result_steps=True, **call) for call in calls]
    monkeypatch.setattr(art_decode_module, "_scratch", poisoned)
    for call, reference in zip(calls, clean):
        dirty = art_decode(q, k, v, cache_seqlens=seqlens, art=params, return_lse=True, return_stats=True,
                           return_result_steps=True, **call)
        assert torch.isfinite(dirty[0]).all() and torch.isfinite(dirty[1]).all()
        for a, b in zip(dirty, reference):
            assert torch.equal(a, b)


def test_a_dense_walk_after_the_wave_keeps_the_wave_results():
    """Where the planned leader range cannot reach the earliest stop the walk after the wave runs dense: the pairs the
    wave finished keep their stops, the others take the dense output."""
    q, k, v = synthetic_inputs(2, 4, 2, 2048, 64, torch.float32, CPU, seed=9)
    params = LOOSE.kernel_params()
    plan = plan_decode(q, k, v, art=params, num_splits=32, wave_steps=8)
    assert plan.art is None and plan.monitored and plan.wave_steps == 8
    walks = art_decode(q, k, v, art=params, num_splits=1, return_stats=True)[1][..., 0]
    out, result = art_decode(q, k, v, art=params, num_splits=32, wave_steps=8, return_result_steps=True)
    dense = art_decode(q, k, v, num_splits=32, block_size=64)
    finished = walks <= 8
    assert finished.any() and not finished.all()
    assert torch.equal(result, torch.where(finished, walks, 32))
    heads = finished.repeat_interleave(2, dim=1)
    assert torch.equal(out[~heads], dense[~heads])
    _, simulated = simulator_stop(q, k, v, None, LOOSE, "sink_recency")
    torch.testing.assert_close(out[heads].double(), simulated.output[heads].double(), rtol=2e-5, atol=2e-5)


def test_bad_wave_steps_are_refused_with_the_reason():
    q, k, v = synthetic_inputs(1, 4, 2, 256, 64, torch.float16, CPU)
    params = LOOSE.kernel_params()
    for value in (-1, MAX_WAVE_STEPS + 1, 2.0, True, "8"):
        with pytest.raises((ValueError, TypeError), match="wave_steps"):
            art_decode(q, k, v, art=params, wave_steps=value)
    with pytest.raises(ValueError, match="needs art"):
        art_decode(q, k, v, wave_steps=4)
    told = PairWalks.from_walks(torch.full((1, 2), 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="not with release_walks"):
        art_decode(q, k, v, art=params, wave_steps=4, release_walks=4)
    # a wave past the walk's blocks is the whole walk; 0 is none, also for a call told its walks
    assert plan_decode(q, k, v, art=params, wave_steps=MAX_WAVE_STEPS).wave_steps == 4
    assert plan_decode(q, k, v, wave_steps=0).wave_steps == 0
    assert plan_decode(q, k, v, art=params, pair_walks=told, wave_steps=0).pair_walks is told


def test_a_told_wave_is_the_longest_walk_and_an_eighth_where_it_costs_less_than_the_walk():
    """The told wave's rule on the H100's 132 multiprocessors (``told_wave_steps``' docstring): few pairs of long
    walks take it, also past one ``WAVE_STEP_TILE``; a short cache (the dense walk is cheaper), many pairs and walks
    past ``MAX_WAVE_STEPS`` do not."""
    one_at_32k = [36, 37, 38, 39, 40, 40, 41, 42]
    assert told_wave_steps(one_at_32k, 512, 128, 132) == 48          # 42 + 5 + 1, rounded up to 8
    assert told_wave_steps(one_at_32k * 8, 2048, 128, 132) == 48      # B = 8 x 128k: 33.9 lone steps against 42
    # 1 x 8k: each pair's own wave, 7 x 48 + 64 blocks (6.2 lone steps) against the dense walk (6.5); every walk of
    # 52, waves of 64 (7.3); at 4 x 8k 17.9 against 25.9
    assert told_wave_steps(one_at_32k[:-1] + [52], 128, 128, 132) == 64
    assert told_wave_steps([52] * 8, 128, 128, 132) == 0
    assert told_wave_steps(one_at_32k * 4, 128, 128, 132) == 48
    assert told_wave_steps(one_at_32k * 16, 512, 128, 132) == 0      # 128 pairs: the wave's reads cost more (65.8)
    assert told_wave_steps([17] * 24, 512, 64, 132) == 24            # 17 + 2 + 1
    assert told_wave_steps([4] * 24, 512, 64, 132) == 0              # shorter walks than the wave's fixed cost
    assert told_wave_steps([120] * 8, 4096, 128, 132) == 136          # two step tiles: 13.3 against 120
    assert told_wave_steps([460] * 8, 4096, 128, 132) == 0           # 460 + 57 + 1 -> 520, past MAX_WAVE_STEPS
    # the same walks on fewer multiprocessors read longer: the wave stops paying
    assert told_wave_steps(one_at_32k, 512, 128, 8) == 0


def test_a_told_call_takes_no_wave_whose_scratch_passes_the_cap(monkeypatch):
    """The told wave's scratch (``wave_workspace_bytes``: ``B * Hq`` heads of ``W`` steps) is checked before the rule:
    at the cap the wave is taken, a byte below it the call keeps its told walk, by ``pair_walks`` and by a hint."""
    q, k, v = synthetic_inputs(3, 8, 2, 3000, 64, torch.float32, CPU, seed=3)
    params = LOOSE.kernel_params()
    walks = art_decode(q, k, v, art=params, num_splits=1, return_stats=True)[1]
    told = PairWalks.from_walks(walks[..., 0])
    hint = LongestWalkHint()
    hint.record(walks)
    wave_steps = told_wave_length(told.sorted_walks[-1])
    _told_wave(monkeypatch, wave_steps)
    scratch = wave_workspace_bytes(3 * 8, wave_steps, 64)
    assert scratch == 4 * 24 * wave_steps * (64 + 3 + 6)
    monkeypatch.setattr(art_decode_module, "TOLD_WAVE_MAX_WORKSPACE", scratch)
    assert plan_decode(q, k, v, art=params, pair_walks=told).wave_steps == wave_steps
    assert plan_decode(q, k, v, art=params, walk_hint=hint).wave_steps == wave_steps
    monkeypatch.setattr(art_decode_module, "TOLD_WAVE_MAX_WORKSPACE", scratch - 1)
    kept = plan_decode(q, k, v, art=params, pair_walks=told)
    assert kept.wave_steps == 0 and kept.pair_walks is told
    assert plan_decode(q, k, v, art=params, walk_hint=hint).wave_steps == 0
    # an explicit wave is the caller's: no cap
    assert plan_decode(q, k, v, art=params, pair_walks=told, wave_steps=wave_steps).wave_steps == wave_steps


def test_the_told_pairs_own_waves_are_counted_by_wave_length():
    """``told_wave_blocks`` (bisection over the wave lengths) equals the sum of each pair's own wave, at most the
    walk's blocks, on walks that share lengths, straddle the multiples of 8 and outrun the cache."""
    generator = torch.Generator().manual_seed(5)
    for most in (6, 40, 130, 600):
        for max_steps in (8, 50, 512):
            walks = sorted(torch.randint(1, most + 1, (97,), generator=generator).tolist())
            assert told_wave_blocks(walks, max_steps) == sum(min(told_wave_length(w), max_steps) for w in walks)
    assert told_wave_blocks([6, 7, 8, 15, 16], 512) == 8 + 8 + 16 + 24 + 24   # 7 + 0 + 1 = 8; 15 + 1 + 1 = 17 -> 24


def _told_wave(monkeypatch, steps):
    """Every told call takes a wave of ``steps`` (the launcher's and the hint plan's rule replaced: on the CPU's one
    "multiprocessor" the wave never pays)."""
    monkeypatch.setattr(art_decode_module, "told_wave_steps", lambda *args: steps)
    monkeypatch.setattr(split_plan_module, "told_wave_steps", lambda *args: steps)


def test_a_call_told_its_walks_runs_the_wave_its_rule_takes_then_the_walk_planned_for_the_longest(monkeypatch):
    q, k, v = synthetic_inputs(3, 8, 2, 3000, 64, torch.float32, CPU, seed=3)
    params = LOOSE.kernel_params()
    walks = art_decode(q, k, v, art=params, num_splits=1, return_stats=True)[1][..., 0]
    told = PairWalks.from_walks(walks)
    wave_steps = int(walks.float().median())
    _told_wave(monkeypatch, wave_steps)
    plan = plan_decode(q, k, v, art=params, pair_walks=told)
    assert plan.wave_steps == wave_steps and plan.pair_walks is None and not plan.longest_first
    longest = plan_decode(q, k, v, art=params, longest_stop_steps=told.sorted_walks[-1], wave_steps=wave_steps)
    assert plan == longest
    waved = art_decode(q, k, v, art=params, pair_walks=told, return_lse=True, return_stats=True,
                       return_result_steps=True)
    explicit = art_decode(q, k, v, art=params, longest_stop_steps=told.sorted_walks[-1], wave_steps=wave_steps,
                          return_lse=True, return_stats=True, return_result_steps=True)
    for a, b in zip(waved, explicit):
        assert torch.equal(a, b)
    finished = walks <= wave_steps
    assert finished.any() and not finished.all()
    assert torch.equal(waved[3][finished], walks[finished])
    # wave_steps=0 keeps the told plan without a wave
    unwaved = plan_decode(q, k, v, art=params, pair_walks=told, wave_steps=0)
    assert unwaved.wave_steps == 0 and unwaved.pair_walks is told


def test_each_told_pair_waves_over_its_own_walk_and_an_eighth(monkeypatch):
    """A told call's wave reads each pair's told walk and an eighth (``told_wave_length``), at most the longest
    pair's: the same outputs, ``lse`` and result steps as every pair reading the whole wave, fewer blocks in its
    stats; and where the walks outrun what the pairs were told, those pairs are walked after their short waves."""
    q, k, v = synthetic_inputs(3, 8, 2, 3000, 64, torch.float32, CPU, seed=3, preset="diffuse")   # walks of 10-22
    params = LOOSE.kernel_params()
    walks = art_decode(q, k, v, art=params, num_splits=1, return_stats=True)[1][..., 0]
    told = PairWalks.from_walks(walks)
    wave_steps = told_wave_length(told.sorted_walks[-1])
    _told_wave(monkeypatch, wave_steps)
    plan = plan_decode(q, k, v, art=params, pair_walks=told)
    assert torch.equal(plan.wave_walks, walks) and plan.wave_steps == wave_steps
    own = torch.clamp(told_wave_length(walks), max=wave_steps)
    assert torch.equal(plan.wave_blocks, own) and (own < wave_steps).any()
    waved = art_decode(q, k, v, art=params, pair_walks=told, return_lse=True, return_stats=True,
                       return_result_steps=True)
    uniform = art_decode(q, k, v, art=params, longest_stop_steps=told.sorted_walks[-1], wave_steps=wave_steps,
                         return_lse=True, return_stats=True, return_result_steps=True)
    for index in (0, 1, 3):    # out, lse, result steps
        assert torch.equal(waved[index], uniform[index])
    assert torch.equal(waved[3], walks)                # every pair stops within its own wave
    assert torch.equal(waved[2][..., 0], own) and torch.equal(uniform[2][..., 0], torch.full_like(own, wave_steps))
    # the same wave forced on the told call (wave_steps with pair_walks): each pair's own, at most the forced length
    forced = plan_decode(q, k, v, art=params, pair_walks=told, wave_steps=wave_steps - 8)
    assert torch.equal(forced.wave_blocks, torch.clamp(own, max=wave_steps - 8))
    # told walks of half their length: the pairs that outrun their waves are walked, with the single walks' results
    halved = PairWalks.from_walks((walks // 2).clamp(min=1).to(torch.int32))
    out, steps, result = art_decode(q, k, v, art=params, pair_walks=halved, wave_steps=wave_steps,
                                    return_stats=True, return_result_steps=True)
    half_waves = torch.clamp(told_wave_length(halved.walks), max=wave_steps)
    outran = walks > half_waves
    assert outran.any() and not outran.all()
    assert torch.equal(result, walks)
    assert (steps[..., 0][outran] > half_waves[outran]).all()           # the wave's blocks, then the walk's
    assert torch.equal(steps[..., 0][~outran], half_waves[~outran])
    _, simulated = simulator_stop(q, k, v, None, LOOSE, "sink_recency")
    torch.testing.assert_close(out.double(), simulated.output.double(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_walk_hint_records_each_pairs_walk_after_a_wave(num_splits):
    """The hint counts a pair the wave finished by its result steps, and any other by its walk after the wave (the
    leader's steps less the wave's blocks), as it counts a call without a wave."""
    q, k, v = synthetic_inputs(3, 8, 2, 3000, 64, torch.float32, CPU, seed=3)
    params = LOOSE.kernel_params()
    walks = art_decode(q, k, v, art=params, num_splits=num_splits, follow_step=0, return_stats=True)[1]
    plain = LongestWalkHint()
    plain.record(walks)
    wave_steps = int(walks[..., 0].float().median())
    hint = LongestWalkHint()
    _, steps, result = art_decode(q, k, v, art=params, num_splits=num_splits, follow_step=0, wave_steps=wave_steps,
                                  walk_hint=hint, return_stats=True, return_result_steps=True)
    finished = result <= wave_steps
    assert finished.any() and not finished.all()
    assert torch.equal(hint.pair_walks.walks, torch.where(finished, result, plain.pair_walks.walks))
    if num_splits == 1:
        assert torch.equal(hint.pair_walks.walks, walks[..., 0])
    # by hand: the call's result steps stand for the wave's
    by_hand = LongestWalkHint()
    plan = plan_decode(q, k, v, art=params, num_splits=num_splits, follow_step=0, wave_steps=wave_steps)
    by_hand.record(steps, wave=(result, plan.wave_blocks))
    assert torch.equal(by_hand.pair_walks.walks, hint.pair_walks.walks)


def test_a_hinted_call_takes_the_wave_of_its_hint_plan_and_records_for_the_next(monkeypatch):
    q, k, v = synthetic_inputs(3, 8, 2, 3000, 64, torch.float32, CPU, seed=3)
    params = LOOSE.kernel_params()
    walks = art_decode(q, k, v, art=params, num_splits=1, return_stats=True)[1]
    hint = LongestWalkHint()
    hint.record(walks)
    wave_steps = int(walks[..., 0].max())        # every pair stops within it
    _told_wave(monkeypatch, wave_steps)
    assert hint_plan(hint.pair_walks, 47, 64, CPU, params) == {"wave_steps": wave_steps}
    assert hint_plan(hint.pair_walks, 47, 64, CPU, params, wave=False) == {"pair_walks": hint.pair_walks}
    plan = plan_decode(q, k, v, art=params, walk_hint=hint)
    assert plan.wave_steps == wave_steps and plan.pair_walks is None
    out, result = art_decode(q, k, v, art=params, walk_hint=hint, return_result_steps=True)
    assert torch.equal(result, walks[..., 0])
    assert torch.equal(hint.pair_walks.walks, walks[..., 0])
    assert torch.equal(out, art_decode(q, k, v, art=params, longest_stop_steps=int(walks.max()),
                                       wave_steps=wave_steps))
    # a caller's wave_steps=0 leaves the hint's plan without one
    assert plan_decode(q, k, v, art=params, walk_hint=hint, wave_steps=0).wave_steps == 0


def _cuda():
    return torch.device("cuda")


@pytest.mark.gpu
def test_gpu_stop_steps_match_the_simulator():
    cases = []
    for seed, (preset, q_heads, kv_heads) in enumerate((("realistic", 32, 8), ("peaked", 40, 8), ("realistic", 48, 4))):
        q, k, v = synthetic_inputs(8, q_heads, kv_heads, 4096, 128, torch.bfloat16, _cuda(), seed=seed, preset=preset)
        cases.append((q, k, v, None))
    for wave_steps in (16, 48):
        assert_stop_agreement(*compare_stop_steps(cases, ART_CONFIGS + (ARTConfig(),), wave_steps=wave_steps),
                              f"GPU bf16 synthetic, wave of {wave_steps}")
    q, k, v, seqlens = captured_inputs(_cuda(), torch.bfloat16)
    assert_stop_agreement(*compare_stop_steps([(q, k, v, seqlens)], ART_CONFIGS + (ARTConfig(),), wave_steps=48),
                          "GPU bf16 captured layer, wave of 48")


@pytest.mark.gpu
def test_gpu_long_wave_stop_steps_match_the_simulator():
    """A wave of two step tiles and a part (``WAVE_STEP_TILE = 128``), under the default thresholds with walks made
    long by patience 140 and by ``min_steps`` 150 (stable runs and states carried across the tiles); 384 pairs, so
    that the bf16 off-by-one the wave can give leaves the 99 % met.  (Thresholds at bf16's rounding, tau 2e-4 and
    phi 1e-7 at patience 160, moved 2 of 384 stops by 9 steps on an H100, NOTES V96: the wave's rounding of each
    block's ``p`` against its own maximum flips a test there, and a flip moves a stop by up to the patience.)"""
    q, k, v = synthetic_inputs(16, 32, 8, 300 * 64, 128, torch.bfloat16, _cuda(), seed=9)
    configs = (ARTConfig(), ARTConfig(patience=140), ARTConfig(min_steps=150))
    assert_stop_agreement(*compare_stop_steps([(q, k, v, None)], configs, wave_steps=280),
                          "GPU bf16 synthetic, wave of 280")


@pytest.mark.gpu
def test_gpu_wave_calls_agree_with_their_walks_ragged_paged_and_graphed(monkeypatch):
    lengths = torch.tensor([1, 63, 65, 1027, 20000], dtype=torch.int32, device="cuda")
    q, k, v = synthetic_inputs(5, 32, 8, 20000, 128, torch.bfloat16, _cuda(), seed=2)
    params = ARTConfig().kernel_params()
    walks = art_decode(q, k, v, cache_seqlens=lengths, art=params, num_splits=1, return_stats=True)[1][..., 0]
    monkeypatch.setattr(art_decode_module, "_scratch", lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device))
    out, lse, steps, result = art_decode(q, k, v, cache_seqlens=lengths, art=params, wave_steps=48, return_lse=True,
                                         return_stats=True, return_result_steps=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (result == walks).float().mean() >= 0.99
    past = torch.arange(k.shape[2], device=k.device)[None, :] >= lengths[:, None].long()
    k_past, v_past = (x.masked_fill(past[:, None, :, None], float("nan")) for x in (k, v))
    for page_size in (1, 16, 64):
        k_pages, v_pages, table = to_paged(k_past, v_past, page_size, seed=page_size)
        paged = art_decode(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, art=params, wave_steps=48,
                           return_lse=True, return_stats=True, return_result_steps=True)
        assert torch.equal(paged[3], result)
        finished = (result <= 48).repeat_interleave(4, dim=1)
        assert torch.equal(paged[0][finished], out[finished])
    # a CUDA graph of the call replays its result
    graph = torch.cuda.CUDAGraph()
    static = art_decode(q, k, v, cache_seqlens=lengths, art=params, wave_steps=48)
    with torch.cuda.graph(graph):
        static = art_decode(q, k, v, cache_seqlens=lengths, art=params, wave_steps=48)
    static.fill_(float("nan"))
    graph.replay()
    assert torch.equal(static, out)
