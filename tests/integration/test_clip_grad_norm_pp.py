"""``trainguard.clip_grad_norm_`` with pipelining: every stage gets the whole model's norm, in a real
4-rank gloo group (2 pipeline stages x 2 data-parallel replicas)."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainguard
from helpers.ports import free_port

STAGES, REPLICAS = 2, 2


def stage_gradients(stage: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(stage)
    return [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]


def _worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES * REPLICAS)
    try:
        stage = rank // REPLICAS
        parameters = [torch.nn.Parameter(torch.zeros_like(g)) for g in stage_gradients(stage)]
        for parameter, grad in zip(parameters, stage_gradients(stage)):
            parameter.grad = grad.clone()
        norm = trainguard.clip_grad_norm_(parameters, max_norm=1.0, pipeline_stages=STAGES)
        results[rank] = (norm, math.sqrt(sum(float(p.grad.square().sum()) for p in parameters)))
    finally:
        dist.destroy_process_group()


def test_every_stage_gets_the_whole_models_norm_and_clips_by_it():
    port = free_port()
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(port, results), nprocs=STAGES * REPLICAS, start_method="fork")
    expected = math.sqrt(sum(float(g.square().sum()) for stage in range(STAGES) for g in stage_gradients(stage)))
    stage_norms = [math.sqrt(sum(float(g.square().sum()) for g in stage_gradients(s))) for s in range(STAGES)]
    for rank in range(STAGES * REPLICAS):
        norm, clipped = results[rank]
        assert math.isclose(norm, expected, rel_tol=1e-6), (rank, norm, expected)
        # clipped by the model's norm, not the stage's: the stage keeps its share of the whole
        assert math.isclose(clipped, stage_norms[rank // REPLICAS] / expected, rel_tol=1e-4)
