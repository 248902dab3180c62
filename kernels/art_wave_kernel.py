"""Triton kernels of the ART *wave*: a pair's first ``W`` traversal steps attended at once, one program per step, and
the ART monitor over them evaluated as scans (``kernels.art_wave`` launches them; ``kernels.art_decode``'s
``wave_steps``).

A walk that stops after ``T`` steps takes ``T`` lone steps in ``art_decode_split_kernel`` however few blocks it reads
(about 1.2 us per 64-token block at ``D = 128``).  The wave reads the first ``W`` blocks of every pair in parallel
and recovers every step's monitor state from the blocks' partial states, so a pair that stops within them (or whose
walk is shorter) ends after one parallel read and two short evaluations; it reads the blocks past its stop too.  A
call told each pair's walk gives each pair its own wave, that walk and an eighth (``_pair_wave_steps``): the steps
past it are read by no kernel, as those past the pair's blocks.

* ``wave_attend_kernel``, grid ``(W, B * Hkv)``: step ``t`` of pair ``bh`` attends its block from an empty state, as
  the walk's first step would (``_attend_block``): the block's score maximum ``m_t [GROUP]`` (unscaled), its
  ``l_t = sum exp(s - m_t)`` and ``a_t = p V [GROUP, D]`` (fp32), into ``part_m``, ``part_l [B * Hkv, GROUP, W]`` and
  ``part_acc [B * Hkv, GROUP, W, D]``.  A step past the pair's blocks, or whose scores are all ``-inf``, stores
  ``m = -inf``, ``l = 0``, ``a = 0``.
* ``wave_monitor_kernel``, grid ``(B * Hkv, GROUP, D / DIM_CHUNK)``: per query head and chunk of its dims, the
  walk's running state after every step, in the frame of its running maximum ``M_t = max(m_0..m_t)`` as the walk
  holds it, by linear-recurrence scans over the steps::

      L_t = alpha_t L_(t-1) + beta_t l_t,   A_t = alpha_t A_(t-1) + beta_t a_t
      alpha_t = exp(M_(t-1) - M_t),  beta_t = exp(m_t - M_t)

  ``A`` (the chunk's dims) overwrites ``part_acc`` (row ``t``: the state after step ``t``); ``M`` goes to
  ``state_m [B * Hkv, GROUP, W]`` and ``L`` (the same in every chunk) to the chunk's rows of ``state_l
  [B * Hkv, GROUP, D / DIM_CHUNK, W]``, and the state before each step is read back from row ``t - 1``.  The walk's
  monitor sums (``art_decode_kernel._probe_sums``) then take every step at once over the chunk's dims, the rows of
  its tiles being the steps, into ``squares`` and ``moved`` (laid out as ``state_l``).  A head's ``[W, D]`` tiles in
  one program took 3,376 sm_90 instructions at ``W = 48``, ``D = 128``, issued one at a time by one warp per
  scheduler (NOTES V88, V89); in chunks of 32 dims, 840 per program (V91).  A wave longer than one tile of steps
  (``kernels.art_wave.WAVE_STEP_TILE``) is scanned a tile at a time, each tile starting from the running maximum,
  total and accumulators after the tile before (they enter through its first step: ``X_t0 = alpha X_(t0-1) +
  beta x_t0``).
* ``wave_finish_kernel``, grid ``(B * Hkv,)``: the chunks' sums added per head and step, and the walk's test
  (``art_decode_kernel._stable_step``) of every step of every head at once: the probe's norm before each step (that
  after the step before, as the walk carries it), then each step's stable test.  A head's stable runs are a running
  maximum of its last unstable step, and its first done step is its stop (none in the wave: ``W + 1``); the pair's
  stop is its last head's (group rule ``all``).  A pair that stops in the wave, or whose whole walk lies in it (it
  then returns the dense output), is *finished*: its ``out [B, Hq, D]`` and ``lse [B, Hq]`` are row ``stop`` of the
  scanned state (``A / L``; ``M * sm_scale + log L``) and ``wave_done [B * Hkv]`` (int32) holds its result steps
  ``stop + 1``; any other pair gets 0 and is walked by ``art_decode_split_kernel`` from its first step.  Tile
  after tile in a long wave, each head's last unstable step carried from one to the next.

The scans sum in another order than the walk, and each block's ``p`` is rounded to the value dtype against the
block's own maximum rather than the running one, so the monitor's values agree with the walk's to rounding.  Where a
step's change lies within rounding of a threshold its test can flip, and the stop can then move by up to
``patience`` steps (an fp16 review: 2 of 480 pairs, by 2, on the diffuse synthetic preset; 0 of 480 in fp32; bf16 on
the GPU: 2 of 1120 off by one, V82).  Readable reference: the simulator's
``mode="kernel"`` replay and ``art_analysis.termination.stop`` (``art_analysis.blockwise``), as for the walk.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .art_decode_kernel import (_attend_block, _inverse_total, _probe_sums, _sequence_length, _stable_step,
                                _step_tiles)

# integer arguments compiled as plain values (as art_decode_split_kernel's UNSPECIALISED_INTS): the thresholds and
# the length
WAVE_UNSPECIALISED_INTS = ("patience", "first_counted", "uniform_len")


@triton.jit
def _pair_wave_steps(num_blocks, wave_steps, pair_walks_ptr, bh, PAIR_WALKS: tl.constexpr,
                     WALK_MARGIN: tl.constexpr, STEP_MULTIPLE: tl.constexpr):
    """The steps of pair ``bh``'s wave: ``min(num_blocks, wave_steps)``, and with ``PAIR_WALKS`` at most the pair's
    own wave, ``kernels.art_wave.told_wave_length`` of its told walk ``pair_walks_ptr [B * Hkv]`` (int32; unused
    otherwise): the walk and ``1 / WALK_MARGIN`` more, rounded up to ``STEP_MULTIPLE``."""
    steps = tl.minimum(num_blocks, wave_steps)
    if PAIR_WALKS:
        walk = tl.load(pair_walks_ptr + bh)
        steps = tl.minimum(steps, tl.cdiv(walk + walk // WALK_MARGIN + 1, STEP_MULTIPLE) * STEP_MULTIPLE)
    return steps


@triton.jit(do_not_specialize=WAVE_UNSPECIALISED_INTS[2:])
def wave_attend_kernel(q_ptr, k_ptr, v_ptr, table_ptr, seqlens_ptr, pair_walks_ptr, part_m_ptr, part_l_ptr,
                       part_acc_ptr, sm_scale, num_kv_heads, uniform_len, wave_steps,
                       stride_qb, stride_qh, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt,
                       stride_table_b,
                       GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                       PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SINK_RECENCY: tl.constexpr,
                       RAGGED: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIR_WALKS: tl.constexpr,
                       WALK_MARGIN: tl.constexpr, STEP_MULTIPLE: tl.constexpr):
    """Grid ``(W, B * Hkv)``: one block's partial state (module docstring).  K and V through pointer loads
    (``strides`` as ``art_decode_split_kernel``'s; ``table_ptr [B, max_pages]`` on the paged layout);
    ``pair_walks_ptr`` as :func:`_pair_wave_steps`'."""
    step = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_kv_heads
    kv_head = bh % num_kv_heads
    seqlen = _sequence_length(seqlens_ptr, b, uniform_len, RAGGED)
    num_blocks = tl.cdiv(seqlen, BLOCK_N)
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < GROUP
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    if step < _pair_wave_steps(num_blocks, wave_steps, pair_walks_ptr, bh, PAIR_WALKS, WALK_MARGIN, STEP_MULTIPLE):
        heads = kv_head * GROUP + rows
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads.to(tl.int64)[:, None] * stride_qh + dims[None, :],
                    mask=row_valid[:, None], other=0.0)
        valids, ks, vs = _step_tiles(step, num_blocks, b, kv_head, seqlen, k_ptr, v_ptr, table_ptr, stride_table_b,
                                     PAGE_SIZE, stride_k0, stride_kh, stride_kt, stride_v0, stride_vh, stride_vt,
                                     BLOCK_N, HEAD_DIM, SINK_RECENCY, PAGED, "pointers", True)
        m, l, acc = _attend_block(q, m, l, acc, ks, vs, valids, sm_scale * 1.4426950408889634, DOT_PRECISION, True)
        # a block whose scores are all -inf (an infinite key) adds nothing where the walk has a finite maximum, but
        # from an empty state its exp(-inf - -inf) is NaN: its partial state is the empty one
        blank = m == float("-inf")
        l = tl.where(blank, 0.0, l)
        acc = tl.where(blank[:, None], 0.0, acc)
    slots = (bh.to(tl.int64) * GROUP + rows) * wave_steps + step
    tl.store(part_m_ptr + slots, m, mask=row_valid)
    tl.store(part_l_ptr + slots, l, mask=row_valid)
    tl.store(part_acc_ptr + slots[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _linear_recurrence(alpha_a, x_a, alpha_b, x_b):
    """Combine of the scan of ``X_t = alpha_t X_(t-1) + x_t``: ``a`` then ``b``."""
    return alpha_a * alpha_b, alpha_b * x_a + x_b


@triton.jit
def _frame_weights(m, m_before, t, in_wave, score_log2, floor, CARRY: tl.constexpr):
    """``(M, alpha, beta)`` over the steps ``t [BLOCK_W]`` of one head (module docstring) from the blocks' maxima
    ``m`` and those of the step before ``m_before`` (``-inf`` outside the wave and before the first step): the running
    maximum and the rescalings of the previous state and of each block; a step outside the wave keeps the state
    (``alpha = 1``, ``beta = 0``).  With ``CARRY`` the steps follow earlier ones whose running maximum is ``floor``."""
    running = tl.associative_scan(m, 0, _maximum)
    before = tl.associative_scan(m_before, 0, _maximum)
    if CARRY:
        running = tl.maximum(running, floor)
        before = tl.maximum(before, floor)
    alpha = tl.where((t == 0) | ~in_wave, 1.0, tl.exp2((before - running) * score_log2))
    beta = tl.where(in_wave, tl.exp2((m - running) * score_log2), 0.0)
    return running, alpha, beta


@triton.jit
def _monitor_steps(part_m_ptr, part_l_ptr, part_acc_ptr, state_m_ptr, state_l_ptr, squares_ptr, moved_ptr,
                   head_row, chunk, wave_steps, steps, first_step, dims, score_log2, carry_m, carry_l, carry_acc,
                   BLOCK_W: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_CHUNK: tl.constexpr, PROBE_OUTPUT: tl.constexpr,
                   PROBE_MMA: tl.constexpr, USE_DIRECTION: tl.constexpr, CARRY: tl.constexpr):
    """The scanned states and the monitor's sums of one head's ``BLOCK_W`` steps from ``first_step`` over the dims
    ``dims [DIM_CHUNK]`` (``wave_monitor_kernel``); with ``CARRY``, after the state of the steps before them (running
    maximum ``carry_m``, total ``carry_l``, accumulators ``carry_acc [DIM_CHUNK]``).  Returns the state after the
    last of these steps in the wave, as that carry."""
    t = first_step + tl.arange(0, BLOCK_W)
    in_wave = t < steps
    slots = head_row * wave_steps + t
    rows = slots[:, None] * HEAD_DIM + dims[None, :]
    own = (head_row * (HEAD_DIM // DIM_CHUNK) + chunk) * wave_steps + t     # this chunk's rows of the sums
    # the blocks' states loaded before any is used (loaded where used, each of the first three loads waited for the
    # one before: four round trips to memory before the barrier below, now two in the sm_90 build)
    m = tl.load(part_m_ptr + slots, mask=in_wave, other=float("-inf"))
    m_before = tl.load(part_m_ptr + slots - 1, mask=in_wave & (t > 0), other=float("-inf"))
    l = tl.load(part_l_ptr + slots, mask=in_wave, other=0.0)
    a = tl.load(part_acc_ptr + rows, mask=in_wave[:, None], other=0.0)
    running, alpha, beta = _frame_weights(m, m_before, t, in_wave, score_log2, carry_m, CARRY)
    weighted_l = beta * l
    weighted_a = beta[:, None] * a
    if CARRY:   # the state before the first of these steps enters through it: X_t0 = alpha X_(t0 - 1) + beta x
        first = t == first_step
        weighted_l += tl.where(first, alpha * carry_l, 0.0)
        weighted_a += tl.where(first[:, None], alpha[:, None] * carry_acc[None, :], 0.0)
    _, total = tl.associative_scan((alpha, weighted_l), 0, _linear_recurrence)
    _, acc = tl.associative_scan((tl.broadcast_to(alpha[:, None], a.shape), weighted_a), 0, _linear_recurrence)
    # the state after each step: the chunk's accumulators in place of the blocks' (no other program reads them), the
    # totals (the same in every chunk) in the chunk's own rows; then the state before each step, from row t - 1
    tl.debug_barrier()       # every thread has read the blocks before any overwrites them
    if chunk == 0:
        tl.store(state_m_ptr + slots, running, mask=in_wave)
    tl.store(state_l_ptr + own, total, mask=in_wave)
    tl.store(part_acc_ptr + rows, acc, mask=in_wave[:, None])
    tl.debug_barrier()
    first = in_wave & (t > 0)
    total_before = tl.load(state_l_ptr + own - 1, mask=first, other=0.0)
    acc_before = tl.load(part_acc_ptr + rows - HEAD_DIM, mask=first[:, None], other=0.0)
    if PROBE_MMA:
        probe_dim = (dims % 8) <= 1
    else:
        probe_dim = dims >= 0
    squares, moved = _probe_sums(acc_before, total_before, acc, total, probe_dim[None, :] & (t[:, None] >= 0),
                                 PROBE_OUTPUT, PROBE_MMA, USE_DIRECTION)
    tl.store(squares_ptr + own, squares, mask=in_wave)
    tl.store(moved_ptr + own, moved, mask=in_wave)
    last = t == tl.minimum(first_step + BLOCK_W, steps) - 1      # one row: the sums below are that row's values
    return (tl.max(tl.where(last, running, float("-inf")), 0), tl.sum(tl.where(last, total, 0.0), 0),
            tl.sum(tl.where(last[:, None], acc, 0.0), 0))


@triton.jit(do_not_specialize=WAVE_UNSPECIALISED_INTS[2:])
def wave_monitor_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, state_m_ptr, state_l_ptr, squares_ptr, moved_ptr,
                        seqlens_ptr, pair_walks_ptr, sm_scale, num_kv_heads, uniform_len, wave_steps,
                        GROUP: tl.constexpr, BLOCK_W: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_CHUNK: tl.constexpr,
                        BLOCK_N: tl.constexpr, RAGGED: tl.constexpr, PROBE_OUTPUT: tl.constexpr,
                        PROBE_MMA: tl.constexpr, USE_DIRECTION: tl.constexpr, STEP_CHUNKS: tl.constexpr,
                        PAIR_WALKS: tl.constexpr, WALK_MARGIN: tl.constexpr, STEP_MULTIPLE: tl.constexpr):
    """Grid ``(B * Hkv, GROUP, HEAD_DIM // DIM_CHUNK)``: one query head's scanned states over one chunk of its dims,
    and the monitor's sums over that chunk (module docstring; the switches as ``art_decode_split_kernel``'s), over
    ``BLOCK_W`` steps at a time where ``STEP_CHUNKS`` (a wave longer than one tile), each after the state the steps
    before it left."""
    bh = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    seqlen = _sequence_length(seqlens_ptr, bh // num_kv_heads, uniform_len, RAGGED)
    steps = _pair_wave_steps(tl.cdiv(seqlen, BLOCK_N), wave_steps, pair_walks_ptr, bh, PAIR_WALKS, WALK_MARGIN,
                             STEP_MULTIPLE)
    dims = chunk * DIM_CHUNK + tl.arange(0, DIM_CHUNK)
    head_row = bh.to(tl.int64) * GROUP + head
    score_log2 = sm_scale * 1.4426950408889634
    carry_acc = tl.zeros([DIM_CHUNK], tl.float32)
    carry_l = tl.sum(carry_acc, 0)
    carry_m = carry_l - float("inf")
    if STEP_CHUNKS:
        for first_step in tl.range(0, steps, BLOCK_W):
            carry_m, carry_l, carry_acc = _monitor_steps(
                part_m_ptr, part_l_ptr, part_acc_ptr, state_m_ptr, state_l_ptr, squares_ptr, moved_ptr, head_row,
                chunk, wave_steps, steps, first_step, dims, score_log2, carry_m, carry_l, carry_acc, BLOCK_W,
                HEAD_DIM, DIM_CHUNK, PROBE_OUTPUT, PROBE_MMA, USE_DIRECTION, True)
    else:
        _monitor_steps(part_m_ptr, part_l_ptr, part_acc_ptr, state_m_ptr, state_l_ptr, squares_ptr, moved_ptr,
                       head_row, chunk, wave_steps, steps, 0, dims, score_log2, carry_m, carry_l, carry_acc, BLOCK_W,
                       HEAD_DIM, DIM_CHUNK, PROBE_OUTPUT, PROBE_MMA, USE_DIRECTION, False)


@triton.jit
def _step_sums(squares_ptr, moved_ptr, state_l_ptr, head_rows, t, valid, wave_steps, CHUNKS: tl.constexpr):
    """The monitor's sums over all dims at the steps ``t [BLOCK_W]`` of the heads ``head_rows [BLOCK_G]``
    (``valid [BLOCK_G, BLOCK_W]``; elsewhere 0): the chunks' sums added in chunk order, and ``1 / l``
    (``_inverse_total`` of chunk 0's totals)."""
    chunk_squares = ()
    chunk_moved = ()
    for chunk in tl.static_range(CHUNKS):      # every load before the first add (no 0 + x to wait on either)
        own = (head_rows[:, None] * CHUNKS + chunk) * wave_steps + t[None, :]
        chunk_squares = chunk_squares + (tl.load(squares_ptr + own, mask=valid, other=0.0),)
        chunk_moved = chunk_moved + (tl.load(moved_ptr + own, mask=valid, other=0.0),)
    total = tl.load(state_l_ptr + head_rows[:, None] * CHUNKS * wave_steps + t[None, :], mask=valid, other=0.0)
    squares = chunk_squares[0]
    moved = chunk_moved[0]
    for chunk in tl.static_range(1, CHUNKS):
        squares += chunk_squares[chunk]
        moved += chunk_moved[chunk]
    return squares, moved, _inverse_total(total)


@triton.jit
def _first_done_steps(squares_ptr, moved_ptr, state_l_ptr, head_rows, head_valid, steps, first_step, carry_unstable,
                      tau, phi, patience, first_counted, wave_steps, BLOCK_W: tl.constexpr, NO_STOP: tl.constexpr,
                      CHUNKS: tl.constexpr, PROBE_OUTPUT: tl.constexpr, RELATIVE: tl.constexpr,
                      USE_SCALE: tl.constexpr, USE_DIRECTION: tl.constexpr, CARRY: tl.constexpr):
    """Each head's first done step ``[BLOCK_G]`` among the ``BLOCK_W`` steps from ``first_step`` (``NO_STOP``: none)
    of the heads ``head_rows`` (``head_valid``): the walk's test (``_stable_step``) of every step at once, the norm
    before each step being the norm after the step before (0 before the first), then the stable runs as a running
    maximum of the last unstable step; with ``CARRY``, after the steps before them, whose last unstable step per head
    is ``carry_unstable [BLOCK_G]`` (-1: none).  Also returns that carry after these steps."""
    t = first_step + tl.arange(0, BLOCK_W)
    in_wave = head_valid[:, None] & (t < steps)[None, :]
    before = in_wave & (t > 0)[None, :]
    steps_2d = tl.broadcast_to(t[None, :], in_wave.shape)
    zeros = tl.zeros(in_wave.shape, tl.int32)
    # both steps' sums loaded before either is used
    squares_before, moved_before, inv_l_before = _step_sums(squares_ptr, moved_ptr, state_l_ptr, head_rows, t - 1,
                                                            before, wave_steps, CHUNKS)
    squares, moved, inv_l = _step_sums(squares_ptr, moved_ptr, state_l_ptr, head_rows, t, in_wave, wave_steps, CHUNKS)
    norm_before, _, _ = _stable_step(squares_before, moved_before, inv_l_before, tl.zeros(in_wave.shape, tl.float32),
                                     zeros, zeros, steps_2d, first_counted, tau, phi, patience, PROBE_OUTPUT, RELATIVE,
                                     USE_SCALE, USE_DIRECTION)
    # each step's stable test (a run counter of 1 from 0), then its stable run: steps since the last unstable one
    _, stable, _ = _stable_step(squares, moved, inv_l, norm_before, zeros, zeros, steps_2d, first_counted, tau, phi,
                                patience, PROBE_OUTPUT, RELATIVE, USE_SCALE, USE_DIRECTION)
    last_unstable = tl.associative_scan(tl.where(stable > 0, -1, steps_2d), 1, _maximum)
    if CARRY:
        last_unstable = tl.maximum(last_unstable, carry_unstable[:, None])
    done = in_wave & (steps_2d - last_unstable >= patience)
    return tl.min(tl.where(done, steps_2d, NO_STOP), 1), tl.max(tl.where(in_wave, last_unstable, -1), 1)


@triton.jit(do_not_specialize=WAVE_UNSPECIALISED_INTS)
def wave_finish_kernel(part_acc_ptr, state_m_ptr, state_l_ptr, squares_ptr, moved_ptr, seqlens_ptr,
                       pair_walks_ptr, out_ptr, lse_ptr, wave_done_ptr, sm_scale, tau, phi, patience, first_counted,
                       num_kv_heads, uniform_len,
                       wave_steps, stride_ob, stride_oh,
                       GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, HEAD_DIM: tl.constexpr,
                       DIM_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, RAGGED: tl.constexpr,
                       PROBE_OUTPUT: tl.constexpr, RELATIVE: tl.constexpr, USE_SCALE: tl.constexpr,
                       USE_DIRECTION: tl.constexpr, STEP_CHUNKS: tl.constexpr, PAIR_WALKS: tl.constexpr,
                       WALK_MARGIN: tl.constexpr, STEP_MULTIPLE: tl.constexpr):
    """Grid ``(B * Hkv,)``: the pair's heads judged, its stop, and its output where the wave finished it (module
    docstring); ``BLOCK_W`` steps at a time where ``STEP_CHUNKS``, each head's stable run carried from one to the
    next.  ``wave_done_ptr [B * Hkv, 2]`` (int32): the pair's result steps (0: not finished) and the blocks its wave
    read."""
    bh = tl.program_id(0)
    b = bh // num_kv_heads
    kv_head = bh % num_kv_heads
    seqlen = _sequence_length(seqlens_ptr, b, uniform_len, RAGGED)
    num_blocks = tl.cdiv(seqlen, BLOCK_N)
    steps = _pair_wave_steps(num_blocks, wave_steps, pair_walks_ptr, bh, PAIR_WALKS, WALK_MARGIN,
                             STEP_MULTIPLE).to(tl.int32)
    chunks: tl.constexpr = HEAD_DIM // DIM_CHUNK
    no_stop: tl.constexpr = (1 << 30) if STEP_CHUNKS else BLOCK_W + 1
    stop = (bh * 0).to(tl.int32)
    for g0 in tl.static_range(0, GROUP, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        valid = g < GROUP
        head_rows = bh.to(tl.int64) * GROUP + g
        carry = tl.full([BLOCK_G], -1, tl.int32)     # no unstable step before the first
        if STEP_CHUNKS:
            first_done = tl.full([BLOCK_G], no_stop, tl.int32)
            for first_step in tl.range(0, steps, BLOCK_W):
                chunk_done, carry = _first_done_steps(squares_ptr, moved_ptr, state_l_ptr, head_rows, valid, steps,
                                                      first_step, carry, tau, phi, patience, first_counted,
                                                      wave_steps, BLOCK_W, no_stop, chunks, PROBE_OUTPUT, RELATIVE,
                                                      USE_SCALE, USE_DIRECTION, True)
                first_done = tl.minimum(first_done, chunk_done)
        else:
            first_done, _ = _first_done_steps(squares_ptr, moved_ptr, state_l_ptr, head_rows, valid, steps, 0,
                                              carry, tau, phi, patience, first_counted, wave_steps, BLOCK_W, no_stop,
                                              chunks, PROBE_OUTPUT, RELATIVE, USE_SCALE, USE_DIRECTION, False)
        stop = tl.maximum(stop, tl.max(tl.where(valid, first_done, 0), 0))
    # a walk that lies in the wave without stopping ends at its last block: the dense output
    finished = (stop < steps) | (steps == num_blocks)
    stop = tl.minimum(stop, steps - 1)
    tl.store(wave_done_ptr + 2 * bh, tl.where(finished, stop + 1, 0))
    tl.store(wave_done_ptr + 2 * bh + 1, steps)
    if finished:
        dims = tl.arange(0, HEAD_DIM)
        for g0 in tl.static_range(0, GROUP, BLOCK_G):
            g = g0 + tl.arange(0, BLOCK_G)
            valid = g < GROUP
            head_rows = bh.to(tl.int64) * GROUP + g
            slots = head_rows * wave_steps + stop
            acc = tl.load(part_acc_ptr + slots[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
            total = tl.load(state_l_ptr + head_rows * chunks * wave_steps + stop, mask=valid, other=0.0)
            running = tl.load(state_m_ptr + slots, mask=valid, other=0.0)
            empty = total == 0.0
            safe = tl.where(empty, 1.0, total)
            heads = (kv_head * GROUP + g).to(tl.int64)
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     (acc / safe[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None])
            tl.store(lse_ptr + b.to(tl.int64) * num_kv_heads * GROUP + heads,
                     tl.where(empty, float("-inf"), running * sm_scale + tl.log(safe)), mask=valid)
