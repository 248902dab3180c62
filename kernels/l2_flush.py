"""How a timed call finds the L2 in the benchmarks: cold, and clean (``"read"``) or dirty (``"memset"``).

``triton.testing.do_bench`` empties the L2 before every timed call, so that no input is cached there, with a memset
of a 256 MB scratch buffer (its driver's ``clear_cache``).  The memset leaves the L2 full of dirty lines, and the
timed kernel pays for writing them back.  On the H200, the dense kernel and cuDNN SDPA took 7.5-20.4 us longer
after the memset than after a read of the same buffer (median 9.8 us over their 18 rows, 14 of them 8.4-11.1;
``benchmarks/results/2026-12-02-art-decode-l2-flush.json``).  For example, dense B = 1, S = 32k went from 48.2 to
38.8 us and synthetic ART at 32 x 32k from 88.1 to 78.4 us.  A call that reads less paid part of it: the dense
replay of the ART walks at 1 x 128k, 9 MB, 0.4 us.  A decode step's attention follows kernels that write a few MB
at most (the projections, the cache append), so in a model its L2 holds little dirty data.

Under :func:`l2_flush` ``("read")``, do_bench empties the L2 by reading its buffer (a sum) instead.  The inputs are
as cold as after the memset, and no write-back is charged to the timed kernel.  ``"memset"`` leaves do_bench as it
is.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import triton

L2_FLUSHES = ("read", "memset")


def read_flush(cache) -> None:
    """Empty the L2 of other data by reading ``cache`` (do_bench's 256 MB scratch tensor): clean lines only."""
    cache.sum()


@contextmanager
def l2_flush(kind: str) -> Iterator[None]:
    """Within the block, ``triton.testing.do_bench`` empties the L2 before each timed call as ``kind`` says
    (``"read"``: :func:`read_flush`; ``"memset"``: do_bench's own memset)."""
    if kind not in L2_FLUSHES:
        raise ValueError(f"the L2 flush must be one of {L2_FLUSHES}, got {kind!r}")
    driver = triton.runtime.driver.active
    if kind == "memset":
        yield
        return
    memset = driver.clear_cache
    driver.clear_cache = read_flush
    try:
        yield
    finally:
        driver.clear_cache = memset
