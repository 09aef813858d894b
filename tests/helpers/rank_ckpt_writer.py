"""Test fixture (not a second writer in src): run as ranks, it trains the reference trainer (whose
own local tier, when ``checkpoint.local_interval`` is set, writes ``RUN/local/nodeK/global_step_N``) and
then writes the state the way verl's FSDP checkpoint manager does, from the real sharded model of every
rank: ``RUN/verl/global_step_N/actor`` (torch.save of DTensor state dicts).
With ``--resave OUT`` it instead resumes (``--resume PATH``) on this layout, saves the resumed state
as a durable checkpoint under OUT, and records in OUT/indices.json the sample indices every data
rank draws for the next step.

``python rank_ckpt_writer.py --nproc N ARGS`` starts its N ranks with trainguard's local launcher
(``runtime.launcher.launch_local``: torch's elastic agent, as torchrun's, in this process, the ranks
forked from a one-thread copy of it that imported the trainer: no interpreter start and imports per
rank); without ``--nproc`` it is one rank of a launcher that set the torch.distributed environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from trainguard.fs.layout import extra_state_name, model_shard_name, optim_shard_name, step_dir_name
from trainguard.checkpoint.rng_state import capture_rng_state
from trainguard.runtime.launcher import launch_local
from trainguard.step.static_files import huggingface_files
from trainguard.trainer.arguments import add_train_arguments
from trainguard.trainer.entry import config_from_args
from trainguard.trainer.loop import Trainer


def write_verl_checkpoint(trainer: Trainer, run_dir: Path) -> None:
    rank, world, step = trainer.rank, trainer.world_size, trainer.guard.global_step
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))
    extra = {"step": step, "rank": rank, "world_size": world, "rng": capture_rng_state(),
             "stateful": {name: obj.state_dict() for name, obj in trainer.guard.checkpoints.stateful.items()}}
    verl = run_dir / "verl" / step_dir_name(step) / "actor"
    verl.mkdir(parents=True, exist_ok=True)
    torch.save(extra, verl / extra_state_name(world, rank))
    torch.save(dict(model_sd), verl / model_shard_name(world, rank))
    torch.save(dict(optim_sd), verl / optim_shard_name(world, rank))
    if rank == 0:
        huggingface_files(trainer.model_config, trainer.tokenizer)(verl)
        (verl / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))


def resave(trainer: Trainer, out: Path) -> None:
    checkpoints = trainer.guard.checkpoints
    step = trainer.guard.resume()
    consumed = trainer.sampler.consumed_samples
    checkpoints.root = out
    checkpoints.durable.root = out
    if trainer.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    checkpoints.save_durable(step)
    checkpoints.close()
    drawn = [trainer.sampler.next_batch_indices() for _ in range(trainer.config.train.micro_batches)]
    gathered = [None] * trainer.world_size
    dist.all_gather_object(gathered, (trainer.dp_rank, drawn))
    if trainer.rank == 0:
        by_dp = {str(dp): indices for dp, indices in gathered}
        (out / "indices.json").write_text(json.dumps({"step": step, "consumed_before": consumed,
                                                      "dp_size": trainer.layout.dp_size, "by_dp_rank": by_dp}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    parser.add_argument("--resave", type=Path)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True, warn_only=True)
    trainer = Trainer(config_from_args(args), Path(args.run_dir))
    if args.resave:
        resave(trainer, args.resave)
    else:
        trainer.run()
        write_verl_checkpoint(trainer, Path(args.run_dir))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1:2] == ["--nproc"]:
        worker_args = sys.argv[3:]
        run_dir = Path(worker_args[worker_args.index("--run-dir") + 1])
        sys.exit(launch_local(int(sys.argv[2]), worker_args, run_dir, main, preload=("trainguard.trainer.loop",)))
    sys.exit(main())
