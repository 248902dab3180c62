"""Whether ART's walks keep their lengths from one decode step to the next.

The decode kernel's split rule can be told the longest walk to expect (``longest_stop_steps`` of
``kernels.art_decode.art_decode``), and a decode loop would take it from its previous step: the longest walk
of the same layer one token earlier.  This study measures how well that works on a capture:

* :func:`decode_walks`: the blocks that the kernel's single-split program of every ``(layer, b, kv_head)``
  loads at every decode step, from the simulator's kernel-mode replay
  (:func:`art_analysis.termination.replay_kernel_walks`; step ``t`` attends to ``C + t + 1`` tokens);
* :func:`persistence_summary`: how the walks change between consecutive steps (their rank correlation and
  absolute change), how each layer's longest walk changes, and how often the previous step's longest walk
  falls on the same side of a split-rule threshold as the current one;
* :func:`pair_split_persistence`: where a batch fills the GPU, ``art_decode`` told each pair's walk splits the
  pairs expected to walk long (``kernels.split_plan.pair_plan``); how often the previous step's walks split the
  pairs that the current step's own would, and above all the one that holds the longest walk.

Run ``python -m art_analysis.analysis.walk_persistence CAPTURE`` for the summary of a capture folder
(``--pair-plan-batch 128`` adds the per-pair split persistence; ``--from-json`` takes the walks of an earlier
run's ``--out`` instead of replaying them).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..checks import check_int
from ..termination import ARTConfig, replay_kernel_walks


def decode_walks(capture, rule: ARTConfig, *, block_size: int = 64, order: str = "sink_recency",
                 progress: bool = True) -> torch.Tensor:
    """``[L, T, B, Hkv]`` int64: the blocks each ``(b, kv_head)`` walk of the capture's ``L`` layers loads at
    each of its ``T`` decode steps under ``rule`` (``group="all"``, the kernel's rule), in the capture's dtype
    and at the model's softmax scale."""
    from ..capture import KVCapture

    if not isinstance(capture, KVCapture):
        raise TypeError(f"capture must be a KVCapture, got {type(capture).__name__}")
    if capture.decode_steps < 2:
        raise ValueError(f"a persistence study needs at least 2 decode steps, the capture has {capture.decode_steps}")
    if not isinstance(rule, ARTConfig) or rule.group != "all":
        raise ValueError(f"rule must be an ARTConfig with group='all' (the kernel's rule), got {rule!r}")
    walks = []
    for layer in tqdm(capture.layers, desc="walks per layer", disable=not progress):
        q, k, v = capture.layer(layer)
        steps = []
        for step in range(capture.decode_steps):
            length = int(capture.cache_seqlens_for_step(step)[0])
            steps.append(replay_kernel_walks(q[:, :, step].contiguous(), k[:, :, :length].contiguous(),
                                             v[:, :, :length].contiguous(), rule, block_size=block_size, order=order,
                                             sm_scale=capture.sm_scale))
        walks.append(torch.stack(steps))
    return torch.stack(walks)


def layer_longest(walks: torch.Tensor) -> torch.Tensor:
    """``[L, T]``: each layer's longest walk (over its batch rows and KV heads) at each step of
    ``walks [L, T, B, Hkv]``."""
    return walks.flatten(2).max(dim=2).values


def persistence_summary(walks: torch.Tensor, thresholds: Sequence[int] = ()) -> dict:
    """How the walks ``[L, T, B, Hkv]`` (:func:`decode_walks`) change from step ``t - 1`` to ``t``, over every
    ``t >= 1``:

    * ``rank_correlation``: Spearman's (ties take their average rank) between each walk at ``t - 1`` and at ``t``,
      pooled over layers, batch rows, KV heads and steps (``None`` when either side is constant, e.g. walks too
      short to stop);
    * ``abs_change_median``, ``abs_change_p90``, ``unchanged_fraction``: the change of each walk, in blocks;
    * ``longest_rel_change_median``: each layer's longest walk (over its batch rows and KV heads), its change over
      its current value;
    * ``longest_grew_fraction``: the ``(layer, t)`` pairs whose longest walk is longer than at ``t - 1``, where a
      hint taken from the previous step falls short;
    * ``split_choice_agreement``: for each threshold (blocks), the ``(layer, t)`` pairs whose longest walk lies on
      the same side of it (at least it, or below) as at ``t - 1``.  The kernel's split plan, told the longest walk,
      defers the followers to that walk where it is shorter than the dense walk in lone steps (every block at the
      device's dense pace, ``kernels.split_plan.dense_walk_ends_first``), and takes a call's guess where it is not
      (``kernels.split_plan.choose_follow_step``), so this is how often the previous step's hint leads to the choice
      that the current walk would."""
    if not isinstance(walks, torch.Tensor) or walks.dim() != 4 or walks.shape[1] < 2:
        shape = tuple(walks.shape) if isinstance(walks, torch.Tensor) else type(walks).__name__
        raise ValueError(f"walks must be [layers, steps >= 2, B, Hkv], got {shape}")
    thresholds = [check_int(t, "threshold", 1) for t in thresholds]
    walks = walks.long().cpu()
    before, after = walks[:, :-1].flatten(), walks[:, 1:].flatten()
    change = (after - before).abs().double()
    longest = layer_longest(walks)
    prev_longest, cur_longest = longest[:, :-1].flatten(), longest[:, 1:].flatten()
    constant = before.unique().numel() < 2 or after.unique().numel() < 2   # no rank correlation is defined
    rank = None if constant else float(pd.Series(before.numpy()).corr(pd.Series(after.numpy()), method="spearman"))
    return {
        "layers": walks.shape[0], "steps": walks.shape[1], "walks_per_step": walks.shape[2] * walks.shape[3],
        "rank_correlation": rank,
        "abs_change_median": float(change.quantile(0.5)),
        "abs_change_p90": float(change.quantile(0.9)),
        "unchanged_fraction": float((change == 0).double().mean()),
        "longest_rel_change_median": float(((cur_longest - prev_longest).abs() / cur_longest).double().quantile(0.5)),
        "longest_grew_fraction": float((cur_longest > prev_longest).double().mean()),
        "split_choice_agreement": {str(t): float(((prev_longest >= t) == (cur_longest >= t)).double().mean())
                                   for t in thresholds},
    }


def pair_split_persistence(walks: torch.Tensor, *, batch: int, max_steps: int, head_dim: int, sms: int) -> dict:
    """Per-pair splits told the previous step's walks, against those told the step's own, for walks
    ``[L, T, B0, Hkv]`` (:func:`decode_walks`) tiled to ``batch`` rows (row ``b`` walks sequence ``b % B0``, as the
    decode-loop benchmark tiles a capture) of at most ``max_steps`` blocks, on ``sms`` multiprocessors.  Each step's
    plan is ``kernels.split_plan.pair_plan`` of its tiled walks: the pairs past its threshold are split, or none.
    Over every ``(layer, t >= 1)`` whose own plan splits some pairs (``pair_split_steps`` of ``pair_plan_steps``):

    * ``pair_split_recall``: of the pairs that the step's own plan splits, the fraction that the previous step's
      plan splits too (pooled over those steps);
    * ``pair_split_same``: the fraction of those steps whose previous plan splits exactly the same pairs;
    * ``pair_split_longest_kept_single``: the fraction of those steps whose longest walk lies in a pair that the
      previous step's plan leaves single: the call then lasts as long as that walk, as without the walks."""
    from kernels.split_plan import pair_plan

    if not isinstance(walks, torch.Tensor) or walks.dim() != 4 or walks.shape[1] < 2:
        shape = tuple(walks.shape) if isinstance(walks, torch.Tensor) else type(walks).__name__
        raise ValueError(f"walks must be [layers, steps >= 2, B, Hkv], got {shape}")
    batch = check_int(batch, "batch", 1)
    rows = torch.arange(batch) % walks.shape[2]
    tiled = walks.long().cpu()[:, :, rows].flatten(2)            # [L, T, batch * Hkv]

    def split_pairs(step_walks: torch.Tensor) -> torch.Tensor:
        splits, threshold = pair_plan(sorted(step_walks.tolist()), max_steps, head_dim, sms)
        return step_walks > threshold if splits > 1 else torch.zeros_like(step_walks, dtype=torch.bool)

    plans = [[split_pairs(tiled[layer, step]) for step in range(tiled.shape[1])] for layer in range(tiled.shape[0])]
    split_steps = recalled = split_total = same = longest_single = 0
    for layer in range(tiled.shape[0]):
        for step in range(1, tiled.shape[1]):
            own, previous = plans[layer][step], plans[layer][step - 1]
            if not own.any():
                continue
            split_steps += 1
            split_total += int(own.sum())
            recalled += int((own & previous).sum())
            same += bool(torch.equal(own, previous))
            longest_single += not bool(previous[int(tiled[layer, step].argmax())])
    return {"pair_plan_batch": batch, "pair_plan_steps": tiled.shape[0] * (tiled.shape[1] - 1),
            "pair_split_steps": split_steps,
            "pair_split_recall": recalled / split_total if split_total else None,
            "pair_split_same": same / split_steps if split_steps else None,
            "pair_split_longest_kept_single": longest_single / split_steps if split_steps else None}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture", type=Path, help="a capture folder with at least 2 decode steps")
    parser.add_argument("--thresholds", type=int, nargs="*", default=[],
                        help="split-rule thresholds in blocks (e.g. 49: the dense walk of B = 32, 3 KV heads "
                             "of D = 64, 129 blocks, 132 SMs)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="cast the capture first (default: as stored); the kernel's benchmark runs bfloat16")
    parser.add_argument("--out", type=Path, help="write the summary and the walks here (JSON)")
    parser.add_argument("--from-json", action="store_true",
                        help="CAPTURE is the JSON that an earlier run wrote with --out: take its walks")
    parser.add_argument("--pair-plan-batch", type=int, default=None,
                        help="add the per-pair split persistence of the walks tiled to this many rows (e.g. 128)")
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=64, help="for --pair-plan-batch")
    parser.add_argument("--sms", type=int, default=132, help="for --pair-plan-batch (132: an H200)")
    args = parser.parse_args(argv)
    from kernels.results_io import read_result, write_json_atomic

    from ..capture import KVCapture
    from ..cli.output_paths import check_output_file

    for option, value in (("--pair-plan-batch", args.pair_plan_batch), ("--sms", args.sms)):
        if value is not None and value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    try:
        check_output_file(args.out, "--out")
        if args.from_json:
            record = read_result(args.capture, what="walks JSON")
        else:
            capture = KVCapture.load(args.capture)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if args.from_json:
        if args.dtype is not None or "walks" not in record:
            parser.error("--from-json takes the walks (and dtype) of an earlier --out JSON; it has "
                         f"{'no walks' if 'walks' not in record else 'its own dtype: drop --dtype'}")
        lacking = [key for key in ("context_tokens", "decode_steps") if key not in record]
        if args.pair_plan_batch is not None and lacking:
            parser.error(f"--pair-plan-batch needs the walks' context length; {args.capture} lacks "
                         f"{', '.join(lacking)}")
        try:
            walks = torch.tensor(record.pop("walks"), dtype=torch.long)
        except (TypeError, ValueError, RuntimeError) as exc:
            parser.error(f"{args.capture}: walks must be [L, T, B, Hkv] block counts ({exc})")
        if walks.dim() != 4 or walks.shape[1] < 2:
            parser.error(f"{args.capture}: walks must be [L, T, B, Hkv] block counts of at least 2 decode steps, "
                         f"got shape {tuple(walks.shape)}")
    else:
        if args.dtype is not None:
            capture = capture.to(dtype=getattr(torch, args.dtype))
        walks = decode_walks(capture, ARTConfig())
        meta = capture.metadata
        record = {"capture": str(args.capture), "model": meta["model"]["name"], "source": meta["source"],
                  "context_tokens": meta["context_tokens"], "decode_steps": meta["decode_steps"],
                  "dtype": args.dtype or "as stored", "rule": repr(ARTConfig())}
    summary = persistence_summary(walks, args.thresholds)
    if args.pair_plan_batch is not None:
        # blocks of the last decode step's context: the longest walk any step can take
        max_steps = -(-(record["context_tokens"] + record["decode_steps"]) // 64)
        summary.update(pair_split_persistence(walks, batch=args.pair_plan_batch, max_steps=max_steps,
                                              head_dim=args.head_dim, sms=args.sms), pair_plan_max_steps=max_steps)
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        write_json_atomic(args.out, {**record, "summary": summary, "walks": walks.tolist()})
    return summary


if __name__ == "__main__":
    main()
