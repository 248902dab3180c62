"""Policies followed by ART: the simulator walk and the paged layout the kernel reads."""
import pytest
import torch

from art_analysis import policies
from art_analysis.blockwise import blockwise_attention
from art_analysis.policies.compose import paged_selection, simulate_policy, walk_order
from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import ARTConfig, stop

BLOCK = 16
SEQLENS = torch.tensor([300, 181])


@pytest.fixture(scope="module")
def cache():
    return synthetic_cache(2, 6, 2, 300, 16, preset="realistic", seed=3)


def test_walk_order_over_the_kept_blocks():
    selection = torch.tensor([[[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 1]]], dtype=torch.bool)
    seqlens = torch.tensor([21])   # blocks 0..5 of 4 tokens: block 5 holds token 20 only
    assert walk_order(selection, "sequential", block_size=4, cache_seqlens=seqlens).tolist() == \
        [[[0, 2, 3, 5], [1, 2, 5, -1]]]
    assert walk_order(selection, "recency", block_size=4, cache_seqlens=seqlens).tolist() == \
        [[[5, 3, 2, 0], [5, 2, 1, -1]]]
    assert walk_order(selection, "sink_recency", block_size=4, cache_seqlens=seqlens).tolist() == \
        [[[0, 5, 3, 2], [1, 5, 2, -1]]]
    # Blocks past the length are never walked, even when selected.
    assert walk_order(selection, "sequential", block_size=4, cache_seqlens=torch.tensor([12])).tolist() == \
        [[[0, 2], [1, 2]]]
    with pytest.raises(ValueError, match="order must be one of"):
        walk_order(selection, "importance", block_size=4)
    for block_size in (-1, 0, 1.5):
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            walk_order(selection, "sequential", block_size=block_size)
    # 6 blocks of 4 tokens hold 21 to 24 tokens
    for seqlen in (20, 25, 24.0):
        with pytest.raises(ValueError, match=r"seqlen must be an int in \(20, 24\]: the 6 blocks of 4 tokens"):
            walk_order(selection, "sequential", block_size=4, seqlen=seqlen)
    assert walk_order(selection, "sequential", block_size=4, seqlen=21).tolist() == [[[0, 2, 3, 5], [1, 2, 5, -1]]]


@pytest.mark.parametrize("mode", ["exact", "kernel"])
@pytest.mark.parametrize("order", ["sequential", "sink_recency"])
def test_dense_then_art_equals_art(cache, mode, order):
    plain = blockwise_attention(cache.q, cache.k, cache.v, block_size=BLOCK, order=order, cache_seqlens=SEQLENS,
                                mode=mode)
    composed = simulate_policy(policies.make("dense"), cache.q, cache.k, cache.v, block_size=BLOCK, order=order,
                               cache_seqlens=SEQLENS, mode=mode)
    assert torch.equal(composed.trace.block_ids, plain.block_ids)
    for config in (ARTConfig(), ARTConfig(tau=1e-2, phi=1e-3, patience=2), ARTConfig.paper()):
        expected, got = stop(plain, config), stop(composed.trace, config)
        assert torch.equal(got.stop_step, expected.stop_step)
        assert torch.equal(got.output, expected.output)
        assert torch.equal(got.loaded_fraction, expected.loaded_fraction)


def test_the_walks_softmax_scale_also_scores_a_policy_without_one(cache):
    scale = 0.7                                                     # not D ** -0.5 = 0.25
    queries = cache.q[:, :, None]
    result = simulate_policy(policies.make("coverage", gamma=0.8), cache.q, cache.k, cache.v, block_size=BLOCK,
                             cache_seqlens=SEQLENS, sm_scale=scale)
    scaled = policies.make("coverage", gamma=0.8, sm_scale=scale)
    expected = scaled.select(cache.k, cache.v, queries=queries, block_size=BLOCK, cache_seqlens=SEQLENS)
    assert torch.equal(result.selection, expected) and result.trace.sm_scale == scale
    default = policies.make("coverage", gamma=0.8).select(cache.k, cache.v, queries=queries, block_size=BLOCK,
                                                          cache_seqlens=SEQLENS)
    assert not torch.equal(expected, default)
    # A policy's own scale stays; a policy without softmax scores, or no scale given, is left as it is.
    own = policies.make("coverage", gamma=0.8, sm_scale=0.25)
    assert own.with_sm_scale(scale) is own and scaled.with_sm_scale(None) is scaled
    quest = policies.make("quest", budget=0.5)
    assert quest.with_sm_scale(scale) is quest
    assert policies.make("snapkv", budget=0.5).with_sm_scale(scale) == policies.make("snapkv", budget=0.5,
                                                                                     sm_scale=scale)


@pytest.mark.parametrize("spec", ["streaming:budget=0.3", "snapkv:budget=0.4,window=16", "quest:budget=96",
                                  "coverage:gamma=0.8", "h2o:budget=0.5"])
def test_the_walk_visits_exactly_the_kept_blocks(cache, spec):
    policy = policies.parse_spec(spec)
    result = simulate_policy(policy, cache.q, cache.k, cache.v, block_size=BLOCK, cache_seqlens=SEQLENS)
    assert torch.equal(result.trace.block_ids, result.order)
    for b in range(2):
        for h in range(2):
            walked = result.order[b, h][result.order[b, h] >= 0]
            kept = result.selection[b, h].nonzero().flatten()
            assert sorted(walked.tolist()) == kept.tolist()
            # The final output is attention over the kept tokens only.
            tokens = torch.cat([torch.arange(j * BLOCK, min((j + 1) * BLOCK, int(SEQLENS[b]))) for j in kept])
            for head in range(3 * h, 3 * h + 3):
                weights = torch.softmax(cache.k[b, h, tokens].double() @ cache.q[b, head].double() / 4.0, 0)
                expected = weights @ cache.v[b, h, tokens].double()
                assert torch.allclose(result.trace.final_out[b, head], expected, atol=1e-10)


def test_query_aware_policies_default_to_the_decode_query(cache):
    policy = policies.make("quest", budget=64)
    result = simulate_policy(policy, cache.q, cache.k, cache.v, block_size=BLOCK, cache_seqlens=SEQLENS)
    expected = policy.select(cache.k, cache.v, queries=cache.q[:, :, None], block_size=BLOCK,
                             cache_seqlens=SEQLENS)
    assert torch.equal(result.selection, expected)


def test_simulate_policy_names_a_policy_spec_or_queries_of_the_wrong_rank(cache):
    for spec in ("snapkv:budget=0.2", None):
        with pytest.raises(TypeError, match=r"policy must be a SelectionPolicy \(policies.make\(name, ...\) or "
                                            r"policies.parse_spec\(spec\) builds one\), got (str|NoneType)"):
            simulate_policy(spec, cache.q, cache.k, cache.v)
    # a query-aware policy is told of q's rank, not asked for queries
    with pytest.raises(ValueError, match=r"q must be \[B, Hq, D\] decode queries, got \(2, 6, 1, 16\)"):
        simulate_policy(policies.make("quest", budget=64), cache.q[:, :, None], cache.k, cache.v)


def test_paged_layout_holds_the_kept_tokens_in_walk_order(cache):
    policy = policies.make("snapkv", budget=0.35, window=20)
    result = simulate_policy(policy, cache.q, cache.k, cache.v, queries=cache.q[:, :, None], block_size=BLOCK,
                             cache_seqlens=SEQLENS, order="sequential")
    paged = paged_selection(cache.q, cache.k, cache.v, result.selection, block_size=BLOCK, cache_seqlens=SEQLENS)
    assert paged.block_table.dtype == torch.int32 and paged.cache_seqlens.dtype == torch.int32
    assert paged.k_cache.shape == (2 * 2 * 19, BLOCK, 1, 16)
    for row in range(4):
        b, h = divmod(row, 2)
        length = int(paged.cache_seqlens[row])
        slots = torch.arange(length)
        pages = paged.block_table[row, slots // BLOCK].long()
        keys = paged.k_cache[pages, slots % BLOCK, 0]
        values = paged.v_cache[pages, slots % BLOCK, 0]
        kept = result.order[b, h][result.order[b, h] >= 0]
        tokens = torch.cat([torch.arange(j * BLOCK, min((j + 1) * BLOCK, int(SEQLENS[b]))) for j in kept])
        assert torch.equal(keys, cache.k[b, h, tokens]) and torch.equal(values, cache.v[b, h, tokens])
        # Paged attention over the table reproduces the simulator's output for the group's heads.
        weights = torch.softmax(keys.double() @ paged.q[row].double().T / 4.0, 0)
        assert torch.allclose(weights.T @ values.double(), result.trace.final_out[b, 3 * h:3 * h + 3], atol=1e-10)
    assert torch.equal(paged.unflatten_heads(paged.q), cache.q)


def test_paged_selection_rejects_an_empty_walk(cache):
    selection = torch.zeros(2, 2, 19, dtype=torch.bool)
    selection[:, :, 0] = True
    selection[1, 1, 0] = False
    with pytest.raises(ValueError, match="at least one block"):
        paged_selection(cache.q, cache.k, cache.v, selection, block_size=BLOCK)
    with pytest.raises(ValueError, match="selection must be a BoolTensor of shape"):
        paged_selection(cache.q, cache.k, cache.v, selection[..., :5], block_size=BLOCK)
    with pytest.raises(ValueError, match=r"block_size \(the kernel's page and block size\) must be one of "
                                         r"\(16, 32, 64, 128\), got 24"):
        paged_selection(cache.q, cache.k, cache.v, selection, block_size=24)
