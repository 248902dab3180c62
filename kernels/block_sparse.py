"""Launchers: causal block-sparse prefill attention and the full FlexPrefill call.

* :func:`block_sparse_attention` runs the Triton kernel of :mod:`kernels.block_sparse_kernel`
  over the tiles of a ``[B, Hq, nb, nb]`` block mask (FlexPrefill's compute step).
* :func:`flexprefill_attention` chains the on-device estimation of
  :mod:`kernels.flexprefill_estimate` and that kernel.

The readable reference for both is ``art_analysis.flexprefill`` (``sparse_attention`` and
``select_blocks``).  Only causal self-attention prefill is supported (``Nq == Nk``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kernels.block_sparse_kernel import block_sparse_attention_kernel, column_table_kernel
from kernels.descriptors import descriptor_ready, host_descriptor
from kernels.device_info import num_sms
from kernels.flexprefill_estimate import FlexPrefillEstimate, estimate_block_mask
from kernels.int_checks import check_choice, check_count, check_flags
from kernels.prefill_checks import (SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, check_block_mask, check_kernel_tensors,
                                     check_prefill_inputs)
from kernels.softmax_scale import softmax_scale

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters; ``block_m`` and ``block_n`` must divide the block size.

    ``heads_first``: launch order; False walks one head's query tiles (longest first) before the
    next head's, True runs one query tile of every head side by side (longest first overall), and
    None (the default) chooses by the grid (:func:`heads_first`).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    heads_first: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value!r}")
        check_count(self.num_stages, "KernelConfig.num_stages", 1)
        if self.heads_first is not None and not isinstance(self.heads_first, bool):
            raise ValueError(f"KernelConfig.heads_first must be True, False or None, got {self.heads_first!r}")


PROGRAMS_PER_SM = 2  # programs of the default tiles resident on one multiprocessor
HEADS_FIRST_BELOW = 16  # query tiles per resident program under which heads run side by side


def heads_first(config: KernelConfig, programs: int, device: torch.device) -> bool:
    """The launch order of ``programs`` query tiles: ``config.heads_first`` when set, else side by side
    when there are fewer than ``HEADS_FIRST_BELOW`` tiles per resident program.

    Head-major order keeps a head's K/V in L2, but on a small grid a head's longest rows start late
    and finish last.  Measured on an H200 (``benchmarks/NOTES-flexprefill.md``, K3): SmolLM2 at
    32k (9 heads, 8.7 tiles per resident program) runs 1.4-12.5 % faster side by side; at 128k (35) and
    with 32 heads at 32k (31) it runs 2.0-13.8 % slower (``2026-12-01-flexprefill-sparse-tiles.json``); the
    threshold lies between those points.
    """
    if config.heads_first is not None:
        return config.heads_first
    return programs < HEADS_FIRST_BELOW * PROGRAMS_PER_SM * num_sms(device)


def default_config(head_dim: int, block_size: int) -> KernelConfig:
    """Tiles for Hopper-class GPUs: the fastest of ``kernels.bench_flexprefill.sweep_kernel_configs``
    on an H200 (dense causal mask, 32k tokens; ``benchmarks/NOTES-flexprefill.md``, K2): with
    D = 128, 128 x 64 tiles on 4 warps and 2 stages (16.5 ms against 18.3 ms for 128 x 128 on 8
    warps); with D = 64, 128 x 128 tiles on 4 warps and 3 stages (10.4 ms against 11.1 ms for
    128 x 64).  Small tiles for the CPU interpreter.  The launch order is chosen by the grid."""
    if not torch.cuda.is_available():
        tile = min(block_size, 32)
        return KernelConfig(tile, tile, 4, 1)
    if head_dim == 128:
        return KernelConfig(min(block_size, 128), min(block_size, 64), 4, 2)
    return KernelConfig(min(block_size, 128), min(block_size, 128), 4, 3)


def column_table(block_mask: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row key-block lists from a block mask, on the device, without host synchronisation.

    Args:
        block_mask: ``[B, H, nb, nb]`` bool; tiles above the diagonal are dropped.
        chunk: mask entries a program scans per step (power of two; default ``min(1024, nb)``).
    Returns:
        ``cols [B, H, nb, nb]`` int32 (the first ``counts`` entries of each row hold its kept
        key blocks in ascending order; the rest are unwritten) and ``counts [B, H, nb]`` int32.
    """
    b, h, nb, _ = block_mask.shape
    cols = torch.empty(b, h, nb, nb, dtype=torch.int32, device=block_mask.device)
    counts = torch.empty(b, h, nb, dtype=torch.int32, device=block_mask.device)
    mask = block_mask.view(torch.uint8)
    column_table_kernel[(nb, b * h)](mask, cols, counts, nb, h, *mask.stride(), *cols.stride(), *counts.stride(),
                                     CHUNK=chunk or min(1024, max(16, triton.next_power_of_2(nb))))
    return cols, counts


def _check_kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, causal: bool) -> None:
    check_prefill_inputs(q, k, v)
    check_flags(causal=causal)
    if not causal:
        raise ValueError("only causal attention is supported (causal=False was requested)")
    check_kernel_tensors(("q", q), ("k", k), ("v", v))
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v must be float16 or bfloat16, got {q.dtype}")
    check_choice(block_size, "block_size", SUPPORTED_BLOCK_SIZES)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor, *,
                           block_size: int = 128, sm_scale: float | None = None, causal: bool = True,
                           return_lse: bool = False, config: KernelConfig | None = None):
    """Causal attention over the tiles kept in ``block_mask``.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]``; fp16 or bf16, D in {64, 128}.  Any strides;
            a tensor the kernel's descriptors cannot address (stride in D other than 1, or a base
            or stride not 16-byte aligned) is copied to a contiguous one first.
        block_mask: ``[B, Hq, nb, nb]`` bool, ``nb = ceil(N / block_size)``.
        block_size: tokens per block (power of two, 16..256).
        sm_scale: softmax scale, default ``D ** -0.5``.
        causal: must be True.
        return_lse: also return ``lse [B, Hq, N]`` float32 (natural log; ``-inf`` for a row
            whose list is empty, whose output is 0).
        config: tile override (see :func:`default_config`).
    Returns:
        ``out [B, Hq, N, D]`` in q's dtype, and ``lse`` on request.  The values are not checked: a NaN among the
        scores or values a row reads makes it NaN, and so does a kept tile whose scores are all ``-inf``.
    """
    _check_kernel_inputs(q, k, v, block_size, causal)
    check_flags(return_lse=return_lse)
    check_block_mask(block_mask, q, block_size)
    b, hq, n, d = q.shape
    scale = softmax_scale(sm_scale, d)
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig (or None for default_config), got {type(config).__name__}")
    cfg = config or default_config(d, block_size)
    if block_size % cfg.block_m or block_size % cfg.block_n:
        raise ValueError(f"config tiles {cfg.block_m}x{cfg.block_n} must divide block_size {block_size}")
    q, k, v = (x if descriptor_ready(x) else x.contiguous() for x in (q, k, v))
    cols, counts = column_table(block_mask)
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device) if return_lse else out.new_empty(1, 1, 1)
    q_programs = triton.cdiv(n, cfg.block_m)
    side_by_side = heads_first(cfg, b * hq * q_programs, q.device)
    grid = (b * hq, q_programs) if side_by_side else (q_programs, b * hq)
    q_desc, out_desc = (host_descriptor(x, cfg.block_m) for x in (q, out))
    k_desc, v_desc = (host_descriptor(x, cfg.block_n) for x in (k, v))
    block_sparse_attention_kernel[grid](
        q_desc, k_desc, v_desc, out_desc, lse, cols, counts,
        scale * math.log2(math.e), n, hq, hq // k.shape[1], q_programs, *lse.stride(), *cols.stride(),
        *counts.stride(),
        HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, RETURN_LSE=return_lse,
        HEADS_FIRST=side_by_side, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return (out, lse) if return_lse else out


def flexprefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, gamma: float = 0.9,
                          tau: float = 0.1, block_size: int = 128, min_budget: int = 1024,
                          max_budget: int | None = None, sm_scale: float | None = None,
                          estimate_scale: float | None = None, budget_divisor: int | None = None,
                          union_vs_for_query_aware: bool = False, js_eps: float | None = 1e-10,
                          causal: bool = True, return_lse: bool = False, return_estimate: bool = False,
                          config: KernelConfig | None = None):
    """FlexPrefill: on-device block selection, then :func:`block_sparse_attention`.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]``; fp16 or bf16, D in {64, 128}.
        gamma: attention mass to cover, in ``(0, 1]``.  tau: JS threshold for query-aware heads.
        block_size, min_budget, max_budget: as ``art_analysis.flexprefill.select_blocks``
            (budgets in tokens).
        sm_scale: attention softmax scale, default ``D ** -0.5``.
        estimate_scale: softmax scale of the estimation, default ``sm_scale`` (upstream always
            estimates with ``D ** -0.5``).
        budget_divisor, union_vs_for_query_aware, js_eps: upstream quirk flags (see
            ``art_analysis.flexprefill``).
        return_lse: also return the LSE ``[B, Hq, N]``.
        return_estimate: also return the :class:`FlexPrefillEstimate` (mask, patterns, JS).
    Returns:
        ``out [B, Hq, N, D]``, then ``lse`` and/or the estimate when requested.
    """
    _check_kernel_inputs(q, k, v, block_size, causal)
    check_flags(return_lse=return_lse, return_estimate=return_estimate)
    scale = softmax_scale(sm_scale, q.shape[-1])
    estimate = estimate_block_mask(
        q, k, gamma=gamma, tau=tau, block_size=block_size, min_budget=min_budget, max_budget=max_budget,
        sm_scale=scale if estimate_scale is None else softmax_scale(estimate_scale, q.shape[-1], "estimate_scale"),
        budget_divisor=budget_divisor,
        union_vs_for_query_aware=union_vs_for_query_aware, js_eps=js_eps)
    result = block_sparse_attention(q, k, v, estimate.block_mask, block_size=block_size, sm_scale=scale,
                                    return_lse=return_lse, config=config)
    outputs = (result if return_lse else (result,)) + ((estimate,) if return_estimate else ())
    return outputs if len(outputs) > 1 else outputs[0]


__all__ = ["KernelConfig", "default_config", "heads_first", "column_table", "block_sparse_attention",
           "flexprefill_attention", "FlexPrefillEstimate", "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES",
           "SUPPORTED_BLOCK_SIZES"]
