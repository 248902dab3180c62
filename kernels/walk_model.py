"""How long one launch of sequential monitored walks takes when they share the memory bandwidth: a fluid model.

A monitored walk is sequential (its step ``t`` waits for step ``t - 1``'s check), so an ART call cannot end
before its longest walk has run; and while many walks run at once, each gets only its share of the
bandwidth.  The model joins the two limits.  The walks are admitted in launch order, at most ``slots`` at
a time (a finished walk's slot goes to the next).  While ``n`` walks run, each advances at

    min(1 / step_us, bandwidth / (block_bytes * n))      blocks per microsecond,

the lone walk's pace or its equal share of the bandwidth, whichever is slower.  The call takes the time
until the last walk ends, plus ``fixed_us`` (launch, first loads, epilogue: the intercept of the lone walk).

It is a reference for a measured time, not a bound: it assumes the bandwidth is shared evenly and fully
used, and that no walk runs faster than a lone one.  A measured time well above it points at the kernel's
scheduling; a time close to it says that only a faster step, or shorter walks, can shorten the call.
``kernels.bench`` reports it for every single-split ART row (``model_ms``).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from .int_checks import check_count


def shared_bandwidth_ms(walk_steps: Sequence[int], *, step_us: float, fixed_us: float, block_bytes: int,
                        bandwidth_tb_per_s: float, slots: int) -> float:
    """Modelled time in ms of a launch whose programs walk ``walk_steps`` blocks each (launch order).

    Args:
        walk_steps: blocks each program loads, one entry per program, at least 1 each.
        step_us: time per block of a lone walk (``kernels.bench.lone_walk_latency``), > 0.
        fixed_us: fixed time of a launch, >= 0.
        block_bytes: bytes one step reads (its K and V tiles), > 0.
        bandwidth_tb_per_s: the memory bandwidth the walks share, > 0.
        slots: programs resident at once, >= 1.
    """
    for name, value in (("step_us", step_us), ("block_bytes", block_bytes), ("bandwidth_tb_per_s", bandwidth_tb_per_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not fixed_us >= 0:
        raise ValueError(f"fixed_us must be >= 0, got {fixed_us!r}")
    blocks_per_step = bandwidth_tb_per_s * 1e6 * step_us / block_bytes
    return (shared_bandwidth_steps(walk_steps, blocks_per_step=blocks_per_step, slots=slots) * step_us
            + fixed_us) / 1e3


def shared_bandwidth_steps(walk_steps: Sequence[int], *, blocks_per_step: float, slots: int) -> float:
    """The same model in lone steps, without the fixed time: ``blocks_per_step`` is the blocks the bandwidth
    serves in one lone step (> 0), so that each of ``n`` running walks advances ``min(1, blocks_per_step / n)``
    blocks per lone step.  ``walk_steps`` and ``slots``: as :func:`shared_bandwidth_ms`."""
    steps = [int(n) for n in walk_steps]
    if not steps:
        raise ValueError("walk_steps must hold at least one walk")
    if min(steps) < 1:
        raise ValueError(f"every walk loads at least one block, got {min(steps)}")
    if not blocks_per_step > 0:
        raise ValueError(f"blocks_per_step must be > 0, got {blocks_per_step!r}")
    check_count(slots, "slots", 1)
    # every running walk advances alike, so a walk ends when the common progress reaches its start + length
    progress, elapsed = 0.0, 0.0
    waiting = iter(steps)
    running = [float(n) for n in (next(waiting) for _ in range(min(slots, len(steps))))]
    heapq.heapify(running)
    while running:
        pace = min(1.0, blocks_per_step / len(running))   # blocks per lone step, per walk
        end = heapq.heappop(running)
        elapsed += (end - progress) / pace
        progress = end
        admitted = next(waiting, None)
        if admitted is not None:
            heapq.heappush(running, progress + admitted)
    return elapsed
