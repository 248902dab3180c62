"""Triton kernels: FlexPrefill's representative attention, reduced on chip to line sums.

The last ``R = min(block_size, N)`` queries attend causally to all ``N`` keys.  Instead of
materialising the ``[R, N]`` probabilities (2 GiB per call at 128k tokens and 32 heads), two
passes over the keys keep everything in registers.  Each program holds *all* ``R`` rows of one
query head (``ROWS`` = the next power of two) and walks one chunk of keys:

1. :func:`representative_row_stats_kernel`: per row and key chunk, the running max and sum
   of ``exp2`` (base-2 online softmax); the host combines chunks into a row log-sum-exp.
2. :func:`representative_line_sums_kernel`: recomputes each score tile, normalises it with
   the row log-sum-exp, and writes its column sums to ``VERTICAL[j]`` (a plain store: no other
   program holds these keys) and adds its sums along each query-key distance
   ``d = pos_r - j`` to ``SLASH[d]`` (atomics).  The distance sums come from a cyclic shear
   of the ``[ROWS, BLOCK_N]`` tile, ``G[r, e] = P[r, (r - e) mod BLOCK_N]`` (``tl.gather``,
   no wider than the tile): entry ``(r, e)`` has distance ``base + e + BLOCK_N * m`` with
   ``m = floor((r - e) / BLOCK_N)``, so ``ROWS / BLOCK_N + 1`` masked column sums give every
   distance the tile touches.  The rows may be processed as two half tiles (``SPLIT = 2``),
   each sheared by its global row index, so that the sums still combine before reducing.

Grid of both: ``(group, ceil(N / keys_per_program), B * Hkv)``: the query heads that share a
KV head and read the same key chunk are launched next to each other, so K is read from L2.
Addresses: int64 bases per head and tile, int32 offsets inside a tile.  The readable
reference is ``art_analysis.flexprefill.representative_attention``.
"""
import triton
import triton.language as tl


@triton.jit
def _score_tile(q, k_base, key_start, tile_offs, positions, row_ok, seqlen, qk_scale, stride_kn,
                BLOCK_N: tl.constexpr):
    """Scaled (base-2) scores ``[ROWS, BLOCK_N]`` of keys from ``key_start``; invisible ones ``-inf``.

    ``tile_offs`` ``[BLOCK_N, D]`` int32: element offsets inside a key tile (loop-invariant)."""
    offs_n = key_start + tl.arange(0, BLOCK_N)
    k = tl.load(k_base + key_start * stride_kn + tile_offs, mask=offs_n[:, None] < seqlen, other=0.0)
    scores = tl.dot(q, tl.trans(k)) * qk_scale
    visible = (offs_n[None, :] <= positions[:, None]) & row_ok[:, None]
    return tl.where(visible, scores, float("-inf")), offs_n


@triton.jit
def _program_rows(Q, K, seqlen, rows, num_kv_heads, group, stride_qb, stride_qh, stride_qn, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's batch, query head, key chunk, rows (offsets into the R rows), their mask and
    positions, its query rows ``[ROWS, D]``, its KV head's key base pointer and the key-tile offsets."""
    pid_bkv = tl.program_id(2)
    b = (pid_bkv // num_kv_heads).to(tl.int64)
    kv_h = (pid_bkv % num_kv_heads).to(tl.int64)
    h = kv_h * group + tl.program_id(0)
    offs_r = tl.arange(0, ROWS)
    row_ok = offs_r < rows
    positions = (seqlen - rows + offs_r).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + positions[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    tile_offs = tl.arange(0, BLOCK_N)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    return b, h, tl.program_id(1), offs_r, row_ok, positions, q, K + b * stride_kb + kv_h * stride_kh, tile_offs


@triton.jit
def representative_row_stats_kernel(
        Q, K, MAX, SUM, qk_scale, seqlen, rows, num_kv_heads, group, keys_per_program,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_sb, stride_sh, stride_sc, stride_sr,
        HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """MAX, SUM: ``[B, Hq, num_chunks, R]`` float32, base-2 running max and ``sum exp2(s - max)``."""
    b, h, pid_c, offs_r, row_ok, positions, q, k_base, tile_offs = _program_rows(
        Q, K, seqlen, rows, num_kv_heads, group, stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd, HEAD_DIM, ROWS, BLOCK_N)

    start = pid_c.to(tl.int64) * keys_per_program
    end = tl.minimum(start + keys_per_program, seqlen)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    for key_start in range(start, end, BLOCK_N):
        scores, _ = _score_tile(q, k_base, key_start, tile_offs, positions, row_ok, seqlen, qk_scale, stride_kn,
                                BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.sum(tl.math.exp2(scores - m_safe[:, None]), 1)
        m_i = m_new
    out = b * stride_sb + h * stride_sh + pid_c * stride_sc + offs_r * stride_sr
    tl.store(MAX + out, m_i, mask=row_ok)
    tl.store(SUM + out, l_i, mask=row_ok)


@triton.jit
def _part_probs(Q, q_base, lse_base, part_start, key_start, k_base, tile_offs, seqlen, rows, qk_scale,
                stride_qn, stride_qd, stride_lr, stride_kn, HEAD_DIM: tl.constexpr, SUB: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Normalised probabilities ``[SUB, BLOCK_N]`` of rows ``[part_start, part_start + SUB)``."""
    offs_r = part_start + tl.arange(0, SUB)
    row_ok = offs_r < rows
    positions = (seqlen - rows + offs_r).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_base + positions[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(lse_base + offs_r * stride_lr, mask=row_ok, other=0.0)
    scores, offs_n = _score_tile(q, k_base, key_start, tile_offs, positions, row_ok, seqlen, qk_scale, stride_kn,
                                 BLOCK_N)
    return tl.math.exp2(scores - lse2[:, None]), offs_n


@triton.jit
def representative_line_sums_kernel(
        Q, K, LSE2, VERTICAL, SLASH, qk_scale, seqlen, rows, num_kv_heads, group, keys_per_program,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_lb, stride_lh, stride_lr,
        stride_vb, stride_vh, stride_vn,
        HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """LSE2: ``[B, Hq, R]`` base-2 row log-sum-exp.  VERTICAL, SLASH: ``[B, Hq, N]`` float32, same
    strides; VERTICAL is written whole, SLASH must be zero-initialised (it receives atomic sums).
    Both are un-normalised (not yet divided by R).  ``SPLIT`` (1 or 2): the rows are handled as
    that many ``ROWS / SPLIT`` tiles, to keep the per-tile tensors small."""
    SUB: tl.constexpr = ROWS // SPLIT
    SHIFTS: tl.constexpr = (ROWS - 1) // BLOCK_N + 2
    pid_bkv = tl.program_id(2)
    b = (pid_bkv // num_kv_heads).to(tl.int64)
    kv_h = (pid_bkv % num_kv_heads).to(tl.int64)
    h = kv_h * group + tl.program_id(0)
    q_base = Q + b * stride_qb + h * stride_qh
    lse_base = LSE2 + b * stride_lb + h * stride_lh
    k_base = K + b * stride_kb + kv_h * stride_kh
    tile_offs = tl.arange(0, BLOCK_N)[:, None] * stride_kn + tl.arange(0, HEAD_DIM)[None, :] * stride_kd
    line_base = b * stride_vb + h * stride_vh

    offs_e = tl.arange(0, BLOCK_N)
    lag = tl.arange(0, SUB)[:, None] + BLOCK_N - offs_e[None, :]  # r - e + BLOCK_N > 0 (first part)

    start = tl.program_id(1).to(tl.int64) * keys_per_program
    end = tl.minimum(start + keys_per_program, seqlen)
    for key_start in range(start, end, BLOCK_N):
        probs, offs_n = _part_probs(Q, q_base, lse_base, 0, key_start, k_base, tile_offs, seqlen, rows, qk_scale,
                                    stride_qn, stride_qd, stride_lr, stride_kn, HEAD_DIM, SUB, BLOCK_N)
        sheared = tl.gather(probs, lag % BLOCK_N, axis=1)
        if SPLIT == 2:
            probs_hi, _ = _part_probs(Q, q_base, lse_base, SUB, key_start, k_base, tile_offs, seqlen, rows,
                                      qk_scale, stride_qn, stride_qd, stride_lr, stride_kn, HEAD_DIM, SUB, BLOCK_N)
            sheared_hi = tl.gather(probs_hi, (lag + SUB) % BLOCK_N, axis=1)
            probs += probs_hi
        tl.store(VERTICAL + line_base + offs_n * stride_vn, tl.sum(probs, 0), mask=offs_n < seqlen)
        base = seqlen - rows - key_start - BLOCK_N + offs_e  # distance of shift 0
        for s in tl.static_range(SHIFTS):
            distance = base + s * BLOCK_N
            part = tl.where(lag // BLOCK_N == s, sheared, 0.0)
            if SPLIT == 2:
                part += tl.where((lag + SUB) // BLOCK_N == s, sheared_hi, 0.0)
            tl.atomic_add(SLASH + line_base + distance * stride_vn, tl.sum(part, 0),
                          mask=(distance >= 0) & (distance < seqlen))


@triton.jit
def block_means_kernel(X, HEADS, OUT, seqlen, block_size, num_heads,
                       stride_xb, stride_xh, stride_xn, stride_xd,
                       stride_os, stride_ob, stride_od,
                       HEAD_DIM: tl.constexpr, TILE: tl.constexpr):
    """OUT ``[S, nb, D]`` float32: the mean over each block's valid tokens of ``X [B, H, N, D]``
    for the ``S`` flat heads ``b * H + h`` listed in HEADS (int64).  Grid ``(S, nb)``."""
    pid_s = tl.program_id(0)
    block = tl.program_id(1).to(tl.int64)
    head = tl.load(HEADS + pid_s)
    offs_d = tl.arange(0, HEAD_DIM)
    base = X + (head // num_heads) * stride_xb + (head % num_heads) * stride_xh
    first = block * block_size
    last = tl.minimum(first + block_size, seqlen)
    total = tl.zeros([HEAD_DIM], tl.float32)
    for start in range(first, last, TILE):
        offs_n = start + tl.arange(0, TILE)
        x = tl.load(base + offs_n[:, None] * stride_xn + offs_d[None, :] * stride_xd,
                    mask=(offs_n < last)[:, None], other=0.0)
        total += tl.sum(x.to(tl.float32), 0)
    tl.store(OUT + pid_s * stride_os + block * stride_ob + offs_d * stride_od, total / (last - first).to(tl.float32))
