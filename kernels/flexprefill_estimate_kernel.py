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

The selection that follows is fused into a few small kernels (:func:`row_lse_kernel`,
:func:`line_blocks_kernel`, :func:`vertical_slash_select_kernel`, :func:`js_pattern_kernel`,
:func:`vertical_slash_mask_kernel`), one launch each, with thresholds passed at run time.
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
                          mask=(distance >= 0) & (distance < seqlen), sem="relaxed")


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


@triton.jit
def row_lse_kernel(MAX, SUM, LSE2, num_chunks, rows, log2_rows,
                   stride_sb, stride_sh, stride_sc, stride_sr, stride_lb, stride_lh, stride_lr, num_heads,
                   ROWS: tl.constexpr, CHUNKS: tl.constexpr):
    """LSE2 ``[B, Hq, R]``: the chunks' running max and sum (``[B, Hq, num_chunks, R]``) combined
    into a base-2 log-sum-exp, plus ``log2_rows`` (so the probabilities come out divided by R).
    Grid ``(B * Hq,)``; ``CHUNKS`` chunks a step."""
    pid = tl.program_id(0)
    b = (pid // num_heads).to(tl.int64)
    h = (pid % num_heads).to(tl.int64)
    offs_r = tl.arange(0, ROWS)
    row_ok = offs_r < rows
    base = b * stride_sb + h * stride_sh + offs_r[None, :] * stride_sr
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    for start in range(0, num_chunks, CHUNKS):
        offs_c = start + tl.arange(0, CHUNKS)
        ok = (offs_c < num_chunks)[:, None] & row_ok[None, :]
        offs = base + offs_c[:, None].to(tl.int64) * stride_sc
        chunk_max = tl.load(MAX + offs, mask=ok, other=float("-inf"))
        chunk_sum = tl.load(SUM + offs, mask=ok, other=0.0)
        m_new = tl.maximum(m_i, tl.max(chunk_max, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.sum(chunk_sum * tl.math.exp2(chunk_max - m_safe[None, :]), 0)
        m_i = m_new
    lse2 = m_i + tl.math.log2(tl.where(row_ok, l_i, 1.0)) + log2_rows
    tl.store(LSE2 + b * stride_lb + h * stride_lh + offs_r * stride_lr, lse2, mask=row_ok)


@triton.jit
def _largest(bits, count):
    """Bool: the ``count`` largest entries of ``bits`` (the int32 bit patterns of non-negative
    floats, which order as the floats; -1 = absent), ties lowest index first."""
    lo = 0
    hi = 0x7F800000
    for _ in range(31):  # largest pattern u with #(bits >= u) >= count: the count-th largest value
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((bits >= mid).to(tl.int32), 0) >= count
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = bits > lo
    ties = bits == lo
    need = count - tl.sum(above.to(tl.int32), 0)
    return (above | (ties & (tl.cumsum(ties.to(tl.int32), 0) <= need))) & (count > 0)


@triton.jit
def line_blocks_kernel(LINES, POOLED, seqlen, num_blocks, block_size, stride_ll, stride_ln, stride_pl, stride_pn,
                       BLOCKS: tl.constexpr, BLOCK_TOKENS: tl.constexpr):
    """``POOLED [l, nb]``: the block sums of line ``LINES [l, N]`` (program ``l``).  ``BLOCKS`` blocks
    of ``BLOCK_TOKENS`` (>= block_size) are pooled a step."""
    line = tl.program_id(0).to(tl.int64)
    offs_b = tl.arange(0, BLOCKS)
    offs_t = tl.arange(0, BLOCK_TOKENS)
    for first in range(0, num_blocks, BLOCKS):
        blocks = first + offs_b
        tokens_at = blocks[:, None].to(tl.int64) * block_size + offs_t[None, :]
        ok = (offs_t[None, :] < block_size) & (tokens_at < seqlen)
        values = tl.load(LINES + line * stride_ll + tokens_at * stride_ln, mask=ok, other=0.0)
        tl.store(POOLED + line * stride_pl + blocks * stride_pn, tl.sum(values, 1), mask=blocks < num_blocks)


@triton.jit
def vertical_slash_select_kernel(SORTED, POOLED, KEPT, BUDGETS, seqlen, num_blocks, gamma, divisor, lowest, highest,
                                 stride_sl, stride_sn, stride_pl, stride_pn, stride_kl, stride_kn, stride_bl,
                                 TILE: tl.constexpr, NB: tl.constexpr):
    """Budget and kept blocks of one normalised line (program ``l`` of the ``B * Hq * 2`` lines).

    ``SORTED``: the lines sorted descending; the token budget is the fewest entries whose running
    sum reaches ``gamma`` (capped at N and at the nonzero entries), in blocks
    ``clamp(ceil(tokens / divisor), lowest, highest)``
    -> ``BUDGETS [l]`` (int64).  ``KEPT [l, nb]`` (int8): the budget's largest entries of the
    line's block sums ``POOLED [l, nb]`` (:func:`line_blocks_kernel`), ties lowest index first.
    ``NB`` >= nb holds the pooled line.
    """
    line = tl.program_id(0).to(tl.int64)
    sorted_base = SORTED + line * stride_sl
    offs = tl.arange(0, TILE)
    carry = 0.0
    below = 0
    nonzero = 0
    for start in range(0, seqlen, TILE):
        idx = start + offs
        ok = idx < seqlen
        values = tl.load(sorted_base + idx * stride_sn, mask=ok, other=0.0)
        running = carry + tl.cumsum(values, 0)
        below += tl.sum(((running < gamma) & ok).to(tl.int32), 0)
        nonzero += tl.sum((values > 0).to(tl.int32), 0)
        carry = tl.max(tl.where(ok, running, 0.0), 0)
    # the nonzero entries hold the whole mass: a float32 sum that stops short of gamma = 1 counts no zeros
    tokens = tl.minimum(tl.minimum(below + 1, seqlen), tl.maximum(nonzero, 1)).to(tl.int64)
    budget = tl.minimum(tl.maximum((tokens + divisor - 1) // divisor, lowest), highest)
    tl.store(BUDGETS + line * stride_bl, budget.to(tl.int64))

    offs_nb = tl.arange(0, NB)
    valid = offs_nb < num_blocks
    pooled = tl.load(POOLED + line * stride_pl + offs_nb * stride_pn, mask=valid, other=0.0)
    kept = _largest(tl.where(valid, pooled.to(tl.int32, bitcast=True), -1), budget)
    tl.store(KEPT + line * stride_kl + offs_nb * stride_kn, kept.to(tl.int8), mask=valid)


@triton.jit
def _block_logits(key_base, query, blocks, ok, scale, stride_kn, stride_kd, HEAD_DIM: tl.constexpr):
    """``query [D] . key_base[blocks] [T, D]^T * scale``; ``-inf`` where not ``ok``."""
    offs_d = tl.arange(0, HEAD_DIM)
    keys = tl.load(key_base + blocks[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=ok[:, None], other=0.0)
    return tl.where(ok, tl.sum(keys * query[None, :], 1) * scale, float("-inf"))


@triton.jit
def js_pattern_kernel(Q, KEY_MEANS, TRUTH, JS, PATTERN, seqlen, rows, num_blocks, num_heads, group, scale, tau,
                      js_eps, stride_qb, stride_qh, stride_qn, stride_qd, stride_mb, stride_mh, stride_mn, stride_md,
                      stride_tb, stride_th, stride_tn,
                      HEAD_DIM: tl.constexpr, ROW_TILE: tl.constexpr, BLOCK_TILE: tl.constexpr,
                      USE_EPS: tl.constexpr):
    """Pattern search of one query head (grid ``(B * Hq,)``): ``JS`` = the JS distance between
    ``softmax(mean of the last rows of Q . KEY_MEANS^T * scale)`` and ``TRUTH`` (the pooled
    vertical line, ``[B, Hq, nb]``), ``PATTERN`` (int64) = ``JS < tau``.  Without ``USE_EPS`` a zero
    entry gives NaN, as upstream."""
    pid = tl.program_id(0)
    b = (pid // num_heads).to(tl.int64)
    h = (pid % num_heads).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + b * stride_qb + h * stride_qh
    total = tl.zeros([HEAD_DIM], tl.float32)
    for start in range(seqlen - rows, seqlen, ROW_TILE):
        offs_n = start + tl.arange(0, ROW_TILE)
        x = tl.load(q_base + offs_n[:, None].to(tl.int64) * stride_qn + offs_d[None, :] * stride_qd,
                    mask=(offs_n < seqlen)[:, None], other=0.0)
        total += tl.sum(x.to(tl.float32), 0)
    recent = total / rows
    means_base = KEY_MEANS + b * stride_mb + (h // group) * stride_mh
    truth_base = TRUTH + b * stride_tb + h * stride_th
    offs_c = tl.arange(0, BLOCK_TILE)
    m_i = float("-inf")
    l_i = 0.0
    for first in range(0, num_blocks, BLOCK_TILE):
        blocks = first + offs_c
        logits = _block_logits(means_base, recent, blocks, blocks < num_blocks, scale, stride_mn, stride_md, HEAD_DIM)
        m_new = tl.maximum(m_i, tl.max(logits, 0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(logits - m_new), 0)
        m_i = m_new
    divergence = 0.0
    for first in range(0, num_blocks, BLOCK_TILE):
        blocks = first + offs_c
        ok = blocks < num_blocks
        logits = _block_logits(means_base, recent, blocks, ok, scale, stride_mn, stride_md, HEAD_DIM)
        # lanes past the last block hold two equal distributions (1, 1), whose terms are 0 on both paths
        estimate = tl.where(ok, tl.exp(logits - m_i) / l_i, 1.0)
        truth = tl.load(truth_base + blocks * stride_tn, mask=ok, other=1.0)
        middle = 0.5 * (estimate + truth)
        if USE_EPS:
            log_middle = tl.log(middle + js_eps)
            terms = estimate * (tl.log(estimate + js_eps) - log_middle) + truth * (tl.log(truth + js_eps) - log_middle)
        else:
            terms = estimate * tl.log(estimate / middle) + truth * tl.log(truth / middle)
        divergence += tl.sum(tl.where(ok, terms, 0.0), 0)
    js = tl.sqrt(tl.maximum(0.5 * divergence, 0.0, propagate_nan=tl.PropagateNan.ALL))  # NaN stays NaN, as upstream
    tl.store(JS + pid, js)
    tl.store(PATTERN + pid, (js < tau).to(tl.int64))


@triton.jit
def vertical_slash_mask_kernel(KEPT, MASK, num_blocks, num_heads,
                               stride_kb, stride_kh, stride_kl, stride_kn,
                               stride_mb, stride_mh, stride_mr, stride_mc,
                               TILE: tl.constexpr):
    """Row ``r`` (``program_id(0)``) of a vertical-slash mask: ``MASK[r, c]`` (uint8) = kept column
    ``c`` or kept diagonal ``r - c``, or ``c`` is 0 or ``r``; zero above the diagonal.  ``KEPT``
    ``[B, Hq, 2, nb]`` int8 (columns, diagonals).  Grid ``(nb, B * Hq)``."""
    r = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // num_heads).to(tl.int64)
    h = (pid % num_heads).to(tl.int64)
    kept_base = KEPT + b * stride_kb + h * stride_kh
    row_base = MASK + b * stride_mb + h * stride_mh + r.to(tl.int64) * stride_mr
    for first in range(0, num_blocks, TILE):
        cols = first + tl.arange(0, TILE)
        causal = cols <= r
        column = tl.load(kept_base + cols * stride_kn, mask=causal, other=0)
        diagonal = tl.load(kept_base + stride_kl + (r - cols) * stride_kn, mask=causal, other=0)
        keep = ((column != 0) | (diagonal != 0) | (cols == 0) | (cols == r)) & causal
        tl.store(row_base + cols * stride_mc, keep.to(tl.uint8), mask=cols < num_blocks)


@triton.jit
def _largest_few(bits, cols, count):
    """As :func:`_largest`, by ``count`` repeated arg-max steps (``tl.argmax`` returns the lowest
    index among equal maxima): cheaper than the 31-step search for a few entries."""
    chosen = cols < 0
    for _ in range(count):
        pick = tl.argmax(tl.where(chosen, -2, bits), 0)
        chosen = chosen | (cols == pick)
    return chosen


@triton.jit
def query_aware_rows_kernel(QUERY_MEANS, KEY_MEANS, POOLED, LIMITS, num_blocks, num_heads, group, scale, lowest,
                            highest, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn,
                            stride_kd, stride_pb, stride_ph, stride_pr, stride_pc, stride_lp,
                            HEAD_DIM: tl.constexpr, BLOCK_TILE: tl.constexpr, NB: tl.constexpr,
                            CAPPED: tl.constexpr, FEW: tl.constexpr):
    """Row ``r`` (``program_id(0)``) of a query-aware head's block map (grid ``(nb, B * Hq)``).

    ``POOLED [B, Hq, nb, nb]`` float32: ``softmax(QUERY_MEANS[r] . KEY_MEANS[c]^T * scale)`` over
    ``c <= r``, 0 above the diagonal (the row's logits are stored there first, so that they are
    computed once).  ``LIMITS [1 + CAPPED, B, Hq, nb, nb]`` (uint8, plane stride
    ``stride_lp``, else POOLED's strides): plane 0 = the row's ``lowest`` largest entries or block 0
    or the diagonal; with ``CAPPED`` (``highest < nb``), plane 1 = its ``highest`` largest entries;
    both block-causal.  ``FEW``: ``lowest`` is small enough for :func:`_largest_few`.
    """
    r = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // num_heads).to(tl.int64)
    h = (pid % num_heads).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    query = tl.load(QUERY_MEANS + b * stride_qb + h * stride_qh + r.to(tl.int64) * stride_qn + offs_d * stride_qd)
    key_base = KEY_MEANS + b * stride_kb + (h // group) * stride_kh
    offs_c = tl.arange(0, BLOCK_TILE)
    row_offs = b * stride_pb + h * stride_ph + r.to(tl.int64) * stride_pr
    m_i = float("-inf")
    l_i = 0.0
    for first in range(0, r + 1, BLOCK_TILE):
        cols = first + offs_c
        logits = _block_logits(key_base, query, cols, cols <= r, scale, stride_kn, stride_kd, HEAD_DIM)
        tl.store(POOLED + row_offs + cols * stride_pc, logits, mask=cols <= r)  # read back below, not recomputed
        m_new = tl.maximum(m_i, tl.max(logits, 0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(logits - m_new), 0)
        m_i = m_new
    tl.debug_barrier()
    for first in range(0, num_blocks, BLOCK_TILE):
        cols = first + offs_c
        logits = tl.load(POOLED + row_offs + cols * stride_pc, mask=cols <= r, other=float("-inf"))
        tl.store(POOLED + row_offs + cols * stride_pc, tl.exp(logits - m_i) / l_i, mask=cols < num_blocks)
    tl.debug_barrier()

    cols = tl.arange(0, NB)
    valid = cols < num_blocks
    row = tl.load(POOLED + row_offs + cols * stride_pc, mask=valid, other=0.0)
    bits = tl.where(valid, row.to(tl.int32, bitcast=True), -1)
    causal = cols <= r
    if FEW:
        at_least = _largest_few(bits, cols, lowest)
    else:
        at_least = _largest(bits, lowest)
    at_least = (at_least | (cols == 0) | (cols == r)) & causal
    tl.store(LIMITS + row_offs + cols * stride_pc, at_least.to(tl.uint8), mask=valid)
    if CAPPED:
        at_most = _largest(bits, highest) & causal
        tl.store(LIMITS + stride_lp + row_offs + cols * stride_pc, at_most.to(tl.uint8), mask=valid)


@triton.jit
def chunk_sums_kernel(X, SUMS, n, stride_xs, stride_xn, stride_ss, stride_sc, TILE: tl.constexpr):
    """SUMS ``[S, ceil(n / TILE)]``: sums of the ``TILE``-entry chunks of ``X [S, n]``.  Grid ``(S, chunks)``."""
    idx = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    x = tl.load(X + tl.program_id(0).to(tl.int64) * stride_xs + idx * stride_xn, mask=idx < n, other=0.0)
    tl.store(SUMS + tl.program_id(0).to(tl.int64) * stride_ss + tl.program_id(1) * stride_sc, tl.sum(x, 0))


@triton.jit
def sorted_coverage_kernel(SORTED, SUMS, KTH, NEED, n, num_chunks, gamma,
                           stride_xs, stride_xn, stride_ss, stride_sc,
                           TILE: tl.constexpr, CHUNKS: tl.constexpr):
    """Coverage of one descending-sorted row ``SORTED[s, :n]`` (grid ``(S,)``), given its
    ``TILE``-chunk sums ``SUMS [S, num_chunks]``: ``count`` = the fewest leading entries whose
    running sum reaches ``gamma`` (capped at n and at the nonzero entries), ``KTH[s]`` = the count-th value and
    ``NEED[s]`` (int32) = how many entries equal to it are in (``count`` minus the entries above it).

    The running sum is the chunk sums' prefix up to the crossing chunk, then a scan of that one
    chunk; the first entry equal to ``KTH`` is found by bisection on the sorted row.
    """
    row = tl.program_id(0).to(tl.int64)
    sums_base = SUMS + row * stride_ss
    offs_c = tl.arange(0, CHUNKS)
    carry = 0.0
    whole = 0  # chunks whose running sum stays below gamma
    before = 0.0  # and their mass
    for first in range(0, num_chunks, CHUNKS):
        ok = first + offs_c < num_chunks
        sums = tl.load(sums_base + (first + offs_c) * stride_sc, mask=ok, other=0.0)
        running = carry + tl.cumsum(sums, 0)
        below = (running < gamma) & ok
        whole += tl.sum(below.to(tl.int32), 0)
        before += tl.sum(tl.where(below, sums, 0.0), 0)
        carry = tl.max(tl.where(ok, running, 0.0), 0)
    row_base = SORTED + row * stride_xs
    idx = whole.to(tl.int64) * TILE + tl.arange(0, TILE)
    ok = idx < n
    running = before + tl.cumsum(tl.load(row_base + idx * stride_xn, mask=ok, other=0.0), 0)
    count = tl.minimum(whole.to(tl.int64) * TILE + tl.sum(((running < gamma) & ok).to(tl.int32), 0) + 1, n)
    kth = tl.load(row_base + (count - 1) * stride_xn)
    lo = tl.full([], 0, tl.int64)
    hi = count - 1
    while lo < hi:  # first position holding kth
        mid = (lo + hi) // 2
        at_or_below = tl.load(row_base + mid * stride_xn) <= kth
        hi = tl.where(at_or_below, mid, hi)
        lo = tl.where(at_or_below, lo, mid + 1)
    # the nonzero entries hold the whole mass: a float32 sum that stops short of gamma = 1 takes no zeros
    count = tl.where((kth == 0.0) & (lo > 0), lo, count)
    tl.store(KTH + row, kth)
    tl.store(NEED + row, (count - lo).to(tl.int32))


@triton.jit
def _flat_row(FLAT, KTH, row_offs, cols, valid, head, stride_fc):
    """A row of the normalised map, and its entries equal to the head's threshold."""
    values = tl.load(FLAT + row_offs + cols * stride_fc, mask=valid, other=0.0)
    kth = tl.load(KTH + head)
    return values, (values == kth) & valid, kth


@triton.jit
def row_ties_kernel(FLAT, KTH, TIES, num_blocks, stride_fs, stride_fr, stride_fc, stride_ts, stride_tr,
                    NB: tl.constexpr):
    """TIES ``[S, nb]`` int32: per row ``r`` (``program_id(0)``) of head ``s``, how many entries of
    ``FLAT [S, nb, nb]`` equal ``KTH[s]``.  Grid ``(nb, S)``."""
    r = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, NB)
    _, ties, _ = _flat_row(FLAT, KTH, s * stride_fs + r.to(tl.int64) * stride_fr, cols, cols < num_blocks, s,
                           stride_fc)
    tl.store(TIES + s * stride_ts + r * stride_tr, tl.sum(ties.to(tl.int32), 0))


@triton.jit
def query_aware_select_kernel(FLAT, KTH, NEED, TIES, LIMITS, OUT, num_blocks,
                              stride_fs, stride_fr, stride_fc, stride_ts, stride_tr, stride_lp,
                              NB: tl.constexpr, CAPPED: tl.constexpr):
    """Row ``r`` (``program_id(0)``) of head ``s``'s query-aware tiles, ``OUT [S, nb, nb]`` (uint8,
    FLAT's strides): the flat coverage (entries above ``KTH[s]``, and the first ``NEED[s]`` equal
    to it in row-major order, ranked by the TIES counts of the rows above and a scan of this one),
    within the row's ``highest`` limit (``LIMITS`` plane 1, if ``CAPPED``), or in the row's
    ``lowest`` set (plane 0); block-causal.  Grid ``(nb, S)``."""
    r = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, NB)
    valid = cols < num_blocks
    row_offs = s * stride_fs + r.to(tl.int64) * stride_fr
    values, ties, kth = _flat_row(FLAT, KTH, row_offs, cols, valid, s, stride_fc)
    earlier = tl.sum(tl.load(TIES + s * stride_ts + cols * stride_tr, mask=cols < r, other=0), 0)
    rank = earlier + tl.cumsum(ties.to(tl.int32), 0)
    chosen = (values > kth) | (ties & (rank <= tl.load(NEED + s)))
    chosen = chosen & (cols <= r)
    if CAPPED:
        chosen = chosen & (tl.load(LIMITS + stride_lp + row_offs + cols * stride_fc, mask=valid, other=0) != 0)
    chosen = chosen | (tl.load(LIMITS + row_offs + cols * stride_fc, mask=valid, other=0) != 0)
    tl.store(OUT + row_offs + cols * stride_fc, chosen.to(tl.uint8), mask=valid)
