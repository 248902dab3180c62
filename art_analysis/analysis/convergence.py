"""How fast the partial output converges along the walk (the paper's Figure 4).

Two views, both on any source (:mod:`art_analysis.analysis.inputs`):

* :func:`convergence_curves`: the relative L2 error of ``O^(t)`` against the fraction of the
  cache loaded, for each traversal order, as the median and interquartile range over the query
  heads of each layer;
* :func:`recent_window_curves`: the paper's retention curve, at token granularity: the
  relative error of attention over only the newest ``n`` tokens (optionally plus the first
  ``sink_tokens``), against ``n`` over the sequence length, exact in float64.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import pandas as pd
import torch

from kernels.softmax_scale import softmax_scale

from ..blockwise import BlockTrace
from ..checks import as_list, check_int
from ..orders import ORDERS
from .inputs import decode_inputs

DEFAULT_FRACTIONS = torch.linspace(0, 1, 101, dtype=torch.float64)


def error_curve(trace: BlockTrace) -> tuple[torch.Tensor, torch.Tensor]:
    """Loaded fraction and relative error of ``O^(t)`` after every step.

    Returns ``(loaded_fraction, rel_error)``, both ``[B, Hq, T]``; padded steps repeat the
    final values (fraction 1, error 0).
    """
    final = trace.final_out[:, :, None, :]
    error = torch.linalg.vector_norm(trace.partial_out - final, dim=-1)
    error = error / torch.clamp(torch.linalg.vector_norm(final, dim=-1), min=1e-30)
    return trace.loaded_fraction, error.double()


def error_at(trace: BlockTrace, fractions: torch.Tensor) -> torch.Tensor:
    """Relative error of every head once ``fractions`` of its walk is loaded: ``[B * Hq, F]`` float64.

    The error at fraction ``f`` is that of the last step whose loaded fraction is ``<= f``
    (error 1, nothing loaded, before the first block).
    """
    loaded, error = error_curve(trace)
    loaded, error = loaded.flatten(0, 1), error.flatten(0, 1)                    # [N, T]
    fractions = torch.as_tensor(fractions, dtype=torch.float64, device=loaded.device)
    position = torch.searchsorted(loaded.contiguous(), fractions.expand(loaded.shape[0], -1).contiguous(),
                                  right=True) - 1
    padded = torch.cat([error, torch.ones(error.shape[0], 1, dtype=error.dtype, device=error.device)], dim=-1)
    return torch.gather(padded, 1, torch.where(position >= 0, position, error.shape[1]))


def _check_fractions(fractions) -> torch.Tensor:
    """``fractions`` (default ``DEFAULT_FRACTIONS``) as a float64 ``[F]`` tensor of loaded fractions in ``[0, 1]``."""
    if fractions is None:
        return DEFAULT_FRACTIONS
    if isinstance(fractions, (str, bytes)):
        raise ValueError(f"fractions must be loaded fractions in [0, 1] (at least one), got {fractions!r}")
    values = torch.as_tensor(fractions, dtype=torch.float64).flatten()
    if values.numel() == 0 or not bool(((values >= 0) & (values <= 1)).all()):
        raise ValueError(f"fractions must be loaded fractions in [0, 1] (at least one), got {values.tolist()}")
    return values


def _quantile_rows(values: torch.Tensor, fractions: torch.Tensor, **keys) -> list[dict]:
    """Median, quartiles and mean over dim 0 of ``values [N, F]``, one row per fraction."""
    quantiles = torch.quantile(values, torch.tensor([0.25, 0.5, 0.75], dtype=values.dtype), dim=0)
    mean = values.mean(0)
    return [dict(**keys, loaded_fraction=float(f), error_q25=float(quantiles[0, i]),
                 error_median=float(quantiles[1, i]), error_q75=float(quantiles[2, i]), error_mean=float(mean[i]),
                 heads=values.shape[0])
            for i, f in enumerate(fractions.tolist())]


def convergence_curves(source, *, orders: Sequence[str] = ORDERS, fractions: torch.Tensor | None = None,
                       block_size: int = 64, step: int = -1) -> pd.DataFrame:
    """Relative error of ``O^(t)`` against the loaded fraction, per layer and traversal order.

    Args:
        source: a capture, a synthetic cache or decode inputs (:func:`~.inputs.decode_inputs`).
        orders: traversal orders; ``"importance"`` walks by Quest's key bound
            (:meth:`~.inputs.DecodeInput.trace`).
        fractions: ``[F]`` loaded fractions to report (default 0, 0.01, ..., 1).

    Returns:
        One row per ``(layer, order, loaded_fraction)``: ``error_q25, error_median, error_q75,
        error_mean`` over the ``heads`` (every query head of every sequence).
    """
    fractions = _check_fractions(fractions)
    orders = as_list(orders, "orders", "['sequential', 'sink_recency']")
    unknown = [o for o in orders if o not in ORDERS]
    if unknown or not orders:
        raise ValueError(f"orders must be a non-empty subset of {ORDERS}, got {list(orders)}")
    rows = []
    for call in decode_inputs(source, step):
        for order in orders:
            values = error_at(call.trace(order=order, block_size=block_size), fractions).cpu()
            rows += _quantile_rows(values, fractions, layer=call.layer, order=order)
    return pd.DataFrame(rows)


def recent_window_curves(source, *, fractions: torch.Tensor | None = None, sink_tokens: Sequence[int] = (0, 4),
                         step: int = -1) -> pd.DataFrame:
    """Relative error of attention over a recent window only, against the window's share of the tokens.

    For window fraction ``f`` the output attends to the newest ``ceil(f * seqlen)`` valid tokens
    and, when ``sink_tokens = s > 0``, also to the first ``s`` tokens (StreamingLLM's sink); the
    error is ``||O_window - O_full|| / ||O_full||`` in float64, at each input's ``sm_scale``.

    Returns:
        One row per ``(layer, window, loaded_fraction)`` with ``window`` = ``"recent"`` or
        ``"sink{s}+recent"``, the error quantiles over heads and ``heads``; ``loaded_fraction`` is
        the window's share of the tokens (sink included; a sink longer than a sequence is all of it).
    """
    fractions = _check_fractions(fractions)
    sizes = list(sink_tokens) if isinstance(sink_tokens, Iterable) and not isinstance(sink_tokens, str) else []
    if not sizes:
        raise ValueError(f"sink_tokens must be a non-empty list of ints >= 0 (0: no sink), got {sink_tokens!r}")
    sink_tokens = list(dict.fromkeys(check_int(s, "each of sink_tokens", 0) for s in sizes))
    rows = []
    for call in decode_inputs(source, step):
        batch, kv_heads, _, dim = call.k.shape
        group = call.q.shape[1] // kv_heads
        scale = softmax_scale(call.sm_scale, dim)
        per_sequence = {s: [] for s in sink_tokens}
        loaded = {s: [] for s in sink_tokens}
        for b in range(batch):
            seqlen = int(call.cache_seqlens[b])
            k = call.k[b, :, :seqlen].double().repeat_interleave(group, 0)
            v = call.v[b, :, :seqlen].double().repeat_interleave(group, 0)
            logits = torch.einsum("hd,hsd->hs", call.q[b].double(), k) * scale
            weights = torch.exp(logits - logits.amax(-1, keepdim=True))                   # [Hq, S]
            full = torch.einsum("hs,hsd->hd", weights, v) / weights.sum(-1, keepdim=True)
            # Newest-first cumulative sums: index n - 1 holds the newest n tokens.
            mass = torch.cumsum(weights.flip(-1), -1)
            weighted = torch.cumsum((weights[..., None] * v).flip(1), 1)
            window = torch.clamp(torch.ceil(fractions * seqlen).long(), 0, seqlen)
            for sink in sink_tokens:
                kept = min(sink, seqlen)             # a sink past the sequence keeps all of it
                # The window never re-counts sink tokens: at most seqlen - kept newest tokens.
                newest = torch.clamp(window, max=seqlen - kept)
                index = (newest - 1).clamp(min=0)
                win_mass = torch.where(newest > 0, mass[:, index], 0.0) + weights[:, :kept].sum(-1, keepdim=True)
                win_value = (torch.where((newest > 0)[None, :, None], weighted[:, index], 0.0)
                             + (weights[:, :kept, None] * v[:, :kept]).sum(1, keepdim=True))
                output = win_value / win_mass.clamp(min=1e-300)[..., None]
                error = torch.linalg.vector_norm(output - full[:, None], dim=-1) / \
                    torch.linalg.vector_norm(full, dim=-1, keepdim=True).clamp(min=1e-30)
                error = torch.where(win_mass > 0, error, torch.ones_like(error))              # nothing loaded
                per_sequence[sink].append(error.cpu())
                loaded[sink].append(((newest + kept).double() / seqlen).cpu())
        for sink in sink_tokens:
            values = torch.cat(per_sequence[sink])
            label = "recent" if sink == 0 else f"sink{sink}+recent"
            share = torch.stack(loaded[sink]).mean(0)
            for row, f in zip(_quantile_rows(values, fractions, layer=call.layer, window=label), share.tolist()):
                row["loaded_fraction"] = f
                rows.append(row)
    return pd.DataFrame(rows)
