"""A transformers model's decode attention through the ART Triton kernel (``kernels.art_decode``).

:func:`kernel_attention` routes every decode call (query length 1) of every layer through ``art_decode`` with the
given ART rule (``None``: the kernel's dense walk), one :class:`kernels.walk_hint.LongestWalkHint` per layer
carrying each call's walks to the layer's next call, so that the split plan follows the layer's walks (and takes
on-demand followers where they are lopsided, :func:`kernels.split_plan.hint_plan`); with ``single_walk=True`` every
ART call runs in one split instead, each pair walking alone to the simulator's stop.  Prefill calls run the model's
own attention.  The hook records the share of the cached tokens each layer's calls loaded (:func:`loaded_tokens` of
the kernel's ``return_stats``: the simulator's units, visited tokens over the tokens) and, told a retrieval prompt's
``needle``, the share of query heads whose output took in a block holding a needle token (the kernel's
``return_result_steps``: the blocks that entered the output, not a follower's blocks read before its leader
stopped).  A static cache
(``generate(..., cache_implementation="static")``) works too: the kernel is given each row's filled slots as
``cache_seqlens`` (:func:`visible_lengths` of the decode mask)::

    with kernel_attention(model, ARTConfig()) as attention:
        model.generate(input_ids, max_new_tokens=32)
    attention.loaded_fraction()          # {layer: mean share of the cached tokens the decode calls loaded}

Where :class:`art_analysis.analysis.retention.RuleAttention` computes the same rule with the simulator,
this is what a served model runs: the kernel's float32 online recurrence, its plan and its loads.  The kernel reads
each sequence's first ``cache_seqlens`` keys, so a batch must not be left-padded (hidden keys before visible ones); on
the CPU it runs in Triton's interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is imported), whose bf16 dot
is wrong: run the model in float32 or float16 there.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from kernels.int_checks import check_flags

from .attention_override import override_attention
from .orders import check_token_range, traversal_order, walkable_blocks, walks_reading
from .termination import ARTConfig

KERNEL_ATTENTION_TAG = "art_kernel"


@dataclass
class KernelAttention:
    """The attention hook of :func:`kernel_attention` (for :func:`art_analysis.attention_override.override_attention`).

    ``art``: the rule (an :class:`~art_analysis.termination.ARTConfig` or ``kernels.art_params.ARTParams``), or
    ``None`` for the kernel's dense walk; ``order``: the blocks' traversal order; ``walk_hints``: carry each layer's
    walks to its next call; ``single_walk``: every ART call in one split with no hint, so that each pair walks
    alone from its first block and stops where the simulator's rule does at every length (the production plan's
    followers can read more, and a released pair takes the whole attention); ``needle``: a ``[start, end)`` token
    range (a retrieval prompt's needle).
    ``loaded[layer]`` holds, per decode call of that layer, the cached tokens its programs loaded over the cached
    tokens (:func:`loaded_tokens` of ``return_stats``; 1.0 for dense calls); with ``needle``, ``needle_read[layer]``
    the share of query heads whose output took in a block holding a needle token (the leading steps of the
    traversal order that entered it, ``return_result_steps``), as the simulator's
    :class:`art_analysis.analysis.retention.RuleAttention` records it."""

    art: object = None
    order: str = "sink_recency"
    walk_hints: bool = True
    single_walk: bool = False
    needle: tuple[int, int] | None = None
    loaded: dict = field(default_factory=dict, init=False)
    needle_read: dict = field(default_factory=dict, init=False)
    hints: dict = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        from kernels.art_decode import ORDERS
        from kernels.art_params import ARTParams

        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS} (the kernel's), got {self.order!r}")
        if isinstance(self.art, ARTConfig):
            self.art = self.art.kernel_params()
        if self.art is not None and not isinstance(self.art, ARTParams):
            raise TypeError(f"art must be an ARTConfig, a kernels.art_params.ARTParams or None, got "
                            f"{type(self.art).__name__}")
        check_flags(walk_hints=self.walk_hints, single_walk=self.single_walk)
        if self.needle is not None:
            self.needle = check_token_range(self.needle)

    def __call__(self, base, module, query, key, value, attention_mask, scaling=None, **kwargs):
        if query.shape[2] != 1:
            return base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        from kernels.art_decode import ART_BLOCK_SIZE, art_decode
        from kernels.walk_hint import LongestWalkHint

        check_full_attention(kwargs, "kernel_attention")
        lengths = visible_lengths(attention_mask, key.shape[0], key.shape[2])
        layer = getattr(module, "layer_idx", None)
        hint, splits = None, None
        if self.single_walk and self.art is not None:
            splits = 1
        elif self.walk_hints and self.art is not None:
            hint = self.hints.setdefault(layer, LongestWalkHint())
        out, steps, *taken = art_decode(query[:, :, 0], key, value, cache_seqlens=lengths, sm_scale=scaling,
                                        art=self.art, order=self.order, walk_hint=hint, num_splits=splits,
                                        return_stats=True,
                                        return_result_steps=self.needle is not None and self.art is not None)
        if self.needle is not None:   # every KV head serves as many query heads: the share over KV heads
            needle_share = self._needle_share(taken[0] if taken else None, lengths, key.shape)
            self.needle_read.setdefault(layer, []).append(needle_share)
        if self.art is None:      # the dense walk loads every cached token
            share = 1.0
        else:
            cached = key.shape[2] if lengths is None else lengths.to(torch.int64)[:, None]       # [B, 1]
            tokens = loaded_tokens(steps.sum(-1, dtype=torch.int64), cached, ART_BLOCK_SIZE, self.order)  # [B, Hkv]
            total = tokens.numel() * key.shape[2] if lengths is None else int(lengths.sum()) * key.shape[1]
            share = float(tokens.sum()) / total
        self.loaded.setdefault(layer, []).append(share)
        return out[:, None], None

    def _needle_share(self, result_steps: torch.Tensor | None, lengths: torch.Tensor | None, key_shape) -> float:
        """Share of the ``[B, Hkv]`` walks whose first ``result_steps`` steps (of ``ART_BLOCK_SIZE``-token blocks in
        ``order``; ``None``: a dense call, every block) visit a needle block; ``lengths``: each row's cached tokens
        (``None``: all ``key_shape[2]``)."""
        from kernels.art_decode import ART_BLOCK_SIZE

        batch, kv_heads, keys = key_shape[:3]
        if lengths is None:
            lengths = torch.full((batch,), keys, dtype=torch.int64)
        walkable = walkable_blocks(lengths, kv_heads, -(-keys // ART_BLOCK_SIZE), ART_BLOCK_SIZE)
        block_ids = traversal_order(self.order, walkable)                                       # [B, Hkv, T]
        steps = walkable.sum(-1) if result_steps is None else result_steps.to(walkable.device)
        return float(walks_reading(block_ids, steps, self.needle, ART_BLOCK_SIZE).double().mean())

    def loaded_fraction(self) -> dict:
        """``{layer: mean loaded share over its decode calls}``."""
        return {layer: sum(shares) / len(shares) for layer, shares in self.loaded.items()}

    def reset(self) -> None:
        """Forget the recorded calls (``loaded``, ``needle_read``) and the layers' walk hints, so that a hook used
        again, on other sequences, records and plans as a new one (the hints would carry the last sequences' walks
        into the next call's split plan)."""
        self.loaded.clear()
        self.needle_read.clear()
        self.hints.clear()


def loaded_tokens(blocks: torch.Tensor, length, block_size: int, order: str) -> torch.Tensor:
    """The cached tokens in the ``blocks`` (any shape, int64) that each ``(b, kv_head)``'s programs loaded of a cache of
    ``length`` tokens (an int, or an int64 tensor that broadcasts to ``blocks``: each pair's length) walked in
    ``block_size``-token blocks in ``order``: every block holds ``block_size`` tokens but the newest, which holds
    the rest.  A pair that loaded every block loaded ``length``.  Otherwise, walking ``"sink_recency"``, two or
    more blocks include the newest, the order's second: the leader's range holds the head of the order.  Walking
    ``"sequential"``, the blocks are taken as whole, so that a follower that walked its range to the newest block
    counts that block's padding too (at most ``block_size - 1`` tokens over)."""
    length = torch.as_tensor(length, dtype=blocks.dtype, device=blocks.device)
    whole = blocks * block_size
    if order == "sink_recency":
        whole = torch.where(blocks >= 2, whole - (-length % block_size), whole)
    return torch.where(blocks >= -(-length // block_size), length, whole)


def check_full_attention(kwargs: dict, hook: str) -> None:
    """A decode hook computes full causal attention: ``ValueError`` for a layer with a sliding window or logit
    soft-capping (``kwargs`` of the attention call), which it would silently leave out."""
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(f"{hook} runs full causal attention: layers with a sliding window or logit soft-capping "
                         "are not supported")


def visible_lengths(attention_mask, batch: int, keys: int, hook: str = "kernel_attention") -> torch.Tensor | None:
    """Each row's cached tokens, from a decode call's ``attention_mask`` (``[B or 1, 1, 1, >= keys]``, bool with
    True visible, or additive with negative values hidden) over its ``keys`` cached keys: ``None`` when every key is
    visible (a dynamic cache), else int32 ``[batch]`` when each row's visible keys are its first ones (a static
    cache, whose slots past each row's tokens are hidden).  A mask that hides a key before a visible one (a
    left-padded batch) is refused: the decode ``hook`` (named in the errors) reads each row's first keys."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[-1] < keys or attention_mask.shape[0] not in (1, batch):
        raise ValueError(f"{hook}: a decode call's attention_mask must be [B or 1, 1, 1, >= {keys} keys] for "
                         f"B = {batch}, got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[..., -1, -keys:]
    visible = (mask if mask.dtype == torch.bool else mask >= 0).reshape(-1, keys).expand(batch, keys)
    lengths = visible.sum(-1, dtype=torch.int32)
    prefix = torch.arange(keys, device=visible.device)[None, :] < lengths[:, None]
    if not torch.equal(visible, prefix):
        raise ValueError(f"{hook} needs a batch without left padding: it reads each row's first cached keys, and "
                         "this decode mask hides keys before visible ones")
    if bool((lengths == 0).any()):
        raise ValueError(f"{hook}: a decode row's mask hides every cached key")
    return None if bool((lengths == keys).all()) else lengths


@contextmanager
def kernel_attention(model, art=None, *, order: str = "sink_recency", walk_hints: bool = True,
                     single_walk: bool = False, needle: tuple[int, int] | None = None) -> Iterator[KernelAttention]:
    """Route ``model``'s decode attention through ``kernels.art_decode`` with ``art`` (module docstring) for the
    duration of the block; yields the :class:`KernelAttention` hook, whose ``loaded`` (and, told a ``needle`` token
    range, ``needle_read``) the calls fill."""
    hook = KernelAttention(art=art, order=order, walk_hints=walk_hints, single_walk=single_walk, needle=needle)
    with override_attention(model, hook, KERNEL_ATTENTION_TAG):
        yield hook
