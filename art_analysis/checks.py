"""Input checks shared by the public entry points (simulator, policies, analyses)."""
from __future__ import annotations

import numbers
from collections.abc import Iterable

import torch

from kernels.int_checks import check_count, is_finite_real


INT64_MAX = 2 ** 63 - 1


def usable_device(device) -> torch.device:
    """``device`` (a ``torch.device`` or its name) as a device this process can allocate on, else ``ValueError``
    naming it (torch's own errors say ``Torch not compiled with CUDA enabled`` or list every device type)."""
    try:
        resolved = torch.device(device)
        torch.empty(0, device=resolved)
    except (RuntimeError, TypeError, AssertionError) as exc:
        raise ValueError(f"device must be a torch.device or a name like 'cpu' or 'cuda:0' that this process can use, "
                         f"got {device!r} ({str(exc).splitlines()[0]})") from None
    return resolved


def check_int(value, name: str, minimum: int) -> int:
    """``value`` must be an integer (an ``int`` or a NumPy integer of a sweep, not a ``bool``) ``>= minimum`` that
    fits an int64 (the tensors it meets); returns it as an ``int``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must fit an int64 (at most 2**63 - 1), got {value}")
    return int(value)


def as_list(value, name: str, example: str) -> list:
    """``value`` (a list, tuple, range, 1-D NumPy array or tensor: a sweep's values) as a list; ``TypeError`` naming
    ``name``, with an ``example``, for a string, a single number or anything else that is not one sequence."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or getattr(value, "ndim", 1) != 1:
        raise TypeError(f"{name} must be a sequence, e.g. {example}, got {value!r}")
    return value.tolist() if isinstance(value, torch.Tensor) else list(value)


def check_int_count(value, name: str, minimum: int) -> int:
    """``kernels.int_checks.check_count`` (an int ``>= minimum``, else ``ValueError``) that also takes a NumPy
    integer, as a sweep passes it; returns a Python ``int``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    return check_count(value, name, minimum)


def check_rows(rows, columns, producer: str) -> None:
    """``rows`` must be a pandas DataFrame holding ``columns``, as ``producer`` (named in the errors) returns them."""
    import pandas as pd

    if not isinstance(rows, pd.DataFrame):
        raise TypeError(f"rows must be the DataFrame of {producer}, got {type(rows).__name__}")
    missing = [column for column in columns if column not in rows.columns]
    if missing:
        raise ValueError(f"rows lack the column(s) {missing} of {producer}")


def check_fraction(value, name: str) -> float:
    """``value`` must be a finite real number (``int``, ``float`` or a NumPy scalar, not a ``bool``) in ``(0, 1]``;
    returns it as a float."""
    if not is_finite_real(value) or not 0 < value <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return float(value)


def check_block_size(block_size) -> int:
    """``block_size`` must be a positive ``int``."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def check_float_tensor(t, name: str, layout: str) -> None:
    """``t`` must be a floating-point ``torch.Tensor`` (``layout`` names its expected shape) that holds values: a
    meta tensor (a shape without data) is refused, since every check and result after this one reads values."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device (a shape without values); the simulator and the analyses "
                         "compute from the values: pass a tensor on 'cpu' or 'cuda'")


def check_kv_cache(k, v) -> None:
    """``k, v`` must be floating-point ``[B, Hkv, S, D]`` tensors of one shape, no dim empty, on one device."""
    check_float_tensor(k, "k", "[B, Hkv, S, D]")
    check_float_tensor(v, "v", "[B, Hkv, S, D]")
    if k.dim() != 4:
        raise ValueError(f"k must be [B, Hkv, S, D], got shape {tuple(k.shape)}")
    if min(k.shape) < 1:
        raise ValueError(f"k must have non-empty dims [B, Hkv, S, D], got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.device != v.device:
        raise ValueError(f"k and v must be on one device, got {k.device} and {v.device}")


def check_cache_seqlens(cache_seqlens, batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """Valid tokens per sequence as ``LongTensor [B]`` in ``[1, S]`` (``None`` means ``S`` for all)."""
    if cache_seqlens is None:
        return torch.full((batch,), seqlen, dtype=torch.long, device=device)
    if isinstance(cache_seqlens, (str, bytes)):
        raise TypeError(f"cache_seqlens must be an integer tensor [B], got {cache_seqlens!r}")
    seqlens = torch.as_tensor(cache_seqlens, device=device)
    if seqlens.is_floating_point() or seqlens.dtype == torch.bool:
        raise TypeError(f"cache_seqlens must be an integer tensor [B], got {seqlens.dtype}")
    if tuple(seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape [B]=[{batch}], got {tuple(seqlens.shape)}")
    if (seqlens < 1).any() or (seqlens > seqlen).any():
        raise ValueError(f"cache_seqlens must lie in [1, S={seqlen}], got {seqlens.tolist()}")
    return seqlens.long()


def valid_token_mask(seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """``BoolTensor [B, S]``: token ``i`` of sequence ``b`` is valid when ``i < seqlens[b]``."""
    return torch.arange(seqlen, device=seqlens.device)[None, :] < seqlens[:, None]


def check_finite(**tensors: torch.Tensor) -> None:
    """Each keyword's tensor must hold only finite values: ``ValueError`` naming the first that does not."""
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} holds NaN or Inf")


def check_finite_cache(k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor) -> None:
    """``k, v [B, Hkv, S, D]`` must be finite on every valid token (garbage past the length is allowed)."""
    valid = valid_token_mask(seqlens, k.shape[2])
    for name, t in (("k", k), ("v", v)):
        if t.dtype == torch.float64:
            finite = torch.isfinite(t).all(-1)
        else:
            # One pass: a token's float64 sum is finite exactly when its (narrower) values all are.
            finite = torch.isfinite(t.sum(-1, dtype=torch.float64))
        if not finite.all(1)[valid].all():
            raise ValueError(f"{name} holds NaN or Inf among the valid tokens")
