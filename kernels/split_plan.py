"""The split plans of ``kernels.art_decode.art_decode``: how a call's walks are cut into programs.

The launcher takes every default from here; a caller can ask for the same plans, or cost them offline:

* the dense walk's block size (:func:`dense_block_size`) and split count (:func:`choose_num_splits`), and where
  short walks at D = 128 take 64-token blocks in one wave instead (:func:`one_wave_dense_splits`);
* an ART call's split count and the step from which its followers walk (:func:`choose_split_plan`,
  :func:`choose_follow_step`, :func:`deferred_splits`);
* told each pair's expected walk, per-pair splits (:func:`choose_pair_splits`, :func:`pair_plan`) or, where the
  walks are lopsided, on-demand followers (:func:`hint_plan`, :func:`on_demand_plan`), and the stage count of walks
  launched longest first (:func:`longest_first_three_stages`);
* what a plan keeps of the monitor: the leader's range (:func:`leader_range`), whether it can stop at all
  (:func:`leader_can_stop`), and the result steps its output holds given each pair's single walk
  (:func:`planned_result_steps`).

The schemes these plans choose between (the leader and its converged flag, deferred, per-pair and on-demand
followers, the launch order) are described, with their measurements, in ``kernels.art_decode``'s docstring and
``benchmarks/NOTES-art-decode.md``.  Plans read only the shapes, the device's multiprocessor count and the
monitor's settings (and a :class:`kernels.pair_walks.PairWalks`' walks on the host): none copies a tensor to the
host, so a call inside a CUDA-graph capture plans as any other.
"""
from __future__ import annotations

import bisect
import functools

import torch

from .art_params import ARTParams
from .art_wave import MAX_WAVE_STEPS, WAVE_WALK_MARGIN, told_wave_length
from .device_info import num_sms as _num_sms
from .int_checks import check_count
from .walk_model import shared_bandwidth_steps

DENSE_BLOCK_SIZE = 128
PAGED_DENSE_BLOCK_SIZE = 64      # dense blocks on pages of other sizes than multiples of DENSE_BLOCK_SIZE
SMALL_HEAD_DENSE_BLOCK_SIZE = 64   # dense blocks of D = 64, contiguous (V61) or paged (V63) ...
SMALL_HEAD_WIDE_BLOCK_MAX_PAIRS_PER_SM = 2   # ... but 128 where one split of them leaves <= 2 pairs per SM (V65)
TARGET_PROGRAMS_PER_SM = 1       # dense blocks of 128 tokens at D = 64 (three fit a multiprocessor, V69)
PROGRAM_START_BLOCKS = 0.75      # ... at D = 128 (one fits, V68, V69): a program's start and end, in its walk's blocks,
LONE_WAVE_PACE = 0.70            # ... and a wave's time per block, of a full wave's, however few programs it holds
SMALL_BLOCK_PROGRAMS_PER_SM = 4   # blocks of at most TMA_MAX_BLOCK tokens (two K/V stages at D = 128 above 3 per SM)
DENSE_SMALL_BLOCK_PROGRAMS_PER_SM = {64: 3, 128: 2}   # ... walked without the monitor, by head dim (V61)
TMA_MAX_BLOCK = 64
RESIDENT_AT_THREE_STAGES = 3     # programs of 64 x 128 blocks with 3 K/V stages per multiprocessor (shared memory)
RESIDENT_AT_TWO_STAGES = 4       # ... and with 2
ONE_WAVE_PROGRAMS_PER_SM = 5     # ... of the dense walk's build at 2 stages (shared memory, V69): its one-wave plan ...
ONE_WAVE_MAX_TOKENS = 8192       # ... for walks of at most this many tokens (measured at 8k; at 32k it trailed, V71)
# told each walk, 3 stages past a wave of them only where the walk model, longest first, gains this much (V45)
LONGEST_FIRST_THREE_STAGES_GAIN = 0.97
MIN_STEPS_PER_SPLIT = 4
MAX_SPLITS = 128
WAVE_FILL = 0.75
ART_STOP_MARGIN = 2        # the guessed longest walk (not told one, or told one past the dense walk): earliest stops
GUESS_REGRET_RATIO = 2     # ... and the followers deferred to it only where the dense walk takes this many times longer
GUESS_PAYS_SHARE = 0.5     # ... and, told each walk, where at least this share of them ends in the leader's range
ON_DEMAND_BLOCKS_PER_SPLIT = 32   # on_demand_plan: a split per this many blocks of the walk, ...
ON_DEMAND_SPLITS = (4, 32)        # ... within these bounds
ON_DEMAND_RELEASED_PER_SM = 8     # ... and at most this many released programs per multiprocessor
ON_DEMAND_RELEASE_FOLLOW_STEPS = 4   # ... every leader releases at this many follow steps, whatever the count, ...
ON_DEMAND_RELEASE_WALK_SHARE = 10    # ... and no earlier than this share (1 / 10) of the walk
# blocks a multiprocessor reads at the dense pace in the time of one lone monitored step (H200: 4.4 TB/s over 132
# multiprocessors, 33 GB/s each; lone steps of 0.93 us over 16 KB blocks at D = 64, 1.19 us over 32 KB at D = 128)
DENSE_BLOCKS_PER_LONE_STEP = {64: 1.9, 128: 1.2}
PAIR_SPLIT_MAX_COST = 0.9   # per-pair splits only where they cost at most this much of the single walks (V44)
PAIR_SPLIT_RANGE = 16       # blocks in each range of a split pair (V46)
PAIR_PLANS_KEPT = 64        # the latest pair plans cheapest_pair_plan keeps (a hinted call plans its walks twice)
# the wave a told call takes (told_wave_steps): its launches and evaluation, in lone steps beyond a told walk's own
# fixed time, and the blocks a multiprocessor's share of it reads and judges per lone step, by head dim (H100, V96,
# 2026-12-08-told-wave-h100.json, each pair its own wave, waves up to 400 steps: fitted as the rule's decision, inside
# the region where it takes the faster arm in all 30 shapes of the fit, [0.67, 0.79] at 2.0 and [1.21, 1.54] at 3.5;
# of the 12 validation shapes it takes the faster in 11, the other a 2 % loss)
WAVE_EXTRA_LONE_STEPS = {64: 3.5, 128: 2.0}
WAVE_BLOCKS_PER_LONE_STEP = {64: 1.35, 128: 0.73}


def dense_block_size(page_size: int | None, head_dim: int = 128, pairs: int | None = None,
                     device: torch.device | None = None) -> int:
    """The dense walk's default block size (tokens) for ``pairs`` ``(b, kv_head)`` pairs on ``device`` (both or
    neither given): ``SMALL_HEAD_DENSE_BLOCK_SIZE`` at ``D = 64`` on either layout, except ``DENSE_BLOCK_SIZE`` where
    128-token blocks fit the layout and one split of 64-token blocks would leave at most
    ``SMALL_HEAD_WIDE_BLOCK_MAX_PAIRS_PER_SM`` programs per multiprocessor (:func:`two_pairs_per_sm`); at ``D = 128``
    on the contiguous layout (``page_size=None``) and on pages that hold 128-token blocks whole ``DENSE_BLOCK_SIZE``,
    else ``PAGED_DENSE_BLOCK_SIZE``.  A block within one page takes one page-table entry and reads consecutive
    rows; across pages its rows are gathered per token, which 64-token blocks bear best (H200, B = 32 / 128 x 32k,
    the default split count: pages of 64 tokens 4.37 / 4.44 TB/s at block 64 against 4.03 / 3.98 at block 128;
    pages of 16, 4.27 / 4.38 against 4.01 / 4.02; pages of 128, 4.43 / 4.51 at block 128;
    ``benchmarks/NOTES-art-decode.md``, V29).  At ``D = 64`` a 128-token block is half the bytes of
    ``D = 128``'s, and the walk of 64-token blocks at several programs per multiprocessor was the fastest at every
    shape measured: contiguous (V61: the SmolLM2 shape at B = 8 x 32k 64.6 -> 53.9 us) and on pages of 128 tokens
    (V63: B = 8 x 32k 71.9 -> 53.5 us, 32 x 8k 59.8 -> 53.5, 128 x 8k 194.0 -> 186.8), except where about two
    pairs share a multiprocessor: two programs of 2 warps keep too few loads in flight, and one 128-token walk of
    4 warps per pair was 3-9 % faster (V65: 32 / 8 heads, 208 pairs x 32k, 428.8 -> 389.6 us, cuDNN 385.2)."""
    if (pairs is None) != (device is None):
        raise ValueError(f"dense_block_size needs pairs and device together (or neither), got pairs={pairs!r}, "
                         f"device={device!r}")
    whole_wide_blocks = page_size is None or page_size % DENSE_BLOCK_SIZE == 0
    if head_dim == 64:
        if whole_wide_blocks and pairs is not None and two_pairs_per_sm(pairs, device):
            return DENSE_BLOCK_SIZE
        return SMALL_HEAD_DENSE_BLOCK_SIZE
    if whole_wide_blocks:
        return DENSE_BLOCK_SIZE
    return PAGED_DENSE_BLOCK_SIZE


def two_pairs_per_sm(pairs: int, device: torch.device) -> bool:
    """Whether one split of the 64-dim dense plan's 64-token blocks spreads ``pairs`` pairs over the multiprocessors
    at more than ``DENSE_SMALL_BLOCK_PROGRAMS_PER_SM[64] / 2`` (the plan's split count is then 1:
    :func:`choose_num_splits`) and at most ``SMALL_HEAD_WIDE_BLOCK_MAX_PAIRS_PER_SM`` per multiprocessor."""
    sms = _num_sms(device)
    return DENSE_SMALL_BLOCK_PROGRAMS_PER_SM[64] * sms < 2 * pairs <= 2 * SMALL_HEAD_WIDE_BLOCK_MAX_PAIRS_PER_SM * sms


def choose_num_splits(batch: int, kv_heads: int, max_steps: int, device: torch.device,
                      block_size: int = DENSE_BLOCK_SIZE, head_dim: int | None = None) -> int:
    """Programs per ``(b, kv_head)`` for a walk of at most ``max_steps`` blocks, dense or ART (``kernels.art_decode``'s
    docstring), at least ``MIN_STEPS_PER_SPLIT`` blocks per split and at most ``MAX_SPLITS``.

    * Blocks of more than ``TMA_MAX_BLOCK`` tokens (the dense walk's 128) at ``D = 128`` (``head_dim`` 128 or
      None), one program per multiprocessor: :func:`wave_balanced_splits` of the multiprocessors.
    * Otherwise one wave of ``TARGET_PROGRAMS_PER_SM`` programs per multiprocessor (128-token blocks at ``D = 64``),
      ``SMALL_BLOCK_PROGRAMS_PER_SM`` (shorter blocks) or, walked without the monitor (``head_dim`` given),
      ``DENSE_SMALL_BLOCK_PROGRAMS_PER_SM[head_dim]``; rounded down unless that leaves more than a quarter of the
      multiprocessors idle.

    An ART call's followers wait for the follow step (:func:`choose_follow_step`) before they walk."""
    programs = batch * kv_heads
    sms = _num_sms(device)
    most = max(1, min(max_steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))
    if block_size > TMA_MAX_BLOCK and head_dim in (None, 128):
        return wave_balanced_splits(programs, max_steps, sms, most)
    if block_size > TMA_MAX_BLOCK:
        per_sm = TARGET_PROGRAMS_PER_SM
    else:
        per_sm = SMALL_BLOCK_PROGRAMS_PER_SM if head_dim is None else DENSE_SMALL_BLOCK_PROGRAMS_PER_SM[head_dim]
    wanted = per_sm * sms // programs
    if wanted * programs < WAVE_FILL * sms:
        wanted += 1
    return max(1, min(wanted, most))


def one_wave_small_block_splits(pairs: int, blocks: int, sms: int) -> int:
    """The split count of a dense walk of ``blocks`` 64-token blocks per pair at ``D = 128`` in one wave: the most
    splits (at least ``MIN_STEPS_PER_SPLIT`` blocks each, at most ``MAX_SPLITS``) whose ``pairs * splits`` programs
    fit one wave of ``ONE_WAVE_PROGRAMS_PER_SM`` per multiprocessor (the launcher gives such grids 2 stages above
    ``RESIDENT_AT_THREE_STAGES`` per multiprocessor); one split where even that overfills it."""
    most = max(1, min(blocks // MIN_STEPS_PER_SPLIT, MAX_SPLITS))
    return max(1, min(ONE_WAVE_PROGRAMS_PER_SM * sms // pairs, most))


def one_wave_dense_splits(pairs: int, max_len: int, head_dim: int, paged: bool, device: torch.device) -> int | None:
    """The split count of 64-token blocks that the dense plan takes instead of its 128-token walk, or ``None`` where
    it keeps that walk: on the contiguous layout at ``D = 128``, for walks of at most ``ONE_WAVE_MAX_TOKENS`` tokens
    (``max_len``) whose 128-token plan (:func:`choose_num_splits`) takes several splits in more than one wave,
    :func:`one_wave_small_block_splits`, where one split of 64-token blocks per pair fits that wave.  There a program
    of 128-token blocks holds a multiprocessor alone, and the last of several short waves walks at a lone program's
    pace, while 64-token programs share the multiprocessors five at a time in one wave.

    Measured on the H200 (``benchmarks/NOTES-art-decode.md``, V71; 32 / 8 heads, 8k tokens, us, 128-token plan ->
    this one, best peer): B = 10 88.4 -> 83.9 (89.7), 18 158.3 -> 144.6 (145.7), 20 168.6 -> 157.3 (160.3),
    22 181.6 -> 171.1, 24 192.9 -> 191.0, 26 212.9 -> 203.5, 34 280.8 -> 267.7, 36 290.2 -> 281.4, 40 313.1 ->
    304.4, 56 433.5 -> 422.8; it was not faster where the 128-token grid is one wave (B = 8: 2 splits, 68.4 against
    69.1; B = 12-16: one split, 1-5 % faster than this plan) or one split (B = 28-32, 44-48, 64: within 0.2 %, 44
    2 % faster), nor at 32k, where it trailed the 128-token plan by up to 3 % at B = 24-56."""
    sms = _num_sms(device)
    if paged or head_dim != 128 or max_len > ONE_WAVE_MAX_TOKENS or pairs > ONE_WAVE_PROGRAMS_PER_SM * sms:
        return None
    wide_steps = -(-max_len // DENSE_BLOCK_SIZE)
    wide_splits = choose_num_splits(pairs, 1, wide_steps, device, DENSE_BLOCK_SIZE, head_dim=head_dim)
    if wide_splits == 1 or pairs * wide_splits <= sms:
        return None
    return one_wave_small_block_splits(pairs, -(-max_len // TMA_MAX_BLOCK), sms)


def wave_balanced_splits(pairs: int, max_steps: int, sms: int, most: int) -> int:
    """The split count (1 to ``most``; the fewest on a tie) whose programs end soonest where each of ``sms``
    multiprocessors holds one program at a time: ``pairs`` walks of ``max_steps`` blocks in ``s`` splits run
    ``pairs * s / sms`` waves of ``ceil(max_steps / s) + PROGRAM_START_BLOCKS`` blocks each, a full wave at the
    bandwidth's pace and a last wave of ``r`` programs at ``max(LONE_WAVE_PACE, r / sms)`` of it: fewer programs
    share the bandwidth, but a lone 128-token program's walk is bound by its latency.

    Both constants were fitted, with a fixed 9 us per call and 1.86 us per block of a full wave (which do not move
    the choice), to 252 dense timings on the H200 (``D = 128``, 8-512 pairs, 8k and 32k tokens, 1-16 splits;
    ``benchmarks/NOTES-art-decode.md``, V68), which the model gives within 2.9 % (root mean square);
    one split of 144 pairs runs a wave and 12 programs at the lone pace (207 us at 8k), 8 splits nine waves of an
    eighth of the walk (156 us), while 96 pairs walk fastest in one split (95 us; 2 splits 116 us)."""
    def waves_of_blocks(splits: int) -> float:
        full, rest = divmod(pairs * splits, sms)
        waves = full + (max(LONE_WAVE_PACE, rest / sms) if rest else 0.0)
        return waves * (-(-max_steps // splits) + PROGRAM_START_BLOCKS)

    return min(range(1, most + 1), key=lambda splits: (waves_of_blocks(splits), splits))


def choose_split_plan(batch: int, kv_heads: int, max_steps: int, device: torch.device, art: ARTParams | None,
                      block_size: int, head_dim: int, longest_stop_steps: int | None = None,
                      told_walks=None) -> tuple[int, int]:
    """``(num_splits, follow_step)`` of a call at the default split count: :func:`choose_num_splits`, and with ``art``
    the follow step of :func:`choose_follow_step` (``told_walks``: the pairs' expected walks, ascending, where the
    call was told them); a call with deferred followers keeps every program resident (:func:`deferred_splits`), and
    one split has no followers (follow step 0)."""
    num_splits = choose_num_splits(batch, kv_heads, max_steps, device, block_size,
                                   head_dim=head_dim if art is None else None)
    follow_step = 0 if art is None else choose_follow_step(batch, kv_heads, max_steps, device, art, num_splits,
                                                          head_dim, longest_stop_steps=longest_stop_steps,
                                                          told_walks=told_walks)
    if follow_step:
        num_splits = min(num_splits, deferred_splits(batch * kv_heads, block_size, head_dim, device))
    return num_splits, follow_step if num_splits > 1 else 0


def choose_follow_step(batch: int, kv_heads: int, max_steps: int, device: torch.device, art: ARTParams,
                       num_splits: int, head_dim: int, longest_stop_steps: int | None = None,
                       told_walks=None) -> int:
    """The leader's step from which an ART call's followers walk (``kernels.art_decode``'s docstring, *deferred
    followers*).  Told the longest walk (``longest_stop_steps``) and the split-K dense walk would not end before it
    (:func:`dense_walk_ends_first`), that walk: walks that stop by then load no follower's block.  Otherwise the
    guess of a call not told: ``ART_STOP_MARGIN`` earliest stops, where the dense walk takes at least
    ``GUESS_REGRET_RATIO`` times the guess, else 0 (at once).  A wrong guess costs the guess on top of the dense walk
    and a right one saves the dense walk less the walks, so it is worth taking where it can save at least what it
    can cost; and a walk that runs past the guess still stops its followers when it stops, as they poll where its
    chunks end, so the guess pays also where the told longest walk outlasts the dense walk: the SmolLM2 layer at
    B = 32 x 32k (walks of 19-349 blocks, median 61; the dense walk 196 lone steps), deferred to 34 against followers
    at once, took 148.2-150.3 against 150.3-153.6 us in each of the H200's full runs V56-V79 and 165.0-168.7 against
    198.7-205.3 on three H100s (V74, V83, V86).  It saves only the blocks of walks that end in the leader's range, so
    a call told each walk (``told_walks``, ascending) takes the guess only where at least ``GUESS_PAYS_SHARE`` of
    them end there (:func:`leader_range` of ``num_splits``, before any cap on resident programs, which can only
    lengthen it): that layer's walks 92 of 96 within the leader's 129 blocks; a call whose walks outlast it pays the
    guess for nothing (not stopping at all, that layer took 1.11x the dense time at 32k deferred to the guess, V50)."""
    if num_splits == 1:
        return 0
    if longest_stop_steps is not None and not dense_walk_ends_first(batch, kv_heads, max_steps, head_dim, device,
                                                                    longest_stop_steps):
        return longest_stop_steps
    guess = expected_longest_walk(art)
    if dense_walk_ends_first(batch, kv_heads, max_steps, head_dim, device, GUESS_REGRET_RATIO * guess):
        return 0
    if told_walks is not None:    # ascending: the walks within the leader's range lead
        if bisect.bisect_right(told_walks, leader_range(max_steps, num_splits, guess)) < GUESS_PAYS_SHARE * len(
                told_walks):
            return 0
    return guess


def on_demand_plan(max_steps: int, device: torch.device, art: ARTParams) -> dict:
    """``art_decode`` keywords of on-demand followers (``num_splits``, ``follow_step``, ``release_walks``,
    ``release_step``) for walks of up to ``max_steps`` blocks: a split per ``ON_DEMAND_BLOCKS_PER_SPLIT`` blocks within
    ``ON_DEMAND_SPLITS``; the followers released once the leaders still walking alone are so few that their
    programs, ``num_splits`` each, number at most ``ON_DEMAND_RELEASED_PER_SM`` per multiprocessor, and no earlier
    than the step :func:`choose_follow_step` takes when the longest walk is not given (``ART_STOP_MARGIN`` earliest
    stops); and by every leader still walking alone at ``ON_DEMAND_RELEASE_FOLLOW_STEPS`` follow steps, or at
    ``1 / ON_DEMAND_RELEASE_WALK_SHARE`` of the walk if later, whatever the count (136 blocks for ``ARTConfig()``
    on walks of up to 1369 blocks, 204 on walks of 2048).
    Fitted to the best plans of the SmolLM2 layer at B = 128 x 8k / 32k / 128k (4-8 / 16 / 32 splits, R = 264 / 66 /
    33 on 132 multiprocessors), it took the fastest of 7 plans at 16k and one within 4.4 % of the fastest at 64k
    (``benchmarks/NOTES-art-decode.md``, V47, V48).  Over that layer's 8 decode steps it took 0.28x the dense loop at
    B = 128 x 32k and 0.72x at B = 32 x 32k, the fastest plan there, but 1.31x at B = 32 x 8k, where most walks run
    past the follow step (V49).  The release step bounds the case where too few walks stop for the count to release
    anyone (R below the pairs): at B = 32, never-stopping calls took 2.54x / 2.60x the dense time at 32k / 128k
    without it and 1.45x / 1.17x with it, and the stopping calls at B = 32 and 128 kept their times within 1 % (V51;
    a release step of 136 at 128k made B = 128 15 % slower: its released pairs have 32 splits, whose followers read
    past the stop).  Usage: ``art_decode(q, k, v, art=art, **on_demand_plan(blocks, q.device, art))``."""
    check_count(max_steps, "max_steps", 1, unit="blocks")
    if not isinstance(art, ARTParams):
        raise TypeError(f"art must be an ARTParams, got {type(art).__name__}")
    low, high = ON_DEMAND_SPLITS
    num_splits = min(max(max_steps // ON_DEMAND_BLOCKS_PER_SPLIT, low), high)
    follow_step = expected_longest_walk(art)
    return {"num_splits": num_splits, "follow_step": follow_step,
            "release_walks": ON_DEMAND_RELEASED_PER_SM * _num_sms(device) // num_splits,
            "release_step": max(ON_DEMAND_RELEASE_FOLLOW_STEPS * follow_step,
                                max_steps // ON_DEMAND_RELEASE_WALK_SHARE)}


def choose_pair_splits(batch: int, kv_heads: int, max_steps: int, device: torch.device, art: ARTParams,
                       block_size: int, head_dim: int, pair_walks) -> tuple[int, int] | None:
    """``(num_splits, threshold)`` of the per-pair splits that a call told ``pair_walks`` (a
    :class:`kernels.pair_walks.PairWalks`) takes at the default split count, or ``None`` where it takes none: where
    :func:`choose_split_plan`, told the walks' longest, takes one split, :func:`choose_pair_plan`'s if that takes
    several."""
    if choose_split_plan(batch, kv_heads, max_steps, device, art, block_size, head_dim,
                         longest_stop_steps=pair_walks.sorted_walks[-1], told_walks=pair_walks.sorted_walks)[0] > 1:
        return None
    num_splits, threshold = choose_pair_plan(pair_walks.sorted_walks, max_steps, head_dim, device)
    return (num_splits, threshold) if num_splits > 1 else None


def choose_pair_plan(sorted_walks, max_steps: int, head_dim: int, device: torch.device) -> tuple[int, int]:
    """:func:`pair_plan` on ``device``'s multiprocessors."""
    return pair_plan(sorted_walks, max_steps, head_dim, _num_sms(device))


def pair_plan(sorted_walks, max_steps: int, head_dim: int, sms: int) -> tuple[int, int]:
    """``(num_splits, threshold)`` of per-pair splits (``kernels.art_decode``'s docstring) for the expected walks
    ``sorted_walks`` (blocks, ascending, one per pair) of walks of at most ``max_steps`` blocks on ``sms``
    multiprocessors: the pairs expected to walk more than ``threshold`` blocks take every split, the others one;
    ``(1, longest)`` when no pair should.

    The split pairs' ranges are ``PAIR_SPLIT_RANGE`` (16) blocks (``splits = ceil(max_steps / 16)``, at most
    ``MAX_SPLITS``): their programs fill the multiprocessors that the single walks free, and short ranges end
    soon after the last of those.  H200, the SmolLM2 layer at B = 128, 4 K/V stages (V46,
    ``-pair-split-stages-ab.json``, ms): at 32k, threshold 115, ranges of 64 / 32 / 16 / 8 blocks 0.177 / 0.160 /
    **0.157** / 0.172; at 128k, threshold 219, ranges of 108 / 64 / 43 / 32 blocks 0.263 / 0.257 / 0.253 / 0.251;
    at 8k, threshold 69, ranges of 64 / 32 / 16 blocks 0.116 / 0.121 / 0.119 (V44's rule took ranges of half the
    threshold, at least 64 blocks).

    Each candidate threshold ``t`` (an expected walk) is costed in lone monitored steps as the longest single
    walk, or the split pairs' range, whichever is longer, plus the blocks that the call loads (the single walks'
    and every block of the split pairs) over the device's dense pace (``DENSE_BLOCKS_PER_LONE_STEP`` per
    multiprocessor): the latency of the longest walk and the bandwidth of all, taken as consecutive phases, as a
    walk that shares the bandwidth and then runs alone does.  The cheapest wins, if it costs at most
    ``PAIR_SPLIT_MAX_COST`` of the single walks (H200, V44: the SmolLM2 layer at B = 128 x 8k, costed at 0.81,
    took 0.85 of the single walks' time; the synthetic cache at B = 32 x 8k, costed at 0.99, took 1.08)."""
    return cheapest_pair_plan(sorted_walks, max_steps, head_dim, sms)[0]


def cheapest_pair_plan(sorted_walks, max_steps: int, head_dim: int, sms: int) -> tuple[tuple[int, int], float]:
    """:func:`pair_plan`'s ``(num_splits, threshold)`` and its cost in lone monitored steps (that of the single walks
    where it splits no pair).  A call given a ``walk_hint`` plans the same walks twice (:func:`hint_plan`, then
    :func:`choose_pair_splits`), each pass a Python loop over the pairs (0.18 / 0.72 ms at 384 / 1024 pairs on two
    CPU cores), so the latest plans are kept (``PAIR_PLANS_KEPT``)."""
    return _cheapest_pair_plan(tuple(sorted_walks), max_steps, head_dim, sms)


@functools.lru_cache(maxsize=PAIR_PLANS_KEPT)
def _cheapest_pair_plan(sorted_walks: tuple, max_steps: int, head_dim: int,
                        sms: int) -> tuple[tuple[int, int], float]:
    rate = DENSE_BLOCKS_PER_LONE_STEP[head_dim] * sms
    walks = [min(max(1, int(w)), max_steps) for w in sorted_walks]
    single_cost = walks[-1] + sum(walks) / rate
    splits = min(MAX_SPLITS, -(-max_steps // PAIR_SPLIT_RANGE))
    if splits < 2:
        return (1, walks[-1]), single_cost
    split_range = -(-max_steps // splits)
    best_cost, best = None, None
    loaded = 0
    for i, threshold in enumerate(walks[:-1]):
        loaded += threshold
        if walks[i + 1] == threshold:
            continue
        cost = max(threshold, split_range) + (loaded + (len(walks) - i - 1) * max_steps) / rate
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, (splits, threshold)
    if best_cost is None or best_cost > PAIR_SPLIT_MAX_COST * single_cost:
        return (1, walks[-1]), single_cost
    return best, best_cost


def hint_plan(pair_walks, max_steps: int, head_dim: int, device: torch.device, art: ARTParams,
              wave: bool = True) -> dict:
    """The keywords that a call of ``pair_walks``' ``[B, Hkv]`` pairs takes from a ``walk_hint`` whose latest walks
    are ``pair_walks`` (a :class:`kernels.pair_walks.PairWalks`; ``kernels.art_decode``'s docstring, *the hint's plan*):
    with ``wave``, ``{"wave_steps": W}`` where :func:`told_wave_steps` takes a wave; else ``{"release_walks": R}`` of
    :func:`on_demand_plan` where :func:`pair_plan` would split the pairs expected to walk long and the dense walk would
    not end before that plan does (:func:`dense_walk_ends_first`), else ``{"pair_walks": pair_walks}``."""
    batch, kv_heads = pair_walks.walks.shape
    wave_steps = told_wave_steps(pair_walks.sorted_walks, max_steps, head_dim, _num_sms(device)) if wave else 0
    if wave_steps:
        return {"wave_steps": wave_steps}
    (num_splits, _), cost = cheapest_pair_plan(pair_walks.sorted_walks, max_steps, head_dim, _num_sms(device))
    if num_splits > 1 and not dense_walk_ends_first(batch, kv_heads, max_steps, head_dim, device, cost):
        return {"release_walks": on_demand_plan(max_steps, device, art)["release_walks"]}
    return {"pair_walks": pair_walks}


def told_wave_steps(sorted_walks, max_steps: int, head_dim: int, sms: int) -> int:
    """The wave (``art_decode``'s ``wave_steps``, :mod:`kernels.art_wave`) that a call told its pairs' walks
    ``sorted_walks`` (blocks, ascending, one per pair; walks of at most ``max_steps`` blocks) takes on ``sms``
    multiprocessors, or 0 for none: its longest pair's wave.

    Each pair's wave is its told walk and ``1 / WAVE_WALK_MARGIN`` more, rounded up to ``WAVE_STEP_MULTIPLE`` steps
    (:func:`told_wave_length`; the longest at most ``MAX_WAVE_STEPS``, else none). It is taken where it costs fewer
    lone monitored steps than the walk could take at best (:func:`wave_pays`): the pairs' waves
    (:func:`told_wave_blocks`) at ``WAVE_BLOCKS_PER_LONE_STEP`` per multiprocessor and ``WAVE_EXTRA_LONE_STEPS``,
    against the longest walk at the lone pace or the dense walk of every block at ``DENSE_BLOCKS_PER_LONE_STEP``,
    whichever ends first (a told walk plan is neither shorter than its longest walk nor faster than the dense pace).
    So it pays where few pairs walk long: the wave reads their blocks at once. H100 (V96,
    ``2026-12-08-told-wave-h100.json``, ``ARTConfig()``), told each walk, with the wave against without it: synthetic
    B = 1 / 4 / 8 x 32k 19.4 / 32.2 / 50.9 us against 53.0 / 61.9 / 62.6, 8 x 8k 64.4 against 93.3; the 64-dim cache
    (9 / 3 heads) at 8 x 32k 21.3 against 47.1; the SmolLM2 layer (walks of up to 114-349 blocks, waves past one
    ``WAVE_STEP_TILE``) at 8 / 32 x 32k 33.2 / 92.9 against 74.6 / 168.2 and at 8 / 32 x 128k 33.1 / 101.1 against
    176.8 / 332.9. It refuses B = 16 (the wave 15-34 % slower) and the SmolLM2 layer at 8k up to B = 8 (the dense
    walk is short). The constants put the rule on the faster arm in all 30 shapes of that run's fit and in 11 of its
    12 validation shapes (the 64-dim cache at 48 x 48k takes the wave, 2 % slower); they are the decision's fit, not
    the wave's pace (module constants)."""
    longest = int(sorted_walks[-1])
    steps = told_wave_length(longest)
    if steps > MAX_WAVE_STEPS:
        return 0
    blocks = told_wave_blocks(sorted_walks, max_steps)
    return min(steps, max_steps) if wave_pays(blocks, longest, max_steps, head_dim, sms, len(sorted_walks)) else 0


def told_wave_blocks(sorted_walks, max_steps: int) -> int:
    """The blocks that the pairs told the walks ``sorted_walks`` (ascending) read in their own waves,
    ``sum(min(told_wave_length(w), max_steps))``: counted per wave length (multiples of ``WAVE_STEP_MULTIPLE``) by
    bisection, so that a call of many pairs plans its wave in a few steps."""
    blocks = counted = 0
    while counted < len(sorted_walks):
        length = told_wave_length(int(sorted_walks[counted]))
        # the longest walk whose wave is this long: walk + walk // margin + 1 <= length
        within = (WAVE_WALK_MARGIN * (length - 1)) // (WAVE_WALK_MARGIN + 1) + 1
        while told_wave_length(within) > length:
            within -= 1
        reach = bisect.bisect_right(sorted_walks, within, lo=counted)
        blocks += (reach - counted) * min(length, max_steps)
        counted = reach
    return blocks


def wave_pays(wave_blocks: int, longest: int, max_steps: int, head_dim: int, sms: int, pairs: int,
              extra_lone_steps: float | None = None, blocks_per_lone_step: float | None = None) -> bool:
    """Whether a wave that reads ``wave_blocks`` blocks in all (its pairs' waves together) costs fewer lone monitored
    steps on ``sms`` multiprocessors than a told walk of ``pairs`` pairs can at best, the longest walk (``longest``
    blocks) at the lone pace or the dense walk of ``max_steps`` blocks per pair (:func:`told_wave_steps`).  The
    wave's cost takes ``extra_lone_steps`` and ``blocks_per_lone_step`` where given (a refit's trial values, e.g.
    :mod:`kernels.bench_told_wave`), else ``WAVE_EXTRA_LONE_STEPS`` and ``WAVE_BLOCKS_PER_LONE_STEP`` of
    ``head_dim``."""
    extra = WAVE_EXTRA_LONE_STEPS[head_dim] if extra_lone_steps is None else extra_lone_steps
    per_step = WAVE_BLOCKS_PER_LONE_STEP[head_dim] if blocks_per_lone_step is None else blocks_per_lone_step
    wave_cost = extra + wave_blocks / (per_step * sms)
    return wave_cost < min(longest, dense_lone_steps(pairs, max_steps, head_dim, sms))


def longest_first_three_stages(sorted_walks, head_dim: int, sms: int) -> bool:
    """Whether single walks of 64-token blocks expected to load ``sorted_walks`` blocks (ascending, one per pair),
    launched longest first on ``sms`` multiprocessors, should run at 3 K/V stages where their grid exceeds a wave
    of them (``RESIDENT_AT_THREE_STAGES`` per multiprocessor; else 2 stages and ``RESIDENT_AT_TWO_STAGES``).  The
    fluid walk model (:func:`kernels.walk_model.shared_bandwidth_steps`, the bandwidth at
    ``DENSE_BLOCKS_PER_LONE_STEP``) times both slot counts; fewer slots win where they gain at least
    ``LONGEST_FIRST_THREE_STAGES_GAIN``: walks of spread lengths, whose short ones fill the slots that the long
    ones free.  H200, synthetic cache, ``ARTConfig()``, longest first (``-longest-first-stages-ab.json``, V45):
    B = 64 x 8k, modelled at 0.94, took 0.167 ms at 3 stages against 0.188 at 2; B = 128 x 8k (0.98) 0.315
    against 0.322; walks of even lengths lost 2-7 % at 3 stages (B = 64 x 32k, modelled at 1.03: 0.151 against
    0.142; B = 128 x 32k, 0.99: 0.270 against 0.264)."""
    rate = DENSE_BLOCKS_PER_LONE_STEP[head_dim] * sms
    longest_first = sorted_walks[::-1]
    three = shared_bandwidth_steps(longest_first, blocks_per_step=rate, slots=RESIDENT_AT_THREE_STAGES * sms)
    two = shared_bandwidth_steps(longest_first, blocks_per_step=rate, slots=RESIDENT_AT_TWO_STAGES * sms)
    return three <= LONGEST_FIRST_THREE_STAGES_GAIN * two


def deferred_splits(pairs: int, block_size: int, head_dim: int, device: torch.device) -> int:
    """The most programs per ``(b, kv_head)`` of a call with deferred followers: all of them stay resident while
    they wait, so the grid must fit one wave at the walk's stage count; with 64-token blocks of ``D = 128`` that
    is ``RESIDENT_AT_THREE_STAGES`` programs per multiprocessor (a larger grid gets 2 stages,
    :func:`kernels.art_decode._launch_config`, and the leaders' lone step slows with them), else ``MAX_SPLITS``."""
    if block_size == TMA_MAX_BLOCK and head_dim == 128:
        return max(1, RESIDENT_AT_THREE_STAGES * _num_sms(device) // pairs)
    return MAX_SPLITS


def dense_walk_ends_first(batch: int, kv_heads: int, max_steps: int, head_dim: int, device: torch.device,
                          lone_steps: int) -> bool:
    """Whether the split-K dense walk of ``batch * kv_heads`` walks of ``max_steps`` 64-token blocks would end within
    ``lone_steps`` steps of a lone monitored walk: the dense walk reads every block at the device's dense pace,
    ``DENSE_BLOCKS_PER_LONE_STEP[head_dim]`` blocks per multiprocessor in the time of one lone step.  H200 (V56):
    B = 1 x 128k at D = 128, 104 lone steps, 124 us, against 127.6 measured; B = 8 x 32k 207 steps, 246 us
    (245.7); the SmolLM2 layer at B = 32 x 8k, 49 steps, 46 us (55.4) and at 32k 196 steps, 182 us (193.0).
    (The rule's earlier estimate, a multiprocessor's blocks over two, read 63 steps for B = 1 x 128k.)"""
    return dense_lone_steps(batch * kv_heads, max_steps, head_dim, _num_sms(device)) <= lone_steps


def dense_lone_steps(pairs: int, max_steps: int, head_dim: int, sms: int) -> float:
    """The lone monitored steps in which the split-K dense walk reads ``pairs`` walks of ``max_steps`` 64-token blocks
    on ``sms`` multiprocessors, at ``DENSE_BLOCKS_PER_LONE_STEP[head_dim]`` blocks per multiprocessor per step."""
    return pairs * max_steps / (DENSE_BLOCKS_PER_LONE_STEP[head_dim] * sms)


def leader_can_stop(max_steps: int, num_splits: int, art: ARTParams, follow_step: int = 0) -> bool:
    """Whether the leader's range (:func:`leader_range`) reaches the walk's earliest stop
    (:func:`earliest_stop_steps`).  When it does not, no walk can stop and the monitor cannot change the result:
    :func:`kernels.art_decode.art_decode` then runs the dense walk of that split count, whose output, ``lse`` and
    ``steps`` (every program's range) are those of the monitored walk bit for bit."""
    return leader_range(max_steps, num_splits, follow_step) >= earliest_stop_steps(art)


def leader_range(blocks, num_splits: int, follow_step: int = 0):
    """Blocks in the leader's range of a walk of ``blocks`` (an int, or an int tensor of walks): the kernel gives
    the leader ``gate + (blocks - gate) // num_splits`` with ``gate = min(follow_step, blocks)``, and cuts the rest
    into balanced ranges, the longer ones (a block more) last; ``blocks // num_splits`` without deferred
    followers."""
    if isinstance(blocks, torch.Tensor):
        gate = blocks.clamp(max=follow_step)
    else:
        gate = min(blocks, follow_step)
    return gate + (blocks - gate) // num_splits


def planned_result_steps(walks: torch.Tensor, blocks, num_splits: int, follow_step: int = 0) -> torch.Tensor:
    """The result steps (``art_decode``'s ``return_result_steps``) of a plan of ``num_splits`` splits with followers
    from ``follow_step`` (at once with 0, or deferred), for pairs whose single walks are ``walks [B, Hkv]`` (int,
    in blocks; e.g. the simulator's ``stop_step + 1``) over walks of ``blocks`` (an int, or a ``[B, 1]`` int tensor
    per sequence): the walk where it ends within the leader's range (:func:`leader_range`), else the whole walk.
    Not the rule of per-pair splits or on-demand followers, whose leaders may walk past that range."""
    return torch.where(walks <= leader_range(blocks, num_splits, follow_step), walks, blocks)


def earliest_stop_steps(art: ARTParams) -> int:
    """The fewest steps a monitored walk loads: its heads are done at step ``max(1, min_steps) +
    patience - 1`` at the earliest (the leader's first chunk ends there)."""
    return max(1, art.min_steps) + art.patience


def expected_longest_walk(art: ARTParams) -> int:
    """The longest walk (blocks) that a call not told its walks plans for: ``ART_STOP_MARGIN`` earliest stops
    (:func:`earliest_stop_steps`), 34 for ``ARTConfig()``."""
    return ART_STOP_MARGIN * earliest_stop_steps(art)


def leader_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """The leader scheme over one program per multiprocessor (rounded down): the split study's
    (:func:`kernels.bench.split_study`) comparison with one split."""
    return max(1, min(_num_sms(device) // (batch * kv_heads), MAX_SPLITS))
