"""Seeded random configurations of ``art_decode`` against the simulator (CPU interpreter, fp32).

Each case draws the batch, KV heads, GQA group (1, 2, 3, 5, 8), head dim, length, block size, order, split count,
ragged lengths, the paged layout (pages of 1 to 128 tokens, shuffled), and an ART rule with one of its schemes
(deferred followers, on-demand followers, per-pair splits, a walk hint) or none.  Whatever the plan, the output must
be the exact attention over the leading steps that ``return_result_steps`` names (the whole walk, or where the
leader stopped), and the rule walked in one split must stop where the simulator's kernel mode stops.
"""
from __future__ import annotations

import random

import pytest
import torch

from art_analysis.blockwise import blockwise_attention
from art_analysis.termination import ARTConfig, kernel_walk_steps, stop
from kernels.art_decode import art_decode
from kernels.paged_cache import to_paged
from kernels.pair_walks import PairWalks
from kernels.walk_hint import LongestWalkHint

CASES = 32


def _draw(seed: int) -> dict:
    """One configuration: its sizes, layout, rule and scheme."""
    rnd = random.Random(seed)
    case = dict(batch=rnd.randint(1, 3), kv_heads=rnd.randint(1, 3), group=rnd.choice([1, 2, 3, 5, 8]),
                dim=rnd.choice([64, 128]), seqlen=rnd.choice([1, 17, 63, 64, 65, 129, 257, 511]),
                block=rnd.choice([16, 32, 64, 128]), order=rnd.choice(["sequential", "sink_recency"]),
                splits=rnd.choice([None, 1, 2, 3, 7]), ragged=rnd.random() < 0.6,
                page=rnd.choice([None, None, 1, 8, 16, 64, 128]),
                art=ARTConfig(tau=rnd.choice([1e-2, 1e-3, 0.0]), phi=rnd.choice([1e-3, 1e-5, 0.0]),
                              patience=rnd.choice([1, 2, 4]), min_steps=rnd.choice([0, 1, 2]))
                if rnd.random() < 0.7 else None,
                scheme=rnd.choice(["plan", "follow", "release", "pairs", "hint"]), draws=rnd.random())
    return case


def _scheme_keywords(case: dict, q, k, v, lengths, table, params) -> dict:
    """The keywords of ``case``'s scheme (none without a rule, or where it needs several splits and has one)."""
    rnd = random.Random(case["draws"])
    splits, scheme = case["splits"], case["scheme"]
    if params is None or scheme == "plan":
        return {"num_splits": splits}
    if scheme == "follow" and splits not in (None, 1):
        return {"num_splits": splits, "follow_step": rnd.randint(0, 6)}
    if scheme == "release" and splits not in (None, 1):
        return {"num_splits": splits, "follow_step": rnd.randint(0, 4),
                "release_walks": rnd.randint(0, case["batch"] * case["kv_heads"]), "release_step": rnd.randint(0, 8)}
    if scheme == "pairs":
        blocks = -(-case["seqlen"] // case["block"])
        generator = torch.Generator().manual_seed(rnd.randint(0, 2 ** 31))
        walks = torch.randint(1, blocks + 1, (case["batch"], case["kv_heads"]), generator=generator)
        return {"pair_walks": PairWalks.from_walks(walks)}
    if scheme == "hint":
        hint = LongestWalkHint()
        art_decode(q, k, v, cache_seqlens=lengths, block_table=table, art=params, order=case["order"],
                   block_size=case["block"], walk_hint=hint)
        return {"walk_hint": hint}
    return {"num_splits": splits}


@pytest.mark.parametrize("seed", range(CASES))
def test_a_random_configuration_agrees_with_the_simulator(seed):
    case = _draw(seed)
    batch, kv_heads, group, dim, seqlen = (case[key] for key in ("batch", "kv_heads", "group", "dim", "seqlen"))
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, dim, generator=generator)
    k = torch.randn(batch, kv_heads, seqlen, dim, generator=generator)
    v = torch.randn(batch, kv_heads, seqlen, dim, generator=generator)
    lengths = None
    if case["ragged"]:
        lengths = torch.randint(1, seqlen + 1, (batch,), generator=generator, dtype=torch.int32)
        lengths[0] = seqlen
    k_cache, v_cache, table = k, v, None
    if case["page"] is not None:
        k_cache, v_cache, table = to_paged(k, v, case["page"], seed=seed)
        if lengths is None:       # the paged default is the table's capacity, which passes S unless pages divide it
            lengths = torch.full((batch,), seqlen, dtype=torch.int32)
    params = case["art"].kernel_params() if case["art"] is not None else None
    keywords = _scheme_keywords(case, q, k_cache, v_cache, lengths, table, params)
    out, taken = art_decode(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, art=params,
                            order=case["order"], block_size=case["block"], return_result_steps=True, **keywords)

    exact = blockwise_attention(q.double(), k.double(), v.double(), block_size=case["block"], order=case["order"],
                                cache_seqlens=lengths, mode="exact")
    kept = (taken.long().repeat_interleave(group, dim=1) - 1)[..., None, None].expand(-1, -1, 1, dim)
    expected = exact.partial_out.gather(2, kept)[:, :, 0]
    error = (out.double() - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-12)
    assert torch.isfinite(out).all() and error.max() < 1e-3, (case, keywords, error.max())
    if params is not None:      # the same rule walked in one split stops where the simulator's kernel mode does
        _, single = art_decode(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, art=params,
                               order=case["order"], block_size=case["block"], num_splits=1, return_stats=True)
        replay = blockwise_attention(q, k, v, block_size=case["block"], order=case["order"], cache_seqlens=lengths,
                                     mode="kernel")
        assert torch.equal(single[..., 0].long(), kernel_walk_steps(stop(replay, case["art"]), kv_heads)), case
