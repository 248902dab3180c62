"""`kernels.walk_model.shared_bandwidth_ms`: the fluid model of sequential walks sharing the bandwidth."""
from __future__ import annotations

import pytest

from kernels.walk_model import shared_bandwidth_ms

BLOCK = 1_000_000            # bytes per step: 1 TB/s moves one block per microsecond


def model(steps, *, step_us=1.0, fixed_us=0.0, tb_per_s=1e6, slots=1000):
    return shared_bandwidth_ms(steps, step_us=step_us, fixed_us=fixed_us, block_bytes=BLOCK,
                               bandwidth_tb_per_s=tb_per_s, slots=slots)


def test_a_lone_walk_takes_its_steps_at_the_lone_pace_plus_the_fixed_time():
    assert model([40], step_us=1.25, fixed_us=5.0) == pytest.approx((40 * 1.25 + 5.0) / 1e3)


def test_equal_walks_past_the_bandwidth_take_their_bytes_over_it():
    # 100 walks of 30 blocks at 10 TB/s: 10 blocks per us in all, 3000 blocks -> 300 us (lone pace: 30 us)
    assert model([30] * 100, tb_per_s=10.0) == pytest.approx(0.300)


def test_a_long_walk_speeds_up_once_the_short_ones_end():
    # 4 walks share 2 blocks per us: 0.5 each until the three 1-block walks end (2 us), then the last
    # walk's 2 remaining blocks at the lone pace (1 per us): 4 us
    assert model([1, 1, 1, 3], tb_per_s=2.0) == pytest.approx(0.004)
    # the same walks at unlimited bandwidth: the longest walk alone
    assert model([1, 1, 1, 3]) == pytest.approx(0.003)


def test_walks_wait_for_a_slot_in_launch_order():
    assert model([2, 2, 2], slots=2) == pytest.approx(0.004)       # the third starts when the first two end
    assert model([1, 5, 1, 1], slots=2) == pytest.approx(0.005)    # the short ones pass through the free slot
    assert model([5, 1, 1, 1], slots=2) == pytest.approx(0.005)
    assert model([1, 1, 1, 5], slots=2) == pytest.approx(0.006)    # the long one comes last: 1 + 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(walk_steps=[]), "at least one walk"),
    (dict(walk_steps=[3, 0]), "at least one block"),
    (dict(step_us=0.0), "step_us"),
    (dict(block_bytes=0), "block_bytes"),
    (dict(bandwidth_tb_per_s=-1.0), "bandwidth_tb_per_s"),
    (dict(fixed_us=-1.0), "fixed_us"),
    (dict(slots=0), "slots"),
    (dict(slots=2.0), "slots"),
])
def test_bad_arguments_are_named(kwargs, message):
    args = dict(walk_steps=[3], step_us=1.0, fixed_us=0.0, block_bytes=BLOCK, bandwidth_tb_per_s=1.0, slots=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        shared_bandwidth_ms(**args)
