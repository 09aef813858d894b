"""The reference trainer, assembled from components: model, data, optimizer, norms, checkpoints, faults."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from trainguard.backup.attach import attach_mirror
from trainguard.fs.fsio import fsync_file
from trainguard.fs.layout import HF_DIR
from trainguard.trainer.local_tier import build_local_tier, fire_wipe_faults
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.rng_state import capture_rng_state, restore_rng_state, seed_everything
from trainguard.config.load import config_to_dict
from trainguard.config.schema import RunConfig
from trainguard.events import EventLog
from trainguard.faults import FaultInjector
from trainguard.guards.health import health_record, judge_health, marked_unhealthy
from trainguard.guards.sdc import FaultyDeviceError, faulty_ranks_path, sdc_config_from_env, write_faulty_ranks
from trainguard.guards.rollback import RollbackGuard
from trainguard.guards.skip import DataSkipAbort, DataSkipGuard, reference_abort_message, reference_log_lines
from trainguard.hf.config import build_empty_model
from trainguard.hf.init import (
    current_rss,
    load_hf_weights,
    materialize,
    peak_rss_since_reset,
    reset_peak_rss,
)
from trainguard.norms import clip_grads_, global_norm_and_sums, local_grad_norms
from trainguard.runtime.heartbeat import node_name
from trainguard.runtime.lifecycle import EXIT_CODES, REASON_NAMES, Lifecycle
from trainguard.topology.layout import MESH_DIMS, resolve_layout
from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens, make_batch
from trainguard.trainer.logging_setup import setup_logging
from trainguard.trainer.model import build_model, build_model_config
from trainguard.trainer.optim import build_optimizer
from trainguard.trainer.parallelize import build_mesh, parallelize
from trainguard.trainer.pipeline import PipelineParts, build_pipeline
from trainguard.trainer.rollback import roll_back
from trainguard.trainer.sdc_guard import FAULTY, NOTHING, REPRODUCIBLE, TRANSIENT, SdcGuard
from trainguard.trainer.tokenizer import ByteTokenizer


@dataclass
class StepResult:
    step: int
    loss: float
    global_norm: float
    lr: float
    seconds: float
    skipped: bool
    embedding_local_norm: float | None
    sample_ranges: list[tuple[int, int]] | None = None  # global sample positions trained on (rollback mode)


def _token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def _nan_as_inf(value: float) -> float:
    return math.inf if math.isnan(value) else value


class Trainer:
    def __init__(self, config: RunConfig, run_dir: Path):
        self.config = config
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.host = node_name()  # the supervisor's node name for simulated nodes, else the host name
        self.log = setup_logging(self.rank, self.run_dir / "logs")
        self.events = EventLog(self.run_dir / "events.jsonl", rank=self.rank, host=self.host)
        self.layout = resolve_layout(config.parallel, self.world_size)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        self.lifecycle = Lifecycle.for_rank(config.lifecycle, self.run_dir, self.rank, self.device)
        self.mesh = build_mesh(self.layout, self.device.type)
        self.dp_rank = self.layout.dp_rank(self.rank)

        self.model_config = build_model_config(config.model, max_position_embeddings=config.data.seq_len)
        self.tokenizer = ByteTokenizer()
        self.pipeline: PipelineParts | None = None
        # what building and loading the model adds to this rank's peak memory (reported by init_from)
        rss_before_model = reset_peak_rss() if config.model.init_from is not None else 0
        if self.layout.pp > 1:
            self.pipeline = build_pipeline(
                self.model_config, config.train.seed, self.mesh, self.layout, self.device,
                n_microbatches=config.train.micro_batches, loss_fn=_token_cross_entropy,
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
        # ranks sharing one pipeline stage (all ranks without pp) and, among them, those holding the loss
        self.ranks_per_stage = self.world_size // self.layout.pp
        self.holds_loss = self.pipeline is None or self.pipeline.is_last
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
            local=build_local_tier(config, self.run_dir, self.layout, self.model, self.events, self.faults,
                                   self._write_static_files),
        )
        attach_mirror(self.checkpoints, config.checkpoint.mirror)
        self.step = 0
        sdc_config = sdc_config_from_env(config.guards.sdc)
        self.sdc: SdcGuard | None = None
        if sdc_config.enabled:  # installed after the faults, so a point sees a fault injected at its module
            self.sdc = SdcGuard(sdc_config, self.model, config.train.micro_batches, self.device,
                                self.rank, self.host, self.log, self.events)
            self.checkpoints.stateful.update(self.sdc.stateful)
        self.skip_guard = DataSkipGuard(config.guards.skip) if config.guards.skip.enabled else None
        if self.skip_guard is not None:
            self.checkpoints.stateful["skip_guard"] = self.skip_guard
        self.rollback = RollbackGuard(config.guards.rollback, config.guards.skip) if config.guards.check_for_global_norm else None
        if self.rollback is not None:
            self.checkpoints.stateful["rollback"] = self.rollback
        self.monitor_embedding = config.guards.monitor or config.guards.health.enabled
        holds_embedding = self.pipeline is None or self.pipeline.is_first
        self.embedding = self.model.model.embed_tokens.weight if holds_embedding else None
        self.max_embedding_norm: float | None = None

    def _write_static_files(self, directory: Path) -> None:
        hf_dir = directory / HF_DIR
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
    def _draw_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [make_batch(self.dataset, self.sampler.next_batch_indices()) for _ in range(self.config.train.micro_batches)]

    def _forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Mean loss over this step's micro-batches (zero on pipeline stages without the loss)."""
        micro_batches = len(batches)
        self.optimizer.zero_grad(set_to_none=True)
        if self.sdc is not None:
            self.sdc.begin_pass()
        if self.pipeline is not None:
            inputs = torch.cat([b[0] for b in batches]).to(self.device)
            labels = torch.cat([b[1] for b in batches]).to(self.device)
            loss = self.pipeline.step(inputs, labels)
            return loss.double() if loss is not None else torch.zeros((), dtype=torch.float64, device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in batches:
            logits = self.model(input_ids=inputs.to(self.device)).logits
            loss = _token_cross_entropy(logits, labels.to(self.device))
            (loss / micro_batches).backward()
            loss_sum += loss.detach().double() / micro_batches
        return loss_sum

    def _monitored_extras(self, loss: torch.Tensor, sdc_code: int = 0) -> torch.Tensor:
        """The scalars that ride in the norm's all-reduce: the loss share, then one slot per rank for its
        embedding local norm and one for its SDC verdict, so every rank learns every rank's values
        without another collective."""
        slots = self.world_size if self.monitor_embedding else 0
        extras = torch.zeros(1 + slots + (self.world_size if self.sdc else 0), dtype=torch.float64, device=self.device)
        if self.sdc is not None:
            extras[1 + slots + self.rank] = sdc_code
        # the loss-holding ranks of a stage are its dp ranks (different data) × tp ranks (the same loss)
        if self.holds_loss:
            extras[0] = loss / self.ranks_per_stage
        if slots and self.embedding is not None and self.embedding.grad is not None:
            local = self.embedding.grad.to_local() if isinstance(self.embedding.grad, DTensor) else self.embedding.grad
            extras[1 + self.rank] = local.detach().double().norm()
        return extras

    def _reduce(self, grads: list[torch.Tensor], loss: torch.Tensor, sdc_code: int = 0):
        """One all-reduce: (global norm, loss, embedding local norms per rank, SDC codes per rank)."""
        norm, sums = global_norm_and_sums(grads, self._monitored_extras(loss, sdc_code), self.ranks_per_stage)
        slots = self.world_size if self.monitor_embedding else 0
        return norm, sums[0], sums[1:1 + slots], [int(v) for v in sums[1 + slots:]]

    def train_step(self) -> StepResult | None:
        """One optimizer step; None when a spike rolled the run back (``self.step`` is then the restored one)."""
        cfg = self.config
        started = time.perf_counter()
        step = self.step + 1
        first_sample = self.sampler.consumed_samples
        self.faults.at_step_start(step)
        rng = capture_rng_state() if self.sdc is not None else None
        batches = self._draw_batches()
        loss = self._forward_backward(batches)
        self.faults.after_backward(step, self.model)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        severity = self.sdc.check(step) if self.sdc is not None else 0
        norm, loss_value, embedding_norms, sdc_codes = self._reduce(grads, loss, severity)
        skipped = False
        if self.sdc is not None and max(sdc_codes, default=0) == 2 and self.sdc.config.recover:
            norm, loss_value, embedding_norms, skipped = self._rerun_step(step, batches, rng, loss)
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if cfg.guards.local_norm:
            self.events.emit("local_norm", step=step, norms=local_grad_norms(self.model.named_parameters()))
        lr = self.scheduler.get_last_lr()[0]
        if self.skip_guard is not None and not skipped:
            decision = self.skip_guard.decide(step, norm, opt_global_step=step - 1 - self.skip_guard.skipped_total)
            for line in reference_log_lines(decision):
                self.log.info(line)
            skipped = decision.skip
            if skipped and self.rank == 0:
                self.events.emit("data_skip", step=step, global_norm=norm, threshold=decision.threshold,
                                 consecutive=decision.consecutive, nan=decision.nan)
            if decision.abort:
                message = reference_abort_message(decision)
                self.log.error("ValueError: %s", message)
                if self.rank == 0:
                    self.events.emit("data_skip_abort", step=step, global_norm=norm, message=message)
                raise DataSkipAbort(f"ValueError: {message}")
        if self.rollback is not None and not skipped:
            spike = self.rollback.check(step, norm, loss_value)
            if spike is not None:
                roll_back(self, spike)
                return None
        if not skipped:
            clip_grads_(grads, cfg.optim.grad_clip, norm)
            self.optimizer.step()
            self.scheduler.step()
        self.step = step
        self.max_embedding_norm = max(embedding_norms, default=None, key=_nan_as_inf)
        samples = self.sampler.ranges_between(first_sample, self.sampler.consumed_samples) if self.rollback else None
        return StepResult(step, loss_value, norm, lr, time.perf_counter() - started, skipped,
                          embedding_norms[self.rank] if embedding_norms else None, samples)

    def _rerun_step(self, step: int, batches, rng, loss: torch.Tensor) -> tuple[float, float, list[float], bool]:
        """Reruns a step after a level-1 SDC detection somewhere (unless ``guards.sdc.rerun`` is off, when
        the step is skipped unverified); returns (norm, loss, embedding norms, skip). A device that has
        become faulty ends the run on every rank with exit 17."""
        reran = self.sdc.config.rerun
        if reran:
            restore_rng_state(rng)
            loss = self._forward_backward(batches)
            self.faults.after_backward(step, self.model)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        code = self.sdc.attribute(step, reran)
        norm, loss_value, embedding_norms, codes = self._reduce(grads, loss, code)
        verdict = max(codes, default=NOTHING)
        if self.rank == 0:
            self.events.emit("sdc_rerun", step=step, verdict={TRANSIENT: "transient", REPRODUCIBLE: "reproducible",
                                                             FAULTY: "faulty", NOTHING: "none"}[verdict],
                             ranks=[r for r, c in enumerate(codes) if c])
        if verdict == FAULTY:
            # saved as step N without N's update: like a skipped step, its batch is not replayed
            self.step = step
            self.max_embedding_norm = None
            self.checkpoints.save(step, self._trainer_state(float("nan")))
            self.checkpoints.close()
            faulty = [r for r, c in enumerate(codes) if c == FAULTY]
            if self.rank in faulty:
                write_faulty_ranks(faulty_ranks_path(self.run_dir), self.sdc.strikes.faulty_entries())
            dist.barrier()
            raise FaultyDeviceError(f"faulty hardware: rank(s) {faulty} reached "
                                    f"{self.sdc.config.strikes} SDC strikes; see {faulty_ranks_path(self.run_dir)}")
        return norm, loss_value, embedding_norms, verdict == REPRODUCIBLE

    def _report(self, result: StepResult) -> None:
        cfg = self.config
        tokens = self.layout.dp_size * cfg.data.micro_batch_size * cfg.data.seq_len * cfg.train.micro_batches
        tokens_per_s = tokens / result.seconds if result.seconds > 0 else 0.0
        totals = {}
        if self.skip_guard is not None:
            totals = {"skipped_total": self.skip_guard.skipped_total, "nan_total": self.skip_guard.nan_total}
        if result.step % cfg.train.log_interval == 0 or result.step == cfg.train.steps:
            line = (f"step: [{result.step:5d}/{cfg.train.steps:5d}], loss: {result.loss:.3f}, "
                    f"global_norm: [{result.global_norm:.3f}], lr: {result.lr:.1e}, "
                    f"per_step_time: {round(result.seconds * 1000)}ms, tokens/s: {round(tokens_per_s)}")
            if totals:
                line += (f", number of skipped iterations: {totals['skipped_total']}, "
                         f"number of nan iterations: {totals['nan_total']}")
            self.log.info(line)
            if result.embedding_local_norm is not None:
                self.log.info("embedding_local_norm: %s", f"{result.embedding_local_norm:.5f}")
        fields = {"embedding_local_norm": result.embedding_local_norm} if result.embedding_local_norm is not None else {}
        if result.sample_ranges is not None:
            fields["sample_ranges"] = [list(r) for r in result.sample_ranges]
        self.events.emit("step", step=result.step, loss=result.loss, global_norm=result.global_norm,
                         lr=result.lr, step_time=result.seconds, tokens_per_s=tokens_per_s,
                         skipped=result.skipped, **totals, **fields)

    def _load_init_from(self) -> None:
        """Reads this rank's slices of ``model.init_from`` into the (materialized, uninitialized) shards."""
        before_load = reset_peak_rss()
        facts = load_hf_weights(self.model, self.model_config, Path(self.config.model.init_from),
                                self.checkpoints.durable.process_group)
        held, peak = self.model_rss
        peak = max(peak, held + peak_rss_since_reset() - before_load)  # other allocations in between left out
        self.events.emit("init_from", step=0, path=str(self.config.model.init_from),
                         peak_rss_increase_bytes=peak, **facts)
        self.log.info("initial weights read from %s (%d tensors, %.2fs)", self.config.model.init_from,
                      facts["tensors"], facts["seconds"])

    def _checkpoint_health(self) -> dict[str, Any] | None:
        """The reference's health verdict for a save at this step: any rank above the threshold."""
        if not self.config.guards.health.enabled or self.max_embedding_norm is None:
            return None
        threshold = self.config.guards.health.embedding_threshold
        return health_record(judge_health(self.max_embedding_norm, threshold), self.max_embedding_norm, threshold)

    def _stop(self, reason: int, last_loss: float) -> int:
        """Saves the current step (if it is not saved yet) and returns the lifecycle's exit code."""
        why = self.lifecycle.describe(reason)
        if self.step > 0 and self.checkpoints.last_saved_step != self.step:
            self.lifecycle.beat("save", self.step)
            self.checkpoints.save(self.step, self._trainer_state(last_loss), health=self._checkpoint_health())
        self.checkpoints.close()
        code = EXIT_CODES[reason]
        self.log.warning("stopping at step %d: %s; exit %d (checkpoint: step %s)", self.step, why, code,
                         self.checkpoints.last_saved_step)
        if self.rank == 0:
            self.events.emit("lifecycle_stop", step=self.step, reason=REASON_NAMES[reason], message=why,
                             exit_code=code, last_checkpoint=self.checkpoints.last_saved_step)
        self.lifecycle.beat("exit", self.step, code)
        return code

    # -------------------------------------------------------------------------------------- run
    def run(self) -> int:
        cfg = self.config
        stop = self.lifecycle.decide()
        if stop:  # before anything is loaded: nothing to save
            return self._stop(stop, float("nan"))
        self.lifecycle.beat("resume", 0)
        self.step = self.checkpoints.resume()
        if cfg.model.init_from is not None and self.checkpoints.resumed_from is None:
            self._load_init_from()
        self.lifecycle.beat("train", self.step)
        total = cfg.train.steps
        stop_at = min(total, total if cfg.train.exit_at_step is None else cfg.train.exit_at_step)
        last_loss = float("nan")
        if self.step == stop_at == 0:  # exit_at_step=0: the initial weights as a step-0 checkpoint
            self.checkpoints.save(0, self._trainer_state(last_loss))
        while self.step < stop_at:
            stop = self.lifecycle.decide()
            if stop:
                return self._stop(stop, last_loss)
            try:
                result = self.train_step()
            except DataSkipAbort:
                self.checkpoints.close()  # the save in flight holds the last good state: let it commit
                raise
            if result is None:  # rolled back
                continue
            last_loss = result.loss
            self.lifecycle.note_step(result.seconds)
            if self.rank == 0:
                self._report(result)
            planned_stop = self.step == stop_at < total  # always saved: the run is meant to go on later
            last = self.step == total and cfg.checkpoint.save_interval > 0
            if self.checkpoints.should_save(self.step) or planned_stop or last:
                self.lifecycle.beat("save", self.step)
                self.lifecycle.note_save(
                    self.checkpoints.save(self.step, self._trainer_state(last_loss), health=self._checkpoint_health()))
            # a step judged unhealthy stays out of the local tier: auto resume prefers a local step to an
            # older durable one and would bring it back (the durable copy is kept, marked, for inspection)
            if self.checkpoints.should_save_local(self.step) and not marked_unhealthy(self._checkpoint_health()):
                self.checkpoints.save_local(self.step)
                fire_wipe_faults(self.faults, self.checkpoints.local, self.step)
            self.lifecycle.beat("step", self.step)
        self.checkpoints.close()
        if self.rank == 0:
            reason = "finished" if self.step >= total else "exit_at_step"
            self.events.emit("run_finished", step=self.step, reason=reason, last_checkpoint=self.checkpoints.last_saved_step)
            self.log.info("run %s at step %d", reason, self.step)
        self.lifecycle.beat("exit", self.step, 0)
        return 0
