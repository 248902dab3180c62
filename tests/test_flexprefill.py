"""The FlexPrefill reference: JS distance, budgets, pattern decision, block selection, sparse attention."""
import math

import pytest
import torch

from art_analysis.flexprefill import (QUERY_AWARE, VERTICAL_SLASH, RepresentativeAttention, block_budgets,
                                      block_sum, coverage_count, dense_causal_attention, descending_rank, gamma_sweep,
                                      js_distance, representative_attention, select_blocks, sparse_attention,
                                      vertical_slash_mask)


def _qkv(b=1, hq=4, hkv=2, n=200, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen) for h in (hq, hkv, hkv))


def _dense(q, k, v):
    group = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1), is_causal=True)


# ----------------------------------------------------------------------------- hand-built arithmetic

def test_js_distance_on_hand_built_distributions():
    p = torch.tensor([1.0, 0.0])
    q = torch.tensor([0.5, 0.5])
    # m = (0.75, 0.25); KL(p||m) = ln(4/3); KL(q||m) = 0.5 ln(2/3) + 0.5 ln 2
    expected = math.sqrt(0.5 * (math.log(4 / 3) + 0.5 * math.log(2 / 3) + 0.5 * math.log(2)))
    assert js_distance(p, q).item() == pytest.approx(expected, abs=1e-6)
    assert js_distance(q, p).item() == pytest.approx(expected, abs=1e-6)
    assert js_distance(q, q).item() == pytest.approx(0.0, abs=1e-6)
    disjoint = js_distance(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).item()
    assert disjoint == pytest.approx(math.sqrt(math.log(2)), abs=1e-6)


def test_js_distance_without_epsilon_is_nan_on_zero_mass_as_upstream():
    p = torch.tensor([1.0, 0.0])
    q = torch.tensor([0.5, 0.5])
    assert torch.isnan(js_distance(p, q, eps=None))
    assert torch.isfinite(js_distance(p, q))


def test_coverage_count_is_the_shortest_prefix_reaching_gamma():
    mass = torch.tensor([0.2, 0.5, 0.3])
    assert coverage_count(mass, 0.5).item() == 1
    assert coverage_count(mass, 0.8).item() == 2
    assert coverage_count(mass, 0.81).item() == 3
    assert coverage_count(mass, 1.0).item() == 3
    assert coverage_count(torch.tensor([[0.7, 0.3], [0.5, 0.5]]), 0.6).tolist() == [1, 2]
    # a normalised float32 mass whose sum rounds to just under 1: gamma = 1 takes the nonzero entries, no zeros
    short = torch.tensor([0.5, 0.49999994, 0.0, 0.0])
    assert short.sum().item() < 1.0 and coverage_count(short, 1.0).item() == 2
    assert coverage_count(torch.zeros(3), 1.0).item() == 1


def test_descending_rank_breaks_ties_by_lower_index():
    assert descending_rank(torch.tensor([0.1, 0.5, 0.1, 0.3])).tolist() == [2, 0, 3, 1]


def test_block_budgets_come_from_the_block_size():
    assert block_budgets(1024, None, 128, 100) == (8, 100)
    assert block_budgets(1024, None, 64, 100) == (16, 100)
    assert block_budgets(1000, 3000, 128, 100) == (8, 24)
    assert block_budgets(1024, 3000, 128, 5) == (5, 5)
    assert block_budgets(0, 1, 32, 7) == (0, 1)


def _stats(vertical, slash):
    return RepresentativeAttention(vertical=torch.tensor(vertical)[None, None],
                                   slash=torch.tensor(slash)[None, None], rows=2)


def test_vertical_slash_budget_and_selection_on_hand_built_lines():
    # N = 8, block size 2: 4 blocks.  Vertical mass on tokens 0, 4, 7; slash mass on distances 0 and 5.
    stats = _stats([0.5, 0, 0, 0, 0.3, 0, 0, 0.2], [0.6, 0, 0, 0, 0, 0.4, 0, 0])
    mask, vertical, slash = vertical_slash_mask(stats, gamma=0.8, block_size=2, min_blocks=0, max_blocks=4,
                                                budget_divisor=2)
    # 2 tokens cover 0.8 in each vector -> ceil(2 / 2) = 1 block each: key block 0 and the main diagonal.
    assert vertical.item() == 1 and slash.item() == 1
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)

    mask, vertical, slash = vertical_slash_mask(stats, gamma=0.8, block_size=2, min_blocks=0, max_blocks=4,
                                                budget_divisor=1)
    # Divisor 1: 2 blocks each: key blocks 0 and 2 (token 4), diagonals 0 and 2 (distance 5 -> offset 2).
    assert vertical.item() == 2 and slash.item() == 2
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)

    _, vertical, slash = vertical_slash_mask(stats, gamma=0.8, block_size=2, min_blocks=3, max_blocks=3,
                                             budget_divisor=2)
    assert vertical.item() == 3 and slash.item() == 3


def test_representative_attention_matches_materialised_softmax_in_any_chunking():
    q, k, _ = _qkv(n=70, d=16)
    scale = 0.25
    stats = representative_attention(q, k, block_size=16, sm_scale=scale, key_chunk=9)
    rows = torch.arange(54, 70)
    scores = (q[:, :, 54:] @ k.repeat_interleave(2, 1).transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(torch.arange(70)[None, :] > rows[:, None], float("-inf")), dim=-1)
    assert torch.allclose(stats.vertical, probs.sum(-2) / 16, atol=1e-6)
    slash = torch.zeros(1, 4, 70)
    for i, pos in enumerate(rows.tolist()):
        slash[..., : pos + 1] += probs[..., i, : pos + 1].flip(-1)
    assert torch.allclose(stats.slash, slash / 16, atol=1e-6)


# ----------------------------------------------------------------------------- selection

def test_gamma_one_with_every_block_kept_equals_dense_causal_attention():
    q, k, v = _qkv(b=2, n=150)
    selection = select_blocks(q, k, gamma=1.0, tau=0.1, block_size=32, min_budget=150)
    nb = 5
    assert torch.equal(selection.block_mask, torch.ones(nb, nb, dtype=torch.bool).tril().expand(2, 4, nb, nb))
    out = sparse_attention(q, k, v, selection.block_mask, 32, compute_dtype=torch.float64)
    assert torch.allclose(out, _dense(q, k, v), atol=1e-10)
    assert torch.allclose(selection.kept_fraction, torch.ones(2, 4))


def test_gamma_one_keeps_every_tile_without_a_minimum_budget():
    q, k, _ = _qkv(n=160)
    selection = select_blocks(q, k, gamma=1.0, tau=0.0, block_size=32, min_budget=0)
    assert bool(selection.block_mask.equal(torch.ones(5, 5, dtype=torch.bool).tril().expand(1, 4, 5, 5)))


def test_first_and_diagonal_blocks_are_always_kept_and_mask_is_causal():
    q, k, _ = _qkv(n=256)
    selection = select_blocks(q, k, gamma=0.3, tau=0.2, block_size=32, min_budget=0)
    mask = selection.block_mask
    assert mask[..., 0].all() and mask.diagonal(dim1=-2, dim2=-1).all()
    assert not mask.triu(diagonal=1).any()


def test_pattern_decision_flips_at_tau():
    q, k, _ = _qkv(b=2, n=256, seed=3)
    js = select_blocks(q, k, block_size=32, min_budget=0).js_distance
    for b in range(2):
        for h in range(4):
            d = js[b, h].item()
            above = select_blocks(q, k, tau=d + 1e-4, block_size=32, min_budget=0)
            below = select_blocks(q, k, tau=d - 1e-4, block_size=32, min_budget=0)
            assert above.pattern[b, h].item() == QUERY_AWARE
            assert below.pattern[b, h].item() == VERTICAL_SLASH


def test_query_aware_and_vertical_slash_heads_use_their_own_sets():
    q, k, _ = _qkv(n=256, seed=4)
    aware = select_blocks(q, k, gamma=0.7, tau=10.0, block_size=32, min_budget=0)
    slash = select_blocks(q, k, gamma=0.7, tau=0.0, block_size=32, min_budget=0)
    union = select_blocks(q, k, gamma=0.7, tau=10.0, block_size=32, min_budget=0, union_vs_for_query_aware=True)
    assert (aware.pattern == QUERY_AWARE).all() and (slash.pattern == VERTICAL_SLASH).all()
    assert not torch.equal(aware.block_mask, slash.block_mask)
    assert torch.equal(union.block_mask, aware.block_mask | slash.block_mask)


def test_budget_divisor_quirk_shrinks_budgets_for_small_blocks():
    q, k, _ = _qkv(n=512, seed=5)
    paper = select_blocks(q, k, gamma=0.9, block_size=16, min_budget=0)
    upstream = select_blocks(q, k, gamma=0.9, block_size=16, min_budget=0, budget_divisor=128)
    assert (upstream.vertical_blocks <= paper.vertical_blocks).all()
    assert (upstream.vertical_blocks < paper.vertical_blocks).any()


def test_max_budget_caps_and_min_budget_floors_vertical_slash_heads():
    q, k, _ = _qkv(n=512, seed=6)
    capped = select_blocks(q, k, gamma=0.99, tau=0.0, block_size=32, min_budget=0, max_budget=64)
    floored = select_blocks(q, k, gamma=0.05, tau=0.0, block_size=32, min_budget=160)
    assert (capped.vertical_blocks == 2).all() and (capped.slash_blocks == 2).all()
    assert (floored.vertical_blocks == 5).all() and (floored.slash_blocks == 5).all()
    aware = select_blocks(q, k, gamma=0.05, tau=10.0, block_size=32, min_budget=160)
    per_row = aware.block_mask.sum(-1)
    assert (per_row >= torch.arange(1, 17).clamp(max=5)).all()


def test_batch_and_gqa_are_vectorised_per_sequence_and_head():
    q, k, _ = _qkv(b=2, hq=6, hkv=2, n=192, seed=7)
    whole = select_blocks(q, k, gamma=0.8, block_size=32, min_budget=32)
    for b in range(2):
        alone = select_blocks(q[b:b + 1], k[b:b + 1], gamma=0.8, block_size=32, min_budget=32)
        assert torch.equal(alone.block_mask[0], whole.block_mask[b])
    repeated = select_blocks(q, k.repeat_interleave(3, 1), gamma=0.8, block_size=32, min_budget=32)
    assert torch.equal(repeated.block_mask, whole.block_mask)


def test_sparse_attention_matches_a_masked_dense_computation():
    q, k, v = _qkv(n=100, seed=8)
    mask = torch.rand(1, 4, 4, 4, generator=torch.Generator().manual_seed(0)) < 0.5
    mask |= torch.eye(4, dtype=torch.bool)
    out, lse = sparse_attention(q, k, v, mask, 32, return_lse=True, compute_dtype=torch.float64, query_chunk=32)
    token_mask = mask.repeat_interleave(32, -1).repeat_interleave(32, -2)[..., :100, :100]
    tokens = token_mask & torch.ones(100, 100).tril().bool()
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 32 ** -0.5
    scores = scores.masked_fill(~tokens, float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(scores, -1))
    assert torch.allclose(out, torch.softmax(scores, -1) @ v.double().repeat_interleave(2, 1))


def test_gamma_sweep_error_falls_and_kept_fraction_rises_with_gamma():
    q, k, v = _qkv(n=256, seed=9)
    sweep = gamma_sweep(q, k, v, [0.5, 0.9, 1.0], tau=0.1, block_size=32, min_budget=0)
    kept = sweep.kept_fraction.mean(dim=(1, 2))
    error = sweep.rel_error.mean(dim=(1, 2))
    assert kept[0] <= kept[1] <= kept[2] and error[0] >= error[1] >= error[2]
    assert kept[2] == pytest.approx(1.0) and error[2] < 1e-6


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,match", [
    (dict(gamma=0.0), r"gamma must lie in \(0, 1\]"),
    (dict(gamma=1.01), r"gamma must lie in \(0, 1\]"),
    (dict(tau=-0.1), "tau must be >= 0"),
    (dict(block_size=0), "block_size"),
    (dict(min_budget=-1), "min_budget"),
    (dict(min_budget=512, max_budget=256), "max_budget"),
    (dict(budget_divisor=0), "budget_divisor"),
    (dict(js_eps=0.0), "js_eps"),
    (dict(gamma=torch.tensor(0.9)), r"gamma must lie in \(0, 1\] \(a real number\), got tensor"),
    (dict(tau=True), r"tau must be >= 0 \(a finite real number\), got True"),
    (dict(block_size=True), "block_size must be a positive int, got True"),
    (dict(block_size=32.0), "block_size must be a positive int, got 32.0"),
    (dict(budget_divisor=True), r"budget_divisor \(or None\) must be a positive int, got True"),
    (dict(key_chunk=-1), "key_chunk must be a positive int, got -1"),
    (dict(sm_scale=0.0), "sm_scale must be a positive finite number, got 0.0"),
    (dict(sm_scale=float("nan")), "sm_scale must be a positive finite number, got nan"),
])
def test_select_blocks_rejects_bad_parameters(kwargs, match):
    q, k, _ = _qkv(n=64)
    with pytest.raises(ValueError, match=match):
        select_blocks(q, k, **kwargs)


def test_select_blocks_rejects_bad_tensors():
    q, k, v = _qkv(n=64)
    with pytest.raises(ValueError, match="same length"):
        select_blocks(q, k[:, :, :32])
    with pytest.raises(ValueError, match="head dim"):
        select_blocks(q, k[..., :16])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        select_blocks(q[:, :3], k)
    with pytest.raises(ValueError, match=r"\[B, H, N, D\]"):
        select_blocks(q[0], k)
    with pytest.raises(TypeError, match="floating-point"):
        select_blocks(q.long(), k)
    with pytest.raises(ValueError, match="block_mask must have shape"):
        sparse_attention(q, k, v, torch.ones(1, 4, 3, 3, dtype=torch.bool), 32)
    with pytest.raises(TypeError, match="bool"):
        sparse_attention(q, k, v, torch.ones(1, 4, 2, 2), 32)
    mask = torch.ones(1, 4, 2, 2, dtype=torch.bool)
    for bad, name in ((q, "q"), (k, "k"), (v, "v")):           # the reference refuses what it would spread
        poisoned = bad.clone()
        poisoned[0, 0, 5, 3] = float("nan")
        inputs = {"q": q, "k": k, "v": v, name: poisoned}
        with pytest.raises(ValueError, match=f"{name} holds NaN or Inf"):
            sparse_attention(inputs["q"], inputs["k"], inputs["v"], mask, 32)
        if name != "v":
            with pytest.raises(ValueError, match=f"{name} holds NaN or Inf"):
                select_blocks(inputs["q"], inputs["k"], block_size=32)
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got NoneType"):
        dense_causal_attention(q, k, None)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        dense_causal_attention(q.tolist(), k, v)
    with pytest.raises(ValueError, match="query_chunk must be a positive int, got 0"):
        sparse_attention(q, k, v, mask, 32, query_chunk=0)
    with pytest.raises(TypeError, match="return_lse must be True or False, got 'no'"):
        sparse_attention(q, k, v, mask, 32, return_lse="no")
    with pytest.raises(TypeError, match="union_vs_for_query_aware must be True or False, got 'no'"):
        select_blocks(q, k, block_size=32, union_vs_for_query_aware="no")


@pytest.mark.parametrize("gammas, error, match", [
    (0.9, TypeError, r"gammas must be a sequence, e.g. \[0.9, 0.95\], got 0.9"),
    ("0.9", TypeError, "gammas must be a sequence"),
    (torch.tensor(0.9), TypeError, "gammas must be a sequence"),
    ([], ValueError, "gammas must hold at least one value"),
    ([0.9, True], ValueError, r"each of gammas must lie in \(0, 1\] \(a real number\), got True"),
    ([0.9, 1.5], ValueError, r"each of gammas must lie in \(0, 1\] \(a real number\), got 1.5"),
])
def test_gamma_sweep_names_gammas_that_are_not_a_sequence_of_fractions(gammas, error, match):
    q, k, v = _qkv(n=64)
    with pytest.raises(error, match=match):
        gamma_sweep(q, k, v, gammas, block_size=32, min_budget=32)


def test_a_block_past_the_prompt_sums_and_selects_as_one_block():
    # block_sum's tile holds the N values, not block_size (2**40 could not be allocated)
    x = torch.arange(12.0).view(2, 6)
    assert torch.equal(block_sum(x, 2 ** 40), x.sum(-1, keepdim=True))
    assert torch.equal(block_sum(x, 4), torch.stack([x[:, :4].sum(-1), x[:, 4:].sum(-1)], -1))
    q, k, v = _qkv()
    huge = select_blocks(q, k, block_size=2 ** 40)
    one_block = select_blocks(q, k, block_size=200)
    assert huge.block_mask.shape == (1, 4, 1, 1) and huge.block_mask.all()
    assert torch.equal(huge.js_distance, one_block.js_distance)
    assert torch.equal(huge.pattern, one_block.pattern)
