"""The reference trainer: a Hugging Face causal LM, deterministic data, FSDP2/HSDP/TP/PP by config,
and every guard through ``trainguard.Guard`` (its step is a closure plus ``guard.step``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.checkpoint.rng_state import seed_everything
from trainguard.config.schema import RunConfig
from trainguard.events.rank_logging import setup_logging
from trainguard.hf.config import build_empty_model
from trainguard.hf.init import (
    current_rss,
    load_hf_weights,
    materialize,
    peak_rss_since_reset,
    reset_peak_rss,
)
from trainguard.step.guard import Guard
from trainguard.topology.layout import resolve_layout
from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens, make_batch
from trainguard.trainer.expert_layout import check_expert_layout
from trainguard.trainer.model import build_model, build_model_config, token_cross_entropy
from trainguard.trainer.optim import build_optimizer
from trainguard.trainer.parallelize import build_mesh, parallelize
from trainguard.trainer.pipeline import PipelineParts, build_pipeline
from trainguard.trainer.tokenizer import ByteTokenizer


class Trainer:
    def __init__(self, config: RunConfig, run_dir: Path):
        self.config = config
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.log = setup_logging(self.rank, self.run_dir / "logs")
        self.layout = resolve_layout(config.parallel, self.world_size)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        self.mesh = build_mesh(self.layout, self.device.type)
        self.dp_rank = self.layout.dp_rank(self.rank)

        self.model_config = build_model_config(config.model, max_position_embeddings=config.data.seq_len)
        check_expert_layout(self.model_config, self.layout)  # also refused before processes start (cli.train)
        self.tokenizer = ByteTokenizer()
        self.pipeline: PipelineParts | None = None
        # what building and loading the model adds to this rank's peak memory (reported by init_from)
        rss_before_model = reset_peak_rss() if config.model.init_from is not None else 0
        if self.layout.pp > 1:
            self.pipeline = build_pipeline(
                self.model_config, config.train.seed, self.mesh, self.layout, self.device,
                n_microbatches=config.train.micro_batches, loss_fn=token_cross_entropy,
                microbatch_size=config.data.micro_batch_size, seq_len=config.data.seq_len,
                empty=config.model.init_from is not None,
            )
            self.model = self.pipeline.module
        elif config.model.init_from is not None:  # this rank's shards only; weights loaded in run()
            model = build_empty_model(self.model_config)
            self.model = parallelize(model, self.mesh, self.layout)
            materialize(self.model, self.device, model)
        else:
            model = build_model(self.model_config, seed=config.train.seed)
            self.model = parallelize(model.to(self.device), self.mesh, self.layout)
        # (held, peak) bytes that building the model added: this rank's shards, and what it took to make them
        self.model_rss = (current_rss() - rss_before_model, peak_rss_since_reset() - rss_before_model)
        seed_everything(config.train.seed + self.rank)  # replaced by the saved states on resume
        self.optimizer, self.scheduler = build_optimizer(self.model, config.optim, config.train.steps)

        self.dataset = TokenDataset(load_corpus_tokens(), config.data.seq_len)
        self.sampler = StatefulSampler(
            len(self.dataset), self.dp_rank, self.layout.dp_size, config.data.micro_batch_size, config.data.seed
        )
        holds_embedding = self.pipeline is None or self.pipeline.is_first
        dp = self.layout.dp_size
        self.guard = Guard(
            self.run_dir, self.model, self.optimizer, self.scheduler, {"sampler": self.sampler}, config,
            mesh=self.mesh, pipeline_stages=self.layout.pp,
            embedding=self.model.get_input_embeddings().weight if holds_embedding else None,
            hf_config=self.model_config, tokenizer=self.tokenizer,
            tokens_per_step=dp * config.data.micro_batch_size * config.data.seq_len * config.train.micro_batches,
        )

    # ------------------------------------------------------------------------------------- step
    def _forward_backward(self) -> torch.Tensor | None:
        """Draws this step's micro-batches and runs forward and backward; returns the mean loss over
        them (None on pipeline stages without the loss). The guard may call it twice (SDC rerun),
        with the sampler restored in between."""
        batches = [make_batch(self.dataset, self.sampler.next_batch_indices())
                   for _ in range(self.config.train.micro_batches)]
        if self.pipeline is not None:
            inputs = torch.cat([b[0] for b in batches]).to(self.device)
            labels = torch.cat([b[1] for b in batches]).to(self.device)
            loss = self.pipeline.step(inputs, labels)
            return loss.double() if loss is not None else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in batches:
            logits = self.model(input_ids=inputs.to(self.device)).logits
            loss = token_cross_entropy(logits, labels.to(self.device))
            (loss / len(batches)).backward()
            loss_sum += loss.detach().double() / len(batches)
        return loss_sum

    def _load_init_from(self) -> None:
        """Reads this rank's slices of ``model.init_from`` into the (materialized, uninitialized) shards."""
        before_load = reset_peak_rss()
        facts = load_hf_weights(self.model, self.model_config, Path(self.config.model.init_from),
                                self.guard.checkpoints.durable.process_group)
        held, peak = self.model_rss
        peak = max(peak, held + peak_rss_since_reset() - before_load)  # other allocations in between left out
        self.guard.events.emit("init_from", step=0, path=str(self.config.model.init_from),
                               peak_rss_increase_bytes=peak, **facts)
        self.log.info("initial weights read from %s (%d tensors, %.2fs)", self.config.model.init_from,
                      facts["tensors"], facts["seconds"])

    # -------------------------------------------------------------------------------------- run
    def run(self) -> int:
        step = self.guard.resume()
        if self.config.model.init_from is not None and self.guard.checkpoints.resumed_from is None:
            self._load_init_from()
        while not self.guard.should_stop(step, self.config.train.steps):
            step = self.guard.step(self._forward_backward).step
        return self.guard.close()
