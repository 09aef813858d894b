"""Fine-tuning with the Hugging Face ``Trainer`` under trainguard: ``GuardedTrainer`` instead of ``Trainer``.

    trainguard run --max-restarts 3 -- torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py \\
        --run-dir runs/hf --steps 20

A tiny Qwen2 from a config (no download) on a synthetic causal-LM dataset, DDP through accelerate
(gloo on CPU). Run it again after a kill and it continues from trainguard's newest verified checkpoint,
bitwise as if it had never stopped. Guards and checkpoint policy come from ``--set`` (trainguard's keys).
"""

import argparse

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainingArguments

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         attention_dropout=0.1, max_position_embeddings=64))
    training = TrainingArguments(output_dir=f"{args.run_dir}/hf_trainer", max_steps=args.steps, learning_rate=3e-3,
                                 per_device_train_batch_size=2, lr_scheduler_type="cosine", warmup_steps=2,
                                 max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                                 use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    trainer = GuardedTrainer(args.run_dir, model=model, args=training, train_dataset=ArithmeticSequences(),
                             guard_config=load_config(None, args.overrides))
    trainer.train()
    # the Trainer leaves the process group to the script: a gloo group still alive at interpreter exit can
    # abort the process (SIGABRT, "terminate called without an active exception") after a clean run
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(trainer.exit_code)


if __name__ == "__main__":
    main()
