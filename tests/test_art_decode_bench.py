"""The decode benchmark's byte model, loaded-block accounting and target summary (CPU, no timing)."""
from __future__ import annotations

import json

import pytest
import torch

import kernels.art_decode as art_decode_module
from kernels.art_params import ARTParams
from kernels.bench import kv_bytes, summarise, target_rows, tile_batch
from kernels.split_plan import (choose_num_splits, choose_split_plan, earliest_stop_steps, leader_can_stop,
                                leader_range, one_wave_dense_splits, one_wave_small_block_splits)


def test_kv_bytes_counts_k_and_v_once():
    k = torch.empty(3, 8, 1000, 128, dtype=torch.bfloat16)
    assert kv_bytes(k) == 2 * 3 * 8 * 1000 * 128 * 2


def test_split_heuristics_fill_one_wave(fake_sms):
    fake_sms(132)
    # 128-token blocks at D = 128 (one program per SM): the split count whose waves end soonest (V68)
    assert choose_num_splits(1, 8, 512, None) == 16                 # 128 programs, not 136
    assert choose_num_splits(32, 3, 512, None) == 1                 # 96 programs walk at the lone pace: one wave
    assert choose_num_splits(32, 8, 512, None) == 1
    assert choose_num_splits(1, 8, 8, None) == 2                    # at least MIN_STEPS_PER_SPLIT blocks each
    assert choose_num_splits(18, 8, 64, None) == 8                  # 144 pairs: 9 waves of an eighth, not 2 of all
    assert choose_num_splits(32, 8, 1024, None) == 1
    assert choose_num_splits(26, 8, 256, None, block_size=128, head_dim=64) == 1   # D = 64: one wave of pairs
    # blocks of at most 64 tokens: four programs per multiprocessor, one more split only where SMs would idle
    assert choose_num_splits(1, 8, 512, None, block_size=64) == 66
    assert choose_num_splits(8, 8, 2048, None, block_size=64) == 8
    assert choose_num_splits(32, 3, 512, None, block_size=64) == 5
    assert choose_num_splits(128, 3, 512, None, block_size=64) == 1     # 384 programs keep every SM busy
    # ... walked without the monitor: 3 programs per SM at D = 64, 2 at D = 128 (V61)
    assert choose_num_splits(1, 3, 2048, None, block_size=64, head_dim=64) == 128   # 132, at most MAX_SPLITS
    assert choose_num_splits(8, 3, 512, None, block_size=64, head_dim=64) == 16     # 384 programs
    assert choose_num_splits(1, 3, 128, None, block_size=64, head_dim=64) == 32     # 4 blocks each at least
    assert choose_num_splits(1, 8, 512, None, block_size=64, head_dim=128) == 33
    assert choose_num_splits(8, 8, 512, None, block_size=128, head_dim=128) == 2    # 128-token blocks: as before


def test_wave_balanced_splits_round_the_programs_up_to_whole_waves():
    from kernels.split_plan import LONE_WAVE_PACE, PROGRAM_START_BLOCKS, wave_balanced_splits

    def waves_of_blocks(pairs, blocks, sms, splits):
        full, rest = divmod(pairs * splits, sms)
        return (full + (max(LONE_WAVE_PACE, rest / sms) if rest else 0)) * (-(-blocks // splits) + PROGRAM_START_BLOCKS)

    # the H200's measured best or within 2 % of it (V68; 128-token blocks, D = 128, 8k tokens = 64 blocks)
    assert wave_balanced_splits(128, 64, 132, 16) == 1              # one wave of whole walks
    assert wave_balanced_splits(96, 64, 132, 16) == 1               # 94.8 us; 2 splits (192 programs) 116.0
    assert wave_balanced_splits(144, 64, 132, 16) == 8              # 155.8 us; 1 split (a wave and 12) 207.1
    assert wave_balanced_splits(48, 64, 132, 16) == 2               # 56.4 us; 3 splits (144 programs) 80.2
    assert wave_balanced_splits(8, 256, 132, 64) == 16              # 128 programs, where 17 splits spill 8
    assert wave_balanced_splits(144, 64, 132, 1) == 1               # at most `most`
    for pairs in range(1, 300, 7):                                  # the least cost, and the fewest splits at it
        chosen = wave_balanced_splits(pairs, 256, 132, 64)
        costs = [waves_of_blocks(pairs, 256, 132, s) for s in range(1, 65)]
        assert costs[chosen - 1] == min(costs) and min(costs) < min(costs[:chosen - 1], default=float("inf"))
    # a last wave of few programs walks at the lone pace, not in proportion to its programs
    assert waves_of_blocks(12, 64, 132, 1) == LONE_WAVE_PACE * (64 + PROGRAM_START_BLOCKS)


def test_dense_batch_rows_time_the_dense_plan_against_the_peers(monkeypatch, fake_sms):
    import itertools

    import kernels.bench as bench

    fake_sms(132)
    monkeypatch.setattr(bench, "num_sms", lambda device: 132)
    clock = itertools.count(1)
    monkeypatch.setattr(bench, "graph_ms", lambda fn, rep_ms, flush="read": float(next(clock)))
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_peer_fns", lambda q, k, v, flex: {
        "cudnn_sdpa": lambda: None, "flash_sdpa": "no kernel for this shape", "flex_attention": lambda: None})
    rows = bench.bench_dense_batches((2, 18), (512,), rep_ms=1, ceiling=4.0, device=torch.device("cpu"), rounds=1)
    ours = ("art_dense", "art_dense_bs64_one_wave")
    assert [(r["batch"], r["impl"]) for r in rows] == [(b, impl) for b in (2, 18)
                                                       for impl in ("cudnn_sdpa", "flash_sdpa") + ours]
    dense = {r["batch"]: r for r in rows if r["impl"] == "art_dense"}
    one_wave = {r["batch"]: r for r in rows if r["impl"] == "art_dense_bs64_one_wave"}
    q = torch.zeros(18, 32, 128)
    k = torch.zeros(18, 8, 512, 128)
    plan = art_decode_module.plan_decode(q, k, k)
    assert (dense[18]["block_size"], dense[18]["num_splits"]) == (plan.block_size, plan.num_splits) == (128, 1)
    assert dense[2]["num_splits"] == 1, "4 blocks of 128 tokens: at least MIN_STEPS_PER_SPLIT each"
    # 8 blocks of 64 tokens: 2 splits at most; 144 pairs x 4 splits would fit 5 x 132 programs, but 8 / 4 < 4 blocks
    assert (one_wave[2]["block_size"], one_wave[2]["num_splits"]) == (64, 2)
    assert (one_wave[18]["block_size"], one_wave[18]["num_splits"]) == (64, 2)
    # one round each: cuDNN 1, dense 2, one wave 3 (batch 2); cuDNN 4, dense 5, one wave 6 (batch 18)
    assert dense[2]["ms"] == 2.0 and dense[2]["speedup_vs_best_peer"] == 0.5
    assert dense[18]["speedup_vs_best_peer"] == 0.8 and one_wave[18]["speedup_vs_best_peer"] == 4 / 6
    assert dense[18]["tb_per_s"] == 2 * 18 * 8 * 512 * 128 * 2 / 5.0 / 1e9
    assert rows[1] == {**{key: rows[2][key] for key in ("batch", "seqlen", "q_heads", "kv_heads", "head_dim")},
                       "impl": "flash_sdpa", "error": "no kernel for this shape"}
    assert bench.dense_batches_summary(rows) == {
        "dense_batches_shapes": 2, "dense_batches_over_best_peer_min": 0.5,
        "dense_batches_over_best_peer_median": 0.8, "dense_batches_b16plus_min": 0.8,
        "dense_batches_b16plus_below_target": 1, "dense_batches_worst_shape": dict(batch=2, seqlen=512, num_splits=1),
        "dense_batches_one_wave_over_default_min": 6 / 5, "dense_batches_one_wave_over_default_median": 3 / 2,
        "dense_batches_one_wave_over_default_max": 3 / 2, "dense_batches_one_wave_faster": 0,
        "dense_batches_one_wave_b16plus_below_target": 1}


def test_one_wave_candidate_takes_the_most_splits_that_fit_one_wave_of_two_stage_programs():
    blocks = 8192 // 64
    assert one_wave_small_block_splits(144, blocks, 132) == 4      # B = 18: 576 of 660 programs (V69's 141.6 us)
    assert one_wave_small_block_splits(80, blocks, 132) == 8       # B = 10: 640
    assert one_wave_small_block_splits(272, blocks, 132) == 2      # B = 34: 544
    assert one_wave_small_block_splits(661, blocks, 132) == 1      # over one wave at any split count
    assert one_wave_small_block_splits(1, blocks, 132) == 32       # 128 blocks: at least 4 per split
    assert one_wave_small_block_splits(1, 2048, 132) == 128        # MAX_SPLITS


def test_dense_plan_takes_one_wave_of_64_token_blocks_only_where_the_128_token_grid_runs_short_waves(fake_sms):
    fake_sms(132)
    cpu = torch.device("cpu")
    # 8k tokens, 32 / 8 heads (V71's dense batches): the one-wave plan where the 128-token grid takes several splits
    # in more than one wave, at the split count the run timed as `art_dense_bs64_one_wave`
    for batch, splits in ((10, 8), (18, 4), (20, 4), (22, 3), (26, 3), (34, 2), (40, 2), (56, 1)):
        assert one_wave_dense_splits(batch * 8, 8192, 128, False, cpu) == splits, batch
    # kept: one wave of 128-token programs (B = 6 and 8: 2 splits of 48 / 64 pairs), one split (B = 12-16, 28-32,
    # 48, 64), longer walks (32k, where it trailed), D = 64, pages, and 4 blocks of 128 tokens (one split)
    for batch in (6, 8, 12, 16, 28, 32, 48, 64):
        assert one_wave_dense_splits(batch * 8, 8192, 128, False, cpu) is None, batch
    assert one_wave_dense_splits(18 * 8, 8193, 128, False, cpu) is None
    assert one_wave_dense_splits(18 * 8, 32768, 128, False, cpu) is None
    assert one_wave_dense_splits(18 * 8, 8192, 64, False, cpu) is None
    assert one_wave_dense_splits(18 * 8, 8192, 128, True, cpu) is None
    assert one_wave_dense_splits(18 * 8, 512, 128, False, cpu) is None
    # B = 83 at 8k: 4 splits of 128 tokens, but 664 pairs overfill one wave of 5 x 132 64-token programs
    assert choose_num_splits(83, 8, 64, cpu) == 4 and one_wave_dense_splits(83 * 8, 8192, 128, False, cpu) is None
    assert one_wave_dense_splits(74 * 8, 8192, 128, False, cpu) == 1
    # the launcher's dense plan takes it: block size and split count, and the launch it gives equals an explicit call
    q = torch.zeros(18, 32, 128)
    k = torch.zeros(18, 8, 8192, 128)
    plan = art_decode_module.plan_decode(q, k, k)
    assert (plan.block_size, plan.num_splits, plan.max_steps, plan.dense_plan) == (64, 4, 128, True)
    explicit = art_decode_module.plan_decode(q, k, k, block_size=64, num_splits=4)
    assert (explicit.block_size, explicit.num_splits, explicit.max_steps) == (64, 4, 128)
    # a ragged batch plans by its longest walk; ART and an explicit block size keep their own plans
    lengths = torch.full((18,), 1000, dtype=torch.int32)
    lengths[3] = 8192
    assert art_decode_module.plan_decode(q, k, k, cache_seqlens=lengths).block_size == 64
    lengths[3] = 8193
    k_long = torch.zeros(18, 8, 8193, 128)
    assert art_decode_module.plan_decode(q, k_long, k_long, cache_seqlens=lengths).block_size == 128
    assert art_decode_module.plan_decode(q, k, k, block_size=128).num_splits == 8
    assert art_decode_module.plan_decode(q, k, k, art=ARTParams()).block_size == 64
    assert art_decode_module.plan_decode(q[:8], k[:8], k[:8]).block_size == 128


def test_split_plan_defers_the_followers_where_the_dense_walk_would_end_last(fake_sms):
    fake_sms(132)
    monitor = ARTParams()                                           # done at step 16 at the earliest: 17 steps
    assert earliest_stop_steps(monitor) == 17
    assert earliest_stop_steps(ARTParams(patience=40, min_steps=9)) == 49   # done at step 48

    def plan(batch, kv_heads, blocks, head_dim=128, longest=None, art=monitor, walks=None):
        return choose_split_plan(batch, kv_heads, blocks, None, art, 64, head_dim, longest_stop_steps=longest,
                                 told_walks=walks)

    # the dense walk (every block at 1.2 blocks per lone step per SM at D = 128, 1.9 at D = 64) ends within
    # GUESS_REGRET_RATIO (2) times the guessed longest walk (2 earliest ends, 34 blocks): followers at once
    assert plan(1, 8, 512) == (66, 0)                               # 26 lone steps
    assert plan(8, 8, 168) == (8, 0)                                # 67.9 (the blocks per SM over two: 41 > 34)
    assert plan(1, 3, 2048, head_dim=64) == (128, 0)                # 24.5 (SmolLM2 B = 1, 128k)
    assert plan(32, 3, 128, head_dim=64) == (5, 0)                  # 49 (SmolLM2 B = 32, 8k: walks of 46-128)
    # else the followers wait for the leader's step 34; at D = 128 the grid keeps 3 programs per SM (3 stages)
    assert plan(8, 8, 169) == (6, 34)                               # 68.3 > 68; 396 // 64 programs
    assert plan(1, 8, 2048) == (49, 34)                             # 103 > 68; 396 // 8
    assert plan(32, 8, 512) == (1, 0)                               # 396 // 256: one split, no follower
    assert plan(32, 3, 512, head_dim=64) == (5, 34)                 # SmolLM2 B = 32, 32k: 196 > 68
    assert plan(128, 3, 512, head_dim=64) == (1, 0)                 # one program per pair already fills the SMs
    # told the longest walk, the rule compares the dense walk with it, and the followers wait for that step; told a
    # walk that outlasts the dense walk, the call takes the guess of a call not told (V87)
    assert plan(32, 3, 128, head_dim=64, longest=128) == (5, 0)     # 49 < 128, and 49 <= 2 x 34: at once
    assert plan(32, 3, 512, head_dim=64, longest=349) == (5, 34)    # 196 < 349, and 196 > 68: the guess
    assert plan(32, 3, 512, head_dim=64, longest=242) == (5, 34)
    assert plan(32, 3, 512, head_dim=64, longest=195) == (5, 195)   # 196 > 195: the told walk
    # told each walk, the guess only where at least half the walks end in the leader's range (34 + 478 // 5 = 129)
    assert plan(32, 3, 512, head_dim=64, longest=349, walks=[60] * 48 + [349] * 48) == (5, 34)
    assert plan(32, 3, 512, head_dim=64, longest=349, walks=[129] * 48 + [349] * 48) == (5, 34)
    assert plan(32, 3, 512, head_dim=64, longest=349, walks=[60] * 47 + [130] + [349] * 48) == (5, 0)
    assert plan(32, 3, 512, head_dim=64, longest=512, walks=[512] * 96) == (5, 0)   # no walk stops: at once
    assert plan(32, 3, 2048, head_dim=64, longest=241, walks=[241] * 96) == (5, 241)  # the told walk, as above
    assert plan(32, 3, 2048, head_dim=64, longest=241) == (5, 241)  # 784 > 241
    assert plan(8, 8, 512, longest=44) == (6, 44)                   # 207 > 44
    # told, the walk needs no margin: 52 > 40 defers, where the guess (52 <= 2 x 34) did not
    assert plan(8, 8, 128, longest=40) == (6, 40) and plan(8, 8, 128) == (8, 0)
    assert plan(8, 8, 512, longest=600, art=None) == (4, 0)         # dense: unused; 2 programs per SM (V61)


def test_on_demand_plan_splits_by_length_and_releases_a_few_programs_per_multiprocessor(fake_sms):
    from kernels.split_plan import on_demand_plan

    fake_sms(132)
    monitor = ARTParams()                                           # earliest stop 17 steps: follow step 34
    # the best plans measured on the SmolLM2 layer at B = 128 (V47) and the two lengths checked after (V48); every
    # leader still alone releases at 4 follow steps, or a tenth of the walk where that is later (V51)
    for blocks, splits, release, step in ((128, 4, 264, 136), (256, 8, 132, 136), (512, 16, 66, 136),
                                          (1024, 32, 33, 136), (2048, 32, 33, 204)):
        assert on_demand_plan(blocks, None, monitor) == {"num_splits": splits, "follow_step": 34,
                                                         "release_walks": release, "release_step": step}
    assert on_demand_plan(40, None, monitor)["num_splits"] == 4     # at least 4 splits
    assert on_demand_plan(1024, None, ARTParams(patience=40, min_steps=9))["follow_step"] == 98
    assert on_demand_plan(1024, None, ARTParams(patience=40, min_steps=9))["release_step"] == 392
    with pytest.raises(ValueError, match="max_steps"):
        on_demand_plan(0, None, monitor)
    with pytest.raises(TypeError, match="ARTParams"):
        on_demand_plan(128, None, None)


def test_the_monitor_runs_only_where_the_leaders_range_reaches_the_earliest_stop():
    monitor = ARTParams()                                                        # earliest stop: 17 steps
    assert leader_can_stop(17, 1, monitor) and not leader_can_stop(16, 1, monitor)
    assert not leader_can_stop(512, 33, monitor)                                 # B = 1, 32k: 16 steps each
    assert leader_can_stop(2048, 33, monitor)                                    # B = 1, 128k: 63 steps
    assert leader_can_stop(128, 4, monitor)                                      # B = 8, 8k: 32 steps
    assert not leader_can_stop(64, 4, ARTParams(patience=13, min_steps=4))      # 16 steps < 17
    assert leader_can_stop(64, 4, ARTParams(patience=12, min_steps=4))
    # deferred followers: the leader's range also holds the steps before the follow step
    assert leader_range(512, 33, 20) == 20 + 492 // 33 and leader_can_stop(512, 33, monitor, follow_step=20)
    assert leader_range(100, 4, 1000) == 100                                     # a gate past the walk: all of it
    assert leader_range(torch.tensor([100, 40]), 4, 50).tolist() == [62, 40]


def test_tile_batch_repeats_rows_cyclically():
    x = torch.arange(6).view(2, 3)
    assert tile_batch((x,), 5)[0].tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5], [0, 1, 2]]


def test_summary_checks_the_targets_on_the_rows():
    def row(impl, ms, batch=32, seqlen=32768, data="synthetic", **extra):
        return dict(data=data, batch=batch, seqlen=seqlen, impl=impl, ms=ms, **extra)

    rows = [row("cudnn_sdpa", 1.0), row("flash_sdpa", 1.5), row("art_dense", 1.02), row("art_dense_bs64", 1.0),
            row("art_never", 1.05), row("art", 0.2, meets_time_bound=False),
            row("cudnn_sdpa", 0.05, batch=1), row("art_dense", 0.06, batch=1), row("art_dense_bs64", 0.06, batch=1),
            row("art_never", 0.06, batch=1), row("art", 0.05, batch=1, meets_time_bound=True, follow_step=34),
            dict(data="synthetic", batch=1, seqlen=32768, impl="flex_attention", error="compile error"),
            # a row whose monitor cannot stop any walk runs the dense walk: not a monitor overhead
            row("art_dense_bs64", 0.01, batch=1, seqlen=8192), row("art_never", 0.02, batch=1, seqlen=8192,
                                                                   monitor_runs=False)]
    summary = summarise(rows, 4.2)
    assert abs(summary["dense_over_best_peer_throughput_b16plus_min"] - 1.0 / 1.02) < 1e-12
    assert summary["b1_s32k"] == {"art_dense_ms": 0.06, "best_peer_ms": 0.05}
    assert abs(summary["monitor_overhead_max"] - 0.05) < 1e-12
    assert summary["monitor_overhead_rows"] == 2 and summary["monitor_skipped_rows"] == 1
    assert summary["art_rows_meeting_time_bound"] == 1 and summary["art_rows"] == 2
    assert summary["art_rows_meeting_time_bound_with_deferred_followers"] == 1
    assert summary["art_rows_with_deferred_followers"] == 1
    assert summary["art_rows_missing_time_bound_below_latency_floor"] == 0
    rows[5]["time_bound_below_latency_floor"] = True                  # the row that misses its bound
    rows[10]["time_bound_below_latency_floor"] = True                 # meets it: not counted
    rows.append(row("art_calibrated", 0.1, meets_time_bound=True, longest_stop_steps=40))
    rows.append(row("art_calibrated", 0.1, batch=128, meets_time_bound=False, longest_stop_steps=90,
                    pair_split_threshold=60, wave_steps=0))
    summary = summarise(rows, 4.2, {"synthetic": {"step_us": 1.3, "fixed_us": 4.0}})
    assert summary["art_calibrated_rows_with_pair_splits"] == 1
    assert summary["art_calibrated_rows_meeting_time_bound_with_pair_splits"] == 0
    assert summary["art_calibrated_rows_with_wave"] == 0
    rows[-2]["wave_steps"] = 48                                       # the told row that meets its bound took a wave
    summary = summarise(rows, 4.2, {"synthetic": {"step_us": 1.3, "fixed_us": 4.0}})
    assert summary["art_calibrated_rows_with_wave"] == 1
    assert summary["art_calibrated_rows_meeting_time_bound_with_wave"] == 1
    assert summary["art_rows_missing_time_bound_below_latency_floor"] == 1
    assert summary["lone_walk_step_us_synthetic"] == 1.3
    assert summary["art_calibrated_rows_meeting_time_bound"] == 1 and summary["art_calibrated_rows"] == 2
    assert summary["art_rows"] == 2                                   # the calibrated rows are counted apart
    assert summary["art_rows_modelled"] == 0 and summary["art_ms_over_model_max"] is None
    rows[5]["model_ms"], rows[10]["model_ms"] = 0.16, 0.05           # 0.2 / 0.16 and 0.05 / 0.05
    summary = summarise(rows, 4.2)
    assert summary["art_rows_modelled"] == 2
    assert summary["art_ms_over_model_min"] == pytest.approx(1.0)
    assert summary["art_ms_over_model_max"] == pytest.approx(1.25)
    assert summary["art_rows_with_walks_dense"] == 0 and summary["art_ms_over_walks_dense_min"] is None
    rows[5].update(walks_dense_ms=0.25, time_bound_below_walks_dense=True)      # misses: counted
    rows[10].update(walks_dense_ms=0.04, time_bound_below_walks_dense=True)     # meets its bound: not counted
    summary = summarise(rows, 4.2)
    assert summary["art_rows_with_walks_dense"] == 2
    assert summary["art_ms_over_walks_dense_min"] == pytest.approx(0.8)
    assert summary["art_ms_over_walks_dense_max"] == pytest.approx(1.25)
    assert summary["art_rows_missing_time_bound_below_walks_dense"] == 1
    # the bound after do_bench's memset is counted apart, on the rows that were timed after it
    assert summary["art_rows_meeting_time_bound_memset_flush"] == 0
    rows[5]["meets_time_bound_memset_flush"] = True
    rows[10]["meets_time_bound_memset_flush"] = False
    rows[-1]["meets_time_bound_memset_flush"] = True
    summary = summarise(rows, 4.2)
    assert summary["art_rows_meeting_time_bound_memset_flush"] == 1
    assert summary["art_calibrated_rows_meeting_time_bound_memset_flush"] == 1
    assert summary["art_rows_meeting_time_bound"] == 1                 # the read-flush count is unchanged
    # the stops the plan keeps in the output, over the rows that report them
    assert summary["art_rows_with_stopped_pairs"] == 0 and summary["art_stopped_pairs_over_single_min"] is None
    rows[5].update(stopped_pairs=0.25, single_stopped_pairs=1.0)                # a leader range too short for most
    rows[10].update(stopped_pairs=0.5, single_stopped_pairs=0.5)
    summary = summarise(rows, 4.2)
    assert summary["art_rows_with_stopped_pairs"] == 2 and summary["art_rows_keeping_every_stop"] == 1
    assert summary["art_stopped_pairs_over_single_min"] == pytest.approx(0.25)
    # never stopping at the default plan, over dense: absent rows give None, the worst shape is named
    assert summary["never_default_over_dense_max"] is None and summary["never_default_worst_shape"] is None
    rows += [row("art_never_default", 1.53), row("art_never_default", 0.063, batch=1)]   # over 1.02 and 0.06
    summary = summarise(rows, 4.2)
    assert summary["never_default_over_dense_max"] == pytest.approx(1.5)
    assert summary["never_default_over_dense_median"] == pytest.approx(1.5)        # the upper of two
    assert summary["never_default_worst_shape"] == {"data": "synthetic", "batch": 32, "seqlen": 32768}
    # the wave's rows: its bound, and its time over the default call's
    assert summary["art_wave_rows"] == 0 and summary["art_wave_over_art_min"] is None
    rows += [row("art_wave", 0.1, meets_time_bound=False, over_art=0.5),
             row("art_wave", 0.06, batch=1, meets_time_bound=True, over_art=1.2)]
    summary = summarise(rows, 4.2)
    assert summary["art_wave_rows"] == 2 and summary["art_wave_rows_meeting_time_bound"] == 1
    assert summary["art_wave_rows_faster_than_art"] == 1
    assert (summary["art_wave_over_art_min"], summary["art_wave_over_art_max"]) == (0.5, 1.2)


def test_overhead_rows_whose_rounds_spread_past_the_target_are_not_resolved():
    def row(impl, rounds, batch):
        return dict(data="synthetic", batch=batch, seqlen=8192, impl=impl, ms=sorted(rounds)[1], ms_rounds=rounds)

    rows = [row("art_dense_bs64", [1.000, 1.002, 1.001], 32), row("art_never", [1.008, 1.009, 1.007], 32),
            # +2 % by the medians, but the never-stopping rounds spread 3 %: within the card's drift
            row("art_dense_bs64", [2.000, 2.001, 2.002], 64), row("art_never", [2.040, 1.990, 2.050], 64),
            # the reference's rounds spread 1.5 %: not resolved either, whatever the overhead reads
            row("art_dense_bs64", [3.000, 3.045, 3.010], 128), row("art_never", [3.001, 3.002, 3.003], 128)]
    summary = summarise(rows, 4.2)
    assert summary["monitor_overhead_rows"] == 3
    assert abs(summary["monitor_overhead_max"] - (2.040 / 2.001 - 1)) < 1e-12
    assert summary["monitor_overhead_rows_over_target"] == 1
    assert summary["monitor_overhead_resolved_rows"] == 1
    assert abs(summary["monitor_overhead_max_resolved"] - (1.008 / 1.001 - 1)) < 1e-12
    # the fastest rounds: 1.007 / 1.000, 1.990 / 2.000 and 3.001 / 3.000
    assert abs(summary["monitor_overhead_fastest_rounds_max"] - (1.007 / 1.000 - 1)) < 1e-12
    assert summary["monitor_overhead_fastest_rounds_over_target"] == 0
    rows[3]["ms_rounds"] = [2.040, 2.050, 2.060]                    # every round slow: over the target either way
    summary = summarise(rows, 4.2)
    assert abs(summary["monitor_overhead_fastest_rounds_max"] - (2.040 / 2.000 - 1)) < 1e-12
    assert summary["monitor_overhead_fastest_rounds_over_target"] == 1
    assert summarise(rows[:2], 4.2)["monitor_overhead_rows_over_target"] == 0
    assert summary["monitor_overhead_settled_rows"] == 0 and summary["monitor_overhead_settled_max"] is None
    # the 64 row timed on to 9 rounds (time_interleaved's settle): counted, with its median overhead
    rows[2].update(ms_rounds=[2.000, 2.001, 2.002, 2.000, 2.001, 2.000, 2.001, 2.002, 2.000], ms=2.001)
    rows[3].update(ms_rounds=[2.040, 1.990, 2.050, 2.001, 2.003, 2.002, 2.004, 2.001, 2.002], ms=2.002)
    summary = summarise(rows, 4.2)
    assert summary["monitor_overhead_settled_rows"] == 1
    assert abs(summary["monitor_overhead_settled_max"] - (2.002 / 2.001 - 1)) < 1e-12
    assert "1 timed to 9 rounds" in target_rows(summary)[2]["measured"]


def test_lone_walk_latency_is_the_slope_over_two_lengths(monkeypatch):
    import kernels.bench as bench

    lengths = []

    def fake_graph_ms(fn, rep_ms):
        return 0.004 + 0.0013 * -(-lengths[-1] // 64)              # 4 us fixed, 1.3 us per 64-token block

    def make_qkv(seqlen):
        lengths.append(seqlen)
        return torch.empty(1, 4, 64), torch.empty(1, 2, seqlen, 64), torch.empty(1, 2, seqlen, 64)

    monkeypatch.setattr(bench, "graph_ms", fake_graph_ms)
    lone = bench.lone_walk_latency(make_qkv, rep_ms=1)
    assert lengths == list(bench.LONE_WALK_LENGTHS) and lone["lengths"] == lengths
    assert abs(lone["step_us"] - 1.3) < 1e-9 and abs(lone["fixed_us"] - 4.0) < 1e-9
    with pytest.raises(ValueError, match="batch 1"):
        bench.lone_walk_latency(lambda seqlen: (torch.empty(2, 4, 64),) * 3, rep_ms=1)


def test_shape_rows_take_the_median_of_interleaved_rounds(monkeypatch):
    import itertools

    import kernels.bench as bench
    from art_analysis.synthetic import synthetic_cache
    from kernels.art_params import ARTParams

    cache = synthetic_cache(batch=2, num_q_heads=4, num_kv_heads=2, seqlen=256, head_dim=64, dtype=torch.float16)
    q, k, v = cache.q, cache.k, cache.v
    order = []
    clock = itertools.count(1)

    def fake_graph_ms(fn, rep_ms, flush="read"):
        order.append(flush)
        return float(next(clock))

    monkeypatch.setattr(bench, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_peer_fns", lambda q, k, v, flex: {
        "cudnn_sdpa": lambda: bench.art_decode(q, k, v)[:, :, None], "flash_sdpa": "no kernel for this shape"})
    rows = bench.bench_shape(q, k, v, data="synthetic", art=ARTParams(), rep_ms=1, ceiling=1.0, rounds=3,
                             lone_walk={"step_us": 2.0, "fixed_us": 5.0})
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["flash_sdpa"] == {**{key: by_impl["art"][key] for key in
                                        ("data", "batch", "seqlen", "q_heads", "kv_heads", "head_dim")},
                                     "impl": "flash_sdpa", "error": "no kernel for this shape"}
    timed = ["cudnn_sdpa", "art_dense", "art_dense_bs64", "art_never", "art_never_default", "art", "art_calibrated",
             "art_walks_dense", "art_wave"]
    # each round times every call in turn after a read of the L2, and the time bound's calls (dense and ART) right
    # after that once more after do_bench's memset: 12 timings a round (1..12, 13..24, 25..36).  The monitor's
    # overhead pair spread far past 1 % over those rounds: the two are then timed in turn to 9 rounds (37..48)
    settled = {"art_never": [37.0, 39.0, 41.0, 43.0, 45.0, 47.0],
               "art_dense_bs64": [38.0, 40.0, 42.0, 44.0, 46.0, 48.0]}
    first = 1
    for impl in timed:
        memset = impl in ("art_dense", "art", "art_calibrated")
        assert by_impl[impl]["ms_rounds"] == [first, first + 12.0, first + 24.0] + settled.get(impl, [])
        assert by_impl[impl]["ms"] == (first + 12.0 if impl not in settled else settled[impl][1])
        assert by_impl[impl]["eager_ms"] == 0.5
        if memset:
            assert by_impl[impl]["ms_memset_flush_rounds"] == [first + 1, first + 13.0, first + 25.0]
            assert by_impl[impl]["ms_memset_flush"] == first + 13.0
        else:
            assert "ms_memset_flush" not in by_impl[impl]
        first += 2 if memset else 1
    assert order == 3 * ["read", "read", "memset", "read", "read", "read", "read", "memset", "read", "memset",
                         "read", "read"] + 12 * ["read"]
    assert by_impl["art_dense"]["ms"] == 14.0 and by_impl["art_dense"]["ms_memset_flush"] == 15.0
    # the dense row states the plan its call took: one split of 64-token blocks (D = 64, 4 pairs on the CPU's one
    # multiprocessor)
    assert (by_impl["art_dense"]["num_splits"], by_impl["art_dense"]["block_size"]) == (1, 64)
    assert by_impl["art"]["time_bound_ms"] == 1.15 * by_impl["art"]["loaded_fraction"] * 14.0 + 0.010
    assert by_impl["art"]["meets_time_bound"] == (by_impl["art"]["ms"] <= by_impl["art"]["time_bound_ms"])
    # under the memset, the bound is the memset's dense time's, and the ART time the memset's too
    assert by_impl["art"]["time_bound_memset_flush_ms"] == 1.15 * by_impl["art"]["loaded_fraction"] * 15.0 + 0.010
    assert by_impl["art"]["meets_time_bound_memset_flush"] == (
        by_impl["art"]["ms_memset_flush"] <= by_impl["art"]["time_bound_memset_flush_ms"])
    # the calibrated row: the longest walk of a single-split call, passed to the split rule
    _, single = bench.art_decode(q, k, v, art=ARTParams(), num_splits=1, return_stats=True)
    calibrated = by_impl["art_calibrated"]
    assert calibrated["longest_stop_steps"] == int(single[..., 0].max())
    _, hinted = bench.art_decode(q, k, v, art=ARTParams(), longest_stop_steps=calibrated["longest_stop_steps"],
                                 return_stats=True)
    assert calibrated["num_splits"] == hinted.shape[-1]
    assert calibrated["loaded_fraction"] == bench.loaded_fraction(hinted, 256)
    assert calibrated["time_bound_ms"] == 1.15 * calibrated["loaded_fraction"] * 14.0 + 0.010
    # the wave's row: its blocks in the loaded fraction and the bound, and its time over the default call's
    wave = by_impl["art_wave"]
    _, wave_steps = bench.art_decode(q, k, v, art=ARTParams(), wave_steps=bench.WAVE_STEPS, return_stats=True)
    assert wave["wave_steps"] == 4 and wave["loaded_fraction"] == bench.loaded_fraction(wave_steps, 256)
    assert wave["time_bound_ms"] == 1.15 * wave["loaded_fraction"] * 14.0 + 0.010
    assert wave["meets_time_bound"] == (wave["ms"] <= wave["time_bound_ms"])
    assert wave["over_art"] == wave["ms"] / by_impl["art"]["ms"]
    assert wave["wave_finished_pairs"] == 1.0   # every walk of 4 blocks lies in the wave
    # the latency floor: the longest leader walk (the kernel's own step counts) at the lone step time
    _, steps = bench.art_decode(q, k, v, art=ARTParams(), return_stats=True)
    assert by_impl["art"]["leader_steps_max"] == int(steps[..., 0].max()) > 0
    assert by_impl["art"]["leader_steps_mean"] == float(steps[..., 0].float().mean())
    assert by_impl["art"]["latency_floor_ms"] == (5.0 + 2.0 * by_impl["art"]["leader_steps_max"]) / 1e3
    assert by_impl["art"]["time_bound_below_latency_floor"] == (
        by_impl["art"]["time_bound_ms"] < by_impl["art"]["latency_floor_ms"])
    # the share of pairs whose output stopped before the walk's end (4 blocks), and of those whose single walk does
    assert by_impl["art"]["single_stopped_pairs"] == float((single[..., 0] < 4).double().mean())
    _, _, taken = bench.art_decode(q, k, v, art=ARTParams(), return_stats=True, return_result_steps=True)
    assert by_impl["art"]["stopped_pairs"] == float((taken < 4).double().mean())
    # one split (one multiprocessor off the GPU): the walks' fluid model at the dense row's throughput
    assert by_impl["art"]["num_splits"] == 1
    walks = steps[..., 0].flatten().tolist()
    assert by_impl["art"]["walk_steps_histogram"] == {str(n): walks.count(n) for n in sorted(set(walks))}
    assert by_impl["art"]["model_ms"] == bench.walk_model_ms(walks, {"step_us": 2.0, "fixed_us": 5.0}, 64, 2,
                                                             bench.kv_bytes(k) / 14.0 / 1e9, 1)
    # the dense kernel over the same walks: its loaded fraction is the single-split walks', its time the rows'
    assert by_impl["art_walks_dense"]["loaded_fraction"] == by_impl["art"]["loaded_fraction"]
    assert by_impl["art"]["walks_dense_ms"] == by_impl["art_walks_dense"]["ms"] == 23.0
    assert by_impl["art"]["time_bound_below_walks_dense"] == (by_impl["art"]["time_bound_ms"] < 23.0)
    assert by_impl["art_dense"]["rel_error_vs_peer"] == 0.0
    assert by_impl["art_dense"]["speedup_vs_best_peer"] == 13.0 / 14.0
    # never stopping at the default plan: the plan the ART row takes (the thresholds do not change it)
    never_default = by_impl["art_never_default"]
    assert (never_default["num_splits"], never_default["follow_step"]) == (
        by_impl["art"]["num_splits"], by_impl["art"]["follow_step"])


def test_interleaved_rounds_record_the_clock_and_power_as_each_round_ends(monkeypatch):
    import itertools

    import kernels.bench as bench

    clock = itertools.count(1)
    readings = itertools.count(1)
    monkeypatch.setattr(bench, "graph_ms", lambda fn, rep_ms: float(next(clock)))
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    calls = {"a": lambda: None, "b": lambda: None, "broken": "no kernel"}
    # each reading follows the timing it belongs to: a's rounds are timings 1, 3, 5 and readings 1, 3, 5
    monkeypatch.setattr(bench, "clock_and_power", lambda device: (lambda n: {"sm_mhz": 1000 + n, "power_w": n / 2})(
        next(readings)))
    results = bench.time_interleaved(calls, 1, 3, torch.device("cuda"))
    assert results["a"]["ms_rounds"] == [1.0, 3.0, 5.0] and results["a"]["sm_mhz_rounds"] == [1001, 1003, 1005]
    assert results["b"]["power_w_rounds"] == [1.0, 2.0, 3.0] and results["b"]["ms"] == 4.0
    assert results["broken"] == {"error": "no kernel"}
    # no NVML: the rows hold the times alone
    monkeypatch.setattr(bench, "clock_and_power", lambda device: None)
    results = bench.time_interleaved(calls, 1, 2, torch.device("cuda"))
    assert set(results["a"]) == {"eager_ms", "ms_rounds", "timing", "ms"}


def test_a_ratios_calls_whose_rounds_spread_past_the_limit_are_timed_on_interleaved(monkeypatch):
    import kernels.bench as bench

    times = {"never": iter([1.00, 1.05, 1.00, 1.01, 1.02, 1.00, 0.99]), "dense": iter([1.0] * 7),
             "peer": iter([2.0] * 7)}
    order = []

    def fake_graph_ms(fn, rep_ms, flush="read"):
        order.append(fn())
        return next(times[fn()])

    monkeypatch.setattr(bench, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "clock_and_power", lambda device: None)
    calls = {name: (lambda name=name: name) for name in ("peer", "never", "dense")}
    # never's first 3 rounds spread 5 % > 1 %: never and dense are timed on, in turn, to 7 rounds; the peer is not
    results = bench.time_interleaved(calls, 1, 3, torch.device("cuda"), settle=("never", "dense"),
                                     settle_spread=0.01, settle_rounds=7)
    assert order == 3 * ["peer", "never", "dense"] + 4 * ["never", "dense"]
    assert results["never"]["ms_rounds"] == [1.00, 1.05, 1.00, 1.01, 1.02, 1.00, 0.99]
    assert results["never"]["ms"] == 1.00 and len(results["dense"]["ms_rounds"]) == 7
    assert results["peer"]["ms_rounds"] == [2.0] * 3
    # within the limit: the rounds asked for and no more
    times.update(never=iter([1.00, 1.005, 1.00]), dense=iter([1.0] * 3), peer=iter([2.0] * 3))
    order.clear()
    results = bench.time_interleaved(calls, 1, 3, torch.device("cuda"), settle=("never", "dense"),
                                     settle_spread=0.01, settle_rounds=7)
    assert order == 3 * ["peer", "never", "dense"] and results["never"]["ms"] == 1.00


def test_clock_and_power_reads_nvml_in_megahertz_and_watts(monkeypatch):
    from kernels.device_info import clock_and_power

    assert clock_and_power(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: 1980)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 512_500)   # NVML reports milliwatts
    assert clock_and_power(torch.device("cuda")) == {"sm_mhz": 1980, "power_w": 512.5}

    def no_nvml(device):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    assert clock_and_power(torch.device("cuda")) is None


def test_walk_replay_reads_each_walks_blocks_as_one_dense_program():
    from art_analysis.synthetic import synthetic_cache
    from kernels.art_decode import art_decode
    from kernels.bench import walk_replay_inputs

    cache = synthetic_cache(batch=2, num_q_heads=6, num_kv_heads=2, seqlen=300, head_dim=64, dtype=torch.float32)
    walks = torch.tensor([[1, 5], [3, 2]])
    q, k, v, lengths = walk_replay_inputs(cache.q, cache.k, cache.v, walks)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [64, 300, 192, 128]     # 5 blocks: the whole 300
    out, steps = art_decode(q, k, v, cache_seqlens=lengths, block_size=64, num_splits=1, return_stats=True)
    assert steps.flatten().tolist() == walks.flatten().tolist()
    out = out.view(2, 6, 64)
    for b in range(2):
        for h in range(2):
            n = int(lengths[2 * b + h])
            scores = cache.q[b, 3 * h:3 * h + 3] @ cache.k[b, h, :n].T / 8.0
            expected = torch.softmax(scores, -1) @ cache.v[b, h, :n]
            torch.testing.assert_close(out[b, 3 * h:3 * h + 3], expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\[B, Hkv\] = \[2, 2\]"):
        walk_replay_inputs(cache.q, cache.k, cache.v, walks.flatten())


def test_walk_model_of_a_launch_counts_64_token_blocks_and_the_resident_programs():
    import kernels.bench as bench
    from kernels.walk_model import shared_bandwidth_ms

    lone = {"step_us": 1.5, "fixed_us": 4.0}
    walks = [7, 3, 9, 2, 2, 5, 6, 4, 6, 3, 8, 3, 5, 11]                     # 14 programs, 12 resident
    expected = shared_bandwidth_ms(walks, step_us=1.5, fixed_us=4.0, block_bytes=2 * 64 * 128 * 2,
                                   bandwidth_tb_per_s=10.0, slots=12)
    assert bench.walk_model_ms(walks, lone, 128, 2, 10.0, 3) == expected
    assert expected > shared_bandwidth_ms(walks, step_us=1.5, fixed_us=4.0, block_bytes=2 * 64 * 128 * 2,
                                          bandwidth_tb_per_s=10.0, slots=14)   # two walks wait for a slot


def test_launch_config_two_stages_only_when_a_wave_at_three_cannot_hold_the_grid_one_warp_at_d64(fake_sms, monkeypatch):
    monkeypatch.setattr(art_decode_module.torch.cuda, "get_device_capability", lambda device: (9, 0))
    fake_sms(132)
    config = art_decode_module._launch_config
    cuda = torch.device("cuda")
    host = "host_descriptors"
    assert config(cuda, 64, 128, 3 * 132, host) == (2, 3)       # B = 32 x 8 KV heads at one split: one wave
    assert config(cuda, 64, 128, 3 * 132 + 1, host) == (2, 2)   # B = 64: 512 programs, four per SM at two stages
    assert config(cuda, 64, 64, 4096, host) == (1, 3)           # 64-dim tiles through host descriptors: one warp
    assert config(cuda, 64, 64, 4096, host, pair_splits=True) == (1, 4)   # per-pair splits: 4 per SM, not 6
    assert config(cuda, 64, 128, 4096, host, pair_splits=True) == (2, 2)  # only the 64-dim tiles take a fourth
    assert config(cuda, 64, 64, 4096, "kernel_descriptors", pair_splits=True) == (2, 3)
    assert config(cuda, 16, 64, 8, host) == (1, 3)
    assert config(cuda, 64, 64, 4096, "pointers") == (2, 3)     # gathered (paged) 64-dim rows keep two
    assert config(cuda, 64, 64, 8, "kernel_descriptors") == (2, 3)
    assert config(cuda, 32, 128, 4096, host) == (2, 3)
    assert config(cuda, 128, 128, 4096, "pointers") == (4, 3)
    assert config(torch.device("cpu"), 64, 128, 4096, host) == (4, 2)
    # paged: two more stages, for the page-table loads the pipeliner stages ahead of the tiles
    assert config(cuda, 128, 128, 4096, "pointers", paged=True) == (4, 5)
    assert config(cuda, 64, 128, 3 * 132 + 1, "pointers", paged=True) == (2, 4)
    assert config(cuda, 64, 64, 8, "pointers", paged=True) == (2, 5)


def test_stop_agreement_counts_the_walks_equal_to_the_simulators(fake_sms):
    """The single walks against the simulator's, and the default plan's outputs against the blocks the simulator's
    walks give them: on one multiprocessor the plan is the single walk (walks of 12 / 6 / 9 / 5 of 16 blocks, all
    stopped); on 132 it takes 4 splits, whose leaders hold 4 blocks, so that a walk of more runs dense."""
    from art_analysis.synthetic import synthetic_cache
    from art_analysis.termination import ARTConfig, replay_kernel_walks
    from kernels.bench import stop_agreement

    cache = synthetic_cache(batch=2, num_q_heads=4, num_kv_heads=2, seqlen=1024, head_dim=64, preset="realistic",
                            dtype=torch.float16)
    config = ARTConfig(tau=2e-2, phi=1e-3, patience=3)
    replay = lambda q, k, v: replay_kernel_walks(q, k, v, config)                  # noqa: E731
    exact = stop_agreement(cache.q, cache.k, cache.v, config.kernel_params(), replay)
    plan = {"plan_num_splits": 1, "plan_follow_step": 0, "plan_equal": 4, "plan_stopped": 4, "stopped": 4}
    assert exact == {"pairs": 4, "equal": 4, "off_by_one": 0, "max_abs_diff": 0, "differences": {}, **plan}
    walks = replay(cache.q, cache.k, cache.v)
    assert walks.tolist() == [[12, 6], [9, 5]]
    shifted = lambda q, k, v: walks + torch.tensor([[1, 0], [0, -3]])              # noqa: E731
    report = stop_agreement(cache.q, cache.k, cache.v, config.kernel_params(), shifted)
    assert report == {"pairs": 4, "equal": 2, "off_by_one": 1, "max_abs_diff": 3, "differences": {"-1": 1, "3": 1},
                      **plan, "plan_equal": 2}
    with pytest.raises(ValueError, match=r"\[B, Hkv\]"):
        stop_agreement(cache.q, cache.k, cache.v, config.kernel_params(), lambda q, k, v: walks.flatten())
    rows = [dict(data="synthetic", batch=2, seqlen=1024, impl="art_dense", ms=1.0)]
    summary = summarise(rows, 4.2, agreement=[exact, report])
    assert (summary["stop_steps_equal"], summary["stop_steps_pairs"], summary["stop_steps_max_abs_diff"]) == (6, 8, 3)
    assert (summary["plan_result_steps_equal"], summary["plan_stopped_pairs"], summary["simulator_stopped_pairs"]) == (
        6, 8, 8)
    assert "stop_steps_equal" not in summarise(rows, 4.2)
    fake_sms(132)
    quick = ARTConfig(tau=2e-2, phi=1e-3, patience=2, min_steps=1)                  # walks of 5 / 5 / 8 / 4 blocks
    replay = lambda q, k, v: replay_kernel_walks(q, k, v, quick)                   # noqa: E731
    spread = stop_agreement(cache.q, cache.k, cache.v, quick.kernel_params(), replay)
    assert replay(cache.q, cache.k, cache.v).tolist() == [[5, 5], [8, 4]]
    assert {key: spread[key] for key in plan} == {"plan_num_splits": 4, "plan_follow_step": 0, "plan_equal": 4,
                                                  "plan_stopped": 1, "stopped": 4}
    quick_walks = replay(cache.q, cache.k, cache.v)
    shifted = lambda q, k, v: quick_walks + torch.tensor([[1, 0], [0, -3]])        # noqa: E731
    # (0, 0): 6 blocks, past the leader's range, so the whole walk as the kernel gives it; (1, 1): 1 block, not 4
    assert stop_agreement(cache.q, cache.k, cache.v, quick.kernel_params(), shifted)["plan_equal"] == 3


def test_capture_queries_reads_the_decode_steps_of_a_captured_layer():
    from pathlib import Path

    from kernels.bench import capture_queries

    assert capture_queries(Path(__file__).parent / "fixtures" / "smollm2_layer15_ctx1024.safetensors") == 8


def test_tiled_capture_cycles_over_sequences_then_decode_queries(tmp_path):
    from safetensors.torch import save_file

    from kernels.bench import capture_queries, tiled_capture

    # two sequences of 5 tokens, 3 decode queries each; every value names its sequence, head, position or step
    k = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).view(2, 1, 5, 2)
    decode_q = torch.arange(2 * 2 * 3 * 2, dtype=torch.float32).view(2, 2, 3, 2)
    path = tmp_path / "layer.safetensors"
    save_file({"k": k, "v": -k, "decode_q": decode_q}, str(path))
    assert capture_queries(path) == 6
    q, k_tiled, v_tiled = tiled_capture(path, 7, 12, torch.device("cpu"))
    assert q.shape == (7, 2, 2) and k_tiled.shape == (7, 1, 12, 2) and q.dtype == torch.bfloat16
    for b in range(7):
        sequence, step = b % 2, (b // 2) % 3
        assert torch.equal(q[b], decode_q[sequence, :, step].bfloat16())
        tokens = torch.arange(12) % 5                      # the sequence repeated to the length
        assert torch.equal(k_tiled[b], k[sequence][:, tokens].bfloat16())
        assert torch.equal(v_tiled[b], -k[sequence][:, tokens].bfloat16())
    # one captured sequence: row b takes decode query b % steps, as the benchmark's SmolLM2 rows always have
    save_file({"k": k[:1].clone(), "v": k[:1].clone(), "decode_q": decode_q[:1].clone()}, str(path))
    q, k_tiled, _ = tiled_capture(path, 4, 5, torch.device("cpu"))
    assert torch.equal(q, decode_q[0, :, [0, 1, 2, 0]].permute(1, 0, 2).bfloat16())
    assert torch.equal(k_tiled, k[:1].expand(4, -1, -1, -1).bfloat16())
    # one decode step for every row: a decode loop's step
    q, _, _ = tiled_capture(path, 3, 5, torch.device("cpu"), step=2)
    assert torch.equal(q, decode_q[0, :, 2].expand(3, -1, -1).bfloat16())


@pytest.mark.parametrize("damage, message", [
    ("missing", "is not a file"),
    ("not_safetensors", "not a readable safetensors file"),
    ("no_decode_q", r"holds \['k', 'v'\]; expected a captured layer"),
    ("v_shape", r"v \(2, 1, 4, 2\)"),
    ("heads", r"decode_q \(2, 3, 3, 2\)"),
    ("int_values", "'I64'"),
])
def test_a_file_that_is_no_captured_layer_is_refused_before_anything_is_timed(tmp_path, monkeypatch, damage,
                                                                               message):
    from safetensors.torch import save_file

    import kernels.bench as bench

    path = tmp_path / "layer.safetensors"
    k, decode_q = torch.zeros(2, 2, 5, 2, dtype=torch.float16), torch.zeros(2, 4, 3, 2, dtype=torch.float16)
    tensors = {"k": k, "v": k.clone(), "decode_q": decode_q}
    if damage == "not_safetensors":
        path.write_text('{"k": [1, 2]}')
    elif damage != "missing":
        if damage == "no_decode_q":
            del tensors["decode_q"]
        elif damage == "v_shape":
            tensors["v"] = torch.zeros(2, 1, 4, 2, dtype=torch.float16)
        elif damage == "heads":
            tensors["decode_q"] = torch.zeros(2, 3, 3, 2, dtype=torch.float16)
        else:
            tensors["k"], tensors["v"] = k.long(), k.long()
        save_file(tensors, str(path))
    calls = _fake_device_run(monkeypatch)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        bench.run(tmp_path / "out", True, art=ARTParams(), make_cache=None, capture=path)
    assert calls["ceiling"] == 0 and calls["cases"] == [] and not (tmp_path / "out").exists()
    save_file({"k": k, "v": k.clone(), "decode_q": decode_q}, str(path))
    assert bench.decode_query_shape(path) == (2, 4, 3, 2)


def test_paged_rows_time_each_layout_against_the_contiguous_one(monkeypatch):
    import itertools

    import kernels.bench as bench
    from art_analysis.synthetic import synthetic_cache

    cache = synthetic_cache(batch=2, num_q_heads=4, num_kv_heads=2, seqlen=256, head_dim=64, dtype=torch.float16)
    q, k, v = cache.q, cache.k, cache.v
    clock = itertools.count(1)
    monkeypatch.setattr(bench, "graph_ms", lambda fn, rep_ms: float(next(clock)))
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    rows = bench.bench_paged(q, k, v, art=ARTParams(), rep_ms=1, ceiling=1.0, rounds=1)
    by_key = {(r["impl"], r["page_size"]): r for r in rows}
    assert list(by_key) == [("art_dense", None), ("art", None), ("art_dense", 16), ("art", 16),
                            ("art_dense", 64), ("art", 64)]
    # one round: the calls are timed in that order, 1..6
    for i, key in enumerate(by_key):
        assert by_key[key]["ms"] == 1.0 + i
        assert by_key[key]["tb_per_s"] == bench.kv_bytes(k) / (1.0 + i) / 1e9
    assert by_key[("art_dense", 64)]["over_contiguous"] == 5.0 / 1.0
    assert by_key[("art", 16)]["over_contiguous"] == 4.0 / 2.0
    _, steps = bench.art_decode(q, k, v, art=ARTParams(), return_stats=True)
    for size in (None, 16, 64):
        assert by_key[("art", size)]["loaded_fraction"] == bench.loaded_fraction(steps, 256)
        assert by_key[("art", size)]["equals_contiguous"] is True
    assert bench.paged_summary(rows) == {
        "paged_art_dense_over_contiguous_max": 5.0, "paged_art_dense_over_contiguous_min": 3.0,
        "paged_art_over_contiguous_max": 3.0, "paged_art_over_contiguous_min": 2.0,
        "paged_art_walks_equal_contiguous": "2/2"}


def test_paged_rows_report_a_walk_that_differs_from_the_contiguous_one(monkeypatch):
    import kernels.bench as bench
    from art_analysis.synthetic import synthetic_cache

    cache = synthetic_cache(batch=2, num_q_heads=4, num_kv_heads=2, seqlen=256, head_dim=64, dtype=torch.float16)
    real_to_paged = bench.to_paged

    def swapped_sequences(k, v, page_size, seed):
        k_pages, v_pages, table = real_to_paged(k, v, page_size, seed=seed)
        return k_pages, v_pages, table.flip(0)  # each sequence reads the other's pages

    monkeypatch.setattr(bench, "to_paged", swapped_sequences)
    monkeypatch.setattr(bench, "graph_ms", lambda fn, rep_ms: 1.0)
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    rows = bench.bench_paged(cache.q, cache.k, cache.v, art=ARTParams(), rep_ms=1, ceiling=1.0, rounds=1)
    assert [r["equals_contiguous"] for r in rows if r["impl"] == "art" and r["page_size"]] == [False, False]
    assert bench.paged_summary(rows)["paged_art_walks_equal_contiguous"] == "0/2"


def test_paged_rows_compare_the_leaders_walks_not_the_followers_loads(monkeypatch):
    import kernels.bench as bench
    from art_analysis.synthetic import synthetic_cache

    cache = synthetic_cache(batch=2, num_q_heads=4, num_kv_heads=2, seqlen=256, head_dim=64, dtype=torch.float16)
    real_art_decode = bench.art_decode

    def followers_late_on_pages(*args, block_table=None, return_stats=False, **kwargs):
        result = real_art_decode(*args, block_table=block_table, return_stats=return_stats, num_splits=2, **kwargs)
        if not return_stats:
            return result
        out, steps = result
        if block_table is not None:  # a follower that saw its leader's flag a chunk later loaded more blocks
            steps = steps.clone()
            steps[..., 1] += 1
        return out, steps

    monkeypatch.setattr(bench, "art_decode", followers_late_on_pages)
    monkeypatch.setattr(bench, "graph_ms", lambda fn, rep_ms: 1.0)
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    rows = bench.bench_paged(cache.q, cache.k, cache.v, art=ARTParams(), rep_ms=1, ceiling=1.0, rounds=1)
    art_rows = {r["page_size"]: r for r in rows if r["impl"] == "art"}
    # pages of 64 hold whole 64-token blocks: the same tiles as the contiguous walk, so the same output bit for bit
    assert art_rows[64]["num_splits"] == 2
    assert art_rows[64]["loaded_fraction"] > art_rows[None]["loaded_fraction"]
    assert art_rows[64]["equals_contiguous"] is True


def test_decode_loop_tells_each_step_the_previous_steps_walks(monkeypatch, tmp_path):
    import itertools

    from safetensors.torch import save_file

    import kernels.bench as bench
    import kernels.bench_decode_loop as loop
    from art_analysis.synthetic import synthetic_cache
    from kernels.split_plan import hint_plan
    from kernels.art_params import ARTParams
    from kernels.pair_walks import PairWalks
    from kernels.walk_hint import pair_walk_lengths

    # two captured sequences of 700 tokens, three decode queries each
    cache = synthetic_cache(batch=2, num_q_heads=6, num_kv_heads=2, seqlen=700, head_dim=64, seed=5)
    noise = torch.Generator().manual_seed(0)
    decode_q = torch.stack([cache.q + step * torch.randn(cache.q.shape, generator=noise) for step in range(3)], dim=2)
    path = tmp_path / "layer_015.safetensors"
    save_file({"k": cache.k.half(), "v": cache.v.half(), "decode_q": decode_q.half()}, str(path))
    # the interpreter's bf16 dot is wrong: walk the tiled layer in fp16
    monkeypatch.setattr(loop, "tiled_capture", lambda *args, **kwargs: tuple(
        x.half() for x in bench.tiled_capture(*args, **kwargs)))
    clock = itertools.count(1)
    monkeypatch.setattr(bench, "graph_ms", lambda fn, rep_ms: float(next(clock)))
    monkeypatch.setattr(bench, "median_ms", lambda fn, rep_ms: 0.5)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    art = ARTParams(tau=1e-2, phi=1e-3, patience=2)
    cpu = torch.device("cpu")
    # the hint's plan of step 1 is hint_plan's; step 2's is taken as on-demand followers, whatever its walks
    hint_plans = []
    monkeypatch.setattr(loop, "hint_plan", lambda *args: hint_plans.append(args) or (
        hint_plan(*args) if len(hint_plans) == 1 else {"release_walks": 3}))
    rows = loop.decode_loop(path, 4, 2048, art=art, rep_ms=1, device=cpu, rounds=2)
    assert len(hint_plans) == 2
    hinted_on_demand = []
    assert [(r["step"], r["impl"]) for r in rows] == [(s, impl) for s in range(3) for impl in loop.IMPLS]
    by_key = {(r["step"], r["impl"]): r for r in rows}
    # each step's five calls are timed in two interleaved rounds: 5 graph times, then 5 more
    calls = len(loop.IMPLS)
    assert calls == 5
    for step in range(3):
        for i, impl in enumerate(loop.IMPLS):
            assert by_key[(step, impl)]["ms_rounds"] == [2.0 * calls * step + 1 + i, 2.0 * calls * step + calls + 1 + i]
    assert by_key[(0, "art_previous_step")]["longest_stop_steps"] is None
    assert by_key[(0, "art_previous_step")]["pair_walks"] is None
    for step in range(3):
        q, k, v = (x.half() for x in bench.tiled_capture(path, 4, 2048, cpu, step=step))
        _, single = bench.art_decode(q, k, v, art=art, num_splits=1, return_stats=True)
        assert by_key[(step, "art_calibrated")]["pair_walks"] == single[..., 0].tolist()
        assert by_key[(step, "art_calibrated")]["longest_stop_steps"] == int(single[..., 0].max())
        told = by_key[(step, "art_previous_step")]["pair_walks"]
        plan = ({} if told is None else {"release_walks": 3} if step == 2
                else hint_plan(PairWalks.from_walks(torch.tensor(told)), 32, 64, cpu, art))
        previous = by_key[(step, "art_previous_step")]
        assert previous["on_demand"] == ("release_walks" in plan) and previous.get("release_walks") == plan.get(
            "release_walks")
        hinted_on_demand.append(previous["on_demand"])
        _, previous_steps, taken = bench.art_decode(q, k, v, art=art, return_stats=True, return_result_steps=True,
                                                    **plan)
        assert previous["num_splits"] == previous_steps.shape[-1]
        assert previous["loaded_fraction"] == bench.loaded_fraction(previous_steps, 2048)
        assert previous["stopped_pairs"] == float((taken < 32).double().mean())
        assert previous["single_stopped_pairs"] == float((single[..., 0] < 32).double().mean()) > 0
        # on-demand followers at the length's plan (one multiprocessor here: 2 pairs released at 4 splits)
        plan = by_key[(step, "art_on_demand")]
        assert {key: plan[key] for key in ("num_splits", "follow_step", "release_walks")} == {
            "num_splits": 4, "follow_step": 6, "release_walks": 2}
        _, steps = bench.art_decode(q, k, v, art=art, num_splits=4, follow_step=6, release_walks=2, return_stats=True)
        assert plan["loaded_fraction"] == bench.loaded_fraction(steps, 2048)
        if step < 2:   # the next step is told this step's walks
            walks = pair_walk_lengths(previous_steps, on_demand=previous["on_demand"])
            assert by_key[(step + 1, "art_previous_step")]["pair_walks"] == walks.tolist()
            assert by_key[(step + 1, "art_previous_step")]["longest_stop_steps"] == int(walks.max())
    assert len({by_key[(s, "art_calibrated")]["longest_stop_steps"] for s in range(3)}) > 1   # the walks move
    summary = loop.loop_summary(rows)
    assert summary["total_ms"]["art_dense"] == sum(by_key[(s, "art_dense")]["ms"] for s in range(3))
    assert summary["previous_step_over_dense"] == summary["total_ms"]["art_previous_step"] / summary["total_ms"][
        "art_dense"]
    assert summary["on_demand_over_dense"] == summary["total_ms"]["art_on_demand"] / summary["total_ms"]["art_dense"]
    assert summary["previous_step_same_splits"] == sum(
        by_key[(s, "art_previous_step")]["num_splits"] == by_key[(s, "art_calibrated")]["num_splits"]
        for s in range(3)) and summary["steps"] == 3
    assert hinted_on_demand[2] and summary["previous_step_on_demand"] == sum(hinted_on_demand)
    assert summary["stopped_pairs_mean"]["art_previous_step"] == pytest.approx(
        sum(by_key[(s, "art_previous_step")]["stopped_pairs"] for s in range(3)) / 3)
    assert set(summary["stopped_pairs_mean"]) == set(loop.IMPLS) - {"art_dense"}


def test_target_rows_state_each_target_of_a_run_and_whether_it_was_met(capsys):
    import json
    from pathlib import Path

    import kernels.bench as bench
    from art_analysis.cli.bench import _print_summaries

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "2026-12-05-art-decode-v67.json"
    summary = json.loads(path.read_text())["summary"]
    rows = bench.target_rows(summary)
    assert [row["met"] for row in rows] == [True, True, True, False]
    assert rows[0]["measured"] == "min 0.989x (median 1.000x)"
    assert rows[1]["measured"] == "0.0386 ms against 0.0404"
    assert rows[2]["measured"] == "max +0.84% over 20 rows (fastest rounds: max +0.78%)"
    assert rows[3]["measured"] == "15 of 26 rows (19 of 26 told each walk)"
    # a target the run did not reach: over the threshold, or not measured at all (a quick run without B >= 16)
    worse = {**summary, "monitor_overhead_max": 0.0101, "dense_over_best_peer_throughput_b16plus_min": None,
             "b1_s32k": {"art_dense_ms": 0.05, "best_peer_ms": 0.04}, "art_rows_meeting_time_bound": 26}
    assert [row["met"] for row in bench.target_rows(worse)] == [None, False, False, True]
    _print_summaries({"decode": summary})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "decode targets:" and printed[-1].endswith("no") and "15 of 26 rows" in printed[-1]


class _Interrupted(Exception):
    """Stands for the time limit that cuts a benchmark run short."""


def _fake_device_run(monkeypatch, fail_at_case: int | None = None) -> dict:
    """Make :func:`kernels.bench.run` run on the CPU with fake measurements; returns the counts of what it measured
    (``cases``: the shapes timed in order; ``ceiling``, ``lone``: measurements made).  ``fail_at_case``: the shape
    count at which the main grid's timing raises :class:`_Interrupted`."""
    import types

    import kernels.bench as bench

    calls = {"cases": [], "ceiling": 0, "lone": 0, "dense_batches": [], "paged": []}
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "source_revision", lambda: {"commit": "abc", "modified": False, "from": "git"})

    def ceiling(device):
        calls["ceiling"] += 1
        return 4.0

    def lone(make_qkv, rep_ms):
        calls["lone"] += 1
        return {"step_us": 1.2, "fixed_us": 5.0}

    def shape(q, k, v, *, data, **kwargs):
        if fail_at_case is not None and len(calls["cases"]) == fail_at_case:
            raise _Interrupted
        calls["cases"].append((data, q.shape[0], k.shape[2]))
        return [dict(data=data, batch=q.shape[0], seqlen=k.shape[2], impl="art_dense", ms=1.0)]

    def dense_rows(batch, seqlen, rep_ms, ceiling, device, rounds):
        calls["dense_batches"].append((batch, seqlen, rep_ms))
        return [dict(batch=batch, seqlen=seqlen, impl="art_dense", ms=1.0, speedup_vs_best_peer=1.0, num_splits=1)]

    def paged(q, k, v, **kwargs):
        calls["paged"].append((q.shape[0], k.shape[2]))
        return [dict(batch=q.shape[0], seqlen=k.shape[2], impl="art_dense", page_size=16, ms=1.0)]

    monkeypatch.setattr(bench, "copy_ceiling_tb_per_s", ceiling)
    monkeypatch.setattr(bench, "lone_walk_latency", lone)
    monkeypatch.setattr(bench, "structured_sequences", lambda make_cache, seqlen, device: (
        torch.zeros(2, 4, 1), torch.zeros(2, 2, seqlen, 1), torch.zeros(2, 2, seqlen, 1)))
    monkeypatch.setattr(bench, "bench_shape", shape)
    monkeypatch.setattr(bench, "split_study", lambda q, k, v, **kwargs: [])
    monkeypatch.setattr(bench, "_dense_batch_rows", dense_rows)
    monkeypatch.setattr(bench, "bench_paged", paged)
    return calls


def test_a_run_cut_short_is_finished_by_a_resumed_run_that_times_only_the_missing_shapes(monkeypatch, tmp_path):
    import kernels.bench as bench

    art = ARTParams()
    calls = _fake_device_run(monkeypatch, fail_at_case=2)
    with pytest.raises(_Interrupted):
        bench.run(tmp_path, True, art=art, make_cache=None)
    [path] = tmp_path.glob("*-art-decode.json")
    cut = json.loads(path.read_text())
    assert cut["complete"] is False and len(cut["rows"]) == 2 and cut["copy_ceiling_tb_per_s"] == 4.0
    first_cases = list(calls["cases"])

    calls = _fake_device_run(monkeypatch)
    payload = bench.run(tmp_path, True, art=art, make_cache=None, resume=True)
    assert calls["ceiling"] == 0 and calls["lone"] == 0, "the earlier run's ceiling and lone walks are kept"
    every_case = [("synthetic", b, s) for s in bench.QUICK_LENGTHS for b in bench.QUICK_BATCHES]
    assert first_cases + calls["cases"] == every_case
    assert [(r["data"], r["batch"], r["seqlen"]) for r in payload["rows"]] == every_case
    assert calls["dense_batches"] == [(b, 8192, bench.DENSE_BATCH_REP_MS) for b in bench.QUICK_DENSE_BATCHES]
    assert calls["paged"] == list(bench.QUICK_PAGED_CASES)
    assert payload["complete"] is True and "summary" in payload and payload["date"] == cut["date"]
    assert json.loads(path.read_text()) == json.loads(json.dumps(payload))
    assert list(tmp_path.glob("*-art-decode.json")) == [path]

    # resumed once more, the complete run is returned as it is, nothing timed
    calls = _fake_device_run(monkeypatch)
    assert bench.run(tmp_path, True, art=art, make_cache=None, resume=True)["rows"] == payload["rows"]
    assert calls["cases"] == [] and calls["ceiling"] == 0


def test_a_resumed_run_without_a_result_to_continue_says_so_and_times_every_shape(monkeypatch, tmp_path, capsys):
    import kernels.bench as bench

    (tmp_path / "resume.json").write_text(json.dumps({"suite": "decode", "complete": False, "rows": []}))
    calls = _fake_device_run(monkeypatch)
    payload = bench.run(tmp_path, True, art=ARTParams(), make_cache=None, resume=True)
    assert "no run of these settings in" in capsys.readouterr().out
    assert calls["ceiling"] == 1 and payload["complete"] and len(calls["cases"]) == len(payload["rows"]) > 0


def test_a_resumed_run_refuses_an_incomplete_run_of_other_settings(monkeypatch, tmp_path):
    import kernels.bench as bench

    _fake_device_run(monkeypatch, fail_at_case=1)
    with pytest.raises(_Interrupted):
        bench.run(tmp_path, True, art=ARTParams(), make_cache=None)
    calls = _fake_device_run(monkeypatch)
    with pytest.raises(ValueError, match="incomplete run with other settings \\(art differ\\)"):
        bench.run(tmp_path, True, art=ARTParams(tau=0.02), make_cache=None, resume=True)
    assert calls["cases"] == [] and calls["ceiling"] == 0
    # without resume the run starts afresh (and replaces the file of the same date)
    payload = bench.run(tmp_path, True, art=ARTParams(tau=0.02), make_cache=None)
    assert calls["ceiling"] == 1 and payload["complete"] and payload["art"]["tau"] == 0.02
