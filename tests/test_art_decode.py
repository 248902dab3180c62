"""`kernels.art_decode` against the simulator: outputs within the FlashAttention oracle, stop
steps equal to the simulator's kernel-mode replay, zero thresholds bit-identical to dense,
outputs fully written, ragged lengths and paged layouts.

CPU runs use the Triton interpreter on small fp16/fp32 shapes; the ``gpu`` tests repeat the
checks at real sizes in bf16 (``pytest -m gpu``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from safetensors.torch import load_file

import kernels.art_decode as art_decode_module
import kernels.split_plan as split_plan_module
from kernels import art_decode_kernel
from art_analysis.blockwise import blockwise_attention
from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import ARTConfig, kernel_walk_steps, stop
from kernels.art_decode import art_decode, plan_decode
from kernels.paged_cache import to_paged
from kernels.pair_walks import PairWalks

CPU = torch.device("cpu")
CAPTURED_LAYER = Path(__file__).parent / "fixtures" / "smollm2_layer15_ctx1024.safetensors"
def synthetic_inputs(batch, q_heads, kv_heads, seqlen, dim, dtype, device, seed=0, preset="realistic"):
    """``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]`` with sink / recency / heavy-hitter structure."""
    cache = synthetic_cache(batch=batch, num_q_heads=q_heads, num_kv_heads=kv_heads, seqlen=seqlen,
                            head_dim=dim, preset=preset, seed=seed, dtype=dtype, device=device)
    return cache.q, cache.k, cache.v


def captured_inputs(device, dtype=torch.float16):
    """A real SmolLM2 layer: the 8 recorded decode queries as a batch of 8 ragged sequences.

    Returns ``q [8, 9, 64]``, ``k, v [8, 3, S, 64]`` and ``cache_seqlens [8]`` (decode step ``t``
    attends to the first ``C + t + 1`` cached tokens).
    """
    tensors = load_file(str(CAPTURED_LAYER))
    k, v, decode_q = tensors["k"], tensors["v"], tensors["decode_q"]
    steps = decode_q.shape[2]
    context = k.shape[2] - steps
    q = decode_q[0].permute(1, 0, 2).contiguous()
    k = k.expand(steps, -1, -1, -1).contiguous()
    v = v.expand(steps, -1, -1, -1).contiguous()
    seqlens = torch.arange(context + 1, context + steps + 1, dtype=torch.int32)
    return (q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype),
            v.to(device=device, dtype=dtype), seqlens.to(device))


def same_dtype_reference(q, k, v, seqlens=None, sm_scale=None):
    """Attention computed by PyTorch in the inputs' dtype (the FlashAttention test oracle's ``out_pt``)."""
    _, q_heads, dim = q.shape
    group = q_heads // k.shape[1]
    sm_scale = dim ** -0.5 if sm_scale is None else sm_scale
    kk = k.repeat_interleave(group, dim=1)
    vv = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q, kk) * sm_scale
    if seqlens is not None:
        valid = torch.arange(k.shape[2], device=k.device)[None, :] < seqlens[:, None]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("bhs,bhsd->bhd", weights, vv)


def assert_within_flash_oracle(out, q, k, v, seqlens=None):
    """``max|out - ref64| <= 3 max|out_same_dtype - ref64| + 1e-5`` (DESIGN §9)."""
    ref = blockwise_attention(q, k, v, cache_seqlens=seqlens, mode="exact").final_out
    same = same_dtype_reference(q, k, v, seqlens)
    err = (out.double() - ref).abs().max().item()
    bound = 3 * (same.double() - ref).abs().max().item() + 1e-5
    assert err <= bound, f"kernel error {err:.3e} exceeds the FlashAttention oracle bound {bound:.3e}"


def assert_paged_agrees(paged, contiguous, page_size, block_size):
    """Paged results against the contiguous layout's: bit for bit, except where a block is read one tile per page
    (pages of at least ``MIN_SUBPAGE`` tokens smaller than the block), whose ``sum p`` adds the pages' tiles first:
    floating results within a few units in the last place, step counts equal."""
    tiles_per_page = block_size % page_size == 0 and art_decode_module.MIN_SUBPAGE <= page_size < block_size
    for a, b in zip(paged, contiguous):
        if tiles_per_page and a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=4 * torch.finfo(a.dtype).eps, atol=1e-6)
        else:
            assert torch.equal(a, b)


def simulator_stop(q, k, v, seqlens, config, order, block_size=64):
    """Steps each ``(b, kv_head)`` visits under ``config`` in the simulator: ``[B, Hkv]`` and the StopResult."""
    trace = blockwise_attention(q, k, v, block_size=block_size, order=order, cache_seqlens=seqlens, mode="kernel")
    result = stop(trace, config)
    return kernel_walk_steps(result, k.shape[1]), result


def compare_stop_steps(cases, configs, order="sink_recency", num_splits=1, **launch):
    """Kernel vs simulator steps over every case and config: ``(matches, total, mismatched differences)``; ``launch``:
    more ``art_decode`` keywords (a wave's walks are its result steps; without one, the leader's steps)."""
    matches, total, differences = 0, 0, []
    for q, k, v, seqlens in cases:
        trace = blockwise_attention(q, k, v, order=order, cache_seqlens=seqlens, mode="kernel")
        group = q.shape[1] // k.shape[1]
        for config in configs:
            result = stop(trace, config)
            expected = kernel_walk_steps(result, k.shape[1])
            out, steps, result_steps = art_decode(q, k, v, cache_seqlens=seqlens, art=config.kernel_params(),
                                                  order=order, num_splits=num_splits, return_stats=True,
                                                  return_result_steps=True, **launch)
            got = (result_steps if launch.get("wave_steps") else steps[..., 0]).long()
            same = got == expected
            matches += int(same.sum())
            total += same.numel()
            differences += (got - expected)[~same].tolist()
            agree = same.repeat_interleave(group, dim=1)
            if agree.any():
                torch.testing.assert_close(out[agree].double(), result.output[agree].double(), rtol=2e-2, atol=2e-2)
    return matches, total, differences


def assert_stop_agreement(matches, total, differences, label):
    print(f"{label}: stop steps equal for {matches}/{total} (b, kv_head); differences {differences}")
    assert matches >= 0.99 * total, f"{label}: only {matches}/{total} stop steps agree; differences {differences}"
    assert all(abs(d) == 1 for d in differences), f"{label}: stop steps off by more than one: {differences}"


ART_CONFIGS = (
    ARTConfig(tau=1e-3, phi=1e-4, patience=3),
    ARTConfig(tau=3e-3, phi=3e-4, patience=2, probe_dims="mma", min_steps=3),
    ARTConfig(tau=1e-3, phi=1e-4, patience=2, probe_source="accumulator", scale="relative"),
    ARTConfig(tau=2e-2, phi=1e-3, patience=2, probe_source="accumulator", scale="absolute", probe_dims="mma"),
    ARTConfig(tau=2e-3, phi=1.0, patience=3, use_direction=False),
    ARTConfig(tau=1.0, phi=2e-4, patience=3, use_scale=False),
)


@pytest.mark.parametrize("dtype, dim, q_heads, kv_heads, order, splits, block_size", [
    (torch.float16, 64, 3, 3, "sink_recency", 1, None),
    (torch.float16, 64, 6, 2, "sequential", 3, 64),
    (torch.float16, 128, 10, 2, "sink_recency", 4, None),
    (torch.float16, 64, 16, 2, "sink_recency", 2, 32),
    (torch.float32, 128, 8, 2, "sequential", 1, 64),
    (torch.float32, 64, 4, 4, "sink_recency", 5, 16),
])
def test_dense_output_within_flash_oracle(dtype, dim, q_heads, kv_heads, order, splits, block_size):
    q, k, v = synthetic_inputs(2, q_heads, kv_heads, 700, dim, dtype, CPU, seed=dim + q_heads)
    out, lse = art_decode(q, k, v, order=order, num_splits=splits, block_size=block_size, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert_within_flash_oracle(out, q, k, v)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), k.double().repeat_interleave(q_heads // kv_heads, 1))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores * dim ** -0.5, -1), rtol=0, atol=1e-4)


def test_monitor_reads_the_tiles_leading_half_only_when_the_group_fits_there():
    groups = (1, 4, 8, 9, 12, 16, 17, 32, 33)
    assert [art_decode_module.tile_rows(g) for g in groups] == [
        (16, 8), (16, 8), (16, 8), (16, 16), (16, 16), (16, 16), (32, 32), (32, 32), (64, 64)]


def test_stop_steps_match_simulator_on_synthetic_caches():
    cases = []
    # groups of 4, 3 and 5 heads (the monitor reads half the 16-row tile), 8 (that half full) and 12 (the whole tile)
    for seed, (preset, q_heads, kv_heads) in enumerate((("realistic", 8, 2), ("peaked", 6, 2), ("diffuse", 5, 1),
                                                        ("realistic", 16, 2), ("peaked", 12, 1))):
        q, k, v = synthetic_inputs(3, q_heads, kv_heads, 1000, 64, torch.float16, CPU, seed=seed, preset=preset)
        cases.append((q, k, v, None))
    assert_stop_agreement(*compare_stop_steps(cases, ART_CONFIGS), "synthetic")


def test_stop_steps_match_simulator_at_the_default_thresholds():
    # phi = 1e-6 sits at the fp32 rounding of 1 - dot / (|x| |y|): with that quotient in the monitor, 5 of these
    # 32 walks differed from the simulator's by up to 30 steps; both now use the cancellation-free 1 - cos
    cases = [(*synthetic_inputs(2, 16, 4, 4096, 128, torch.float16, CPU, seed=seed, preset=preset), None)
             for seed, preset in enumerate(("realistic", "realistic", "peaked", "diffuse"))]
    assert_stop_agreement(*compare_stop_steps(cases, [ARTConfig()]), "synthetic, default thresholds")


def test_stop_steps_match_simulator_on_captured_layer():
    q, k, v, seqlens = (x[::2] for x in captured_inputs(CPU))
    assert_stop_agreement(*compare_stop_steps([(q, k, v, seqlens)], ART_CONFIGS[:4]), "captured SmolLM2 layer 15")


def test_stop_steps_match_simulator_in_sequential_order():
    q, k, v = synthetic_inputs(2, 6, 3, 800, 64, torch.float16, CPU, seed=7)
    assert_stop_agreement(*compare_stop_steps([(q, k, v, None)], ART_CONFIGS[:3], order="sequential"),
                          "sequential order")


def test_leader_split_stops_where_the_simulator_does_and_followers_are_dropped():
    """Where the leader stops, the output is the single walk's and its result steps are the simulator's; elsewhere
    the dense walk's, over all 24 steps.  Pair (2, 0)'s leader stops at the last step of its 12: its followers have
    walked their range too (the interpreter runs programs one at a time), so the programs' steps alone are those of
    a walk that did not stop, and only the result steps tell it apart."""
    q, k, v = synthetic_inputs(4, 8, 2, 1536, 64, torch.float16, CPU, seed=3)   # 24 steps, leader holds 12
    config = ARTConfig(tau=1e-3, phi=1e-4, patience=3)
    expected, _ = simulator_stop(q, k, v, None, config, "sink_recency")
    single = art_decode(q, k, v, art=config.kernel_params(), num_splits=1)
    dense = art_decode(q, k, v, num_splits=2, block_size=64)
    out, steps, taken = art_decode(q, k, v, art=config.kernel_params(), num_splits=2, return_stats=True,
                                   return_result_steps=True)
    leader_stopped = expected <= 12
    assert leader_stopped.any() and (~leader_stopped).any(), "the case must cover both outcomes"
    group = q.shape[1] // k.shape[1]
    stopped_heads = leader_stopped.repeat_interleave(group, dim=1)
    assert torch.equal(steps[..., 0][leader_stopped].long(), expected[leader_stopped])
    assert torch.equal(out[stopped_heads], single[stopped_heads])
    assert torch.equal(steps[~leader_stopped], torch.full_like(steps[~leader_stopped], 12))
    assert torch.equal(out[~stopped_heads], dense[~stopped_heads])
    assert taken.dtype == torch.int32 and torch.equal(taken.long(), torch.where(leader_stopped, expected, 24))
    assert expected[2, 0] == 12 and steps[2, 0].tolist() == [12, 12] and taken[2, 0] == 12
    assert torch.equal(taken.long(), split_plan_module.planned_result_steps(expected, 24, 2))


@pytest.mark.parametrize("splits, follow_step", [(2, 0), (3, 4)])
def test_planned_result_steps_are_the_result_steps_of_ragged_walks(splits, follow_step):
    """``planned_result_steps`` told the simulator's walks and each sequence's blocks gives the kernel's result
    steps under followers at once and deferred ones, where each sequence's leader holds a range of its own."""
    q, k, v = synthetic_inputs(4, 8, 2, 1536, 64, torch.float16, CPU, seed=3)
    seqlens = torch.tensor([1536, 1000, 700, 64])                 # 24, 16, 11 and 1 blocks
    config = ARTConfig(tau=3e-3, phi=3e-4, patience=2)
    expected, _ = simulator_stop(q, k, v, seqlens, config, "sink_recency")    # walks [[8, 8], [11, 8], [3, 6], [1, 1]]
    _, taken = art_decode(q, k, v, cache_seqlens=seqlens, art=config.kernel_params(), num_splits=splits,
                          follow_step=follow_step, return_result_steps=True)
    blocks = torch.tensor([[24], [16], [11], [1]])
    planned = split_plan_module.planned_result_steps(expected, blocks, splits, follow_step)
    assert torch.equal(taken.long(), planned)
    plan = plan_decode(q, k, v, cache_seqlens=seqlens, art=config.kernel_params(), num_splits=splits,
                       follow_step=follow_step)
    assert torch.equal(plan.walk_blocks.long(), blocks)
    assert torch.equal(plan.result_steps(expected), planned), "the plan's result steps are the function's"
    ranges = split_plan_module.leader_range(blocks, splits, follow_step)
    assert ((expected <= ranges) & (expected < blocks)).any() and (expected > ranges).any(), \
        "the case must cover leaders that stop in their range and walks that pass it"
    assert torch.equal(planned, torch.where(expected > ranges, blocks, expected))


@pytest.mark.parametrize("splits, config", [(1, ART_CONFIGS[0]), (1, ART_CONFIGS[1]), (1, ART_CONFIGS[4]),
                                             (2, ARTConfig(tau=1e-3, phi=1e-4, patience=3))])
def test_no_block_past_the_leaders_stop_step_enters_its_state(splits, config):
    """Blocks of the leader's range after its stop step are NaN-poisoned: a chunk that ran past the stop
    would carry NaN into the state it keeps."""
    q, k, v = synthetic_inputs(3, 8, 2, 1536, 64, torch.float16, CPU, seed=5)   # 24 steps of 64 tokens
    out, lse, steps = art_decode(q, k, v, art=config.kernel_params(), num_splits=splits, return_lse=True,
                                 return_stats=True)
    leader_range = -(-24 // splits)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    stopped = steps[..., 0] < leader_range
    assert stopped.any(), "the case must have leaders that stop inside their range"
    for b, kv_head in stopped.nonzero().tolist():
        for step in range(int(steps[b, kv_head, 0]), leader_range):
            block = 0 if step == 0 else 24 - step
            k_poisoned[b, kv_head, block * 64:(block + 1) * 64] = float("nan")
            v_poisoned[b, kv_head, block * 64:(block + 1) * 64] = float("nan")
    again = art_decode(q, k_poisoned, v_poisoned, art=config.kernel_params(), num_splits=splits, return_lse=True,
                       return_stats=True)
    assert torch.equal(again[2], steps)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_walk_that_cannot_stop_runs_without_the_monitor(record_decode_launches, splits):
    q, k, v = synthetic_inputs(2, 6, 2, 1536, 64, torch.float16, CPU, seed=11)   # 24 steps
    config = ARTConfig(tau=1e9, phi=2.0, patience=30).kernel_params()            # stable at once, but 31 > 24
    dense = art_decode(q, k, v, num_splits=splits, block_size=64, return_lse=True, return_stats=True)
    launches = record_decode_launches(forward=True)
    got = art_decode(q, k, v, art=config, num_splits=splits, return_lse=True, return_stats=True)
    assert [call.kwargs["ART"] for call in launches.calls] == [False]
    assert all(torch.equal(a, b) for a, b in zip(got, dense))
    art_decode(q, k, v, art=dataclasses.replace(config, patience=20), num_splits=1)   # 21 <= 24: it can stop
    assert [call.kwargs["ART"] for call in launches.calls] == [False, True]


def test_the_dense_plan_walks_64_token_blocks_at_64_dims_and_serves_the_walks_that_cannot_stop(
        fake_sms, record_decode_launches):
    """A dense call that leaves the walk to the launcher walks 128-token blocks at D = 128 and 64-token blocks at
    D = 64, at the split count of ``choose_num_splits(..., head_dim=D)``; an ART call of the launcher's plan whose
    walks cannot stop runs that dense plan's walk of 64-token blocks: at D = 64 the default dense call, bit for bit."""
    fake_sms(132)
    launches = record_decode_launches(forward=True)
    for dim, block in ((64, 64), (128, 128)):
        q, k, v = synthetic_inputs(1, 6, 2, 1536, dim, torch.float16, CPU, seed=3)
        art_decode(q, k, v)
        splits = split_plan_module.choose_num_splits(1, 2, 1536 // block, CPU, block, head_dim=dim)
        assert launches.calls[-1].kwargs["BLOCK_N"] == block and launches.calls[-1].grid == (splits, 2)
    assert splits == 1536 // 128 // split_plan_module.MIN_STEPS_PER_SPLIT   # 3 splits of 4 blocks at D = 128
    # on 2 multiprocessors the monitored plan takes 4 splits of the 24 blocks (4 programs per SM) and the dense 3
    fake_sms(2)
    q, k, v = synthetic_inputs(1, 6, 2, 1536, 64, torch.float16, CPU, seed=3)
    config = ARTConfig(tau=1e9, phi=2.0, patience=30).kernel_params()           # 31 steps > 24: no walk stops
    dense = art_decode(q, k, v, return_lse=True, return_stats=True)
    got = art_decode(q, k, v, art=config, return_lse=True, return_stats=True)
    assert [call.kwargs["ART"] for call in launches.calls[-2:]] == [False, False]
    assert all(torch.equal(a, b) for a, b in zip(got, dense)) and dense[2].shape == (1, 2, 3)
    assert art_decode(q, k, v, art=config, num_splits=4, return_stats=True)[1].shape == (1, 2, 4)   # chosen: kept


def test_the_64_dim_dense_plan_walks_128_token_blocks_where_about_two_pairs_share_a_multiprocessor(
        fake_sms, record_decode_launches):
    """Where one split of 64-token blocks would leave more than 1.5 and at most 2 pairs per multiprocessor, a
    64-dim dense call of the launcher's plan walks one split of 128-token blocks (V65) if the layout holds them
    whole; elsewhere, and at D = 128, the block is as before."""
    fake_sms(132)
    band = [pairs for pairs in range(1, 400) if split_plan_module.two_pairs_per_sm(pairs, CPU)]
    assert band == list(range(199, 265))
    block = split_plan_module.dense_block_size
    assert [block(None, 64, pairs, CPU) for pairs in (198, 199, 264, 265)] == [64, 128, 128, 64]
    assert [block(page, 64, 256, CPU) for page in (16, 64, 128, 256)] == [64, 64, 128, 128]
    assert block(None, 64) == 64 and block(None, 128, 256, CPU) == 128 and block(64, 128, 256, CPU) == 64
    with pytest.raises(ValueError, match="pairs and device together"):
        block(None, 64, 256)
    # on 2 multiprocessors the band is 4 pairs: B = 2 x 2 KV heads walks one split of 128-token blocks
    fake_sms(2)
    launches = record_decode_launches(forward=True)
    q, k, v = synthetic_inputs(2, 6, 2, 1536, 64, torch.float16, CPU, seed=5)
    _planned_walk_is(launches, q, k, v, block_size=128, num_splits=1)
    art_decode(q[:1], k[:1], v[:1])                                          # 2 pairs: 64-token blocks
    assert launches.calls[-1].kwargs["BLOCK_N"] == 64


def _planned_walk_is(launches, q, k, v, *, block_size: int, num_splits: int) -> tuple:
    """The default dense call's output and LSE, after checking that it launched ``num_splits`` splits of
    ``block_size``-token blocks per pair and equals that walk asked for explicitly, bit for bit."""
    planned = art_decode(q, k, v, return_lse=True)
    assert launches.calls[-1].kwargs["BLOCK_N"] == block_size
    assert launches.calls[-1].grid == (num_splits, q.shape[0] * k.shape[1])
    chosen = art_decode(q, k, v, block_size=block_size, num_splits=num_splits, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(planned, chosen))
    return planned


def test_the_128_dim_dense_plan_walks_64_token_blocks_in_one_wave_where_its_128_token_grid_runs_short_waves(
        fake_sms, record_decode_launches):
    """At D = 128, a dense call of the launcher's plan whose 128-token walk would take several splits in more than
    one wave (``kernels.split_plan.one_wave_dense_splits``) walks 64-token blocks at the one-wave split count: on 2
    multiprocessors, 3 pairs of 1024 tokens take 2 splits of 8 blocks of 128 (6 programs, 3 waves), so the call
    walks 3 splits of 64-token blocks (9 of 10 programs in one wave), equal bit for bit to that walk asked for
    explicitly, and within the FlashAttention oracle of the 128-token walk."""
    fake_sms(2)
    assert split_plan_module.choose_num_splits(3, 1, 8, CPU, 128, head_dim=128) == 2
    launches = record_decode_launches(forward=True)
    q, k, v = synthetic_inputs(3, 4, 1, 1024, 128, torch.float16, CPU, seed=11)
    planned = _planned_walk_is(launches, q, k, v, block_size=64, num_splits=3)
    wide = art_decode(q, k, v, block_size=128, num_splits=2, return_lse=True)
    torch.testing.assert_close(planned[0], wide[0], atol=2e-3, rtol=0)
    torch.testing.assert_close(planned[1], wide[1], atol=1e-4, rtol=0)
    art_decode(q[:1], k[:1], v[:1])                                          # 1 pair: one wave of 128-token blocks
    assert launches.calls[-1].kwargs["BLOCK_N"] == 128


def test_the_dense_plan_gives_64_dim_tiles_two_warps(fake_sms, monkeypatch):
    """On Hopper a dense walk of the launcher's plan reads 64-dim tiles through host descriptors with 2 warps;
    a walk whose configuration the caller chose takes the monitor's 1, so that zero thresholds stay bit-identical."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fake_sms(132)
    config = art_decode_module._launch_config
    cuda = torch.device("cuda")
    assert config(cuda, 64, 64, 384, "host_descriptors", dense_plan=True) == (2, 3)
    assert config(cuda, 64, 64, 384, "host_descriptors") == (1, 3)
    assert config(cuda, 64, 128, 264, "host_descriptors", dense_plan=True) == config(cuda, 64, 128, 264,
                                                                                     "host_descriptors")


def test_the_longest_walk_hint_sets_the_default_split_plan(fake_sms, record_decode_launches):
    fake_sms(132)
    q = torch.zeros(32, 9, 64, dtype=torch.float16)                                 # SmolLM2's heads, 128 steps
    k = v = torch.zeros(32, 3, 8192, 64, dtype=torch.float16)
    long_k = torch.zeros(32, 3, 16384, 64, dtype=torch.float16)                     # 256 steps
    config = ARTConfig(tau=0.0, phi=0.0).kernel_params()                           # never stops: short to run
    launches = record_decode_launches()                                # not run: the split plan is the point
    # dense walk: 32 x 3 x 128 blocks at 1.9 blocks per lone step on each of 132 SMs, 49 lone steps
    art_decode(q, k, v, art=config)                                  # 49 <= 2 x 34 (the guess): followers at once
    art_decode(q, long_k, long_k, art=config)                        # 98 > 68: followers from the guess, step 34
    art_decode(q, k, v, art=config, longest_stop_steps=128)          # 49 <= 128: the guess's rule, at once
    art_decode(q, k, v, art=config, longest_stop_steps=46)           # 49 > 46, told: followers from step 46
    art_decode(q, long_k, long_k, art=config, longest_stop_steps=200)   # 98 <= 200: the guess's rule, step 34
    # told each walk past the dense walk: the guess where half the walks end in the leader's range (34 + 222 // 5);
    # without the told wave, which these walks would take (one long walk among short ones: 30 lone steps)
    short = torch.full((32, 3), 40)
    short[0, 0] = 200
    art_decode(q, long_k, long_k, art=config, pair_walks=PairWalks.from_walks(short), wave_steps=0)  # 95 of 96: 34
    art_decode(q, long_k, long_k, art=config, pair_walks=PairWalks.from_walks(torch.full((32, 3), 256)))  # none: 0
    art_decode(q, k, v, art=config, num_splits=2, longest_stop_steps=128)   # an explicit count: followers at once
    art_decode(q, k, v, art=config, num_splits=2, follow_step=20)
    follow = launches.kernel.arg_names.index("follow_step")
    plans = [(call.grid, call.kwargs["DEFERRED"], call.args[follow]) for call in launches.calls]
    # deferred followers take the grid (pairs, splits), so that every leader is dispatched first
    assert plans == [((5, 96), False, 0), ((96, 5), True, 34), ((5, 96), False, 0), ((96, 5), True, 46),
                     ((96, 5), True, 34), ((96, 5), True, 34), ((5, 96), False, 0), ((2, 96), False, 0),
                     ((96, 2), True, 20)]


def test_plan_decode_states_the_walk_that_art_decode_launches(fake_sms, record_decode_launches):
    """For dense and monitored calls of every plan (the launcher's or given, deferred, on-demand, per-pair, a leader
    that cannot stop), ``plan_decode`` with the same arguments gives the launch's block size, split count and grid,
    follow step, monitor, and followers' scheme, without launching anything itself."""
    from kernels.pair_walks import PairWalks

    q = torch.zeros(4, 8, 64, dtype=torch.float16)
    k = v = torch.zeros(4, 2, 1536, 64, dtype=torch.float16)                          # 24 blocks of 64 tokens
    quick = ARTConfig(tau=1e-3, phi=1e-4, patience=3).kernel_params()                  # can stop from step 4
    lopsided = torch.tensor([[3, 3], [3, 3], [3, 3], [3, 24]], dtype=torch.int32)
    cases = [(132, {}), (132, dict(block_size=64, num_splits=3)),
             (132, dict(art=ARTConfig().kernel_params())),                              # earliest stop 17 of 24
             (132, dict(art=quick)), (132, dict(art=quick, num_splits=3, follow_step=8)),
             (132, dict(art=quick, num_splits=4, release_walks=2)),
             (2, dict(art=quick, pair_walks=PairWalks.from_walks(lopsided))),            # the pairs fill 2 SMs
             (132, dict(art=quick, cache_seqlens=torch.tensor([1536, 700, 64, 1000]), order="sequential"))]
    launches = record_decode_launches()
    follow, limit = (launches.kernel.arg_names.index(name) for name in ("follow_step", "pair_limit"))
    seen = []
    for sms, keywords in cases:
        fake_sms(sms)
        plan = plan_decode(q, k, v, **keywords)
        assert not launches.calls, "plan_decode must not launch"
        assert plan_decode(q, k, v, **keywords) == plan, "plans of one call compare equal (tensors left out)"
        assert "tensor" not in repr(plan)
        art_decode(q, k, v, **keywords)
        call = launches.calls.pop()
        assert call.kwargs["BLOCK_N"] == plan.block_size and plan.num_splits in call.grid
        assert call.grid[0] * call.grid[1] == 8 * plan.num_splits
        assert call.args[follow] == plan.follow_step
        assert call.kwargs["ART"] == (plan.art is not None) and plan.monitored == ("art" in keywords)
        assert (call.kwargs["DEFERRED"], call.kwargs["ON_DEMAND"], call.kwargs["PAIR_GATES"],
                call.kwargs["LONGEST_FIRST"]) == (plan.deferred, plan.on_demand, plan.per_pair_splits,
                                                  plan.longest_first)
        if plan.on_demand:
            assert call.args[limit] == plan.release_walks
        if plan.per_pair_splits:
            assert call.args[limit] == plan.pair_threshold
        assert call.kwargs["RAGGED"] == (plan.seqlens is not None) and plan.max_steps == -(-plan.max_len // 64)
        seen.append((plan.block_size, plan.num_splits, plan.follow_step, plan.art is not None, plan.dense_plan,
                     plan.deferred, plan.on_demand, plan.per_pair_splits))
    assert seen[0][:2] == (64, 6) and seen[0][4], "the dense plan: 64-token blocks at D = 64, 4 blocks per split"
    assert seen[1] == (64, 3, 0, False, False, False, False, False)
    assert seen[2] == seen[0], "a leader that cannot reach step 17: the dense plan's walk"
    assert seen[4][5] and seen[5][6] and seen[6][7], "deferred, on-demand and per-pair plans"
    assert seen[7][3], "the ragged call keeps its monitor"


def test_plan_result_steps_of_a_leader_that_cannot_stop_and_of_schedule_dependent_plans(fake_sms):
    """A monitored call whose leader cannot reach the earliest stop runs the dense walk: its plan's result steps are
    every pair's whole walk, as the kernel records them.  Per-pair splits and on-demand followers have no result
    steps that the single walks fix, so the plan refuses them; walks of the wrong shape or dtype are refused."""
    from kernels.pair_walks import PairWalks

    fake_sms(132)
    q, k, v = synthetic_inputs(4, 8, 2, 1536, 64, torch.float16, CPU, seed=3)      # 24 blocks, 6 splits of 4
    config = ARTConfig(tau=3e-3, phi=3e-4, patience=6)                              # earliest stop 7: 4 blocks short
    walks, _ = simulator_stop(q, k, v, None, config, "sink_recency")
    plan = plan_decode(q, k, v, art=config.kernel_params())
    assert plan.monitored and plan.art is None and plan.walk_blocks == 24
    _, taken = art_decode(q, k, v, art=config.kernel_params(), return_result_steps=True)
    assert (walks < 24).any(), "the single walks must stop where the plan's dense walk does not"
    assert torch.equal(plan.result_steps(walks), torch.full_like(walks, 24))
    assert torch.equal(plan.result_steps(walks), taken.long())
    fake_sms(2)
    dense = plan_decode(q, k, v, block_size=64)
    assert not dense.monitored and dense.num_splits == 1, "8 pairs on 2 SMs: one split, whose range is the walk"
    _, taken = art_decode(q, k, v, block_size=64, return_result_steps=True)
    assert torch.equal(dense.result_steps(walks), taken.long())
    assert torch.equal(taken.long(), torch.full_like(walks, 24)), "a dense call's output holds every block"
    quick = ARTConfig(tau=1e-3, phi=1e-4, patience=3).kernel_params()
    lopsided = PairWalks.from_walks(torch.tensor([[3, 3], [3, 3], [3, 3], [3, 24]], dtype=torch.int32))
    for keywords in (dict(num_splits=4, release_walks=2), dict(pair_walks=lopsided)):
        with pytest.raises(ValueError, match="per-pair splits or on-demand"):
            plan_decode(q, k, v, art=quick, **keywords).result_steps(walks)
    plan = plan_decode(q, k, v, art=quick)
    with pytest.raises(ValueError, match=r"\[B, Hkv\]=\[4, 2\]"):
        plan.result_steps(walks[:3])
    with pytest.raises(TypeError, match="integer"):
        plan.result_steps(walks.float())


def test_deferred_followers_walk_nothing_when_the_leader_stops_and_finish_a_walk_that_does_not():
    """The interpreter runs every leader before any follower, so a follower finds its leader converged (it walks
    nothing: the result is the single walk's bit for bit) or released without stopping (it walks its range: the
    dense result of that partition)."""
    from kernels.walk_hint import longest_walk

    q, k, v = synthetic_inputs(4, 8, 2, 1536, 64, torch.float16, CPU, seed=3)   # 24 steps
    config = ARTConfig(tau=1e-3, phi=1e-4, patience=3)
    expected, _ = simulator_stop(q, k, v, None, config, "sink_recency")
    single = art_decode(q, k, v, art=config.kernel_params(), num_splits=1)
    # follow step 8 over 3 splits: the leader holds 8 + 16 // 3 = 13 steps, the followers 5 and 6 (the longer last)
    out, lse, steps, taken = art_decode(q, k, v, art=config.kernel_params(), num_splits=3, follow_step=8,
                                        return_lse=True, return_stats=True, return_result_steps=True)
    assert split_plan_module.leader_range(24, 3, 8) == 13
    stopped = expected <= 13
    assert torch.equal(taken.long(), torch.where(stopped, expected, 24))
    assert stopped.any() and (~stopped).any(), "the case must cover both outcomes"
    group = q.shape[1] // k.shape[1]
    heads = stopped.repeat_interleave(group, dim=1)
    assert torch.equal(steps[stopped], torch.stack([expected[stopped].to(torch.int32),
                                                    *[torch.zeros_like(expected[stopped], dtype=torch.int32)] * 2], -1))
    assert torch.equal(out[heads], single[heads])
    assert torch.equal(steps[~stopped], torch.tensor([13, 5, 6], dtype=torch.int32).expand_as(steps[~stopped]))
    assert_within_flash_oracle(out[~heads].view(-1, 1, q.shape[-1]), q[~heads].view(-1, 1, q.shape[-1]),
                               *(x.repeat_interleave(group, dim=1)[~heads].view(-1, 1, 1536, q.shape[-1])
                                 for x in (k, v)))
    assert int(longest_walk(steps, follow_step=8)) == max(int(expected[stopped].max()), 24)
    for page_size in (16, 64):                                  # the same walks on shuffled pages
        k_pages, v_pages, table = to_paged(k, v, page_size, seed=page_size)
        paged = art_decode(q, k_pages, v_pages, block_table=table, art=config.kernel_params(), num_splits=3,
                           follow_step=8, return_lse=True, return_stats=True)
        assert_paged_agrees(paged, (out, lse, steps), page_size, 64)
    # a follow step at or past the walk's end: the leader holds the whole walk and the followers none
    out, steps = art_decode(q, k, v, art=config.kernel_params(), num_splits=3, follow_step=24, return_stats=True)
    assert torch.equal(steps[..., 1:], torch.zeros_like(steps[..., 1:]))
    assert torch.equal(steps[..., 0].long(), expected) and torch.equal(out, single)


def test_on_demand_stage_count_counts_the_leaders_alone(monkeypatch):
    """An on-demand grid's followers are dispatched after every leader and only wait: the launch configuration is
    sized for the ``B * Hkv`` leaders (a grid of 64 x 128 blocks counted with them went to 2 stages and slowed every
    leader, V52), while a deferred grid of the same split count, whose programs all stay resident, counts them all."""
    counted = []
    original = art_decode_module._launch_config
    monkeypatch.setattr(art_decode_module, "_launch_config",
                        lambda device, block_size, head_dim, programs, *args, **kwargs: counted.append(programs)
                        or original(device, block_size, head_dim, programs, *args, **kwargs))
    q, k, v = synthetic_inputs(4, 8, 2, 1536, 64, torch.float16, CPU, seed=3)   # 8 pairs
    params = ARTConfig(tau=1e-3, phi=1e-4, patience=3).kernel_params()
    art_decode(q, k, v, art=params, num_splits=3, follow_step=8, release_walks=3)
    art_decode(q, k, v, art=params, num_splits=3, follow_step=8)
    assert counted == [8, 24]


def test_on_demand_followers_wait_until_few_leaders_walk_alone(record_decode_launches):
    """The interpreter runs the leaders one after another, in pair order, before any follower: leader ``i`` finds
    ``i`` pairs done with their walk alone, so with ``release_walks = r`` exactly the pairs from ``B * Hkv - r`` on
    release their followers at the follow step (when they pass it), and the others are the single walk.  Released
    everywhere, the call is the deferred followers' of that follow step bit for bit; released nowhere, the single
    walk's.  Every counter is back at zero after each call."""
    q, k, v = synthetic_inputs(4, 8, 2, 1536, 64, torch.float16, CPU, seed=3)   # 24 steps, 8 pairs
    params = ARTConfig(tau=1e-3, phi=1e-4, patience=3).kernel_params()
    single = art_decode(q, k, v, art=params, num_splits=1, return_lse=True, return_stats=True)
    deferred = art_decode(q, k, v, art=params, num_splits=3, follow_step=8, return_lse=True, return_stats=True)
    launches = record_decode_launches(forward=True)
    everywhere = art_decode(q, k, v, art=params, num_splits=3, follow_step=8, release_walks=8, return_lse=True,
                            return_stats=True)
    call = launches.calls[0]
    assert call.grid == (8, 3) and call.kwargs["ON_DEMAND"] and not call.kwargs["DEFERRED"]
    assert call.args[launches.kernel.arg_names.index("pair_limit")] == 8
    assert all(torch.equal(a, b) for a, b in zip(everywhere, deferred))
    k_pages, v_pages, table = to_paged(k, v, 64, seed=1)                  # the same walks on shuffled pages
    assert_paged_agrees(art_decode(q, k_pages, v_pages, block_table=table, art=params, num_splits=3, follow_step=8,
                                   release_walks=8, return_lse=True, return_stats=True), everywhere, 64, 64)
    walks = single[2][..., 0]
    for release_walks in (0, 3):
        out, lse, steps, taken = art_decode(q, k, v, art=params, num_splits=3, follow_step=8,
                                            release_walks=release_walks, return_lse=True, return_stats=True,
                                            return_result_steps=True)
        released = (torch.arange(8).view(4, 2) >= 8 - release_walks) & (walks > 8)
        # a pair walked alone took its single walk; a released one, its leader's stop within its share, or all 24
        leader_stopped = steps[..., 0] < torch.where(released, 13, 24)
        assert torch.equal(taken, torch.where(released & ~leader_stopped, 24, steps[..., 0]))
        assert torch.equal(taken[~released], walks[~released])
        # the last three pairs pass the follow step; one of them walks past its leader's share, so its followers walk
        assert released.sum() == (3 if release_walks else 0) and bool(steps[..., 1:].any()) == bool(release_walks)
        heads = released.repeat_interleave(4, dim=1)
        assert torch.equal(out[heads], deferred[0][heads]) and torch.equal(lse[heads], deferred[1][heads])
        assert torch.equal(steps[released], deferred[2][released])
        assert torch.equal(out[~heads], single[0][~heads]) and torch.equal(lse[~heads], single[1][~heads])
        assert torch.equal(steps[~released], torch.stack([walks[~released], *[torch.zeros_like(walks[~released])] * 2],
                                                         -1))
        assert not art_decode_module._arrival_counters(CPU, 8).any()
        assert art_decode_module._release_words(CPU, 8)[-1] == 0, "the count of finished pairs must be back at zero"
    # a release step: every leader that passes it without stopping releases there, whatever the count (here none
    # would by the count: with release_walks=0 only the last leader sees no other walking alone, and it is done)
    at_step = art_decode(q, k, v, art=params, num_splits=3, follow_step=8, release_walks=0, release_step=8,
                         return_lse=True, return_stats=True)
    assert launches.calls[-1].args[launches.kernel.arg_names.index("release_step")] == 8
    assert all(torch.equal(a, b) for a, b in zip(at_step, deferred))
    past_walks = art_decode(q, k, v, art=params, num_splits=3, follow_step=8, release_walks=0, release_step=40,
                            return_lse=True, return_stats=True)
    assert launches.calls[-1].args[launches.kernel.arg_names.index("release_step")] == 24   # capped at the walk
    assert all(torch.equal(a[..., 0] if a.dim() == 3 else a, b[..., 0] if b.dim() == 3 else b)
               for a, b in zip(past_walks, single)) and not past_walks[2][..., 1:].any()
    # without num_splits, on_demand_plan's split count, follow step and release step (24 blocks: 4 splits;
    # released from step 8)
    art_decode(q, k, v, art=params, release_walks=3)
    call = launches.calls[-1]
    assert call.grid == (8, 4) and call.kwargs["ON_DEMAND"]
    assert call.args[launches.kernel.arg_names.index("follow_step")] == 8
    assert call.args[launches.kernel.arg_names.index("release_step")] == min(
        split_plan_module.on_demand_plan(24, CPU, params)["release_step"], 24)
    from kernels.pair_walks import PairWalks
    for bad, message in (({"release_walks": -1}, "release_walks"),
                         ({"release_walks": 4, "pair_walks": PairWalks.from_walks(walks)}, "no pair_walks"),
                         ({"release_walks": 4, "release_step": -1}, "release_step"),
                         ({"release_step": 8}, "on-demand followers")):
        with pytest.raises(ValueError, match=message):
            art_decode(q, k, v, art=params, **bad)
    with pytest.raises(ValueError, match="needs art"):
        art_decode(q, k, v, release_walks=4)


def test_per_pair_splits_give_each_pair_the_result_of_its_own_plan(monkeypatch, record_decode_launches):
    """The pairs expected to walk past the threshold run the leader scheme over every split, the others the single
    walk: each pair's output, lse and steps equal those of a uniform call with its plan, bit for bit."""
    from kernels.pair_walks import PairWalks

    q, k, v = synthetic_inputs(3, 8, 2, 1536, 64, torch.float16, CPU, seed=3)   # 24 steps, 6 pairs
    params = ARTConfig(tau=1e-3, phi=1e-4, patience=3).kernel_params()
    single = art_decode(q, k, v, art=params, num_splits=1, return_lse=True, return_stats=True)
    leader = art_decode(q, k, v, art=params, num_splits=3, return_lse=True, return_stats=True,
                        return_result_steps=True)
    walks = single[2][..., 0]
    threshold = int(walks.flatten().sort().values[2])
    split = walks > threshold
    assert split.any() and (~split).any() and (single[2][split] < 24).any(), "the case must cover both plans"
    monkeypatch.setattr(split_plan_module, "choose_pair_plan", lambda *args: (3, threshold))
    launches = record_decode_launches(forward=True)
    out, lse, steps, taken = art_decode(q, k, v, art=params, pair_walks=PairWalks.from_walks(walks),
                                        return_lse=True, return_stats=True, return_result_steps=True)
    assert torch.equal(taken[split], leader[3][split]) and torch.equal(taken[~split], walks[~split])
    call = launches.calls[0]
    assert call.grid == (6, 3) and call.kwargs["PAIR_GATES"] and not call.kwargs["DEFERRED"]
    assert call.args[launches.kernel.arg_names.index("pair_limit")] == threshold
    heads = split.repeat_interleave(4, dim=1)
    assert torch.equal(out[heads], leader[0][heads]) and torch.equal(lse[heads], leader[1][heads])
    assert torch.equal(steps[split], leader[2][split])
    assert torch.equal(out[~heads], single[0][~heads]) and torch.equal(lse[~heads], single[1][~heads])
    assert torch.equal(steps[~split], torch.stack([walks[~split], *[torch.zeros_like(walks[~split])] * 2], -1))
    assert not art_decode_module._arrival_counters(CPU, 6).any(), "every arrival counter must be back at zero"
    # a walk longer than expected still stops where the simulator does: no pair is cut short by its plan
    expected, _ = simulator_stop(q, k, v, None, ARTConfig(tau=1e-3, phi=1e-4, patience=3), "sink_recency")
    assert torch.equal(steps[~split][:, 0].long(), expected[~split])


def test_a_call_told_each_walk_launches_the_longest_first_with_the_same_results(record_decode_launches):
    """Told each pair's walk, the programs take the pairs longest walk first (``LONGEST_FIRST``: slot ``i`` serves
    pair ``launch_order[i]``); every pair's output, lse and steps are those of the call told only the longest walk,
    which launches the pairs in order, bit for bit."""
    from kernels.pair_walks import PairWalks

    q, k, v = synthetic_inputs(3, 8, 2, 1536, 64, torch.float16, CPU, seed=5)   # 24 steps, 6 pairs
    params = ARTConfig(tau=1e-3, phi=1e-4, patience=3).kernel_params()
    in_order = art_decode(q, k, v, art=params, num_splits=1, return_lse=True, return_stats=True)
    walks = in_order[2][..., 0]
    told = PairWalks.from_walks(walks)
    order = told.launch_order.tolist()
    assert order != sorted(order), "the case must launch the pairs out of their order"
    assert walks.flatten()[order].tolist() == sorted(walks.flatten().tolist(), reverse=True)
    launches = record_decode_launches(forward=True)
    longest_first = art_decode(q, k, v, art=params, pair_walks=told, return_lse=True, return_stats=True,
                               return_result_steps=True)
    baseline = art_decode(q, k, v, art=params, longest_stop_steps=int(walks.max()), return_lse=True,
                          return_stats=True)
    assert [call.kwargs["LONGEST_FIRST"] for call in launches.calls] == [True, False]
    assert [call.grid for call in launches.calls] == [(1, 6), (1, 6)], "both calls must be the single walk"
    for got, expected, single in zip(longest_first, baseline, in_order):
        assert torch.equal(got, expected) and torch.equal(got, single)
    assert torch.equal(longest_first[3], walks), "each pair's result steps, written at its own index"


def test_walks_launched_longest_first_keep_three_stages_only_where_the_model_gains():
    from kernels.split_plan import longest_first_three_stages

    def walks(histogram: dict, copies: int) -> list[int]:
        return sorted(w for w, n in histogram.items() for _ in range(n * copies))

    # the synthetic cache's walks at B = 32 (the replay of an H200 run): spread at 8k, even at 32k
    at_8k = {28: 16, 30: 16, 31: 16, 32: 16, 33: 16, 37: 32, 39: 16, 41: 32, 44: 32, 45: 16, 52: 16, 57: 16, 65: 16}
    at_32k = {31: 48, 32: 48, 33: 16, 34: 32, 35: 16, 36: 16, 39: 48, 42: 16, 44: 16}
    # B = 64 x 8k on 132 multiprocessors: the 65-block walks start first, the 28-block ones fill the freed slots
    assert longest_first_three_stages(walks(at_8k, 2), 128, 132)
    # B = 128 x 8k: modelled at 0.98 of two stages, B = 64 x 32k at 1.03: two stages
    assert not longest_first_three_stages(walks(at_8k, 4), 128, 132)
    assert not longest_first_three_stages(walks(at_32k, 2), 128, 132)
    assert not longest_first_three_stages([40] * 512, 128, 132), "equal walks gain nothing from fewer slots"


def test_the_stage_rule_runs_only_for_single_walks_told_each_walk(fake_sms, monkeypatch):
    """The launch configuration asks the model only for contiguous single walks told each walk whose 64 x 128 grid
    exceeds a wave at 3 stages, once per walks object, and takes 3 stages where it says so; the launcher hands it the
    walks only for single-split calls told each walk, and says per-pair splits only for calls that take them."""
    from kernels.pair_walks import PairWalks

    told = PairWalks.from_walks(torch.tensor([[3, 8], [5, 2]]))
    handed = []
    original = art_decode_module._launch_config
    monkeypatch.setattr(art_decode_module, "_launch_config",
                        lambda *args, **kwargs: handed.append((kwargs["single_walks"], kwargs["pair_splits"]))
                        or original(*args, **kwargs))
    q, k, v = synthetic_inputs(2, 8, 2, 512, 128, torch.float16, CPU, seed=1)   # 4 pairs on 1 "multiprocessor"
    params = ARTConfig(tau=1e-3, phi=1e-4, patience=3).kernel_params()
    art_decode(q, k, v, art=params, pair_walks=told)
    art_decode(q, k, v, art=params, longest_stop_steps=8)                  # told the longest only
    art_decode(q, k, v, art=params, num_splits=2)                          # several splits
    monkeypatch.setattr(art_decode_module, "choose_pair_splits", lambda *args: (2, 4))
    art_decode(q, k, v, art=params, pair_walks=told)                       # per-pair splits: 2 pairs above 4
    assert handed == [(told, False), (None, False), (None, False), (None, True)]

    monkeypatch.setattr(art_decode_module, "_launch_config", original)
    asked = []
    answer = {"three": True}
    monkeypatch.setattr(art_decode_module, "longest_first_three_stages",
                        lambda walks, head_dim, sms: asked.append((walks, head_dim, sms)) or answer["three"])
    fake_sms(132)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    config, cuda = art_decode_module._launch_config, torch.device("cuda")
    assert config(cuda, 64, 128, 512, "host_descriptors", single_walks=told) == (2, 3)
    assert config(cuda, 64, 128, 512, "host_descriptors", single_walks=told) == (2, 3)
    assert config(cuda, 64, 128, 512, "host_descriptors") == (2, 2)                    # not told: one wave at 2
    assert config(cuda, 64, 128, 396, "host_descriptors", single_walks=told) == (2, 3)  # one wave at 3 anyway
    assert config(cuda, 64, 128, 512, "page_descriptors", paged=True, single_walks=told) == (2, 4)
    assert config(cuda, 64, 64, 512, "pointers", single_walks=told) == (2, 3)           # D = 64: 3 stages anyway
    assert asked == [((2, 3, 5, 8), 128, 132)], "one model evaluation per walks object, and only where it decides"
    answer["three"] = False
    even = PairWalks.from_walks(torch.ones(2, 2, dtype=torch.int64))
    assert config(cuda, 64, 128, 512, "host_descriptors", single_walks=even) == (2, 2)


def test_pair_plan_splits_only_the_walks_that_would_outlast_the_rest(fake_sms):
    from kernels.split_plan import DENSE_BLOCKS_PER_LONE_STEP, MAX_SPLITS, choose_pair_plan

    fake_sms(132)
    # 380 walks of 10 blocks and 4 of 400 in 2048: split the 4 into ranges of 16 blocks (128 splits, cost
    # 16 + (3800 + 4 * 2048) / 251 = 64 lone steps against 400 + 5400 / 251 = 422 for one split)
    assert choose_pair_plan([10] * 380 + [400] * 4, 2048, 64, CPU) == (MAX_SPLITS, 10)
    # 4 walks of 2000 among 380 of 200: the ranges do not depend on the threshold
    assert choose_pair_plan([200] * 380 + [2000] * 4, 2048, 64, CPU) == (MAX_SPLITS, 200)
    # walks of at most 16 blocks: one range, nothing to split
    assert choose_pair_plan([1] * 383 + [16], 16, 64, CPU) == (1, 16)
    assert choose_pair_plan([1] * 383 + [17], 17, 64, CPU) == (2, 1)
    assert DENSE_BLOCKS_PER_LONE_STEP[64] * 132 == pytest.approx(250.8)
    # even walks: nothing to split
    assert choose_pair_plan([30] * 384, 512, 128, CPU) == (1, 30)
    # many walks of 60 in 2048 blocks: splitting them would load far more than their latency saves
    assert choose_pair_plan([10] * 200 + [60] * 184, 2048, 128, CPU) == (1, 60)
    # but walks that nearly reach the end lose little by running every split: 184 of 120 in 128 blocks
    assert choose_pair_plan([10] * 200 + [120] * 184, 128, 128, CPU) == (8, 10)
    # walks that all end about together: the single walks cost least (a split count of 1 is not costed at the
    # whole walk's range)
    assert choose_pair_plan([30] * 300 + [42] * 84, 512, 128, CPU) == (1, 42)
    # the synthetic cache at B = 32 x 8k: splitting the 16 walks of 65 blocks in 3 is costed at 0.99 of the single
    # walks, within the model's error (it took 1.08 on the H200): no split
    synthetic = {30: 32, 31: 32, 33: 16, 37: 32, 39: 16, 41: 32, 44: 32, 45: 16, 52: 16, 57: 16, 65: 16}
    assert choose_pair_plan(sorted(w for w, n in synthetic.items() for _ in range(n)), 128, 128, CPU) == (1, 65)
    # a few 1-block walks cap the split count at MAX_SPLITS, and expected walks past the length count as the length
    splits, threshold = choose_pair_plan([1] * 383 + [9999], 2 ** 14, 64, CPU)
    assert (splits, threshold) == (MAX_SPLITS, 1)


def test_pair_walks_reject_bad_input():
    from kernels.pair_walks import PairWalks

    q, k, v = synthetic_inputs(2, 4, 2, 256, 64, torch.float16, CPU)
    params = ARTConfig().kernel_params()
    walks = PairWalks.from_walks(torch.tensor([[3, 4], [1, 4]]))
    assert walks.sorted_walks == (1, 3, 4, 4) and walks.walks.dtype == torch.int32
    # the launch order: longest first, equal walks in pair order
    assert walks.launch_order.tolist() == [1, 3, 0, 2] and walks.launch_order.dtype == torch.int32
    for bad, message in ((torch.tensor([3, 4]), r"\[B, Hkv\] integer tensor"),
                         (torch.ones(2, 2), r"\[B, Hkv\] integer tensor"),
                         (torch.tensor([[0, 4], [1, 4]]), r"in \[1, 2\*\*31\) blocks, got \[0, 4\]")):
        with pytest.raises(ValueError, match=message):
            PairWalks.from_walks(bad)
    with pytest.raises(TypeError, match="pair_walks must be a kernels.pair_walks.PairWalks"):
        art_decode(q, k, v, art=params, pair_walks=torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="it needs art"):
        art_decode(q, k, v, pair_walks=walks)
    for extra in ({"num_splits": 2}, {"follow_step": 4}):
        with pytest.raises(ValueError, match="pass neither num_splits nor follow_step"):
            art_decode(q, k, v, art=params, pair_walks=walks, **extra)
    with pytest.raises(ValueError, match=r"one walk per \(b, kv_head\): \[2, 2\], got \[1, 2\]"):
        art_decode(q, k, v, art=params, pair_walks=PairWalks.from_walks(torch.tensor([[3, 4]])))


def test_splits_take_balanced_ranges_with_the_leader_among_the_shortest():
    from kernels.art_params import ARTParams

    # 23 and 7 steps over 5 splits: ranges of 4 and 1 steps, the 3 and 2 longer ones last; 3 steps: two empty first
    lengths = torch.tensor([23 * 64 - 5, 7 * 64, 3 * 64], dtype=torch.int32)
    q, k, v = synthetic_inputs(3, 4, 2, 23 * 64, 64, torch.float16, CPU, seed=23)
    expected = torch.tensor([[4, 4, 5, 5, 5], [1, 1, 1, 2, 2], [0, 0, 1, 1, 1]], dtype=torch.int32)
    never = ARTParams(tau=0.0, phi=0.0, patience=2)   # the monitor runs (the leader reaches the earliest stop)
    dense = art_decode(q, k, v, cache_seqlens=lengths, num_splits=5, block_size=64, return_lse=True,
                       return_stats=True)
    monitored = art_decode(q, k, v, cache_seqlens=lengths, art=never, num_splits=5, return_lse=True,
                           return_stats=True)
    for out, lse, steps in (dense, monitored):
        assert torch.equal(steps, expected[:, None, :].expand(-1, 2, -1))
        assert_within_flash_oracle(out, q, k, v, lengths)
    assert all(torch.equal(a, b) for a, b in zip(dense, monitored))
    assert split_plan_module.leader_can_stop(23, 5, never) and not split_plan_module.leader_can_stop(14, 5, never)


@pytest.mark.parametrize("splits", [2, 3])
def test_followers_run_the_monitor_but_never_stop_on_their_own_state(splits):
    from kernels.art_params import ARTParams

    # sequence 0: 24 steps; sequence 1: 48 steps, so that the monitor runs (its leader's range reaches the
    # earliest stop) while sequence 0's leader range ends before its first counted step
    q, k, v = synthetic_inputs(2, 6, 2, 3072, 64, torch.float16, CPU, seed=17)
    lengths = torch.tensor([1536, 3072])
    leader_steps = -(-24 // splits)
    # every step from min_steps on is stable at patience 1: sequence 0's leader never counts a step, while a
    # follower's first step would finish its own monitor at once if that could stop it
    loose = ARTParams(tau=1e9, phi=2.0, patience=1, min_steps=leader_steps)
    dense = art_decode(q, k, v, cache_seqlens=lengths, num_splits=splits, block_size=64, return_lse=True)
    out, lse, steps = art_decode(q, k, v, cache_seqlens=lengths, art=loose, num_splits=splits, return_lse=True,
                                 return_stats=True)
    assert torch.equal(out[0], dense[0][0]) and torch.equal(lse[0], dense[1][0])
    ranges = torch.tensor([min(leader_steps, 24 - s * leader_steps) for s in range(splits)], dtype=torch.int32)
    assert torch.equal(steps[0], ranges.expand_as(steps[0]))
    assert (steps[1, :, 0] == leader_steps + 1).all(), "sequence 1's leader stops at its first counted step"
    single_steps = art_decode(q[:1], k[:1, :, :1536], v[:1, :, :1536], art=loose, num_splits=1, return_stats=True)[1]
    assert (single_steps == leader_steps + 1).all(), "a single walk stops at the first counted step"


@pytest.mark.parametrize("blocks, follower_steps", [(78, 26), (120, art_decode_module.ART_CHUNK)])
def test_followers_poll_after_each_chunk_and_take_a_short_rest_in_one(blocks, follower_steps):
    """The interpreter runs every leader (split 0) before any follower, so a follower sees its leader's flag at its
    first poll: after ART_CHUNK steps of a 40-step range, and never within a 26-step range (shorter than two
    chunks: one chunk, no poll)."""
    from kernels.art_params import ARTParams

    q, k, v = synthetic_inputs(1, 4, 1, blocks * 64, 64, torch.float16, CPU, seed=19)
    stops_at_once = ARTParams(tau=1e9, phi=2.0, patience=1)               # the leader stops at its first counted step
    out, steps = art_decode(q, k, v, art=stops_at_once, num_splits=3, return_stats=True)
    assert steps[0, 0].tolist() == [2, follower_steps, follower_steps]
    assert torch.equal(out, art_decode(q, k, v, art=stops_at_once, num_splits=1))


@triton.jit
def _follower_chunks(word_ptr, walked_ptr, rest_ptr, out_ptr, ART_CHUNK: tl.constexpr):
    """``_follower_chunk`` of 16 cases (int32 ``[16]`` each)."""
    i = tl.arange(0, 16)
    tl.store(out_ptr + i, art_decode_kernel._follower_chunk(tl.load(word_ptr + i), tl.load(walked_ptr + i),
                                                            tl.load(rest_ptr + i), ART_CHUNK))


def test_released_deferred_followers_poll_where_their_leaders_chunks_end():
    """A released deferred follower's chunks (``_follower_chunk``) from the word it last read: to a step past the chunk
    end its leader published (counted from the follow step, against the follower's steps since its release), a
    short chunk once that point has passed, the rest of its range once the leader walks no further, and
    ``ART_CHUNK`` chunks without a hint or past the largest hint the word holds (a rest shorter than two in one);
    never past the rest.  The count and flag bits do not disturb it.  The interpreter runs every leader first, so
    its calls never see a hint of a leader still walking."""
    kernel = art_decode_kernel
    shift, walked_on = kernel.CHUNK_HINT_SHIFT.value, kernel.CHUNK_HINT_WALKED.value
    flags = kernel.RELEASED.value | 3                      # released, three programs arrived
    chunk = art_decode_module.ART_CHUNK
    cases = [  # (hint, walked, rest, chunk)
        (8, 0, 100, 9), (8, 5, 100, 4), (8, 8, 100, 1), (8, 9, 100, kernel.RELEASED_FIRST_CHUNK.value),
        (8, 0, 3, 3), (40, 0, 100, 41), (walked_on, 7, 93, 93), (walked_on - 1, 4100, 500, chunk),
        (0, 0, 100, chunk), (0, 9, 31, 31), (0, 0, 32, chunk),
        (1, 0, 100, 2), (1, 2, 100, 4), (2, 1, 100, 2), (walked_on - 1, 4000, 500, 95), (0, 0, 1, 1)]
    word = torch.tensor([(hint << shift) | flags for hint, *_ in cases], dtype=torch.int32)
    walked, rest, expected = (torch.tensor([case[i] for case in cases], dtype=torch.int32) for i in (1, 2, 3))
    out = torch.empty(16, dtype=torch.int32)
    _follower_chunks[(1,)](word, walked, rest, out, chunk)
    assert out.tolist() == expected.tolist()


@triton.jit
def _chunk_end_hints(step_ptr, end_ptr, horizon_ptr, released_at_ptr, out_ptr):
    """``_chunk_end_hint`` of 8 cases (int32 ``[8]`` each)."""
    i = tl.arange(0, 8)
    tl.store(out_ptr + i, art_decode_kernel._chunk_end_hint(tl.load(step_ptr + i), tl.load(end_ptr + i),
                                                            tl.load(horizon_ptr + i), tl.load(released_at_ptr + i)))


def test_released_leaders_publish_where_their_next_chunk_ends():
    """What a released leader (deferred or on demand) publishes at a chunk end (``_chunk_end_hint``): its next chunk's
    end within its range, counted from its release step; the largest hint the word holds for a chunk end further
    out; and ``CHUNK_HINT_WALKED`` once its range is walked (also at a release whose share of the rest is empty).
    Each hint, read back by a follower that has walked as far, polls a step past that chunk end."""
    kernel = art_decode_kernel
    walked_on = kernel.CHUNK_HINT_WALKED.value
    cases = [  # (step, end, leader horizon, release step, hint)
        (40, 100, 5, 34, 11), (40, 42, 5, 34, 8), (100, 100, 5, 34, walked_on), (5000, 9000, 10, 0, walked_on - 1),
        (60, 80, 3, 60, 3), (60, 60, 3, 60, walked_on), (34, 200, 1, 34, 1), (4000, 4200, 100, 0, 4094)]
    step, end, horizon, released_at, expected = (torch.tensor([case[i] for case in cases], dtype=torch.int32)
                                                 for i in range(5))
    out = torch.empty(8, dtype=torch.int32)
    _chunk_end_hints[(1,)](step, end, horizon, released_at, out)
    assert out.tolist() == expected.tolist()
    # a follower that has walked as far as its leader (step - release step) polls one step after the chunk end
    followed = torch.empty(16, dtype=torch.int32)
    word = (torch.cat([out, out]) << kernel.CHUNK_HINT_SHIFT.value) | kernel.RELEASED.value
    walked = torch.cat([step - released_at] * 2)
    _follower_chunks[(1,)](word, walked, torch.full((16,), 10_000, dtype=torch.int32), followed,
                           art_decode_module.ART_CHUNK)
    assert followed[:3].tolist() == [6, 3, 10_000]
    assert followed[4:7].tolist() == [4, 10_000, 2]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "pages16"])
def test_zero_thresholds_are_bit_identical_to_dense(splits, page_size):
    from kernels.art_params import ARTParams

    q, k, v = synthetic_inputs(2, 6, 2, 900, 64, torch.float16, CPU, seed=11)
    seqlens = torch.tensor([900, 517], dtype=torch.int32)
    table = None
    if page_size is not None:  # one tile per page: dense and ART read the same tiles
        k, v, table = to_paged(k, v, page_size)
    dense = art_decode(q, k, v, cache_seqlens=seqlens, block_table=table, num_splits=splits, block_size=64,
                       return_lse=True, return_stats=True)
    # patience 2: the leader's range (5 steps at 3 splits) reaches the earliest stop, so the monitor runs
    never = art_decode(q, k, v, cache_seqlens=seqlens, block_table=table, art=ARTParams(tau=0.0, phi=0.0, patience=2),
                       num_splits=splits, return_lse=True, return_stats=True)
    for a, b in zip(dense, never):
        assert torch.equal(a, b)


def test_zero_thresholds_of_the_direction_test_alone_are_bit_identical_to_dense():
    # one value vector for every token: the output never moves, so 1 - cos is 0 up to rounding, which must not
    # pass phi = 0 (without the scale test nothing else holds the walk back)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 64, generator=gen), torch.randn(1, 1, 1024, 64, generator=gen)
    v = torch.randn(1, 1, 1, 64, generator=gen).expand(1, 1, 1024, 64).contiguous()
    dense = art_decode(q, k, v, block_size=64, num_splits=1, return_lse=True, return_stats=True)
    config = ARTConfig(tau=0.0, phi=0.0, patience=1, use_scale=False)
    never = art_decode(q, k, v, block_size=64, num_splits=1, art=config.kernel_params(), return_lse=True,
                       return_stats=True)
    for a, b in zip(dense, never):
        assert torch.equal(a, b)
    expected, _ = simulator_stop(q, k, v, None, config, "sink_recency")
    assert expected.tolist() == [[16]]


def test_the_direction_test_guards_are_built_in_only_for_phi_outside_zero_to_one():
    from kernels.art_params import ARTParams

    builds = {phi: art_decode_module._direction_build(ARTParams(phi=phi)) for phi in (0.0, 1e-46, 1e-6, 1.0, 1.5)}
    assert builds == {0.0: 2, 1e-46: 2, 1e-6: 1, 1.0: 1, 1.5: 2}     # 1e-46 is 0 in fp32, as the kernel reads it
    assert art_decode_module._direction_build(ARTParams(use_direction=False)) == 0
    assert art_decode_module._direction_build(art_decode_module.ARTParams()) == art_decode_kernel.DIRECTION_ON.value


@pytest.mark.parametrize("phi, steps", [(0.5, 10), (1.5, 3)])
def test_a_zero_probe_has_direction_change_one_as_in_the_simulator(phi, steps):
    # V = 0: every probe is the zero vector, whose 1 - cos is 1 by definition: stable exactly where phi > 1
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 64, generator=gen).half(), torch.randn(1, 1, 640, 64, generator=gen).half()
    v = torch.zeros(1, 1, 640, 64, dtype=torch.float16)
    config = ARTConfig(tau=1e9, phi=phi, patience=2)
    expected, _ = simulator_stop(q, k, v, None, config, "sink_recency")
    _, got = art_decode(q, k, v, art=config.kernel_params(), num_splits=1, return_stats=True)
    assert got[..., 0].tolist() == expected.tolist() == [[steps]]


def test_values_whose_accumulator_squares_overflow_saturate_the_monitor_into_the_dense_walk():
    # the output probe's norm is sum acc^2 in fp32, scaled by 1 / l after the root (the module docstring): values
    # that overflow it make every step unstable, so the walk reads the whole cache; the simulator, which forms
    # acc / l first, still stops there (it saturates only at values about l times larger)
    q, k, v = synthetic_inputs(1, 4, 2, 1024, 64, torch.float32, CPU, seed=3)
    config = ARTConfig(tau=1e-3, phi=1e-4, patience=3)
    _, walks = art_decode(q, k, v, art=config.kernel_params(), num_splits=1, return_stats=True)
    big = v * 1e18
    expected, _ = simulator_stop(q, k, big, None, config, "sink_recency")
    out, steps = art_decode(q, k, big, art=config.kernel_params(), num_splits=1, return_stats=True)
    assert walks[..., 0].tolist() == expected.tolist() and min(expected.flatten().tolist()) < 16
    assert steps[..., 0].tolist() == [[16, 16]]
    dense = art_decode(q, k, big, num_splits=1, block_size=64)
    assert torch.isfinite(out).all() and torch.equal(out, dense)


@pytest.mark.parametrize("splits, never_stops", [(1, False), (3, False), (3, True)])
def test_a_nan_in_the_cache_gives_nan_outputs_for_its_group_only(splits, never_stops):
    from kernels.art_params import ARTParams

    q, k, v = synthetic_inputs(2, 4, 2, 300, 64, torch.float16, CPU, seed=3)
    art = ARTParams(tau=0.0, phi=0.0, patience=2) if never_stops else None
    clean, clean_lse = art_decode(q, k, v, num_splits=splits, block_size=64, art=art, return_lse=True)
    k[0, 1, 100, 5] = float("nan")
    out, lse = art_decode(q, k, v, num_splits=splits, block_size=64, art=art, return_lse=True)
    group = torch.zeros(2, 4, dtype=torch.bool)
    group[0, 2:] = True   # the query heads of KV head 1 of sequence 0
    assert out[group].isnan().all() and lse[group].isnan().all()
    assert torch.equal(out[~group], clean[~group]) and torch.equal(lse[~group], clean_lse[~group])


def test_outputs_fully_written_over_nan_poisoned_buffers(monkeypatch):
    def poisoned(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else -7
        return torch.full(shape, fill, dtype=dtype, device=device)

    q, k, v = synthetic_inputs(3, 4, 2, 600, 64, torch.float16, CPU, seed=5)
    seqlens = torch.tensor([600, 1, 130], dtype=torch.int32)
    config = ARTConfig(tau=1e-3, phi=1e-4, patience=2).kernel_params()
    clean = [art_decode(q, k, v, cache_seqlens=seqlens, art=art, num_splits=splits, return_lse=True,
                        return_stats=True, return_result_steps=True) for art in (None, config) for splits in (1, 4)]
    monkeypatch.setattr(art_decode_module, "_scratch", poisoned)
    dirty = [art_decode(q, k, v, cache_seqlens=seqlens, art=art, num_splits=splits, return_lse=True,
                        return_stats=True, return_result_steps=True) for art in (None, config) for splits in (1, 4)]
    for (out, lse, steps, taken), reference in zip(dirty, clean):
        assert torch.isfinite(out).all() and torch.isfinite(lse).all() and (steps >= 0).all() and (taken >= 1).all()
        for a, b in zip((out, lse, steps, taken), reference):
            assert torch.equal(a, b)
    # the dense walks' result steps are every block of each length (1, 10 and 3 of 64 tokens)
    assert all(reference[3].tolist() == [[10, 10], [1, 1], [3, 3]] for reference in clean[:2])


@pytest.mark.parametrize("art", [None, ARTConfig(tau=1e-3, phi=1e-4, patience=2)], ids=["dense", "art"])
def test_ragged_lengths_and_shuffled_pages(art):
    lengths = torch.tensor([1, 63, 65, 1027], dtype=torch.int32)
    q, k, v = synthetic_inputs(4, 4, 2, 1027, 64, torch.float16, CPU, seed=13)
    params = None if art is None else art.kernel_params()
    contiguous, lse, steps = art_decode(q, k, v, cache_seqlens=lengths, art=params, num_splits=2, block_size=64,
                                        return_lse=True, return_stats=True)
    if art is None:
        assert_within_flash_oracle(contiguous, q, k, v, lengths)
        assert torch.equal(steps.sum(-1), ((lengths.long() + 63) // 64)[:, None].expand(-1, 2).to(steps.dtype))
    else:
        expected, _ = simulator_stop(q, k, v, lengths, art, "sink_recency")
        _, single_steps = art_decode(q, k, v, cache_seqlens=lengths, art=params, num_splits=1, return_stats=True)
        assert torch.equal(single_steps[..., 0].long(), expected)
    # pages smaller than a block (gathered per token; from 16 tokens, one tile per page), a size that neither
    # divides nor is divided by the block, and pages holding whole blocks (one page-table entry per block), a
    # power of two and not
    # slots past a sequence's length hold NaN: a page read whole must not let them reach the output
    past = torch.arange(k.shape[2])[None, :] >= lengths[:, None].long()
    k_past, v_past = (x.masked_fill(past[:, None, :, None], float("nan")) for x in (k, v))
    for page_size in (1, 16, 32, 48, 64, 192):
        k_pages, v_pages, table = to_paged(k_past, v_past, page_size, seed=page_size)
        paged = art_decode(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, art=params,
                           num_splits=2, block_size=64, return_lse=True, return_stats=True)
        assert_paged_agrees(paged, (contiguous, lse, steps), page_size, 64)


@pytest.mark.parametrize("art", [None, ARTConfig(tau=1e-2, phi=1e-2, patience=2)], ids=["dense", "art"])
def test_pages_read_one_tile_each_agree_in_sequential_order(art):
    # blocks of whole pages of 16 / 32 tokens: the last block holds pages past the length (their table entries are
    # not read) and NaN past the length in its own page
    lengths = torch.tensor([1, 70, 700], dtype=torch.int32)
    q, k, v = synthetic_inputs(3, 4, 2, 700, 64, torch.float16, CPU, seed=21)
    params = None if art is None else art.kernel_params()
    kwargs = dict(cache_seqlens=lengths, art=params, order="sequential", num_splits=1, block_size=64, return_lse=True,
                  return_stats=True)
    contiguous = art_decode(q, k, v, **kwargs)
    if art is not None:  # the walk is monitored and stops inside the sequence: the order decides what it read
        assert torch.equal(contiguous[2][..., 0].long(), simulator_stop(q, k, v, lengths, art, "sequential")[0])
        assert (contiguous[2][2] < 11).all()
    past = torch.arange(k.shape[2])[None, :] >= lengths[:, None].long()
    k_past, v_past = (x.masked_fill(past[:, None, :, None], float("nan")) for x in (k, v))
    for page_size in (16, 32):
        k_pages, v_pages, table = to_paged(k_past, v_past, page_size, seed=page_size)
        assert art_decode_module._kv_loads(k_pages, v_pages, True, 64, uniform=False,
                                           leader_steps=None) == "subpage_descriptors"
        assert_paged_agrees(art_decode(q, k_pages, v_pages, block_table=table, **kwargs), contiguous, page_size, 64)


@pytest.mark.parametrize("order", ["sink_recency", "sequential"])
@pytest.mark.parametrize("art", [None, ARTConfig(tau=1e-3, phi=1e-4, patience=2)], ids=["dense", "art"])
def test_the_step_that_holds_the_length_zeroes_the_slots_past_it_in_every_range(order, art):
    # Page descriptors read a page's slots past the length; only the step of the block that holds the length zeroes
    # them, run apart from the walk's loops: the first step of a walk (one block), the second under sink_recency (in
    # the leader's first chunk), the last under sequential (the end of the last split's range), or none (a length
    # that ends a block)
    lengths = torch.tensor([1, 40, 640, 1000], dtype=torch.int32)
    q, k, v = synthetic_inputs(4, 4, 2, 1000, 64, torch.float16, CPU, seed=31)
    past = torch.arange(k.shape[2])[None, :] >= lengths[:, None].long()
    k_past, v_past = (x.masked_fill(past[:, None, :, None], float("nan")) for x in (k, v))
    params = None if art is None else art.kernel_params()
    for splits in (1, 3):
        kwargs = dict(cache_seqlens=lengths, art=params, order=order, num_splits=splits, block_size=64,
                      return_lse=True, return_stats=True)
        contiguous = art_decode(q, k, v, **kwargs)
        for page_size in (64, 32):
            k_pages, v_pages, table = to_paged(k_past, v_past, page_size, seed=page_size + splits)
            assert art_decode_module._kv_loads(k_pages, v_pages, True, 64, uniform=False, leader_steps=None) == (
                "page_descriptors" if page_size == 64 else "subpage_descriptors")
            paged = art_decode(q, k_pages, v_pages, block_table=table, **kwargs)
            assert torch.isfinite(paged[0]).all()
            assert_paged_agrees(paged, contiguous, page_size, 64)


def arrival_counters_all_zero():
    return all(bool((c == 0).all()) for c in art_decode_module._ARRIVAL_COUNTERS.values())


@pytest.mark.parametrize("art", [None, ARTConfig(tau=1e-3, phi=1e-4, patience=2)], ids=["dense", "art"])
@pytest.mark.parametrize("lengths, loads", [([1, 63, 65, 300], "kernel_descriptors"), ([300] * 4, "host_descriptors")],
                         ids=["ragged", "uniform"])
def test_descriptor_loads_equal_pointer_loads_and_never_read_past_the_length(monkeypatch, art, lengths, loads):
    q, k, v = synthetic_inputs(4, 8, 2, 400, 64, torch.float16, CPU, seed=9)
    k[:, :, 300:] = float("nan")  # past every length: zeros from the descriptor, masked pointer loads
    v[:, :, 300:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    params = None if art is None else art.kernel_params()
    assert art_decode_module._kv_loads(k, v, False, 64, uniform=len(set(lengths)) == 1, leader_steps=None) == loads
    results = []
    for kind in (loads, "pointers"):
        calls = []
        monkeypatch.setattr(art_decode_module, "_kv_loads",
                            lambda k_cache, v_cache, paged, block_size, uniform, leader_steps, kind=kind:
                            calls.append(kind) or kind)
        results.append(art_decode(q, k, v, cache_seqlens=seqlens, art=params, block_size=64, num_splits=3,
                                  return_lse=True, return_stats=True))
        assert calls == [kind]
    assert torch.isfinite(results[0][0]).all()
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block_size, paged", [(64, False), (128, False), (16, True)],
                         ids=["descriptors", "pointers", "paged"])
def test_uniform_lengths_take_the_scalar_length_and_agree_with_ragged_calls(block_size, paged):
    """Equal lengths (given, or the capacity when none are given) reach the kernel as one scalar: its
    rows must equal those of a ragged call in which they have the same length."""
    q, k, v = synthetic_inputs(3, 4, 2, 320, 64, torch.float16, CPU, seed=21)
    layout = {}
    if paged:
        k, v, layout["block_table"] = to_paged(k, v, 16, seed=3)  # 20 pages of 16: capacity 320
    for art in (None, ARTConfig(tau=1e-3, phi=1e-4, patience=2).kernel_params()):
        kwargs = dict(art=art, block_size=block_size, num_splits=2, return_lse=True, return_stats=True, **layout)
        for length, uniform_calls in ((300, [{"cache_seqlens": torch.full((3,), 300, dtype=torch.int32)}]),
                                      (320, [{"cache_seqlens": torch.full((3,), 320, dtype=torch.int32)}, {}])):
            reference = art_decode(q, k, v, cache_seqlens=torch.tensor([length, length, 7], dtype=torch.int32),
                                   **kwargs)
            for lengths in uniform_calls:
                for a, b in zip(art_decode(q, k, v, **lengths, **kwargs), reference):
                    assert torch.equal(a[:2], b[:2])


def test_descriptors_are_used_for_small_contiguous_blocks_only():
    q, k, v = synthetic_inputs(1, 4, 2, 256, 64, torch.float16, CPU)
    loads = art_decode_module._kv_loads
    for uniform, kind in ((False, "kernel_descriptors"), (True, "host_descriptors")):
        assert loads(k, v, paged=False, block_size=64, uniform=uniform, leader_steps=None) == kind
        assert loads(k, v, paged=False, block_size=128, uniform=uniform, leader_steps=None) == "pointers"
        assert loads(k, v, paged=True, block_size=64, uniform=uniform, leader_steps=None) == "pointers"
        # pages holding whole blocks: descriptors of the page pool, else pointer loads
        pages = torch.zeros(4, 64, 2, 64, dtype=torch.float16)
        assert loads(pages, pages, paged=True, block_size=64, uniform=uniform, leader_steps=None) == "page_descriptors"
        assert loads(pages, pages, paged=True, block_size=32, uniform=uniform, leader_steps=None) == "page_descriptors"
        assert loads(pages, pages, paged=True, block_size=128, uniform=uniform, leader_steps=None) == "pointers"
        # blocks of whole pages of at least 16 tokens: one descriptor copy per page
        for page_size, kind in ((16, "subpage_descriptors"), (32, "subpage_descriptors"), (8, "pointers"),
                                (48, "pointers")):
            small = torch.zeros(4, page_size, 2, 64, dtype=torch.float16)
            assert loads(small, small, paged=True, block_size=64, uniform=uniform, leader_steps=None) == kind
        misaligned = torch.empty(1, 2, 256, 68, dtype=torch.float16)[..., :64]  # row stride of 136 bytes
        assert loads(misaligned, v, paged=False, block_size=64, uniform=uniform, leader_steps=None) == "pointers"
        shared = k.expand(3, -1, -1, -1)   # one cache for three sequences: a batch stride of 0
        assert loads(shared, shared, paged=False, block_size=64, uniform=uniform, leader_steps=None) == "pointers"
        single = k.as_strided(k.shape, (0, *k.stride()[1:]))   # a stride of 0 along a dim of one entry is fine
        assert loads(single, single, paged=False, block_size=64, uniform=uniform,
                     leader_steps=None) == ("host_descriptors" if uniform else "kernel_descriptors")
    # the leader scheme builds descriptors in the kernel only for D = 128 and long enough splits
    assert loads(k, v, paged=False, block_size=64, uniform=False, leader_steps=1000) == "pointers"
    assert loads(k, v, paged=False, block_size=64, uniform=True, leader_steps=1000) == "host_descriptors"
    k128, v128 = torch.zeros(2, 1, 2, 256, 128, dtype=torch.float16)
    minimum = art_decode_module.LEADER_TMA_MIN_STEPS
    assert loads(k128, v128, paged=False, block_size=64, uniform=False, leader_steps=minimum) == "kernel_descriptors"
    assert loads(k128, v128, paged=False, block_size=64, uniform=False, leader_steps=minimum - 1) == "pointers"
    assert loads(k128, v128, paged=False, block_size=64, uniform=True, leader_steps=minimum - 1) == "host_descriptors"


def assert_expanded_caches_agree(q, k, v, ragged):
    """A cache shared by the batch (batch stride 0) or one KV head's cache shared by every KV head (head stride 0)
    is read through pointer loads (no tensor descriptor takes a zero stride): dense, ART and split calls, uniform
    and ``ragged`` lengths, give what the contiguous copies give through descriptors: the same leader walks,
    floating results within a few units in the last place (the two builds compile apart: on an H100 a one-split
    call's ``lse`` differed by one float32 unit), and the dense output within the FlashAttention oracle."""
    art = ARTConfig(tau=1e-2, phi=1e-3, patience=2).kernel_params()    # stops within a few blocks
    calls = (dict(), dict(num_splits=1), dict(art=art, return_stats=True),
             dict(art=art, num_splits=4, follow_step=0, return_stats=True))
    for shared in ((k[:1].expand_as(k), v[:1].expand_as(v)), (k[:, :1].expand_as(k), v[:, :1].expand_as(v))):
        owned = [x.contiguous() for x in shared]
        for lengths in (None, ragged):
            for call in calls:
                got = art_decode(q, *shared, cache_seqlens=lengths, return_lse=True, **call)
                want = art_decode(q, *owned, cache_seqlens=lengths, return_lse=True, **call)
                for a, b in zip(got, want):
                    if a.is_floating_point():
                        torch.testing.assert_close(a, b, rtol=4 * torch.finfo(a.dtype).eps, atol=1e-6)
                    else:
                        # a follower's steps depend on when it sees its leader stop: the leaders' walks
                        assert torch.equal(a[..., 0], b[..., 0]), call
                if not call:
                    assert_within_flash_oracle(got[0], q, *owned, lengths)


def test_expanded_caches_give_the_results_of_the_same_caches_made_contiguous():
    q, k, v = synthetic_inputs(3, 4, 2, 320, 64, torch.float16, CPU, seed=5)
    assert_expanded_caches_agree(q, k, v, torch.tensor([320, 1, 130], dtype=torch.int32))


def test_dense_default_block_is_128_unless_64_dim_or_pages_split_such_blocks(record_decode_launches):
    recorded = record_decode_launches()
    q128, k128, v128 = synthetic_inputs(2, 4, 2, 512, 128, torch.float16, CPU)
    q, k, v = synthetic_inputs(2, 4, 2, 512, 64, torch.float16, CPU)
    calls = [dict(q=q128, k=k128, v=v128), dict(), dict(art=ARTConfig().kernel_params())]
    for page_size in (16, 64, 128, 256, 192):
        k_pages, v_pages, table = to_paged(k128, v128, page_size)
        calls.append(dict(q=q128, k=k_pages, v=v_pages, block_table=table))
    for page_size in (128, 256):
        k_pages, v_pages, table = to_paged(k, v, page_size)
        calls.append(dict(k=k_pages, v=v_pages, block_table=table))
    for call in calls:
        layout = dict(q=call.pop("q", q), k_cache=call.pop("k", k), v_cache=call.pop("v", v))
        art_decode(**layout, **call)
    blocks = [launch.kwargs["BLOCK_N"] for launch in recorded.calls]
    pages = [launch.kwargs["PAGE_SIZE"] for launch in recorded.calls]
    # D = 128 contiguous; D = 64 contiguous (the dense plan, V61), ART; D = 128 on pages of 16 / 64 / 192, which
    # split 128-token blocks; D = 64 on pages that hold them whole walks 64-token blocks all the same (V63)
    assert blocks == [128, 64, 64, 64, 64, 128, 128, 64, 64, 64]
    assert pages == [1, 1, 1, 16, 64, 128, 256, 192, 128, 256]


def test_last_arriver_combine_with_empty_splits_matches_oracle_and_leaves_counters_at_zero():
    # 8 splits of 64-token blocks, the longer ranges last: length 1 fills split 7 only, 130 splits 5-7, 700 ranges of
    # 1 and 2 blocks
    lengths = torch.tensor([1, 130, 700], dtype=torch.int32)
    q, k, v = synthetic_inputs(3, 6, 2, 700, 64, torch.float32, CPU, seed=17)
    out, lse, steps = art_decode(q, k, v, cache_seqlens=lengths, num_splits=8, block_size=64, return_lse=True,
                                 return_stats=True)
    assert steps[0, 0].tolist() == [0] * 7 + [1] and steps[1, 0].tolist() == [0] * 5 + [1] * 3
    assert steps[2, 0].tolist() == [1] * 5 + [2] * 3
    assert_within_flash_oracle(out, q, k, v, lengths)
    single, single_lse = art_decode(q, k, v, cache_seqlens=lengths, num_splits=1, block_size=64, return_lse=True)
    torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, single_lse, rtol=1e-5, atol=1e-5)
    assert arrival_counters_all_zero()
    again = art_decode(q, k, v, cache_seqlens=lengths, num_splits=8, block_size=64, return_lse=True,
                       return_stats=True)
    for a, b in zip(again, (out, lse, steps)):
        assert torch.equal(a, b)
    assert arrival_counters_all_zero()


def test_converged_flag_is_cleared_for_the_next_call():
    from kernels.art_params import ARTParams

    q, k, v = synthetic_inputs(4, 8, 2, 1536, 64, torch.float16, CPU, seed=3)   # the leader stops for some pairs
    config = ARTConfig(tau=1e-3, phi=1e-4, patience=3).kernel_params()
    _, steps = art_decode(q, k, v, art=config, num_splits=2, return_stats=True)
    assert (steps[..., 0] < 12).any()
    assert arrival_counters_all_zero()
    dense = art_decode(q, k, v, num_splits=2, block_size=64, return_lse=True, return_stats=True)
    # the same monitored walk (patience 3: the leader's 12 steps reach the earliest stop), which never stops
    never = art_decode(q, k, v, art=ARTParams(tau=0.0, phi=0.0, patience=3), num_splits=2, return_lse=True,
                       return_stats=True)
    for a, b in zip(dense, never):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- GPU, real sizes, bf16

def _cuda():
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seqlen, q_heads, kv_heads, dim", [
    (1, 32768, 32, 8, 128), (16, 8192, 32, 8, 128), (3, 5000, 40, 8, 128), (4, 8192, 9, 3, 64), (2, 4096, 8, 8, 64),
])
def test_gpu_dense_output_within_flash_oracle(batch, seqlen, q_heads, kv_heads, dim):
    q, k, v = synthetic_inputs(batch, q_heads, kv_heads, seqlen, dim, torch.bfloat16, _cuda(), seed=seqlen)
    for splits in (None, 1):
        assert_within_flash_oracle(art_decode(q, k, v, num_splits=splits), q, k, v)


@pytest.mark.gpu
def test_gpu_stop_steps_match_simulator():
    cases = []
    # groups of 4 and 5 (the monitor reads half the 16-row tile) and 12 (every row of it)
    for seed, (preset, q_heads, kv_heads) in enumerate((("realistic", 32, 8), ("peaked", 40, 8), ("diffuse", 32, 8),
                                                        ("realistic", 48, 4))):
        q, k, v = synthetic_inputs(8, q_heads, kv_heads, 4096, 128, torch.bfloat16, _cuda(), seed=seed, preset=preset)
        cases.append((q, k, v, None))
    assert_stop_agreement(*compare_stop_steps(cases, ART_CONFIGS + (ARTConfig(),)), "GPU bf16 synthetic")
    q, k, v, seqlens = captured_inputs(_cuda(), torch.bfloat16)
    assert_stop_agreement(*compare_stop_steps([(q, k, v, seqlens)], ART_CONFIGS + (ARTConfig(),)),
                          "GPU bf16 captured layer")


@pytest.mark.gpu
def test_gpu_zero_thresholds_bit_identical_and_fully_written(monkeypatch):
    from kernels.art_params import ARTParams

    q, k, v = synthetic_inputs(4, 32, 8, 16384, 128, torch.bfloat16, _cuda(), seed=1)
    seqlens = torch.tensor([16384, 1, 9000, 4097], dtype=torch.int32, device="cuda")
    monkeypatch.setattr(art_decode_module, "_scratch", lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device))
    for splits in (1, 7, 32):
        dense = art_decode(q, k, v, cache_seqlens=seqlens, num_splits=splits, block_size=64, return_lse=True,
                           return_stats=True)
        # patience 2: every leader range (8 steps at 32 splits) reaches the earliest stop, so the monitor runs
        never = art_decode(q, k, v, cache_seqlens=seqlens, art=ARTParams(tau=0.0, phi=0.0, patience=2),
                           num_splits=splits, return_lse=True, return_stats=True)
        assert torch.isfinite(dense[0]).all() and torch.isfinite(dense[1]).all()
        for a, b in zip(dense, never):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_ragged_paged_layouts_agree():
    lengths = torch.tensor([1, 63, 65, 1027, 20000], dtype=torch.int32, device="cuda")
    q, k, v = synthetic_inputs(5, 32, 8, 20000, 128, torch.bfloat16, _cuda(), seed=2)
    # the dense default block depends on the page size (dense_block_size): compare at the same block
    contiguous = {block: art_decode(q, k, v, cache_seqlens=lengths, block_size=block, return_lse=True)
                  for block in (64, 128)}
    assert_within_flash_oracle(contiguous[128][0], q, k, v, lengths)
    art = ARTConfig().kernel_params()
    monitored = art_decode(q, k, v, cache_seqlens=lengths, art=art, num_splits=1, return_lse=True, return_stats=True)
    # slots past a sequence's length hold NaN: pages read whole (descriptors) must keep them out of the output
    past = torch.arange(k.shape[2], device=k.device)[None, :] >= lengths[:, None].long()
    k_past, v_past = (x.masked_fill(past[:, None, :, None], float("nan")) for x in (k, v))
    for page_size in (1, 16, 32, 48, 64, 128, 256):
        k_pages, v_pages, table = to_paged(k_past, v_past, page_size, seed=page_size)
        block = split_plan_module.dense_block_size(page_size)
        paged = art_decode(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, return_lse=True)
        assert_paged_agrees(paged, contiguous[block], page_size, block)
        paged = art_decode(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, art=art, num_splits=1,
                           return_lse=True, return_stats=True)
        assert_paged_agrees(paged, monitored, page_size, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dim, q_heads, kv_heads", [(128, 32, 8), (64, 9, 3)])
def test_gpu_expanded_caches_give_the_results_of_the_same_caches_made_contiguous(dim, q_heads, kv_heads):
    q, k, v = synthetic_inputs(4, q_heads, kv_heads, 8192, dim, torch.bfloat16, _cuda(), seed=dim)
    assert_expanded_caches_agree(q, k, v, torch.tensor([8192, 1, 4097, 5000], dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
def test_gpu_64_dim_pages_that_hold_128_token_blocks_walk_64_token_blocks():
    """At D = 64 the dense default walks 64-token blocks on pages of 128 and 256 tokens too (V63): bit for bit the
    contiguous layout's walk of such blocks, ragged lengths and a shuffled page table included."""
    lengths = torch.tensor([1, 63, 65, 1027, 20000], dtype=torch.int32, device="cuda")
    q, k, v = synthetic_inputs(5, 9, 3, 20000, 64, torch.bfloat16, _cuda(), seed=4)
    contiguous = art_decode(q, k, v, cache_seqlens=lengths, block_size=64, return_lse=True)
    assert_within_flash_oracle(contiguous[0], q, k, v, lengths)
    for page_size in (128, 256):
        k_pages, v_pages, table = to_paged(k, v, page_size, seed=page_size)
        paged = art_decode(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, return_lse=True)
        assert_paged_agrees(paged, contiguous, page_size, 64)


@pytest.mark.parametrize("paged", [False, True])
def test_unread_lengths_give_the_read_calls_result_without_reading_them(paged, monkeypatch):
    # read_lengths=False: the lengths and pages stay on the device (what a sync would read is never asked for) and
    # the call, sized for the capacity, equals the one that read them where the longest length is the capacity
    q, k, v = synthetic_inputs(3, 8, 2, 256, 64, torch.float16, torch.device("cpu"), seed=5)
    table = None
    if paged:
        k, v, table = to_paged(k, v, 16, seed=5)
    lengths = torch.tensor([256, 1, 130], dtype=torch.int32)
    for art, splits in ((None, 2), (ARTConfig(tau=1e-3, phi=1e-4, patience=2).kernel_params(), 1)):
        read = art_decode(q, k, v, cache_seqlens=lengths, block_table=table, art=art, num_splits=splits,
                          return_lse=True, return_stats=True)
        with monkeypatch.context() as patched:
            def no_read(*args, **kwargs):
                raise AssertionError("the lengths or pages were read back")

            patched.setattr(torch, "aminmax", no_read)
            patched.setattr(art_decode_module, "_check_block_table", no_read)
            unread = art_decode(q, k, v, cache_seqlens=lengths, block_table=table, art=art, num_splits=splits,
                                return_lse=True, return_stats=True, read_lengths=False)
        for a, b in zip(read, unread):
            assert torch.equal(a, b), (paged, art)
    with pytest.raises(TypeError, match="read_lengths must be True or False, got 0"):
        art_decode(q, k, v, cache_seqlens=lengths, block_table=table, read_lengths=0)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_cuda_graph_replays_read_the_lengths_changed_in_place(paged):
    # a decode loop captures one call and changes cache_seqlens between replays: each replay must equal an
    # eager call on the lengths of that moment (the capture cannot read them, so it checks none)
    q, k, v = synthetic_inputs(4, 32, 8, 8192, 128, torch.bfloat16, _cuda(), seed=3)
    table = None
    if paged:
        k, v, table = to_paged(k, v, 16, seed=3)
    for art, splits, dtype in ((None, 4, torch.int32), (ARTConfig().kernel_params(), 1, torch.int64)):
        lengths = torch.tensor([8192, 1, 4097, 65], dtype=dtype, device="cuda")

        def call(read_lengths=True):
            return art_decode(q, k, v, cache_seqlens=lengths, block_table=table, art=art, num_splits=splits,
                              return_lse=True, return_stats=True, read_lengths=read_lengths)

        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        for new in ([1000, 8192, 1, 300], [64, 65, 8191, 2]):
            lengths.copy_(torch.tensor(new))
            graph.replay()
            for a, b, c in zip(captured, call(), call(read_lengths=False)):   # an eager call planned as captured
                assert torch.equal(a, b) and torch.equal(a, c), (art, splits, new)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seqlen, splits, follow_step",
                         [(8, 131072, 4, 0), (1, 32768, 16, 0), (2, 32768, 5, 0),
                          (8, 32768, 6, 34), (1, 131072, 49, 34), (2, 32768, 5, 20)])
def test_gpu_leader_scheme_output_is_the_leaders_alone_or_dense_in_every_call(batch, seqlen, splits, follow_step):
    # the leader scheme's result must not depend on timing: where the leader stopped, the single-split
    # output bit for bit (the followers' early exits dropped); elsewhere the dense output of that partition (the
    # never-stopping call's, which is the dense call's bit for bit without deferred followers).  The result steps
    # say which: the leader's steps, or the whole walk (a leader that stopped on the last step of its range walked
    # as far as one that did not stop).  Deferred followers of a leader that stopped by the follow step load
    # nothing.
    q, k, v = synthetic_inputs(batch, 32, 8, seqlen, 128, torch.bfloat16, _cuda(), seed=batch)
    leader_range = split_plan_module.leader_range(seqlen // 64, splits, follow_step)
    held_back_pairs = 0
    for config in (ARTConfig(), ARTConfig(tau=1e-3, phi=1e-5, patience=8)):
        params = config.kernel_params()
        single = art_decode(q, k, v, art=params, num_splits=1)
        never = dataclasses.replace(params, tau=0.0, phi=0.0)
        dense = art_decode(q, k, v, art=never, num_splits=splits, follow_step=follow_step)
        mismatched_calls = 0
        for _ in range(20):
            out, steps, taken = art_decode(q, k, v, art=params, num_splits=splits, follow_step=follow_step,
                                           return_stats=True, return_result_steps=True)
            walks = seqlen // 64
            assert bool(((taken == steps[..., 0]) | ((taken == walks) & (steps[..., 0] == leader_range))).all())
            whole = (taken == walks).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            right = torch.where(whole, (out == dense).all(-1), (out == single).all(-1))
            mismatched_calls += int(not bool(right.all()))
            if follow_step:
                held_back = steps[..., 0] <= follow_step
                held_back_pairs += int(held_back.sum())
                assert not steps[..., 1:][held_back].any(), \
                    "a follower of a leader that stopped by the follow step loaded"
        assert mismatched_calls == 0, f"{mismatched_calls} of 20 calls differ ({config})"
    assert held_back_pairs > 0 or not follow_step, "the case must have leaders that stop by the follow step"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [64, 128])
def test_gpu_walks_launched_longest_first_give_the_single_walks_results(monkeypatch, batch):
    # B = 64 / 128 x 8k: 512 / 1024 single walks, past a wave at 3 stages.  Told walks spread like the synthetic
    # cache's, the launcher takes 3 stages at B = 64 and 2 at B = 128 (longest_first_three_stages); either way the
    # programs take the pairs longest first, and every output, lse and step count is the single walk's, bit for bit.
    from kernels.pair_walks import PairWalks

    q, k, v = synthetic_inputs(batch, 32, 8, 8192, 128, torch.bfloat16, _cuda(), seed=7)
    params = ARTConfig().kernel_params()
    single = art_decode(q, k, v, art=params, num_splits=1, return_lse=True, return_stats=True)
    spread = {28: 16, 30: 16, 31: 16, 32: 16, 33: 16, 37: 32, 39: 16, 41: 32, 44: 32, 45: 16, 52: 16, 57: 16, 65: 16}
    expected = torch.tensor([w for w, n in spread.items() for _ in range(n * batch // 32)], device=q.device)
    expected = expected[torch.randperm(expected.numel(), generator=torch.Generator().manual_seed(0)).to(q.device)]
    told = PairWalks.from_walks(expected.view(batch, 8))
    stages = []
    original = art_decode_module._launch_config
    def recording_launch_config(*args, **kwargs):
        config = original(*args, **kwargs)
        stages.append(config[1])
        return config

    monkeypatch.setattr(art_decode_module, "_launch_config", recording_launch_config)
    for _ in range(3):
        got = art_decode(q, k, v, art=params, pair_walks=told, return_lse=True, return_stats=True)
        for value, reference in zip(got, single):
            assert torch.equal(value, reference)
    assert set(stages) == {3 if batch == 64 else 2}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, polls_per_step", [(64, None), (128, None), (64, 0)])
def test_gpu_on_demand_followers_give_each_pair_the_single_walk_or_the_whole_attention(monkeypatch, head_dim,
                                                                                        polls_per_step):
    # B = 128 x 8k, 4 splits: the leaders release their followers once at most 132 of them walk alone.  In every call
    # a pair whose followers walked nothing is the single walk bit for bit (output, lse, steps); a released pair is
    # the single walk where its leader stopped (its steps the single walk's), else the whole attention (within the
    # FlashAttention oracle), its programs covering every block.  With no polls every follower gives up at once
    # unless its leader has released it, and the same holds.  The counters are back at zero after every call.
    if polls_per_step is not None:
        monkeypatch.setattr(art_decode_module, "GATE_POLLS_PER_STEP", polls_per_step)
    q, k, v = synthetic_inputs(128, 32, 8, 8192, head_dim, torch.bfloat16, _cuda(), seed=11)
    params = ARTConfig().kernel_params()
    single = art_decode(q, k, v, art=params, num_splits=1, return_lse=True, return_stats=True)
    released_pairs = 0
    for _ in range(5):
        out, lse, steps, taken = art_decode(q, k, v, art=params, num_splits=4, release_walks=132, return_lse=True,
                                            return_stats=True, return_result_steps=True)
        alone = steps[..., 1:].sum(-1) == 0
        whole = ~alone & (steps[..., 0] != single[2][..., 0])
        assert torch.equal(taken, torch.where(whole, 128, single[2][..., 0])), "the output's steps, as recorded"
        assert torch.equal(steps[..., 0][alone], single[2][..., 0][alone])
        heads = (~whole).repeat_interleave(4, dim=1)
        assert torch.equal(out[heads], single[0][heads]) and torch.equal(lse[heads], single[1][heads])
        assert bool((steps[whole].sum(-1) == 128).all()), "a released walk that does not stop covers every block"
        b, h = whole.nonzero(as_tuple=True)
        if b.numel():
            assert_within_flash_oracle(out.view(128, 8, 4, head_dim)[b, h], q.view(128, 8, 4, head_dim)[b, h],
                                       k[b, h][:, None], v[b, h][:, None])
        released_pairs += int((~alone).sum())
        assert not art_decode_module._arrival_counters(q.device, 1024).any()
        assert int(art_decode_module._release_words(q.device, 1024)[-1]) == 0
    # (without polls the followers dispatched before their leader's release give up, so none may walk)
    assert released_pairs > 0 or polls_per_step == 0, "the case must release some pairs"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_on_demand_release_step_releases_every_leader_still_alone(head_dim):
    # B = 32 x 8k, 4 splits, R = 0: no leader releases by the count, so only the release step (40) does.  Never
    # stopping, every pair is released there and its programs cover every block, with the whole attention; with
    # stopping thresholds a pair that stopped first is the single walk bit for bit, and a released one the single
    # walk where its leader stopped in its range, else the whole attention.  Counters back at zero after each call.
    from kernels.art_params import ARTParams
    q, k, v = synthetic_inputs(32, 32, 8, 8192, head_dim, torch.bfloat16, _cuda(), seed=5)
    params = ARTConfig().kernel_params()
    never = ARTParams(tau=0.0, phi=0.0, patience=params.patience, min_steps=params.min_steps)
    dense = art_decode(q, k, v, art=None, return_lse=True)
    out, lse, steps = art_decode(q, k, v, art=never, num_splits=4, release_walks=0, release_step=40,
                                 return_lse=True, return_stats=True)
    assert bool((steps.sum(-1) == 128).all()) and bool((steps[..., 1:].sum(-1) > 0).all())
    assert bool((steps[..., 0] >= 40).all()), "a leader walks alone up to the release step"
    assert_within_flash_oracle(out, q, k, v)
    assert torch.allclose(lse, dense[1], atol=1e-4, rtol=0)
    single = art_decode(q, k, v, art=params, num_splits=1, return_lse=True, return_stats=True)
    out, lse, steps = art_decode(q, k, v, art=params, num_splits=4, release_walks=0, release_step=40,
                                 return_lse=True, return_stats=True)
    alone = steps[..., 1:].sum(-1) == 0
    whole = ~alone & (steps[..., 0] != single[2][..., 0])
    assert bool((single[2][..., 0][alone] <= 56).all()), "a leader alone past the release step must have released"
    assert torch.equal(steps[..., 0][alone], single[2][..., 0][alone])
    heads = (~whole).repeat_interleave(4, dim=1)
    assert torch.equal(out[heads], single[0][heads]) and torch.equal(lse[heads], single[1][heads])
    assert bool((steps[whole].sum(-1) == 128).all())
    assert int((~alone).sum()) > 0, "the case must release some pairs"
    assert not art_decode_module._arrival_counters(q.device, 256).any()
    assert int(art_decode_module._release_words(q.device, 256)[-1]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_per_pair_splits_give_each_pair_the_result_of_its_plan_in_every_call(head_dim):
    # B = 128 x 8k fills the GPU, so the plan is one split; told that 16 pairs walk the whole 128 blocks, the launcher
    # splits those (choose_pair_plan) and keeps the rest single.  Every call, each pair's output must be its plan's:
    # the single walk's bit for bit, or the leader scheme's over the split count (the single walk where the leader
    # stopped in its range, else the dense output of that partition).  D = 64 runs PAIR_SPLIT_STAGES.
    from kernels.pair_walks import PairWalks

    q, k, v = synthetic_inputs(128, 32, 8, 8192, head_dim, torch.bfloat16, _cuda(), seed=5)
    params = ARTConfig().kernel_params()
    single, single_steps = art_decode(q, k, v, art=params, num_splits=1, return_stats=True)
    expected = single_steps[..., 0].clone()
    expected.view(-1)[::64] = 128
    walks = PairWalks.from_walks(expected)
    plan = split_plan_module.choose_pair_splits(128, 8, 128, q.device, params, 64, head_dim, walks)
    assert plan is not None, "the case must take per-pair splits"
    splits, threshold = plan
    split = (expected > threshold).repeat_interleave(4, dim=1)
    dense = art_decode(q, k, v, art=dataclasses.replace(params, tau=0.0, phi=0.0), num_splits=splits)
    leader_range = split_plan_module.leader_range(128, splits)
    for _ in range(10):
        out, steps = art_decode(q, k, v, art=params, pair_walks=walks, return_stats=True)
        assert steps.shape[-1] == splits
        leader = steps[..., 0].repeat_interleave(4, dim=1)
        assert torch.equal(out[~split], single[~split])
        assert torch.equal(steps[..., 0][~split[:, ::4]], single_steps[..., 0][~split[:, ::4]])
        assert not steps[..., 1:][~split[:, ::4]].any(), "a follower of a single-walk pair loaded"
        right = torch.where(leader < leader_range, (out == single).all(-1),
                            (out == single).all(-1) | (out == dense).all(-1))
        assert bool(right[split].all())
