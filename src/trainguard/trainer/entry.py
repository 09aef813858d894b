"""The training process: ``python -m trainguard.trainer.entry`` under torchrun, Slurm or ``trainguard train``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.config import load_config
from trainguard.errors import ConfigError, ConfigErrorExit, TrainguardError
from trainguard.trainer.arguments import add_train_arguments, overrides_from_args
from trainguard.trainer.model import check_positions_fit, check_tokenizer_fits


def config_from_args(args: argparse.Namespace):
    config = load_config(args.config, overrides_from_args(args))
    source = str(args.config) if args.config else "--set"
    check_tokenizer_fits(config.model, source)
    check_positions_fit(config.model, config.data.seq_len, source)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.trainer.entry")
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = config_from_args(args)
        if not args.run_dir:
            raise ConfigError("--run-dir is required when the trainer is started directly")
        backend = "gloo"
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible; "
                                  "NCCL runs one rank per GPU): lower --nproc, or CUDA_VISIBLE_DEVICES= to train on CPU")
            torch.cuda.set_device(local_rank)
            # the guards' small host-side reductions go through gloo, the model's collectives through NCCL
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend)
        from trainguard.trainer.loop import Trainer

        torch.use_deterministic_algorithms(True, warn_only=True)
        trainer = Trainer(config, Path(args.run_dir))
        try:
            code = trainer.run()
        except SystemExit:
            raise  # the guard ended the run itself, its exit record written
        except BaseException as exc:  # the supervisor tells a rank that failed from one that was killed
            with contextlib.suppress(OSError):  # a full disk must not mask the error being raised
                trainer.guard.lifecycle.beat("exit", trainer.guard.global_step, getattr(exc, "exit_code", 1))
            raise
    except ConfigErrorExit as exc:  # the guard printed it already, on rank 0 alone
        code = exc.exit_code
    except TrainguardError as exc:
        if rank == 0 or not exc.every_rank_raises:
            print(f"trainguard: error: [rank {rank}] {exc}", file=sys.stderr, flush=True)
        code = exc.exit_code
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def run_worker(argv: list[str]) -> None:
    """Entry point of a rank started by ``trainguard train``: exits with the trainer's code."""
    code = main(argv)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
