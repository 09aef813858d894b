"""Pipeline parallelism (trainer/pipeline.py): global parameter names, and loss and gradients equal to the
unsharded model's, for pp=2 (2 processes) and pp=2 x dp_shard=2 (4 processes, FSDP2 per stage), gloo on CPU."""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from helpers.ports import free_port
from trainguard.config.schema import ModelConfig
from trainguard.errors import ConfigError
from trainguard.topology.layout import Layout
from trainguard.trainer.model import build_model, build_model_config
from trainguard.trainer.pipeline import build_pipeline, check_pipeline_config, split_layers

SEED = 7
SEQ_LEN = 32
MICRO_BATCH = 2
N_MICROBATCHES = 2
NUM_LAYERS = 3  # uneven over 2 stages: stage 0 gets layers 0-1, stage 1 layer 2
COLLECTIVE_TIMEOUT_S = 60  # a stuck send/recv fails the worker instead of hanging the test
WORKERS_TIMEOUT_S = 120
STEPS = 2  # the second step checks that the schedule and FSDP state are reusable after an optimizer step
LR = 0.5


def model_config(**overrides):
    params = {**dict(preset="llama-micro", num_layers=NUM_LAYERS, tie_word_embeddings=False), **overrides}
    return build_model_config(ModelConfig(**params), max_position_embeddings=SEQ_LEN)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


def batches(dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch of ``N_MICROBATCHES * MICRO_BATCH`` samples per data-parallel rank, all different."""
    from trainguard.trainer.data import TokenDataset, load_corpus_tokens, make_batch

    dataset = TokenDataset(load_corpus_tokens(), SEQ_LEN)
    per_rank = N_MICROBATCHES * MICRO_BATCH
    return [make_batch(dataset, [5 + 3 * (d * per_rank + i) for i in range(per_rank)]) for d in range(dp_size)]


def reference(dp_size: int, attn: str = "sdpa"):
    """The unsharded model, plain HF forward, ``STEPS`` steps of SGD: for each step the per-dp-rank loss (mean
    over microbatches of mean CE), the gradients (of the mean over dp ranks and microbatches, accumulated as
    the non-pipelined trainer does) and the weights the step started from."""
    model = build_model(model_config(attn_implementation=attn), seed=SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for _ in range(STEPS):
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        losses = []
        for inputs, labels in batches(dp_size):
            total = 0.0
            for mb_in, mb_lab in zip(inputs.chunk(N_MICROBATCHES), labels.chunk(N_MICROBATCHES)):
                loss = loss_fn(model(input_ids=mb_in).logits, mb_lab)
                (loss / (N_MICROBATCHES * dp_size)).backward()
                total += loss.item() / N_MICROBATCHES
            losses.append(total)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        steps.append((losses, grads, weights))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps


def _worker(rank: int, world: int, port: int, shape: dict, options: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        from torch.distributed.tensor import DTensor

        from trainguard.trainer.parallelize import build_mesh

        layout = Layout(**shape)
        mesh = build_mesh(layout, "cpu")
        extra = dict(microbatch_size=MICRO_BATCH, seq_len=SEQ_LEN) if options["static"] else {}
        parts = build_pipeline(model_config(attn_implementation=options["attn"]), SEED, mesh, layout,
                               torch.device("cpu"), N_MICROBATCHES, loss_fn, schedule=options["schedule"], **extra)
        assert type(parts.schedule).__name__ == {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}[options["schedule"]]
        coords = layout.coordinates(rank)
        assert parts.stage_index == coords["pp"]
        assert parts.is_first == (coords["pp"] == 0) and parts.is_last == (coords["pp"] == layout.pp - 1)

        expected_steps = reference(layout.dp_size, options["attn"])
        full_names = set(expected_steps[0][1])

        # (a) global names on every stage; the union over stages is the full model
        names = [name for name, _ in parts.module.named_parameters()]
        assert set(names) <= full_names, sorted(set(names) - full_names)
        assert set(parts.module.state_dict()) == set(names)
        expected_layers = list(split_layers(NUM_LAYERS, layout.pp)[parts.stage_index])
        assert parts.layer_ids == expected_layers
        assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {str(i) for i in expected_layers}
        assert ("model.embed_tokens.weight" in names) == parts.is_first
        assert ("lm_head.weight" in names) == parts.is_last and ("model.norm.weight" in names) == parts.is_last
        everyone: list = [None] * world
        dist.all_gather_object(everyone, names)
        assert set().union(*everyone) == full_names

        inputs, labels = batches(layout.dp_size)[layout.dp_rank(rank)]
        optimizer = torch.optim.SGD(parts.module.parameters(), lr=LR)
        for step, (ref_losses, ref_grads, ref_weights) in enumerate(expected_steps, start=1):
            # the weights the step starts from: the same init as pp=1, then the same updates
            for name, param in parts.module.named_parameters():
                torch.testing.assert_close(param.detach().full_tensor(), ref_weights[name], rtol=1e-5,
                                           atol=1e-6, msg=lambda m, n=name, s=step: f"step {s} weight {n}: {m}")

            # (b) the loss equals the unsharded model's
            loss = parts.step(inputs, labels)
            if parts.is_last:
                expected = ref_losses[layout.dp_rank(rank)]
                assert loss is not None and loss.dim() == 0 and not loss.requires_grad
                assert abs(loss.item() - expected) <= 1e-5 * abs(expected), (step, loss.item(), expected)
            else:
                assert loss is None

            # (c) gradients of owned parameters equal the unsharded model's
            for name, param in parts.module.named_parameters():
                assert isinstance(param, DTensor) and isinstance(param.grad, DTensor), name
                ref = ref_grads[name]
                torch.testing.assert_close(param.grad.full_tensor(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                                           msg=lambda m, n=name, s=step: f"step {s} grad {n}: {m}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "shape, options",
    [
        # torch infers the stage shapes on the first step (one extra forward/backward, discarded)
        (dict(pp=2), dict(static=False, schedule="1f1b", attn="sdpa")),
        # FSDP2 over dp_shard inside each stage; shapes given up front
        (dict(pp=2, dp_shard=2), dict(static=True, schedule="gpipe", attn="sdpa")),
        # HSDP mesh (dp_replicate x dp_shard) per stage; eager attention takes the materialized causal mask
        (dict(pp=2, dp_replicate=2), dict(static=True, schedule="1f1b", attn="eager")),
    ],
    ids=["pp2-1f1b", "pp2-dp_shard2-gpipe", "pp2-dp_replicate2-eager"],
)
def test_pipeline_matches_unsharded_model(shape, options):
    world = Layout(**shape).world_size
    # A fork server that imported torch and transformers once starts the workers in well under a second
    # each (spawn re-imports everything in every process: ~6 s each on two busy cores).
    multiprocessing.set_forkserver_preload(["torch", "transformers", "trainguard.trainer.pipeline",
                                            "trainguard.trainer.data"])
    context = mp.start_processes(_worker, args=(world, free_port(), shape, options), nprocs=world, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    while not context.join(timeout=1):  # raises with the worker's traceback if one failed
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"pipeline workers did not finish in {WORKERS_TIMEOUT_S}s")


def test_split_layers_is_even_and_earlier_stages_take_the_remainder():
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ConfigError, match="at least as many layers"):
        split_layers(2, 3)


def test_refused_configurations_are_one_clear_error():
    with pytest.raises(ConfigError, match=r"parallel.pp > 1 needs model.tie_word_embeddings=false"):
        check_pipeline_config(model_config(tie_word_embeddings=True), Layout(pp=2))
    with pytest.raises(ConfigError, match="tp > 1"):
        check_pipeline_config(model_config(), Layout(pp=2, tp=2))
    with pytest.raises(ConfigError, match="parallel.pp > 1 needs model.tie_word_embeddings=false"):
        build_pipeline(model_config(tie_word_embeddings=True), SEED, None, Layout(pp=2), torch.device("cpu"),
                       N_MICROBATCHES, loss_fn)
    check_pipeline_config(model_config(tie_word_embeddings=True), Layout())  # one stage: tied is fine
