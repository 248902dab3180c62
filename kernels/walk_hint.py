"""The ART walks of a layer's previous ``art_decode`` call (the longest, and each pair's), carried to its next call
without a sync.

``art_decode``'s default split plan does not know how long the monitored walks will run; it takes twice the
earliest possible stop (``ART_STOP_MARGIN``), which fits the synthetic caches and not a real model's layers: on
8 distinct SmolLM2 sequences at B = 32 x 32k the longest walk runs 349 steps, and the single split that the rule
took then was 1.64x the dense call (``benchmarks/NOTES-art-decode.md``, V38; since V41 the followers are deferred
to that guess instead, 0.153 ms against the dense 0.202).  Told the longest walk (``longest_stop_steps``), the plan
starts the followers at once there (0.160 ms), and walks persist from one decode step to the next well enough for the
previous step's longest walk to give the same choice in 207-210 of 210 (layer, step) pairs of the SmolLM2
captures (V36, ``art_analysis.analysis.walk_persistence``); timed over a layer's 8 decode steps at B = 32, it took
the calibrated split count in 7 of 8 and the loop ran at 0.79x the dense loop's time at 32k (V40,
:mod:`kernels.bench_decode_loop`).  One :class:`LongestWalkHint` per layer carries it::

    hints = [LongestWalkHint() for _ in range(num_layers)]
    ...                                                          # in each decode step, for each layer
    out = art_decode(q, k, v, art=art, walk_hint=hints[layer])

``art_decode`` takes the hint's latest walk as ``longest_stop_steps``, and plans the call from its latest walk of
each pair (:func:`kernels.split_plan.hint_plan`): the wave where few pairs walk short (:mod:`kernels.art_wave`,
:func:`kernels.split_plan.told_wave_steps`), else on-demand followers where those walks are lopsided, else the walks
as ``pair_walks`` (per-pair splits where the pairs fill the GPU: :mod:`kernels.pair_walks`); it records the call's
walks into it (by hand: ``**hint_plan(hint.pair_walks, ...)``, then ``hint.record(steps, follow_step=...,
on_demand=...)`` with the call's ``return_stats``, follow step and whether it released on demand, and after a wave
``wave=(result_steps, plan.wave_blocks)`` with its ``return_result_steps`` and :func:`kernels.art_decode.plan_decode`'s
plan).
:meth:`LongestWalkHint.record` reduces the call's ``steps`` to each pair's walk on the device and copies those
``B * Hkv`` numbers to pinned host memory without blocking; :attr:`LongestWalkHint.steps` and
:attr:`LongestWalkHint.pair_walks` take the latest record whose copy has landed (event queries, never a wait) and
otherwise keep the values before it.  The hint lags by as many calls as the host runs ahead of the GPU, and it never
stalls the stream.
"""
from __future__ import annotations

from collections import deque

import torch

from .int_checks import check_count
from .pair_walks import PairWalks, longest_first
from .split_plan import leader_range


class LongestWalkHint:
    """The longest walk (blocks) of the latest recorded ``art_decode`` call of one layer whose stats have reached
    the host; ``None`` until one has.

    A call's ``steps [B, Hkv, splits]`` (``return_stats``) hold the blocks each program loaded.  With one split
    that is each ``(b, kv_head)``'s walk.  With several, split 0 (the leader) holds the range of
    :func:`kernels.split_plan.leader_range` (``N // splits`` of the walk's ``N`` blocks, or with deferred
    followers the follow step more): a leader that stopped loaded its walk, at most that many blocks; a leader
    that reached the end of its range without stopping (and every program of a call that ran the dense walk,
    where no leader could stop) loaded the whole range, the other programs theirs, ``N`` blocks in all.  So a
    pair's walk is taken as ``steps.sum(-1)`` where ``steps[..., 0]`` is the leader's range of that many blocks
    (a walk that did not stop in the leader's range, counted as all its blocks: at least as long as it is), else
    as ``steps[..., 0]``; with one split both are the same.  (A leader that stopped on its range's last block, or
    whose followers' blocks happen to meet that equality, counts the same way: more blocks than its walk, which
    leans the split rule towards the dense split count, the slower side only where walks are short.)
    """

    def __init__(self):
        self._steps: int | None = None
        self._pair_walks: PairWalks | None = None
        # records in stream order: each pair's walk on the device, its pinned host copy, its launch order, and the
        # copy's event
        self._pending: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.Event]] = deque()

    @property
    def steps(self) -> int | None:
        """The longest walk of the latest record whose copy has landed (pass it as ``longest_stop_steps``)."""
        self._take_landed()
        return self._steps

    @property
    def pair_walks(self) -> PairWalks | None:
        """Each ``(b, kv_head)``'s walk of the same record (pass it as ``pair_walks``; ``art_decode`` given this hint
        takes it where its shape is the call's)."""
        self._take_landed()
        return self._pair_walks

    def _take_landed(self) -> None:
        while self._pending and self._pending[0][3].query():
            self._set(*self._pending.popleft()[:3])

    def _set(self, walks: torch.Tensor, host: torch.Tensor, order: torch.Tensor | None = None) -> None:
        pair_walks = PairWalks.of(walks, host, order)
        if pair_walks.sorted_walks[0] < 1:   # every pair walks a block at least (cache_seqlens >= 1)
            raise ValueError(f"LongestWalkHint: a recorded call's steps give a (b, kv_head) a walk of "
                             f"{pair_walks.sorted_walks[0]} blocks, and every walk loads at least one: record the "
                             "return_stats of an art_decode call (blocks loaded per program) with its follow_step")
        self._pair_walks = pair_walks
        self._steps = pair_walks.sorted_walks[-1]

    def record(self, steps: torch.Tensor, follow_step: int = 0, on_demand: bool = False,
               wave: tuple[torch.Tensor, int | torch.Tensor] | None = None) -> None:
        """Take the walks of a call's ``steps [B, Hkv, splits]`` (int32, ``return_stats``) made with ``follow_step``
        (``art_decode``'s, 0 without deferred followers), with ``on_demand``, on-demand followers, and after a wave
        ``wave`` (:func:`pair_walk_lengths`).  On a CUDA device the reduction and a non-blocking copy to pinned memory
        are queued on the current stream; on the CPU the value is taken at once.  Not inside a CUDA-graph capture (a
        replay would not record).  Stats that give a pair a walk of no block (negative or all-zero counts: not a
        call's) raise ``ValueError`` when the values are taken: here on the CPU, else at the first read of
        :attr:`steps` or :attr:`pair_walks` after the copy has landed (which drops that record)."""
        if not isinstance(steps, torch.Tensor) or steps.dim() != 3 or steps.dtype != torch.int32 or steps.numel() == 0:
            described = (f"{tuple(steps.shape)} {steps.dtype}" if isinstance(steps, torch.Tensor)
                         else type(steps).__name__)
            raise ValueError(f"steps must be art_decode's return_stats tensor [B, Hkv, splits] int32, got {described}")
        check_count(follow_step, "follow_step", 0)
        walks = pair_walk_lengths(steps, follow_step, on_demand, wave)
        if steps.device.type != "cuda":
            self._pending.clear()
            self._set(walks, walks)
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("LongestWalkHint.record cannot run inside a CUDA-graph capture: its copy to the host "
                               "would only happen at capture time; a captured call's split count is fixed anyway")
        host = torch.empty(walks.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(walks, non_blocking=True)
        order = longest_first(walks)   # queued with the record, in stream order
        landed = torch.cuda.Event()
        landed.record()
        self._pending.append((walks, host, order, landed))


def pair_walk_lengths(steps: torch.Tensor, follow_step: int = 0, on_demand: bool = False,
                      wave: tuple[torch.Tensor, int | torch.Tensor] | None = None) -> torch.Tensor:
    """Each ``(b, kv_head)``'s walk (``[B, Hkv]`` int32 on ``steps``' device) of a call's ``steps [B, Hkv, splits]``
    made with ``follow_step``, counted as :class:`LongestWalkHint` describes.  A call with per-pair splits counts the
    same way: a pair walked alone has its whole walk in its leader's range.  A call with on-demand followers
    (``on_demand``) counts each pair's blocks, all its programs' together: a pair whose followers were never released
    loaded its walk in its leader alone, and a released pair's count (the whole walk where its leader ran past its
    share) is at least its walk from the release on, whose length its steps do not tell.

    After a wave (``art_decode``'s ``wave_steps``), ``wave`` is ``(wave_result [B, Hkv], wave_blocks)``: each pair's
    result steps where the wave finished it (its walk), else 0, and the blocks of each walk the wave read (an int,
    ``[B, 1]`` or ``[B, Hkv]``), which every leader's ``steps`` count before its own walk; the other pairs count as
    above.  ``wave_result`` may also be the call's ``return_result_steps``: every pair then counts by those."""
    if wave is not None:
        wave_result, wave_blocks = wave
        wave_blocks = torch.as_tensor(wave_blocks, dtype=steps.dtype, device=steps.device).expand(steps.shape[:-1])
        steps = torch.cat([steps[..., :1] - wave_blocks[..., None], steps[..., 1:]], dim=-1)
    total = steps.sum(-1, dtype=torch.int32)
    if on_demand:
        walks = total
    else:
        leader = steps[..., 0]
        walks = torch.where(leader == leader_range(total, steps.shape[-1], follow_step), total, leader)
    if wave is not None:
        walks = torch.where(wave_result > 0, wave_result, walks)
    return walks.contiguous()


def longest_walk(steps: torch.Tensor, follow_step: int = 0) -> torch.Tensor:
    """The longest walk (a 0-dim int32 tensor on ``steps``' device) of a call's ``steps [B, Hkv, splits]`` made with
    ``follow_step``: the longest of :func:`pair_walk_lengths`."""
    return pair_walk_lengths(steps, follow_step).max()
