"""On-device FlexPrefill estimation: representative attention in Triton, selection in batched torch.

No host synchronisation (no ``.item()``, ``torch.unique`` or histograms) and no loop over heads:
every decision is a batched tensor operation over ``[B, Hq, ...]``.  It implements exactly the
rules of ``art_analysis.flexprefill.select_blocks`` (the readable reference the tests hold it
to); see that module for the algorithm and for the upstream quirk flags.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kernels.flexprefill_estimate_kernel import representative_line_sums_kernel, representative_row_stats_kernel
from kernels.prefill_checks import check_prefill_inputs, check_selection_params


@dataclass
class FlexPrefillEstimate:
    """Result of :func:`estimate_block_mask`.

    Attributes:
        block_mask: ``[B, Hq, nb, nb]`` bool, block-causal.
        pattern: ``[B, Hq]`` long, 1 = query-aware, 0 = vertical-slash.
        js_distance: ``[B, Hq]`` float32.
        budgets: ``[B, Hq, 2]`` long, vertical and slash budgets in blocks.
        lines: ``[B, Hq, 2, N]`` float32, the normalised vertical and slash vectors.
    """

    block_mask: torch.Tensor
    pattern: torch.Tensor
    js_distance: torch.Tensor
    budgets: torch.Tensor
    lines: torch.Tensor


def _launch_config(rows: int, head_dim: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_N, num_warps) for the representative-attention kernels.

    ``BLOCK_N == ROWS`` keeps the shear width ``ROWS + BLOCK_N`` a power of two.
    """
    row_tile = max(16, min(64, triton.next_power_of_2(rows)))
    return row_tile, row_tile, 4 if head_dim <= 64 else 8


def representative_lines(q: torch.Tensor, k: torch.Tensor, *, block_size: int, sm_scale: float,
                         keys_per_program: int = 4096) -> torch.Tensor:
    """``[B, Hq, 2, N]`` float32: vertical (column) and slash (distance) sums of the last
    ``min(block_size, N)`` queries' causal softmax, divided by the row count."""
    b, hq, n, d = q.shape
    rows = min(block_size, n)
    row_tile, block_n, num_warps = _launch_config(rows, d)
    per_program = max(block_n, keys_per_program // block_n * block_n)
    chunks = triton.cdiv(n, per_program)
    grid = (chunks, triton.cdiv(rows, row_tile), b * hq)
    qk_scale = sm_scale * math.log2(math.e)
    shared = (qk_scale, n, rows, hq, hq // k.shape[1], per_program, *q.stride(), *k.stride())

    row_max = torch.empty(b, hq, chunks, rows, dtype=torch.float32, device=q.device)
    row_sum = torch.empty_like(row_max)
    representative_row_stats_kernel[grid](q, k, row_max, row_sum, *shared, *row_max.stride(),
                                          HEAD_DIM=d, ROWS=row_tile, BLOCK_N=block_n, num_warps=num_warps)
    top = row_max.amax(dim=2)
    lse2 = (top + torch.log2((row_sum * torch.exp2(row_max - top[:, :, None])).sum(dim=2))).contiguous()

    lines = torch.zeros(2, b, hq, n, dtype=torch.float32, device=q.device)
    representative_line_sums_kernel[grid](q, k, lse2, lines[0], lines[1], *shared, *lse2.stride(),
                                          *lines[0].stride(), HEAD_DIM=d, ROWS=row_tile, BLOCK_N=block_n,
                                          num_warps=num_warps)
    return lines.permute(1, 2, 0, 3) / rows


def _pool(x: torch.Tensor, block_size: int, dim: int) -> torch.Tensor:
    """Sum over consecutive ``block_size`` entries of ``dim`` (zero-padded), accumulated in float32."""
    n = x.shape[dim]
    nb = -(-n // block_size)
    if nb * block_size != n:
        pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, nb * block_size - n]
        x = torch.nn.functional.pad(x, pad)
    return x.unflatten(dim, (nb, block_size)).sum(dim=dim % x.dim() + 1, dtype=torch.float32)


def _token_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, H, N, D] -> [B, H, nb, D]`` float32 block means over valid tokens."""
    n = x.shape[2]
    valid = torch.full((n,), 1.0, device=x.device)
    return _pool(x, block_size, 2) / _pool(valid, block_size, 0)[:, None]


def _keep_best(scores: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Bool mask of the ``budget[...]`` largest entries along the last dim (ties: lower index first)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    taken = torch.arange(scores.shape[-1], device=scores.device) < budget[..., None]
    return torch.zeros_like(taken).scatter_(-1, order, taken)


def _cover(mass: torch.Tensor, gamma: float) -> torch.Tensor:
    """Fewest largest entries of normalised ``mass [..., n]`` that reach ``gamma`` (capped at n)."""
    reached = mass.sort(dim=-1, descending=True).values.cumsum(dim=-1) >= gamma
    first = torch.where(reached.any(dim=-1), reached.int().argmax(dim=-1) + 1, mass.shape[-1])
    return first


def _grouped_logits(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``rows [B, Hq, M, D]`` x ``keys [B, Hkv, C, D]`` -> ``[B, Hq, M, C]``."""
    b, hq, m, d = rows.shape
    return (rows.view(b, keys.shape[1], -1, d) @ keys.transpose(-1, -2)).view(b, hq, m, keys.shape[2])


def estimate_block_mask(q: torch.Tensor, k: torch.Tensor, *, gamma: float = 0.9, tau: float = 0.1,
                        block_size: int = 128, min_budget: int = 1024, max_budget: int | None = None,
                        sm_scale: float | None = None, budget_divisor: int | None = None,
                        union_vs_for_query_aware: bool = False, js_eps: float | None = 1e-10,
                        keys_per_program: int = 4096) -> FlexPrefillEstimate:
    """FlexPrefill's block selection on the device (arguments as ``select_blocks``).

    Args:
        q: ``[B, Hq, N, D]``; k: ``[B, Hkv, N, D]`` (fp16/bf16 on CUDA, or any float under the
            Triton interpreter).
    """
    check_prefill_inputs(q, k)
    check_selection_params(gamma, tau, block_size, min_budget, max_budget, budget_divisor, js_eps)
    b, hq, n, d = q.shape
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    nb = -(-n // block_size)
    divisor = block_size if budget_divisor is None else budget_divisor
    lowest = min(-(-min_budget // block_size), nb)
    highest = nb if max_budget is None else min(-(-max_budget // block_size), nb)
    blocks = torch.arange(nb, device=q.device)
    causal = blocks[None, :] <= blocks[:, None]

    lines = representative_lines(q, k, block_size=block_size, sm_scale=scale, keys_per_program=keys_per_program)
    line_blocks = _pool(lines, block_size, 3)
    budgets = (torch.div(_cover(lines, gamma) + divisor - 1, divisor, rounding_mode="floor")).clamp(lowest, highest)
    kept_lines = _keep_best(line_blocks, budgets)
    vertical_slash = kept_lines[:, :, 0, None, :] | kept_lines[:, :, 1][..., (blocks[:, None] - blocks[None, :]).clamp(min=0)]

    key_means = _token_means(k, block_size)
    rows = min(block_size, n)
    recent_mean = q[:, :, n - rows:].mean(dim=2, keepdim=True, dtype=torch.float32)
    estimate = torch.softmax(_grouped_logits(recent_mean, key_means)[:, :, 0] * scale, dim=-1)
    truth = line_blocks[:, :, 0]
    middle = 0.5 * (estimate + truth)
    if js_eps is None:
        divergence = (estimate * torch.log(estimate / middle) + truth * torch.log(truth / middle)).sum(dim=-1)
    else:
        log_middle = torch.log(middle + js_eps)
        divergence = (estimate * (torch.log(estimate + js_eps) - log_middle)
                      + truth * (torch.log(truth + js_eps) - log_middle)).sum(dim=-1)
    js = torch.sqrt((0.5 * divergence).clamp(min=0.0))
    query_aware = js < tau

    pooled = torch.softmax((_grouped_logits(_token_means(q, block_size), key_means) * scale)
                           .masked_fill(~causal, float("-inf")), dim=-1)
    flat = pooled.flatten(-2) / pooled.flatten(-2).sum(dim=-1, keepdim=True)
    chosen = _keep_best(flat, _cover(flat, gamma)).view_as(pooled)
    order = pooled.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, blocks.expand_as(order))
    aware = (chosen & (rank < highest)) | (rank < lowest)
    if union_vs_for_query_aware:
        aware = aware | vertical_slash
    forced = (blocks[None, :] == 0) | (blocks[None, :] == blocks[:, None])
    mask = (torch.where(query_aware[..., None, None], aware, vertical_slash) | forced) & causal
    return FlexPrefillEstimate(block_mask=mask, pattern=query_aware.long(), js_distance=js, budgets=budgets,
                               lines=lines)
