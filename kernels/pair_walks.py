"""Each ``(b, kv_head)``'s expected ART walk, for per-pair splits: the walks expected to run long take every split.

When the pairs fill the GPU (``B * Hkv`` at or above a wave of leaders), ``art_decode``'s split plan runs every
walk as one program: there is no room for followers on every pair, and the call then lasts as long as its longest
walk at about the lone pace.  A real layer's walks are lopsided: on the SmolLM2 layer tiled to B = 128 x 32k, 22 of
384 walks run 187-484 blocks and the rest at most 122, so the call took 0.483 ms where the same layer's walks at 8k
(at most 128 blocks) took 0.146 (``benchmarks/NOTES-art-decode.md``, V44).  Told each pair's walk, the launcher
gives the pairs expected to run past a threshold every split at once (the leader scheme, for those pairs only) and
keeps the others single (:func:`kernels.split_plan.choose_pair_plan`)::

    walks = PairWalks.from_walks(steps[..., 0])     # a single-split call's stats, or the simulator's stops + 1
    out = art_decode(q, k, v, art=art, pair_walks=walks)

A :class:`PairWalks` holds the walks twice: on the call's device, where the kernel reads each pair's, and sorted on
the host, where the launcher plans the split count and threshold without reading the device.  Making one reads the
tensor once (a device sync); a call that takes it reads nothing, so it can be captured in a CUDA graph.

It also holds the *launch order*: the pairs by expected walk, longest first.  A call told the walks dispatches its
programs in that order, so that where the grid is more than one wave the longest walks start first and the short
ones fill the multiprocessors as they free up, instead of a long walk starting late and ending last (the classic
longest-processing-time-first rule; ``kernels.art_decode``, *launch order*).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PairWalks:
    """``walks [B, Hkv]`` (int32, on the call's device): the blocks each ``(b, kv_head)``'s monitored walk is
    expected to load; ``sorted_walks``: the same values on the host, ascending; ``launch_order [B * Hkv]`` (int32,
    on the device): the pairs (``b * Hkv + kv_head``) by expected walk, longest first, equal walks in pair order.

    The kernel reads both tensors as they are, so they are checked here: contiguous int32 on one device, the
    walks ``[B, Hkv]`` with ``B * Hkv`` host values, the order ``[B * Hkv]``, and on the CPU a permutation of the
    pairs.  On a CUDA device that last check would wait for the device; there an order is taken as given
    (:meth:`from_walks` and :class:`kernels.walk_hint.LongestWalkHint` make it with :func:`longest_first`)."""

    walks: torch.Tensor
    sorted_walks: tuple[int, ...]
    launch_order: torch.Tensor
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, t, dims in (("walks", self.walks, 2), ("launch_order", self.launch_order, 1)):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == dims and t.is_contiguous()):
                described = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"PairWalks.{name} must be a contiguous {dims}-D int32 tensor, got {described}")
        pairs = self.walks.numel()
        if self.launch_order.device != self.walks.device or self.launch_order.numel() != pairs \
                or len(self.sorted_walks) != pairs:
            raise ValueError(f"PairWalks needs a launch order of the walks' {pairs} pairs on their device "
                             f"{self.walks.device} and as many host walks, got an order of "
                             f"{self.launch_order.numel()} on {self.launch_order.device} and {len(self.sorted_walks)}")
        if self.launch_order.device.type == "cpu" and not torch.equal(
                torch.sort(self.launch_order).values, torch.arange(pairs, dtype=torch.int32)):
            raise ValueError(f"PairWalks.launch_order must be a permutation of the pairs 0 .. {pairs - 1}")

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()``, evaluated once per ``key`` for these walks (the launcher's plans from them, which a decode
        step's calls of one layer would otherwise repeat)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @classmethod
    def of(cls, walks: torch.Tensor, host: torch.Tensor, order: torch.Tensor | None = None) -> PairWalks:
        """From ``walks [B, Hkv]`` (int32, on the call's device), the same values already on the host, and their
        :func:`longest_first` (queued here when not given; no sync either way)."""
        return cls(walks, tuple(sorted(host.flatten().tolist())), longest_first(walks) if order is None else order)

    @classmethod
    def from_walks(cls, walks: torch.Tensor) -> PairWalks:
        """From a ``[B, Hkv]`` integer tensor of walks in blocks, each at least 1 (e.g. ``steps[..., 0]`` of an
        ``art_decode`` call with ``num_splits=1`` and ``return_stats``); reads it once (a sync on a device)."""
        if not isinstance(walks, torch.Tensor) or walks.dim() != 2 or walks.numel() == 0 \
                or walks.dtype.is_floating_point or walks.dtype.is_complex or walks.dtype == torch.bool:
            described = (f"{tuple(walks.shape)} {walks.dtype}" if isinstance(walks, torch.Tensor)
                         else type(walks).__name__)
            raise ValueError(f"walks must be a non-empty [B, Hkv] integer tensor of blocks, got {described}")
        host = walks.detach().to("cpu", torch.int64)
        if int(host.min()) < 1 or int(host.max()) >= 2 ** 31:
            raise ValueError(f"every expected walk must be in [1, 2**31) blocks, got [{int(host.min())}, "
                             f"{int(host.max())}]")
        return cls.of(walks.detach().to(torch.int32).contiguous(), host)


def longest_first(walks: torch.Tensor) -> torch.Tensor:
    """The launch order of pairs with expected walks ``walks [B, Hkv]`` (on their device, no sync): ``[B * Hkv]``
    int32 pair indices by walk, longest first, equal walks in pair order."""
    return torch.argsort(walks.flatten(), descending=True, stable=True).to(torch.int32)
