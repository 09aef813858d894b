"""``trainguard plan``: checkpoint sizes, staging memory, retention storage and the save interval."""

from __future__ import annotations

import argparse
import json

from trainguard.cli.output import stdout_console
from trainguard.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="size checkpoints and choose the save interval")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="parameter count, e.g. 176e9")
    size.add_argument("--hidden", type=int, help="hidden size (with --layers, --seq-len, --vocab)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--vocab", type=int)
    for degree in ("tp", "pp", "dp-replicate", "dp-shard"):
        parser.add_argument(f"--{degree}", type=int, default=1)
    parser.add_argument("--save-seconds", type=float, help="measured time of one durable save")
    parser.add_argument("--mtbf-hours", type=float, help="mean time between failures of the whole job")
    parser.add_argument("--restart-seconds", type=float, default=0.0, help="time from a failure to training again")
    parser.add_argument("--step-seconds", type=float, help="time of one training step, to express the interval in steps")
    parser.add_argument("--steps", type=int, help="total steps, for the retention storage")
    parser.add_argument("--save-interval", type=int, help="save interval in steps, for the retention storage")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--keep-every", type=int)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainguard.plan import checkpoint_sizes, expected_goodput, optimal_save_interval, transformer_params
    from trainguard.plan.sizing import GIB, retention_bytes

    if args.hidden is not None:
        missing = [flag for flag in ("layers", "seq_len", "vocab") if getattr(args, flag) is None]
        if missing:
            raise ConfigError(f"--hidden needs --{missing[0].replace('_', '-')} too")
        params = transformer_params(args.hidden, args.layers, args.seq_len, args.vocab)
    else:
        params = int(args.params)
    try:
        sizes = checkpoint_sizes(params, args.tp, args.pp, args.dp_replicate, args.dp_shard)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    figures: dict[str, float | int | None] = {
        "params": params,
        "weights_gib": sizes.weights_bytes / GIB,
        "full_gib": sizes.full_bytes / GIB,
        "staging_per_rank_gib": sizes.full_per_rank_bytes / GIB,
        "local_tier_gib": sizes.local_tier_bytes / GIB,
    }
    if args.steps and args.save_interval:
        figures["retention_gib"] = retention_bytes(sizes.full_bytes, args.steps, args.save_interval,
                                                   args.keep_last, args.keep_every) / GIB
    if args.save_seconds and args.mtbf_hours:
        mtbf = args.mtbf_hours * 3600
        interval = optimal_save_interval(args.save_seconds, mtbf)
        figures["optimal_interval_seconds"] = interval
        figures["expected_goodput"] = expected_goodput(interval, args.save_seconds, mtbf, args.restart_seconds)
        if args.step_seconds:
            figures["optimal_interval_steps"] = max(1, round(interval / args.step_seconds))
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"checkpoint plan: {params / 1e9:.2f}B parameters")
    table.add_column("figure")
    table.add_column("value", justify="right")
    labels = {
        "weights_gib": ("bf16 weights (2 B/param)", "{:.2f} GiB"),
        "full_gib": ("full checkpoint (14 B/param)", "{:.2f} GiB"),
        "staging_per_rank_gib": ("async staging memory per rank", "{:.2f} GiB"),
        "local_tier_gib": ("local tier, all ranks (replicas included)", "{:.2f} GiB"),
        "retention_gib": ("durable storage at the end (retention)", "{:.2f} GiB"),
        "optimal_interval_seconds": ("save interval √(2·C·MTBF)", "{:.0f} s"),
        "optimal_interval_steps": ("save interval in steps", "{}"),
        "expected_goodput": ("expected goodput", "{:.1%}"),
    }
    for key, (label, fmt) in labels.items():
        if key in figures:
            table.add_row(label, fmt.format(figures[key]))
    stdout_console().print(table)
    return 0
