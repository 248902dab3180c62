"""The ART wave's launcher (``kernels.art_wave_kernel``): ``art_decode(..., wave_steps=W)`` runs it before its walk.

:func:`run_wave` attends the first ``W`` traversal steps of every ``(b, kv_head)`` pair at once, evaluates the ART
monitor over them as scans, and writes ``out`` and ``lse`` of every pair it *finishes*: one whose query heads are
all done within the wave (its stop is the walk's), or whose whole walk lies in it.  It returns each pair's result
steps (0: not finished) and the blocks its wave read; ``art_decode_split_kernel`` then walks only the other pairs,
from their first step, so that their blocks in the wave are read twice.  Every pair's wave reads ``min(W, blocks)``
blocks, also past its stop, or with ``pair_walks`` (a call told each pair's walk ``w_p``) ``min(W, W_p, blocks)``
of its own ``W_p = told_wave_length(w_p)``.
A wave of more than ``WAVE_STEP_TILE`` steps (up to ``MAX_WAVE_STEPS``) is judged a tile of steps at a time.
"""
from __future__ import annotations

import torch
import triton

from .art_params import ARTParams
from .art_wave_kernel import wave_attend_kernel, wave_finish_kernel, wave_monitor_kernel

MAX_WAVE_STEPS = 512       # a wave's steps (its scratch: wave_workspace_bytes)
# steps the monitor and the finish take at a time ([W, DIM_CHUNK] fp32 tiles: 91 registers at 128 steps, no spill); a
# longer wave runs them tile after tile, each after the state the tiles before it left (sm_90, Triton 3.9: monitor
# 150 registers, finish 80-96, no spill)
WAVE_STEP_TILE = 128
WAVE_HEADS = 16            # query heads a finishing program writes at once
WAVE_WARPS = 4
# dims of a head per monitor program: its [W, 32] tiles take 840 sm_90 instructions at W = 48 (53 registers), the
# [W, 128] tiles of one program per head 3,376 (255 registers); the finish sums the chunks' sums (NOTES V91)
WAVE_DIM_CHUNK = 32
WAVE_WALK_MARGIN = 8        # a pair told its walk waves over that walk and an eighth more (walks vary call to call),
WAVE_STEP_MULTIPLE = 8      # ... rounded up to a multiple of 8 steps
# the most scratch a told call's wave may take (wave_workspace_bytes): that of the longest told wave before V96, 128
# steps at B = 128, Hq = 32, D = 128 (286 MiB)
TOLD_WAVE_MAX_WORKSPACE = 320 * 2 ** 20


def wave_workspace_bytes(query_heads: int, wave_steps: int, head_dim: int) -> int:
    """Bytes of the scratch :func:`run_wave` takes for ``query_heads`` query heads in all (``B * Hq``) and a wave of
    ``wave_steps`` steps: each step's partial and scanned state (``D + 3`` floats) and the chunks' sums (3 floats
    per ``WAVE_DIM_CHUNK`` dims)."""
    return 4 * query_heads * wave_steps * (head_dim + 3 + 3 * (head_dim // WAVE_DIM_CHUNK))


def told_wave_length(walk: int) -> int:
    """The steps of the wave of a pair told a walk of ``walk`` blocks: that walk and ``1 / WAVE_WALK_MARGIN`` more,
    rounded up to ``WAVE_STEP_MULTIPLE`` steps (the wave kernels' ``_pair_wave_steps``)."""
    return -(-(walk + walk // WAVE_WALK_MARGIN + 1) // WAVE_STEP_MULTIPLE) * WAVE_STEP_MULTIPLE


def run_wave(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, monitor: ARTParams, wave_steps: int,
             block_size: int, order: str, sm_scale: float, kv_heads: int, max_len: int,
             seqlens: torch.Tensor | None, block_table: torch.Tensor | None, pair_walks: torch.Tensor | None,
             strides: tuple[tuple[int, ...], tuple[int, ...]], dot_precision: str, direction: int, block_h: int,
             out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The wave over ``q [B, Hq, D]`` and the cache (contiguous ``[B, Hkv, S, D]``, or paged with ``block_table``):
    writes the finished pairs' ``out [B, Hq, D]`` and ``lse [B, Hq]`` and returns ``wave_done [B * Hkv, 2]`` (int32:
    each pair's result steps where the wave finished it, else 0, and the blocks its wave read).  ``seqlens``: ``[B]``
    lengths where they differ, else every sequence holds ``max_len`` tokens; ``pair_walks``: each pair's told walk
    (``[B, Hkv]`` int32), whose :func:`told_wave_length` bounds its wave, or ``None`` (every pair's is
    ``wave_steps``); ``strides``: K's and V's (``kernels.paged_cache.kv_strides``); ``dot_precision``: the
    attend's ``tl.dot`` input precision, the walk's; ``direction``: the monitor's direction build
    (``kernels.art_decode._direction_build``); ``block_h``: the rows of the attend's dot tile
    (``kernels.art_decode.tile_rows``)."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    pairs = batch * kv_heads
    paged = block_table is not None
    device = q.device
    chunks = head_dim // WAVE_DIM_CHUNK       # D is 64 or 128 (the launcher's HEAD_DIMS)
    part_m = torch.empty(pairs * group * wave_steps, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    state_m = torch.empty_like(part_m)
    part_acc = torch.empty(pairs * group * wave_steps * head_dim, dtype=torch.float32, device=device)
    state_l = torch.empty(pairs * group * chunks * wave_steps, dtype=torch.float32, device=device)
    squares = torch.empty_like(state_l)
    moved = torch.empty_like(state_l)
    wave_done = torch.empty(pairs, 2, dtype=torch.int32, device=device)
    lengths = wave_done if seqlens is None else seqlens       # a placeholder pointer where the lengths agree
    table = block_table if paged else wave_done
    own_waves = pair_walks is not None
    pair_walks = pair_walks if own_waves else wave_done       # a placeholder pointer where every wave is W
    build_args = dict(PAIR_WALKS=own_waves, WALK_MARGIN=WAVE_WALK_MARGIN, STEP_MULTIPLE=WAVE_STEP_MULTIPLE,
                      num_warps=WAVE_WARPS, num_stages=1)
    strides_k, strides_v = strides
    ragged = seqlens is not None
    block_w = triton.next_power_of_2(min(wave_steps, WAVE_STEP_TILE))
    step_chunks = wave_steps > block_w
    probe_output = monitor.probe_source == "output"
    wave_attend_kernel[(wave_steps, pairs)](
        q, k_cache, v_cache, table, lengths, pair_walks, part_m, part_l, part_acc, sm_scale, kv_heads, max_len,
        wave_steps, q.stride(0), q.stride(1), *strides_k, *strides_v, table.stride(0) if paged else 0,
        GROUP=group, BLOCK_H=block_h, BLOCK_N=block_size, HEAD_DIM=head_dim, PAGED=paged,
        PAGE_SIZE=k_cache.shape[1] if paged else 1, SINK_RECENCY=order == "sink_recency", RAGGED=ragged,
        DOT_PRECISION=dot_precision, **build_args)
    wave_monitor_kernel[(pairs, group, chunks)](
        part_m, part_l, part_acc, state_m, state_l, squares, moved, lengths, pair_walks, sm_scale, kv_heads, max_len,
        wave_steps,
        GROUP=group, BLOCK_W=block_w, HEAD_DIM=head_dim, DIM_CHUNK=WAVE_DIM_CHUNK, BLOCK_N=block_size, RAGGED=ragged,
        PROBE_OUTPUT=probe_output, PROBE_MMA=monitor.probe_dims == "mma", USE_DIRECTION=direction,
        STEP_CHUNKS=step_chunks, **build_args)
    wave_finish_kernel[(pairs,)](
        part_acc, state_m, state_l, squares, moved, lengths, pair_walks, out, lse, wave_done, sm_scale,
        float(monitor.tau), float(monitor.phi), int(monitor.patience), max(1, int(monitor.min_steps)), kv_heads,
        max_len, wave_steps,
        out.stride(0), out.stride(1), GROUP=group, BLOCK_G=min(WAVE_HEADS, triton.next_power_of_2(group)),
        BLOCK_W=block_w, HEAD_DIM=head_dim, DIM_CHUNK=WAVE_DIM_CHUNK, BLOCK_N=block_size, RAGGED=ragged,
        PROBE_OUTPUT=probe_output, RELATIVE=monitor.scale == "relative", USE_SCALE=monitor.use_scale,
        USE_DIRECTION=direction, STEP_CHUNKS=step_chunks, **build_args)
    return wave_done
