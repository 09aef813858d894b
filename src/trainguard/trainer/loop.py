"""The reference trainer, assembled from components: model, data, optimizer, norms, checkpoints, faults."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainguard.checkpoint.fsio import fsync_file
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.rng_state import seed_everything
from trainguard.config.load import config_to_dict
from trainguard.config.schema import RunConfig
from trainguard.events import EventLog
from trainguard.faults import FaultInjector
from trainguard.norms import clip_grads_, global_norm_and_sums
from trainguard.topology.layout import MESH_DIMS, resolve_layout
from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens, make_batch
from trainguard.trainer.logging_setup import setup_logging
from trainguard.trainer.model import build_model, build_model_config
from trainguard.trainer.optim import build_optimizer
from trainguard.trainer.parallelize import build_mesh, parallelize
from trainguard.trainer.tokenizer import ByteTokenizer


@dataclass
class StepResult:
    step: int
    loss: float
    global_norm: float
    lr: float
    seconds: float


class Trainer:
    def __init__(self, config: RunConfig, run_dir: Path):
        self.config = config
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.host = socket.gethostname()
        self.log = setup_logging(self.rank, self.run_dir / "logs")
        self.events = EventLog(self.run_dir / "events.jsonl", rank=self.rank, host=self.host)
        self.layout = resolve_layout(config.parallel, self.world_size)
        if self.layout.pp > 1:
            from trainguard.errors import ConfigError

            raise ConfigError("parallel.pp > 1 is not supported by the reference trainer yet")
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        self.mesh = build_mesh(self.layout, self.device.type)
        self.dp_rank = self.layout.dp_rank(self.rank)

        self.model_config = build_model_config(config.model, max_position_embeddings=config.data.seq_len)
        self.tokenizer = ByteTokenizer()
        model = build_model(self.model_config, seed=config.train.seed)
        seed_everything(config.train.seed + self.rank)  # replaced by the saved states on resume
        self.model = parallelize(model.to(self.device), self.mesh, self.layout)
        self.optimizer, self.scheduler = build_optimizer(self.model, config.optim, config.train.steps)

        self.dataset = TokenDataset(load_corpus_tokens(), config.data.seq_len)
        self.sampler = StatefulSampler(
            len(self.dataset), self.dp_rank, self.layout.dp_size, config.data.micro_batch_size, config.data.seed
        )
        self.faults = FaultInjector.from_env(
            self.run_dir, self.rank, self.world_size, self.events.emit, config_text=config.faults
        )
        self.faults.install(self.model)

        self.checkpoints = CheckpointManager(
            self.run_dir,
            self.model,
            self.optimizer,
            {"scheduler": self.scheduler, "sampler": self.sampler},
            save_interval=config.checkpoint.save_interval,
            keep_last=config.checkpoint.keep_last,
            keep_every=config.checkpoint.keep_every,
            async_save=config.checkpoint.async_save,
            resume=config.checkpoint.resume,
            mesh_shape=list(self.layout.shape),
            mesh_dim_names=list(MESH_DIMS),
            static_files=self._write_static_files,
            events=self.events,
            after_commit=self.faults.after_commit,
            seed=config.train.seed,
        )
        self.step = 0

    def _write_static_files(self, directory: Path) -> None:
        hf_dir = directory / "huggingface"
        self.model_config.save_pretrained(hf_dir)
        self.tokenizer.save_pretrained(hf_dir)
        for path in hf_dir.iterdir():
            fsync_file(path)

    def _trainer_state(self, last_loss: float) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumed_samples": self.sampler.state_dict()["consumed_samples"],
            "lr": self.scheduler.get_last_lr()[0],
            "loss": last_loss,
            "config": config_to_dict(self.config),
        }

    # ------------------------------------------------------------------------------------- step
    def train_step(self) -> StepResult:
        cfg = self.config
        started = time.perf_counter()
        self.faults.at_step_start(self.step + 1)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for _ in range(cfg.train.micro_batches):
            inputs, labels = make_batch(self.dataset, self.sampler.next_batch_indices())
            logits = self.model(input_ids=inputs.to(self.device)).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.to(self.device).reshape(-1))
            (loss / cfg.train.micro_batches).backward()
            loss_sum += loss.detach().double().cpu() / cfg.train.micro_batches
        self.faults.after_backward(self.step + 1, self.model)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # each rank's loss counts 1/world: dp ranks hold different data, tp ranks the same loss
        norm, sums = global_norm_and_sums(grads, loss_sum.reshape(1) / self.world_size,
                                          ranks_per_stage=self.world_size)
        clip_grads_(grads, cfg.optim.grad_clip, norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return StepResult(self.step, float(sums[0]), norm, lr, time.perf_counter() - started)

    def _report(self, result: StepResult) -> None:
        cfg = self.config
        tokens = self.layout.dp_size * cfg.data.micro_batch_size * cfg.data.seq_len * cfg.train.micro_batches
        tokens_per_s = tokens / result.seconds if result.seconds > 0 else 0.0
        if result.step % cfg.train.log_interval == 0 or result.step == cfg.train.steps:
            self.log.info(
                "step: [%5d/%5d], loss: %.3f, global_norm: [%.3f], lr: %.1e, per_step_time: %dms, tokens/s: %d",
                result.step, cfg.train.steps, result.loss, result.global_norm, result.lr,
                round(result.seconds * 1000), round(tokens_per_s),
            )
        self.events.emit("step", step=result.step, loss=result.loss, global_norm=result.global_norm,
                         lr=result.lr, step_time=result.seconds, tokens_per_s=tokens_per_s)

    # -------------------------------------------------------------------------------------- run
    def run(self) -> int:
        cfg = self.config
        self.step = self.checkpoints.resume()
        total = cfg.train.steps
        stop_at = min(total, cfg.train.exit_at_step or total)
        last_loss = float("nan")
        while self.step < stop_at:
            result = self.train_step()
            last_loss = result.loss
            if self.rank == 0:
                self._report(result)
            planned_stop = self.step == stop_at < total  # always saved: the run is meant to go on later
            last = self.step == total and cfg.checkpoint.save_interval > 0
            if self.checkpoints.should_save(self.step) or planned_stop or last:
                self.checkpoints.save(self.step, self._trainer_state(last_loss))
        self.checkpoints.close()
        if self.rank == 0:
            reason = "finished" if self.step >= total else "exit_at_step"
            self.events.emit("run_finished", step=self.step, reason=reason, last_checkpoint=self.checkpoints.last_saved_step)
            self.log.info("run %s at step %d", reason, self.step)
        return 0
