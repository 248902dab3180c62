"""Every KV-selection policy against a brute-force reference written with plain loops."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from art_analysis import policies
from art_analysis.policies.base import validate_inputs
from art_analysis.policies.oracle_contribution import block_contributions
from art_analysis.policies.pyramidkv import pyramid_layer_tokens
from art_analysis.policies.quest import page_key_bounds, page_score_bound

BATCH, Q_HEADS, KV_HEADS, SEQLEN, DIM, BLOCK = 2, 4, 2, 77, 8, 8
SEQLENS = [77, 50]


def make_inputs(seed=0, num_queries=3):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(BATCH, KV_HEADS, SEQLEN, DIM, generator=gen) * 1.5
    v = torch.randn(BATCH, KV_HEADS, SEQLEN, DIM, generator=gen)
    queries = torch.randn(BATCH, Q_HEADS, num_queries, DIM, generator=gen) * 1.5
    return k, v, queries


def num_valid_blocks(length, block=BLOCK):
    return -(-length // block)


def token_budget(budget, length):
    return budget if isinstance(budget, int) else max(1, math.floor(budget * length + 1e-9))


def top_with_forced(scores, forced, count):
    """Forced blocks, then the others by decreasing score (ties: older first), ``count`` in all."""
    rest = sorted((j for j in range(len(scores)) if j not in forced), key=lambda j: (-scores[j], j))
    chosen = list(forced) + rest
    return set(chosen[:count])


def softmax_rows(b, kv, k, queries, length):
    """``{(g, n): weights over tokens < length}`` for the query heads of KV head ``kv``."""
    group = Q_HEADS // KV_HEADS
    rows = {}
    for g in range(group):
        for n in range(queries.shape[2]):
            q = queries[b, kv * group + g, n].double()
            logits = torch.stack([q @ k[b, kv, i].double() for i in range(length)]) / math.sqrt(DIM)
            rows[g, n] = torch.softmax(logits, 0)
    return rows


def reduce(values, how):
    return sum(values) / len(values) if how == "mean" else max(values)


def block_of(i):
    return i // BLOCK


def as_sets(mask):
    return [[set(mask[b, h].nonzero().flatten().tolist()) for h in range(mask.shape[1])] for b in range(mask.shape[0])]


def run(policy, k, v, queries=None, **kw):
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("cache_seqlens", torch.tensor(SEQLENS))
    return as_sets(policy.select(k, v, queries=queries, **kw))


def test_dense_keeps_every_valid_block():
    k, v, _ = make_inputs()
    got = run(policies.make("dense"), k, v)
    for b, length in enumerate(SEQLENS):
        assert got[b] == [set(range(num_valid_blocks(length)))] * KV_HEADS


@pytest.mark.parametrize("budget, sink", [(30, 4), (0.5, 4), (16, 9), (50, 0)])
def test_streaming_keeps_sink_and_newest_blocks(budget, sink):
    k, v, _ = make_inputs()
    got = run(policies.make("streaming", budget=budget, sink_tokens=sink), k, v)
    for b, length in enumerate(SEQLENS):
        nb, count = num_valid_blocks(length), num_valid_blocks(token_budget(budget, length))
        sink_blocks = set(range(-(-sink // BLOCK)))
        newest = [j for j in range(nb - 1, -1, -1) if j not in sink_blocks][:count - len(sink_blocks)]
        assert got[b] == [sink_blocks | set(newest)] * KV_HEADS


def snapkv_reference(k, queries, budget_blocks, window, kernel_size, pooling, group_reduce):
    expected = []
    for b, length in enumerate(SEQLENS):
        nb, row = num_valid_blocks(length), []
        for kv in range(KV_HEADS):
            rows = softmax_rows(b, kv, k, queries, length)
            group = Q_HEADS // KV_HEADS
            pooled = []
            for g in range(group):
                w = [sum(float(rows[g, n][i]) for n in range(queries.shape[2])) / queries.shape[2]
                     for i in range(length)] + [0.0] * (SEQLEN - length)
                radius = kernel_size // 2
                hood = [[w[j] for j in range(i - radius, i + radius + 1) if 0 <= j < SEQLEN] for i in range(length)]
                pooled.append([sum(h) / kernel_size if pooling == "avgpool" else max(h) for h in hood])
            token = [reduce([pooled[g][i] for g in range(group)], group_reduce) for i in range(length)]
            scores = [sum(token[i] for i in range(length) if block_of(i) == j) for j in range(nb)]
            forced = list(range(nb - 1, -1, -1))[:-(-window // BLOCK)]
            row.append(top_with_forced(scores, forced, budget_blocks(b, length)))
        expected.append(row)
    return expected


@pytest.mark.parametrize("budget, window, kernel_size, pooling, group_reduce", [
    (0.4, 8, 5, "avgpool", "mean"), (40, 12, 3, "maxpool", "max"), (24, 0, 7, "avgpool", "max")])
def test_snapkv_equals_brute_force(budget, window, kernel_size, pooling, group_reduce):
    k, v, queries = make_inputs(seed=1)
    policy = policies.make("snapkv", budget=budget, window=window, kernel_size=kernel_size, pooling=pooling,
                           group_reduce=group_reduce)
    expected = snapkv_reference(k, queries, lambda b, length: num_valid_blocks(token_budget(budget, length)),
                                window, kernel_size, pooling, group_reduce)
    assert run(policy, k, v, queries) == expected


def test_pyramidkv_layer_budgets_follow_the_linear_schedule():
    tokens, seqlens = torch.tensor([232, 432]), torch.tensor([10_000, 400])
    budgets = [pyramid_layer_tokens(tokens, seqlens, window=32, layer=layer, num_layers=5, beta=20).tolist()
               for layer in range(5)]
    # Sequence 0: A = 200, lo = 10, hi = 390, step 95 per layer.
    assert [row[0] for row in budgets] == [32 + 390, 32 + 295, 32 + 200, 32 + 105, 32 + 10]
    # Sequence 1: A = 400 would give hi = 780 > L - w = 368, so hi = 368, lo = 800 - 368 = 432.
    assert [row[1] for row in budgets] == [32 + 368, 32 + 384, 32 + 400, 32 + 416, 32 + 432]
    assert pyramid_layer_tokens(tokens, seqlens, window=32, layer=0, num_layers=1, beta=20).tolist() == [232, 432]


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_pyramidkv_is_snapkv_with_the_layer_budget(layer):
    k, v, queries = make_inputs(seed=2)
    budget, window, num_layers = 0.5, 8, 4

    def layer_blocks(b, length):
        spread = token_budget(budget, length) - window
        lo, hi = spread / 20, 2 * spread - spread / 20
        if hi > length - window:
            hi, lo = length - window, 2 * spread - (length - window)
        return num_valid_blocks(window + math.floor(hi - (hi - lo) * layer / (num_layers - 1) + 1e-9))

    expected = snapkv_reference(k, queries, layer_blocks, window, 5, "avgpool", "mean")
    policy = policies.make("pyramidkv", budget=budget, window=window)
    assert run(policy, k, v, queries, layer=layer, num_layers=num_layers) == expected
    first, last = (sum(len(s) for s in run(policy, k, v, queries, layer=x, num_layers=num_layers)[0])
                   for x in (0, num_layers - 1))
    assert first > last


@pytest.mark.parametrize("budget, recent_fraction, group_reduce", [(0.5, 0.5, "mean"), (32, 0.25, "max"),
                                                                    (40, 0.0, "mean")])
def test_h2o_equals_brute_force(budget, recent_fraction, group_reduce):
    k, v, queries = make_inputs(seed=3)
    policy = policies.make("h2o", budget=budget, recent_fraction=recent_fraction, group_reduce=group_reduce)
    for b, length in enumerate(SEQLENS):
        nb, count = num_valid_blocks(length), num_valid_blocks(token_budget(budget, length))
        recent = list(range(nb - 1, -1, -1))[:math.ceil(count * recent_fraction - 1e-9)]
        for kv in range(KV_HEADS):
            rows = softmax_rows(b, kv, k, queries, length)
            group = Q_HEADS // KV_HEADS
            token = [reduce([sum(float(rows[g, n][i]) for n in range(queries.shape[2])) for g in range(group)],
                            group_reduce) for i in range(length)]
            scores = [sum(token[i] for i in range(length) if block_of(i) == j) for j in range(nb)]
            assert run(policy, k, v, queries)[b][kv] == top_with_forced(scores, recent, count)


@pytest.mark.parametrize("budget, group_reduce", [(0.3, "max"), (24, "mean")])
def test_quest_equals_brute_force(budget, group_reduce):
    k, v, queries = make_inputs(seed=4)
    policy = policies.make("quest", budget=budget, group_reduce=group_reduce)
    for b, length in enumerate(SEQLENS):
        nb, count = num_valid_blocks(length), num_valid_blocks(token_budget(budget, length))
        for kv in range(KV_HEADS):
            scores = []
            for j in range(nb):
                page = k[b, kv, j * BLOCK:min((j + 1) * BLOCK, length)].double()
                low, high = page.amin(0), page.amax(0)
                bounds = []
                for h in range(kv * Q_HEADS // KV_HEADS, (kv + 1) * Q_HEADS // KV_HEADS):
                    for q in queries[b, h].double():
                        bounds.append(sum(max(float(q[i] * high[i]), float(q[i] * low[i])) for i in range(DIM)))
                scores.append(reduce(bounds, group_reduce))
            assert run(policy, k, v, queries)[b][kv] == top_with_forced(scores, [nb - 1], count)


def test_quest_leaves_its_first_layers_dense():
    k, v, queries = make_inputs(seed=4)
    policy = policies.make("quest", budget=8, dense_layers=2)
    dense = run(policies.make("dense"), k, v)
    assert run(policy, k, v, queries, layer=1, num_layers=4) == dense
    assert run(policy, k, v, queries, layer=2, num_layers=4) == run(policy, k, v, queries)
    assert all(len(s) == 1 for row in run(policy, k, v, queries, layer=2, num_layers=4) for s in row)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dim=st.integers(1, 5), seqlen=st.integers(1, 12), block=st.integers(1, 5))
def test_quest_bound_is_at_least_every_pages_true_max_score(data, dim, seqlen, block):
    value = st.floats(-100, 100, allow_nan=False, allow_infinity=False, width=32)
    keys = torch.tensor(data.draw(st.lists(st.lists(value, min_size=dim, max_size=dim),
                                           min_size=seqlen, max_size=seqlen)), dtype=torch.float32)
    q = torch.tensor(data.draw(st.lists(value, min_size=dim, max_size=dim)), dtype=torch.float64)
    length = data.draw(st.integers(1, seqlen))
    k = keys[None, None]
    inputs = validate_inputs(k, k, queries=None, layer=None, num_layers=None, block_size=block,
                             cache_seqlens=torch.tensor([length]))
    low, high = page_key_bounds(inputs)
    bound = page_score_bound(q[None, None, None], low, high)[0, 0, 0]
    for j in range(-(-length // block)):
        true_max = max(float(q @ keys[i].double()) for i in range(j * block, min((j + 1) * block, length)))
        assert bound[j] >= true_max - 1e-9 * (1 + abs(true_max))


@pytest.mark.parametrize("gamma", [0.5, 0.9, 1.0])
def test_coverage_equals_brute_force_union_of_per_head_sets(gamma):
    k, v, queries = make_inputs(seed=5)
    policy = policies.make("coverage", gamma=gamma)
    got = run(policy, k, v, queries)
    for b, length in enumerate(SEQLENS):
        nb = num_valid_blocks(length)
        for kv in range(KV_HEADS):
            rows = softmax_rows(b, kv, k, queries, length)
            union = set()
            for g in range(Q_HEADS // KV_HEADS):
                mass = [sum(float(rows[g, n][i]) for n in range(queries.shape[2]) for i in range(length)
                            if block_of(i) == j) / queries.shape[2] for j in range(nb)]
                taken, total = [], 0.0
                for j in sorted(range(nb), key=lambda j: (-mass[j], j)):
                    if taken and total >= gamma - 1e-12:
                        break
                    taken.append(j)
                    total += mass[j]
                union |= set(taken)
            assert got[b][kv] == union


def test_coverage_keeps_what_each_query_head_needs():
    # Head 0 of the group attends only to block 1, head 1 only to block 3: the union keeps both.
    k = torch.zeros(1, 1, 32, 4)
    k[0, 0, 8:16, 0] = 20.0
    k[0, 0, 24:32, 1] = 20.0
    queries = torch.zeros(1, 2, 1, 4)
    queries[0, 0, 0, 0] = queries[0, 1, 0, 1] = 2.0
    assert as_sets(policies.make("coverage", gamma=0.9).select(k, k, queries=queries, block_size=8)) == [[{1, 3}]]


@pytest.mark.parametrize("budget, group_reduce", [(0.3, "max"), (20, "mean")])
def test_oracle_contribution_equals_brute_force(budget, group_reduce):
    k, v, queries = make_inputs(seed=6)
    policy = policies.make("oracle_contribution", budget=budget, group_reduce=group_reduce)
    for b, length in enumerate(SEQLENS):
        nb, count = num_valid_blocks(length), num_valid_blocks(token_budget(budget, length))
        for kv in range(KV_HEADS):
            rows = softmax_rows(b, kv, k, queries, length)
            scores = [reduce([float(sum(rows[key][i] * v[b, kv, i].double() for i in range(length)
                                        if block_of(i) == j).norm()) for key in rows], group_reduce)
                      for j in range(nb)]
            assert run(policy, k, v, queries)[b][kv] == top_with_forced(scores, [], count)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_oracle_contributions_ignore_garbage_past_the_lengths(garbage):
    k, v, queries = make_inputs(seed=6)
    lengths = torch.tensor(SEQLENS)
    past = (torch.arange(SEQLEN) >= lengths[:, None])[:, None, :, None]
    inputs = {fill: validate_inputs(k.masked_fill(past, fill), v.masked_fill(past, fill), queries=queries, layer=None,
                                    num_layers=None, block_size=BLOCK, cache_seqlens=lengths)
              for fill in (garbage, 0.0)}
    assert torch.equal(block_contributions(inputs[garbage], None), block_contributions(inputs[0.0], None))


@pytest.mark.parametrize("spec", ["dense", "streaming:budget=20", "snapkv:budget=20,window=8",
                                  "pyramidkv:budget=20,window=8", "h2o:budget=20", "quest:budget=20,dense_layers=0",
                                  "coverage:gamma=0.9", "oracle_contribution:budget=20"])
@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_garbage_past_the_lengths_changes_no_selection(spec, garbage):
    k, v, queries = make_inputs(seed=8)
    lengths = torch.tensor(SEQLENS)
    past = (torch.arange(SEQLEN) >= lengths[:, None])[:, None, :, None]
    policy = policies.parse_spec(spec)
    kept = {fill: policy.select(k.masked_fill(past, fill), v.masked_fill(past, fill), queries=queries, layer=1,
                                num_layers=3, block_size=BLOCK, cache_seqlens=lengths)
            for fill in (garbage, 0.0)}
    assert torch.equal(kept[garbage], kept[0.0])


def test_group_reduce_mean_and_max_differ_as_documented():
    # Block j's keys are sqrt(3) e_j, so a query's block weights are softmax(q) (8 equal tokens each).
    # Head 0 weights blocks (0.05, 0.6, 0.35), head 1 (0.5, 0, 0.5): the max over the group prefers
    # block 1 (0.6 > 0.5), the mean block 2 (0.425 > 0.3).
    k = torch.zeros(1, 1, 24, 3)
    for j in range(3):
        k[0, 0, 8 * j:8 * (j + 1), j] = 3 ** 0.5
    queries = torch.tensor([[[[math.log(0.05), math.log(0.6), math.log(0.35)]], [[0.0, -40.0, 0.0]]]])
    kept = {how: as_sets(policies.make("h2o", budget=8, recent_fraction=0.0, group_reduce=how)
                         .select(k, k, queries=queries, block_size=8))[0][0] for how in ("mean", "max")}
    assert kept == {"max": {1}, "mean": {2}}


@pytest.mark.parametrize("spec", ["streaming:budget={}", "snapkv:budget={},window=8", "pyramidkv:budget={},window=8",
                                  "h2o:budget={}", "quest:budget={},dense_layers=0",
                                  "oracle_contribution:budget={}"])
@pytest.mark.parametrize("block", [1, 8, 13])
def test_budgets_hold_exactly(spec, block):
    k, v, queries = make_inputs(seed=7)
    for budget in (9, 33, 0.35, 1.0):
        policy = policies.parse_spec(spec.format(budget))
        kept = policy.select(k, v, queries=queries, block_size=block, cache_seqlens=torch.tensor(SEQLENS),
                             layer=1, num_layers=3).sum(-1)
        if policy.name == "pyramidkv":   # the middle of three layers gets the mean budget
            expected_tokens = [pyramid_layer_tokens(torch.tensor([token_budget(budget, n)]), torch.tensor([n]),
                                                    window=8, layer=1, num_layers=3, beta=20).item() for n in SEQLENS]
        else:
            expected_tokens = [token_budget(budget, n) for n in SEQLENS]
        for b, tokens in enumerate(expected_tokens):
            assert kept[b].tolist() == [-(-tokens // block)] * KV_HEADS
            if block == 1:
                assert kept[b].tolist() == [tokens] * KV_HEADS


def test_windows_and_sinks_are_kept_even_without_attention():
    # The queries look away from every key of the window, yet the window blocks stay.
    k = torch.zeros(1, 1, 64, 2)
    k[0, 0, :, 0] = 5.0
    k[0, 0, 48:, 0] = -5.0
    queries = torch.tensor([[[[1.0, 0.0]]]])
    kept = as_sets(policies.make("snapkv", budget=24, window=16).select(k, k, queries=queries, block_size=8))[0][0]
    assert {6, 7} <= kept and len(kept) == 3
    kept = as_sets(policies.make("h2o", budget=32, recent_fraction=0.5).select(k, k, queries=queries,
                                                                                block_size=8))[0][0]
    assert {6, 7} <= kept and len(kept) == 4
    kept = as_sets(policies.make("quest", budget=16).select(k, k, queries=queries, block_size=8))[0][0]
    assert 7 in kept and len(kept) == 2
    kept = as_sets(policies.make("streaming", budget=24, sink_tokens=4).select(k, k, block_size=8))[0][0]
    assert kept == {0, 6, 7}


@pytest.mark.parametrize("spec", ["streaming:budget=0.5", "quest:budget=0.5", "snapkv:budget=0.5,window=8",
                                  "oracle_contribution:budget=0.5", "h2o:budget=0.5"])
def test_a_block_past_the_cache_selects_as_one_block_of_the_cache(spec):
    # to_blocks' tiles hold S slots, not block_size (2**40 slots could not be allocated)
    k, v, queries = make_inputs()
    policy = policies.parse_spec(spec)
    lengths = torch.tensor(SEQLENS)
    huge = policy.select(k, v, queries=queries, block_size=2 ** 40, cache_seqlens=lengths)
    one_block = policy.select(k, v, queries=queries, block_size=SEQLEN, cache_seqlens=lengths)
    assert huge.shape == (BATCH, KV_HEADS, 1) and huge.all()
    assert torch.equal(huge, one_block)
    inputs = validate_inputs(k, v, queries=queries, layer=None, num_layers=None, block_size=2 ** 40,
                             cache_seqlens=lengths)
    assert inputs.block_tile == SEQLEN
    assert torch.equal(inputs.block_sum(torch.ones(BATCH, SEQLEN)), lengths[:, None].to(torch.float32))
