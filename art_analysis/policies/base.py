"""The policy base class and the validated inputs every policy selects from.

A KV-selection policy maps a KV cache (and, for query-aware methods, recent queries) to the
KV blocks it keeps per ``(b, kv_head)``.  Blocks are the unit the simulator and the decode
kernel walk: block ``j`` of sequence ``b`` covers tokens ``[j * bs, min((j + 1) * bs, L_b))``
with ``L_b = cache_seqlens[b]``; blocks with no valid token are never kept.

Shapes: ``k, v [B, Hkv, S, D]``; ``queries [B, Hq, Nq, D]`` (``Hq % Hkv == 0``; query head
``h`` reads KV head ``h // (Hq // Hkv)``); the selection is ``BoolTensor [B, Hkv, nb]`` with
``nb = ceil(S / block_size)``.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from ..checks import (check_block_size, check_cache_seqlens, check_finite, check_finite_cache, check_kv_cache,
                      valid_token_mask)
from .budget import Budget, budget_tokens, check_budget, tokens_to_blocks


@dataclass(frozen=True)
class SelectionInputs:
    """What a policy sees, validated once by :meth:`SelectionPolicy.select`.

    Attributes:
        k, v: ``[B, Hkv, S, D]`` KV cache.
        queries: ``[B, Hq, Nq, D]`` observation-window / recent decode queries, or ``None``.
        layer, num_layers: the layer the cache belongs to and the model's layer count, or ``None``.
        block_size: tokens per block.
        seqlens: ``LongTensor [B]`` valid tokens per sequence.
    """

    k: torch.Tensor
    v: torch.Tensor
    queries: torch.Tensor | None
    layer: int | None
    num_layers: int | None
    block_size: int
    seqlens: torch.Tensor

    @property
    def num_blocks(self) -> int:
        """``nb = ceil(S / block_size)``."""
        return math.ceil(self.k.shape[2] / self.block_size)

    @property
    def block_tile(self) -> int:
        """Token slots per block in :meth:`to_blocks`: ``block_size``, or ``S`` where one block holds the whole cache
        (a ``block_size`` past ``S`` is not padded to, however large)."""
        return min(self.block_size, self.k.shape[2])

    @property
    def group_size(self) -> int:
        """Query heads per KV head (needs ``queries``)."""
        return self.queries.shape[1] // self.k.shape[1]

    @property
    def valid_tokens(self) -> torch.Tensor:
        """``BoolTensor [B, S]``: token ``i`` of sequence ``b`` is valid when ``i < L_b``."""
        return valid_token_mask(self.seqlens, self.k.shape[2])

    @property
    def blocks_per_sequence(self) -> torch.Tensor:
        """``LongTensor [B]``: blocks holding at least one valid token, ``ceil(L_b / bs)``."""
        return tokens_to_blocks(self.seqlens, self.block_size)

    @property
    def valid_blocks(self) -> torch.Tensor:
        """``BoolTensor [B, nb]``: blocks holding at least one valid token."""
        ids = torch.arange(self.num_blocks, device=self.k.device)
        return ids[None, :] < self.blocks_per_sequence[:, None]

    def every_valid_block(self) -> torch.Tensor:
        """``BoolTensor [B, Hkv, nb]``: every block holding a valid token, for every KV head."""
        return self.valid_blocks[:, None, :].expand(-1, self.k.shape[1], -1).clone()

    def first_blocks(self, count: int) -> torch.Tensor:
        """``BoolTensor [B, nb]``: the oldest ``count`` valid blocks of every sequence."""
        ids = torch.arange(self.num_blocks, device=self.k.device)
        return (ids[None, :] < count) & self.valid_blocks

    def newest_blocks(self, count: torch.Tensor | int) -> torch.Tensor:
        """``BoolTensor [B, nb]``: the newest ``count`` (int or ``[B]``) valid blocks of every sequence."""
        ids = torch.arange(self.num_blocks, device=self.k.device)
        count = torch.as_tensor(count, device=self.k.device).expand(self.seqlens.shape[0])
        start = self.blocks_per_sequence - count
        return (ids[None, :] >= start[:, None]) & self.valid_blocks

    def to_blocks(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """Split the token axis ``dim`` (length ``S``) into ``[nb, bs]`` (``bs`` = :attr:`block_tile`), zero-padded
        past ``S``.

        For example ``[B, Hkv, S, D]`` -> ``[B, Hkv, nb, bs, D]`` with ``dim=2``.
        """
        dim = dim % x.dim()
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, self.num_blocks * self.block_tile - x.shape[dim]]
        return torch.nn.functional.pad(x, pad).unflatten(dim, (self.num_blocks, self.block_tile))

    @property
    def valid_block_tokens(self) -> torch.Tensor:
        """``BoolTensor [B, nb, bs]`` (``bs`` = :attr:`block_tile`): which slots of every block hold a valid token."""
        return self.to_blocks(self.valid_tokens.to(torch.uint8), dim=1).bool()

    def block_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum per-token values ``[B, ..., S]`` into per-block values ``[B, ..., nb]`` (invalid tokens count 0)."""
        valid = self.valid_block_tokens.view(x.shape[0], *([1] * (x.dim() - 2)), self.num_blocks, self.block_tile)
        blocks = self.to_blocks(x, dim=-1)
        return torch.where(valid, blocks, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


class SelectionPolicy(ABC):
    """Base of every policy: validates the inputs, then calls :meth:`keep_blocks`.

    Subclasses are dataclasses whose fields are the method's hyper-parameters (checked in
    ``__post_init__``); ``name`` is the registry key and ``needs_queries`` says whether
    :meth:`select` requires ``queries``.
    """

    name: ClassVar[str]
    needs_queries: ClassVar[bool] = False

    def select(self, k: torch.Tensor, v: torch.Tensor, *, queries: torch.Tensor | None = None,
               layer: int | None = None, num_layers: int | None = None, block_size: int = 64,
               cache_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks kept per ``(b, kv_head)``.

        Args:
            k, v: ``[B, Hkv, S, D]`` KV cache.
            queries: ``[B, Hq, Nq, D]`` queries that attend to the whole cache (an observation
                window or recent decode queries; pass a decode query ``q [B, Hq, D]`` as
                ``q[:, :, None]``).  Required by query-aware methods.
            layer, num_layers: layer index in ``[0, num_layers)`` and layer count, for
                layer-aware methods.
            block_size: tokens per block.
            cache_seqlens: ``[B]`` integer valid tokens per sequence, in ``[1, S]`` (default ``S``).

        Returns:
            ``BoolTensor [B, Hkv, ceil(S / block_size)]``; blocks without a valid token are ``False``.
        """
        inputs = validate_inputs(k, v, queries=queries, layer=layer, num_layers=num_layers,
                                 block_size=block_size, cache_seqlens=cache_seqlens)
        if self.needs_queries and queries is None:
            raise ValueError(f"policy {self.name!r} scores blocks with queries: pass queries [B, Hq, Nq, D] "
                             "(for a decode query q [B, Hq, D], queries=q[:, :, None])")
        return self.keep_blocks(inputs)

    @abstractmethod
    def keep_blocks(self, inputs: SelectionInputs) -> torch.Tensor:
        """``BoolTensor [B, Hkv, nb]`` from validated inputs."""

    def with_sm_scale(self, sm_scale: float | None) -> SelectionPolicy:
        """This policy scoring at ``sm_scale`` (e.g. the model's, from a capture): a copy with that ``sm_scale``
        where the policy has an ``sm_scale`` field left at ``None`` (``D ** -0.5``); else the policy itself
        (no softmax scores, a scale of its own, or ``sm_scale=None``)."""
        if sm_scale is None or "sm_scale" not in {f.name for f in fields(self)} or self.sm_scale is not None:
            return self
        return replace(self, sm_scale=sm_scale)

    @property
    def spec(self) -> str:
        """``"name:field=value,..."`` listing every field; :func:`art_analysis.policies.parse_spec` reads it back."""
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
        return f"{self.name}:{params}" if params else self.name


@dataclass(frozen=True)
class BudgetPolicy(SelectionPolicy):
    """A policy that keeps a budget of each sequence (see :mod:`~art_analysis.policies.budget`).

    ``budget`` is checked and normalised here (``int`` tokens or ``float`` fraction); a subclass that checks more
    fields calls ``super().__post_init__()`` first.

    Attributes:
        budget: tokens (int) or fraction of each sequence (float in ``(0, 1]``).
    """

    budget: Budget

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", check_budget(self.budget))

    def kept_block_counts(self, inputs: SelectionInputs) -> torch.Tensor:
        """The blocks kept per sequence, ``N_b = ceil(T_b / block_size)``: ``LongTensor [B]``."""
        return tokens_to_blocks(budget_tokens(self.budget, inputs.seqlens), inputs.block_size)


def validate_inputs(k, v, *, queries, layer, num_layers, block_size, cache_seqlens) -> SelectionInputs:
    """Check shapes, dtypes and devices at the public boundary and build :class:`SelectionInputs`."""
    check_kv_cache(k, v)
    batch, kv_heads, seqlen, dim = k.shape
    check_block_size(block_size)
    if queries is not None:
        if not isinstance(queries, torch.Tensor) or not queries.is_floating_point():
            raise TypeError("queries must be a floating-point torch.Tensor [B, Hq, Nq, D]")
        if queries.dim() != 4:
            raise ValueError(f"queries must be [B, Hq, Nq, D] (a decode query q [B, Hq, D] is q[:, :, None]), "
                             f"got shape {tuple(queries.shape)}")
        if queries.shape[0] != batch or queries.shape[3] != dim:
            raise ValueError(f"queries [B, Hq, Nq, D] must match k's B={batch} and D={dim}, "
                             f"got {tuple(queries.shape)}")
        if queries.shape[1] % kv_heads or queries.shape[1] == 0 or queries.shape[2] == 0:
            raise ValueError(f"queries need Hq a positive multiple of Hkv={kv_heads} and Nq >= 1, "
                             f"got {tuple(queries.shape)}")
        if queries.device != k.device:
            raise ValueError(f"queries must be on k's device {k.device}, got {queries.device}")
        check_finite(queries=queries)
    for name, value in (("layer", layer), ("num_layers", num_layers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if layer is not None and num_layers is not None and layer >= num_layers:
        raise ValueError(f"layer must lie in [0, num_layers={num_layers}), got {layer}")
    seqlens = check_cache_seqlens(cache_seqlens, batch, seqlen, k.device)
    check_finite_cache(k, v, seqlens)
    inputs = SelectionInputs(k=k, v=v, queries=queries, layer=layer, num_layers=num_layers,
                             block_size=block_size, seqlens=seqlens)
    return inputs
