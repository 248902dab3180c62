"""`kernels.walk_hint.LongestWalkHint`: what each kind of call's stats tell the split rule, on the CPU
(interpreter) and, with ``pytest -m gpu``, through the pinned copy that never waits."""
from __future__ import annotations

import pytest
import torch

from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import ARTConfig
from kernels.art_decode import art_decode
from kernels.pair_walks import PairWalks
from kernels.split_plan import earliest_stop_steps, hint_plan, on_demand_plan
from kernels.walk_hint import LongestWalkHint

ART = ARTConfig().kernel_params()


def stats(*programs: list[int]) -> torch.Tensor:
    """``steps [1, len(programs), splits]`` int32: the blocks each split of each KV head loaded."""
    return torch.tensor([programs], dtype=torch.int32)


def test_records_take_the_longest_walk_a_stopped_leader_or_a_whole_walk():
    hint = LongestWalkHint()
    assert hint.steps is None
    hint.record(stats([40], [12]))                         # one split: the walks
    assert hint.steps == 40
    hint.record(stats([3]))                                # however short
    assert hint.steps == 3
    hint.record(stats([20, 22, 22, 22], [17, 19, 19, 19]))  # leaders that stopped; followers cut short
    assert hint.steps == 20
    hint.record(stats([20, 22, 22, 22], [30, 30, 31, 31]))  # the second leader ran its range: a walk of 122
    assert hint.steps == 122
    hint.record(stats([8, 8, 8], [0, 1, 1]))               # a dense call's ranges (and a walk shorter than its splits)
    assert hint.steps == 24
    # deferred followers from step 30: the leader holds 30 + (N - 30) // splits blocks
    hint.record(stats([33, 0, 0], [34, 5, 6]), follow_step=30)   # stopped before / after the followers started
    assert hint.steps == 34
    hint.record(stats([35, 5, 6], [34, 0, 0]), follow_step=30)   # 46 blocks: the first leader ran its range
    assert hint.steps == 46
    with pytest.raises(ValueError, match="follow_step must be an int >= 0"):
        hint.record(stats([3]), follow_step=-1)


def test_bad_stats_are_refused():
    hint = LongestWalkHint()
    with pytest.raises(ValueError, match=r"\[B, Hkv, splits\] int32, got \(1, 2, 1\) torch.int64"):
        hint.record(stats([5], [6]).long())
    with pytest.raises(ValueError, match=r"got \(2, 1\)"):
        hint.record(stats([5], [6])[0])
    with pytest.raises(ValueError, match="got list"):
        hint.record([[[5]]])
    assert hint.steps is None
    hint.record(stats([7], [9]))
    # counts that no call returns: a plan from them would defer the followers to step -5 or switch the monitor off
    for bad in (stats([-5], [9]), stats([0, 0], [4, 4])):
        with pytest.raises(ValueError, match="a walk of (-5|0) blocks, and every walk loads at least one"):
            hint.record(bad)
    assert hint.steps == 9 and hint.pair_walks.sorted_walks == (7, 9)       # the refused records left no trace


def _inputs(device, dtype, seqlen):
    cache = synthetic_cache(batch=2, num_q_heads=6, num_kv_heads=2, seqlen=seqlen, head_dim=64, preset="realistic",
                            seed=11, dtype=dtype, device=device)
    return cache.q, cache.k, cache.v


def test_real_calls_report_their_longest_walk_at_any_split_count():
    q, k, v = _inputs(torch.device("cpu"), torch.float16, 4096)                     # 64 blocks
    _, single = art_decode(q, k, v, art=ART, num_splits=1, return_stats=True)
    walks = single[..., 0]
    assert 32 > int(walks.min()) and int(walks.max()) > 32                          # some stop in a half, some not
    hint = LongestWalkHint()
    hint.record(single)
    assert hint.steps == int(walks.max())
    _, halves = art_decode(q, k, v, art=ART, num_splits=2, return_stats=True)       # leader scheme, ranges of 32
    stopped = walks < 32
    assert torch.equal(halves[..., 0][stopped], walks[stopped])
    hint.record(halves)
    assert hint.steps == 64                                                         # a leader ran its whole range
    hint.record(halves[stopped][None])                                              # the pairs whose leader stopped
    assert hint.steps == int(walks[stopped].max())
    patient = ARTConfig(tau=1e9, phi=2.0, patience=30).kernel_params()              # stable at once, 31 > 64 / 3
    _, dense = art_decode(q, k, v, art=patient, num_splits=3, return_stats=True)    # runs the dense walk
    hint.record(dense)
    assert hint.steps == 64


def test_a_call_given_the_hint_takes_its_walk_and_records_its_own():
    q, k, v = _inputs(torch.device("cpu"), torch.float16, 4096)                     # 64 blocks
    _, single = art_decode(q, k, v, art=ART, num_splits=1, return_stats=True)
    hint = LongestWalkHint()
    _, steps = art_decode(q, k, v, art=ART, num_splits=3, follow_step=20, walk_hint=hint, return_stats=True)
    walks = single[..., 0]
    leader = 20 + 44 // 3
    expected = torch.where(walks <= leader, walks, torch.full_like(walks, 64)).max()
    assert hint.steps == int(expected)
    art_decode(q, k, v, walk_hint=hint)                                             # dense: nothing to record
    assert hint.steps == int(expected)


@pytest.mark.gpu
def test_gpu_record_lands_without_a_wait_and_refuses_a_capture():
    device = torch.device("cuda")
    q, k, v = _inputs(device, torch.bfloat16, 32768)
    hint = LongestWalkHint()
    walks = []
    for _ in range(3):
        _, steps = art_decode(q, k, v, art=ART, num_splits=1, longest_stop_steps=hint.steps, return_stats=True)
        hint.record(steps)
        walks.append(int(steps[..., 0].max()))
    torch.cuda.synchronize()
    assert hint.steps == walks[-1] and earliest_stop_steps(ART) <= walks[-1] < 512
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        with torch.cuda.graph(graph):
            _, steps = art_decode(q, k, v, art=ART, num_splits=1, return_stats=True)
            hint.record(steps)
    with pytest.raises(RuntimeError, match="walk_hint cannot record inside a CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            art_decode(q, k, v, art=ART, num_splits=1, walk_hint=hint)           # refused before the launch


def test_the_hint_carries_each_pairs_walk_and_a_call_of_that_shape_takes_it(record_decode_launches):
    hint = LongestWalkHint()
    assert hint.pair_walks is None
    hint.record(stats([20, 22, 22, 22], [17, 19, 19, 19], [30, 30, 31, 31]))
    walks = hint.pair_walks
    assert walks.walks.tolist() == [[20, 17, 122]] and walks.sorted_walks == (17, 20, 122) and hint.steps == 122
    # a call with per-pair splits: pairs walked alone (a leader that stopped, one that ran the whole walk) and split
    # pairs (a leader that stopped in its range, one that ran its range of 42)
    hint.record(stats([40, 0, 0], [128, 0, 0], [12, 16, 16]))
    assert hint.pair_walks.walks.tolist() == [[40, 128, 12]]
    hint.record(stats([40, 0, 0], [128, 0, 0], [42, 43, 43]))
    assert hint.pair_walks.walks.tolist() == [[40, 128, 128]]
    q, k, v = (torch.zeros(1, 6, 64, dtype=torch.float16), *[torch.zeros(1, 3, 8192, 64, dtype=torch.float16)] * 2)
    launches = record_decode_launches()
    # walks whose split would cost more than the dense walk (most blocks are walked): the pair walks, not on demand.
    # (Each call records its own steps, which the recorded launches leave unwritten: record the walks again.)
    for call in (lambda: art_decode(q, k, v, art=ART, walk_hint=hint),               # [1, 3]: the pair walks
                 lambda: art_decode(q[:, :4], k[:, :2], v[:, :2], art=ART, walk_hint=hint),   # [1, 2]: the longest
                 lambda: art_decode(q, k, v, art=ART, walk_hint=hint, longest_stop_steps=40)):  # told: no pair walks
        hint.record(stats([90, 0, 0], [90, 0, 0], [128, 0, 0]))
        call()
    gates = [call.kwargs["PAIR_GATES"] for call in launches.calls]
    assert gates == [True, False, False]
    # the recorded walks' launch order (longest first) goes to the call that takes them, and to no other
    assert [call.kwargs["LONGEST_FIRST"] for call in launches.calls] == [True, False, False]
    order = launches.calls[0].args[launches.kernel.arg_names.index("order_ptr")]
    assert order.tolist() == [2, 0, 1]   # walks [90, 90, 128]
    assert not any(call.kwargs["ON_DEMAND"] for call in launches.calls)


def test_a_hint_of_lopsided_walks_takes_on_demand_followers(record_decode_launches):
    """Walks of which a few run far longer than the rest, where the dense walk would take longer than splitting the
    long ones, take on-demand followers from a hint (told the same walks as ``pair_walks``, the call splits those
    pairs); walks that end about together, or that cover most blocks, do not.  The plan is ``hint_plan``'s."""
    q, k, v = (torch.zeros(1, 6, 64, dtype=torch.float16), *[torch.zeros(1, 3, 8192, 64, dtype=torch.float16)] * 2)
    cpu = torch.device("cpu")
    lopsided, even, full = (PairWalks.from_walks(torch.tensor(w, dtype=torch.int32))
                            for w in ([[40, 128, 128]], [[38, 40, 41]], [[90, 90, 128]]))
    release = on_demand_plan(128, cpu, ART)["release_walks"]
    assert hint_plan(lopsided, 128, 64, cpu, ART) == {"release_walks": release}
    assert hint_plan(even, 128, 64, cpu, ART) == {"pair_walks": even}
    assert hint_plan(full, 128, 64, cpu, ART) == {"pair_walks": full}
    launches = record_decode_launches()
    hint = LongestWalkHint()
    hint.record(lopsided.walks[..., None])
    art_decode(q, k, v, art=ART, walk_hint=hint)                           # (records its unwritten steps)
    art_decode(q, k, v, art=ART, pair_walks=lopsided)                      # told the walks: per-pair splits
    hint.record(even.walks[..., None])
    art_decode(q, k, v, art=ART, walk_hint=hint)
    on_demand, told, ended_together = launches.calls
    assert on_demand.kwargs["ON_DEMAND"] and not on_demand.kwargs["PAIR_GATES"] and not on_demand.kwargs[
        "LONGEST_FIRST"]
    assert on_demand.args[launches.kernel.arg_names.index("pair_limit")] == release
    assert on_demand.grid == (3, on_demand_plan(128, cpu, ART)["num_splits"])
    assert told.kwargs["PAIR_GATES"] and not told.kwargs["ON_DEMAND"]
    assert not ended_together.kwargs["ON_DEMAND"] and ended_together.kwargs["LONGEST_FIRST"]


def test_on_demand_calls_record_each_pairs_blocks(record_decode_launches):
    """A pair whose followers were never released walked in its leader alone; a released one counts every block its
    programs loaded.  A real on-demand call given the hint records so, and the next call takes the plan of those
    walks."""
    hint = LongestWalkHint()
    hint.record(stats([30, 0, 0, 0], [128, 0, 0, 0], [80, 16, 16, 16]), on_demand=True)
    assert hint.pair_walks.walks.tolist() == [[30, 128, 128]] and hint.steps == 128
    q, k, v = _inputs(torch.device("cpu"), torch.float16, 4096)                     # 64 blocks, 4 pairs
    _, single = art_decode(q, k, v, art=ART, num_splits=1, return_stats=True)
    _, steps = art_decode(q, k, v, art=ART, num_splits=3, follow_step=30, release_walks=4, walk_hint=hint,
                          return_stats=True)
    walks = single[..., 0]
    released = steps[..., 1:].any(-1)
    assert bool(released.any()) and not bool(released.all())
    assert torch.equal(steps[~released][..., 0], walks[~released])                  # the single walks
    assert hint.pair_walks.walks.tolist() == steps.sum(-1).tolist()
    assert torch.equal(hint.pair_walks.walks[released], torch.full_like(walks[released], 64))   # ran past its share
    planned = hint_plan(hint.pair_walks, 64, 64, torch.device("cpu"), ART)   # before the call records its own
    launches = record_decode_launches()
    art_decode(q, k, v, art=ART, walk_hint=hint)
    assert launches.calls[0].kwargs["ON_DEMAND"] == ("release_walks" in planned)


def test_a_hint_of_walks_that_end_together_keeps_them_and_a_few_whole_walks_go_on_demand(fake_sms):
    """On 132 multiprocessors (the H200's), the simulator's walks of the synthetic 32/8 caches at 8k (ARTConfig(),
    30-65 blocks, about together) never take on-demand followers from a hint, at B = 1 to 128 (at B = 1 and 8 the told
    wave, of 64 and 80 steps, each pair reading its own walk and an eighth: at B = 1 392 blocks, 6.1 lone steps
    against the dense walk's 6.5; V96, on an H100: 20.3 against 20.4 us and 64.4 against 93.3); with a few pairs
    walking the whole cache at B = 128 they do."""
    from art_analysis.blockwise import blockwise_attention
    from art_analysis.termination import stop

    fake_sms(132)
    cpu = torch.device("cpu")
    cache = synthetic_cache(batch=2, num_q_heads=32, num_kv_heads=8, seqlen=8192, head_dim=128, preset="realistic",
                            dtype=torch.float32)
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64, order="sink_recency", mode="kernel")
    walks = (stop(trace, ARTConfig()).stop_step.view(2, 8, 4).amax(-1) + 1).to(torch.int32)
    assert 25 <= int(walks.min()) and int(walks.max()) <= 70
    for batch in (1, 8, 32, 128):
        tiled = PairWalks.from_walks(walks.repeat(max(1, batch // 2), 1)[:batch].contiguous())
        expected = {1: {"wave_steps": 64}, 8: {"wave_steps": 80}}.get(batch, {"pair_walks": tiled})
        assert hint_plan(tiled, 128, 128, cpu, ART) == expected, batch
    lopsided = walks.repeat(64, 1)
    lopsided[:4] = 128
    assert "release_walks" in hint_plan(PairWalks.from_walks(lopsided), 128, 128, cpu, ART)


def test_pair_walks_refuse_tensors_the_kernel_would_misread():
    walks = torch.tensor([[3, 9], [5, 1]], dtype=torch.int32)
    host = walks.to(torch.int64)
    assert PairWalks.of(walks, host).launch_order.tolist() == [1, 2, 0, 3]
    for order, message in (
            (torch.tensor([1, 2, 0], dtype=torch.int32), "a launch order of the walks' 4 pairs"),
            (torch.tensor([1, 2, 0, 3], dtype=torch.int64), "launch_order must be a contiguous 1-D int32 tensor"),
            (torch.tensor([1, 2, 0, 7], dtype=torch.int32), "must be a permutation of the pairs 0 .. 3"),
            (torch.tensor([0, 0, 1, 2], dtype=torch.int32), "must be a permutation of the pairs 0 .. 3"),
            (torch.arange(8, dtype=torch.int32)[::2], "launch_order must be a contiguous 1-D int32 tensor")):
        with pytest.raises(ValueError, match=message):
            PairWalks.of(walks, host, order)
    with pytest.raises(ValueError, match="walks must be a contiguous 2-D int32 tensor"):
        PairWalks.of(walks.t(), host)
    with pytest.raises(ValueError, match="as many host walks"):
        PairWalks.of(walks, host[:1])
