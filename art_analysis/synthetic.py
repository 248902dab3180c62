"""KV caches with controllable attention structure, for tests, demos and benchmarks.

The logits are built directly.  Every KV head ``(b, h)`` gets a random unit direction
``u``; its query heads are ``q = sqrt(D) * u + query_noise * n_q`` and its keys are
``k_i = noise * n_i + bias_i * u`` with standard normal ``n``.  With the default softmax
scale ``D ** -0.5`` the logit of token ``i`` is then ``bias_i`` plus noise of standard
deviation about ``noise``, where::

    bias_i = sink        for the first `sink_tokens` tokens          (attention sink)
           + recency * exp(-(S - 1 - i) / recency_scale)             (locality)
           + heavy       for `heavy_hitters` random tokens           (heavy hitters)

Values are standard normal plus a per-head mean ``value_mean * w`` (so the output has a
stable direction to converge to); `value_outliers` random tokens get their value vector
scaled by `outlier_scale` (value-norm outliers: tokens that matter through ``||v||``
rather than through their attention weight).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from kernels.int_checks import check_cache_dims, is_finite_real

from .checks import usable_device


@dataclass
class SyntheticCache:
    """A generated cache.

    Attributes:
        q: ``[B, Hq, D]`` decode queries.
        k, v: ``[B, Hkv, S, D]``.
        heavy_hitters: ``[B, Hkv, n_heavy]`` token positions given the heavy-hitter bias.
        value_outliers: ``[B, Hkv, n_outliers]`` token positions with scaled value norms.
        bias: ``[B, Hkv, S]`` the structured part of every token's logit.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heavy_hitters: torch.Tensor
    value_outliers: torch.Tensor
    bias: torch.Tensor


PRESETS = {
    # Diffuse attention: logits are mostly noise.
    "diffuse": dict(sink=1.0, recency=0.5, heavy=1.0, noise=0.5),
    # Concentration seen in real decode heads: strong sink, local window, a few heavy hitters.
    "realistic": dict(sink=8.0, recency=5.0, recency_scale=512.0, heavy=5.0, noise=1.0),
    # Very peaked attention: almost everything on the sink and the last tokens.
    "peaked": dict(sink=12.0, recency=9.0, recency_scale=128.0, heavy=4.0, noise=0.5),
}


def synthetic_cache(batch: int = 1, num_q_heads: int = 8, num_kv_heads: int = 2, seqlen: int = 4096,
                    head_dim: int = 64, *, sink: float = 6.0, sink_tokens: int = 4, recency: float = 4.0,
                    recency_scale: float = 256.0, heavy_hitters: int = 8, heavy: float = 4.0,
                    value_outliers: int = 4, outlier_scale: float = 8.0, value_mean: float = 1.0,
                    noise: float = 1.0, query_noise: float = 0.1, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    preset: str | None = None) -> SyntheticCache:
    """Generate a KV cache with attention sink, recency, heavy hitters and value outliers.

    ``preset`` (one of :data:`PRESETS`) overrides the structure parameters it names.
    """
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
        overrides = PRESETS[preset]
        sink = overrides.get("sink", sink)
        recency = overrides.get("recency", recency)
        recency_scale = overrides.get("recency_scale", recency_scale)
        heavy = overrides.get("heavy", heavy)
        noise = overrides.get("noise", noise)
    check_cache_dims(batch, num_q_heads, num_kv_heads, seqlen, head_dim)
    for name, value in (("sink_tokens", sink_tokens), ("heavy_hitters", heavy_hitters),
                        ("value_outliers", value_outliers)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value <= seqlen:
            raise ValueError(f"{name} must be an int in [0, seqlen={seqlen}], got {value!r}")
    reals = dict(sink=sink, recency=recency, recency_scale=recency_scale, heavy=heavy, outlier_scale=outlier_scale,
                 value_mean=value_mean, noise=noise, query_noise=query_noise)
    bad = {name: value for name, value in reals.items() if not is_finite_real(value)}
    if bad:
        raise ValueError(f"the structure parameters must be finite numbers, got {bad}")
    if recency_scale <= 0 or noise < 0 or query_noise < 0 or outlier_scale <= 0:
        raise ValueError("recency_scale and outlier_scale must be > 0, noise and query_noise >= 0")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch dtype, got {dtype!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    device = usable_device(device)

    gen = torch.Generator().manual_seed(int(seed))
    group = num_q_heads // num_kv_heads
    shape = (batch, num_kv_heads)
    direction = torch.randn(*shape, head_dim, generator=gen)
    direction = direction / direction.norm(dim=-1, keepdim=True)

    positions = torch.arange(seqlen, dtype=torch.float64)
    bias = torch.zeros(*shape, seqlen, dtype=torch.float64)
    bias[..., :sink_tokens] += sink
    bias += recency * torch.exp(-(seqlen - 1 - positions) / recency_scale)
    heavy_pos = _random_positions(shape, seqlen, heavy_hitters, gen)
    bias.scatter_add_(-1, heavy_pos, torch.full(heavy_pos.shape, float(heavy), dtype=torch.float64))

    q = head_dim ** 0.5 * direction[:, :, None, :] + query_noise * torch.randn(*shape, group, head_dim,
                                                                               generator=gen)
    k = noise * torch.randn(*shape, seqlen, head_dim, generator=gen) \
        + bias.to(torch.float32)[..., None] * direction[:, :, None, :]
    mean_dir = torch.randn(*shape, 1, head_dim, generator=gen)
    v = torch.randn(*shape, seqlen, head_dim, generator=gen) + value_mean * mean_dir
    outlier_pos = _random_positions(shape, seqlen, value_outliers, gen)
    scale = torch.ones(*shape, seqlen)
    scale.scatter_(-1, outlier_pos, outlier_scale)
    v = v * scale[..., None]
    return SyntheticCache(q=q.reshape(batch, num_q_heads, head_dim).to(device=device, dtype=dtype),
                          k=k.to(device=device, dtype=dtype), v=v.to(device=device, dtype=dtype),
                          heavy_hitters=heavy_pos, value_outliers=outlier_pos, bias=bias)


def _random_positions(shape: tuple, seqlen: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` distinct random token positions per ``shape`` entry: ``LongTensor [*shape, count]``."""
    keys = torch.rand(*shape, seqlen, generator=gen)
    return keys.topk(count, dim=-1).indices.sort(dim=-1).values
