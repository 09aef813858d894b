"""``trainguard ckpt convert``: a checkpoint into a durable reshardable one (dcp) or a universal one."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path

from trainguard.cli.output import byte_progress


def add_commands(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser("convert", help="convert a checkpoint to a durable (dcp) or universal one")
    source = convert.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source", type=Path, metavar="D",
                        help="a local per-rank or durable checkpoint directory")
    source.add_argument("--from-hf", dest="from_hf", type=Path, metavar="HF_DIR",
                        help="a Hugging Face model directory (starts a durable checkpoint at step 0)")
    convert.add_argument("--to", dest="target", type=Path, required=True, metavar="T", help="the new checkpoint")
    convert.add_argument("--format", choices=("dcp", "universal"), default="dcp",
                         help="dcp: blocks kept as DCP chunks; universal: one fp32 file per parameter")
    convert.add_argument("--force", action="store_true", help="replace a target directory that is not empty")
    convert.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from trainguard.checkpoint.trusted import require_verified

    require_verified(args.from_hf if args.from_hf is not None else args.source)
    if args.from_hf is not None:
        from trainguard.hf.convert import hf_to_durable  # transformers and DCP: only when needed

        hf_to_durable(args.from_hf, args.target)
        print(f"converted {args.from_hf} into {args.target}")
        return 0
    from trainguard.merge.universal import convert_checkpoint

    with ExitStack() as stack:
        convert_checkpoint(args.source, args.target, args.format, force=args.force,
                           progress=lambda total, what: stack.enter_context(byte_progress(what, total)))
    print(f"converted {args.source} into {args.target} ({args.format})")
    return 0
