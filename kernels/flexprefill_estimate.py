"""On-device FlexPrefill estimation: representative attention, vertical-slash selection and the
pattern search in Triton; the query-aware search in Triton around one torch sort.

Up to the pattern decision a call is a fixed sequence of launches (row statistics, their
log-sum-exp, line sums, the lines' block sums, key block means, the JS pattern search), with no
host synchronisation: the host launch cost, not the GPU work, bounded the calls at 32k tokens.
The one synchronisation then reads which heads the pattern search made query-aware, so that the
query-aware search (an ``nb x nb`` map per head, sorted whole) runs for those heads only; most
heads of real models are vertical-slash.  The pattern is copied to pinned host memory and the
vertical-slash selection (one sort of the lines, budgets and kept blocks, the mask) is queued
behind the copy, so the device works on it while the host waits and launches what follows.
It implements the rules of ``art_analysis.flexprefill.select_blocks`` (the
readable reference the tests hold it to; see that module for the algorithm and for the upstream
quirk flags): the block masks are identical except where a coverage sum lands within float
rounding of ``gamma``, since sums are taken in another order (tiled scans on long rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kernels.flexprefill_estimate_kernel import (block_means_kernel, chunk_sums_kernel, js_pattern_kernel,
                                                 line_blocks_kernel, query_aware_rows_kernel, query_aware_select_kernel,
                                                 representative_line_sums_kernel, representative_row_stats_kernel,
                                                 row_lse_kernel, row_ties_kernel, sorted_coverage_kernel,
                                                 vertical_slash_mask_kernel, vertical_slash_select_kernel)
from kernels.int_checks import check_count
from kernels.prefill_checks import check_kernel_tensors, check_prefill_inputs, check_selection_params
from kernels.softmax_scale import softmax_scale


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


LINE_SUMS_CONFIG = {"block_n": None, "split": 2}  # block_n None: 32 keys a step for D <= 64, else 64 (H200 sweep)


def _launch_config(rows: int, head_dim: int) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_N, SPLIT, num_warps) for the representative-attention kernels.

    One program holds all ``R`` rows (``ROWS`` = next power of two, at least 16), as ``SPLIT``
    row tiles of at least 32 rows; the line-sum kernel walks ``BLOCK_N`` keys a step (its shear
    is as wide as the tile), the row-statistics kernel, which has no shear, ``2 * BLOCK_N``.
    """
    row_tile = max(16, triton.next_power_of_2(rows))
    block_n = min(row_tile, LINE_SUMS_CONFIG["block_n"] or (32 if head_dim <= 64 else 64))
    split = LINE_SUMS_CONFIG["split"] if row_tile >= 64 else 1
    return row_tile, block_n, split, 8 if row_tile * head_dim >= 128 * 64 else 4


def _keys_per_program(n: int, heads: int, block_n: int, keys_per_program: int | None) -> int:
    """Keys per program, a multiple of ``2 * block_n``: as given, or the largest of 4096, 2048, ...
    that still gives at least 1024 programs (about 8 per SM on an H200)."""
    step = 2 * block_n
    if keys_per_program is None:
        keys_per_program = 4096
        while keys_per_program > step and heads * triton.cdiv(n, keys_per_program) < 1024:
            keys_per_program //= 2
    return max(step, keys_per_program // step * step)


def representative_lines(q: torch.Tensor, k: torch.Tensor, *, block_size: int, sm_scale: float,
                         keys_per_program: int | None = None) -> torch.Tensor:
    """``[B, Hq, 2, N]`` float32 (contiguous): vertical (column) and slash (distance) sums of the
    last ``min(block_size, N)`` queries' causal softmax, divided by the row count."""
    b, hq, n, d = q.shape
    rows = min(block_size, n)
    row_tile, block_n, split, num_warps = _launch_config(rows, d)
    per_program = _keys_per_program(n, b * hq, block_n, keys_per_program)
    chunks = triton.cdiv(n, per_program)
    hkv = k.shape[1]
    grid = (hq // hkv, chunks, b * hkv)
    qk_scale = sm_scale * math.log2(math.e)
    shared = (qk_scale, n, rows, hkv, hq // hkv, per_program, *q.stride(), *k.stride())

    row_max = torch.empty(b, hq, chunks, rows, dtype=torch.float32, device=q.device)
    row_sum = torch.empty_like(row_max)
    representative_row_stats_kernel[grid](q, k, row_max, row_sum, *shared, *row_max.stride(),
                                          HEAD_DIM=d, ROWS=row_tile, BLOCK_N=2 * block_n, num_warps=num_warps)
    lse2 = torch.empty(b, hq, rows, dtype=torch.float32, device=q.device)
    row_lse_kernel[(b * hq,)](row_max, row_sum, lse2, chunks, rows, math.log2(rows), *row_max.stride(),
                              *lse2.stride(), hq, ROWS=row_tile, CHUNKS=max(1, 4096 // row_tile))

    lines = torch.empty(b, hq, 2, n, dtype=torch.float32, device=q.device)
    lines[:, :, 1].zero_()
    representative_line_sums_kernel[grid](q, k, lse2, lines[:, :, 0], lines[:, :, 1], *shared, *lse2.stride(),
                                          *lines[:, :, 0].stride(), HEAD_DIM=d, ROWS=row_tile, BLOCK_N=block_n,
                                          SPLIT=split, num_warps=num_warps)
    return lines


def _token_means(x: torch.Tensor, block_size: int, heads: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, N, D] -> [B, H, nb, D]`` float32 block means over valid tokens; with ``heads``
    (``[S]`` long, flat indices ``b * H + h``) only those heads, ``[1, S, nb, D]``, read in place."""
    b, h, n, d = x.shape
    all_heads = heads is None
    if all_heads:
        heads = torch.arange(b * h, device=x.device)
    nb = -(-n // block_size)
    out = torch.empty(heads.numel(), nb, d, dtype=torch.float32, device=x.device)
    tile = min(triton.next_power_of_2(block_size), max(16, 16384 // d))
    block_means_kernel[(heads.numel(), nb)](x, heads, out, n, block_size, h, *x.stride(), *out.stride(),
                                            HEAD_DIM=d, TILE=tile)
    return out.view(b, h, nb, d) if all_heads else out[None]


def pooled_lines(lines: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, Hq, 2, nb]`` float32: the block sums of ``lines [B, Hq, 2, N]`` (contiguous)."""
    b, hq, _, n = lines.shape
    nb = -(-n // block_size)
    pooled = torch.empty(b, hq, 2, nb, dtype=torch.float32, device=lines.device)
    block_tokens = triton.next_power_of_2(block_size)
    flat, flat_pooled = lines.view(-1, n), pooled.view(-1, nb)
    line_blocks_kernel[(b * hq * 2,)](flat, flat_pooled, n, nb, block_size, *flat.stride(), *flat_pooled.stride(),
                                      BLOCKS=max(1, 4096 // block_tokens), BLOCK_TOKENS=block_tokens, num_warps=8)
    return pooled


def vertical_slash_blocks(lines: torch.Tensor, pooled: torch.Tensor, *, gamma: float, lowest: int, highest: int,
                          divisor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Budgets and kept blocks of the vertical-slash pattern from ``lines [B, Hq, 2, N]`` and their
    block sums ``pooled [B, Hq, 2, nb]`` (:func:`pooled_lines`; both contiguous).

    Returns the kept columns and diagonals ``[B, Hq, 2, nb]`` int8 and the budgets ``[B, Hq, 2]``
    (blocks).
    """
    b, hq, _, n = lines.shape
    nb = pooled.shape[-1]
    ordered = lines.sort(dim=-1, descending=True).values.view(-1, n)
    kept = torch.empty(b, hq, 2, nb, dtype=torch.int8, device=lines.device)
    budgets = torch.empty(b, hq, 2, dtype=torch.long, device=lines.device)
    flat_pooled, flat_kept = pooled.view(-1, nb), kept.view(-1, nb)
    vertical_slash_select_kernel[(b * hq * 2,)](
        ordered, flat_pooled, flat_kept, budgets.view(-1), n, nb, gamma, divisor, lowest, highest,
        *ordered.stride(), *flat_pooled.stride(), *flat_kept.stride(), 1,
        TILE=min(4096, max(16, triton.next_power_of_2(n))), NB=max(16, triton.next_power_of_2(nb)), num_warps=8)
    return kept, budgets


def js_pattern_distance(q: torch.Tensor, key_means: torch.Tensor, truth: torch.Tensor, *, rows: int, scale: float,
                        tau: float, js_eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """JS distance ``[B, Hq]`` between ``softmax(mean(last rows of q) . key_means^T * scale)`` and
    ``truth [B, Hq, nb]``, and the pattern ``[B, Hq]`` long (1 = query-aware: distance < tau)."""
    b, hq, n, d = q.shape
    nb = key_means.shape[2]
    js = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    pattern = torch.empty(b, hq, dtype=torch.long, device=q.device)
    js_pattern_kernel[(b * hq,)](q, key_means, truth, js, pattern, n, rows, nb, hq, hq // key_means.shape[1], scale,
                                 tau, 0.0 if js_eps is None else js_eps, *q.stride(), *key_means.stride(),
                                 *truth.stride(), HEAD_DIM=d, ROW_TILE=32, BLOCK_TILE=max(16, 8192 // d),
                                 USE_EPS=js_eps is not None)
    return js, pattern


def vertical_slash_mask(kept: torch.Tensor) -> torch.Tensor:
    """``[B, Hq, nb, nb]`` bool: kept columns and diagonals (``kept [B, Hq, 2, nb]``) spread over
    the rows, plus block 0 and the diagonal block, block-causal."""
    b, hq, _, nb = kept.shape
    mask = torch.empty(b, hq, nb, nb, dtype=torch.bool, device=kept.device)
    bytes_ = mask.view(torch.uint8)
    vertical_slash_mask_kernel[(nb, b * hq)](kept, bytes_, nb, hq, *kept.stride(), *bytes_.stride(),
                                             TILE=min(1024, max(16, triton.next_power_of_2(nb))))
    return mask


def query_aware_blocks(query_means: torch.Tensor, key_means: torch.Tensor, *, gamma: float, scale: float,
                       lowest: int, highest: int) -> torch.Tensor:
    """Query-aware tiles ``[B, Hq, nb, nb]`` (block-causal, with block 0 and the diagonal block)
    from block-mean queries ``[B, Hq, nb, D]`` and keys ``[B, Hkv, nb, D]`` (float32).

    The flat coverage over each head's normalised ``nb x nb`` map takes one sort: the running sum
    of the sorted map gives the count and its last value ``kth``; the tiles above ``kth`` are in,
    and of those equal to it the first ``count - #above`` in row-major order (a stable descending
    sort's prefix), ranked from per-row tie counts.
    """
    b, hq, nb, d = query_means.shape
    heads = b * hq
    capped = highest < nb
    pooled = torch.empty(b, hq, nb, nb, dtype=torch.float32, device=query_means.device)
    limits = torch.empty(1 + capped, b, hq, nb, nb, dtype=torch.uint8, device=query_means.device)
    row_block = max(16, triton.next_power_of_2(nb))
    query_aware_rows_kernel[(nb, heads)](
        query_means, key_means, pooled, limits, nb, hq, hq // key_means.shape[1], scale, lowest, highest,
        *query_means.stride(), *key_means.stride(), *pooled.stride(), limits.stride(0), HEAD_DIM=d,
        BLOCK_TILE=max(16, min(row_block, 8192 // d)), NB=row_block, CAPPED=capped, FEW=lowest <= 16)
    flat = pooled.view(heads, nb * nb)
    flat = flat / flat.sum(dim=-1, keepdim=True)
    ordered = flat.sort(dim=-1, descending=True).values
    tile = min(4096, max(16, triton.next_power_of_2(nb * nb)))
    chunks = triton.cdiv(nb * nb, tile)
    sums = torch.empty(heads, chunks, dtype=torch.float32, device=flat.device)
    chunk_sums_kernel[(heads, chunks)](ordered, sums, nb * nb, *ordered.stride(), *sums.stride(), TILE=tile)
    kth = torch.empty(heads, dtype=torch.float32, device=flat.device)
    need = torch.empty(heads, dtype=torch.int32, device=flat.device)
    sorted_coverage_kernel[(heads,)](ordered, sums, kth, need, nb * nb, chunks, gamma, *ordered.stride(),
                                     *sums.stride(), TILE=tile,
                                     CHUNKS=min(1024, max(16, triton.next_power_of_2(chunks))))
    ties = torch.empty(heads, nb, dtype=torch.int32, device=flat.device)
    flat = flat.view(heads, nb, nb)
    row_ties_kernel[(nb, heads)](flat, kth, ties, nb, *flat.stride(), *ties.stride(), NB=row_block)
    out = torch.empty(b, hq, nb, nb, dtype=torch.bool, device=flat.device)
    query_aware_select_kernel[(nb, heads)](flat, kth, need, ties, limits, out.view(torch.uint8).view(heads, nb, nb),
                                           nb, *flat.stride(), *ties.stride(), limits.stride(0), NB=row_block,
                                           CAPPED=capped)
    return out


def _copy_to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``x`` on the host, and on CUDA the event after which the (asynchronous) copy is complete."""
    if x.device.type != "cuda":
        return x, None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def estimate_block_mask(q: torch.Tensor, k: torch.Tensor, *, gamma: float = 0.9, tau: float = 0.1,
                        block_size: int = 128, min_budget: int = 1024, max_budget: int | None = None,
                        sm_scale: float | None = None, budget_divisor: int | None = None,
                        union_vs_for_query_aware: bool = False, js_eps: float | None = 1e-10,
                        keys_per_program: int | None = None) -> FlexPrefillEstimate:
    """FlexPrefill's block selection on the device (arguments as ``select_blocks``).

    Args:
        q: ``[B, Hq, N, D]``; k: ``[B, Hkv, N, D]`` (fp16/bf16 on CUDA, or any float under the
            Triton interpreter).
    """
    check_prefill_inputs(q, k)
    check_kernel_tensors(("q", q), ("k", k))
    check_selection_params(gamma, tau, block_size, min_budget, max_budget, budget_divisor, js_eps,
                           union_vs_for_query_aware)
    if keys_per_program is not None:
        check_count(keys_per_program, "keys_per_program (or None)", 1)
    n, d = q.shape[2], q.shape[3]
    scale = softmax_scale(sm_scale, d)
    nb = -(-n // block_size)
    lowest = min(-(-min_budget // block_size), nb)
    highest = nb if max_budget is None else min(-(-max_budget // block_size), nb)

    lines = representative_lines(q, k, block_size=block_size, sm_scale=scale, keys_per_program=keys_per_program)
    pooled = pooled_lines(lines, block_size)
    key_means = _token_means(k, block_size)
    js, pattern = js_pattern_distance(q, key_means, pooled[:, :, 0], rows=min(block_size, n), scale=scale, tau=tau,
                                      js_eps=js_eps)
    # the one host synchronisation: which heads are query-aware.  The pattern is copied to the host
    # first, and the vertical-slash selection is queued behind the copy, so the device keeps working
    # while the host waits and then launches the query-aware search.
    pattern_on_host, copied = _copy_to_host(pattern)
    kept, budgets = vertical_slash_blocks(lines, pooled, gamma=gamma, lowest=lowest, highest=highest,
                                          divisor=block_size if budget_divisor is None else budget_divisor)
    mask = vertical_slash_mask(kept)
    if copied is not None:
        copied.synchronize()
    aware_heads = pattern_on_host.flatten().nonzero().squeeze(1)
    if aware_heads.numel():
        # from pinned memory: a copy from pageable memory would wait for the queued selection
        aware_heads = aware_heads.pin_memory().to(q.device, non_blocking=True) if q.is_cuda else aware_heads
        b_idx, h_idx = aware_heads // q.shape[1], aware_heads % q.shape[1]
        group = q.shape[1] // k.shape[1]
        aware = query_aware_blocks(_token_means(q, block_size, aware_heads), key_means[b_idx, h_idx // group][None],
                                   gamma=gamma, scale=scale, lowest=lowest, highest=highest)[0]
        mask[b_idx, h_idx] = aware | mask[b_idx, h_idx] if union_vs_for_query_aware else aware
    return FlexPrefillEstimate(block_mask=mask, pattern=pattern, js_distance=js, budgets=budgets, lines=lines)
