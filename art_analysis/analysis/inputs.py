"""What every analysis runs on: one decode attention call per layer, from a capture or a synthetic cache.

Each study accepts a *source*: a :class:`~art_analysis.capture.KVCapture` (every captured layer
at one decode step), a :class:`~art_analysis.synthetic.SyntheticCache` (one "layer" 0), or a
sequence of :class:`DecodeInput` (or plain tuples in its field order, ``sm_scale`` optional).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..blockwise import BlockTrace, blockwise_attention, check_decode_call
from ..policies.quest import group_block_bounds


class DecodeInput(NamedTuple):
    """One decode attention call.

    Attributes:
        q: ``[B, Hq, D]`` decode queries.
        k, v: ``[B, Hkv, S, D]``.
        cache_seqlens: ``[B]`` int valid tokens.
        queries: ``[B, Hq, n, D]`` recent queries for query-aware policies, or ``None``.
        layer: the model layer (0 for a synthetic cache).
        num_layers: the model's layer count (1 for a synthetic cache).
        sm_scale: the softmax scale the model used (a capture's :attr:`~art_analysis.capture.KVCapture.sm_scale`),
            or ``None`` for ``D ** -0.5``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache_seqlens: torch.Tensor
    queries: torch.Tensor | None
    layer: int
    num_layers: int
    sm_scale: float | None = None

    def trace(self, *, order: str = "sink_recency", block_size: int = 64, mode: str = "exact") -> BlockTrace:
        """The simulator's walk of this call, at its ``sm_scale``; ``order="importance"`` walks blocks by
        :func:`~art_analysis.policies.quest.group_block_bounds` (Quest's key bound), highest first."""
        scores = None
        if order == "importance":
            scores = group_block_bounds(self.q, self.k, self.v, block_size=block_size,
                                        cache_seqlens=self.cache_seqlens)
        return blockwise_attention(self.q, self.k, self.v, block_size=block_size, order=order,
                                   cache_seqlens=self.cache_seqlens, sm_scale=self.sm_scale, mode=mode,
                                   block_scores=scores)


def decode_inputs(source, step: int = -1) -> list[DecodeInput]:
    """The decode calls of ``source`` (see the module docstring); ``step`` picks a capture's decode
    step (negative counts from the end).  A capture's calls carry its softmax scale.  Each call is checked as
    :func:`~art_analysis.blockwise.check_decode_call` checks a walk's inputs, and ``cache_seqlens`` left ``None``
    is filled in (``S``)."""
    return [call._replace(cache_seqlens=check_decode_call(call.q, call.k, call.v, call.cache_seqlens,
                                                          call.sm_scale)[0])
            for call in _decode_calls(source, step)]


def _decode_calls(source, step: int) -> list[DecodeInput]:
    from ..capture import KVCapture
    from ..synthetic import SyntheticCache

    if isinstance(source, KVCapture):
        return [DecodeInput(*call, sm_scale=source.sm_scale) for call in source.policy_inputs(step)]
    if isinstance(source, SyntheticCache):
        batch, _, seqlen, _ = source.k.shape
        lengths = torch.full((batch,), seqlen, dtype=torch.int32, device=source.k.device)
        return [DecodeInput(source.q, source.k, source.v, lengths, source.q[:, :, None], 0, 1)]
    if isinstance(source, DecodeInput):
        return [source]
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)) and source:
        calls = []
        fields = DecodeInput._fields
        for call in source:
            if isinstance(call, DecodeInput):
                calls.append(call)
            elif isinstance(call, tuple) and len(fields) - 1 <= len(call) <= len(fields):
                calls.append(DecodeInput(*call))
            else:
                raise TypeError(f"a source sequence must hold DecodeInput or tuples of {len(fields) - 1} or "
                                f"{len(fields)} items ({', '.join(fields)}; sm_scale optional), "
                                f"got {type(call).__name__}")
        return calls
    raise TypeError("source must be a KVCapture, a SyntheticCache or a non-empty sequence of DecodeInput, "
                    f"got {type(source).__name__}")


def traces(source, *, order: str = "sink_recency", block_size: int = 64, step: int = -1) -> list[BlockTrace]:
    """``[call.trace(...) for call in decode_inputs(source, step)]``."""
    return [call.trace(order=order, block_size=block_size) for call in decode_inputs(source, step)]
