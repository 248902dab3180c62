"""Decode-attention speed on one GPU: the ART kernel against the best dense decode kernels.

Everything is measured in one run with ``triton.testing.do_bench`` medians.  Each call starts with a cold L2,
emptied by a read rather than by do_bench's memset, whose dirty lines took the timed kernel about 10 us to write
back (:mod:`kernels.l2_flush`).  The rows of the time bound (``MEMSET_FLUSH_IMPLS``) are also timed after the
memset (``ms_memset_flush``), and their bound is checked under both (``meets_time_bound_memset_flush``).  The run
measures:

* the copy-bandwidth ceiling (bytes read + written of a 1 GiB copy);
* per ``(B, S)`` with ``Hq / Hkv = 32 / 8``, ``D = 128``, bf16: the peers cuDNN SDPA, flash
  SDPA and FlexAttention decode (where it compiles; failures are recorded), this kernel in
  dense mode (``art=None`` at its dense plan: 128-token blocks at ``D = 128``, 64 at ``D = 64``), dense at the
  monitor's block size 64 and with never-terminating thresholds (``NEVER``; same block size and split count:
  the monitor's overhead, summarised over the rows where the monitor runs: ``monitor_runs`` is false
  where the leader's range is shorter than the earliest stop and the call is the dense walk,
  ``kernels.split_plan.leader_can_stop``), never-terminating at the default split plan (``art_never_default``:
  what a call costs when no walk stops, deferred followers included; summarised over dense as
  ``never_default_over_dense_*``), and with the given ART thresholds at the default split count
  (``num_splits`` and ``follow_step`` of the call's plan, ``kernels.art_decode.plan_decode``, as every row's plan:
  followers deferred until the leader has walked that many blocks, or 0),
  and again told each walk (``art_calibrated``: ``pair_walks`` from the stats of one earlier single-split call
  on the same inputs, so the split rule takes their longest as ``longest_stop_steps``, and where it then takes one
  split the walks expected to run long take every split of ``kernels.split_plan.choose_pair_plan``:
  ``pair_split_threshold``, ``pair_split_walks``; told each walk, the call also launches the pairs longest
  first, ``kernels.art_decode``'s *launch order*; where ``kernels.split_plan.told_wave_steps`` takes a wave, the
  told call runs it (``wave_steps``), then the walk planned for the longest, and its row has no latency floor or walk
  model; a decode loop has only its previous step's walks, which :mod:`kernels.bench_decode_loop` times), and after
  a wave of ``WAVE_STEPS`` steps (``art_wave``: ``art_decode``'s ``wave_steps``, :mod:`kernels.art_wave`;
  ``wave_finished_pairs``: the share of pairs whose single walk ends within the wave, which the wave finishes, the
  others walked after it at the default plan; the wave's blocks count in the loaded fraction and the bound;
  ``over_art``: its time over the ``art`` row's);
* the same on a captured SmolLM2 layer (``D = 64``, ``Hq / Hkv = 9 / 3``) tiled to length;
* the split study: ART with one split and with the leader scheme over one wave of programs
  (loaded fractions of all programs and of the leader), and the dense kernel over a sweep of
  split counts and block sizes 64 / 128;
* the dense default at batch sizes off the grid, where the programs fill the multiprocessors unevenly, and at the
  grid's up to 64 (``dense_batches``: ``DENSE_BATCHES`` x ``DENSE_BATCH_LENGTHS``) against cuDNN and flash SDPA,
  and beside it the one-wave plan of 64-token blocks (:func:`kernels.split_plan.one_wave_small_block_splits`) at every
  shape, which the default takes for walks of at most 8k tokens (4k too) where its 128-token grid runs short waves
  (V71), each timing over ``DENSE_BATCH_REP_MS`` (:func:`bench_dense_batches`, summarised by
  :func:`dense_batches_summary`);
* the paged layout (``paged``): dense and ART at the launcher's defaults on the synthetic cache at
  ``PAGED_CASES`` and on shuffled page pools of it with pages of ``PAGE_SIZES`` tokens
  (:func:`bench_paged`), each time over the contiguous layout's, and whether the paged ART walks equal
  the contiguous ones bit for bit (summarised by :func:`paged_summary`).

Every row's ``ms`` is the median GPU time of a CUDA-graph replay of the call (``eager_ms``: the
plain call, which also pays the host-side launch cost of the Python launcher).  The graph times of
one shape are taken in ``ROUNDS`` interleaved rounds (every implementation once per round, in the
same order) and ``ms`` is the median over the rounds (``ms_rounds`` keeps each), so that a drift of
the card during a shape (clocks, power cap) reaches every implementation alike: one-pass full runs
had shown single rows 6-20 % slow that were not slow when repeated.  The monitor's overhead is a ratio of two
calls (``MONITOR_OVERHEAD_PAIR``) that a drift of 1 % hides: where either's first rounds spread by more than
the target, both are timed on, interleaved, to ``SETTLE_ROUNDS`` rounds in all, and their median is over every
round.  Where NVML can be read, each row
also keeps the SM clock and power draw read as each of its rounds ends (``sm_mhz_rounds``,
``power_w_rounds``), so that a round slow on a throttled card can be told from a slow kernel.

KV caches are structured (sink, recency, heavy hitters: a ``make_cache`` callable such as
``art_analysis.synthetic.synthetic_cache``, passed in by the CLI since ``kernels`` imports
nothing from ``art_analysis``); two distinct sequences are generated per length and tiled
over the batch.  Throughput is KV bytes read once (``2 B Hkv S D`` elements) over time; ART
rows also report the *loaded fraction*, the K/V blocks the programs really loaded
(``return_stats``) over all blocks, and check the target
``ms <= 1.15 * loaded_fraction * dense_ms + 0.010``.  They also report ``stopped_pairs``, the share of
``(b, kv_head)`` pairs whose output stopped before the walk's last block (``return_result_steps``), next to
``single_stopped_pairs``, the share whose single walk stops: what the split plan keeps of the rule's termination in
the output (a leader that cannot stop in its range gives the whole attention), where the loaded fraction counts
the traffic, the followers' too.

A monitored walk is sequential: its step ``t`` cannot start before step ``t - 1`` has been checked.  So
an ART call cannot end before its longest leader walk (``leader_steps_max`` blocks) has run at the
fastest a walk runs, alone on a multiprocessor.  That per-block time is measured once per data kind
(:func:`lone_walk_latency`: one split, never-terminating thresholds, B = 1, two lengths; the slope is
``step_us``, the intercept ``fixed_us``), and each ART row reports its *latency floor*
``fixed_us + leader_steps_max * step_us`` and whether the time bound lies below it (a bound no walk of
this step time can meet, whatever the traffic).  Single-split ART rows also report ``model_ms``
(:func:`walk_model_ms`): the time of their walks (each pair's ``return_stats`` steps) under the fluid model of
``kernels.walk_model``, at the lone walk's pace and the row's dense throughput shared evenly, and
``walk_steps_histogram`` (``{steps: pairs}``), from which it was computed, and ``walks_dense_ms``: the
``art_walks_dense`` row, the dense kernel (block 64, one split) reading exactly as many blocks per program as
the single-split ART walks, in the same launch order and without a monitor (:func:`walk_replay_inputs`; its
ragged lengths are read by the graph's replays).  ART's time over it is what the monitor and the stopping
cost on those walks; a time bound below it (``time_bound_below_walks_dense``) is one that the dense kernel
misses on the same blocks.  Given the simulator's replay
(the CLI passes it), the run also compares the kernel's single-split walks on each length's distinct sequences
with the simulator's, at the benchmark's sizes (``stop_agreement``: pairs equal, off by one, the largest
difference), and the default plan's outputs on them with the blocks the simulator's walks give them
(``plan_equal``: the walk where it ends within the leader's range, else every block; ``plan_stopped`` against
``stopped``, the outputs that stopped before the walk's end).

``run(out_dir, quick, art=..., make_cache=..., capture=..., replay=...)`` writes
``<out_dir>/<date>-art-decode.json`` (device, versions, date, ceilings, the lone walks, the stop agreement,
every row, the split study, the dense batches, the paged rows, summary).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from tqdm.auto import tqdm

from .art_decode import ART_BLOCK_SIZE, art_decode, plan_decode
from .art_params import ARTParams
from .device_info import clock_and_power, num_sms
from .l2_flush import l2_flush
from .paged_cache import to_paged
from .pair_walks import PairWalks
from .results_io import input_file_record, latest_result, source_revision, write_json_atomic
from .split_plan import SMALL_BLOCK_PROGRAMS_PER_SM, choose_num_splits, leader_splits, one_wave_small_block_splits
from .walk_model import shared_bandwidth_ms

BATCHES = (1, 8, 32, 64, 128, 256)
LENGTHS = (8192, 32768, 131072)
QUICK_BATCHES = (1, 32)
QUICK_LENGTHS = (8192, 32768)
CAPTURE_BATCHES = (1, 32, 128)
FLEX_CASES = ((1, 32768), (8, 32768), (32, 32768))
SPLIT_STUDY = ((1, 32768), (1, 131072), (8, 131072), (32, 32768), (64, 32768))
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128)
PAGED_CASES = ((8, 32768), (32, 32768), (128, 8192))
QUICK_PAGED_CASES = ((32, 8192),)
PAGE_SIZES = (16, 64)
LONE_WALK_LENGTHS = (8192, 32768)
# between the grid's batch sizes, and the grid's 8, 32 and 64 beside them; 9, 17, 52 and 72 and 4k tokens: where the
# dense plan's one-wave walk (split_plan.one_wave_dense_splits, V71) applies but no run had timed it
DENSE_BATCHES = (2, 3, 4, 6, 8, 9, 10, 12, 14, 16, 17, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 40, 44, 48, 52, 56, 64,
                 72)
DENSE_BATCH_LENGTHS = (4096, 8192, 32768)
QUICK_DENSE_BATCHES = (6, 18)
DENSE_BATCH_REP_MS = 50          # per timing of the dense batches (84 shapes x 4 calls x ROUNDS), as in V68's runs
ROUNDS = 3
MAX_KV_BYTES = 80 * 2 ** 30
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# never-terminating: with tau = 0 no step passes the scale test; phi keeps its default, so that the monitor is the
# default build (a phi outside (0, 1] compiles the direction test's guards in: kernels.art_decode._direction_build)
NEVER = ARTParams(tau=0.0)
MONITOR_OVERHEAD_TARGET = 0.01
# the never-stopping call and its dense reference at the same plan: timed on to SETTLE_ROUNDS rounds where either's
# first ROUNDS spread by more than MONITOR_OVERHEAD_TARGET (V72: 32 x 128k spread 4.4 % over 3 rounds in V71's run)
MONITOR_OVERHEAD_PAIR = ("art_never", "art_dense_bs64")
SETTLE_ROUNDS = 9
DENSE_TARGET = 0.97              # dense over the best peer's throughput, B >= 16
WAVE_STEPS = 48                  # the art_wave rows' wave: the fastest of 32 / 48 / 64 on the synthetic caches (V82)
# what a resumed run must share with the run it continues (kernels.bench.run(resume=True))
RESUME_FIELDS = ("suite", "device", "sm_count", "versions", "source", "quick", "art", "l2_flush", "capture_file")
# timed after do_bench's memset as well (kernels.l2_flush): the time bound's rows, under either flush
MEMSET_FLUSH_IMPLS = ("art", "art_calibrated", "art_dense")


def kv_bytes(k: torch.Tensor) -> int:
    """Bytes of K and V ``[B, Hkv, S, D]`` read once."""
    return 2 * k.numel() * k.element_size()


def throughput(nbytes: int, ms: float, ceiling: float) -> dict:
    """A row's ``tb_per_s`` (``nbytes`` read in ``ms``) and ``fraction_of_copy_ceiling`` (of ``ceiling`` TB/s)."""
    tb_per_s = nbytes / ms / 1e9
    return {"tb_per_s": tb_per_s, "fraction_of_copy_ceiling": tb_per_s / ceiling}


def median_ms(fn: Callable[[], object], rep_ms: int, flush: str = "read") -> float:
    """``do_bench`` median in milliseconds, the L2 emptied before each call as ``flush`` says
    (:func:`kernels.l2_flush.l2_flush`)."""
    with l2_flush(flush):
        return float(triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))


def graph_ms(fn: Callable[[], object], rep_ms: int, flush: str = "read") -> float:
    """``do_bench`` median of a CUDA-graph replay of ``fn`` (GPU time without the host launch cost; ``flush``: as
    :func:`median_ms`)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = median_ms(graph.replay, rep_ms, flush)
    del graph
    return ms


def copy_ceiling_tb_per_s(device: torch.device) -> float:
    """Device-to-device copy bandwidth, counting bytes read and written."""
    src = torch.randn(2 ** 28, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 200)
    return 2 * src.numel() * src.element_size() / ms / 1e9


def structured_sequences(make_cache: Callable, seqlen: int, device: torch.device, q_heads: int = Q_HEADS,
                         kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, ...]:
    """Two sequences of ``make_cache`` (realistic preset, bf16; by default ``Hq / Hkv = 32 / 8``, ``D = 128``) on
    ``device``."""
    cache = make_cache(batch=2, num_q_heads=q_heads, num_kv_heads=kv_heads, seqlen=seqlen, head_dim=head_dim,
                       preset="realistic", dtype=torch.bfloat16)
    return tuple(x.to(device) for x in (cache.q, cache.k, cache.v))


def tile_batch(tensors: tuple[torch.Tensor, ...], batch: int) -> tuple[torch.Tensor, ...]:
    """Repeat the rows of ``tensors`` (each ``[B0, ...]``) cyclically to ``batch`` rows (contiguous copies)."""
    rows = torch.arange(batch, device=tensors[0].device) % tensors[0].shape[0]
    return tuple(x[rows].contiguous() for x in tensors)


def tiled_capture(path: str | os.PathLike, batch: int, seqlen: int, device: torch.device,
                  step: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A captured layer (safetensors ``k, v [B0, Hkv, S0, D]``, ``decode_q [B0, Hq, steps, D]``: ``B0`` captured
    sequences) tiled to ``seqlen`` tokens; batch row ``b`` uses sequence ``b % B0`` and its decode query
    ``(b // B0) % steps``, or decode query ``step`` in every row when it is given."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    k, v, decode_q = tensors["k"], tensors["v"], tensors["decode_q"]
    reps = -(-seqlen // k.shape[2])
    k, v = (x.repeat(1, 1, reps, 1)[:, :, :seqlen].to(device=device, dtype=torch.bfloat16) for x in (k, v))
    rows = torch.arange(batch)
    sequence = rows % decode_q.shape[0]
    queries = (rows // decode_q.shape[0]) % decode_q.shape[2] if step is None else torch.full_like(rows, step)
    q = decode_q[sequence, :, queries].to(device=device, dtype=torch.bfloat16)
    sequence = sequence.to(device)
    return q.contiguous(), k[sequence].contiguous(), v[sequence].contiguous()


CAPTURED_LAYER_DTYPES = ("F16", "BF16", "F32")   # safetensors' names of the float dtypes a captured layer holds


def decode_query_shape(path: str | os.PathLike) -> tuple[int, int, int, int]:
    """``(B0, Hq, steps, D)`` of a captured layer's ``decode_q``, read from the file's header after checking that the
    file is a captured layer: float ``k, v [B0, Hkv, S0, D]`` and ``decode_q [B0, Hq, steps, D]`` with ``Hq`` a
    multiple of ``Hkv``; ``FileNotFoundError`` or ``ValueError`` naming the file otherwise."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"the captured layer {path} is not a file")
    expected = ("a captured layer (a capture folder's layer_NNN.safetensors, e.g. of `art-analysis capture --dtype "
                "float16`): float k, v [B0, Hkv, S0, D] and decode_q [B0, Hq, steps, D]")
    try:
        with safe_open(str(path), framework="pt") as tensors:
            names = set(tensors.keys())
            if not {"k", "v", "decode_q"} <= names:
                raise ValueError(f"{path} holds {sorted(names)}; expected {expected}")
            header = {name: tensors.get_slice(name) for name in ("k", "v", "decode_q")}
            shapes = {name: tuple(piece.get_shape()) for name, piece in header.items()}
            dtypes = {name: piece.get_dtype() for name, piece in header.items()}
    except SafetensorError as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc}); expected {expected}") from exc
    k, v, q = shapes["k"], shapes["v"], shapes["decode_q"]
    fits = (len(k) == 4 and v == k and len(q) == 4 and min(k + q) >= 1 and q[0] == k[0] and q[3] == k[3]
            and q[1] % k[1] == 0 and all(dtype in CAPTURED_LAYER_DTYPES for dtype in dtypes.values()))
    if not fits:
        raise ValueError(f"{path} holds k {k}, v {v}, decode_q {q} of dtypes {dtypes}; expected {expected}")
    return q


def capture_queries(path: str | os.PathLike) -> int:
    """The decode queries of a captured layer (``decode_q [B0, Hq, steps, D]``), ``B0 * steps``: its distinct batch
    rows when tiled (:func:`tiled_capture`)."""
    sequences, _, steps, _ = decode_query_shape(path)
    return sequences * steps


def distinct_inputs(data: str, seqlen: int, device: torch.device, make_cache: Callable,
                    capture: str | os.PathLike | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of the distinct batch rows of a benchmark input (a batch tiles them cyclically): the two
    structured sequences for ``data == "synthetic"``, else one row per decode query of each sequence of the captured
    layer."""
    if data == "synthetic":
        return structured_sequences(make_cache, seqlen, device)
    return tiled_capture(capture, capture_queries(capture), seqlen, device)


def steps_histogram(walks: list[int]) -> dict[str, int]:
    """``{steps: walks}`` of a list of walk lengths, in increasing steps."""
    return {str(n): walks.count(n) for n in sorted(set(walks))}


def stop_agreement(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, art: ARTParams,
                   replay: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> dict:
    """The kernel's single-split walks on ``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]`` against ``replay(q, k, v)``
    (the simulator's ``[B, Hkv]`` blocks per walk): ``{"pairs", "equal", "off_by_one", "max_abs_diff",
    "differences": {diff: pairs}}`` (kernel minus simulator, the unequal pairs only); and the default plan's
    (``plan_num_splits``, ``plan_follow_step``): ``plan_equal``, the pairs whose output holds the blocks the
    simulator says (``return_result_steps``: the simulator's walk where it ends within the leader's range, else the
    whole walk), and ``plan_stopped`` / ``stopped``, the pairs whose output stopped before the walk's end under the
    plan / in the simulator."""
    _, steps = art_decode(q, k, v, art=art, num_splits=1, return_stats=True)
    expected = replay(q, k, v)
    if tuple(expected.shape) != tuple(steps.shape[:2]):
        raise ValueError(f"replay must return [B, Hkv] = {tuple(steps.shape[:2])}, got {tuple(expected.shape)}")
    diff = (steps[..., 0].long().cpu() - expected.long().cpu()).flatten()
    unequal = diff[diff != 0].tolist()
    plan = plan_decode(q, k, v, art=art)
    blocks = plan.walk_blocks
    _, _, taken = art_decode(q, k, v, art=art, return_stats=True, return_result_steps=True)
    walks = expected.long().cpu()
    kept = plan.result_steps(walks)
    return {"pairs": diff.numel(), "equal": int((diff == 0).sum()), "off_by_one": int((diff.abs() == 1).sum()),
            "max_abs_diff": int(diff.abs().max()),
            "differences": {str(d): unequal.count(d) for d in sorted(set(unequal))},
            "plan_num_splits": plan.num_splits, "plan_follow_step": plan.follow_step,
            "plan_equal": int((taken.long().cpu() == kept).sum()), "plan_stopped": int((taken < blocks).sum()),
            "stopped": int((walks < blocks).sum())}


def _peer_fns(q, k, v, flex: bool) -> dict:
    """Dense decode peers as zero-argument callables (or the error that prevented building one)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4 = q[:, :, None, :]

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        return call

    peers = {"cudnn_sdpa": sdpa(SDPBackend.CUDNN_ATTENTION), "flash_sdpa": sdpa(SDPBackend.FLASH_ATTENTION)}
    if flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention, dynamic=False)
            peers["flex_attention"] = lambda: compiled(q4, k, v, enable_gqa=True)
        except Exception as exc:  # recorded in the results, never fatal
            peers["flex_attention"] = f"{type(exc).__name__}: {exc}"
    return peers


def loaded_fraction(steps: torch.Tensor, seqlen: int, splits: slice = slice(None)) -> float:
    """KV blocks loaded by the programs of ``splits`` (``art_decode``'s ``steps [B, Hkv, splits]``: a
    program loads exactly the blocks of the steps it visited) over all blocks of full-length sequences
    (block size ``ART_BLOCK_SIZE``)."""
    return float(steps[..., splits].sum()) / (steps.shape[0] * steps.shape[1] * math.ceil(seqlen / ART_BLOCK_SIZE))


def lone_walk_latency(make_qkv: Callable[[int], tuple], rep_ms: int, rounds: int = ROUNDS) -> dict:
    """The time per block of a monitored walk alone on its multiprocessor: ART with never-terminating
    thresholds and one split on ``make_qkv(seqlen)`` (``(q, k, v)`` with ``B = 1``: a few programs on an
    idle GPU) at the two ``LONE_WALK_LENGTHS``, the median CUDA-graph time of ``rounds`` rounds each.
    Returns ``{"lengths", "ms", "step_us", "fixed_us"}``: the slope per block and the intercept (launch,
    first loads, epilogue)."""
    times = []
    for seqlen in LONE_WALK_LENGTHS:
        q, k, v = make_qkv(seqlen)
        if q.shape[0] != 1:
            raise ValueError(f"the lone walk is timed at batch 1, got q of shape {tuple(q.shape)}")
        times.append(statistics.median(graph_ms(lambda: art_decode(q, k, v, art=NEVER, num_splits=1), rep_ms)
                                       for _ in range(rounds)))
        del q, k, v
    steps = [math.ceil(seqlen / ART_BLOCK_SIZE) for seqlen in LONE_WALK_LENGTHS]
    step_ms = (times[1] - times[0]) / (steps[1] - steps[0])
    return {"lengths": list(LONE_WALK_LENGTHS), "ms": times, "step_us": step_ms * 1e3,
            "fixed_us": (times[0] - steps[0] * step_ms) * 1e3}


def walk_replay_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       walk_blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs on which a dense call (block size ``ART_BLOCK_SIZE``, one split) reads exactly as many blocks per
    program as the ART walks ``walk_blocks [B, Hkv]`` did, in the same launch order: ``(q', k', v', lengths)``
    with ``q' [B * Hkv, Hq / Hkv, D]``, ``k', v' [B * Hkv, 1, S, D]`` (views of ``q [B, Hq, D]`` and
    contiguous ``k, v [B, Hkv, S, D]``) and ``lengths [B * Hkv]`` int32, each walk's blocks in tokens.  The
    dense walk reads each sequence's first blocks, a sink-recency walk block 0 and the last ones: as many
    bytes, other addresses."""
    batch, q_heads, head_dim = q.shape
    kv_heads, seqlen = k.shape[1], k.shape[2]
    if tuple(walk_blocks.shape) != (batch, kv_heads):
        raise ValueError(f"walk_blocks must be [B, Hkv] = [{batch}, {kv_heads}], got {tuple(walk_blocks.shape)}")
    lengths = (walk_blocks.flatten().to(torch.int32) * ART_BLOCK_SIZE).clamp(max=seqlen).contiguous()
    per_head = q.reshape(batch * kv_heads, q_heads // kv_heads, head_dim)
    return (per_head, *(x.reshape(batch * kv_heads, 1, seqlen, head_dim) for x in (k, v)), lengths)


def bench_shape(q, k, v, *, data: str, art: ARTParams, rep_ms: int, ceiling: float, flex: bool = False,
                rounds: int = ROUNDS, lone_walk: dict | None = None) -> list[dict]:
    """Time every implementation on one ``(q, k, v)`` (graph times in ``rounds`` interleaved rounds); one
    row per implementation.  ``lone_walk``: :func:`lone_walk_latency` of this data kind, for the ART
    row's latency floor."""
    batch, q_heads, head_dim = q.shape
    kv_heads, seqlen = k.shape[1], k.shape[2]
    nbytes = kv_bytes(k)
    base = dict(data=data, batch=batch, seqlen=seqlen, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    dense = plan_decode(q, k, v)
    blocks = math.ceil(seqlen / ART_BLOCK_SIZE)
    splits = choose_num_splits(batch, kv_heads, blocks, q.device, block_size=ART_BLOCK_SIZE)
    _, single_steps = art_decode(q, k, v, art=art, num_splits=1, return_stats=True)
    longest = int(single_steps[..., 0].max())
    calls = dict(_peer_fns(q, k, v, flex))
    calls["art_dense"] = lambda: art_decode(q, k, v)
    calls["art_dense_bs64"] = lambda: art_decode(q, k, v, block_size=ART_BLOCK_SIZE, num_splits=splits)
    calls["art_never"] = lambda: art_decode(q, k, v, art=NEVER, num_splits=splits)
    calls["art_never_default"] = lambda: art_decode(q, k, v, art=NEVER)
    calls["art"] = lambda: art_decode(q, k, v, art=art)
    pair_walks = PairWalks.from_walks(single_steps[..., 0])
    calls["art_calibrated"] = lambda: art_decode(q, k, v, art=art, pair_walks=pair_walks)
    q_walks, k_walks, v_walks, walk_lengths = walk_replay_inputs(q, k, v, single_steps[..., 0])
    calls["art_walks_dense"] = lambda: art_decode(q_walks, k_walks, v_walks, cache_seqlens=walk_lengths,
                                                  block_size=ART_BLOCK_SIZE, num_splits=1)
    calls["art_wave"] = lambda: art_decode(q, k, v, art=art, wave_steps=WAVE_STEPS)
    never_default = plan_decode(q, k, v, art=NEVER)
    extras = {"art_dense": dict(num_splits=dense.num_splits, block_size=dense.block_size),
              "art_dense_bs64": dict(num_splits=splits, block_size=ART_BLOCK_SIZE),
              "art_never": dict(num_splits=splits, block_size=ART_BLOCK_SIZE,
                                monitor_runs=plan_decode(q, k, v, art=NEVER, num_splits=splits).art is not None),
              "art_never_default": dict(num_splits=never_default.num_splits, follow_step=never_default.follow_step),
              "art_walks_dense": dict(num_splits=1, block_size=ART_BLOCK_SIZE,
                                      loaded_fraction=loaded_fraction(single_steps, seqlen))}
    walks = {}
    single_stopped = stopped_share(single_steps[..., 0], blocks)
    for impl, hint in (("art", None), ("art_calibrated", pair_walks)):
        plan = plan_decode(q, k, v, art=art, pair_walks=hint)
        _, steps, taken = art_decode(q, k, v, art=art, pair_walks=hint, return_stats=True, return_result_steps=True)
        walks[impl] = steps[..., 0].flatten().tolist() if steps.shape[-1] == 1 and not plan.wave_steps else None
        extras[impl] = dict(num_splits=plan.num_splits, follow_step=plan.follow_step, wave_steps=plan.wave_steps,
                            loaded_fraction=loaded_fraction(steps, seqlen), monitor_runs=plan.art is not None,
                            leader_steps_mean=float(steps[..., 0].float().mean()),
                            leader_steps_max=int(steps[..., 0].max()),
                            stopped_pairs=stopped_share(taken, blocks), single_stopped_pairs=single_stopped)
        if plan.per_pair_splits:
            extras[impl].update(pair_split_threshold=plan.pair_threshold,
                                pair_split_walks=sum(w > plan.pair_threshold for w in hint.sorted_walks))
    extras["art_calibrated"]["longest_stop_steps"] = longest
    wave_plan = plan_decode(q, k, v, art=art, wave_steps=WAVE_STEPS)
    _, wave_steps, wave_taken = art_decode(q, k, v, art=art, wave_steps=WAVE_STEPS, return_stats=True,
                                           return_result_steps=True)
    extras["art_wave"] = dict(wave_steps=wave_plan.wave_steps, num_splits=wave_plan.num_splits,
                              follow_step=wave_plan.follow_step, loaded_fraction=loaded_fraction(wave_steps, seqlen),
                              wave_finished_pairs=float((single_steps[..., 0] <= wave_plan.wave_steps).double().mean()),
                              stopped_pairs=stopped_share(wave_taken, blocks), single_stopped_pairs=single_stopped)
    results = time_interleaved(calls, rep_ms, rounds, q.device, memset_flush=MEMSET_FLUSH_IMPLS,
                               settle=MONITOR_OVERHEAD_PAIR, settle_spread=MONITOR_OVERHEAD_TARGET,
                               settle_rounds=SETTLE_ROUNDS)
    rows = []
    for impl, result in results.items():
        row = {**base, "impl": impl, **result, **extras.get(impl, {})}
        if "ms" in row:
            row.update(throughput(nbytes, row["ms"], ceiling))
        rows.append(row)
    by_impl = {r["impl"]: r for r in rows}
    reference = next((calls[p]().squeeze(2).float() for p in ("cudnn_sdpa", "flash_sdpa", "flex_attention")
                      if "ms" in by_impl.get(p, {})), None)
    dense = by_impl["art_dense"]
    if reference is not None and "ms" in dense:
        dense["rel_error_vs_peer"] = float((art_decode(q, k, v).float() - reference).norm() / reference.norm())
    wave = by_impl["art_wave"]
    if "ms" in wave and "ms" in dense:
        wave["time_bound_ms"] = time_bound_ms(wave["loaded_fraction"], dense["ms"])
        wave["meets_time_bound"] = wave["ms"] <= wave["time_bound_ms"]
        if "ms" in by_impl["art"]:
            wave["over_art"] = wave["ms"] / by_impl["art"]["ms"]
    for row in (by_impl["art"], by_impl["art_calibrated"]):
        if "ms" in row and "ms" in dense:
            row["time_bound_ms"] = time_bound_ms(row["loaded_fraction"], dense["ms"])
            row["meets_time_bound"] = row["ms"] <= row["time_bound_ms"]
            if "ms_memset_flush" in row and "ms_memset_flush" in dense:
                row["time_bound_memset_flush_ms"] = time_bound_ms(row["loaded_fraction"], dense["ms_memset_flush"])
                row["meets_time_bound_memset_flush"] = row["ms_memset_flush"] <= row["time_bound_memset_flush_ms"]
            if lone_walk is not None and not row["wave_steps"]:   # a wave's walks are not lone walks
                row["latency_floor_ms"] = (lone_walk["fixed_us"] + row["leader_steps_max"] * lone_walk["step_us"]) / 1e3
                row["time_bound_below_latency_floor"] = row["time_bound_ms"] < row["latency_floor_ms"]
                if walks[row["impl"]] is not None:
                    row["walk_steps_histogram"] = steps_histogram(walks[row["impl"]])
                    row["model_ms"] = walk_model_ms(walks[row["impl"]], lone_walk, head_dim, k.element_size(),
                                                    nbytes / dense["ms"] / 1e9, num_sms(q.device))
            if walks[row["impl"]] is not None and "ms" in by_impl["art_walks_dense"]:
                row["walks_dense_ms"] = by_impl["art_walks_dense"]["ms"]
                row["time_bound_below_walks_dense"] = row["time_bound_ms"] < row["walks_dense_ms"]
    _speedups(rows)
    return rows


def bench_dense_batches(batches, lengths, *, rep_ms: int, ceiling: float, device: torch.device,
                        rounds: int = ROUNDS, rows: list[dict] | None = None,
                        progress: Callable[[], None] | None = None) -> list[dict]:
    """The dense plan against cuDNN and flash SDPA at batch sizes off the main grid, where the programs fill the
    multiprocessors unevenly (and at some of the grid's, beside them): ``B`` in ``batches`` x ``S`` in ``lengths``,
    ``Hq / Hkv = 32 / 8``, ``D = 128``, bf16
    random caches (a dense walk's time does not depend on the values).  Rows ``cudnn_sdpa``, ``flash_sdpa``,
    ``art_dense`` and ``art_dense_bs64_one_wave`` (64-token blocks at :func:`one_wave_small_block_splits` at every
    shape; the default's own walk where :func:`kernels.split_plan.one_wave_dense_splits` takes it) per shape (graph
    times in ``rounds`` interleaved rounds), each of ours with its block size and split count.  ``rows``: a list to
    extend (default a new one), whose shapes are already timed and are skipped; ``progress``: called after each
    shape (e.g. to save the rows so far)."""
    rows = [] if rows is None else rows
    timed = {(r["batch"], r["seqlen"]) for r in rows}
    for seqlen in lengths:
        for batch in tqdm([b for b in batches if (b, seqlen) not in timed], desc=f"dense batches, S={seqlen}"):
            rows += _dense_batch_rows(batch, seqlen, rep_ms, ceiling, device, rounds)
            torch.cuda.empty_cache()
            if progress is not None:
                progress()
    return rows


def _dense_batch_rows(batch: int, seqlen: int, rep_ms: int, ceiling: float, device: torch.device,
                      rounds: int) -> list[dict]:
    """:func:`bench_dense_batches`' rows of one shape."""
    generator = torch.Generator(device=device).manual_seed(batch)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(batch, KV_HEADS, seqlen, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=generator)
            for _ in range(2))
    plan = plan_decode(q, k, v)
    one_wave = one_wave_small_block_splits(batch * KV_HEADS, -(-seqlen // ART_BLOCK_SIZE), num_sms(device))
    plans = {"art_dense": (plan.block_size, plan.num_splits), "art_dense_bs64_one_wave": (ART_BLOCK_SIZE, one_wave)}
    calls = {impl: fn for impl, fn in _peer_fns(q, k, v, flex=False).items() if impl in ("cudnn_sdpa", "flash_sdpa")}
    calls["art_dense"] = lambda: art_decode(q, k, v)
    calls["art_dense_bs64_one_wave"] = lambda: art_decode(q, k, v, block_size=ART_BLOCK_SIZE, num_splits=one_wave)
    nbytes, rows = kv_bytes(k), []
    for impl, result in time_interleaved(calls, rep_ms, rounds, device).items():
        row = dict(batch=batch, seqlen=seqlen, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, impl=impl,
                   **result)
        if impl in plans:
            row.update(zip(("block_size", "num_splits"), plans[impl]))
        if "ms" in row:
            row.update(throughput(nbytes, row["ms"], ceiling))
        rows.append(row)
    _speedups(rows)
    return rows


def dense_batches_summary(rows: list[dict]) -> dict:
    """The rows of :func:`bench_dense_batches`: the dense default's over the best peer's throughput (min and median
    over every shape and over ``B >= 16``, the shapes of ``B >= 16`` below ``DENSE_TARGET``, and the worst shape),
    and the one-wave candidate's time over the default's (min, median, max, the shapes where it is the faster) and
    the shapes of ``B >= 16`` where it is below ``DENSE_TARGET``."""
    dense = [r for r in rows if r["impl"] == "art_dense" and "speedup_vs_best_peer" in r]
    ratios = [r["speedup_vs_best_peer"] for r in dense]
    large = [r["speedup_vs_best_peer"] for r in dense if r["batch"] >= 16]
    worst = min(dense, key=lambda r: r["speedup_vs_best_peer"], default=None)
    default_ms = {(r["batch"], r["seqlen"]): r["ms"] for r in rows if r["impl"] == "art_dense" and "ms" in r}
    candidate = [r for r in rows if r["impl"] == "art_dense_bs64_one_wave" and "ms" in r
                 and (r["batch"], r["seqlen"]) in default_ms]
    over_default = [r["ms"] / default_ms[r["batch"], r["seqlen"]] for r in candidate]
    return {"dense_batches_shapes": len(dense),
            "dense_batches_over_best_peer_min": min(ratios, default=None),
            "dense_batches_over_best_peer_median": upper_median(ratios),
            "dense_batches_b16plus_min": min(large, default=None),
            "dense_batches_b16plus_below_target": sum(x < DENSE_TARGET for x in large),
            "dense_batches_worst_shape": (dict(batch=worst["batch"], seqlen=worst["seqlen"],
                                               num_splits=worst["num_splits"]) if worst else None),
            "dense_batches_one_wave_over_default_min": min(over_default, default=None),
            "dense_batches_one_wave_over_default_median": upper_median(over_default),
            "dense_batches_one_wave_over_default_max": max(over_default, default=None),
            "dense_batches_one_wave_faster": sum(x < 1 for x in over_default),
            "dense_batches_one_wave_b16plus_below_target": sum(
                r["speedup_vs_best_peer"] < DENSE_TARGET for r in candidate
                if r["batch"] >= 16 and "speedup_vs_best_peer" in r)}


def target_rows(summary: dict) -> list[dict]:
    """The issue's four targets as ``{"target", "measured", "met"}`` rows of a decode run's ``summary``
    (:func:`summarise`; ``met`` is ``None`` where the run did not measure the target, e.g. a quick run without
    ``B >= 16``)."""
    dense = summary.get("dense_over_best_peer_throughput_b16plus_min")
    b1 = summary.get("b1_s32k")
    overhead = summary.get("monitor_overhead_max")
    bound, rows = summary.get("art_rows_meeting_time_bound"), summary.get("art_rows")
    told, told_rows = summary.get("art_calibrated_rows_meeting_time_bound"), summary.get("art_calibrated_rows")
    return [
        {"target": f"dense >= {DENSE_TARGET}x the best peer, B >= 16",
         "measured": "not measured" if dense is None else
         f"min {dense:.3f}x (median {summary['dense_over_best_peer_throughput_b16plus_median']:.3f}x)",
         "met": None if dense is None else dense >= DENSE_TARGET},
        {"target": "dense no slower than the best peer, B = 1 x 32k",
         "measured": "not measured" if b1 is None else f"{b1['art_dense_ms']:.4f} ms against {b1['best_peer_ms']:.4f}",
         "met": None if b1 is None else b1["art_dense_ms"] <= b1["best_peer_ms"]},
        {"target": f"never-stopping monitor overhead <= {MONITOR_OVERHEAD_TARGET:.0%}",
         "measured": "not measured" if overhead is None else
         f"max {overhead:+.2%} over {summary.get('monitor_overhead_rows', '?')} rows" + (
             f" (fastest rounds: max {summary['monitor_overhead_fastest_rounds_max']:+.2%})"
             if summary.get("monitor_overhead_fastest_rounds_max") is not None else "") + (
             f"; {summary['monitor_overhead_settled_rows']} timed to {SETTLE_ROUNDS} rounds"
             if summary.get("monitor_overhead_settled_rows") else ""),
         "met": None if overhead is None else overhead <= MONITOR_OVERHEAD_TARGET},
        {"target": "ART <= 1.15 x loaded fraction x dense + 10 us",
         "measured": "not measured" if not rows else
         f"{bound} of {rows} rows" + (f" ({told} of {told_rows} told each walk)" if told_rows else ""),
         "met": None if not rows else bound == rows},
    ]


def stopped_share(result_steps: torch.Tensor, blocks: int) -> float:
    """The share of ``(b, kv_head)`` pairs whose output stopped before the last of the walk's ``blocks``:
    ``result_steps [B, Hkv]`` (``art_decode``'s ``return_result_steps``, or a single walk's steps)."""
    return float((result_steps < blocks).double().mean())


def upper_median(values) -> float | None:
    """The median of ``values``, the upper of the two middle ones for an even count; ``None`` when there are none."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def time_bound_ms(loaded_fraction: float, dense_ms: float) -> float:
    """The issue's bound on an ART call's time: ``1.15 * loaded_fraction * dense_ms + 10 us``."""
    return 1.15 * loaded_fraction * dense_ms + 0.010


def walk_model_ms(walk_steps: list[int], lone_walk: dict, head_dim: int, element_size: int,
                  bandwidth_tb_per_s: float, sms: int) -> float:
    """:func:`kernels.walk_model.shared_bandwidth_ms` of single-split walks (``walk_steps``, one per
    ``(b, kv_head)`` in launch order) of 64-token K/V blocks at the pace and fixed time of ``lone_walk``
    (:func:`lone_walk_latency`), ``SMALL_BLOCK_PROGRAMS_PER_SM`` programs resident on each of ``sms``
    multiprocessors."""
    return shared_bandwidth_ms(walk_steps, step_us=lone_walk["step_us"], fixed_us=lone_walk["fixed_us"],
                               block_bytes=2 * ART_BLOCK_SIZE * head_dim * element_size,
                               bandwidth_tb_per_s=bandwidth_tb_per_s, slots=SMALL_BLOCK_PROGRAMS_PER_SM * sms)


def time_interleaved(calls: dict, rep_ms: int, rounds: int, device: torch.device,
                     memset_flush: tuple[str, ...] = (), settle: tuple[str, ...] = (), settle_spread: float = 0.0,
                     settle_rounds: int = 0) -> dict[str, dict]:
    """``{impl: {"ms", "ms_rounds", "eager_ms", "timing"} or {"error"}}`` for zero-argument callables
    (a string value is an error recorded in place of a callable).  Each callable runs and is timed
    eagerly once; its CUDA-graph time is then taken once per round, every callable in each round, after an L2
    emptied by a read (:mod:`kernels.l2_flush`).  The callables named in ``memset_flush`` are also timed, in each
    round right after that, after do_bench's own memset (``ms_memset_flush_rounds``, median ``ms_memset_flush``).
    Where NVML can be read, ``sm_mhz_rounds`` and ``power_w_rounds`` hold the SM clock and power draw read as each
    round's timing ends (:func:`kernels.device_info.clock_and_power`), to tell a slow round on a throttled
    card from a slow kernel.  The callables named in ``settle`` (a ratio's two calls) are timed on, interleaved in
    their order, to ``settle_rounds`` rounds in all where the first ``rounds`` of any of them spread by more than
    ``settle_spread`` (:func:`round_spread`); their ``ms`` is the median over every round."""
    results, graphed = {}, []
    for impl, fn in calls.items():
        if isinstance(fn, str):
            results[impl] = {"error": fn}
            continue
        try:
            fn()
            torch.cuda.synchronize()
            results[impl] = {"eager_ms": median_ms(fn, rep_ms)}
        except Exception as exc:  # a peer without a kernel for this shape is a result, not a crash
            results[impl] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            torch.cuda.synchronize()
            continue
        try:
            results[impl].update(ms_rounds=[], timing="cuda_graph")
            _graph_round(results[impl], fn, rep_ms, device, impl in memset_flush)
            graphed.append(impl)
        except Exception as exc:  # not capturable: keep the eager time and say why
            results[impl] = {"eager_ms": results[impl]["eager_ms"], "ms": results[impl]["eager_ms"],
                             "timing": f"eager ({type(exc).__name__}: {str(exc)[:120]})"}
            torch.cuda.synchronize()
    for _ in range(rounds - 1):
        for impl in graphed:
            _graph_round(results[impl], calls[impl], rep_ms, device, impl in memset_flush)
    settling = [impl for impl in settle if impl in graphed]
    if settling and max(round_spread(results[impl]) for impl in settling) > settle_spread:
        for _ in range(settle_rounds - rounds):
            for impl in settling:
                _graph_round(results[impl], calls[impl], rep_ms, device, impl in memset_flush)
    for impl in graphed:
        results[impl]["ms"] = statistics.median(results[impl]["ms_rounds"])
        if impl in memset_flush:
            results[impl]["ms_memset_flush"] = statistics.median(results[impl]["ms_memset_flush_rounds"])
    return results


def _graph_round(result: dict, fn: Callable[[], object], rep_ms: int, device: torch.device, memset: bool) -> None:
    """One round of ``fn``'s CUDA-graph timing into ``result``: after a read of the L2 (``ms_rounds``), then, with
    ``memset``, after do_bench's memset (``ms_memset_flush_rounds``); then the clock and power."""
    result["ms_rounds"].append(graph_ms(fn, rep_ms))
    if memset:
        result.setdefault("ms_memset_flush_rounds", []).append(graph_ms(fn, rep_ms, flush="memset"))
    _record_clock(result, device)


def _record_clock(result: dict, device: torch.device) -> None:
    """Append the device's SM clock and power draw now to ``result``'s ``sm_mhz_rounds`` and ``power_w_rounds``
    (nothing where NVML cannot be read)."""
    state = clock_and_power(device)
    if state is not None:
        result.setdefault("sm_mhz_rounds", []).append(state["sm_mhz"])
        result.setdefault("power_w_rounds", []).append(state["power_w"])


def _speedups(rows: list[dict]) -> None:
    """Add ``speedup_vs_best_peer`` (best peer time / this time) to the rows of one shape."""
    peer_ms = [r["ms"] for r in rows if r["impl"] in ("cudnn_sdpa", "flash_sdpa", "flex_attention") and "ms" in r]
    if not peer_ms:
        return
    best = min(peer_ms)
    for r in rows:
        if "ms" in r:
            r["best_peer_ms"] = best
            r["speedup_vs_best_peer"] = best / r["ms"]


def split_study(q, k, v, *, art: ARTParams, rep_ms: int) -> list[dict]:
    """ART with one split vs the leader scheme over one wave of programs (loaded fractions of all
    programs and of the leader), and dense over a sweep of split counts and block sizes
    (CUDA-graph times)."""
    batch, kv_heads, seqlen = q.shape[0], k.shape[1], k.shape[2]
    base = dict(batch=batch, seqlen=seqlen)
    rows = []
    leader = leader_splits(batch, kv_heads, q.device)
    for label, splits in (("art_single_split", 1), ("art_leader_one_wave", leader)):
        _, steps = art_decode(q, k, v, art=art, num_splits=splits, return_stats=True)
        rows.append({**base, "impl": label, "num_splits": steps.shape[-1],
                     "loaded_fraction": loaded_fraction(steps, seqlen),
                     "leader_loaded_fraction": loaded_fraction(steps, seqlen, slice(0, 1)),
                     "ms": graph_ms(lambda splits=splits: art_decode(q, k, v, art=art, num_splits=splits), rep_ms)})
    for block_size in (64, 128):
        for splits in SPLIT_SWEEP:
            rows.append({**base, "impl": "art_dense", "block_size": block_size, "num_splits": splits,
                         "ms": graph_ms(lambda bs=block_size, ns=splits: art_decode(q, k, v, block_size=bs,
                                                                                    num_splits=ns), rep_ms)})
    return rows


def bench_paged(q, k, v, *, art: ARTParams, rep_ms: int, ceiling: float, rounds: int = ROUNDS) -> list[dict]:
    """Dense (``art=None``) and ART calls at the launcher's defaults on the contiguous cache ``k, v [B, Hkv, S, D]``
    and on shuffled page pools of it (``kernels.paged_cache.to_paged``, each of ``PAGE_SIZES``), timed in
    interleaved rounds of CUDA-graph medians.  One row per layout and call: ``ms``, TB/s (the cache's bytes read
    once), the fraction of the copy ceiling and ``over_contiguous``, its time over the same call's on the
    contiguous cache; ART rows add the loaded fraction and ``equals_contiguous``: output and the leaders' steps
    bit-identical to the contiguous call's (the same walk over the same values; on pages read one tile each, whose
    ``sum p`` adds in another order, an output may differ in its last bit).  The followers' steps are left out: how
    many blocks a follower loads before it sees its leader's flag depends on timing, not on the layout."""
    batch, q_heads, head_dim = q.shape
    kv_heads, seqlen = k.shape[1], k.shape[2]
    nbytes = kv_bytes(k)
    base = dict(data="synthetic", batch=batch, seqlen=seqlen, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    layouts = {None: (k, v, None), **{size: to_paged(k, v, size, seed=size) for size in PAGE_SIZES}}
    calls, walks = {}, {}
    for size, (k_cache, v_cache, table) in layouts.items():
        for impl, rule in (("art_dense", None), ("art", art)):
            calls[(impl, size)] = lambda kc=k_cache, vc=v_cache, t=table, r=rule: art_decode(q, kc, vc, block_table=t,
                                                                                             art=r)
        walks[size] = art_decode(q, k_cache, v_cache, block_table=table, art=art, return_stats=True)
    results = time_interleaved(calls, rep_ms, rounds, q.device)
    rows = []
    for (impl, size), result in results.items():
        row = {**base, "impl": impl, "page_size": size, **result}
        if "ms" in row:
            row.update(throughput(nbytes, row["ms"], ceiling))
            contiguous = results[(impl, None)]
            if "ms" in contiguous:
                row["over_contiguous"] = row["ms"] / contiguous["ms"]
        if impl == "art":
            out, steps = walks[size]
            row.update(loaded_fraction=loaded_fraction(steps, seqlen), num_splits=steps.shape[-1],
                       equals_contiguous=bool(torch.equal(out, walks[None][0])
                                              and torch.equal(steps[..., 0], walks[None][1][..., 0])))
        rows.append(row)
    return rows


def paged_summary(rows: list[dict]) -> dict:
    """The paged rows (:func:`bench_paged`) in a few numbers: per call, the largest and smallest time over the
    contiguous layout's, and whether every ART walk equalled the contiguous one."""
    summary = {}
    for impl in ("art_dense", "art"):
        ratios = [r["over_contiguous"] for r in rows if r["impl"] == impl and r["page_size"] and "over_contiguous" in r]
        if ratios:
            summary[f"paged_{impl}_over_contiguous_max"] = max(ratios)
            summary[f"paged_{impl}_over_contiguous_min"] = min(ratios)
    walks = [r["equals_contiguous"] for r in rows if r["impl"] == "art" and r["page_size"]]
    if walks:
        summary["paged_art_walks_equal_contiguous"] = f"{sum(walks)}/{len(walks)}"
    return summary


def round_spread(row: dict) -> float:
    """How far a row's rounds spread: ``max / min - 1`` of its ``ms_rounds`` (0 with fewer than two)."""
    rounds = row.get("ms_rounds") or []
    return max(rounds) / min(rounds) - 1 if len(rounds) > 1 else 0.0


def fastest_round_ms(row: dict) -> float:
    """A row's fastest round (its ``ms`` without ``ms_rounds``): a power-capped round is only ever slower."""
    return min(row.get("ms_rounds") or [row["ms"]])


def summarise(rows: list[dict], ceiling: float, lone_walk: dict | None = None,
              agreement: list[dict] | None = None) -> dict:
    """The issue's targets, checked on the rows of the main grid; with ``lone_walk`` (``{data:``
    :func:`lone_walk_latency` ``}``) also each data kind's time per block of a lone walk, and with
    ``agreement`` (:func:`stop_agreement` entries) the walks equal to the simulator's over all of them.

    The monitor's overhead is also summarised over the *resolved* rows alone: those where neither the
    never-stopping nor the block-64 dense time spread over its rounds by more than the target
    (:func:`round_spread`), since elsewhere the measurement cannot tell 1 % from the card's drift; and over the
    fastest round of each (``monitor_overhead_fastest_rounds_*``): a power-capped card only ever slows a round, and
    which of the two calls draws the cap is chance (``benchmarks/NOTES-art-decode.md``, V38, V43).  The rows
    timed on past ``ROUNDS`` (:func:`time_interleaved`'s ``settle``) are counted in ``monitor_overhead_settled_*``."""
    by_shape: dict = {}
    timed: dict = {}
    monitor_skipped = set()
    for r in rows:
        if "ms" in r:
            by_shape.setdefault((r["data"], r["batch"], r["seqlen"]), {})[r["impl"]] = r["ms"]
            timed.setdefault((r["data"], r["batch"], r["seqlen"]), {})[r["impl"]] = r
        if r["impl"] == "art_never" and not r.get("monitor_runs", True):
            monitor_skipped.add((r["data"], r["batch"], r["seqlen"]))
    dense_ratio, overhead, resolved, overhead_fastest, settled, b1 = [], [], [], [], [], None
    never_default = {}
    for (data, batch, seqlen), impls in by_shape.items():
        if "art_never_default" in impls and "art_dense" in impls:
            never_default[(data, batch, seqlen)] = impls["art_never_default"] / impls["art_dense"]
        peers = [impls[p] for p in ("cudnn_sdpa", "flash_sdpa", "flex_attention") if p in impls]
        if data == "synthetic" and batch >= 16 and peers and "art_dense" in impls:
            dense_ratio.append(min(peers) / impls["art_dense"])
        if "art_never" in impls and "art_dense_bs64" in impls and (data, batch, seqlen) not in monitor_skipped:
            overhead.append(impls["art_never"] / impls["art_dense_bs64"] - 1)
            never, reference = timed[(data, batch, seqlen)]["art_never"], timed[(data, batch, seqlen)]["art_dense_bs64"]
            overhead_fastest.append(fastest_round_ms(never) / fastest_round_ms(reference) - 1)
            if max(round_spread(never), round_spread(reference)) <= MONITOR_OVERHEAD_TARGET:
                resolved.append(overhead[-1])
            if len(never.get("ms_rounds", ())) > ROUNDS:
                settled.append(overhead[-1])
        if data == "synthetic" and batch == 1 and seqlen == 32768 and peers and "art_dense" in impls:
            b1 = {"art_dense_ms": impls["art_dense"], "best_peer_ms": min(peers)}
    art_rows = [r for r in rows if r["impl"] == "art" and "meets_time_bound" in r]
    calibrated_rows = [r for r in rows if r["impl"] == "art_calibrated" and "meets_time_bound" in r]
    wave_rows = [r for r in rows if r["impl"] == "art_wave" and "over_art" in r]
    modelled = [r["ms"] / r["model_ms"] for r in art_rows if "model_ms" in r]
    stops = [(r["stopped_pairs"], r["single_stopped_pairs"]) for r in art_rows if "stopped_pairs" in r]
    replayed = [r["ms"] / r["walks_dense_ms"] for r in art_rows if "walks_dense_ms" in r]
    return {
        "copy_ceiling_tb_per_s": ceiling,
        "dense_over_best_peer_throughput_b16plus_min": min(dense_ratio, default=None),
        "dense_over_best_peer_throughput_b16plus_median": upper_median(dense_ratio),
        "dense_target": DENSE_TARGET,
        "b1_s32k": b1,
        "monitor_overhead_max": max(overhead, default=None),
        "monitor_overhead_median": upper_median(overhead),
        "monitor_overhead_target": MONITOR_OVERHEAD_TARGET,
        "monitor_overhead_rows": len(overhead),
        "monitor_overhead_rows_over_target": sum(o > MONITOR_OVERHEAD_TARGET for o in overhead),
        "monitor_overhead_resolved_rows": len(resolved),
        "monitor_overhead_max_resolved": max(resolved, default=None),
        "monitor_overhead_settled_rows": len(settled),
        "monitor_overhead_settled_max": max(settled, default=None),
        "monitor_overhead_fastest_rounds_max": max(overhead_fastest, default=None),
        "monitor_overhead_fastest_rounds_over_target": sum(o > MONITOR_OVERHEAD_TARGET for o in overhead_fastest),
        "monitor_skipped_rows": len(monitor_skipped),
        "never_default_over_dense_max": max(never_default.values(), default=None),
        "never_default_over_dense_median": upper_median(never_default.values()),
        "never_default_worst_shape": (dict(zip(("data", "batch", "seqlen"), max(never_default, key=never_default.get)))
                                      if never_default else None),
        "art_rows_meeting_time_bound": sum(r["meets_time_bound"] for r in art_rows),
        "art_rows_with_deferred_followers": sum(r.get("follow_step", 0) > 0 for r in art_rows),
        "art_rows_meeting_time_bound_with_deferred_followers": sum(
            r["meets_time_bound"] and r.get("follow_step", 0) > 0 for r in art_rows),
        "art_rows_missing_time_bound_below_latency_floor": sum(
            not r["meets_time_bound"] and r.get("time_bound_below_latency_floor", False) for r in art_rows),
        "art_rows": len(art_rows),
        "art_calibrated_rows_meeting_time_bound": sum(r["meets_time_bound"] for r in calibrated_rows),
        "art_calibrated_rows": len(calibrated_rows),
        "art_calibrated_rows_with_pair_splits": sum("pair_split_threshold" in r for r in calibrated_rows),
        "art_calibrated_rows_meeting_time_bound_with_pair_splits": sum(
            r["meets_time_bound"] and "pair_split_threshold" in r for r in calibrated_rows),
        "art_calibrated_rows_with_wave": sum(r.get("wave_steps", 0) > 0 for r in calibrated_rows),
        "art_calibrated_rows_meeting_time_bound_with_wave": sum(
            r["meets_time_bound"] and r.get("wave_steps", 0) > 0 for r in calibrated_rows),
        "art_rows_meeting_time_bound_memset_flush": sum(r.get("meets_time_bound_memset_flush", False)
                                                        for r in art_rows),
        "art_calibrated_rows_meeting_time_bound_memset_flush": sum(
            r.get("meets_time_bound_memset_flush", False) for r in calibrated_rows),
        "art_wave_rows": len(wave_rows),
        "art_wave_rows_meeting_time_bound": sum(r["meets_time_bound"] for r in wave_rows),
        "art_wave_rows_faster_than_art": sum(r["over_art"] < 1 for r in wave_rows),
        "art_wave_over_art_min": min((r["over_art"] for r in wave_rows), default=None),
        "art_wave_over_art_max": max((r["over_art"] for r in wave_rows), default=None),
        "art_rows_with_stopped_pairs": len(stops),
        "art_rows_keeping_every_stop": sum(kept == single for kept, single in stops),
        "art_stopped_pairs_over_single_min": min((kept / single for kept, single in stops if single), default=None),
        "art_rows_modelled": len(modelled),
        "art_ms_over_model_min": min(modelled, default=None),
        "art_ms_over_model_max": max(modelled, default=None),
        "art_rows_with_walks_dense": len(replayed),
        "art_ms_over_walks_dense_min": min(replayed, default=None),
        "art_ms_over_walks_dense_max": max(replayed, default=None),
        "art_rows_missing_time_bound_below_walks_dense": sum(
            not r["meets_time_bound"] and r.get("time_bound_below_walks_dense", False) for r in art_rows),
        **{f"lone_walk_step_us_{data}": lone["step_us"] for data, lone in (lone_walk or {}).items()},
        **({"stop_steps_equal": sum(a["equal"] for a in agreement),
            "stop_steps_pairs": sum(a["pairs"] for a in agreement),
            "stop_steps_max_abs_diff": max(a["max_abs_diff"] for a in agreement),
            "plan_result_steps_equal": sum(a["plan_equal"] for a in agreement),
            "plan_stopped_pairs": sum(a["plan_stopped"] for a in agreement),
            "simulator_stopped_pairs": sum(a["stopped"] for a in agreement)} if agreement else {}),
    }


def checked_run_device(suite: str, art: ARTParams, capture: str | os.PathLike | None = None) -> torch.device:
    """The CUDA device a run of the benchmark ``suite`` times on, once its inputs pass the checks at the boundary: a
    CUDA device present, ``art`` an :class:`ARTParams`, and ``capture`` (where given) a captured layer
    (:func:`decode_query_shape`: a damaged or wrong file stops the run before anything is timed)."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"the {suite} benchmark needs a CUDA device")
    if not isinstance(art, ARTParams):
        raise TypeError(f"art must be an ARTParams, got {type(art).__name__}")
    if capture is not None:
        decode_query_shape(capture)
    return torch.device("cuda")


def run(out_dir: str | os.PathLike, quick: bool, *, art: ARTParams, make_cache: Callable,
        capture: str | os.PathLike | None = None, replay: Callable | None = None, resume: bool = False) -> dict:
    """Run the decode benchmark and write ``<out_dir>/<date>-art-decode.json``; returns the payload.

    ``quick``: B in {1, 32} x S in {8k, 32k} and no FlexAttention (a smoke run).
    ``art``: the thresholds of the terminating ART rows.  ``make_cache``: structured cache
    generator (see the module docstring).  ``capture``: a safetensors layer (``k``, ``v``,
    ``decode_q``) benchmarked tiled to each length.  ``replay``: the simulator's single-split walks
    (``replay(q, k, v) -> [B, Hkv]`` blocks, e.g. ``art_analysis.termination.replay_kernel_walks`` with the
    same rule): the kernel's walks on each length's distinct sequences are compared with it
    (:func:`stop_agreement`, ``stop_agreement`` in the payload and the summary).

    The file is rewritten after every shape, marked ``"complete": false`` until the end.  ``resume``: continue the
    newest result in ``out_dir`` where it is such an incomplete run of the same settings (``RESUME_FIELDS``: device,
    software, code, thresholds, capture, quick): its copy ceiling, lone walks, stop agreement and finished shapes
    are kept and only the shapes it lacks are timed (a run cut short, e.g. by a time limit, finishes in a second
    call); a complete run of the same settings is returned as it is.
    """
    device = checked_run_device("decode", art, capture)
    rep_ms = 50 if quick else 100
    batches, lengths = (QUICK_BATCHES, QUICK_LENGTHS) if quick else (BATCHES, LENGTHS)
    settings = {
        "suite": "decode",
        "device": torch.cuda.get_device_name(device),
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()},
        "source": source_revision(),
        "quick": quick,
        "art": dataclasses.asdict(art),
        "l2_flush": "read",
        "capture_file": input_file_record(capture) if capture is not None else None,
    }
    path = Path(out_dir) / f"{datetime.date.today().isoformat()}-art-decode.json"
    previous: dict = {}
    if resume:
        found, earlier = resumable_run(out_dir, settings)
        if earlier is not None and earlier.get("complete"):
            print(f"{found}: a complete run of these settings; nothing left to run")
            return earlier
        if earlier is not None:
            path, previous = found, earlier
            print(f"{found}: continuing its run ({len(earlier.get('rows') or [])} rows)")
        else:
            print(f"no run of these settings in {out_dir} to continue (a *-art-decode.json): timing every shape")
    ceiling = previous.get("copy_ceiling_tb_per_s") or copy_ceiling_tb_per_s(device)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    payload = {"suite": settings["suite"], "date": previous.get("date") or started, **settings,
               "copy_ceiling_tb_per_s": ceiling}
    cases = [("synthetic", b, s) for s in lengths for b in batches
             if 2 * b * KV_HEADS * s * HEAD_DIM * 2 <= MAX_KV_BYTES]
    if capture is not None:
        cases += [("smollm2_layer15_tiled", b, s) for s in lengths
                  for b in (QUICK_BATCHES if quick else CAPTURE_BATCHES)]
    payload["skipped"] = [dict(batch=b, seqlen=s, reason=f"KV cache over {MAX_KV_BYTES / 2 ** 30:.0f} GiB")
                          for s in lengths for b in batches if 2 * b * KV_HEADS * s * HEAD_DIM * 2 > MAX_KV_BYTES]
    lone_inputs = {"synthetic": lambda seqlen: tile_batch(structured_sequences(make_cache, seqlen, device), 1)}
    if capture is not None:
        lone_inputs["smollm2_layer15_tiled"] = lambda seqlen: tiled_capture(capture, 1, seqlen, device)
    payload["lone_walk"] = previous.get("lone_walk") or {
        data: lone_walk_latency(make_qkv, rep_ms) for data, make_qkv in tqdm(lone_inputs.items(), desc="lone walk")}
    if previous.get("stop_agreement"):
        payload["stop_agreement"] = previous["stop_agreement"]
    elif replay is not None:
        kinds = ("synthetic",) + (("smollm2_layer15_tiled",) if capture is not None else ())
        payload["stop_agreement"] = [
            {"data": data, "seqlen": seqlen,
             **stop_agreement(*distinct_inputs(data, seqlen, device, make_cache, capture), art, replay)}
            for data, seqlen in tqdm([(d, s) for d in kinds for s in lengths], desc="stop agreement")]
    sections = {name: list(previous.get(name) or []) for name in ("rows", "split_study", "dense_batches", "paged")}

    def save(complete: bool = False) -> None:
        write_json_atomic(path, {**payload, **sections, "complete": complete})

    rows, study, sequences = sections["rows"], sections["split_study"], {}
    timed = {(r["data"], r["batch"], r["seqlen"]) for r in rows}
    for data, batch, seqlen in tqdm([case for case in cases if case not in timed], desc="decode bench"):
        if data == "synthetic":
            if seqlen not in sequences:
                sequences = {seqlen: structured_sequences(make_cache, seqlen, device)}
            q, k, v = tile_batch(sequences[seqlen], batch)
        else:
            sequences = {}
            q, k, v = tiled_capture(capture, batch, seqlen, device)
        flex = data == "synthetic" and not quick and (batch, seqlen) in FLEX_CASES
        rows += bench_shape(q, k, v, data=data, art=art, rep_ms=rep_ms, ceiling=ceiling, flex=flex,
                            lone_walk=payload["lone_walk"][data])
        if data == "synthetic" and (batch, seqlen) in SPLIT_STUDY:
            study += [{"data": data, **r} for r in split_study(q, k, v, art=art, rep_ms=rep_ms)]
        del q, k, v
        torch.cuda.empty_cache()
        save()
    bench_dense_batches(QUICK_DENSE_BATCHES if quick else DENSE_BATCHES,
                        QUICK_LENGTHS[:1] if quick else DENSE_BATCH_LENGTHS, rep_ms=DENSE_BATCH_REP_MS,
                        ceiling=ceiling, device=device, rows=sections["dense_batches"], progress=save)
    paged = sections["paged"]
    timed = {(r["batch"], r["seqlen"]) for r in paged}
    for batch, seqlen in tqdm([case for case in (QUICK_PAGED_CASES if quick else PAGED_CASES) if case not in timed],
                              desc="paged layout"):
        q, k, v = tile_batch(structured_sequences(make_cache, seqlen, device), batch)
        paged += bench_paged(q, k, v, art=art, rep_ms=rep_ms, ceiling=ceiling)
        del q, k, v
        torch.cuda.empty_cache()
        save()
    payload.update(sections, complete=True,
                   summary={**summarise(rows, ceiling, payload["lone_walk"], payload.get("stop_agreement")),
                            **dense_batches_summary(sections["dense_batches"]), **paged_summary(paged)})
    write_json_atomic(path, payload)
    return payload


def resumable_run(out_dir: str | os.PathLike, settings: dict) -> tuple[Path | None, dict | None]:
    """The newest decode result in ``out_dir`` (``kernels.results_io.latest_result``) and its payload, where it is
    a run of ``settings`` (equal in every ``RESUME_FIELDS`` entry); ``(None, None)`` where there is none or the newest
    is a complete run of other settings.  An incomplete run of other settings is an error: continuing it would mix
    two settings' rows in one file, and starting afresh on the same date would overwrite its rows."""
    found = latest_result("art-decode", out_dir)
    if found is None:
        return None, None
    try:
        earlier = json.loads(found.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{found} is not valid JSON ({exc}): it cannot be continued; move it aside") from None
    wanted = json.loads(json.dumps({field: settings.get(field) for field in RESUME_FIELDS}))
    differ = [field for field in RESUME_FIELDS if earlier.get(field) != wanted[field]]
    if earlier.get("complete"):
        return (found, earlier) if not differ else (None, None)
    if differ:
        raise ValueError(f"{found} is an incomplete run with other settings ({', '.join(differ)} differ): this run "
                         "cannot continue it; move it aside to start afresh")
    return found, earlier
