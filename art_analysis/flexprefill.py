"""FlexPrefill reference: pattern search, block selection and block-sparse causal attention.

FlexPrefill (Lai et al., ICLR 2025) chooses, per input and per head, which
``block_size x block_size`` tiles of the causal attention matrix a prefill computes.  This
module is the readable PyTorch reference that the Triton path in
:mod:`kernels.block_sparse` and :mod:`kernels.flexprefill_estimate` is held to.

Tensors are ``[B, H, N, D]`` (queries ``[B, Hq, N, D]``, keys and values
``[B, Hkv, N, D]``, ``Hq % Hkv == 0``, query head ``h`` reads KV head ``h // (Hq // Hkv)``).
The block grid starts at token 0: block ``j`` covers tokens ``[j*bs, min((j+1)*bs, N))`` and
``nb = ceil(N / bs)``.

Algorithm, per ``(b, h)``:

1. **Representative attention.**  ``Q_hat`` = the last ``min(bs, N)`` queries.  Their causal
   softmax over all keys, ``A [R, N]``, is computed in key chunks (two passes: log-sum-exp,
   then sums) so that ``A`` is never held whole.  From it: the *vertical* vector (column sums)
   and the *slash* vector (sums along query-key distance ``d = i - j``), each divided by
   ``R`` so that it sums to 1.
2. **Pattern search.**  Estimate ``a_bar = softmax(mean(Q_hat) . blockmean(K)^T * scale)``
   against truth ``a_hat = blocksum(vertical)``; ``D_JS = sqrt(JSD(a_bar, a_hat))`` (natural
   log, so ``0 <= D_JS <= sqrt(ln 2)``).  ``D_JS < tau`` makes the head *query-aware*, else
   it is *vertical-slash*.
3. **Vertical-slash heads.**  Token budget = the fewest top tokens whose mass reaches
   ``gamma`` (separately for the vertical and the slash vector), converted to blocks as
   ``ceil(tokens / budget_divisor)`` and clamped to ``[min_b, max_b]``.  The top key blocks by
   pooled vertical mass and the top block diagonals (offset ``o`` pools distances
   ``[o*bs, (o+1)*bs)``) by pooled slash mass are kept and extended over every query block.
4. **Query-aware heads.**  ``A_bar = softmax(blockmean(Q) . blockmean(K)^T * scale)`` with a
   block-causal mask; flattened and divided by its total, the fewest top entries reaching
   ``gamma`` are kept.  Per query block, at least its ``min_b`` best blocks and at most its
   ``max_b`` best selected blocks are kept.
5. Every query block keeps key block 0 and its diagonal block; everything is ANDed with the
   block-causal mask.

Budgets: ``min_b = ceil(min_budget / bs)``, ``max_b = min(ceil(max_budget / bs), nb)``
(tokens in, blocks out; nothing is hard-coded to 128).

Upstream quirks (``ByteDance-Seed/FlexPrefill`` at ``a24b27b``) are flags, defaulting to the
paper's intent:

* ``budget_divisor``: tokens per block in the budget conversion; ``None`` = ``block_size``
  (upstream divides by a hard-coded 128 whatever the block size).
* ``union_vs_for_query_aware``: upstream unions a query-aware head's set with its
  vertical-slash set; the paper uses the query-aware set alone (``False``).
* ``js_eps``: epsilon inside the JS logarithms; ``None`` reproduces upstream, where a block
  with zero mass makes ``D_JS`` NaN and the head silently vertical-slash.
* ``sm_scale``: the softmax scale used by the estimation (upstream always uses
  ``D ** -0.5`` for estimation even when attention uses another scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.int_checks import check_count, check_flags, is_finite_real
from kernels.prefill_checks import check_block_mask, check_prefill_inputs, check_selection_params
from kernels.softmax_scale import softmax_scale

from .checks import as_list, check_finite

VERTICAL_SLASH = 0
QUERY_AWARE = 1

DEFAULT_JS_EPS = 1e-10


@dataclass
class FlexPrefillSelection:
    """The blocks FlexPrefill computes.

    Attributes:
        pattern: ``[B, H]`` long, :data:`QUERY_AWARE` or :data:`VERTICAL_SLASH` per query head.
        block_mask: ``[B, H, nb, nb]`` bool, ``True`` where tile ``(query block, key block)``
            is computed; always block-causal.
        js_distance: ``[B, H]`` float32, ``sqrt(JSD(a_bar, a_hat))`` of the pattern search.
        vertical_blocks: ``[B, H]`` long, the vertical budget in blocks (after clamping).
        slash_blocks: ``[B, H]`` long, the slash budget in blocks (after clamping).
        block_size: tokens per block.
    """

    pattern: torch.Tensor
    block_mask: torch.Tensor
    js_distance: torch.Tensor
    vertical_blocks: torch.Tensor
    slash_blocks: torch.Tensor
    block_size: int

    @property
    def query_aware(self) -> torch.Tensor:
        """``[B, H]`` bool: heads that use query-aware selection."""
        return self.pattern == QUERY_AWARE

    @property
    def kept_fraction(self) -> torch.Tensor:
        """``[B, H]`` float: kept tiles over the ``nb (nb + 1) / 2`` tiles of the causal triangle."""
        nb = self.block_mask.shape[-1]
        return self.block_mask.sum(dim=(-1, -2)).float() / (nb * (nb + 1) / 2)


@dataclass
class RepresentativeAttention:
    """Statistics of the last queries' causal attention, per query head.

    Attributes:
        vertical: ``[B, H, N]`` float32, column sums of ``A`` divided by the row count (sums to 1).
        slash: ``[B, H, N]`` float32, entry ``d`` = sum of ``A[i, j]`` over ``i - j = d`` (query
            and key positions), divided by the row count (sums to 1).
        rows: number of representative queries ``R = min(block_size, N)``.
    """

    vertical: torch.Tensor
    slash: torch.Tensor
    rows: int


def block_budgets(min_budget: int, max_budget: int | None, block_size: int, num_blocks: int) -> tuple[int, int]:
    """Token budgets to block budgets: ``(ceil(min_budget/bs), min(ceil(max_budget/bs), nb))``.

    ``max_budget=None`` means no cap (``nb``).  The minimum is also capped at ``nb``.
    """
    max_blocks = num_blocks if max_budget is None else min(-(-max_budget // block_size), num_blocks)
    return min(-(-min_budget // block_size), num_blocks), max_blocks


def coverage_count(mass: torch.Tensor, gamma: float) -> torch.Tensor:
    """Fewest entries whose largest values sum to at least ``gamma``.

    Args:
        mass: ``[..., n]`` non-negative, normalised (sums to 1 along the last dim).
    Returns:
        ``[...]`` long, ``min{k : sum of the k largest >= gamma}``, capped at ``n`` and at the number of
        nonzero entries (at least 1): those hold the whole mass, though a rounded sum of them can stay just
        under ``gamma = 1``.
    """
    cumulative = mass.sort(dim=-1, descending=True).values.cumsum(dim=-1)
    nonzero = (mass > 0).sum(dim=-1).clamp(min=1)
    return torch.minimum(((cumulative < gamma).sum(dim=-1) + 1).clamp(max=mass.shape[-1]), nonzero)


def descending_rank(scores: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` long: the position of each entry when sorted descending (ties: lower index first)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def js_distance(p: torch.Tensor, q: torch.Tensor, eps: float | None = DEFAULT_JS_EPS) -> torch.Tensor:
    """Square root of the Jensen-Shannon divergence (natural log) along the last dim.

    ``p, q [..., n]`` are distributions; returns ``[...]`` in ``[0, sqrt(ln 2)]``.  With
    ``eps=None`` a zero entry gives NaN (``0 * log 0``), as upstream.
    """
    m = 0.5 * (p + q)
    if eps is None:
        kl_p = (p * torch.log(p / m)).sum(dim=-1)
        kl_q = (q * torch.log(q / m)).sum(dim=-1)
    else:
        log_m = torch.log(m + eps)
        kl_p = (p * (torch.log(p + eps) - log_m)).sum(dim=-1)
        kl_q = (q * (torch.log(q + eps) - log_m)).sum(dim=-1)
    return torch.sqrt((0.5 * (kl_p + kl_q)).clamp(min=0.0))


def block_sum(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[..., N] -> [..., ceil(N / bs)]``: sums over consecutive blocks (last one partial; a block past ``N`` is the
    one block of ``N`` values, not padded to ``bs``)."""
    n = x.shape[-1]
    nb = -(-n // block_size)
    tile = min(block_size, n)
    padded = torch.nn.functional.pad(x, (0, nb * tile - n))
    return padded.unflatten(-1, (nb, tile)).sum(dim=-1)


def block_mean(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, H, N, D] -> [B, H, nb, D]`` float32: mean over each block's valid tokens."""
    n = x.shape[2]
    sums = block_sum(x.float().transpose(2, 3), block_size).transpose(2, 3)
    counts = block_sum(torch.ones(n, device=x.device), block_size)
    return sums / counts[:, None]


def _grouped_scores(q_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q_rows [B, Hq, R, D]`` x ``keys [B, Hkv, C, D]`` -> ``[B, Hq, R, C]`` without repeating KV."""
    b, hq, r, d = q_rows.shape
    hkv = keys.shape[1]
    scores = q_rows.reshape(b, hkv, (hq // hkv) * r, d) @ keys.transpose(-1, -2)
    return scores.reshape(b, hq, r, keys.shape[2])


def representative_attention(q: torch.Tensor, k: torch.Tensor, *, block_size: int, sm_scale: float,
                             key_chunk: int = 4096) -> RepresentativeAttention:
    """Vertical and slash statistics of the last ``min(block_size, N)`` queries' causal attention.

    Computed in float32 over key chunks of ``key_chunk`` tokens, in two passes (row
    log-sum-exp, then sums), so at most ``[B, Hq, R, key_chunk]`` scores are held.
    """
    b, hq, n, _ = q.shape
    rows = min(block_size, n)
    q_hat = q[:, :, n - rows:].float() * sm_scale
    positions = torch.arange(n - rows, n, device=q.device)

    def chunk_scores(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.arange(start, min(start + key_chunk, n), device=q.device)
        scores = _grouped_scores(q_hat, k[:, :, start:start + key_chunk].float())
        distance = positions[:, None] - keys[None, :]
        return scores.masked_fill(distance < 0, float("-inf")), distance

    row_max = torch.full((b, hq, rows), float("-inf"), device=q.device)
    row_sum = torch.zeros(b, hq, rows, device=q.device)
    for start in range(0, n, key_chunk):
        scores, _ = chunk_scores(start)
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        row_sum = row_sum * torch.exp(row_max - new_max) + torch.exp(scores - new_max[..., None]).sum(dim=-1)
        row_max = new_max
    lse = row_max + torch.log(row_sum)

    vertical = torch.zeros(b, hq, n, device=q.device)
    slash = torch.zeros(b, hq, n, device=q.device)
    for start in range(0, n, key_chunk):
        scores, distance = chunk_scores(start)
        probs = torch.exp(scores - lse[..., None])
        vertical[..., start:start + probs.shape[-1]] = probs.sum(dim=-2)
        index = distance.clamp(min=0).flatten().expand(b, hq, -1)
        slash.scatter_add_(-1, index, probs.flatten(-2))
    return RepresentativeAttention(vertical=vertical / rows, slash=slash / rows, rows=rows)


def pattern_search(q: torch.Tensor, k: torch.Tensor, stats: RepresentativeAttention, *, block_size: int,
                   sm_scale: float, js_eps: float | None = DEFAULT_JS_EPS) -> torch.Tensor:
    """``[B, Hq]`` JS distance between the pooled estimate ``a_bar`` and the true block mass ``a_hat``."""
    n = q.shape[2]
    q_mean = q[:, :, n - stats.rows:].float().mean(dim=2, keepdim=True)
    estimate = torch.softmax(_grouped_scores(q_mean, block_mean(k, block_size)).squeeze(2) * sm_scale, dim=-1)
    return js_distance(estimate, block_sum(stats.vertical, block_size), js_eps)


def block_causal(num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """``[nb, nb]`` bool: ``key block <= query block``."""
    idx = torch.arange(num_blocks, device=device)
    return idx[None, :] <= idx[:, None]


def vertical_slash_mask(stats: RepresentativeAttention, *, gamma: float, block_size: int, min_blocks: int,
                        max_blocks: int, budget_divisor: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vertical-slash block mask ``[B, H, nb, nb]`` and the two budgets ``[B, H]`` (blocks)."""
    vertical_scores = block_sum(stats.vertical, block_size)
    slash_scores = block_sum(stats.slash, block_size)
    nb = vertical_scores.shape[-1]

    def budget(mass: torch.Tensor) -> torch.Tensor:
        tokens = coverage_count(mass, gamma)
        blocks = torch.div(tokens + budget_divisor - 1, budget_divisor, rounding_mode="floor")
        return blocks.clamp(min_blocks, max_blocks)

    vertical_blocks, slash_blocks = budget(stats.vertical), budget(stats.slash)
    columns = descending_rank(vertical_scores) < vertical_blocks[..., None]
    diagonals = descending_rank(slash_scores) < slash_blocks[..., None]
    idx = torch.arange(nb, device=columns.device)
    offset = (idx[:, None] - idx[None, :]).clamp(min=0)
    mask = columns[..., None, :] | diagonals[..., offset]
    return mask & block_causal(nb, mask.device), vertical_blocks, slash_blocks


def query_aware_mask(q: torch.Tensor, k: torch.Tensor, *, gamma: float, block_size: int, sm_scale: float,
                     min_blocks: int, max_blocks: int) -> torch.Tensor:
    """Query-aware block mask ``[B, Hq, nb, nb]`` from block-pooled queries and keys."""
    causal = block_causal(-(-q.shape[2] // block_size), q.device)
    logits = _grouped_scores(block_mean(q, block_size), block_mean(k, block_size)) * sm_scale
    pooled = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    flat = pooled.flatten(-2)
    flat = flat / flat.sum(dim=-1, keepdim=True)
    selected = (descending_rank(flat) < coverage_count(flat, gamma)[..., None]).view_as(pooled)
    row_rank = descending_rank(pooled)
    return ((selected & (row_rank < max_blocks)) | (row_rank < min_blocks)) & causal


def select_blocks(q: torch.Tensor, k: torch.Tensor, *, gamma: float = 0.9, tau: float = 0.1,
                  block_size: int = 128, min_budget: int = 1024, max_budget: int | None = None,
                  sm_scale: float | None = None, budget_divisor: int | None = None,
                  union_vs_for_query_aware: bool = False, js_eps: float | None = DEFAULT_JS_EPS,
                  key_chunk: int = 4096) -> FlexPrefillSelection:
    """FlexPrefill's pattern search and block selection (see the module docstring).

    Args:
        q: ``[B, Hq, N, D]`` queries (post-RoPE).
        k: ``[B, Hkv, N, D]`` keys.
        gamma: cumulative attention to cover, in ``(0, 1]``.
        tau: JS-distance threshold; heads with ``D_JS < tau`` are query-aware.
        block_size: tokens per block (any positive int here; the kernel wants a power of two).
        min_budget, max_budget: tokens; converted to blocks with ``block_size``.
        sm_scale: softmax scale used by the estimation, default ``D ** -0.5``.
        budget_divisor, union_vs_for_query_aware, js_eps: upstream quirks (module docstring).
        key_chunk: keys per chunk of the representative attention (memory bound, not results).
    """
    check_prefill_inputs(q, k)
    check_selection_params(gamma, tau, block_size, min_budget, max_budget, budget_divisor, js_eps,
                           union_vs_for_query_aware)
    check_finite(q=q, k=k)
    check_count(key_chunk, "key_chunk", 1)
    scale = softmax_scale(sm_scale, q.shape[-1])
    nb = -(-q.shape[2] // block_size)
    min_blocks, max_blocks = block_budgets(min_budget, max_budget, block_size, nb)

    stats = representative_attention(q, k, block_size=block_size, sm_scale=scale, key_chunk=key_chunk)
    distance = pattern_search(q, k, stats, block_size=block_size, sm_scale=scale, js_eps=js_eps)
    query_aware = distance < tau
    vs_mask, vertical_blocks, slash_blocks = vertical_slash_mask(
        stats, gamma=gamma, block_size=block_size, min_blocks=min_blocks, max_blocks=max_blocks,
        budget_divisor=block_size if budget_divisor is None else budget_divisor)
    qa_mask = query_aware_mask(q, k, gamma=gamma, block_size=block_size, sm_scale=scale,
                               min_blocks=min_blocks, max_blocks=max_blocks)
    if union_vs_for_query_aware:
        qa_mask = qa_mask | vs_mask
    idx = torch.arange(nb, device=q.device)
    forced = (idx[None, :] == 0) | (idx[None, :] == idx[:, None])
    mask = torch.where(query_aware[..., None, None], qa_mask, vs_mask) | forced
    return FlexPrefillSelection(
        pattern=torch.where(query_aware, QUERY_AWARE, VERTICAL_SLASH),
        block_mask=mask & block_causal(nb, q.device), js_distance=distance,
        vertical_blocks=vertical_blocks, slash_blocks=slash_blocks, block_size=block_size)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor,
                     block_size: int, *, sm_scale: float | None = None, return_lse: bool = False,
                     compute_dtype: torch.dtype = torch.float32, query_chunk: int = 1024):
    """Causal attention restricted to the tiles of ``block_mask``, in plain PyTorch.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]``.
        block_mask: ``[B, Hq, nb, nb]`` bool, tile ``(query block, key block)`` computed or not;
            tiles above the diagonal are ignored (attention is causal).
        block_size: tokens per block.
        sm_scale: default ``D ** -0.5``.
        return_lse: also return the natural-log log-sum-exp of the kept scaled scores.
        compute_dtype: float32 or float64.
        query_chunk: queries per chunk (at most ``[B, Hq, query_chunk, N]`` scores are held).
    Returns:
        ``out [B, Hq, N, D]`` in ``compute_dtype`` (rows with no kept key are 0), and with
        ``return_lse`` also ``lse [B, Hq, N]`` (``-inf`` for such rows).
    """
    if not isinstance(v, torch.Tensor):           # check_prefill_inputs takes v as optional
        raise TypeError(f"v must be a torch.Tensor, got {type(v).__name__}")
    check_prefill_inputs(q, k, v)
    check_finite(q=q, k=k, v=v)
    check_block_mask(block_mask, q, block_size)
    check_flags(return_lse=return_lse)
    check_count(query_chunk, "query_chunk", 1)
    b, hq, n, _ = q.shape
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
    scale = softmax_scale(sm_scale, q.shape[-1])
    keys, values = k.to(compute_dtype), v.to(compute_dtype)
    key_pos = torch.arange(n, device=q.device)
    key_block = key_pos // block_size
    outputs, lses = [], []
    chunk = max(block_size, query_chunk // block_size * block_size)
    for start in range(0, n, chunk):
        query_pos = key_pos[start:start + chunk]
        scores = _grouped_scores(q[:, :, start:start + chunk].to(compute_dtype) * scale, keys)
        tiles = block_mask[:, :, query_pos // block_size][..., key_block]
        allowed = tiles & (key_pos[None, :] <= query_pos[:, None])
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
        hkv = keys.shape[1]
        out = probs.reshape(b, hkv, -1, n) @ values
        outputs.append(out.reshape(b, hq, -1, q.shape[-1]))
        lses.append(lse)
    out = torch.cat(outputs, dim=2)
    return (out, torch.cat(lses, dim=2)) if return_lse else out


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                           compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense causal attention ``[B, Hq, N, D]``: :func:`sparse_attention` with every tile kept (which checks ``v``
    and the values; ``q`` and ``k`` are checked here, where their shape sizes the mask)."""
    check_prefill_inputs(q, k)
    b, hq, n, _ = q.shape
    block_size = max(1, min(n, 128))
    nb = -(-n // block_size)
    full = torch.ones(b, hq, nb, nb, dtype=torch.bool, device=q.device)
    return sparse_attention(q, k, v, full, block_size, sm_scale=sm_scale, compute_dtype=compute_dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``[B, H]``: ``||out - ref|| / ||ref||`` over each head's ``[N, D]`` output."""
    diff = (out.double() - ref.double()).flatten(2).norm(dim=-1)
    return (diff / ref.double().flatten(2).norm(dim=-1).clamp(min=1e-30)).float()


@dataclass
class GammaSweep:
    """FlexPrefill over a grid of ``gamma`` on one input, against dense causal attention.

    Attributes:
        gammas: ``[G]``.
        kept_fraction: ``[G, B, H]`` kept tiles over causal tiles.
        rel_error: ``[G, B, H]`` ``||out - dense|| / ||dense||`` per head.
        pattern: ``[B, H]`` (:data:`QUERY_AWARE` / :data:`VERTICAL_SLASH`; depends on ``tau`` only).
        js_distance: ``[B, H]``.
    """

    gammas: torch.Tensor
    kept_fraction: torch.Tensor
    rel_error: torch.Tensor
    pattern: torch.Tensor
    js_distance: torch.Tensor


def gamma_sweep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gammas, *, tau: float = 0.1,
                block_size: int = 128, min_budget: int = 1024, max_budget: int | None = None,
                sm_scale: float | None = None, **quirks) -> GammaSweep:
    """Select blocks and run :func:`sparse_attention` for every ``gamma``; compare with dense.

    ``quirks`` are passed to :func:`select_blocks` (``budget_divisor``, ``union_vs_for_query_aware``,
    ``js_eps``).  Inputs as :func:`select_blocks`; computed in float32.
    """
    values = as_list(gammas, "gammas", "[0.9, 0.95]")
    if not values:
        raise ValueError("gammas must hold at least one value")
    bad = [g for g in values if not (is_finite_real(g) and 0.0 < g <= 1.0)]
    if bad:
        raise ValueError(f"each of gammas must lie in (0, 1] (a real number), got {bad[0]!r}")
    gammas = torch.tensor([float(g) for g in values], dtype=torch.float64)
    dense = dense_causal_attention(q, k, v, sm_scale=sm_scale)
    kept, errors, selection = [], [], None
    for gamma in gammas.tolist():
        selection = select_blocks(q, k, gamma=gamma, tau=tau, block_size=block_size, min_budget=min_budget,
                                  max_budget=max_budget, sm_scale=sm_scale, **quirks)
        out = sparse_attention(q, k, v, selection.block_mask, block_size, sm_scale=sm_scale)
        kept.append(selection.kept_fraction)
        errors.append(relative_error(out, dense))
    return GammaSweep(gammas=gammas, kept_fraction=torch.stack(kept), rel_error=torch.stack(errors),
                      pattern=selection.pattern, js_distance=selection.js_distance)


__all__ = [
    "VERTICAL_SLASH", "QUERY_AWARE", "FlexPrefillSelection", "RepresentativeAttention", "select_blocks",
    "sparse_attention", "dense_causal_attention", "representative_attention", "pattern_search",
    "vertical_slash_mask", "query_aware_mask", "coverage_count", "descending_rank", "js_distance",
    "block_budgets", "block_sum", "block_mean", "block_causal", "relative_error", "check_prefill_inputs",
    "check_selection_params", "GammaSweep", "gamma_sweep",
]
