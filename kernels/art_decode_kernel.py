"""Triton split-K flash-decoding kernel with the ART monitor inside the KV loop.

One program serves one ``(b, kv_head, split)``: the query heads of the KV head are packed
into the ``BLOCK_H`` rows of one ``tl.dot`` tile, so every K/V block is loaded once for the
whole GQA group.  The monitor reads the tile's leading ``PROBE_ROWS`` rows: half of them when
the group fits there, since the rest are padding (``kernels.art_decode.tile_rows``).  A split
walks a contiguous range of the traversal *steps* (positions in the order, not token ranges; ``N // splits``
steps, the ``N % splits`` longer ones last), so split 0 holds the head of the order: the sink and the newest
blocks under ``sink_recency``.

Per step ``t`` the block ``j(t)`` (``t`` for ``sequential``; ``0`` then ``nb - t`` for
``sink_recency``) is attended with the FlashAttention-2 online recurrence of the simulator's
``mode="kernel"`` replay (``art_analysis.blockwise``)::

    s = (q @ k_blk^T) * sm_scale        (fp32, invalid tokens -inf)
    m_new = max(m, max s); alpha = exp(m - m_new); p = exp(s - m_new)
    l = alpha l + sum p;  acc = alpha acc + p.to(v.dtype) @ v_blk

with the scale folded into the exponent: ``m`` holds the maximum of the unscaled ``q @ k_blk^T`` and
each ``exp`` is the hardware's ``exp2`` of one FMA (``_attend_block``), the same numbers up to rounding.

With ``ART`` the walk runs in chunks (an inner, software-pipelined loop whose K/V loads do not
depend on the monitor, so they can be issued stages ahead, and are issued for the chunk's steps
only).  Every step evaluates the monitor of ``kernels.art_params`` and latches a per-head *done*
bit.  The leader split (split 0) sizes each chunk to the *horizon*: the fewest steps after which
its whole group can be done (a head that is not done needs ``patience - count`` more stable
steps, counted from ``first_counted``; a shorter chunk is always safe, so it is clamped to
``HORIZON_CAP``).  Its group can therefore be done only at the last step of a chunk: it stops
there, with the state of its stop step, having computed and loaded no block past it, and it
raises the ``(b, kv_head)`` *converged* flag: bit ``CONVERGED`` of the pair's arrival counter (below), so
that the program arriving last learns it from its own arrival.  Follower splits run the same
monitored step with a patience out of reach (their monitor never stops them and is discarded, so
that in a walk that does not stop every program takes the same time per block), in chunks of
``ART_CHUNK`` steps (a rest of their range shorter than two chunks is one chunk), poll that flag after
each chunk and stop too; the combine then ignores them
(see ``kernels.art_decode``).  With ``DEFERRED`` (deferred followers) the followers first wait in
``_await_leader`` until the leader has raised that flag (they walk nothing) or bit ``RELEASED``, which it sets
at the end of a chunk at or past its step ``follow_step`` without being done (its chunks also end there).  With each
such chunk end it publishes, in the same word, where its next chunk ends (the next step at which it can stop), and
a released follower polls at that point of its own walk (``_follower_chunk``): a leader stops within a few steps
of the follow step as often as not, and a follower that polled after a fixed chunk kept walking past it.  The
ranges then cut the walk past the follow step, the leader's holding the steps before it too, and the grid is
``(B * Hkv, splits)`` so that every leader is dispatched before any follower.  With ``PAIR_GATES`` (per-pair
splits, ``kernels.pair_walks``) each pair's expected walk (``walks [B * Hkv]``) decides its ranges: a pair
expected to walk more than ``pair_limit`` blocks is cut as in the leader scheme (followers at once), any other
is the single walk (the leader's range is the whole walk and it writes ``out`` and ``lse`` itself; its followers'
ranges are empty, and none of the pair's programs touches its arrival counter); the grid is then
``(B * Hkv, splits)`` too, so that the leaders are dispatched first and the empty followers after them.  With
``ON_DEMAND`` (on-demand followers, ``release_walks``) the leader's range is the whole walk until it releases its
followers: at the end of a chunk at or past ``follow_step``, once at most ``pair_limit`` of the launch's leaders still
walk alone (a count after the pairs' words in ``pair_words_ptr``, read as the chunk starts), or at or past
``release_step`` whatever the count, it writes its step in its pair's word, sets ``RELEASED`` and ends its range a
share past that step, with the end of its next chunk in the same word (and after each chunk, as a deferred leader
publishes it); the followers wait from the start (``_await_release``), cut the rest of the walk as deferred
followers released at that step would, and poll where the leader's chunks end.  A leader that stops first, or walks
to its end, raises ``CONVERGED`` (its result alone is the pair's); the grid is
``(B * Hkv, splits)``.  With ``LONGEST_FIRST`` (a call told each walk) the pair of each program slot is read from the
launch order (``order [B * Hkv]``, the pairs by expected walk, longest first), so that the longest walks are dispatched
first.

Outputs: with one split the program writes ``out [B, Hq, D]`` (input dtype) and
``lse [B, Hq]`` (fp32) directly; with several it writes its normalised partial output to
``part_out [B, Hq, splits, D]`` and ``part_lse [B, Hq, splits]`` (fp32; ``-inf`` and zeros for
an empty range) and increments the ``(b, kv_head)``'s arrival counter (``arrivals [B * Hkv]``,
zero on entry; arrivals count below ``CONVERGED``, the flag adds ``CONVERGED``); the program that arrives
last merges the group's partials into ``out`` and ``lse`` (``kernels.art_decode_combine.combine_group``)
and resets the word, counter and flag, to 0 (``kernels.art_decode``, *one launch*).  Every program writes
``steps [B, Hkv, splits]`` (int32): the steps whose blocks entered its state (the leader's
stop step + 1 when it stopped), which are the blocks it loaded.  With ``RECORD_KEPT`` each pair's
``kept [B * Hkv]`` (int32) says how many splits entered its output: 1 where one program wrote it (one split, a
pair walked alone) or the last arrival found the converged flag (the leader's result alone), else ``splits``;
the program that writes the output writes it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .art_decode_combine import combine_group


HORIZON_CAP = tl.constexpr(1 << 20)   # the leader's chunks are at most this many steps (ART walks are no longer)
CONVERGED = tl.constexpr(1 << 16)     # the converged flag's bit in an arrival counter (splits are fewer)
RELEASED = tl.constexpr(1 << 17)      # deferred followers: the leader passed the follow step without stopping
RELEASED_FIRST_CHUNK = tl.constexpr(4)  # a released follower's chunk when its leader's next stop is not known
GAVE_UP = tl.constexpr(1 << 18)       # on-demand followers: one stopped waiting before the release (it is then void)
AWAITED = tl.constexpr(CONVERGED.value | RELEASED.value | GAVE_UP.value)  # the bits that end an on-demand wait
CHUNK_HINT_SHIFT = tl.constexpr(19)   # released followers: bits 19-30 of the word hold the leader's chunk end ...
CHUNK_HINT_WALKED = tl.constexpr(4095)  # ... past the release, or this value once the leader walks no further
DIRECTION_OFF = tl.constexpr(0)       # USE_DIRECTION: the monitor's direction test left out (an ablation) ...
DIRECTION_ON = tl.constexpr(1)        # ... in, for 0 < phi <= 1 (the guards of a zero probe and of phi = 0 drop out)
DIRECTION_GUARDED = tl.constexpr(2)   # ... in, for phi = 0 or phi > 1


@triton.jit
def _sequence_length(seqlens_ptr, b, uniform_len, RAGGED: tl.constexpr):
    """Sequence ``b``'s tokens (int64): ``seqlens_ptr[b]`` where the lengths differ, else ``uniform_len``."""
    if RAGGED:
        seqlen = tl.load(seqlens_ptr + b).to(tl.int64)
    else:
        seqlen = uniform_len.to(tl.int64)
    return seqlen


@triton.jit
def _step_block(step, num_blocks, SINK_RECENCY: tl.constexpr):
    """The block that traversal step ``step`` visits: ``step`` in sequential order; under ``sink_recency`` block 0,
    then ``num_blocks - step`` (the newest first)."""
    if SINK_RECENCY:
        block = tl.where(step == 0, 0, num_blocks - step)
    else:
        block = step
    return block


@triton.jit
def _block_rows(step, num_blocks, b, kv_head, seqlen, table_ptr, stride_table_b, PAGE_SIZE: tl.constexpr,
                stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt,
                BLOCK_N: tl.constexpr, SINK_RECENCY: tl.constexpr, PAGED: tl.constexpr):
    """Token validity ``[BLOCK_N]``, int64 row offsets of K and V, a descriptor's coordinates of traversal
    step ``step`` (the leading index: ``b``, or the page of a block within one page; the first row, int32: the
    block's first token, or its first slot in the page)."""
    first = _step_block(step, num_blocks, SINK_RECENCY).to(tl.int64) * BLOCK_N
    pos = first + tl.arange(0, BLOCK_N)
    valid = pos < seqlen
    lead = b
    first_row = first.to(tl.int32)
    if PAGED:
        if PAGE_SIZE % BLOCK_N == 0:
            # the block lies in one page: one page-table entry per step, its rows consecutive slots
            lead = tl.load(table_ptr + b.to(tl.int64) * stride_table_b + first // PAGE_SIZE).to(tl.int32)
            first_row = (first % PAGE_SIZE).to(tl.int32)
            page = lead.to(tl.int64)
            slot = first_row + tl.arange(0, BLOCK_N).to(tl.int64)
        else:
            page = tl.load(table_ptr + b.to(tl.int64) * stride_table_b + pos // PAGE_SIZE, mask=valid, other=0)
            page = page.to(tl.int64)
            slot = pos % PAGE_SIZE
        k_rows = page * stride_k0 + slot * stride_kt + kv_head * stride_kh
        v_rows = page * stride_v0 + slot * stride_vt + kv_head * stride_vh
    else:
        k_rows = b.to(tl.int64) * stride_k0 + kv_head * stride_kh + pos * stride_kt
        v_rows = b.to(tl.int64) * stride_v0 + kv_head * stride_vh + pos * stride_vt
    return valid, k_rows, v_rows, lead, first_row


@triton.jit
def _load_tile(src, rows, valid, lead, first_row, kv_head,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, LOADS: tl.constexpr):
    """The ``[BLOCK_N, D]`` K or V tile of one step (``LOADS``: see ``art_decode_split_kernel``; ``lead``,
    ``first_row``: ``_block_rows``' descriptor coordinates)."""
    if LOADS == "host_descriptors":
        tile = src.load([lead, kv_head, first_row, 0]).reshape(BLOCK_N, HEAD_DIM)
    elif LOADS == "page_descriptors":
        tile = src.load([lead, first_row, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM)
    elif LOADS == "kernel_descriptors":
        tile = src.load([first_row, 0])
    else:
        tile = tl.load(src + rows[:, None] + tl.arange(0, HEAD_DIM)[None, :], mask=valid[:, None], other=0.0)
    return tile


@triton.jit
def _tail_step(seqlen, num_blocks, BLOCK_N: tl.constexpr, SINK_RECENCY: tl.constexpr):
    """The traversal step of the block that holds the last token when the length ends inside it, else -1: the one
    block with tokens past the length.  Page descriptors read a page's slots past the length, which may hold
    anything: their scores are -inf, but p = 0 times a NaN would still reach the output, so that step zeroes them in
    V.  On the page layouts read through descriptors (``PEEL_TAIL`` of ``_dense_walk``, ``_monitored_walk``) the walks
    run it apart from their loops as their one ``MASKED`` step (``_step_tiles``), and the loops' steps, whole blocks,
    take no mask: a select inside a loop takes every step's V tile from shared memory to registers and back, whichever
    branch it takes (``benchmarks/NOTES-art-decode.md``, V32), and the score mask costs a contiguous step 54 to 102
    instructions (V48).  The contiguous layout masks every step: there the unmasked loop measured slower on the H200
    (V48)."""
    if SINK_RECENCY:
        step = tl.where(num_blocks == 1, 0, 1)
    else:
        step = num_blocks - 1
    return tl.where(seqlen % BLOCK_N == 0, -1, step)


@triton.jit
def _subpage_tiles(step, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr, stride_table_b,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SINK_RECENCY: tl.constexpr,
                   MASKED: tl.constexpr):
    """The block of traversal step ``step`` on pages smaller than it (``BLOCK_N`` a multiple of ``PAGE_SIZE``):
    tuples of its ``BLOCK_N // PAGE_SIZE`` pages' token validity ``[PAGE_SIZE]`` and K and V tiles
    ``[PAGE_SIZE, D]``, each tile one bulk copy through a descriptor of the page pool.  A page wholly past the
    length is not looked up in the table (its entry may not exist): page 0 is read in its place, and in the block
    that holds the length (``MASKED``, the one step with such pages) every row of V past it is zeroed, whatever page
    it came from; in any other step every page is looked up unmasked."""
    first = _step_block(step, num_blocks, SINK_RECENCY).to(tl.int64) * BLOCK_N
    entries = table_ptr + b.to(tl.int64) * stride_table_b + first // PAGE_SIZE
    valids = ()
    ks = ()
    vs = ()
    for i in tl.static_range(BLOCK_N // PAGE_SIZE):
        page_first = first + i * PAGE_SIZE
        if MASKED:
            page = tl.load(entries + i, mask=page_first < seqlen, other=0).to(tl.int32)
        else:
            page = tl.load(entries + i).to(tl.int32)
        valid = page_first + tl.arange(0, PAGE_SIZE) < seqlen
        k = k_src.load([page, 0, kv_head, 0]).reshape(PAGE_SIZE, HEAD_DIM)
        v = v_src.load([page, 0, kv_head, 0]).reshape(PAGE_SIZE, HEAD_DIM)
        if MASKED:
            v = tl.where(valid[:, None], v, 0.0)
        valids = valids + (valid,)
        ks = ks + (k,)
        vs = vs + (v,)
    return valids, ks, vs


@triton.jit
def _step_tiles(step, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr, stride_table_b, PAGE_SIZE: tl.constexpr,
                stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SINK_RECENCY: tl.constexpr, PAGED: tl.constexpr,
                LOADS: tl.constexpr, MASKED: tl.constexpr):
    """Token validity and the K and V tiles of traversal step ``step``, as tuples of one ``[BLOCK_N]`` mask and
    ``[BLOCK_N, D]`` tiles, or, with ``LOADS == "subpage_descriptors"``, of each page's (``_subpage_tiles``); all
    taken before the step's scores (``k_src``, ``v_src``: tensor descriptors, one bulk copy per tile with rows
    past the length read as zeros, or base pointers with invalid tokens masked to zeros, as ``LOADS`` says).
    ``MASKED``: the step may hold tokens past the length (``_tail_step``): their scores are -inf, and page
    descriptors' slots past the length are zeroed in V; a step that is not ``MASKED`` must hold a whole block, and
    its scores and page lookups take no mask (only walks read through page descriptors have such steps).
    Taking V here rather than after the softmax keeps the 64-dim multi-split build's MMAs interleaved
    (``benchmarks/NOTES-art-decode.md``, V14)."""
    if LOADS == "subpage_descriptors":
        valids, ks, vs = _subpage_tiles(step, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr, stride_table_b,
                                        PAGE_SIZE, BLOCK_N, HEAD_DIM, SINK_RECENCY, MASKED)
    else:
        valid, k_rows, v_rows, lead, first_row = _block_rows(
            step, num_blocks, b, kv_head, seqlen, table_ptr, stride_table_b, PAGE_SIZE,
            stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt, BLOCK_N, SINK_RECENCY, PAGED)
        k = _load_tile(k_src, k_rows, valid, lead, first_row, kv_head, BLOCK_N, HEAD_DIM, LOADS)
        v = _load_tile(v_src, v_rows, valid, lead, first_row, kv_head, BLOCK_N, HEAD_DIM, LOADS)
        if MASKED and LOADS == "page_descriptors":
            v = tl.where(valid[:, None], v, 0.0)
        valids = (valid,)
        ks = (k,)
        vs = (v,)
    return valids, ks, vs


@triton.jit
def _attend_block(q, m, l, acc, ks, vs, valids, score_log2, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One step of the online softmax over the loaded tiles (``_step_tiles``' tuples ``ks``, ``vs`` of
    ``[N, D]`` tiles, and ``valids`` of ``[N]`` masks, false for invalid tokens, applied in a ``MASKED`` step only):
    returns the new
    ``m [BLOCK_H]``, ``l [BLOCK_H]``, ``acc [BLOCK_H, D]``.  ``m`` is the running maximum of the unscaled scores
    ``q k^T`` and ``score_log2`` is ``sm_scale * log2(e)``: ``exp(sm_scale * (s - m))`` is evaluated as
    ``exp2(s * score_log2 - m * score_log2)``, one FMA and the hardware's ``ex2`` per score.  Several tiles
    (pages smaller than the block) take the block's maximum over all of them before any ``exp``, as one tile
    would; the maximum and ``sum p`` take the tiles elementwise, then one reduction along the rows (one cross-warp
    exchange each, as for one tile), and ``P V`` chains the tiles' products."""
    scores = ()
    for i in tl.static_range(len(ks)):
        s = tl.dot(q, tl.trans(ks[i]), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(valids[i][None, :], s, float("-inf"))
        scores = scores + (s,)
    score_max = scores[0]
    for i in tl.static_range(1, len(ks)):
        score_max = tl.maximum(score_max, scores[i])
    m_new = tl.maximum(m, tl.max(score_max, 1))
    alpha = tl.exp2((m - m_new) * score_log2)
    ps = ()
    for i in tl.static_range(len(ks)):
        ps = ps + (tl.exp2(scores[i] * score_log2 - (m_new * score_log2)[:, None]),)
    p_sum = ps[0]
    for i in tl.static_range(1, len(ks)):
        p_sum = p_sum + ps[i]
    l_new = alpha * l + tl.sum(p_sum, 1)
    acc_new = tl.dot(ps[0].to(vs[0].dtype), vs[0], acc * alpha[:, None], input_precision=DOT_PRECISION)
    for i in tl.static_range(1, len(ks)):
        acc_new = tl.dot(ps[i].to(vs[i].dtype), vs[i], acc_new, input_precision=DOT_PRECISION)
    return m_new, l_new, acc_new


@triton.jit
def _dense_steps(q, m, l, acc, first, last, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr, stride_table_b,
                 PAGE_SIZE: tl.constexpr, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt, score_log2,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SINK_RECENCY: tl.constexpr, PAGED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr, MASKED: tl.constexpr):
    """Steps ``[first, last)`` of the online softmax without a monitor (software-pipelined loads)."""
    for t in tl.range(first, last):
        valids, ks, vs = _step_tiles(t, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr, stride_table_b,
                                     PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt,
                                     BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED, LOADS, MASKED)
        m, l, acc = _attend_block(q, m, l, acc, ks, vs, valids, score_log2, DOT_PRECISION, MASKED)
    return m, l, acc


@triton.jit
def _dense_walk(q, m, l, acc, first, last, tail, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr,
                stride_table_b, PAGE_SIZE: tl.constexpr, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh,
                stride_vt, score_log2, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SINK_RECENCY: tl.constexpr,
                PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr, PEEL_TAIL: tl.constexpr):
    """Steps ``[first, last)`` of the online softmax without a monitor.  With ``PEEL_TAIL`` the step ``tail``
    (``_tail_step``), when in the range, runs between two loops, the one ``MASKED`` step; without, every step is."""
    cut = last
    if PEEL_TAIL:
        cut = tl.where((tail >= first) & (tail < last), tail, last)
    m, l, acc = _dense_steps(q, m, l, acc, first, cut, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr,
                             stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh,
                             stride_vt, score_log2, BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED, DOT_PRECISION, LOADS,
                             not PEEL_TAIL)
    if PEEL_TAIL:
        if cut < last:
            m, l, acc = _dense_steps(q, m, l, acc, cut, cut + 1, num_blocks, b, kv_head, seqlen, k_src, v_src,
                                     table_ptr, stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0,
                                     stride_vh, stride_vt, score_log2, BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED,
                                     DOT_PRECISION, LOADS, True)
            m, l, acc = _dense_steps(q, m, l, acc, cut + 1, last, num_blocks, b, kv_head, seqlen, k_src, v_src,
                                     table_ptr, stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0,
                                     stride_vh, stride_vt, score_log2, BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED,
                                     DOT_PRECISION, LOADS, False)
    return m, l, acc


@triton.jit
def _probe_update(acc_old, l_old, acc_new, l_new, norm_old, count, done, step, first_counted,
                  tau, phi, patience, probe_mask,
                  PROBE_OUTPUT: tl.constexpr, PROBE_MMA: tl.constexpr, RELATIVE: tl.constexpr,
                  USE_SCALE: tl.constexpr, USE_DIRECTION: tl.constexpr):
    """The ART monitor after one step: returns the probe norm, stable-run counter and done bit per head
    (``_probe_sums`` over the rows of ``acc_old``, ``acc_new [rows, D]``, then ``_stable_step``)."""
    inv_l = _inverse_total(l_new)
    squares, moved = _probe_sums(acc_old, l_old, acc_new, l_new, probe_mask, PROBE_OUTPUT, PROBE_MMA, USE_DIRECTION)
    return _stable_step(squares, moved, inv_l, norm_old, count, done, step, first_counted, tau, phi, patience,
                        PROBE_OUTPUT, RELATIVE, USE_SCALE, USE_DIRECTION)


@triton.jit
def _probe_sums(acc_old, l_old, acc_new, l_new, probe_mask, PROBE_OUTPUT: tl.constexpr, PROBE_MMA: tl.constexpr,
                USE_DIRECTION: tl.constexpr):
    """The two sums over the probe's dims that the monitor's test reads, per row of ``acc_old``, ``acc_new
    [rows, D]`` (``l_old``, ``l_new [rows]``): ``|acc_new|^2`` and, with the direction test, the squared change
    ``|x - x_old|^2`` scaled by ``l_new^2`` where the probe is the output (``_stable_step`` applies ``1 / l_new^2``),
    else 0.  The output probe ``x = acc / l`` is never formed: the change is ``acc_new - acc_old * l_new / l_old``
    (one FMA per element), reduced together with ``|acc|^2`` (one cross-warp exchange).  Sums over parts of the
    dims add up to the sums over all of them (the wave's monitor takes them in chunks of ``D``)."""
    square = acc_new * acc_new
    if PROBE_MMA:
        square = tl.where(probe_mask, square, 0.0)
    if USE_DIRECTION:
        if PROBE_OUTPUT:
            # l_new * (x - x_old): one FMA per element, the 1 / l_new^2 applied to the sum
            moved = acc_new - acc_old * (l_new / tl.maximum(l_old, 1e-30))[:, None]
        else:
            moved = acc_new - acc_old
        moved = moved * moved
        if PROBE_MMA:
            moved = tl.where(probe_mask, moved, 0.0)
        squares, moved = tl.split(tl.sum(tl.join(square, moved), 1))
    else:
        squares = tl.sum(square, 1)
        moved = tl.zeros_like(squares)
    return squares, moved


@triton.jit
def _inverse_total(l):
    """``1 / l`` of the softmax totals ``l`` (any shape), as the monitor scales the output probe's sums."""
    return 1.0 / tl.maximum(l, 1e-30)


@triton.jit
def _stable_step(squares, moved, inv_l, norm_old, count, done, step, first_counted, tau, phi, patience,
                 PROBE_OUTPUT: tl.constexpr, RELATIVE: tl.constexpr, USE_SCALE: tl.constexpr,
                 USE_DIRECTION: tl.constexpr):
    """The monitor's test of one step from ``_probe_sums``' sums (any shape, elementwise with ``inv_l``,
    ``norm_old``, ``count``, ``done`` and ``step``; ``inv_l``: ``_inverse_total`` of the step's ``l``, read only where
    the probe is the output): returns the probe norm, stable-run counter and done bit.  Its
    norm is the accumulator's scaled by ``1 / l`` per head where the probe is the output, and the direction test
    uses the simulator's cancellation-free ``1 - cos`` (``art_analysis.termination.one_minus_cos``)::

        d_scale < tau  <=>  |n - n_old| < tau * max(n_old, 1e-30)   (relative; absolute: < tau)
        d_dir   < phi  <=>  |x - x_old|^2 - (n - n_old)^2 < 2 phi n n_old  and  phi > 0   where n n_old > 1e-30
                       <=>  1 < phi                                                    elsewhere (d_dir = 1)

    (``phi > 0``: ``1 - cos`` is never below 0, so a rounding below zero must not pass ``phi = 0``; the simulator
    clamps it at 0.)  ``USE_DIRECTION``: ``DIRECTION_OFF``, ``DIRECTION_ON`` for ``0 < phi <= 1``, where both
    guards are true and drop out (each cost latency-bound walks up to 1 % on an H100), or ``DIRECTION_GUARDED``
    for any other ``phi``.
    """
    if PROBE_OUTPUT and USE_DIRECTION:
        moved = moved * inv_l * inv_l
    norm = tl.sqrt_rn(squares)
    if PROBE_OUTPUT:
        norm = norm * inv_l
    stable = step >= first_counted
    if USE_SCALE:
        change = tl.abs(norm - norm_old)
        if RELATIVE:
            stable = stable & (change < tau * tl.maximum(norm_old, 1e-30))
        else:
            stable = stable & (change < tau)
    if USE_DIRECTION:
        radial = norm - norm_old
        both = norm * norm_old
        if USE_DIRECTION == DIRECTION_GUARDED:
            stable = stable & tl.where(both > 1e-30, (moved - radial * radial < 2.0 * phi * both) & (phi > 0.0),
                                       phi > 1.0)
        else:
            stable = stable & (moved - radial * radial < 2.0 * phi * both) & (both > 1e-30)
    count = tl.where(stable, count + 1, 0)
    done = done | (count >= patience).to(tl.int32)
    return norm, count, done


@triton.jit
def _leading_rows(x, ROWS: tl.constexpr):
    """The first ``ROWS`` rows of ``x``: ``[ROWS, D]`` of a tile ``[BLOCK_H, D]`` or ``[ROWS]`` of a per-row vector
    ``[BLOCK_H]``, ``ROWS`` being ``BLOCK_H`` or half of it (in the MMA layout the two halves are separate
    registers, so the half is taken without a data move).  One return: an early one would not stop the frontend
    from building the reshape below it."""
    if ROWS == x.shape[0]:
        rows = x
    elif len(x.shape) == 1:
        rows = tl.split(tl.permute(tl.reshape(x, (2, ROWS)), (1, 0)))[0]
    else:
        rows = tl.split(tl.permute(tl.reshape(x, (2, ROWS, x.shape[1])), (1, 2, 0)))[0]
    return rows


@triton.jit
def _monitored_steps(q, m, l, acc, norm, count, done, first, last, num_blocks, b, kv_head, seqlen, k_src, v_src,
                     table_ptr, stride_table_b, PAGE_SIZE: tl.constexpr, stride_k0, stride_kh, stride_kt, stride_v0,
                     stride_vh, stride_vt, score_log2, first_counted, tau, phi, patience, probe_mask,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SINK_RECENCY: tl.constexpr, PAGED: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr, PROBE_OUTPUT: tl.constexpr,
                     PROBE_MMA: tl.constexpr, RELATIVE: tl.constexpr, USE_SCALE: tl.constexpr,
                     USE_DIRECTION: tl.constexpr, PROBE_ROWS: tl.constexpr, MASKED: tl.constexpr):
    """Steps ``[first, last)`` of the online softmax, the monitor (``_probe_update``) after each (software-pipelined
    loads): returns ``m``, ``l``, ``acc`` and the monitor's ``norm``, ``count``, ``done``."""
    for t in tl.range(first, last):
        valids, ks, vs = _step_tiles(t, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr, stride_table_b,
                                     PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt,
                                     BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED, LOADS, MASKED)
        m_new, l_new, acc_new = _attend_block(q, m, l, acc, ks, vs, valids, score_log2, DOT_PRECISION, MASKED)
        norm, count, done = _probe_update(
            _leading_rows(acc, PROBE_ROWS), _leading_rows(l, PROBE_ROWS), _leading_rows(acc_new, PROBE_ROWS),
            _leading_rows(l_new, PROBE_ROWS), norm, count, done, t, first_counted, tau, phi, patience,
            probe_mask, PROBE_OUTPUT, PROBE_MMA, RELATIVE, USE_SCALE, USE_DIRECTION)
        m, l, acc = m_new, l_new, acc_new
    return m, l, acc, norm, count, done


@triton.jit
def _monitored_walk(q, m, l, acc, norm, count, done, first, last, tail, num_blocks, b, kv_head, seqlen, k_src, v_src,
                    table_ptr, stride_table_b, PAGE_SIZE: tl.constexpr, stride_k0, stride_kh, stride_kt, stride_v0,
                    stride_vh, stride_vt, score_log2, first_counted, tau, phi, patience, probe_mask,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SINK_RECENCY: tl.constexpr, PAGED: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr, PROBE_OUTPUT: tl.constexpr,
                    PROBE_MMA: tl.constexpr, RELATIVE: tl.constexpr, USE_SCALE: tl.constexpr,
                    USE_DIRECTION: tl.constexpr, PROBE_ROWS: tl.constexpr, PEEL_TAIL: tl.constexpr):
    """Steps ``[first, last)`` with the monitor (``_monitored_steps``), as ``_dense_walk`` runs them without: with
    ``PEEL_TAIL`` the step ``tail`` (``_tail_step``), when in the range, runs between two loops, the one ``MASKED``
    step; without, every step is."""
    cut = last
    if PEEL_TAIL:
        cut = tl.where((tail >= first) & (tail < last), tail, last)
    m, l, acc, norm, count, done = _monitored_steps(
        q, m, l, acc, norm, count, done, first, cut, num_blocks, b, kv_head, seqlen, k_src, v_src, table_ptr,
        stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt, score_log2,
        first_counted, tau, phi, patience, probe_mask, BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED, DOT_PRECISION, LOADS,
        PROBE_OUTPUT, PROBE_MMA, RELATIVE, USE_SCALE, USE_DIRECTION, PROBE_ROWS, not PEEL_TAIL)
    if PEEL_TAIL:
        if cut < last:
            m, l, acc, norm, count, done = _monitored_steps(
                q, m, l, acc, norm, count, done, cut, cut + 1, num_blocks, b, kv_head, seqlen, k_src, v_src,
                table_ptr, stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh,
                stride_vt, score_log2, first_counted, tau, phi, patience, probe_mask, BLOCK_N, HEAD_DIM,
                SINK_RECENCY, PAGED, DOT_PRECISION, LOADS, PROBE_OUTPUT, PROBE_MMA, RELATIVE, USE_SCALE,
                USE_DIRECTION, PROBE_ROWS, True)
            m, l, acc, norm, count, done = _monitored_steps(
                q, m, l, acc, norm, count, done, cut + 1, last, num_blocks, b, kv_head, seqlen, k_src, v_src,
                table_ptr, stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh,
                stride_vt, score_log2, first_counted, tau, phi, patience, probe_mask, BLOCK_N, HEAD_DIM,
                SINK_RECENCY, PAGED, DOT_PRECISION, LOADS, PROBE_OUTPUT, PROBE_MMA, RELATIVE, USE_SCALE,
                USE_DIRECTION, PROBE_ROWS, False)
    return m, l, acc, norm, count, done


@triton.jit
def _read_word(ptr):
    """The arrival counter at ``ptr`` with its flags (int32: the converged flag, and for released followers,
    deferred or on demand, the leader's chunk-end hint), the same value in every warp of the program.

    A scalar ``tl.load`` is issued by every thread, and warps that read it on either side of the
    leader's store would leave the walk at different chunks, so that the program's barriers no
    longer pair up (wrong partial results, or a hang with the descriptor pipeline).  A scalar
    atomic is executed by one thread and broadcast to the program."""
    return tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _await_leader(ptr, max_polls):
    """A deferred follower's wait before its first block: polls the arrival counter at ``ptr`` until the leader
    has raised the converged flag (the follower walks nothing) or released the followers, at most ``max_polls``
    times (then the follower walks its range as an eager one would, so that no program waits without end on a
    leader that is not resident; the result is the same either way).  Returns the last word read (its
    ``CONVERGED`` bit, and the leader's chunk-end hint: ``_follower_chunk``)."""
    word = max_polls * 0
    polls = max_polls * 0
    while ((word & (CONVERGED | RELEASED)) == 0) & (polls < max_polls):
        word = _read_word(ptr)
        polls += 1
    return word


@triton.jit
def _leader_horizon(done, count, step, patience, first_counted, probe_valid):
    """The fewest steps after ``step`` at which the leader's whole group can be done: a head that is not done needs
    ``patience - count`` more stable steps, counted from ``first_counted`` (int32; 0 when every head is done)."""
    need = tl.where(done != 0, 0, tl.minimum(patience, HORIZON_CAP) - count
                    + tl.minimum(tl.maximum(first_counted - step, 0), HORIZON_CAP).to(tl.int32))
    return tl.max(tl.where(probe_valid, need, 0), 0)


@triton.jit
def _fixed_chunk(rest, ART_CHUNK: tl.constexpr):
    """A follower's next chunk (steps) where its leader's chunks are not known: ``ART_CHUNK`` steps, or the whole
    ``rest`` of its range when that is shorter than two chunks (a poll drains the program's pipeline, and it would
    save at most a chunk's blocks there)."""
    return tl.where(rest < 2 * ART_CHUNK, rest, ART_CHUNK)


@triton.jit
def _chunk_end_hint(step, end, leader_horizon, released_at):
    """What a released leader publishes at ``step``, the end of a chunk, for its followers (``_follower_chunk``):
    where its next chunk ends (``leader_horizon`` steps on, within its range ``end``) counted from its release step
    ``released_at`` (at most ``CHUNK_HINT_WALKED - 1``), or ``CHUNK_HINT_WALKED`` once its range is walked (int32)."""
    next_end = tl.minimum(step + leader_horizon, end)
    return tl.where(step < end, tl.minimum(next_end - released_at, CHUNK_HINT_WALKED - 1),
                    CHUNK_HINT_WALKED).to(tl.int32)


@triton.jit
def _follower_chunk(word, walked, rest, ART_CHUNK: tl.constexpr):
    """A released follower's next chunk (steps; deferred or on demand), from the last ``word`` it read of its pair
    and the steps it has ``walked`` since the release: its leader publishes, with its release and each chunk it
    starts after it, that chunk's end counted from the release step (bits ``CHUNK_HINT_SHIFT`` on,
    ``_chunk_end_hint``), and can stop only there; the follower,
    walking at the leader's pace, polls a step after the leader's chunk ends (so that a leader which stopped there
    has raised its flag; the H200 measured a poll at the chunk end itself slower), in ``RELEASED_FIRST_CHUNK``
    steps where that point has passed (the leader has not published its next chunk yet), the whole ``rest`` of its
    range once the leader walks no further (``CHUNK_HINT_WALKED``), and without a hint (a deferred follower that
    stopped waiting before the release, or one past the largest hint the word holds, ``CHUNK_HINT_WALKED - 1``
    steps: walks of over 262k tokens) in ``_fixed_chunk``'s.  The chunks decide only when it polls, never what it
    computes."""
    hint = (word >> CHUNK_HINT_SHIFT) & CHUNK_HINT_WALKED
    ahead = hint - walked
    unhinted = _fixed_chunk(rest, ART_CHUNK)
    hinted = tl.where(ahead >= 0, ahead + 1, tl.where(hint == CHUNK_HINT_WALKED - 1, unhinted, RELEASED_FIRST_CHUNK))
    chunk = tl.where(hint == 0, unhinted, tl.where(hint == CHUNK_HINT_WALKED, rest, hinted))
    return tl.minimum(chunk, rest)


@triton.jit
def _pause(nanoseconds, SLEEP: tl.constexpr):
    """With ``SLEEP``, the thread sleeps about ``nanoseconds`` (``nanosleep``: a waiting program then leaves the
    multiprocessor's issue slots and the atomics' bandwidth to the walks); without it (the CPU interpreter, which runs
    no inline assembly), nothing.  Returns 0."""
    if SLEEP:
        done = tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r", [nanoseconds],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        done = nanoseconds * 0
    return done


@triton.jit
def _await_release(ptr, max_polls, poll_ns, SLEEP: tl.constexpr):
    """An on-demand follower's wait before its first block: polls the arrival counter at ``ptr`` until the leader
    has released the followers (the follower walks its range) or finished alone (bit ``CONVERGED``: it walks
    nothing), at most ``max_polls`` times.  Then it gives up unless the leader has released meanwhile: it sets
    ``GAVE_UP`` by compare-and-swap only while ``RELEASED`` is clear, so a word that holds both was given up first,
    and the leader, whose release returns the word, then walks on alone (no program waits without end on a leader
    that is not resident).  Between polls it sleeps ``poll_ns`` (``_pause``).  Returns the last word read: the
    follower walks where its flags are ``RELEASED`` alone, and the word then holds the leader's first chunk-end hint
    (``_follower_chunk``)."""
    word = max_polls * 0
    polls = max_polls * 0
    while ((word & AWAITED) == 0) & (polls < max_polls):
        word = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        polls += 1
        if (word & AWAITED) == 0:
            polls += _pause(poll_ns, SLEEP)
    if (word & AWAITED) == 0:
        word = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        while (word & AWAITED) == 0:
            seen = tl.atomic_cas(ptr, word, word | GAVE_UP, sem="acq_rel", scope="gpu")
            word = tl.where(seen == word, word | GAVE_UP, seen)
    return word


@triton.jit
def _count_finished(counter_ptr, num_pairs):
    """An on-demand leader that has released its followers or finished alone adds itself to the launch's count
    of such pairs at ``counter_ptr``; the last of ``num_pairs`` puts it back to 0 for the next launch (every leader
    reads it only before its own count)."""
    before = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
    if before == num_pairs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


# Integer arguments compiled as plain values, never specialised (Triton makes an int equal to 1 a constant and marks one
# divisible by 16): the monitor's thresholds, so that a sweep of patience or min_steps reuses one build, and the values
# that change from call to call.
UNSPECIALISED_INTS = ("patience", "first_counted", "uniform_len", "follow_step", "max_gate_polls", "pair_limit",
                      "release_step")


@triton.jit(do_not_specialize=UNSPECIALISED_INTS)
def art_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, seqlens_ptr,
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, steps_ptr, kept_ptr, arrivals_ptr, pair_words_ptr, order_ptr,
        wave_ptr, sm_scale, tau, phi, patience, first_counted,
        num_kv_heads, num_splits, uniform_len, follow_step, max_gate_polls, pair_limit, release_step,
        stride_qb, stride_qh,
        stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt,
        stride_table_b, stride_ob, stride_oh,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGED: tl.constexpr, SINK_RECENCY: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
        ART: tl.constexpr, PROBE_OUTPUT: tl.constexpr, PROBE_MMA: tl.constexpr, RELATIVE: tl.constexpr,
        USE_SCALE: tl.constexpr, USE_DIRECTION: tl.constexpr, ART_CHUNK: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, COMBINE_CHUNK: tl.constexpr,
        RAGGED: tl.constexpr, LOADS: tl.constexpr, PROBE_ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr,
        DEFERRED: tl.constexpr, PAIR_GATES: tl.constexpr, LONGEST_FIRST: tl.constexpr, ON_DEMAND: tl.constexpr,
        PROGRAM_THREADS: tl.constexpr, POLL_NS: tl.constexpr, RECORD_KEPT: tl.constexpr, WAVE: tl.constexpr):
    """Grid ``(splits, B * Hkv)``, or ``(B * Hkv, splits)`` with ``DEFERRED``, ``PAIR_GATES`` or ``ON_DEMAND``.
    See the module docstring for the buffers and the walk; ``follow_step`` and ``max_gate_polls``: the deferred and
    on-demand followers' (``DEFERRED``, ``ON_DEMAND``; unused otherwise).  ``pair_words_ptr`` (int32) and
    ``pair_limit``: with ``PAIR_GATES`` each pair's expected walk (``[B * Hkv]``) and the walk threshold of the
    per-pair splits; with ``ON_DEMAND`` each pair's release step, then the launch's count of pairs whose leader has
    released its followers or finished alone (``[B * Hkv + 1]``, the count zero between launches), and the most
    leaders still walking alone at a release; unused otherwise.  ``release_step``: with ``ON_DEMAND``, the leader's
    step from which it releases its followers whatever that count (``num_blocks`` or more: never).  ``PROGRAM_THREADS``:
    the program's threads (``32 * num_warps``), ``POLL_NS``: an on-demand follower's sleep between polls (0: none, as in
    the CPU interpreter).  ``order_ptr [B * Hkv]`` (int32, ``LONGEST_FIRST``; unused otherwise): the pair each program
    slot serves, the pairs' launch order (``kernels.pair_walks.longest_first``).  ``kept_ptr`` (int32 ``[B * Hkv]``,
    ``RECORD_KEPT``; unused otherwise): the splits that entered each pair's output.  ``WAVE`` (``wave_ptr [B * Hkv, 2]``
    int32; unused otherwise): the call ran the wave first (``kernels.art_wave``), which wrote each pair's result
    steps (0: not finished) and the blocks it read: the programs of a pair it finished leave at once and write no
    output, and every leader counts the wave's blocks in its ``steps``.  Not with
    ``PAIR_GATES`` or ``ON_DEMAND``.

    ``RAGGED``: every sequence's length is read from ``seqlens_ptr [B]``; else all are ``uniform_len``
    (no load before the first K/V loads can be issued).  ``LOADS`` says how K and V tiles are read
    (contiguous layout only for descriptors): ``"pointers"`` (``k_ptr``, ``v_ptr`` base pointers,
    masked), ``"kernel_descriptors"`` (per-sequence ``[seqlen, D]`` descriptors made here) or
    ``"host_descriptors"`` (``k_ptr``, ``v_ptr`` are ``[B, Hkv, uniform_len, D]`` descriptors made by the
    launcher, uniform lengths only) or ``"page_descriptors"`` (paged layout, pages holding whole blocks:
    ``[num_pages, page_size, Hkv, D]`` descriptors made by the launcher, one bulk copy of a block's slots) or
    ``"subpage_descriptors"`` (blocks of whole pages of at least 16 tokens: the same descriptors, one bulk copy
    per page, ``_subpage_tiles``).
    Contiguous descriptor rows past the length read as zeros; a page's slots past it are read and zeroed in V.  The
    step that holds the length is the only one that masks, and the walks run it apart from their loops
    (``_tail_step``).  ``PAGE_SIZE``: tokens
    per page of the paged layout (1 for the contiguous one); a block within one page (``PAGE_SIZE`` a multiple
    of ``BLOCK_N``) takes one page-table entry per step, a block of whole pages read through descriptors one
    entry per page, else each token's row is gathered through its own.  ``PROBE_ROWS``: the
    leading rows of the ``BLOCK_H``-row tile that the monitor reads, ``BLOCK_H // 2`` when the group's
    heads fit in them (the rest is padding; the monitored step then takes 611 instead of 664 instructions
    at ``D = 128``), else ``BLOCK_H``."""
    if DEFERRED or PAIR_GATES or ON_DEMAND:
        # grid (B * Hkv, splits): every leader is dispatched before any follower, one per multiprocessor first,
        # and the followers that wait for them (or, per pair, have nothing to walk) fill the rest
        slot = tl.program_id(0)
        split = tl.program_id(1)
    else:
        split = tl.program_id(0)
        slot = tl.program_id(1)
    if LONGEST_FIRST:
        # the pairs expected to walk longest take the slots dispatched first
        bh = tl.load(order_ptr + slot)
    else:
        bh = slot
    score_log2 = sm_scale * 1.4426950408889634
    b = bh // num_kv_heads
    kv_head = bh % num_kv_heads
    seqlen = _sequence_length(seqlens_ptr, b, uniform_len, RAGGED)
    num_blocks = tl.cdiv(seqlen, BLOCK_N)
    wave_blocks = 0
    if WAVE:
        # a pair the wave finished has its output: its programs leave at once, the leader counting the wave's blocks
        wave_blocks = tl.load(wave_ptr + 2 * bh + 1)
        if tl.load(wave_ptr + 2 * bh) > 0:
            tl.store(steps_ptr + bh.to(tl.int64) * num_splits + split,
                     tl.where(split == 0, wave_blocks, 0).to(tl.int32))
            return
    # page descriptors read a page's slots past the length: the step that holds them runs apart (_tail_step)
    PEEL_TAIL: tl.constexpr = LOADS == "page_descriptors" or LOADS == "subpage_descriptors"
    tail = _tail_step(seqlen, num_blocks, BLOCK_N, SINK_RECENCY)
    # ranges of `num_blocks // num_splits` steps, the `num_blocks % num_splits` longer ones by a step last: the leader,
    # which alone restarts its pipeline where it could first stop, holds one of the shortest.  Deferred followers
    # start once the leader has passed the follow step (`gate`): the ranges then cut the walk past it, and the leader's
    # also holds the steps before it, so that a walk that does not stop ends in every program at once.
    gate = 0
    if DEFERRED:
        # (bounded below too: a gate the compiler cannot prove non-negative serialises the step's MMAs)
        gate = tl.maximum(tl.minimum(follow_step.to(num_blocks.dtype), num_blocks), 0)
    if PAIR_GATES:
        # a pair expected to walk past the threshold takes every split at once, any other is the single walk
        gate = tl.where(tl.load(pair_words_ptr + bh) > pair_limit, 0, num_blocks)
    # released followers: the last word read of the pair (its leader's chunk-end hint, _follower_chunk)
    word = (split * 0).to(tl.int32)
    if ON_DEMAND:
        # the leader walks alone unless it releases its followers; a follower learns its range at the release
        gate = num_blocks
        if split > 0:
            word = _await_release(arrivals_ptr + bh, max_gate_polls, POLL_NS, POLL_NS > 0)
            if (word & AWAITED) == RELEASED:
                gate = tl.atomic_add(pair_words_ptr + bh, 0, sem="relaxed", scope="gpu").to(num_blocks.dtype)
    base = (num_blocks - gate) // num_splits
    longer_from = num_splits - (num_blocks - gate) % num_splits
    start = gate + split * base + tl.maximum(split - longer_from, 0)
    end = start + base + (split >= longer_from).to(base.dtype)
    if DEFERRED or PAIR_GATES or ON_DEMAND:
        start = tl.where(split == 0, 0, start)

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads.to(tl.int64)[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    visited = start * 0
    if LOADS == "kernel_descriptors":
        k_src = tl.make_tensor_descriptor(k_ptr + b.to(tl.int64) * stride_k0 + kv_head.to(tl.int64) * stride_kh,
                                          shape=[seqlen.to(tl.int32), HEAD_DIM], strides=[stride_kt, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_ptr + b.to(tl.int64) * stride_v0 + kv_head.to(tl.int64) * stride_vh,
                                          shape=[seqlen.to(tl.int32), HEAD_DIM], strides=[stride_vt, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
    else:
        k_src, v_src = k_ptr, v_ptr

    if ART:
        if PROBE_MMA:
            probe_dim = (dims % 8) <= 1
        else:
            probe_dim = dims >= 0
        probe_rows = tl.arange(0, PROBE_ROWS)
        probe_valid = probe_rows < GROUP
        probe_mask = probe_dim[None, :] & (probe_rows[:, None] >= 0)
        is_leader = split == 0
        # a follower's heads are never done: no stable run reaches this length
        patience = tl.where(is_leader, patience, 2147483647)
        norm = tl.zeros([PROBE_ROWS], tl.float32)
        count = tl.zeros([PROBE_ROWS], tl.int32)
        done = tl.zeros([PROBE_ROWS], tl.int32)
        group_done = start * 0
        step = start
        # No flag read before the first chunk: its loads would wait for the atomic's round trip, in every
        # program at once at the start of a launch, while a leader cannot have stopped before its followers start
        # in the one wave that the launcher sizes the scheme to (a follower that starts later reads one chunk).
        # Deferred followers wait for their leader before it instead.
        converged = split * 0
        # the leader: the chunk-end hint it last published, and the step of its release (released says whether it
        # has released its followers); its horizon, taken where each chunk ends for the next (computed at each
        # chunk's start as well, the 128-dim on-demand build compiled with serialised MMAs;
        # benchmarks/NOTES-art-decode.md, V57)
        hint_posted = (split * 0).to(tl.int32)
        released_at = gate
        if DEFERRED:
            if not is_leader and start < end:
                word = _await_leader(arrivals_ptr + bh, max_gate_polls)
                converged = ((word & CONVERGED) != 0).to(tl.int32)
        released = split * 0
        num_pairs = tl.num_programs(0)
        go = (step < end) & (converged == 0)
        leader_horizon = _leader_horizon(done, count, step, patience, first_counted, probe_valid)
        while go:
            # The leader's chunk ends at the earliest step at which its whole group can be done (a head that is
            # not done needs `patience - count` more stable steps, counted from `first_counted`), so its stop
            # step is always the last step of a chunk: it never computes or loads a block past it.  Followers
            # poll the flag after chunks of _fixed_chunk's steps.  int32: `count` stays below HORIZON_CAP while the
            # walk runs.
            rest = (end - step).to(tl.int32)
            horizon = tl.where(is_leader, leader_horizon, _fixed_chunk(rest, ART_CHUNK))
            if DEFERRED or ON_DEMAND:
                # the leader's chunk also ends at the follow step, from which it may release the followers.
                # Released followers poll where their leader's chunks end (the leader's hint, _follower_chunk): a
                # leader released there may stop a few steps later
                followed = _follower_chunk(word, (step - start).to(tl.int32), rest, ART_CHUNK)
                horizon = tl.where(is_leader, tl.where(step < follow_step, tl.minimum(horizon, follow_step - step),
                                                       horizon), followed)
            chunk_end = tl.minimum(step + horizon, end)
            if ON_DEMAND:
                # the count of pairs done with their walk alone, read now and used after the chunk: the load's round
                # trip overlaps the chunk's steps.  One element per thread, reduced over all of them after the chunk,
                # so that every warp takes the same decision (warps that read the count on either side of an update
                # would otherwise leave the walk at different chunks, and the program's barriers would not pair up)
                polled = (is_leader & (released == 0) & (chunk_end >= follow_step)).to(tl.int32)
                lanes = tl.arange(0, PROGRAM_THREADS)
                finished_seen = tl.load(pair_words_ptr + num_pairs + lanes * 0, volatile=True,
                                        mask=lanes < PROGRAM_THREADS * polled, other=0)
            # With several splits every program runs the monitored step (a follower's heads are never done
            # and its monitor is discarded), so that in a walk that does not stop all programs take the same
            # time per block and share the bandwidth evenly.  A single-split launch has no followers: its
            # dense branch is never taken, but it stays compiled, because without it the Triton 3.6 build
            # serialises the step's QK^T MMAs (743 instead of 706 instructions per step, single-split ART
            # 19 % slower; benchmarks/NOTES-art-decode.md, V13).
            if is_leader or not SINGLE_SPLIT:
                m, l, acc, norm, count, done = _monitored_walk(
                    q, m, l, acc, norm, count, done, step, chunk_end, tail, num_blocks, b, kv_head, seqlen, k_src,
                    v_src, table_ptr, stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh,
                    stride_vt, score_log2, first_counted, tau, phi, patience, probe_mask, BLOCK_N, HEAD_DIM,
                    SINK_RECENCY, PAGED, DOT_PRECISION, LOADS, PROBE_OUTPUT, PROBE_MMA, RELATIVE, USE_SCALE,
                    USE_DIRECTION, PROBE_ROWS, PEEL_TAIL)
                # (derived from the done bits here, not from the next horizon being 0: that placement compiled
                # the 64-dim multi-split step with serialised MMAs; benchmarks/NOTES-art-decode.md, V14)
                group_done = tl.min(tl.where(probe_valid, done, 1), 0).to(group_done.dtype)
            else:
                m, l, acc = _dense_walk(q, m, l, acc, step, chunk_end, tail, num_blocks, b, kv_head, seqlen, k_src,
                                        v_src, table_ptr, stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt,
                                        stride_v0, stride_vh, stride_vt, score_log2,
                                        BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED, DOT_PRECISION, LOADS, PEEL_TAIL)
            visited += chunk_end - step
            step = chunk_end
            if SINGLE_SPLIT:
                leader_horizon = _leader_horizon(done, count, step, patience, first_counted, probe_valid)
            else:
                # the leader raises the flag and never reads it (its own done bits decide); followers poll it.
                # The leader's add precedes its own arrival on the same word, so the last arrival sees it.
                if is_leader:
                    leader_horizon = _leader_horizon(done, count, step, patience, first_counted, probe_valid)
                    if ON_DEMAND:
                        # a released leader that stops raises the flag here, and one that walks on publishes where
                        # its next chunk ends (_chunk_end_hint); one that walks alone raises the flag after the
                        # walk, stopped or not
                        hint = _chunk_end_hint(step, end, leader_horizon, released_at)
                        tl.atomic_add(arrivals_ptr + bh, tl.where(group_done != 0, CONVERGED,
                                                                  (hint - hint_posted) << CHUNK_HINT_SHIFT),
                                      sem="relaxed", scope="gpu", mask=released != 0)
                        hint_posted = tl.where(released != 0, hint, hint_posted)
                        # past the follow step, with few pairs left walking alone or at the release step: release
                        # the followers over the rest of the walk (the leader keeps a share of it), with the end of
                        # its next chunk in the same word
                        release = ((group_done == 0) & (released == 0) & (step >= follow_step) & (step < num_blocks)
                                   & ((num_pairs - tl.max(finished_seen, 0) <= pair_limit) | (step >= release_step)))
                        if release:
                            tl.store(pair_words_ptr + bh, step.to(tl.int32))
                            tl.debug_barrier()
                            share_end = step + (num_blocks - step) // num_splits
                            hint = _chunk_end_hint(step, share_end, leader_horizon, step)
                            before = tl.atomic_or(arrivals_ptr + bh, (hint << CHUNK_HINT_SHIFT) | RELEASED,
                                                  sem="release", scope="gpu")
                            if (before & GAVE_UP) == 0:
                                released = split * 0 + 1
                                end = share_end
                                released_at = step
                                hint_posted = hint
                                _count_finished(pair_words_ptr + num_pairs, num_pairs)
                    elif DEFERRED:
                        # converged: raise the flag.  Past the follow step without stopping: release the followers
                        # (once), and publish where its next chunk ends, the next step it can stop at, counted from
                        # the follow step, or CHUNK_HINT_WALKED at the end of its range (_follower_chunk); one add
                        walks_on = (group_done == 0) & (step >= follow_step)
                        hint = _chunk_end_hint(step, end, leader_horizon, follow_step)
                        published = ((hint - hint_posted) << CHUNK_HINT_SHIFT) + tl.where(released == 0, RELEASED, 0)
                        tl.atomic_add(arrivals_ptr + bh, tl.where(group_done != 0, CONVERGED, published),
                                      sem="relaxed", scope="gpu", mask=(group_done != 0) | walks_on)
                        hint_posted = tl.where(walks_on, hint, hint_posted)
                        released = tl.where(walks_on, 1, released)
                    else:
                        raise_flag = group_done != 0
                        if PAIR_GATES:
                            raise_flag = raise_flag & (gate < num_blocks)   # a pair walked alone has no followers
                        tl.atomic_add(arrivals_ptr + bh, CONVERGED, sem="relaxed", scope="gpu", mask=raise_flag)
                else:
                    word = _read_word(arrivals_ptr + bh)
                    converged = ((word & CONVERGED) != 0).to(tl.int32)
            go = (step < end) & (group_done == 0) & (converged == 0)
        if ON_DEMAND:
            if is_leader and released == 0:
                # walked alone, to its stop or to the end: its result alone is the pair's
                tl.atomic_or(arrivals_ptr + bh, CONVERGED, sem="relaxed", scope="gpu")
                _count_finished(pair_words_ptr + num_pairs, num_pairs)
    else:
        m, l, acc = _dense_walk(q, m, l, acc, start, end, tail, num_blocks, b, kv_head, seqlen, k_src, v_src,
                                table_ptr, stride_table_b, PAGE_SIZE, stride_k0, stride_kh, stride_kt,
                                stride_v0, stride_vh, stride_vt, score_log2,
                                BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED, DOT_PRECISION, LOADS, PEEL_TAIL)
        visited = end - start

    if WAVE:
        # the leader counts the blocks the wave read for its pair
        visited += tl.where(split == 0, wave_blocks, 0)
    tl.store(steps_ptr + bh.to(tl.int64) * num_splits + split, visited.to(tl.int32))
    _write_result(m, l, acc, sm_scale, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr, kept_ptr,
                  b, kv_head, bh, split, heads, dims, row_valid, num_kv_heads, num_splits, stride_ob, stride_oh,
                  gate, num_blocks, ART, GROUP, BLOCK_G, HEAD_DIM, BLOCK_S, COMBINE_CHUNK, RECORD_KEPT,
                  SINGLE_SPLIT, PAIR_GATES)


@triton.jit
def _write_result(m, l, acc, sm_scale, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr, kept_ptr, b,
                  kv_head, bh, split, heads, dims, row_valid, num_kv_heads, num_splits, stride_ob, stride_oh, gate,
                  num_blocks, ART: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_S: tl.constexpr, COMBINE_CHUNK: tl.constexpr, RECORD_KEPT: tl.constexpr,
                  SINGLE_SPLIT: tl.constexpr, PAIR_GATES: tl.constexpr):
    """A program's result from its state ``m``, ``l``, ``acc``: the output of one split or of a pair walked alone
    (``_store_output``), else its partial and arrival (``_arrive_and_combine``)."""
    # a split that walked nothing has l = 0 and acc = 0: out 0, lse -inf; a NaN among the scores or values gives
    # NaN (out and lse), as in dense attention
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m * sm_scale + tl.log(l_safe))
    if SINGLE_SPLIT:
        _store_output(out_ptr, lse_ptr, kept_ptr, out, lse, b, bh, heads, dims, row_valid, num_kv_heads, stride_ob,
                      stride_oh, GROUP, RECORD_KEPT)
    elif PAIR_GATES:
        # a pair walked alone: its leader writes the output as one split does, and nobody arrives
        if gate == num_blocks:
            if split == 0:
                _store_output(out_ptr, lse_ptr, kept_ptr, out, lse, b, bh, heads, dims, row_valid, num_kv_heads,
                              stride_ob, stride_oh, GROUP, RECORD_KEPT)
        else:
            _arrive_and_combine(out, lse, part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, arrivals_ptr, kept_ptr, b,
                                kv_head, bh, split, heads, dims, row_valid, num_kv_heads, num_splits, stride_ob,
                                stride_oh, ART, GROUP, BLOCK_G, HEAD_DIM, BLOCK_S, COMBINE_CHUNK, RECORD_KEPT)
    else:
        _arrive_and_combine(out, lse, part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, arrivals_ptr, kept_ptr, b, kv_head,
                            bh, split, heads, dims, row_valid, num_kv_heads, num_splits, stride_ob, stride_oh,
                            ART, GROUP, BLOCK_G, HEAD_DIM, BLOCK_S, COMBINE_CHUNK, RECORD_KEPT)


@triton.jit
def _store_output(out_ptr, lse_ptr, kept_ptr, out, lse, b, bh, heads, dims, row_valid, num_kv_heads, stride_ob,
                  stride_oh, GROUP: tl.constexpr, RECORD_KEPT: tl.constexpr):
    """A walk's own result into ``out [B, Hq, D]`` (input dtype) and ``lse [B, Hq]``: one split's, or a pair
    walked alone; with ``RECORD_KEPT``, its one split into ``kept [B * Hkv]``."""
    out_rows = b.to(tl.int64) * stride_ob + heads.to(tl.int64) * stride_oh
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    tl.store(lse_ptr + b.to(tl.int64) * num_kv_heads * GROUP + heads, lse, mask=row_valid)
    if RECORD_KEPT:
        tl.store(kept_ptr + bh.to(tl.int64), 1)


@triton.jit
def _arrive_and_combine(out, lse, part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, arrivals_ptr, kept_ptr, b, kv_head,
                        bh, split, heads, dims, row_valid, num_kv_heads, num_splits, stride_ob, stride_oh,
                        ART: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_S: tl.constexpr, COMBINE_CHUNK: tl.constexpr, RECORD_KEPT: tl.constexpr):
    """One of several splits: its partial into ``part_out`` and ``part_lse``, then its arrival; the last to arrive
    merges the pair's partials into ``out`` and ``lse`` (the leader's alone where it converged) and, with
    ``RECORD_KEPT``, writes how many splits it merged to ``kept [B * Hkv]``."""
    part_rows = (b.to(tl.int64) * num_kv_heads * GROUP + heads) * num_splits + split
    tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])
    tl.store(part_lse_ptr + part_rows, lse, mask=row_valid)
    # Arrival: every thread's partial stores are ordered before the counter increment (CTA
    # barrier, then a gpu-scope release); the program that arrives last acquires the others'
    # partials through the same atomic, merges the group and puts the word (counter and
    # converged flag) back to 0 for the next launch.  Its atomic returns the flag with the count:
    # no second round trip before the combine (a flag word apart cost one; V35).
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + bh, 1, sem="acq_rel", scope="gpu")
    if ART:
        converged = (arrived & CONVERGED) != 0
        arrived = arrived & (CONVERGED - 1)
    if arrived == num_splits - 1:
        kept_splits = num_splits
        if ART:
            kept_splits = tl.where(converged, 1, num_splits)
        combine_group(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, b, kv_head, kept_splits,
                      num_kv_heads, num_splits, stride_ob, stride_oh,
                      GROUP, BLOCK_G, HEAD_DIM, BLOCK_S, COMBINE_CHUNK)
        if RECORD_KEPT:
            tl.store(kept_ptr + bh.to(tl.int64), kept_splits)
        tl.store(arrivals_ptr + bh, 0)
