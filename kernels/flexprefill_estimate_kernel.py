"""Triton kernels: FlexPrefill's representative attention, reduced on chip to line sums.

The last ``R = min(block_size, N)`` queries attend causally to all ``N`` keys.  Instead of
materialising the ``[R, N]`` probabilities (2 GiB per call at 128k tokens and 32 heads), two
passes over the keys keep everything in registers:

1. :func:`representative_row_stats_kernel`: per row and key chunk, the running max and sum
   of ``exp2`` (base-2 online softmax); the host combines chunks into a row log-sum-exp.
2. :func:`representative_line_sums_kernel`: recomputes each score tile, normalises it with
   the row log-sum-exp, and adds its column sums to ``VERTICAL[j]`` and its sums along each
   query-key distance ``d = pos_i - j`` to ``SLASH[d]`` (atomics).  The distance sums come from
   a shear of the tile: ``G[r, e] = P[r, r + BLOCK_N - 1 - e]`` (``tl.gather``), whose column
   ``e`` holds distance ``d_base + e``.

Grid of both: ``(row_groups * group, ceil(N / keys_per_program), B * Hkv)`` with
``row_groups = ceil(R / ROWS)``: the programs that read the same key chunk (all row groups of
all query heads of one KV head) are launched next to each other, so K is read from L2.  The readable
reference is ``art_analysis.flexprefill.representative_attention``.
"""
import triton
import triton.language as tl


@triton.jit
def _score_tile(q, k_base, key_start, positions, row_ok, seqlen, qk_scale, stride_kn, stride_kd,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scaled (base-2) scores ``[ROWS, BLOCK_N]`` of keys from ``key_start``; invisible ones ``-inf``."""
    offs_n = key_start + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=offs_n[:, None] < seqlen, other=0.0)
    scores = tl.dot(q, tl.trans(k)) * qk_scale
    visible = (offs_n[None, :] <= positions[:, None]) & row_ok[:, None]
    return tl.where(visible, scores, float("-inf")), offs_n


@triton.jit
def _program_rows(Q, K, seqlen, rows, num_kv_heads, group, row_groups, stride_qb, stride_qh, stride_qn, stride_qd,
                  stride_kb, stride_kh, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """This program's batch, query head, key chunk, row offsets (into the R rows), their mask and
    positions, its query rows ``[ROWS, D]`` and its KV head's key base pointer."""
    pid_rg = tl.program_id(0)
    pid_bkv = tl.program_id(2)
    b = (pid_bkv // num_kv_heads).to(tl.int64)
    kv_h = (pid_bkv % num_kv_heads).to(tl.int64)
    h = kv_h * group + pid_rg // row_groups
    offs_r = (pid_rg % row_groups) * ROWS + tl.arange(0, ROWS)
    row_ok = offs_r < rows
    positions = (seqlen - rows + offs_r).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + positions[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    return b, h, tl.program_id(1), offs_r, row_ok, positions, q, K + b * stride_kb + kv_h * stride_kh


@triton.jit
def representative_row_stats_kernel(
        Q, K, MAX, SUM, qk_scale, seqlen, rows, num_kv_heads, group, row_groups, keys_per_program,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_sb, stride_sh, stride_sc, stride_sr,
        HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """MAX, SUM: ``[B, Hq, num_chunks, R]`` float32, base-2 running max and ``sum exp2(s - max)``."""
    b, h, pid_c, offs_r, row_ok, positions, q, k_base = _program_rows(
        Q, K, seqlen, rows, num_kv_heads, group, row_groups, stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, HEAD_DIM, ROWS)

    start = pid_c.to(tl.int64) * keys_per_program
    end = tl.minimum(start + keys_per_program, seqlen)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    for key_start in range(start, end, BLOCK_N):
        scores, _ = _score_tile(q, k_base, key_start, positions, row_ok, seqlen, qk_scale, stride_kn, stride_kd,
                                HEAD_DIM, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.sum(tl.math.exp2(scores - m_safe[:, None]), 1)
        m_i = m_new
    out = b * stride_sb + h * stride_sh + pid_c * stride_sc + offs_r * stride_sr
    tl.store(MAX + out, m_i, mask=row_ok)
    tl.store(SUM + out, l_i, mask=row_ok)


@triton.jit
def representative_line_sums_kernel(
        Q, K, LSE2, VERTICAL, SLASH, qk_scale, seqlen, rows, num_kv_heads, group, row_groups, keys_per_program,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_lb, stride_lh, stride_lr,
        stride_vb, stride_vh, stride_vn,
        HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """LSE2: ``[B, Hq, R]`` base-2 row log-sum-exp.  VERTICAL, SLASH: ``[B, Hq, N]`` float32,
    zero-initialised, same strides; receive un-normalised column and distance sums."""
    SHEAR: tl.constexpr = ROWS + BLOCK_N
    b, h, pid_c, offs_r, row_ok, positions, q, k_base = _program_rows(
        Q, K, seqlen, rows, num_kv_heads, group, row_groups, stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, HEAD_DIM, ROWS)
    lse2 = tl.load(LSE2 + b * stride_lb + h * stride_lh + offs_r * stride_lr, mask=row_ok, other=0.0)
    line_base = b * stride_vb + h * stride_vh

    local = tl.arange(0, ROWS)
    offs_e = tl.arange(0, SHEAR)
    source = local[:, None] + (BLOCK_N - 1) - offs_e[None, :]
    in_tile = (source >= 0) & (source < BLOCK_N)
    source = tl.where(in_tile, source, 0)
    first_position = seqlen - rows + tl.min(offs_r, 0)

    start = pid_c.to(tl.int64) * keys_per_program
    end = tl.minimum(start + keys_per_program, seqlen)
    for key_start in range(start, end, BLOCK_N):
        scores, offs_n = _score_tile(q, k_base, key_start, positions, row_ok, seqlen, qk_scale, stride_kn,
                                     stride_kd, HEAD_DIM, BLOCK_N)
        probs = tl.math.exp2(scores - lse2[:, None])
        tl.atomic_add(VERTICAL + line_base + offs_n * stride_vn, tl.sum(probs, 0), mask=offs_n < seqlen)
        sheared = tl.where(in_tile, tl.gather(probs, source, axis=1), 0.0)
        distance = first_position - (key_start + BLOCK_N - 1) + offs_e
        tl.atomic_add(SLASH + line_base + distance * stride_vn, tl.sum(sheared, 0),
                      mask=(distance >= 0) & (distance < seqlen) & (offs_e < SHEAR - 1))
