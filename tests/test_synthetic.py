import numpy as np
import pytest
import torch

from art_analysis.synthetic import PRESETS, synthetic_cache


def logits(cache):
    group = cache.q.shape[1] // cache.k.shape[1]
    k = cache.k.double().repeat_interleave(group, dim=1)
    return torch.einsum("bhd,bhsd->bhs", cache.q.double(), k) * cache.q.shape[-1] ** -0.5


def test_shapes_dtypes_and_determinism():
    a = synthetic_cache(2, 6, 3, 500, 32, dtype=torch.float16, seed=4)
    b = synthetic_cache(2, 6, 3, 500, 32, dtype=torch.float16, seed=4)
    assert a.q.shape == (2, 6, 32) and a.k.shape == a.v.shape == (2, 3, 500, 32)
    assert a.q.dtype == torch.float16
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert not torch.equal(a.k, synthetic_cache(2, 6, 3, 500, 32, dtype=torch.float16, seed=5).k)


def test_logits_follow_the_requested_structure():
    cache = synthetic_cache(1, 4, 1, 4000, 64, sink=10.0, recency=6.0, recency_scale=50.0, heavy=8.0,
                            heavy_hitters=5, noise=0.5, query_noise=0.0)
    s = logits(cache)[0, 0]
    assert torch.allclose(s, cache.bias[0, 0], atol=3.0)   # bias plus noise of std ~0.5
    middle = s[1000:3000].median()
    assert s[:4].min() > middle + 7                            # sink
    assert s[-5:].min() > middle + 4                           # recency
    assert s[cache.heavy_hitters[0, 0]].min() > middle + 5     # heavy hitters


def test_value_outliers_have_large_norms():
    cache = synthetic_cache(1, 2, 1, 1000, 64, value_outliers=3, outlier_scale=10.0)
    norms = cache.v[0, 0].norm(dim=-1)
    assert norms[cache.value_outliers[0, 0]].min() > 4 * norms.median()


def test_presets_differ_in_concentration():
    def top_block_mass(preset):
        s = logits(synthetic_cache(1, 4, 1, 4096, 64, preset=preset))
        mass = torch.softmax(s, -1).view(1, 4, 64, 64).sum(-1)
        return mass.topk(4, dim=-1).values.sum(-1).mean()
    assert top_block_mass("diffuse") < top_block_mass("realistic") < top_block_mass("peaked")
    assert set(PRESETS) == {"diffuse", "realistic", "peaked"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_q_heads=5, num_kv_heads=2), "num_q_heads % num_kv_heads"),
    (dict(seqlen=0), "seqlen"), (dict(heavy_hitters=10_000), "heavy_hitters"),
    (dict(preset="spiky"), "preset"), (dict(recency_scale=0.0), "recency_scale"),
    (dict(sink=float("nan")), r"must be finite numbers, got \{'sink': nan\}"),
    (dict(outlier_scale=float("inf"), value_mean="1"), r"got \{'outlier_scale': inf, 'value_mean': '1'\}"),
    (dict(preset=["realistic"]), r"preset must be one of \['diffuse', 'peaked', 'realistic'\], got \['realistic'\]"),
    (dict(sink_tokens=True), r"sink_tokens must be an int in \[0, seqlen=4096\], got True"),
    (dict(seed=1.5), r"seed must be an int in \[0, 2\*\*63\), got 1.5"),
    (dict(seed=None), r"seed must be an int in \[0, 2\*\*63\), got None"),
    (dict(seed=2 ** 70), "seed must be an int in"),
    (dict(device="gpu"), "device must be a torch.device or a name like 'cpu' or 'cuda:0' that this process can use, "
                         "got 'gpu'"),
])
def test_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic_cache(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="names a device this process cannot use")
def test_a_device_this_process_cannot_use_is_named():
    with pytest.raises(ValueError, match="got 'cuda' .*Torch not compiled with CUDA enabled|got 'cuda' "):
        synthetic_cache(1, 2, 1, 64, 8, device="cuda")


def test_numpy_integers_of_a_sweep_are_counts_and_seeds():
    swept = synthetic_cache(1, 2, 1, 64, 8, heavy_hitters=np.int64(3), seed=np.int64(5))
    plain = synthetic_cache(1, 2, 1, 64, 8, heavy_hitters=3, seed=5)
    assert torch.equal(swept.k, plain.k) and torch.equal(swept.heavy_hitters, plain.heavy_hitters)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64, "float16"])
def test_a_cache_dtype_that_is_not_floating_is_refused(dtype):
    with pytest.raises(TypeError, match="dtype must be a floating torch dtype"):
        synthetic_cache(1, 2, 1, 64, 8, dtype=dtype)
