import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from art_analysis.blockwise import BlockwiseAttention, blockwise_attention
from art_analysis.orders import ORDERS, check_token_range, walks_reading


def reference_attention(q, k, v, seqlens, sm_scale=None, selection=None, block_size=None):
    """softmax(q K^T) V in float64, one sequence and head at a time: [B, Hq, D]."""
    batch, q_heads, dim = q.shape
    group = q_heads // k.shape[1]
    sm_scale = dim ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty(batch, q_heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // group
            keep = torch.arange(k.shape[2]) < seqlens[b]
            if selection is not None:
                keep &= selection[b, kv].repeat_interleave(block_size)[: k.shape[2]]
            kk, vv = k[b, kv, keep].double(), v[b, kv, keep].double()
            weights = torch.softmax(kk @ q[b, h].double() * sm_scale, dim=0)
            out[b, h] = weights @ vv
    return out


def random_case(seed, batch, kv_heads, group, seqlen, dim):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, dim, generator=gen)
    k = torch.randn(batch, kv_heads, seqlen, dim, generator=gen) * 1.5
    v = torch.randn(batch, kv_heads, seqlen, dim, generator=gen)
    seqlens = torch.randint(1, seqlen + 1, (batch,), generator=gen)
    return q, k, v, seqlens


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 3, 5]), seqlen=st.integers(1, 200), dim=st.sampled_from([4, 8, 16]),
       block_size=st.sampled_from([1, 7, 16, 64]), order=st.sampled_from(ORDERS[:3]))
def test_exact_mode_equals_float64_reference(seed, batch, kv_heads, group, seqlen, dim, block_size, order):
    q, k, v, seqlens = random_case(seed, batch, kv_heads, group, seqlen, dim)
    trace = blockwise_attention(q, k, v, block_size=block_size, order=order, cache_seqlens=seqlens)
    ref = reference_attention(q, k, v, seqlens)
    assert trace.final_out.dtype == torch.float64
    assert torch.allclose(trace.final_out, ref, atol=1e-10, rtol=0)
    # The last real step of every walk is the full output, and padding steps repeat it.
    assert torch.allclose(trace.partial_out[:, :, -1], ref, atol=1e-10, rtol=0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), seqlen=st.integers(2, 300), block_size=st.sampled_from([3, 16, 32]))
def test_every_partial_output_is_attention_over_the_visited_blocks(seed, seqlen, block_size):
    q, k, v, seqlens = random_case(seed, 2, 2, 2, seqlen, 8)
    trace = blockwise_attention(q, k, v, block_size=block_size, cache_seqlens=seqlens)
    steps = trace.block_ids.shape[-1]
    t = steps // 2
    for b in range(2):
        for kv in range(2):
            ids = trace.block_ids[b, kv, : t + 1]
            ids = ids[ids >= 0]
            selection = torch.zeros(2, 2, math.ceil(seqlen / block_size), dtype=torch.bool)
            selection[b, kv, ids] = True
            ref = reference_attention(q, k, v, seqlens, selection=selection, block_size=block_size)
            for h in range(kv * 2, kv * 2 + 2):
                assert torch.allclose(trace.partial_out[b, h, t], ref[b, h], atol=1e-10, rtol=0)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), seqlen=st.integers(1, 400), block_size=st.sampled_from([8, 64]))
def test_every_order_gives_the_same_final_output(seed, seqlen, block_size):
    q, k, v, seqlens = random_case(seed, 2, 2, 4, seqlen, 16)
    num_blocks = math.ceil(seqlen / block_size)
    gen = torch.Generator().manual_seed(seed)
    outputs = [blockwise_attention(q, k, v, block_size=block_size, order=o, cache_seqlens=seqlens).final_out
               for o in ORDERS[:3]]
    scores = torch.randn(2, 2, num_blocks, generator=gen)
    outputs.append(blockwise_attention(q, k, v, block_size=block_size, order="importance",
                                       block_scores=scores, cache_seqlens=seqlens).final_out)
    # An explicit random permutation of the walkable blocks of each sequence.
    perm = torch.full((2, num_blocks), -1)
    for b in range(2):
        n = math.ceil(int(seqlens[b]) / block_size)
        perm[b, :n] = torch.randperm(n, generator=gen)
    outputs.append(blockwise_attention(q, k, v, block_size=block_size, order=perm, cache_seqlens=seqlens).final_out)
    for out in outputs[1:]:
        assert torch.allclose(out, outputs[0], atol=1e-12, rtol=0)


def test_selection_restricts_the_walk_to_the_kept_blocks():
    q, k, v, _ = random_case(3, 2, 2, 3, 300, 8)
    selection = torch.rand(2, 2, 5, generator=torch.Generator().manual_seed(1)) > 0.5
    selection[..., 0] = True
    trace = blockwise_attention(q, k, v, block_size=64, selection=selection)
    ref = reference_attention(q, k, v, torch.tensor([300, 300]), selection=selection, block_size=64)
    assert torch.allclose(trace.final_out, ref, atol=1e-10, rtol=0)
    walked = torch.zeros_like(selection)
    for b in range(2):
        for kv in range(2):
            ids = trace.block_ids[b, kv]
            walked[b, kv, ids[ids >= 0]] = True
    assert torch.equal(walked, selection)
    assert torch.equal(trace.num_steps, selection.sum(-1).amax(-1))


def test_orders_visit_blocks_in_the_documented_sequence():
    q, k, v, _ = random_case(0, 1, 1, 1, 5 * 16 - 3, 4)
    ids = {o: blockwise_attention(q, k, v, block_size=16, order=o).block_ids[0, 0].tolist() for o in ORDERS[:3]}
    assert ids["sequential"] == [0, 1, 2, 3, 4]
    assert ids["recency"] == [4, 3, 2, 1, 0]
    assert ids["sink_recency"] == [0, 4, 3, 2, 1]
    scores = torch.tensor([[[0.1, 5.0, -1.0, 2.0, 0.0]]])
    trace = blockwise_attention(q, k, v, block_size=16, order="importance", block_scores=scores)
    assert trace.block_ids[0, 0].tolist() == [1, 3, 0, 4, 2]
    assert trace.block_tokens[0, 0].tolist() == [16, 16, 16, 13, 16]


def test_walks_reading_a_token_range_take_only_their_first_steps():
    ids = torch.tensor([[0, 4, 3, 2, 1], [0, 4, 3, -1, -1]])        # sink then newest, blocks of 16; the 2nd: 3 steps
    needle = (33, 50)                                               # tokens in blocks 2 and 3
    assert walks_reading(ids, torch.tensor([2, 2]), needle, 16).tolist() == [False, False]
    assert walks_reading(ids, torch.tensor([3, 3]), needle, 16).tolist() == [True, True]     # block 3, third
    assert walks_reading(ids, torch.tensor([5, 5]), (16, 17), 16).tolist() == [True, False]  # block 1: not walked
    assert check_token_range((torch.tensor(3), 7)) == (3, 7)
    for bad in ((5, 5), (-1, 2), (1.5, 3), (1, 2, 3), None):
        with pytest.raises(ValueError, match="token range"):
            check_token_range(bad)


def test_block_mass_and_contribution_match_their_definitions():
    q, k, v, seqlens = random_case(5, 2, 2, 2, 150, 8)
    trace = blockwise_attention(q, k, v, block_size=32, order="sequential", cache_seqlens=seqlens)
    for b in range(2):
        length = int(seqlens[b])
        for h in range(4):
            kv = h // 2
            weights = torch.softmax(k[b, kv, :length].double() @ q[b, h].double() * 8 ** -0.5, dim=0)
            weighted = weights[:, None] * v[b, kv, :length].double()
            for t, block in enumerate(trace.block_ids[b, kv].tolist()):
                if block < 0:
                    assert trace.block_mass[b, h, t] == 0
                    continue
                part = slice(block * 32, min(block * 32 + 32, length))
                assert torch.isclose(trace.block_mass[b, h, t], weights[part].sum(), atol=1e-12)
                assert torch.isclose(trace.block_contribution[b, h, t], weighted[part].sum(0).norm(), atol=1e-12)
    assert torch.allclose(trace.block_mass.sum(-1), torch.ones(2, 4, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_mode_agrees_with_exact_mode_to_float32_accuracy(dtype):
    q, k, v, seqlens = random_case(11, 2, 2, 4, 517, 32)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    exact = blockwise_attention(q, k, v, block_size=64, cache_seqlens=seqlens)
    kernel = blockwise_attention(q, k, v, block_size=64, cache_seqlens=seqlens, mode="kernel")
    assert kernel.partial_out.dtype == torch.float32
    # p is rounded to the value dtype before the PV product, as a FlashAttention-2 kernel does.
    tol = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert (kernel.partial_out.double() - exact.partial_out).abs().max() < tol
    assert torch.allclose(kernel.running_max.double(), exact.running_max, atol=1e-5)
    assert torch.allclose(kernel.running_sum.double(), exact.running_sum, rtol=1e-5)
    assert torch.allclose(kernel.block_mass.double(), exact.block_mass, atol=1e-6)


def test_kernel_mode_running_state_follows_the_online_recurrence():
    q, k, v, seqlens = random_case(2, 1, 1, 2, 200, 16)
    trace = blockwise_attention(q, k, v, block_size=64, order="sink_recency", cache_seqlens=seqlens,
                                mode="kernel")
    length = int(seqlens[0])
    for h in range(2):
        m, l = float("-inf"), 0.0
        for t, block in enumerate(trace.block_ids[0, 0].tolist()):
            if block < 0:
                break
            kb = k[0, 0, block * 64: min(block * 64 + 64, length)]
            s = (kb @ q[0, h]) * 16 ** -0.5
            m_new = max(m, float(s.max()))
            l = math.exp(m - m_new) * l + float(torch.exp(s - m_new).sum())
            m = m_new
            assert math.isclose(float(trace.running_max[0, h, t]), m, rel_tol=1e-6, abs_tol=1e-6)
            assert math.isclose(float(trace.running_sum[0, h, t]), l, rel_tol=1e-5)
            acc = trace.accumulator[0, h, t]
            assert torch.allclose(acc / l, trace.partial_out[0, h, t], rtol=1e-5, atol=1e-6)


def test_module_form_matches_function():
    q, k, v, seqlens = random_case(4, 1, 2, 2, 100, 8)
    module = BlockwiseAttention(block_size=16, order="recency")
    trace = module(q, k, v, cache_seqlens=seqlens)
    direct = blockwise_attention(q, k, v, block_size=16, order="recency", cache_seqlens=seqlens)
    assert torch.equal(trace.final_out, direct.final_out)


def test_sm_scale_is_applied():
    q, k, v, seqlens = random_case(6, 1, 1, 1, 40, 8)
    trace = blockwise_attention(q, k, v, block_size=8, sm_scale=0.3, cache_seqlens=seqlens)
    assert torch.allclose(trace.final_out, reference_attention(q, k, v, seqlens, sm_scale=0.3), atol=1e-10)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(q=torch.randn(1, 3, 8)), ValueError, "Hq % Hkv"),
    (dict(q=torch.randn(1, 4, 16)), ValueError, "head dim mismatch"),
    (dict(cache_seqlens=torch.tensor([65])), ValueError, r"\[1, S=64\]"),
    (dict(cache_seqlens=torch.tensor([0])), ValueError, r"\[1, S=64\]"),
    (dict(cache_seqlens=torch.tensor([3.0])), TypeError, "integer"),
    (dict(k=torch.randint(0, 4, (1, 2, 64, 8))), TypeError, "floating-point"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(block_size=-4), ValueError, "block_size"),
    (dict(order=torch.tensor([0, 1, 1, 3])), ValueError, "not a permutation"),
    (dict(order=torch.tensor([0, 1, 2])), ValueError, "not a permutation"),
    (dict(order="random"), ValueError, "order must be one of"),
    (dict(order="importance"), ValueError, "block_scores"),
    (dict(order="importance", block_scores=[[[0.0] * 4] * 2]), TypeError,
     r"block_scores must be a floating-point tensor \[B, Hkv, num_blocks\], got list"),
    (dict(order="importance", block_scores=torch.ones(1, 2, 4, dtype=torch.bool)), TypeError,
     "block_scores must be a floating-point tensor .*got torch.bool"),
    (dict(sm_scale=True), ValueError, "sm_scale must be a positive finite number, got True"),
    (dict(mode="fast"), ValueError, "mode"),
    (dict(selection=torch.ones(1, 2, 3, dtype=torch.bool)), ValueError, "selection must have shape"),
    (dict(selection=torch.zeros(1, 2, 4, dtype=torch.bool)), ValueError, "at least one block"),
    (dict(selection=torch.ones(1, 2, 4, dtype=torch.bool, device="meta")), ValueError,
     "selection must be on k's device cpu, got meta"),
    (dict(q=torch.randn(1, 4, 8, device="meta")), ValueError, "q is on the meta device"),
    (dict(k=torch.randn(1, 2, 64, 8, device="meta"), v=torch.randn(1, 2, 64, 8, device="meta")), ValueError,
     "k is on the meta device"),
    (dict(block_scores=torch.randn(1, 2, 4)), ValueError,
     "block_scores order the walk only with order='importance'; got order 'sink_recency'"),
    (dict(v=torch.randn(1, 2, 32, 8)), ValueError, "shape of k"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (dict(q=torch.randn(0, 4, 8)), ValueError, r"q must have non-empty dims \[B, Hq, D\], got \(0, 4, 8\)"),
    (dict(q=torch.randn(1, 0, 8)), ValueError, r"q must have non-empty dims"),
    (dict(k=torch.randn(1, 2, 0, 8), v=torch.randn(1, 2, 0, 8)), ValueError,
     r"k must have non-empty dims \[B, Hkv, S, D\], got \(1, 2, 0, 8\)"),
    (dict(k=torch.randn(1, 0, 64, 8), v=torch.randn(1, 0, 64, 8)), ValueError, r"k must have non-empty dims"),
])
def test_bad_input_gets_a_clear_error(kwargs, error, message):
    args = dict(q=torch.randn(1, 4, 8), k=torch.randn(1, 2, 64, 8), v=torch.randn(1, 2, 64, 8), block_size=16)
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=message):
        blockwise_attention(q, k, v, **args)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_cache_is_rejected_only_among_valid_tokens(name, bad):
    tensors = dict(q=torch.randn(1, 2, 8), k=torch.randn(1, 1, 32, 8), v=torch.randn(1, 1, 32, 8))
    tensors[name][0, 0, 30, 3] = bad
    with pytest.raises(ValueError, match=f"{name} holds NaN or Inf"):
        blockwise_attention(**tensors, block_size=8)
    # Garbage past cache_seqlens is never read.
    trace = blockwise_attention(**tensors, block_size=8, cache_seqlens=torch.tensor([30]))
    assert torch.isfinite(trace.final_out).all()


@pytest.mark.parametrize("mode", ["exact", "kernel"])
def test_a_block_past_the_cache_is_walked_as_the_cache_not_padded_to_its_size(mode):
    # 2**40 tokens of padding could not be allocated: the one block is walked as its S tokens
    q, k, v, seqlens = random_case(7, 2, 4, 2, 100, 8)
    huge = blockwise_attention(q, k, v, block_size=2 ** 40, mode=mode, cache_seqlens=seqlens)
    one_block = blockwise_attention(q, k, v, block_size=100, mode=mode, cache_seqlens=seqlens)
    assert huge.block_size == 2 ** 40 and huge.partial_out.shape[-2] == 1
    assert torch.equal(huge.final_out, one_block.final_out)
    assert torch.equal(huge.block_tokens, one_block.block_tokens)
    assert torch.equal(huge.block_tokens[..., 0], seqlens[:, None].expand(-1, 4))
