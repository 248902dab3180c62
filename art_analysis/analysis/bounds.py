"""The truncation error of a stopped walk, and bounds on it.

If the walk stops after step ``t``, ``R`` is the set of unvisited tokens, ``rho_R`` their share
of the softmax mass and ``Obar_R`` their softmax-weighted mean value, then exactly (DESIGN §5)::

    O_full - O^(t) = rho_R (Obar_R - O^(t))
    ||O_full - O^(t)|| <= rho_R (||Obar_R|| + ||O^(t)||) <= rho_R (max_{j in R} ||v_j|| + ||O^(t)||)

The last form needs only ``rho_R``.  ``rho_R`` itself is unknown at run time, but Quest-style
per-block key bounds make it certifiable: every unvisited score is at most
``u_b = sm_scale * sum_i max(q_i kmax_{b,i}, q_i kmin_{b,i})``, so with the kernel's running
max ``m_t`` and sum ``l_t``::

    l_R <= sum_{b in R} n_b exp(u_b - m_t),    rho_R <= l_R / (l_t + l_R)

which gives a **certified** bound computable from the visited state and per-block key
min/max alone.  :func:`truncation_report` evaluates every term from the raw cache in float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import pandas as pd
import torch

from ..blockwise import BlockTrace, check_decode_call
from ..checks import check_rows, valid_token_mask
from ..policies.quest import block_score_bounds
from ..termination import ARTConfig, FixedBudget, MassCoverage, Rule, art_or_default, stop
from .inputs import decode_inputs

# A bound "holds" when error <= bound * (1 + BOUND_RTOL) + BOUND_ATOL: float64 rounding only.
BOUND_RTOL = 1e-9
BOUND_ATOL = 1e-12
BOUNDS = ("bound_mean", "bound_max_value", "bound_certified")


@dataclass
class TruncationReport:
    """All ``[B, Hq]`` float64.

    Attributes:
        error: ``||O_full - O^(t)||``.
        identity_residual: ``||(O_full - O^(t)) - rho_R (Obar_R - O^(t))||`` (rounding only).
        rho: ``rho_R``, the unvisited share of the softmax mass.
        bound_mean: ``rho_R (||Obar_R|| + ||O^(t)||)``.
        bound_max_value: ``rho_R (max_R ||v_j|| + ||O^(t)||)``.
        rho_certified: the key-bound upper estimate of ``rho_R``.
        bound_certified: ``rho_certified (max_R ||v_j|| + ||O^(t)||)``.
    """

    error: torch.Tensor
    identity_residual: torch.Tensor
    rho: torch.Tensor
    bound_mean: torch.Tensor
    bound_max_value: torch.Tensor
    rho_certified: torch.Tensor
    bound_certified: torch.Tensor


def truncation_report(trace: BlockTrace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      stop_step: torch.Tensor, cache_seqlens: torch.Tensor | None = None) -> TruncationReport:
    """Truncation error and bounds for a walk stopped at ``stop_step``.

    Args:
        trace: the trace of ``q, k, v`` (any mode; the visited state is read at ``stop_step``).
        q: ``[B, Hq, D]``; k, v: ``[B, Hkv, S, D]``: the inputs that produced ``trace``.
        stop_step: ``[B, Hq]`` last visited step (e.g. ``stop(trace, rule).stop_step``).
        cache_seqlens: ``[B]`` as given to the simulator.
    """
    if not isinstance(trace, BlockTrace):
        raise TypeError(f"trace must be the BlockTrace of q, k, v (blockwise_attention), got {type(trace).__name__}")
    seqlens, _ = check_decode_call(q, k, v, cache_seqlens, trace.sm_scale)
    batch, kv_heads, seqlen, dim = k.shape
    group = trace.group_size
    if tuple(q.shape) != tuple(trace.final_out.shape) or (batch, kv_heads * group, dim) != tuple(q.shape):
        raise ValueError(f"q must be the trace's [B, Hq, D]={tuple(trace.final_out.shape)} and k, v its "
                         f"[B, Hq / {group}, S, D], got q {tuple(q.shape)} and k, v {tuple(k.shape)}")
    if not isinstance(stop_step, torch.Tensor) or stop_step.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"stop_step must be an int tensor [B, Hq] of steps, got "
                        f"{stop_step.dtype if isinstance(stop_step, torch.Tensor) else type(stop_step).__name__}")
    if tuple(stop_step.shape) != tuple(trace.final_out.shape[:2]):
        raise ValueError(f"stop_step must be [B, Hq]={tuple(trace.final_out.shape[:2])}, got {tuple(stop_step.shape)}")
    last_steps = (trace.block_ids >= 0).sum(-1).repeat_interleave(group, dim=1) - 1     # [B, Hq]
    if bool(((stop_step < 0) | (stop_step > last_steps.to(stop_step.device))).any()):
        raise ValueError("stop_step must lie within each head's walk: steps 0 to its last step")
    block_size = trace.block_size
    implied = (seqlens[:, None, None] - trace.block_ids.clamp(min=0) * block_size).clamp(0, block_size)
    if not torch.equal(torch.where(trace.block_ids >= 0, implied, 0), trace.block_tokens.to(implied.device)):
        raise ValueError("cache_seqlens must be the lengths the trace was built with (the valid tokens of its "
                         "blocks differ)")
    num_blocks = -(-seqlen // block_size)
    block_of_token = torch.arange(seqlen, device=k.device) // block_size

    # Visited blocks per query head: steps 0..stop_step of its KV head's order.
    ids = trace.block_ids.repeat_interleave(group, dim=1)                         # [B, Hq, T]
    steps = torch.arange(ids.shape[-1], device=ids.device)
    taken = (steps <= stop_step[..., None]) & (ids >= 0)
    visited_blocks = _block_set(ids, taken, num_blocks)
    # Blocks the walk could have visited (selection and length); the rest of R is what it skipped.
    walk_blocks = _block_set(ids, ids >= 0, num_blocks)
    valid = valid_token_mask(seqlens, seqlen)[:, None, :]
    in_walk = walk_blocks[..., block_of_token] & valid                             # [B, Hq, S]
    visited = visited_blocks[..., block_of_token] & in_walk
    unvisited = in_walk & ~visited

    k64 = k.double().repeat_interleave(group, dim=1)
    # Values past the length may be NaN or Inf, which the zero weights there would not cancel.
    v64 = torch.where(valid[..., None], v.double(), 0.0).repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), k64) * trace.sm_scale
    scores = scores.masked_fill(~in_walk, float("-inf"))
    walk_max = torch.gather(trace.running_max.double(), -1, last_steps[..., None].to(scores.device)).squeeze(-1)
    if not torch.allclose(scores.amax(-1), walk_max, rtol=1e-3, atol=1e-3):
        raise ValueError("q, k must be the inputs that produced the trace: their scaled scores' maximum over each "
                         "walk differs from the trace's running maximum")
    weights = torch.softmax(scores, dim=-1)
    full = torch.einsum("bhs,bhsd->bhd", weights, v64)
    rho = (weights * unvisited).sum(-1)
    visited_w = weights * visited
    partial = torch.einsum("bhs,bhsd->bhd", visited_w, v64) / visited_w.sum(-1, keepdim=True)
    unvisited_w = weights * unvisited
    unvisited_mass = unvisited_w.sum(-1, keepdim=True).clamp(min=1e-300)
    mean_unvisited = torch.einsum("bhs,bhsd->bhd", unvisited_w, v64) / unvisited_mass

    error_vec = full - partial
    error = torch.linalg.vector_norm(error_vec, dim=-1)
    residual = torch.linalg.vector_norm(error_vec - rho[..., None] * (mean_unvisited - partial), dim=-1)
    partial_norm = torch.linalg.vector_norm(partial, dim=-1)
    value_norm = torch.linalg.vector_norm(v64, dim=-1).masked_fill(~unvisited, 0.0)
    max_value = value_norm.amax(-1)

    # Certified rho from per-block key min/max (Quest's bound) and the visited running state.
    tokens_unvisited = torch.zeros(batch, kv_heads * group, num_blocks, dtype=torch.float64, device=k.device)
    tokens_unvisited.scatter_add_(-1, block_of_token.expand_as(unvisited), unvisited.double())
    upper = block_score_bounds(q, k, v, block_size=block_size, cache_seqlens=seqlens) * trace.sm_scale
    upper = upper.masked_fill(tokens_unvisited == 0, float("-inf"))   # blocks left out add nothing
    index = stop_step[..., None]
    m_t = torch.gather(trace.running_max.double(), -1, index).squeeze(-1)
    l_t = torch.gather(trace.running_sum.double(), -1, index).squeeze(-1)
    bound_mass = (tokens_unvisited * torch.exp(upper - m_t[..., None])).sum(-1)
    rho_certified = bound_mass / (l_t + bound_mass)
    return TruncationReport(error=error, identity_residual=residual, rho=rho,
                            bound_mean=rho * (torch.linalg.vector_norm(mean_unvisited, dim=-1) + partial_norm),
                            bound_max_value=rho * (max_value + partial_norm), rho_certified=rho_certified,
                            bound_certified=rho_certified * (max_value + partial_norm))


def _block_set(ids: torch.Tensor, keep: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``BoolTensor [B, H, num_blocks]`` marking ``ids [B, H, T]`` where ``keep`` holds."""
    marks = torch.zeros(*ids.shape[:2], num_blocks + 1, dtype=torch.bool, device=ids.device)
    marks.scatter_(-1, torch.where(keep, ids, num_blocks), True)
    return marks[..., :num_blocks]


def bound_rules(art: ARTConfig | None = None) -> dict:
    """The stops at which the studies check the bounds (they must hold at any stop): ``art`` (default
    ``ARTConfig()``), the paper's preset, 90% mass coverage and eight blocks."""
    return {"art": art_or_default(art), "art_paper": ARTConfig.paper(), "coverage_0.9": MassCoverage(0.9),
            "fixed_8": FixedBudget(8)}


def bound_table(source, rules: Mapping[str, Rule], *, block_size: int = 64, step: int = -1) -> pd.DataFrame:
    """The truncation error against its bounds at the stops of every rule, one row per query head.

    Args:
        source: a capture, a synthetic cache or decode inputs (:func:`~.inputs.decode_inputs`).
        rules: name -> stopping rule.

    Returns:
        Rows ``(layer, rule, b, head)`` with ``rho, error, identity_residual`` and, for every bound of
        :class:`TruncationReport` (``bound_mean``, ``bound_max_value``, ``bound_certified``), its value
        and ``<bound>_holds`` (``error <= bound`` up to float64 rounding).
    """
    if not isinstance(rules, Mapping):
        raise TypeError(f"rules must map a name to each rule, e.g. bound_rules() or {{'art': ARTConfig()}}; got "
                        f"{type(rules).__name__}")
    if not rules:
        raise ValueError("bound_table needs at least one rule")
    frames = []
    for call in decode_inputs(source, step):
        trace = call.trace(block_size=block_size)
        for name, rule in rules.items():
            report = truncation_report(trace, call.q, call.k, call.v, stop(trace, rule).stop_step, call.cache_seqlens)
            batch, heads = report.error.shape
            columns = dict(layer=call.layer, rule=name, b=torch.arange(batch).repeat_interleave(heads).numpy(),
                           head=torch.arange(heads).repeat(batch).numpy())
            for field in ("rho", "error", "identity_residual", *BOUNDS):
                columns[field] = getattr(report, field).flatten().cpu().numpy()
            for bound in BOUNDS:
                columns[f"{bound}_holds"] = columns["error"] <= columns[bound] * (1 + BOUND_RTOL) + BOUND_ATOL
            frames.append(pd.DataFrame(columns))
    return pd.concat(frames, ignore_index=True)


def bound_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per rule, over the heads of :func:`bound_table`: ``heads``, ``truncated`` (``rho > 0``), mean error,
    the share of heads where each bound holds (must be 1: a failure is a bug), the median tightness
    ``bound / error`` over truncated heads, the worst identity residual, and the share of truncated
    heads whose certified bound is at most 0.05."""
    check_rows(table, ("rule", "rho", "error", "identity_residual", *BOUNDS, *(f"{b}_holds" for b in BOUNDS)),
               "bound_table")
    rows = []
    for rule, group in table.groupby("rule", sort=False):
        truncated = group[group["rho"] > 0]
        row = dict(rule=rule, heads=len(group), truncated=len(truncated), error_mean=group["error"].mean(),
                   identity_residual_max=group["identity_residual"].max())
        for bound in BOUNDS:
            row[f"{bound}_holds"] = group[f"{bound}_holds"].mean()
            row[f"{bound}_tightness_median"] = ((truncated[bound] / truncated["error"].clip(lower=1e-300)).median()
                                                if len(truncated) else float("nan"))
        row["certified_le_0_05"] = ((truncated["bound_certified"] <= 0.05).mean() if len(truncated)
                                    else float("nan"))
        rows.append(row)
    return pd.DataFrame(rows)


BOUND_COLUMNS = ("rule", "heads", "truncated", "error_mean", "bound_mean_holds", "bound_max_value_holds",
                 "bound_certified_holds", "bound_mean_tightness_median", "certified_le_0_05")
BOUND_FORMATS = {"error_mean": ".2e", "bound_mean_holds": ".3f", "bound_max_value_holds": ".3f",
                 "bound_certified_holds": ".3f", "bound_mean_tightness_median": ".2f", "certified_le_0_05": ".3f"}
