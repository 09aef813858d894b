"""``trainguard ckpt merge`` (any checkpoint -> Hugging Face) and ``trainguard ckpt test`` (compare)."""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from pathlib import Path

from trainguard.cli.output import byte_progress
from trainguard.errors import ConfigError

# Literal here, not imported: the merge modules (and torch) load only when a merge runs.
BACKENDS = ("fsdp", "dcp", "auto")
DTYPES = ("bf16", "fp16", "fp32", "keep")

EXIT_DIFFERENT = 1


def add_commands(commands: argparse._SubParsersAction) -> None:
    merge = commands.add_parser("merge", help="merge a sharded checkpoint into a Hugging Face model directory")
    merge.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="fsdp: per-rank files (trainguard local or verl); dcp: trainguard durable; auto: detect")
    merge.add_argument("--local_dir", required=True, type=Path, help="the checkpoint directory")
    merge.add_argument("--target_dir", required=True, type=Path, help="where the Hugging Face model is written")
    merge.add_argument("--tie-word-embedding", action="store_true", help="no separate output embedding tensor")
    merge.add_argument("--is-value-model", action="store_true", help="keep the value head (score.weight)")
    merge.add_argument("--dtype", choices=DTYPES, default="keep", help="dtype of floating tensors written")
    merge.add_argument("--max-shard-size", default="5GB", help="split the safetensors files past this size")
    merge.add_argument("--force", action="store_true", help="replace a target directory that is not empty")
    merge.add_argument("--hf_config", "--hf_model_path", dest="hf_config", type=Path, metavar="DIR",
                       help="a Hugging Face directory with the model's config.json (and tokenizer), for a "
                            "checkpoint without huggingface/ (leaves the checkpoint untouched)")
    merge.set_defaults(func=run_merge)

    test = commands.add_parser("test", help="compare a merged model with a reference, tensor by tensor")
    test.add_argument("--local_dir", required=True, type=Path, help="the merged Hugging Face directory")
    test.add_argument("--reference", required=True, type=Path,
                      help="a Hugging Face directory or a trainguard checkpoint")
    test.set_defaults(func=run_test)


def run_merge(args: argparse.Namespace) -> int:
    from trainguard.checkpoint.trusted import require_verified
    from trainguard.merge.merger import merge_to_hf
    from trainguard.merge.safetensors_out import parse_size

    require_verified(args.local_dir)
    started = time.perf_counter()
    with ExitStack() as stack:
        result = merge_to_hf(args.local_dir, args.target_dir, backend=args.backend,
                             tie_word_embedding=args.tie_word_embedding, is_value_model=args.is_value_model,
                             dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size), force=args.force,
                             hf_config=args.hf_config,
                             progress=lambda total, what: stack.enter_context(byte_progress(what, total)))
    seconds = time.perf_counter() - started
    print(f"merged {result.tensors} tensors ({result.bytes} bytes) from {result.source} into {args.target_dir}: "
          f"{', '.join(result.files)} in {seconds:.2f} s ({result.bytes / max(seconds, 1e-9) / 1e6:.0f} MB/s)")
    return 0


def run_test(args: argparse.Namespace) -> int:
    from trainguard.checkpoint.trusted import require_verified
    from trainguard.merge.compare import compare_tensors, hf_tensors, reference_tensors

    for path in (args.local_dir, args.reference):
        if not path.is_dir():
            raise ConfigError(f"{path}: no such directory")
        require_verified(path)
    compared, differences = compare_tensors(hf_tensors(args.local_dir), reference_tensors(args.reference, args.local_dir))
    for difference in differences:
        print(difference)
    verdict = "identical within tolerance" if not differences else f"{len(differences)} difference(s)"
    print(f"{compared} tensors compared: {verdict}")
    return EXIT_DIFFERENT if differences else 0
