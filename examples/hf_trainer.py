"""Fine-tuning with the Hugging Face ``Trainer`` under trainguard: ``GuardedTrainer`` instead of ``Trainer``.

    trainguard run --max-restarts 3 -- torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py \\
        --run-dir runs/hf --steps 20

A tiny Qwen2 from a config (no download) on a synthetic causal-LM dataset, DDP through accelerate
(gloo on CPU). Run it again after a kill and it continues from trainguard's newest verified checkpoint,
bitwise as if it had never stopped. Guards and checkpoint policy come from ``--config`` and ``--set``
(trainguard's keys).

The same file trains with live recovery (a rank dies, the others keep stepping, its replacement rejoins;
the same result) when its configuration says ``fault_tolerance.live: true``, started by the live
launcher instead of torchrun (each step: ``train.micro_batches`` micro-batches of 2 samples)::

    trainguard run --nproc 2 --config live.yaml --run-dir runs/hf-live -- python examples/hf_trainer.py \
        --steps 20 --config live.yaml

with ``live.yaml``: ``{fault_tolerance: {live: true}, parallel: {dp_replicate: 2}, train: {steps: 20,
micro_batches: 4}}``. The launcher appends its own flags (``--store``, ``--rank``, ``--run-dir``, ...),
which the parser below leaves to trainguard.
``--plain`` runs the same fine-tune on a plain ``transformers.Trainer`` (no trainguard) to compare with;
``--log-file`` appends every log the Trainer emits (what W&B or a callback receives) as JSON lines.
``--fsdp`` shards the model with FSDP2 through accelerate (``TrainingArguments(fsdp=True,
fsdp_config={"version": 2, ...})``), one ``fully_shard`` per decoder layer and one for the whole model;
accelerate turns FSDP on only on accelerators, so it needs a GPU per rank (on CPU ``GuardedTrainer``
refuses it in one line: the Trainer would silently run DDP). Rank 0 prints one line saying how many
parameters are DTensors once the Trainer prepared the model. On a GPU the Trainer runs with
``full_determinism`` (deterministic kernels, as a bitwise resume needs)::

    trainguard run --max-restarts 3 -- torchrun --standalone --nproc-per-node 1 examples/hf_trainer.py \\
        --run-dir runs/hf-fsdp --steps 20 --fsdp
"""

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainerCallback, TrainingArguments

from trainguard.config import load_config
from trainguard.integrations.hf_trainer import GuardedTrainer

VOCAB_SIZE = 96


class ArithmeticSequences(torch.utils.data.Dataset):
    """Sample i: an arithmetic sequence mod the vocabulary, a pure function of i (learnable, no files)."""

    def __init__(self, size: int = 256, seq_len: int = 16):
        self.size, self.seq_len = size, seq_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        start = torch.randint(VOCAB_SIZE, (1,), generator=gen)
        stride = torch.randint(1, 5, (1,), generator=gen)
        tokens = (start + stride * torch.arange(self.seq_len)) % VOCAB_SIZE
        return {"input_ids": tokens, "labels": tokens.clone()}


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        attention_dropout=0.1, max_position_embeddings=64))


# FSDP2: each decoder layer its own fully_shard unit (then the whole model), accelerate's default policy
FSDP2_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}


def training_arguments(run_dir: str, steps: int, fsdp: bool = False) -> TrainingArguments:
    on_gpu = torch.cuda.is_available()
    sharding = {"fsdp": True, "fsdp_config": dict(FSDP2_CONFIG)} if fsdp else {}
    return TrainingArguments(output_dir=f"{run_dir}/hf_trainer", max_steps=steps, learning_rate=3e-3,
                             per_device_train_batch_size=2, lr_scheduler_type="cosine", warmup_steps=2,
                             max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                             use_cpu=not on_gpu, dataloader_num_workers=0,
                             full_determinism=on_gpu,  # deterministic CUDA kernels: a resume ends bitwise
                             **sharding)


class LogFile(TrainerCallback):
    """Appends each log of the Trainer, with its step, to a JSON-lines file (the main process only)."""

    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            with self.path.open("a") as out:
                out.write(json.dumps({**logs, "step": state.global_step}) + "\n")


class ShardingReport(TrainerCallback):
    """Rank 0 prints, once the Trainer prepared the model, how FSDP2 sharded it: what ``--fsdp`` asked for."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        parameters = list(model.parameters())
        sharded = [p for p in parameters if isinstance(p, DTensor)]
        units = sum(isinstance(module, FSDPModule) for module in model.modules())
        if state.is_world_process_zero:
            mesh = sharded[0].device_mesh if sharded else None
            print(f"hf_trainer: FSDP2: {len(sharded)} of {len(parameters)} parameters are DTensors, "
                  f"{units} fully_shard units, mesh {mesh}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--run-dir", required=True)  # under the live launcher: its --run-dir
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", help="a trainguard YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--plain", action="store_true", help="a plain transformers.Trainer, to compare with")
    parser.add_argument("--log-file", type=Path, help="append the Trainer's logs here as JSON lines")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 through accelerate (a GPU per rank)")
    args, _ = parser.parse_known_args()  # the others: a live launcher's flags, which trainguard reads

    callbacks = ([LogFile(args.log_file)] if args.log_file else []) + ([ShardingReport()] if args.fsdp else [])
    common = {"model": tiny_qwen2(), "args": training_arguments(args.run_dir, args.steps, fsdp=args.fsdp),
              "train_dataset": ArithmeticSequences(), "callbacks": callbacks or None}
    if args.plain:
        trainer = Trainer(**common)
    else:
        trainer = GuardedTrainer(args.run_dir, guard_config=load_config(args.config, args.overrides), **common)
    trainer.train()  # in live mode it ends the process with the live run's exit code
    exit_code = 0 if args.plain else trainer.exit_code
    # the Trainer leaves the process group to the script: a gloo group still alive at interpreter exit can
    # abort the process (SIGABRT, "terminate called without an active exception") after a clean run
    if dist.is_initialized():
        dist.barrier()  # without it the plain Trainer's ranks hung here (gloo, CPU): one destroyed the group early
        # DDP's reducer holds the group too. Left to the interpreter's exit, it dropped the group's last
        # reference holding the GIL while the group's destructor joined a gloo thread that waited for the GIL
        # (a hang, about one run in twenty here); freed first, the group ends in destroy_process_group, which
        # lets go of the GIL while its threads end
        del trainer, common
        gc.collect()
        dist.destroy_process_group()
    raise SystemExit(exit_code)


if __name__ == "__main__":
    main()
