"""`art-analysis bench-compare BASE.json NEW.json`: two results of one `art-analysis bench` suite, call by call: the
calls that got slower or faster than in the baseline run beyond a threshold and the runs' own noise, the plans that
changed, and the summaries side by side (``kernels.bench_compare``).  BASE may be a folder (``benchmarks/results``):
the baseline is then its newest complete run of NEW's suite, device and quick setting.  Runs on the CPU: it reads
JSON only."""
from __future__ import annotations

import argparse
from pathlib import Path

from .output_paths import check_output_file

ROW_COLUMNS = ("call", "section", "base_ms", "new_ms", "ratio", "noise", "plan")
ROW_FORMATS = {"base_ms": ".4f", "new_ms": ".4f", "ratio": ".3f", "noise": ".3f"}


def register(subparsers) -> None:
    from kernels.bench_compare import DEFAULT_THRESHOLD

    parser = subparsers.add_parser("bench-compare", help="compare two GPU benchmark results call by call",
                                   description=__doc__)
    parser.add_argument("base", type=Path,
                        help="the baseline result (e.g. a committed benchmarks/results JSON), or a folder of results: "
                             "its newest complete run of the new result's suite, device and quick setting")
    parser.add_argument("new", type=Path, help="the result to check against it, of the same suite and device")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"a ratio counts as a change beyond max(threshold, the rows' round spread) "
                             f"(default {DEFAULT_THRESHOLD})")
    parser.add_argument("--all", action="store_true", help="list every compared call, not only the changed ones")
    parser.add_argument("--json", type=Path, default=None, help="also write the whole comparison here")
    parser.add_argument("--fail-on-slower", action="store_true",
                        help="exit with status 1 when any call the baseline timed is slower in the new run, records "
                             "an error there or is missing from it (a regression check)")
    parser.set_defaults(func=run)


def _calls(entries: list[dict], key_fields: tuple[str, ...]) -> list[str]:
    """Each compared call of one section in one cell: the key fields that vary over the section, ``impl`` or
    ``method`` last."""
    named = [field for field in key_fields if field not in ("impl", "method")
             and len({entry.get(field) for entry in entries}) > 1]
    return [" ".join([*(f"{field}={entry.get(field)}" for field in named),
                      str(entry.get("impl") or entry.get("method"))]) for entry in entries]


def _source(header: dict) -> str:
    source = header.get("source") or {}
    commit = source.get("commit")
    return f"commit {commit[:12]}{' + changes' if source.get('modified') else ''}" if commit else "commit unknown"


def run(args: argparse.Namespace) -> int:
    from kernels.bench_compare import ROW_KEYS, baseline_in, compare_runs, headline_entries, load_run
    from kernels.results_io import write_json_atomic

    from ..table import format_table

    if args.json is not None:
        check_output_file(args.json, "--json")
    new = load_run(args.new)
    base_path = baseline_in(args.base, new, args.new) if args.base.is_dir() else args.base
    comparison = compare_runs(load_run(base_path), new, args.threshold, base_name=base_path.name,
                              new_name=args.new.name)
    suite = comparison["suite"]
    print(f"{suite} results on {comparison['new']['device']}")
    for side in ("base", "new"):
        header = comparison[side]
        print(f"  {side}: {header['file']} ({str(header['date'])[:10]}, {_source(header)})")
    for note in comparison["notes"]:
        print(f"  note: {note}")
    if comparison["peer_ratio_median"] is not None:
        print(f"  the peers' calls took {comparison['peer_ratio_median']:.3f}x their baseline time (median): the "
              "card's and their software's drift between the runs")
    counts = comparison["counts"]
    only_base = sum(len(keys) for keys in comparison["only_in_base"].values())
    only_new = sum(len(keys) for keys in comparison["only_in_new"].values())
    print(f"calls compared: {sum(counts.values())} (slower {counts['slower']}, faster {counts['faster']}, same "
          f"{counts['same']}, error in one run {counts['error']}); timed in one run only: base {only_base}, "
          f"new {only_new}")
    headlines = headline_entries(comparison)
    if headlines:
        print()
        print(format_table(headlines, ("entry", "base", "new"), {"base": ".4g", "new": ".4g"}))
    shown = [{"section": section, "call": call, **entry}
             for section, entries in comparison["rows"].items()
             for entry, call in zip(entries, _calls(entries, ROW_KEYS[suite][section]))
             if args.all or entry["change"] != "same" or entry["plan"]]
    print()
    if shown:
        print(f"{'every compared call' if args.all else 'calls changed'} (ratio: new / base; a change beyond "
              f"max({args.threshold:g}, noise); plan: what the launcher chose differently):")
        print(format_table(shown, ROW_COLUMNS, ROW_FORMATS))
    else:
        print(f"no call changed beyond max({args.threshold:g}, its noise) and no plan changed")
    if args.json is not None:
        write_json_atomic(args.json, comparison)
        print(f"wrote {args.json}")
    regressions = comparison["regressions"]
    if args.fail_on_slower and any(regressions.values()):
        print(f"regression check failed: {regressions['slower']} slower, {regressions['error_in_new']} with an error "
              f"in the new run only, {regressions['only_in_base']} timed in the baseline and missing from the new run")
        return 1
    return 0
