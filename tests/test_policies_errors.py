"""Building policies by name or spec, and the errors bad input gets."""
import numpy as np
import pytest
import torch

from art_analysis import policies

QUERY_METHODS = ["snapkv", "pyramidkv", "h2o", "quest", "coverage", "oracle_contribution"]


def cache(seqlen=40, batch=1):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(batch, 2, seqlen, 8, generator=gen)
    return k, torch.randn(batch, 2, seqlen, 8, generator=gen), torch.randn(batch, 4, 2, 8, generator=gen)


def test_registry_lists_every_method():
    assert list(policies.REGISTRY) == ["dense", "streaming", "snapkv", "pyramidkv", "h2o", "quest", "coverage",
                                       "oracle_contribution"]
    assert {name for name, cls in policies.REGISTRY.items() if cls.needs_queries} == set(QUERY_METHODS)


def test_make_and_parse_spec_build_the_same_policy():
    assert policies.make("snapkv", budget=0.2) == policies.parse_spec("snapkv:budget=0.2")
    policy = policies.parse_spec(" snapkv : budget=256, window=16, pooling=maxpool, sm_scale=None ")
    assert policy == policies.SnapKVPolicy(budget=256, window=16, pooling="maxpool")
    assert isinstance(policy.budget, int)
    assert policies.parse_spec("dense") == policies.DensePolicy()


@pytest.mark.parametrize("policy", [policies.make("streaming", budget=0.25, sink_tokens=0),
                                    policies.make("pyramidkv", budget=100, beta=5.0, group_reduce="max"),
                                    policies.make("coverage", gamma=0.95, sm_scale=0.5),
                                    policies.make("quest", budget=64, dense_layers=0)])
def test_spec_reads_back(policy):
    assert policies.parse_spec(policy.spec) == policy


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown policy 'snapk'.*dense, streaming, snapkv"):
        policies.make("snapk", budget=0.2)
    with pytest.raises(ValueError, match="unknown policy"):
        policies.parse_spec("tova:budget=0.2")


def test_unknown_or_missing_parameter_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown parameter.*windw.*valid parameters: budget, window"):
        policies.parse_spec("snapkv:budget=0.2,windw=32")
    with pytest.raises(ValueError, match="policy 'h2o' needs budget"):
        policies.make("h2o")
    with pytest.raises(ValueError, match="unknown parameter.*budget.*\\(none\\)"):
        policies.make("dense", budget=0.5)


@pytest.mark.parametrize("spec", ["", "snapkv:budget", "snapkv:=3", "snapkv:budget=0.2,budget=0.3"])
def test_malformed_specs(spec):
    with pytest.raises(ValueError, match="spec"):
        policies.parse_spec(spec)


@pytest.mark.parametrize("budget", [0, -5, 0.0, -0.1, 1.5, float("nan")])
def test_budget_of_zero_or_below_or_a_bad_fraction(budget):
    with pytest.raises(ValueError, match="budget"):
        policies.make("streaming", budget=budget)


@pytest.mark.parametrize("budget", [True, "0.2", None])
def test_budget_of_the_wrong_type(budget):
    with pytest.raises(TypeError, match="budget must be an int"):
        policies.make("snapkv", budget=budget)


@pytest.mark.parametrize("name", ["streaming", "snapkv", "pyramidkv", "h2o", "quest", "oracle_contribution"])
def test_numpy_budgets_of_a_sweep_are_held_as_python_numbers(name):
    tokens, fraction = (policies.make(name, budget=b).budget for b in (np.int64(16), np.float32(0.25)))
    assert (tokens, fraction) == (16, 0.25) and type(tokens) is int and type(fraction) is float
    assert policies.make(name, budget=np.int64(16)).spec == policies.make(name, budget=16).spec
    with pytest.raises(ValueError, match="budget as a fraction must lie in"):
        policies.make(name, budget=np.float64(1.5))


def test_a_budget_policy_of_ones_own_checks_its_budget_and_counts_its_blocks():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class NewestPolicy(policies.BudgetPolicy):
        name = "newest"

        def keep_blocks(self, inputs):
            newest = inputs.newest_blocks(self.kept_block_counts(inputs))      # [B, nb]
            return newest[:, None, :].expand(-1, inputs.k.shape[1], -1)

    k, v, _ = cache(seqlen=40, batch=2)
    keep = NewestPolicy(budget=np.float64(0.5)).select(k, v, block_size=8, cache_seqlens=torch.tensor([40, 17]))
    # half of 40 tokens is 20 (3 blocks of 8); half of 17 is 8 (1 block), the newest valid one (block 2)
    assert keep.sum(-1).tolist() == [[3, 3], [1, 1]] and keep[1, :, 2].all()
    assert NewestPolicy(budget=np.int64(9)).spec == "newest:budget=9"
    with pytest.raises(ValueError, match="budget as a fraction must lie in"):
        NewestPolicy(budget=2.0)


@pytest.mark.parametrize("name", ["streaming", "snapkv", "h2o", "quest", "oracle_contribution"])
def test_budget_above_the_length(name):
    k, v, queries = cache(seqlen=40, batch=2)
    policy = policies.make(name, budget=33)
    with pytest.raises(ValueError, match="budget of 33 tokens exceeds the length of sequence 1 \\(32 tokens\\)"):
        policy.select(k, v, queries=queries, block_size=8, cache_seqlens=torch.tensor([40, 32]))


@pytest.mark.parametrize("name", QUERY_METHODS)
def test_query_methods_need_queries(name):
    k, v, _ = cache()
    policy = policies.make(name, **({"gamma": 0.9} if name == "coverage" else {"budget": 0.5}))
    with pytest.raises(ValueError, match=f"policy '{name}' scores blocks with queries"):
        policy.select(k, v, layer=3, num_layers=4, block_size=8)


def test_pyramidkv_needs_its_layer():
    k, v, queries = cache()
    with pytest.raises(ValueError, match="pass layer and num_layers"):
        policies.make("pyramidkv", budget=0.5, window=8).select(k, v, queries=queries, block_size=8)


def test_forced_blocks_must_fit_in_the_budget():
    k, v, queries = cache()
    with pytest.raises(ValueError, match="cannot hold the observation window"):
        policies.make("snapkv", budget=8, window=16).select(k, v, queries=queries, block_size=8)
    with pytest.raises(ValueError, match="cannot hold the sink blocks"):
        policies.make("streaming", budget=8, sink_tokens=12).select(k, v, block_size=8)


@pytest.mark.parametrize("params, match", [
    (dict(name="snapkv", budget=0.5, kernel_size=4), "odd"),
    (dict(name="snapkv", budget=0.5, pooling="median"), "pooling"),
    (dict(name="h2o", budget=0.5, group_reduce="sum"), "group_reduce"),
    (dict(name="h2o", budget=0.5, recent_fraction=1.5), "recent_fraction"),
    (dict(name="pyramidkv", budget=0.5, beta=0.5), "beta"),
    (dict(name="coverage", gamma=0.0), "gamma"),
    (dict(name="coverage", gamma=0.9, sm_scale=-1.0), "sm_scale"),
    (dict(name="quest", budget=0.5, dense_layers=-1), "dense_layers"),
    (dict(name="streaming", budget=0.5, sink_tokens=2.5), "sink_tokens"),
])
def test_bad_hyper_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        policies.make(**params)


def test_numpy_scalars_of_a_sweep_are_hyper_parameters():
    swept = [policies.make("h2o", budget=0.5, recent_fraction=np.float32(0.25)),
             policies.make("pyramidkv", budget=0.5, beta=np.float32(5), window=np.int64(8)),
             policies.make("streaming", budget=0.5, sink_tokens=np.int64(2)),
             policies.make("quest", budget=0.5, dense_layers=np.int64(1))]
    plain = [policies.make("h2o", budget=0.5, recent_fraction=0.25),
             policies.make("pyramidkv", budget=0.5, beta=5.0, window=8),
             policies.make("streaming", budget=0.5, sink_tokens=2), policies.make("quest", budget=0.5, dense_layers=1)]
    assert swept == plain
    assert [type(p.recent_fraction) for p in swept[:1]] == [float] and type(swept[1].window) is int
    with pytest.raises(ValueError, match=r"recent_fraction must lie in \[0, 1\] \(a real number\), got True"):
        policies.make("h2o", budget=0.5, recent_fraction=True)


def test_bad_tensors():
    k, v, queries = cache()
    policy = policies.make("snapkv", budget=0.5, window=8)
    with pytest.raises(ValueError, match=r"queries must be \[B, Hq, Nq, D\].*q\[:, :, None\]"):
        policy.select(k, v, queries=queries[:, :, 0], block_size=8)
    with pytest.raises(ValueError, match="must match k's B=1 and D=8"):
        policy.select(k, v, queries=queries[..., :4], block_size=8)
    with pytest.raises(ValueError, match="multiple of Hkv=2"):
        policy.select(k, v, queries=queries[:, :3], block_size=8)
    with pytest.raises(ValueError, match="v must have the shape of k"):
        policy.select(k, v[:, :, :5], queries=queries, block_size=8)
    with pytest.raises(TypeError, match="floating-point"):
        policy.select(k.long(), v, queries=queries, block_size=8)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        policy.select(k, v, queries=queries, block_size=0)
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[1, S=40\]"):
        policy.select(k, v, queries=queries, block_size=8, cache_seqlens=torch.tensor([41]))
    with pytest.raises(TypeError, match="cache_seqlens must be an integer tensor"):
        policy.select(k, v, queries=queries, block_size=8, cache_seqlens=torch.tensor([4.0]))
    with pytest.raises(TypeError, match=r"cache_seqlens must be an integer tensor \[B\], got '5'"):
        policy.select(k, v, queries=queries, block_size=8, cache_seqlens="5")
    with pytest.raises(ValueError, match=r"layer must lie in \[0, num_layers=2\)"):
        policy.select(k, v, queries=queries, block_size=8, layer=2, num_layers=2)
    bad = k.clone()
    bad[0, 1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="k holds NaN"):
        policy.select(bad, v, queries=queries, block_size=8)
    # NaN past a sequence's length is ignored.
    bad = k.clone()
    bad[0, 1, 39, 0] = float("nan")
    policy.select(bad, v, queries=queries, block_size=8, cache_seqlens=torch.tensor([39]))
