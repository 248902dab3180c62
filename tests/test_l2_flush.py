"""The benchmarks' L2 flush: do_bench empties the L2 by a read under ``l2_flush("read")``, by its memset otherwise."""
import pytest
import triton
import triton.testing

from kernels.l2_flush import l2_flush, read_flush


class ScratchBuffer:
    """Stands for do_bench's 256 MB scratch tensor: records how it was used."""

    def __init__(self):
        self.used = []

    def zero_(self):
        self.used.append("zero_")

    def sum(self):
        self.used.append("sum")


class FakeDriver:
    """Stands for the active driver: its ``clear_cache`` is do_bench's memset."""

    def clear_cache(self, cache):
        cache.zero_()


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(triton.runtime.driver, "_active", fake)
    return fake


def fake_do_bench(fn, warmup, rep, return_mode):
    """Clears the cache as do_bench does before a timed call, through the active driver, then calls ``fn`` once
    (whose result is the "time")."""
    cache = ScratchBuffer()
    triton.runtime.driver.active.clear_cache(cache)
    return fn(cache.used)


def test_a_read_flush_reads_the_scratch_buffer_and_the_memset_is_restored_after(driver):
    cache = ScratchBuffer()
    with l2_flush("read"):
        triton.runtime.driver.active.clear_cache(cache)
    assert cache.used == ["sum"]
    triton.runtime.driver.active.clear_cache(cache)
    assert cache.used == ["sum", "zero_"]
    with l2_flush("memset"):
        triton.runtime.driver.active.clear_cache(cache)
    assert cache.used == ["sum", "zero_", "zero_"]
    read_flush(cache)
    assert cache.used[-1] == "sum"


def test_the_memset_is_restored_when_the_timed_block_raises(driver):
    with pytest.raises(RuntimeError, match="kernel failed"):
        with l2_flush("read"):
            raise RuntimeError("kernel failed")
    cache = ScratchBuffer()
    triton.runtime.driver.active.clear_cache(cache)
    assert cache.used == ["zero_"]


def test_an_unknown_flush_is_refused(driver):
    with pytest.raises(ValueError, match="one of"):
        with l2_flush("write"):
            pass


def test_the_benchmarks_time_after_a_read_unless_told_the_memset(driver, monkeypatch):
    import kernels.bench as bench

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    # the "time" is 1 when the buffer was read, 2 when it was zeroed
    def timed(used):
        return {("sum",): 1.0, ("zero_",): 2.0}[tuple(used)]

    assert bench.median_ms(timed, 1) == 1.0
    assert bench.median_ms(timed, 1, flush="memset") == 2.0
    with pytest.raises(ValueError, match="one of"):
        bench.median_ms(timed, 1, flush="none")
