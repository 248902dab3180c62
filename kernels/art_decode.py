"""ART flash-decoding: the launcher of ``art_decode_split_kernel`` (one launch, split-K combine included).

``art_decode(q, k_cache, v_cache, ...)`` computes decode attention for one new token per
sequence over a contiguous (``[B, Hkv, S, D]``) or paged (``[num_pages, page_size, Hkv, D]`` +
``block_table [B, max_pages]``) KV cache with ragged ``cache_seqlens``, walking each
``(b, kv_head)``'s KV blocks in a traversal order (``sequential`` or ``sink_recency``).  With
``art=ARTParams(...)`` the ART monitor runs after every block (rule: ``kernels.art_params``;
reference: the simulator ``art_analysis.blockwise`` in ``mode="kernel"`` evaluated by
``art_analysis.termination.stop`` with ``group="all"``) and the walk ends once every query
head of the group is done: the walk runs in chunks that end at the earliest step at which the
group can be done (``kernels.art_decode_kernel``), so no block past the stop step is loaded or
computed.  ``art=None`` compiles the monitor out (the dense baseline).  The launcher's default plans (block
sizes, split counts, follow steps, per-pair splits, on-demand followers) are ``kernels.split_plan``'s.

**Split scheme (leader + converged flag).**  A sequence's walk of ``N`` steps is cut into
``num_splits`` contiguous ranges of the *traversal order*, one program each, combined by a
log-sum-exp merge: ranges of ``N // num_splits`` steps, the ``N % num_splits`` longer ones (a step more) last,
so that the leader, the one program that restarts its pipeline where it could first stop, holds one of the
shortest (V33).  Split 0, the *leader*, holds the head of the order (the sink and the
newest blocks), and its monitor runs on exactly the state a single-split kernel would hold, so
its stop step is the simulator's.  When it stops it raises a per-``(b, kv_head)`` *converged*
flag in global memory; the *followers* (splits ``1..``) poll the flag after each chunk of
``ART_CHUNK`` blocks (a rest of their range shorter than two chunks is one chunk: V31, never-stopping
SmolLM2 B = 32, 8k at 5 splits, 26-block ranges, 0.0642 -> 0.0639 ms) and exit, and the combine keeps
the leader alone, so the output is the simulator's truncated output whatever the timing (deterministic).  If the leader
reaches the end of its range without converging, the followers have covered the rest and the combine
merges everything: the dense output (reported as a walk of all ``N`` steps).  Every program's
step count, which is the number of blocks it loaded, is returned with ``return_stats``; the leading steps of the
order whose blocks entered the output (the leader's where the combine kept it alone, else all ``N``) with
``return_result_steps`` (the combine records how many splits it kept; the steps alone cannot tell a leader that
stopped at the last step of its range, its followers having walked theirs, from one that walked on).

Why this shape: with ``P`` programs per ``(b, kv_head)``, the dense walk ends after about
``N / P`` block times, while any monitor needs ``T`` sequential block times to see
convergence at step ``T``; followers that restarted from scratch could never stop, and the
leader scheme bounds an ART call by the split-K dense time when the walk does not stop.  Its
cost is the followers' blocks read before they see the flag.  The followers run the same
monitored step as the leader, with a patience out of reach (their monitor never stops them
and is discarded): in a walk that does not stop, every program then takes the same time per
block and shares the bandwidth evenly, where a leader that alone ran the monitor ended last
(``benchmarks/NOTES-art-decode.md``, V13: never-stopping overhead at B = 8, 4 splits +6.0 % ->
+1.4-3.2 %; B = 1, 128k +10.9 % -> +4.4 %).  A walk split across programs that keeps the monitor
exact (helpers attend blocks against the walk's running maximum, one owner merges their partials through
the monitor) was built and measured (V31, ``-cooperative-walk.json``): stop steps equal in every pair,
but the owner's merges took 0.8 us per step, a global-memory round trip per chunk of ready partials, so
it gained only on few or long walks (B = 1, 128k 0.049 -> 0.039 ms; SmolLM2 B = 32, 32k 0.238 -> 0.193)
and was 1.1-2.2x slower elsewhere; not kept.  No program reads the flag before its first chunk: every
program of a launch would wait for that atomic before its first loads, and in the one wave the scheme is
sized to, a leader cannot stop before its followers have started (a follower that starts later, in a grid
of several waves, reads one chunk before it sees the flag; V30: never-stopping SmolLM2 B = 32, 8k at 5
splits 0.0641 -> 0.0639 ms, +1.7 -> +1.3 % over the dense walk).  The leader's chunks end at its earliest possible
stop (``kernels.art_decode_kernel``), so it stops, and raises the flag, at its stop step exactly
rather than at the end of a fixed chunk (V14: leader scheme at B = 1, 128k 0.110 -> 0.088 ms,
at B = 8, 128k 0.111 -> 0.087).  Measured on the H200 (V14 full run; ``ARTConfig()``
thresholds, synthetic caches, bf16, CUDA-graph medians):

====================================  ===========================  ============================
case                                  one split (ms, blocks read)   leader scheme (ms, read)
====================================  ===========================  ============================
synthetic 32/8, B = 1, S = 128k       0.061, 1.6 %                 0.088, 31 % (16 splits)
synthetic 32/8, B = 8, S = 128k       0.067, 1.6 %                 0.087, 3.7 % (2 splits)
synthetic 32/8, B = 1, S = 32k        0.073, 7.0 %                 0.063, 100 % (16 splits)
====================================  ===========================  ============================

A lone walk is latency-bound (1.20 us per block at D = 128, 0.94 at D = 64; V26), so a monitored walk that
must run to step ``T`` cannot end before ``T`` block times, however few blocks it reads, and it stops well
after its earliest possible step (:func:`kernels.split_plan.earliest_stop_steps`, 17 steps for ``ARTConfig()``;
mean walks of 33-41 blocks on the synthetic caches and 63-86 on the SmolLM2 layer of 8 sequences, V72's run at
B = 128).  A call cannot end before its longest walk, and only the data knows that length: the caller can pass it
(``longest_stop_steps``, e.g. the longest walk of the layer's previous call, which ``walk_hint`` carries), else it
is taken as ``ART_STOP_MARGIN`` (2)
earliest ends, 34 steps for ``ARTConfig()``, which fits the synthetic caches (longest walks 36-65 at 8k-128k) but
not a real layer's (SmolLM2 layer 15 on 8 sequences: 128 at 8k, 347-484 at 32k-128k).  Hence the default
(:func:`kernels.split_plan.choose_split_plan`): the dense split count, and

* **deferred followers** (below) from the told longest walk where the split-K dense walk would not end before it
  (:func:`kernels.split_plan.dense_walk_ends_first`): a walk that stops by then is the single walk (its followers load
  nothing);
* else (not told, or told a walk that outlasts the dense walk) deferred followers from the guess where the dense walk
  takes at least ``GUESS_REGRET_RATIO`` (2) times it: a walk that runs longer is finished by all the pair's programs,
  so a wrong guess costs the dense walk's time plus the guess instead of the whole walk at the lone pace, and there a
  right guess saves at least what a wrong one costs (V56: the SmolLM2 layer at B = 32 x 8k, whose walks run 46-128
  blocks, took 68 us deferred to 34 blocks against 55 us for the dense walk; its followers now start at once).  Told a
  walk past the dense walk, the guess still pays: the followers of a walk released past it stop when it stops (V87:
  the SmolLM2 layer at B = 32 x 32k, walks of up to 349 blocks, 149 against 153 us on the H200, 165 against 199 on
  an H100, against followers at once), where the walks end in the leader's range: told each walk, the call takes it
  only where at least half of them do (V90);
* else the leader scheme with the followers starting at once: about the dense time plus the monitor, and few or no
  blocks saved, since the leader's range is too short to stop in, or the dense walk itself where the leader's range
  cannot reach the earliest stop (below).

``num_splits=1`` forces the single walk.  When even the leader's range is shorter than the earliest stop
(:func:`kernels.split_plan.leader_can_stop`: B = 1 up to 32k, B = 8 at 8k, the SmolLM2 layer at B = 1), no walk can stop
and the call runs a dense walk without the monitor: given its split count, the dense walk of that count, with the same
result bit for bit (V15: B = 1, 8k and 32k, 0.023 / 0.053 -> 0.021 / 0.050 ms, against 0.073 with one split at 32k;
SmolLM2 B = 1, 8k and 32k, 0.016 / 0.024 -> 0.014 / 0.022), else the dense plan's (below, V61).

**Deferred followers** (``follow_step``; ``benchmarks/NOTES-art-decode.md``, V41).  The followers wait (they poll
the arrival counter, at most ``GATE_POLLS_PER_STEP`` times per follow step, after which they walk anyway, so no
program waits without end on a leader that is not resident) until the leader either stops (bit ``CONVERGED``: they
load nothing) or passes its step ``follow_step`` without stopping (bit ``RELEASED``: they walk their ranges as in
the leader scheme).  A released leader may stop a few steps later: with each chunk it starts past the follow step
it publishes that chunk's end, the next step it can stop at, and its followers poll a step after it (V55:
synthetic 32/8, B = 8 x 32k 0.085 -> 0.070 ms, B = 8 x 128k 0.083 -> 0.066, against polls after 4 steps and then
every 16; outputs the same bit for bit).  The
ranges cut the walk past the follow step, and the leader's also holds the steps before it
(:func:`kernels.split_plan.leader_range`), so that a walk that does not stop ends in every program at once.  The grid is
then ``(B * Hkv, splits)``, so that every leader is dispatched before any follower, one per multiprocessor first, and at
``D = 128`` it is capped at ``RESIDENT_AT_THREE_STAGES`` programs per multiprocessor
(:func:`kernels.split_plan.deferred_splits`), since the waiting followers hold their shared memory.  H200,
``ARTConfig()``, against the rule it replaced (one split where the dense walk would end after 34 blocks; ms,
``-deferred-followers-ab.json``):

=========================================  ============  ==================  ==========
case                                       one split     deferred followers  dense
=========================================  ============  ==================  ==========
SmolLM2 layer, 8 sequences, B = 32, 8k     0.127         0.073 (5 splits)    0.065
SmolLM2, B = 32, 32k                       0.330         0.153               0.202
SmolLM2, B = 32, 128k                      0.329         0.365               0.746
synthetic 32/8, B = 8, 32k                 0.058         0.088 (6 splits)    0.256
synthetic 32/8, B = 1, 128k                0.049         0.062 (49 splits)   0.138
synthetic 32/8, B = 8, 128k                0.055         0.085               0.961
=========================================  ============  ==================  ==========

On the synthetic caches some walks run past 34 blocks (longest 36-42), their followers are released and load a
first chunk each (loaded fraction 6.7 -> 10.5 % at B = 8, 32k); and at ``D = 128`` the monitored step of every
multi-split build takes about 9 % more than the single walk's (1.30 against 1.19 us, with every follower idle; V42),
6-7 us over these walks.  Told the longest walk,
the plan defers the followers to it: 0.066 / 0.057 / 0.062 ms on those three synthetic rows, and the SmolLM2 rows
take 0.064 / 0.160 / 0.327 (the old rule told the walk: 0.064 / 0.160 / 0.329).

**Per-pair splits** (``pair_walks``, :mod:`kernels.pair_walks`).  Where the pairs fill the GPU the plan above
takes one split, and the call then lasts as long as its longest walk, at about the lone pace once the shorter walks
have ended.  A real layer's walks are lopsided (SmolLM2 layer 15 tiled to B = 128 x 32k: 22 of 384 walks run
187-484 blocks, the rest at most 122).  Told each pair's expected walk (a :class:`kernels.pair_walks.PairWalks`, e.g.
of the layer's previous call), the launcher gives the pairs expected to walk more than a threshold every split at
once, the leader scheme above for those pairs alone, and keeps the others single: the kernel reads each pair's walk,
and a pair below the threshold has the whole walk in its leader's range and empty ranges in its followers, which
arrive at once.  :func:`kernels.split_plan.choose_pair_plan` takes the threshold that minimises the longest walk or
split range plus the blocks loaded over the dense pace; the split pairs' ranges are ``PAIR_SPLIT_RANGE`` (16) blocks,
and at ``D = 64`` such a call runs 4 K/V stages, 4 programs per multiprocessor instead of 6 (V46: SmolLM2, B = 128 x
32k, 0.173 ms with V44's 8 splits at 3 stages, 0.157 with 32 splits at 4; at 8k 0.125 -> 0.119 with 8 splits, at 128k
0.272 -> 0.251 with 128).  A pair's result is that of the plan it takes: the single walk's, or that of the leader scheme
over its split count (its leader stops within its range, or the walk is dense).  The grid is ``(B * Hkv, splits)``, so
that every leader is dispatched before the followers, most of which walk nothing.  H200, ``ARTConfig()``, CUDA-graph
medians (``benchmarks/NOTES-art-decode.md``, V44): the SmolLM2 layer of 8 sequences at B = 128 x 8k / 32k / 128k took
0.146 / 0.481 / 0.483 ms told its longest walk and
**0.130 / 0.175 / 0.267** told each walk (4 / 9 / 19 splits for 128 / 26 / 8 of its 384 pairs; dense 0.187 /
0.722 / 2.860), and with ranges of at least 64 blocks 0.123 / 0.175 / 0.271 (2 / 8 / 19 splits, same-process A/B);
on the synthetic caches, whose walks end about together, the plan splits none.  Told the previous decode step's
walks instead (:class:`kernels.walk_hint.LongestWalkHint` carries them), the plan gains less where the long walks
move between pairs from step to step: 8 steps at B = 128 x 32k totalled 0.37x the dense loop, against 0.40x
without a hint and 0.23x told each step's own walks.

**The hint's plan** (:func:`kernels.split_plan.hint_plan`; ``benchmarks/NOTES-art-decode.md``, V58).  So a call given a
``walk_hint`` does not take per-pair splits from the previous call's walks: where :func:`kernels.split_plan.pair_plan`
would split the pairs that walked long, and the dense walk would not end before that plan, it takes on-demand followers
(below) at :func:`kernels.split_plan.on_demand_plan`'s plan, which find the long walks of this call as they run.
Per-pair splits from the previous step split the pairs that walked long then, which may be short now, and leave a pair
whose walk has grown to walk alone (the SmolLM2 layer at B = 128 x 32k, previous step's walks: one step took 0.516 ms,
the default 0.472); and since a split pair's leader cannot stop past its range, the hint counts its walk as all its
blocks, so a pair once split stays split (loaded fraction 0.18 -> 0.29 over 8 steps).  An on-demand call records each
pair's blocks (:func:`kernels.walk_hint.pair_walk_lengths`): a released pair reads as long, so the layer keeps its plan
while its walks stay lopsided.  On the synthetic caches, whose walks end about together, and on the SmolLM2 layer
at B = 32 x 8k, where the dense walk ends first, nothing changes.  A call's result under on-demand followers
depends on timing (below).  H200, the layer's 8 decode steps, CUDA-graph medians of 3 interleaved rounds, the loop
over the dense loop (``-loop-hint-plan-ab.json``), the previous plan -> this one: B = 32 x 32k 0.77x -> **0.70x**,
128 x 8k 0.91x -> **0.68x**, 128 x 32k 0.37x -> **0.27x** (on demand in 6 / 7 / 6 of the 8 steps), 32 x 8k 1.00x
either way; 128 x 128k 0.096x -> 0.101x, where the one step that took on-demand followers took 0.39 ms against
0.29 with the previous step's per-pair splits (at 128k those split the long pairs into 128 ranges at once, where
on-demand followers release 32 after their leaders have walked alone).  Before either, where the previous call's walks
are short and few pairs walk them, the hint's plan takes the wave (*the wave*, below;
:func:`kernels.split_plan.told_wave_steps`), and the hint records the wave's result steps of the pairs it finished.

**On-demand followers** (``release_walks``; ``benchmarks/NOTES-art-decode.md``, V47).  Not told the walks, a call
whose pairs fill the GPU takes one split and lasts as long as its longest walk.  With ``release_walks=R`` (and
``num_splits``; ``follow_step`` default 0) every leader walks alone, and at each end of a chunk past the follow step
it reads the launch's count of pairs done walking alone (the count is read as the chunk starts, one element per
thread, and reduced over all of them, so that every warp decides alike); once at most ``R`` leaders still walk
alone, it releases its followers: it writes the release step, sets ``RELEASED``, and its range ends a share past
that step (:func:`kernels.split_plan.leader_range` of the rest, as for deferred followers released there).  The
followers wait from the start, polling the pair's word and sleeping ``ON_DEMAND_POLL_NS`` between polls, read the
release step and walk their ranges, polling a step past each end of their leader's chunks, which it publishes in the
release and after each chunk as a deferred leader does (V57: the SmolLM2 layer at B = 32 x 128k 0.233 -> 0.221 ms
against polls after 4 steps and then every 16; on the synthetic caches, B = 32 x 8k 0.155 -> 0.141 with the 128-dim
step's MMAs no longer serialised in the same change); a pair whose leader stops first, or walks to its end, is the
single walk bit for bit (its leader raises ``CONVERGED`` and its followers walk nothing), and a released pair whose
leader runs past its share gets the whole attention.  Which pairs are released depends on when the other leaders finish,
so a pair's result, its single walk or the whole attention, may differ from one call to the next (V57).  The grid
is ``(B * Hkv, splits)``, every leader dispatched before any follower; a follower that has polled
``GATE_POLLS_PER_STEP`` times per block of the walk gives up unless released (``GAVE_UP``, set by compare-and-swap only
while ``RELEASED`` is clear; a leader whose release finds it walks on alone), so no program waits without end on a
leader that is not resident.  In a launch where too few walks stop for the count to fall to ``R``, every leader would
walk alone to its end (2.5x the dense time at B = 32); with ``release_step`` each leader still walking alone releases at
its first chunk end at or past that step, whatever the count (V51; :func:`kernels.split_plan.on_demand_plan` takes one).
The stage count of an on-demand grid is set by its leaders alone (:func:`_launch_config`): the followers, dispatched
after every leader, only wait, and counted with them a grid of 64 x 128 blocks went to 2 stages (V52: synthetic 32/8,
B = 32 x 8k at the plan's 4 splits, 0.182 -> 0.154 ms; the rows whose leaders alone exceed 3 per multiprocessor
unchanged).  Opt-in: it gains on lopsided walks at 64-dim heads, and costs elsewhere.  H200, ``ARTConfig()``, the
SmolLM2 layer at B = 128, CUDA-graph medians of 3 interleaved rounds (``-on-demand-ab.json``, ms; the bound at each
call's loaded fraction):

=========================  ==============  ==========================  ================================  =====
SmolLM2 layer, B = 128     default         on demand (splits, R)       never stopping: default -> od     dense
=========================  ==============  ==========================  ================================  =====
8k                         0.144 (0.114)   **0.126 (0.133)** (8, 264)  0.183 -> 0.192 (+4.8 %; 4, 264)   0.184
32k                        0.480 (0.130)   **0.196 (0.155)** (16, 66)  0.700 -> 0.725 (+3.6 %; 16, 66)   0.705
128k                       0.481 (0.144)   **0.331 (0.197)** (32, 33)  2.765 -> 2.831 (+2.4 %; 16, 66)   2.79
=========================  ==============  ==========================  ================================  =====

Told each walk instead, the per-pair splits take 0.120 / 0.157 / 0.251 ms.  The never-stopping overhead is not
the polls (1 us sleeps or none: the same within 0.5 %).  On the synthetic caches at ``D = 128`` (B = 32 to 128 x 8k,
128 x 32k) every setting was 5-60 % slower than the default, whose single walks end about together (B = 32 x 8k:
0.171 ms at 2 splits against 0.108), so the default plan does not take it.  :func:`kernels.split_plan.on_demand_plan`
gives the keywords of a plan for a walk's length (V48: a split per 32 blocks, at most 8 released programs per
multiprocessor; over the SmolLM2 layer's 8 decode steps at B = 128, on-demand followers took 0.68x / 0.28x of the dense
loop at 8k / 32k with 8 / 264 and 16 / 66 splits / R, against 0.76x / 0.40x by default and 0.91x / 0.37x told the
previous step's walks).

**Launch order** (``benchmarks/NOTES-art-decode.md``, V45).  A call told each walk (``pair_walks``, or a
``walk_hint`` that carries them) dispatches its programs by expected walk, longest first
(:attr:`kernels.pair_walks.PairWalks.launch_order`, read by each program before anything else): where the grid is
more than one wave, a long walk no longer starts late and ends last, and the short walks fill the multiprocessors
that the long ones free.  In one wave the order only mixes long and short walks on each multiprocessor.  Single
walks of 64 x 128 blocks past a wave at 3 stages also keep 3 stages (3 programs per multiprocessor, not 2 stages
and 4) where :func:`kernels.split_plan.longest_first_three_stages` finds that fewer slots pay: walks of spread lengths.
H200, ``ARTConfig()``, CUDA-graph medians of 5 interleaved rounds, told each walk (``-longest-first-stages-ab.json``;
ms, the launcher's choice in bold):

============================  ==========  ==========================  ==========================  ===========
synthetic 32/8, one split     pair order  longest first, 2 stages     longest first, 3 stages     time bound
============================  ==========  ==========================  ==========================  ===========
B = 32 x 8k (256 programs)    0.1089      (3 stages: one wave)        **0.1084**                  0.1003
B = 64 x 8k (512)             0.1918      0.1883                      **0.1672**                  0.1868
B = 128 x 8k (1024)           0.3693      **0.3220**                  0.3153                      0.3593
B = 256 x 8k (2048)           0.6670      **0.6175**                  0.6170                      0.7119
B = 64 x 32k                  0.1439      **0.1426**                  0.1511                      0.1555
B = 128 x 32k                 0.2768      **0.2639**                  0.2696                      0.3001
B = 256 x 32k                 0.5330      **0.5146**                  0.5163                      0.5964
B = 64 x 128k                 0.1372      **0.1369**                  0.1462                      0.1509
B = 128 x 128k                0.2666      **0.2579**                  0.2640                      0.2922
============================  ==========  ==========================  ==========================  ===========

On the SmolLM2 layer at B = 128 (per-pair splits) the order changed nothing (0.1230 / 0.1752 / 0.2711 ->
0.1239 / 0.1754 / 0.2713 ms at 8k / 32k / 128k).  Reading the order costs a load before the first: 0-1.2 us per
call against the same pairs told only their longest walk (0.1085 -> 0.1090 ms at B = 32 x 8k,
``-longest-first-ab.json``).

**One launch.**  With several splits, each program writes its partial ``(out, lse)``, then
increments the ``(b, kv_head)``'s *arrival counter* (a CTA barrier, then a gpu-scope
``acq_rel`` atomic: the program's partial stores are released before the increment); the
program that arrives last (the atomic returned ``num_splits - 1`` arrivals) acquired every other
program's partial with that atomic, merges the group's query heads
(``art_decode_combine.combine_group``: the leader alone when the converged flag is set, else
every split; empty splits weigh 0) and writes the counter back to 0.  The converged flag is a bit of
the same word (the leader adds ``CONVERGED`` before it arrives), so the last arrival's atomic returns it
with the count (V35: a flag word apart took the last arriver one more atomic round trip before the combine;
never-stopping B = 1, 128k at 66 splits 0.1418 -> 0.1411 ms, +0.91 -> +0.34 % over the dense walk).
So no second launch and no per-call memset: the counters live in one int32 buffer
per device and pair count (:func:`_arrival_counters`), zero-initialised once, with the
invariant *zero between launches*.  A launch either runs every program (each counter reaches
``num_splits`` and is reset) or faults, and a fault is sticky for the CUDA context, which
takes the buffers with it; a call that raises does so before the launch.  Calls of one
pair count issued on different streams share the buffer and must not overlap in time.  With
one split the program writes ``out`` and ``lse`` itself and touches no counter.  Measured on
the H200 (``benchmarks/NOTES-art-decode.md``, V6): B = 1, S = 32k dense 0.0500 ms against
0.0509 ms for the former two launches (cuDNN SDPA 0.0497 ms); unchanged at B >= 8.

**Dense defaults** (``art=None``): the split count comes from the real lengths
(``max(cache_seqlens)``, one device sync when lengths are given), at least ``MIN_STEPS_PER_SPLIT`` blocks per
split, at most ``MAX_SPLITS``.  At ``D = 128`` a 128-token program holds its multiprocessor alone (136 KB of shared
memory), and the count is the one whose waves of programs end soonest (:func:`kernels.split_plan.wave_balanced_splits`):
a grid that spills a few programs into another wave pays that wave at a lone program's pace (17 splits x 8 KV heads =
136 programs on 132 multiprocessors measured 11 % slower than 16 splits; 144 pairs 207 us in one split at 8k
tokens, 156 in 8), while a grid of fewer programs than multiprocessors can beat two waves (96 pairs: 95 us in
one split, 116 in 2; V68); the block size is ``DENSE_BLOCK_SIZE`` (128) at ``D = 128``,
measured best or tied at every point of the benchmark's split sweep (on the paged layout, unless a page
holds such blocks whole, 64: :func:`kernels.split_plan.dense_block_size`).  Blocks of at most
``TMA_MAX_BLOCK`` (64) tokens, the monitor's step, target ``SMALL_BLOCK_PROGRAMS_PER_SM`` (4)
programs per multiprocessor instead, rounded up only where the multiprocessors themselves would
idle: co-resident programs hide each other's step latency, the monitor's above all (never-stopping
ART over dense at B = 8, S = 128k: +44 % at one program per multiprocessor, +6 % at two, V7; at
B = 8 and the SmolLM2 layer at B = 32, 0.0-2.4 % at four against 1.0-5.8 % at two, with the dense
walk as fast or 2-4 % faster, V17).

**The dense plan** (``benchmarks/NOTES-art-decode.md``, V61).  A dense call that leaves the block size and split
count to the launcher walks 64-token blocks at ``D = 64`` (``SMALL_HEAD_DENSE_BLOCK_SIZE``),
2 warps per program where the monitor's walks take 1, and, walking such blocks without the monitor, targets
``DENSE_SMALL_BLOCK_PROGRAMS_PER_SM`` programs per multiprocessor (3 at ``D = 64``, 2 at ``D = 128``) instead of
the monitor's 4.  At ``D = 64`` a 128-token block of one program per multiprocessor left too few loads in flight:
H200, the SmolLM2 shape (9 / 3 heads, bf16), CUDA-graph medians of 3 interleaved rounds against cuDNN SDPA in the
same run (``-dense-plan-ab.json``, us), 128-token blocks -> the dense plan:

=====  ==========================  =======================  =======================
B      8k                          32k                      128k
=====  ==========================  =======================  =======================
1      13.3 -> 11.5 (cuDNN 13.0)   17.6 -> 17.3 (17.1)      37.0 -> 35.6 (33.6)
8      23.1 -> 20.0 (21.1)         65.2 -> 53.6 (55.4)      225.6 -> 186.9 (189.1)
16     37.8 -> 33.2 (32.3)         120.1 -> 99.3 (99.9)     449.1 -> 365.1 (370.0)
128    189.2 -> 184.9 (185.1)      723.4 -> 718.8 (717.4)   2855 -> 2828 (2828)
256    364.3 -> 368.1 (374.2)      1434 -> 1428 (1473)      5713 -> 5736 (5945)
=====  ==========================  =======================  =======================

At ``D = 128`` the plan keeps 128-token blocks (64-token ones were within 2 % either way, ``-dense-sweep.json``),
except on the contiguous layout for walks of at most 8k tokens whose 128-token grid takes several splits in more
than one wave: there 64-token blocks walk in one wave of five programs per multiprocessor
(:func:`kernels.split_plan.one_wave_dense_splits`; V71: B = 18 x 8k 158.3 -> 144.6 us, cuDNN 145.7).
At ``D = 64`` it walks 64-token blocks on the paged layout too, also on pages that hold 128-token blocks whole (V63,
``-paged64-plan-ab.json``: pages of 128 tokens, 128-token blocks at their split count -> the plan, us; the SmolLM2
shape B = 1 x 128k 40.3 -> 34.4, 8 x 32k 71.9 -> 53.5, 8 x 128k 252.8 -> 188.4, 32 x 32k 208.0 -> 188.7, 128 x 8k
194.0 -> 186.8; pages of 256 alike; 32 / 8 heads at 64 dims 8-22 % faster except B = 32 x 8k, +1.6 %).
Where the plan's one split of 64-token blocks would leave more than 1.5 and at most 2 pairs per multiprocessor
(:func:`kernels.split_plan.two_pairs_per_sm`; 199-264 pairs on the H200's 132), a 64-dim dense call walks one split of
128-token blocks at 4 warps instead, if the layout holds them whole: two programs of 2 warps kept too few loads in
flight (V65, ``-pair-band64.json``, 32k, us, 64-token -> 128-token walk (cuDNN): 32 / 8 heads at 208 pairs 428.8 ->
389.6 (385.2), 240 pairs 462.3 -> 443.4 (440.3); 9 / 3 heads at 216 pairs 434.7 -> 403.0 (400.7), 252 pairs 477.6 ->
464.5 (459.6); at 176-180 and 272-368 pairs the 128-token walk was 2-8 % slower).
An ART call of the launcher's plan whose leader cannot stop (:func:`kernels.split_plan.leader_can_stop`) runs the dense
plan's walk of 64-token blocks, at ``D = 64`` outside that band the default dense call bit for bit (the SmolLM2 shape at
B = 1 x 32k 18.6 -> 17.4 us, at B = 2 x 32k 24.6 -> 22.1; synthetic 32 / 8 at B = 1 x 32k 41.2 -> 40.4); a call
given ``num_splits`` or ``block_size`` runs the dense walk of the configuration it chose, which keeps
``tau = phi = 0`` bit-identical to the dense call of that configuration.

**Uniform lengths** (``benchmarks/NOTES-art-decode.md``, V11).  When every sequence has the same
length (no ``cache_seqlens``, or equal ones: the launcher already reads their min and max), the
kernel takes that length as a scalar argument: no lengths tensor is made per call (a fill kernel,
which a CUDA graph replays too) and no program waits for a length load before its first K/V loads.
B = 1, S = 32k dense: 0.0500 -> 0.0481 ms (cuDNN SDPA 0.0493 ms in the same run); results
bit-identical to the ragged path.

**Loads and launch shape** (``benchmarks/NOTES-art-decode.md``, V7, V11).  With blocks of at most
``TMA_MAX_BLOCK`` tokens on the contiguous layout, K and V tiles are read through tensor
descriptors (``kernels.descriptors``: one bulk copy per tile, rows past the length read as
zeros), which removes the per-row address arithmetic and masks from the monitor's walk (a
leader step compiles to ~495 instead of ~610 instructions per warp), and programs run 2 warps;
128-token dense blocks keep pointer loads and 4 warps, measured 0.2-5 % faster that way.  With
uniform lengths the launcher makes one pair of ``[B, Hkv, len, D]`` descriptors, passed by value
(B = 1, S = 32k, 64-token dense walks 0.0541 -> 0.0501 ms; SmolLM2 never-stopping leader scheme,
B = 32, S = 128k: 1.181 ms with pointer loads, 1.125 with them); with ragged lengths each
program makes its sequence's, a fixed cost per program, so the ART leader scheme (several
splits with a monitor) then uses them only for ``D = 128`` and splits of at least
``LEADER_TMA_MIN_STEPS`` blocks (V8: SmolLM2's 64-dim walks of 6-47 blocks per split were 2-8 %
slower with them).  All three ways of loading give bit-identical results.

**Paged loads** (``benchmarks/NOTES-art-decode.md``, V29).  The page size is a compile-time constant
(``PAGE_SIZE``).  A block that lies within one page (the page size a multiple of the block) takes one
page-table entry per step; blocks of at most ``TMA_MAX_BLOCK`` tokens then read its slots through
descriptors of the page pool made on the host (one bulk copy per tile; slots past the length are read too,
and zeroed in V so that whatever a page holds there cannot reach the output: only in the block that holds the
last token, which the walks run apart from their loops, V30, V32; the loops' steps, whole blocks, take no token
mask, V48), larger ones through pointer
loads of consecutive slots.  A block of whole pages of at least ``MIN_SUBPAGE`` (16) tokens takes one
descriptor copy per page (``"subpage_descriptors"``): the step's scores are one dot per page's tile, the
block's maximum and ``sum p`` are taken over the tiles elementwise and then along the rows, and ``P V`` chains
the tiles' products, so ``l``, and with it ``lse``, can differ from the contiguous layout's in the last bit
(outputs and stop steps were equal in every A/B comparison).  Otherwise each token's row is gathered through
its own entry, with the page and slot a shift and a mask for pages of a power of two.  The software pipeliner stages
each step's page-table load ahead of its K/V tiles, which at the contiguous layout's stage count left the tiles
single-buffered; the paged launches take ``PAGE_TABLE_STAGES`` (2) more stages, which double-buffers them
at about the contiguous layout's shared memory.  Against the former runtime page size (an int64 division per token) and
stage count, on the H200 (shuffled tables): the lone 64-token step 4.1 -> 2.0-2.6 us monitored and 3.6 -> 1.3-1.7 us
dense; dense B = 32 / 128 x 32k at 128-token blocks 3.5 -> 3.9-4.5 TB/s, and 4.3-4.5 with
:func:`kernels.split_plan.dense_block_size`'s default (contiguous 4.4-4.6); synthetic ART at 8 x 32k 0.186 -> 0.096 ms
with pages of 64, and 0.087 with the page descriptors (contiguous 0.058); every output, lse and step count
bit-identical.  Zeroing V only in the block past which the length ends (V30, ``-tail-zeroing-ab.json``): the lone
monitored step on pages of 64 / 256 tokens 2.00 / 1.83 -> 1.68 / 1.63 us (contiguous 1.20), ART at 8 x 32k on pages of
64 0.088 -> 0.077 ms (contiguous 0.059), bit-identical.  One tile per page (V30, ``-subpages-ab.json``): the lone
monitored step on pages of 16 / 32 tokens 2.61 / 2.62 -> 2.25 / 1.76 us, ART at 8 x 32k 0.118 -> 0.101 / 0.082 ms and at
128 x 8k 0.489 / 0.485 -> 0.416 / 0.399 ms (pages of 64: 0.398), dense B = 32 x 32k 4.40 / 4.44 -> 4.45 / 4.52 TB/s.
The block that holds the last token run apart from the loops (V32, ``-paged-tail-apart-ab.json``): a select
inside a loop, even one that the other steps branch around, took every step's V tile from shared memory to
registers and back; the lone monitored step on pages of 64 / 16 tokens 1.70 / 2.26 -> 1.48 / 1.94 us, the lone
dense step 1.17 / 1.70 -> 0.89 / 1.26 (contiguous 0.89), ART at 8 x 32k 0.077 / 0.101 -> 0.069 / 0.085 ms
(contiguous 0.058), bit-identical, and with lengths that end inside a block (the tail apart in every walk)
0.081 / 0.107 -> 0.077 / 0.093.

**Converged flag, read uniformly** (V8).  Every read of the flag is a scalar atomic
(``art_decode_kernel._read_word``; the last arriver's read is its arrival): one
thread executes it and the value is broadcast, so all warps of a program leave the walk at the
same chunk.  With plain scalar loads each warp read the flag itself; warps on either side of the
leader's store left the loop at different chunks, their barriers paired up wrongly, and the
result depended on timing (3 of 20 calls wrong at B = 8, S = 128k, 4 splits) or, with the
descriptor pipeline, the program hung (the V7 hang).

Numerics: scores, softmax and accumulation in fp32; ``p`` is rounded to the value dtype before the
``P V`` product, as in the simulator.  The kernel's dot products sum in a different order than
PyTorch's, its exponentials are the hardware's ``exp2`` (flushing denormal results to zero) of the
scores times ``sm_scale * log2(e)`` minus the running maximum so scaled, one FMA each (V23: with
``tl.exp``, a non-flushing ``ex2`` with its denormal fix-up after a separate scale multiply, the monitored
step took 611 instead of 526 instructions and 1.27 instead of 1.21 us), and the monitor tests
are evaluated without division (``d_scale < tau`` as ``|n - n_old| < tau * n_old``, see
``art_decode_kernel._stable_step``), so a probe that lands within rounding of a threshold
can flip a stable/unstable decision; the tests count such stop steps (1 of 1568
``(b, kv_head)`` on the H200 in bf16, off by one step; none in the CPU interpreter).  The direction
change ``1 - cos`` is computed from the change vector, ``(|x - x_old|^2 - (n - n_old)^2) / (2 n n_old)``,
as in the simulator (``art_analysis.termination.one_minus_cos``): the textbook ``1 - x.y / (n n_old)``
carries an fp32 rounding error as large as the default ``phi = 1e-6`` and set 19 of 120 stop steps at the
benchmark's sizes (V26; since then every pair agrees: 624 of 624 in V79's run).  The output probe's norm is the
accumulator's, summed as ``sum acc^2`` in fp32 and scaled by ``1 / l`` after the root; the simulator forms
``acc / l`` first.  So for values so large that ``sum acc^2`` overflows (``|v| l`` about ``1e18``: beyond any fp16
cache, and beyond real models' bf16 or fp32 values by many orders of magnitude) the kernel's monitor saturates where
the simulator's does not yet (``|v|`` about ``1e19``): every step reads unstable, the walk reads the whole cache and
returns the dense output; it never stops early.

**The wave (``wave_steps``; ``kernels.art_wave``, NOTES V82, V84, V92).**  A call cannot end before its longest walk
at the lone pace, however few blocks it reads.  With ``wave_steps=W`` the call first attends the first ``W`` steps
of every pair at once, one program per step, and recovers the walk's running state after each of them by
linear-recurrence scans over the steps' partial states (in the frame of the running maximum, as the walk holds it);
the monitor's rule then runs on those states, and a pair whose heads are all done within the wave, or whose walk is
no longer, takes its output from there.  The planned walk runs for the other pairs only, from their first step (the
wave's blocks are read twice for them).  Every pair's wave reads ``min(W, blocks)`` blocks, also past its stop, and
the leaders' ``steps`` count them.  On an H100 (``2026-12-06-art-decode-wave-ab-h100.json``, ``ARTConfig()``,
synthetic caches, W = 48), the call's time against the default plan's: B = 1 x 32k / 128k 52.6 / 58.5 -> 22.1 /
22.2 us, 8 x 32k / 128k 67.5 / 63.0 -> 59.2 / 58.6, the 64-dim cache (9 / 3 heads) at 8 x 32k 74.0 -> 22.5 and
32 x 32k 51.1 -> 43.0; slower where many pairs share the bandwidth (16 x 32k 70.3 -> 107.3, 32 x 8k 136.3 -> 289.3),
at 1 x 8k (20.2 -> 29.9), and where walks outlast the wave (never stopping: +4 % at 8 x 128k to +67 % at 1 x 8k).
Since V83 its monitor runs at half the warps: the same at B = 1, 6-10 % faster at B = 8-32 (8 x 32k 59.5 -> 55.4 us);
since V91 one program per query head and 32 dims (V92, H100: 1 x 32k / 128k 22.3 / 21.9 -> 19.3 / 19.2 us, 8 x 32k
55.2 -> 53.2).  The wave's monitor is the walk's own
step over the scanned states (its sums, ``_probe_sums``, then its test, ``_stable_step``), so its stops agree with
the simulator's as the walk's do (bf16 on the GPU: 1118 of 1120 synthetic pairs, two off by one; 168 of 168
captured).
Whether it pays depends on walks that only the data knows, so a call not told its walks never takes it; a call told
each pair's walk (``pair_walks``, or a ``walk_hint``'s) takes the wave of :func:`kernels.split_plan.told_wave_steps`
(the longest told walk and an eighth more) where that costs fewer lone steps than the longest walk or the dense walk,
each pair reading only its own told walk and an eighth of it (V95: the rule's cost counts those blocks), and then
plans the walk after it as a call told only the longest (V92, before each pair's own wave, ``-v92-ab-h100.json``: on
an H100, synthetic B = 1 / 2 / 4 / 8 x 32k told each walk 53.0 / 60.9 / 61.6 / 62.8 -> 19.0 / 23.9 / 32.7 / 53.1 us,
the SmolLM2 layer at 1 x 128k 43.4 -> 17.2; no wave at B = 16).
``wave_steps=0`` refuses it.

**CUDA graphs.**  A decode loop can capture ``art_decode`` with ``cache_seqlens`` (and ``block_table``)
and change the lengths in place between replays.  Inside a capture the launcher cannot read the lengths
(that needs a sync), so it checks their tensor's type, shape and device only, sizes the grid for the
capacity (``S``, or ``max_pages * page_size``) and passes the lengths on: each replay reads the values of
that moment, which the caller keeps in ``[1, capacity]`` with valid pages.  Pass ``num_splits`` to fix
the split count that the capture's capacity would otherwise pick.  An eager loop can ask for the same with
``read_lengths=False``: no call then waits for the device to read its lengths back.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton

from .art_decode_kernel import DIRECTION_GUARDED, DIRECTION_OFF, DIRECTION_ON, HORIZON_CAP, art_decode_split_kernel
from .art_params import INT32_MAX, ARTParams
from .art_wave import MAX_WAVE_STEPS, TOLD_WAVE_MAX_WORKSPACE, run_wave, told_wave_length, wave_workspace_bytes
from .descriptors import descriptor_ready, host_descriptor, page_descriptor, prepare_descriptors
from .device_info import num_sms as _num_sms
from .int_checks import check_choice, check_count, check_flags
from .paged_cache import kv_strides
from .pair_walks import PairWalks
from .softmax_scale import softmax_scale
from .split_plan import (MAX_SPLITS, RESIDENT_AT_THREE_STAGES, TMA_MAX_BLOCK, choose_pair_splits, choose_split_plan,
                         dense_block_size, hint_plan, leader_can_stop, leader_range, longest_first_three_stages,
                         on_demand_plan, one_wave_dense_splits, planned_result_steps, told_wave_steps)

ORDERS = ("sequential", "sink_recency")
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZES = (16, 32, 64, 128)
ART_BLOCK_SIZE = 64
MAX_GROUP = 128
MMA_ROWS = 16                    # the fewest rows of the kernel's dot tile (query heads padded up to it)
MIN_SUBPAGE = 16                 # the fewest tokens of a page read as its own tile (the smallest dot operand)
LEADER_TMA_MIN_STEPS = 32
PAGE_TABLE_STAGES = 2            # extra pipeline stages of the paged layout (its tiles wait on page-table loads)
PAIR_SPLIT_STAGES = 4            # 64-dim per-pair splits: 4 programs per multiprocessor instead of 6 (V46)
ART_CHUNK = 16
FP32_ROUNDS_TO_ZERO = 2.0 ** -150   # the largest float that rounds to 0 in fp32 (half the smallest subnormal, a tie)
MAX_ART_STEPS = HORIZON_CAP.value   # blocks of one monitored walk (the kernel's chunk sizes are int32-safe below it)
GATE_POLLS_PER_STEP = 16   # a deferred follower waits for its leader at most this many polls per follow step
ON_DEMAND_POLL_NS = 1000   # an on-demand follower sleeps this long between polls of its leader's word
COMBINE_ROWS = 64          # (query head, split) partial rows the last program merges per iteration


@dataclass(frozen=True)
class DecodePlan:
    """The walk an :func:`art_decode` call runs, as :func:`plan_decode` resolves it (before any launch).

    Attributes:
        batch, q_heads, kv_heads, head_dim: ``B``, ``Hq``, ``Hkv`` and ``D`` of the call.
        paged: whether the cache is paged (``block_table`` given).
        order: the traversal order, ``"sequential"`` or ``"sink_recency"``.
        sm_scale: the softmax scale.
        seqlens: ``[B]`` int32 lengths on the call's device where they differ (and inside a CUDA-graph capture),
            ``None`` where every sequence has ``max_len`` tokens.
        max_len: the longest sequence in tokens (the capacity inside a CUDA-graph capture).
        max_steps: blocks of the longest walk, ``ceil(max_len / block_size)``.
        block_size: tokens per block (the monitor's step).
        num_splits: programs per ``(b, kv_head)``.
        follow_step: the leader's step from which the followers walk (0: at once, or one split).
        art: the monitor the kernel runs; ``None`` for a dense call, and for a monitored call whose leader cannot
            reach the earliest stop (:func:`kernels.split_plan.leader_can_stop`): that call runs the dense walk.
        monitored: whether the call asked for the monitor (``art`` given).
        pair_walks: the :class:`kernels.pair_walks.PairWalks` the call was told (directly or by its ``walk_hint``)
            and plans its walk by, else ``None`` (also where it took a wave from them).
        pair_threshold: with per-pair splits, the expected walk past which a pair takes every split, else ``None``.
        release_walks, release_step: with on-demand followers, the count of leaders still walking alone below which
            a leader releases its followers, and the step from which it releases them whatever the count (``None``:
            never); both ``None`` without on-demand followers.
        dense_plan: whether a dense walk's block size and split count are the launcher's own.
        wave_steps: the steps of the wave run before the walk (``kernels.art_wave``; at most ``max_steps``), 0 for
            none.
        wave_walks: where the wave came from told walks, those walks (``[B, Hkv]`` int32 on the call's device):
            each pair's wave is at most :func:`kernels.art_wave.told_wave_length` of its walk; else ``None`` (every
            pair's wave is ``wave_steps``).

    Two plans compare equal when they walk alike: the lengths and the told walks (tensors) are neither compared
    nor printed.
    """

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    paged: bool
    order: str
    sm_scale: float
    seqlens: torch.Tensor | None = field(compare=False, repr=False)
    max_len: int
    max_steps: int
    block_size: int
    num_splits: int
    follow_step: int
    art: ARTParams | None
    monitored: bool
    pair_walks: PairWalks | None = field(compare=False, repr=False)
    pair_threshold: int | None
    release_walks: int | None
    release_step: int | None
    dense_plan: bool
    wave_steps: int = 0
    wave_walks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def on_demand(self) -> bool:
        """Whether the followers are released on demand (module docstring, *on-demand followers*)."""
        return self.release_walks is not None

    @property
    def deferred(self) -> bool:
        """Whether the followers wait for the leader's follow step (module docstring, *deferred followers*)."""
        return self.follow_step > 0 and not self.on_demand

    @property
    def per_pair_splits(self) -> bool:
        """Whether only the pairs expected to walk past ``pair_threshold`` take every split."""
        return self.pair_threshold is not None

    @property
    def longest_first(self) -> bool:
        """Whether the programs take the pairs longest expected walk first (module docstring, *launch order*)."""
        return self.pair_walks is not None and self.art is not None

    @property
    def walk_blocks(self) -> int | torch.Tensor:
        """Blocks of each sequence's whole walk, ``ceil(len / block_size)``: ``max_steps``, or ``[B, 1]`` int32 on
        the call's device where the lengths differ."""
        if self.seqlens is None:
            return self.max_steps
        return ((self.seqlens + self.block_size - 1) // self.block_size)[:, None]

    @property
    def wave_blocks(self) -> int | torch.Tensor:
        """Blocks of each walk that the wave reads, ``min(wave_steps, walk_blocks)`` (0 without a wave): an int, or
        ``[B, 1]`` int32 on the call's device where the lengths differ; with ``wave_walks``, ``[B, Hkv]``: each
        pair's own wave (its walk's ``told_wave_length``) where that is shorter."""
        blocks = self.walk_blocks
        if self.wave_walks is not None:
            own = torch.clamp(told_wave_length(self.wave_walks), max=self.wave_steps)
            return torch.clamp(own, max=blocks) if isinstance(blocks, int) else torch.minimum(own, blocks)
        if isinstance(blocks, int):
            return min(blocks, self.wave_steps)
        return torch.clamp(blocks, max=self.wave_steps)

    def result_steps(self, walks: torch.Tensor) -> torch.Tensor:
        """The ``result_steps [B, Hkv]`` (``art_decode``'s ``return_result_steps``) this plan gives pairs whose single
        walks (one split, the simulator's ``stop_step + 1``) are ``walks [B, Hkv]`` (int, blocks): under a monitor,
        :func:`kernels.split_plan.planned_result_steps`; where the call runs the dense walk (no monitor, or a leader
        that cannot stop), every pair's whole walk.  Returned on ``walks``' device.

        With a wave, a pair whose single walk ends within it (``walks <=`` :attr:`wave_blocks`) is the wave's.

        Raises ``ValueError`` for per-pair splits and on-demand followers, whose leaders may walk past their range
        (the result then depends on when followers were released, not on the single walks alone)."""
        if not isinstance(walks, torch.Tensor) or walks.dtype.is_floating_point or walks.is_complex():
            raise TypeError(f"walks must be an integer torch.Tensor [B, Hkv], got {walks!r:.80}")
        if tuple(walks.shape) != (self.batch, self.kv_heads):
            raise ValueError(f"walks must have shape [B, Hkv]=[{self.batch}, {self.kv_heads}], "
                             f"got {tuple(walks.shape)}")
        if self.per_pair_splits or self.on_demand:
            raise ValueError("the result steps of per-pair splits or on-demand followers depend on the call's "
                             "schedule, not on the single walks alone")
        blocks = torch.as_tensor(self.walk_blocks, dtype=walks.dtype, device=walks.device)   # [] or [B, 1]
        if self.art is None:
            walked = blocks.expand_as(walks).clone()
        else:
            walked = planned_result_steps(walks, blocks, self.num_splits, self.follow_step)
        if self.wave_steps:   # a walk that ends within the wave is the wave's
            wave_blocks = torch.as_tensor(self.wave_blocks, dtype=walks.dtype, device=walks.device)
            walked = torch.where(walks <= wave_blocks, walks, walked)
        return walked


def plan_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                sm_scale: float | None = None, art: ARTParams | None = None, order: str = "sink_recency",
                block_size: int | None = None, num_splits: int | None = None, longest_stop_steps: int | None = None,
                follow_step: int | None = None, walk_hint=None, pair_walks=None, release_walks: int | None = None,
                release_step: int | None = None, wave_steps: int | None = None,
                read_lengths: bool = True) -> DecodePlan:
    """The :class:`DecodePlan` of ``art_decode(q, k_cache, v_cache, ...)`` with the same arguments (see
    :func:`art_decode`), without a launch: every check of the inputs and keywords, then the block size, split
    count, follow step, per-pair splits or on-demand followers (``kernels.split_plan``), and whether the monitor
    runs at all.  :func:`art_decode` runs exactly this plan; the benchmark states each row's plan from it.  Reads
    the lengths (a sync on a device), except inside a CUDA-graph capture or with ``read_lengths=False``; records
    nothing into ``walk_hint``."""
    batch, q_heads, head_dim = _check_tensors(q, k_cache, v_cache, block_table)
    paged = block_table is not None
    kv_heads = k_cache.shape[2] if paged else k_cache.shape[1]
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[2]
    if kv_heads < 1 or q_heads % kv_heads:
        layout = f"{'paged [num_pages, page_size, Hkv, D]' if paged else 'contiguous [B, Hkv, S, D]'} k_cache " \
                 f"{tuple(k_cache.shape)}"
        if kv_heads < 1:
            raise ValueError(f"the {layout} holds no KV head")
        raise ValueError(f"Hq % Hkv must be 0 (query head h reads KV head h // (Hq // Hkv)); "
                         f"got Hq={q_heads}, Hkv={kv_heads} from the {layout}")
    group = q_heads // kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"at most {MAX_GROUP} query heads per KV head are supported, got {group}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS} in the kernel, got {order!r}")
    planned_walk = block_size is None and num_splits is None   # the launcher picks the walk (dense plan, V61)
    if block_size is None:
        block_size = ART_BLOCK_SIZE if art is not None else dense_block_size(k_cache.shape[1] if paged else None,
                                                                             head_dim, batch * kv_heads, q.device)
    check_choice(block_size, "block_size", BLOCK_SIZES)
    if art is not None and not isinstance(art, ARTParams):
        raise TypeError(f"art must be kernels.art_params.ARTParams or None, got {type(art).__name__} "
                        "(ARTConfig.kernel_params() converts)")
    sm_scale = softmax_scale(sm_scale, head_dim)
    capacity_name = ("block_table too short: max_pages * page_size" if paged else "S of the contiguous cache")
    # inside a CUDA-graph capture no value can be read back: the lengths and pages go unchecked, and the grid is
    # sized for the capacity, so that every replay may change the lengths in place; read_lengths=False asks for the
    # same outside a capture (no sync)
    check_flags(read_lengths=read_lengths)
    capturing = _capturing(q.device)
    reading = read_lengths and not capturing
    seqlens, max_len = _check_seqlens(cache_seqlens, batch, capacity, capacity_name, q.device, read_values=reading)
    if paged and reading:
        _check_block_table(block_table, max_len if seqlens is None else seqlens, k_cache.shape[1], k_cache.shape[0])
    one_wave_splits = (one_wave_dense_splits(batch * kv_heads, max_len, head_dim, paged, q.device)
                       if planned_walk and art is None else None)
    if one_wave_splits is not None:   # short walks in several waves of 128-token blocks: 64-token blocks in one (V71)
        block_size = TMA_MAX_BLOCK
    max_steps = -(-max_len // block_size)
    if art is not None and max_steps > MAX_ART_STEPS:
        raise ValueError(f"an ART walk is at most {MAX_ART_STEPS} blocks ({MAX_ART_STEPS * block_size} tokens at "
                         f"block_size={block_size}); max(cache_seqlens)={max_len} needs {max_steps}: use a larger "
                         "block_size or art=None")
    # steps past any walk (MAX_ART_STEPS) mean nothing more; the bounds keep the kernel's int32 arguments in range
    if longest_stop_steps is not None:
        check_count(longest_stop_steps, "longest_stop_steps", 1, MAX_ART_STEPS, unit="blocks")
    if follow_step is not None:
        check_count(follow_step, "follow_step", 0, MAX_ART_STEPS, unit="blocks")
    if release_walks is not None:
        check_count(release_walks, "release_walks", 0, INT32_MAX, unit="pairs")
        if art is None or pair_walks is not None:
            raise ValueError("release_walks releases the followers of monitored walks: it needs art and no "
                             "pair_walks")
    if wave_steps is not None:
        check_count(wave_steps, "wave_steps", 0, MAX_WAVE_STEPS, unit="blocks")
        if wave_steps and art is None:
            raise ValueError("wave_steps evaluates the ART monitor over a wave of steps: it needs art")
        if wave_steps and release_walks is not None:
            raise ValueError("wave_steps runs before the plan of a call told its walks or none: not with "
                             "release_walks")
    if release_step is not None:
        check_count(release_step, "release_step", 0, MAX_ART_STEPS, unit="blocks")
        if release_walks is None:
            raise ValueError("release_step is the on-demand followers' (release_walks)")
    wave_walks = None
    if walk_hint is not None:
        from .walk_hint import LongestWalkHint
        if not isinstance(walk_hint, LongestWalkHint):
            raise TypeError(f"walk_hint must be a kernels.walk_hint.LongestWalkHint, got {type(walk_hint).__name__}")
        if capturing and art is not None:
            raise RuntimeError("walk_hint cannot record inside a CUDA-graph capture (its copy to the host would only "
                               "happen at capture time); pass longest_stop_steps=hint.steps to a captured call")
        hinted = walk_hint.pair_walks
        if (pair_walks is None and longest_stop_steps is None and art is not None and num_splits is None
                and follow_step is None and release_walks is None and not wave_steps and hinted is not None
                and tuple(hinted.walks.shape) == (batch, kv_heads) and hinted.walks.device == q.device):
            planned = hint_plan(hinted, max_steps, head_dim, q.device, art,
                                wave=wave_steps is None and _told_wave_fits(batch * q_heads, hinted, max_steps,
                                                                            head_dim))
            pair_walks, release_walks = planned.get("pair_walks"), planned.get("release_walks")
            wave_steps = planned.get("wave_steps", 0)   # hint_plan has decided the told wave
            if wave_steps:
                wave_walks = hinted.walks
        if longest_stop_steps is None:
            longest_stop_steps = walk_hint.steps
    if pair_walks is not None:
        _check_pair_walks(pair_walks, batch, kv_heads, q.device, art, num_splits, follow_step)
        if longest_stop_steps is None:
            longest_stop_steps = pair_walks.sorted_walks[-1]
        if wave_steps is None and _told_wave_fits(batch * q_heads, pair_walks, max_steps, head_dim):
            # told each walk: the wave where it pays, then the walk planned for the longest
            wave_steps = told_wave_steps(pair_walks.sorted_walks, max_steps, head_dim, _num_sms(q.device)) or None
        if wave_steps:   # each pair's own wave (the kernels' told_wave_length of its walk), at most wave_steps
            wave_walks = pair_walks.walks
            pair_walks = None
    pair_threshold = None
    if num_splits is None and release_walks is not None:
        on_demand_keywords = on_demand_plan(max_steps, q.device, art)
        num_splits = on_demand_keywords["num_splits"]
        follow_step = on_demand_keywords["follow_step"] if follow_step is None else follow_step
        release_step = on_demand_keywords["release_step"] if release_step is None else release_step
    elif one_wave_splits is not None:
        num_splits = one_wave_splits
    elif num_splits is None:
        num_splits, planned_follow_step = choose_split_plan(
            batch, kv_heads, max_steps, q.device, art, block_size, head_dim, longest_stop_steps=longest_stop_steps,
            told_walks=None if pair_walks is None else pair_walks.sorted_walks)
        follow_step = planned_follow_step if follow_step is None else follow_step
        pair_plan = None if pair_walks is None else choose_pair_splits(batch, kv_heads, max_steps, q.device, art,
                                                                       block_size, head_dim, pair_walks)
        if pair_plan is not None:
            num_splits, pair_threshold = pair_plan
    else:
        check_count(num_splits, "num_splits", 1, MAX_SPLITS)
    if art is None or num_splits == 1 or follow_step is None or pair_threshold is not None:
        follow_step = 0
    monitored = art is not None
    # with per-pair splits and on-demand followers, a leader may walk the whole range: the monitor can stop there
    whole_walks = pair_threshold is not None or release_walks is not None
    dense_plan = planned_walk and art is None
    if art is not None and not leader_can_stop(max_steps, 1 if whole_walks else num_splits, art, follow_step):
        # no walk can stop: the dense walk gives the result; of this split count, bit for bit, where the caller
        # chose the walk, else of the dense plan's (the default dense call's where its blocks are the monitor's)
        art = None
        follow_step = 0
        if planned_walk and not whole_walks:
            num_splits = choose_split_plan(batch, kv_heads, max_steps, q.device, None, block_size, head_dim)[0]
            dense_plan = True

    on_demand = release_walks is not None and art is not None and num_splits > 1
    return DecodePlan(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, paged=paged, order=order,
                      sm_scale=float(sm_scale), seqlens=seqlens, max_len=max_len, max_steps=max_steps,
                      block_size=block_size, num_splits=num_splits, follow_step=follow_step, art=art,
                      monitored=monitored, pair_walks=pair_walks, pair_threshold=pair_threshold,
                      release_walks=release_walks if on_demand else None,
                      release_step=release_step if on_demand else None, dense_plan=dense_plan,
                      wave_steps=min(wave_steps or 0, max_steps), wave_walks=wave_walks)


def _told_wave_fits(query_heads: int, pair_walks: PairWalks, max_steps: int, head_dim: int) -> bool:
    """Whether the wave a call of ``query_heads`` query heads in all would take from the told walks ``pair_walks``
    (its longest's :func:`kernels.art_wave.told_wave_length`) fits ``TOLD_WAVE_MAX_WORKSPACE`` of scratch."""
    steps = min(told_wave_length(pair_walks.sorted_walks[-1]), max_steps)
    return wave_workspace_bytes(query_heads, steps, head_dim) <= TOLD_WAVE_MAX_WORKSPACE


def art_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
               cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
               sm_scale: float | None = None, art: ARTParams | None = None, order: str = "sink_recency",
               block_size: int | None = None, num_splits: int | None = None, longest_stop_steps: int | None = None,
               follow_step: int | None = None, walk_hint=None, pair_walks=None, release_walks: int | None = None,
               release_step: int | None = None, wave_steps: int | None = None, read_lengths: bool = True,
               return_lse: bool = False, return_stats: bool = False, return_result_steps: bool = False):
    """Decode attention with optional ART termination: the walk that :func:`plan_decode` resolves from the same
    arguments, in one launch.  The cache's values are not checked (that would read all of it): a NaN among the
    scores or values a pair walks makes its query heads' outputs and ``lse`` NaN, as dense attention does, and so
    does a block whose scores are all ``-inf`` (an infinite key; its running maximum stays ``-inf``), where dense
    attention over the other blocks would not.

    Args:
        q: ``[B, Hq, D]`` one query per sequence (fp16, bf16 or fp32), ``D`` in ``HEAD_DIMS``.
        k_cache, v_cache: contiguous ``[B, Hkv, S, D]``, or paged ``[num_pages, page_size, Hkv, D]``
            when ``block_table`` is given; same dtype and device as ``q``, unit stride in ``D``.
        cache_seqlens: ``[B]`` int32/int64 valid tokens per sequence, ``1 <= len <= capacity``
            (default: the capacity, ``S`` or ``max_pages * page_size``).  Inside a CUDA-graph capture
            the values are not read (that needs a sync): the graph is sized for the capacity, its replays
            read the tensor's current lengths, and keeping them (and ``block_table``'s pages) valid is
            the caller's part.
        block_table: ``[B, max_pages]`` int32/int64 page ids of each sequence (paged layout).
        sm_scale: softmax scale, default ``D ** -0.5``.
        art: monitor settings, or ``None`` for dense attention.
        order: ``"sequential"`` or ``"sink_recency"`` block traversal.
        block_size: tokens per KV block (the monitor's step), one of ``BLOCK_SIZES``; default
            ``ART_BLOCK_SIZE`` (64, the simulator's default) with ``art``, else the dense plan's
            (:func:`kernels.split_plan.dense_block_size`: ``DENSE_BLOCK_SIZE`` (128); 64 at ``D = 64``, but 128 where
            one split of 64-token blocks would leave 1.5-2 pairs per multiprocessor; ``PAGED_DENSE_BLOCK_SIZE`` (64) on
            pages that do not hold 128-token blocks whole), or 64 at ``D = 128`` where the 128-token walk's short
            waves are slower than one wave of 64-token blocks
            (:func:`kernels.split_plan.one_wave_dense_splits`, which then gives the split count).
        num_splits: programs per ``(b, kv_head)``; default :func:`kernels.split_plan.choose_split_plan`, or with
            ``release_walks`` :func:`kernels.split_plan.on_demand_plan`'s.
        longest_stop_steps: with ``art`` and the default follow step, the longest walk expected, in blocks:
            e.g. ``steps[..., 0].max()`` of an earlier call on this layer with ``num_splits=1`` and
            ``return_stats`` (at any split count, :class:`kernels.walk_hint.LongestWalkHint` takes it from
            the stats without a sync), or the simulator's stop steps on a captured layer (+ 1); default
            ``walk_hint``'s, else ``ART_STOP_MARGIN`` times the earliest stop.  Sets the default follow step
            (:func:`kernels.split_plan.choose_follow_step`).  Unused when ``follow_step`` is given or ``art``
            is ``None``.
        follow_step: with ``art`` and several splits, the leader's step from which the followers walk: they
            wait until the leader has walked that many blocks without stopping (*deferred followers*, module
            docstring); 0 starts them at once.  With ``release_walks``, the first step at which the leader may
            release them.  Default: :func:`kernels.split_plan.choose_split_plan`'s (with ``release_walks``,
            :func:`kernels.split_plan.on_demand_plan`'s) when ``num_splits`` is not given, else 0.
        walk_hint: a :class:`kernels.walk_hint.LongestWalkHint` of this layer: its latest longest walk is the
            default ``longest_stop_steps``, and where the shapes agree (and neither ``num_splits``, ``follow_step``,
            ``longest_stop_steps`` nor ``release_walks`` is given) its latest walk of each pair plans the call
            (:func:`kernels.split_plan.hint_plan`): a wave where it pays, else on-demand followers where those walks
            are lopsided, else the default ``pair_walks``; this call's walks are recorded into it (with ``art``; not
            inside a CUDA-graph capture; after a wave, the wave's result steps for the pairs it finished).
        pair_walks: with ``art``, a :class:`kernels.pair_walks.PairWalks` of this call's ``[B, Hkv]`` pairs: each
            pair's expected walk.  Its longest is the default ``longest_stop_steps``, and its walks decide whether
            a longest walk past the dense walk defers the followers to the guess
            (:func:`kernels.split_plan.choose_follow_step`); where the plan then takes one split, the pairs
            expected to walk long take every split of :func:`kernels.split_plan.choose_pair_plan` (module
            docstring, *per-pair splits*); where :func:`kernels.split_plan.told_wave_steps` takes a wave,
            the call runs it and plans the rest for the longest walk only.  Not with ``num_splits`` or
            ``follow_step``.
        release_walks: with ``art`` and several splits, the followers are released *on demand* (module docstring):
            each leader walks alone, and past ``follow_step`` (default 0) releases its followers over the rest of
            its walk only once at most this many of the launch's ``B * Hkv`` leaders are still walking alone; a pair
            whose leader stops first, or walks to its end, is the single walk.  Without ``num_splits``, the split
            count, follow step and release step of :func:`kernels.split_plan.on_demand_plan`, which also suggests this
            count.  Not with ``pair_walks``.
        release_step: with ``release_walks``, the leader's step from which it releases its followers whatever the
            count of leaders still walking alone (at the end of its first chunk at or past it), so that a launch in
            which too few walks stop does not walk alone to the end.  Default:
            :func:`kernels.split_plan.on_demand_plan`'s when ``num_splits`` is not given, else never.
        wave_steps: with ``art``, first attend the first ``wave_steps`` steps (at most ``MAX_WAVE_STEPS``) of every
            pair at once and evaluate the monitor over them as scans (``kernels.art_wave``): a pair whose query heads
            are all done within them, or whose walk is no longer, takes its output from the wave, and the walk that
            the other arguments plan runs for the other pairs only, from their first step.  A lone walk takes about
            1.2 us per 64-token block at ``D = 128``; the wave reads its blocks in parallel, ``min(wave_steps,
            blocks)`` of them per pair, also past a stop (``steps`` counts them in each leader's), with scratch of
            ``B * Hq * wave_steps * D`` floats and a little more (``kernels.art_wave.wave_workspace_bytes``: 300 MB
            at B = 128, Hq = 32, 128 steps, D = 128; past ``WAVE_STEP_TILE`` steps its monitor runs tile after
            tile); a told call takes no wave whose scratch would pass ``TOLD_WAVE_MAX_WORKSPACE`` (320 MiB).  With
            ``pair_walks``, each pair's wave is at most its told walk and an eighth
            (:func:`kernels.art_wave.told_wave_length`), and the rest is walked as told only the longest walk.  Not
            with ``release_walks``; with ``walk_hint``, the hint's walks plan nothing but the longest.
            0: no wave.  Default: none, except in a call told each pair's walk (``pair_walks``, or a ``walk_hint``'s
            where it plans the call), which takes the wave of :func:`kernels.split_plan.told_wave_steps` where that
            pays (module docstring, *the wave*): each pair's own, as above.
        read_lengths: ``False`` leaves ``cache_seqlens`` and ``block_table`` on the device: no sync (each call
            with lengths otherwise reads their min and max, and on the paged layout checks the pages they use).
            As inside a CUDA-graph capture, their values then go unchecked (keeping them in ``[1, capacity]`` with
            valid pages is the caller's part) and the split plan is made for the capacity, not the longest length.
        return_lse: also return ``lse [B, Hq]`` (fp32, natural log of the softmax normaliser of
            the scaled scores over the visited blocks).
        return_stats: also return ``steps [B, Hkv, splits]`` (int32): steps whose blocks entered each
            program's result (for the leader that stopped: its stop step + 1, as the simulator's
            ``stop_step + 1``), which are the blocks each program loaded.
        return_result_steps: also return ``result_steps [B, Hkv]`` (int32): the leading steps of the traversal
            order whose blocks entered the output.  Where the leader's result alone is the pair's (it stopped, or
            walked the whole walk alone) its ``steps``, else the whole walk (``ceil(cache_seqlens / block_size)``
            blocks): a follower's blocks loaded before it saw its leader stop do not count, nor does a leader that
            stopped at the last step of its range look like one that walked on.  Under ART, the simulator's
            ``stop_step + 1`` wherever the leader stopped.

    Returns:
        ``out [B, Hq, D]`` in ``q``'s dtype, followed by ``lse``, ``steps`` and ``result_steps`` when requested.
    """
    check_flags(return_lse=return_lse, return_stats=return_stats, return_result_steps=return_result_steps)
    plan = plan_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, sm_scale=sm_scale,
                       art=art, order=order, block_size=block_size, num_splits=num_splits,
                       longest_stop_steps=longest_stop_steps, follow_step=follow_step, walk_hint=walk_hint,
                       pair_walks=pair_walks, release_walks=release_walks, release_step=release_step,
                       wave_steps=wave_steps, read_lengths=read_lengths)
    batch, q_heads, kv_heads, head_dim = plan.batch, plan.q_heads, plan.kv_heads, plan.head_dim
    paged, seqlens, max_len, max_steps = plan.paged, plan.seqlens, plan.max_len, plan.max_steps
    art_params = art   # the caller's monitor: the wave's, also where the walk after it runs dense (plan.art None)
    block_size, num_splits, follow_step, art = plan.block_size, plan.num_splits, plan.follow_step, plan.art
    pair_walks, pair_threshold, on_demand = plan.pair_walks, plan.pair_threshold, plan.on_demand
    group = q_heads // kv_heads

    out = _scratch((batch, q_heads, head_dim), q.dtype, q.device)
    lse = _scratch((batch, q_heads), torch.float32, q.device)
    steps = _scratch((batch, kv_heads, num_splits), torch.int32, q.device)
    kept = _scratch((batch, kv_heads), torch.int32, q.device) if return_result_steps else steps
    single = num_splits == 1
    if single:
        part_out, part_lse, arrivals = out, lse, steps
    else:
        part_out = _scratch((batch, q_heads, num_splits, head_dim), torch.float32, q.device)
        part_lse = _scratch((batch, q_heads, num_splits), torch.float32, q.device)
        arrivals = _arrival_counters(q.device, batch * kv_heads)
    monitor = art if art is not None else ARTParams()
    table = block_table if paged else steps          # steps: a placeholder pointer, never read
    lengths = steps if seqlens is None else seqlens
    strides_k, strides_v = kv_strides(k_cache, paged), kv_strides(v_cache, paged)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    loads = _kv_loads(k_cache, v_cache, paged, block_size, uniform=seqlens is None,
                      leader_steps=(max_steps if on_demand else leader_range(max_steps, num_splits, follow_step)
                                    if art is not None and num_splits > 1 else None))
    programs = batch * kv_heads * num_splits
    pair_gates = plan.per_pair_splits
    if pair_gates:   # the followers of the pairs below the threshold have empty ranges
        programs = batch * kv_heads + (num_splits - 1) * sum(w > pair_threshold for w in pair_walks.sorted_walks)
    elif on_demand:   # the followers are dispatched after every leader and wait: the leaders alone walk at once (V52)
        programs = batch * kv_heads
    longest_first = plan.longest_first
    num_warps, num_stages = _launch_config(q.device, block_size, head_dim, programs, loads, paged=paged,
                                           single_walks=pair_walks if longest_first and single else None,
                                           pair_splits=pair_gates, dense_plan=plan.dense_plan)
    block_g = triton.next_power_of_2(group)
    block_h, probe_rows = tile_rows(group)
    k_arg, v_arg = k_cache, v_cache
    if loads == "host_descriptors":
        k_arg, v_arg = (host_descriptor(x, block_size, rows=max_len) for x in (k_cache, v_cache))
    elif loads in ("page_descriptors", "subpage_descriptors"):
        k_arg, v_arg = (page_descriptor(x, min(block_size, k_cache.shape[1])) for x in (k_cache, v_cache))
    deferred = plan.deferred
    wave_done = steps                                # a placeholder pointer without a wave, never read
    if plan.wave_steps:
        wave_done = run_wave(q, k_cache, v_cache, monitor=art_params, wave_steps=plan.wave_steps,
                             block_size=block_size, order=plan.order, sm_scale=plan.sm_scale, kv_heads=kv_heads,
                             max_len=max_len, seqlens=seqlens, block_table=block_table,
                             pair_walks=plan.wave_walks, strides=(strides_k, strides_v),
                             dot_precision=dot_precision, direction=_direction_build(art_params), block_h=block_h,
                             out=out, lse=lse)
    grid = (batch * kv_heads, num_splits) if deferred or pair_gates or on_demand else (num_splits, batch * kv_heads)
    art_decode_split_kernel[grid](
        q, k_arg, v_arg, table, lengths,
        out, lse, part_out, part_lse, steps, kept, arrivals,
        pair_walks.walks if pair_gates else _release_words(q.device, batch * kv_heads) if on_demand else steps,
        pair_walks.launch_order if longest_first else steps, wave_done,
        plan.sm_scale, float(monitor.tau), float(monitor.phi), int(monitor.patience),
        max(1, int(monitor.min_steps)),
        kv_heads, num_splits, max_len, follow_step, GATE_POLLS_PER_STEP * (max_steps if on_demand else follow_step),
        pair_threshold if pair_gates else plan.release_walks if on_demand else 0,
        min(plan.release_step, max_steps) if on_demand and plan.release_step is not None else max_steps,
        q.stride(0), q.stride(1), *strides_k, *strides_v,
        table.stride(0) if paged else 0, out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=block_h, BLOCK_N=block_size, HEAD_DIM=head_dim,
        PAGED=paged, SINK_RECENCY=plan.order == "sink_recency", SINGLE_SPLIT=single,
        ART=art is not None, PROBE_OUTPUT=monitor.probe_source == "output",
        PROBE_MMA=monitor.probe_dims == "mma", RELATIVE=monitor.scale == "relative",
        USE_SCALE=monitor.use_scale, USE_DIRECTION=_direction_build(monitor), ART_CHUNK=ART_CHUNK,
        DOT_PRECISION=dot_precision, BLOCK_G=block_g, BLOCK_S=triton.next_power_of_2(num_splits),
        COMBINE_CHUNK=min(max(1, COMBINE_ROWS // block_g), triton.next_power_of_2(num_splits)),
        RAGGED=seqlens is not None, LOADS=loads, PROBE_ROWS=probe_rows,
        PAGE_SIZE=k_cache.shape[1] if paged else 1, DEFERRED=deferred, PAIR_GATES=pair_gates,
        LONGEST_FIRST=longest_first, ON_DEMAND=on_demand, PROGRAM_THREADS=32 * num_warps,
        POLL_NS=ON_DEMAND_POLL_NS if q.device.type == "cuda" else 0, RECORD_KEPT=return_result_steps,
        WAVE=plan.wave_steps > 0, num_warps=num_warps, num_stages=num_stages)
    # each pair's result steps where the wave finished it (else 0) and the blocks its wave read, [B, Hkv] each
    wave_result, wave_read = wave_done.view(batch, kv_heads, 2).unbind(-1) if plan.wave_steps else (None, None)
    if walk_hint is not None and plan.monitored:
        walk_hint.record(steps, follow_step=follow_step, on_demand=on_demand,
                         wave=(wave_result, wave_read) if plan.wave_steps else None)
    results = (out,) + ((lse,) if return_lse else ()) + ((steps,) if return_stats else ())
    if return_result_steps:   # the leader's steps where its result alone is the pair's, else the whole walk
        # after a wave: the leader's steps without the wave's blocks, and the wave's result where it finished the pair
        leader_steps = steps[..., 0] - wave_read if plan.wave_steps else steps[..., 0]
        walked = torch.where(kept == 1, leader_steps, plan.walk_blocks)
        if plan.wave_steps:
            walked = torch.where(wave_result > 0, wave_result, walked)
        results += (walked,)
    return results[0] if len(results) == 1 else results


def tile_rows(group: int) -> tuple[int, int]:
    """``(BLOCK_H, PROBE_ROWS)`` for ``group`` query heads per KV head: the rows of the kernel's ``tl.dot``
    tile (a power of two, at least the 16 rows of an MMA), and the leading rows the ART monitor reads,
    half of them when the group fits there (the others are padding), else all."""
    block_h = max(MMA_ROWS, triton.next_power_of_2(group))
    return block_h, block_h // 2 if group <= block_h // 2 else block_h


def _scratch(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised kernel output (every element is written by the kernels)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (no value can be read back)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_ARRIVAL_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_RELEASE_WORDS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _zero_between_launches(store: dict, device: torch.device, length: int) -> torch.Tensor:
    """``[length]`` int32 of ``store`` on ``device``, which every launch leaves at zero: allocated zeroed once per
    device and length and kept for the process.  A first call for a shape inside a CUDA-graph capture gets a buffer
    of its own, zeroed by a memset node of the graph, and does not cache it (the memset has not run when the capture
    ends, so eager calls could not use that buffer)."""
    key = (device, length)
    words = store.get(key)
    if words is None:
        words = torch.zeros(length, dtype=torch.int32, device=device)
        if not _capturing(device):
            store[key] = words
    return words


def _arrival_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """``[pairs]`` int32, zero between launches (:func:`_zero_between_launches`): per ``(b, kv_head)`` the arrival
    counter of the multi-split kernel, with the converged flag in its bit ``CONVERGED`` (module docstring, *one
    launch*)."""
    return _zero_between_launches(_ARRIVAL_COUNTERS, device, pairs)


def _release_words(device: torch.device, pairs: int) -> torch.Tensor:
    """``[pairs + 1]`` int32 of the on-demand followers (``release_walks``): each ``(b, kv_head)``'s release step
    (written before its ``RELEASED`` bit, read only after it), then the launch's count of pairs whose leader has
    released its followers or finished alone, zero between launches (the last to count puts it back;
    :func:`_zero_between_launches`)."""
    return _zero_between_launches(_RELEASE_WORDS, device, pairs + 1)


def _kv_loads(k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool, block_size: int, *, uniform: bool,
              leader_steps: int | None) -> str:
    """How the kernel reads K and V tiles (``art_decode_split_kernel``'s ``LOADS``).

    Tensor descriptors (bulk copies) on the contiguous layout for blocks of at most ``TMA_MAX_BLOCK``
    tokens and tensors a descriptor can address, else pointer loads.  With uniform lengths the launcher
    makes them (``"host_descriptors"``: one pair for the whole cache, bounded at the length); with ragged
    lengths each program makes its sequence's (``"kernel_descriptors"``), a fixed cost per program that
    short walks do not repay, so in the ART leader scheme (``leader_steps``: blocks per split, ``None``
    otherwise) only for ``D = 128`` and at least ``LEADER_TMA_MIN_STEPS`` blocks per split
    (``benchmarks/NOTES-art-decode.md``, V8).  On the paged layout, descriptors made on the host
    (``"page_descriptors"``) when each block lies within one page (``page_size`` a multiple of the block),
    or one per page of a block made of whole pages of at least ``MIN_SUBPAGE`` tokens
    (``"subpage_descriptors"``), else pointer loads (V29, V30)."""
    if block_size > TMA_MAX_BLOCK or not (descriptor_ready(k_cache) and descriptor_ready(v_cache)):
        return "pointers"
    if paged:
        page_size = k_cache.shape[1]
        if page_size % block_size == 0:
            return "page_descriptors"
        return "subpage_descriptors" if block_size % page_size == 0 and page_size >= MIN_SUBPAGE else "pointers"
    if uniform:
        return "host_descriptors"
    if leader_steps is not None and (k_cache.shape[-1] != 128 or leader_steps < LEADER_TMA_MIN_STEPS):
        return "pointers"
    prepare_descriptors(k_cache.device)
    return "kernel_descriptors"


def _launch_config(device: torch.device, block_size: int, head_dim: int, programs: int, loads: str, *,
                   paged: bool = False, single_walks=None, pair_splits: bool = False,
                   dense_plan: bool = False) -> tuple[int, int]:
    """``(num_warps, num_stages)``: on Hopper and newer, 3 K/V stages; 4 warps for the dense 128-token
    blocks; for blocks of at most ``TMA_MAX_BLOCK`` tokens (the monitor's walks) 2 warps, or 1 for
    ``D = 64`` tiles read through host-made descriptors (``loads``, see :func:`_kv_loads`; V13: the
    monitored 64-dim walk 10-19 % faster and its never-stopping overhead +5.6 -> +0.1 % at one split,
    while with pointer loads one warp was 39 % slower).  A grid of 64-token blocks of ``D = 128``
    larger than ``RESIDENT_AT_THREE_STAGES`` programs per multiprocessor gets 2 stages: then 5 programs
    fit on a multiprocessor instead of 3 (shared memory, V69; V9 counted 4), so B = 64's 512 programs run in one wave
    instead of 1.3 (V9; ``programs``: those that walk at once, an on-demand call's leaders), unless the call
    walks each pair single, launched longest first from ``single_walks`` (a :class:`kernels.pair_walks.PairWalks`),
    on the contiguous layout, and :func:`kernels.split_plan.longest_first_three_stages` prefers 3 stages for those walks
    (evaluated once per walks object).  A call with per-pair splits (``pair_splits``) of 64-dim tiles through host
    descriptors takes ``PAIR_SPLIT_STAGES`` (4) stages: 4 programs per multiprocessor instead of 6 at 3 stages (shared
    memory), which shortened the SmolLM2 layer's per-pair plans at B = 128 by 2-7 % (V46).  ART and dense calls of one
    shape get the same configuration, so that ``tau = phi = 0`` stays bit-identical to dense, except the dense plan
    (``dense_plan``: a dense walk whose block size and split count the launcher chose), whose 64-dim tiles through
    host descriptors take 2 warps: without the monitor's latency to hide, one warp per program left too few loads
    in flight (V61: the SmolLM2 shape at B = 1 x 32k, 88 splits, 19.6 us at 1 warp, 17.1 at 2).

    The paged layout takes ``PAGE_TABLE_STAGES`` more stages: each K/V tile's rows come from a page-table
    load, which the software pipeliner stages ahead of the tile, so at the contiguous layout's stage count
    the tiles are single-buffered (one step of lookahead); two more restore the contiguous layout's
    double-buffered tiles at about its shared memory (``benchmarks/NOTES-art-decode.md``, V29)."""
    if not (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9):
        return 4, 2
    if block_size > TMA_MAX_BLOCK:
        warps, stages = 4, 3
    elif head_dim == 64 and loads == "host_descriptors":
        warps, stages = 2 if dense_plan else 1, PAIR_SPLIT_STAGES if pair_splits else 3
    elif (block_size == TMA_MAX_BLOCK and head_dim == 128 and programs > RESIDENT_AT_THREE_STAGES * _num_sms(device)
          and not (single_walks is not None and not paged and single_walks.memo(
              ("three_stages", head_dim, _num_sms(device)),
              lambda: longest_first_three_stages(single_walks.sorted_walks, head_dim, _num_sms(device))))):
        warps, stages = 2, 2
    else:
        warps, stages = 2, 3
    return warps, stages + (PAGE_TABLE_STAGES if paged else 0)


def _direction_build(monitor: ARTParams) -> int:
    """The monitor's direction-test build (``USE_DIRECTION``): the guards of a zero probe (``1 - cos = 1``, stable
    only where ``phi > 1``) and of ``phi = 0`` (a rounding below zero must not pass) are compiled in only for a
    ``phi`` outside ``(0, 1]``, where they can change a step; within it they hold and cost latency.  The kernel
    reads ``phi`` in fp32, where a ``phi`` up to ``FP32_ROUNDS_TO_ZERO`` is 0 (a ``phi`` just above 1 that rounds
    to 1 keeps the guards, which hold there too)."""
    if not monitor.use_direction:
        return DIRECTION_OFF.value
    return (DIRECTION_ON if FP32_ROUNDS_TO_ZERO < monitor.phi <= 1.0 else DIRECTION_GUARDED).value


def _check_tensors(q, k_cache, v_cache, block_table):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    layout = "[num_pages, page_size, Hkv, D]" if block_table is not None else "[B, Hkv, S, D]"
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be {layout}, got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    devices = {q.device, k_cache.device, v_cache.device}
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
        devices.add(block_table.device)
    if len(devices) != 1:
        raise ValueError("q, k_cache, v_cache (and block_table) must be on one device, "
                         f"got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(f"art_decode runs on a CUDA device (or on the CPU with TRITON_INTERPRET=1), got {q.device}")
    batch, q_heads, head_dim = q.shape
    if batch < 1 or q_heads < 1:
        raise ValueError(f"q must hold at least one sequence and one query head, got shape {tuple(q.shape)}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {HEAD_DIMS}, got {head_dim}")
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"head dim mismatch: q has D={head_dim}, k_cache and v_cache have D={k_cache.shape[-1]}")
    if block_table is not None and (k_cache.shape[0] < 1 or k_cache.shape[1] < 1):
        raise ValueError(f"paged k_cache {layout} needs at least one page of at least one token, "
                         f"got {tuple(k_cache.shape)}")
    if block_table is None and k_cache.shape[0] != batch:
        raise ValueError(f"contiguous k_cache must be [B, Hkv, S, D] with B={batch}, got {tuple(k_cache.shape)} "
                         "(pass block_table for the paged layout)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in the head dim, got strides {t.stride()}")
    if block_table is not None:
        if block_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"block_table must be int32 or int64, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be [B={batch}, max_pages], got shape {tuple(block_table.shape)}")
        if block_table.stride(1) != 1:
            raise ValueError("block_table must have unit stride along pages")
    return batch, q_heads, head_dim


def _check_pair_walks(pair_walks, batch: int, kv_heads: int, device: torch.device, art, num_splits, follow_step):
    if not isinstance(pair_walks, PairWalks):
        raise TypeError(f"pair_walks must be a kernels.pair_walks.PairWalks, got {type(pair_walks).__name__}")
    if art is None:
        raise ValueError("pair_walks plans the monitored walks: it needs art (got art=None)")
    if num_splits is not None or follow_step is not None:
        raise ValueError("pair_walks chooses the split count and the followers' start: pass neither num_splits "
                         "nor follow_step with it")
    if tuple(pair_walks.walks.shape) != (batch, kv_heads):
        raise ValueError(f"pair_walks must hold one walk per (b, kv_head): [{batch}, {kv_heads}], got "
                         f"{list(pair_walks.walks.shape)}")
    if pair_walks.walks.device != device:
        raise ValueError(f"pair_walks must be on q's device {device}, got {pair_walks.walks.device}")


def _check_seqlens(cache_seqlens, batch, capacity, capacity_name, device, read_values=True):
    """``(seqlens, max length)``: ``seqlens`` the ``[B]`` int32 lengths on the device when they differ,
    ``None`` when every sequence has the max length (the kernel then takes it as a scalar).  Validates
    ``1 <= len <= capacity`` (one sync).  Without ``read_values`` (a CUDA-graph capture) only the tensor's
    type, shape and device are checked: the lengths stay a tensor and the max length is the capacity."""
    if cache_seqlens is None:
        if capacity < 1:
            raise ValueError(f"the KV cache holds no token ({capacity_name} = {capacity}); it needs at least one")
        return None, capacity
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor [B], got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_seqlens must be int32 or int64, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape [B]=[{batch}], got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on {device}, got {cache_seqlens.device}")
    if not read_values:
        return cache_seqlens.to(torch.int32).contiguous(), capacity
    low, high = torch.stack(torch.aminmax(cache_seqlens)).tolist()
    if low < 1:
        raise ValueError(f"cache_seqlens must be >= 1, got a length of {low}")
    if high > capacity:
        raise ValueError(f"cache_seqlens holds a length of {high} beyond the capacity of {capacity} tokens "
                         f"({capacity_name})")
    return (None if low == high else cache_seqlens.to(torch.int32).contiguous()), high


def _check_block_table(block_table, seqlens, page_size, num_pages):
    """Every page a sequence uses must be a valid page id (one sync).  ``seqlens``: ``[B]`` lengths, or
    one length (an int) for every sequence."""
    if isinstance(seqlens, int):
        pages_used = -(-seqlens // page_size)
    else:
        pages_used = ((seqlens.to(torch.int64) + page_size - 1) // page_size)[:, None]
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, p = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {p}] = {int(block_table[b, p])} is not a page id in [0, {num_pages})")
