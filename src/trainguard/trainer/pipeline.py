"""Pipeline parallelism for the reference trainer (``torch.distributed.pipelining``), with FSDP2/HSDP per stage.

How a stage is built (the torchtitan approach):

1. every rank builds the *full* Hugging Face model on the CPU from the same seed (``build_model``), so the
   initial weights are bit-identical to a run without pipelining, whatever the layout;
2. each rank keeps only what its stage owns and drops the rest: ``model.layers`` (a ``ModuleList``) becomes
   a ``ModuleDict`` keyed by the original layer indices (``"3"``, ``"4"``...), the embedding lives on stage 0
   only, the final norm and ``lm_head`` on the last stage only (``None`` elsewhere). Parameter names are
   therefore the model's *global* names on every stage (``model.layers.17.mlp.up_proj.weight`` on
   whichever stage holds layer 17), exactly those of ``LlamaForCausalLM.named_parameters()``; the union
   over stages is the full model. Checkpoints written per stage merge by name;
3. the pruned model is wrapped in :class:`PipelineStageModule` (its own forward: embedding if owned, rotary
   position embeddings, the owned decoder layers called as Hugging Face calls them, norm + head if owned),
   sharded with FSDP2 over this stage's data-parallel mesh (``dp_shard``, or ``dp_replicate x dp_shard``
   for HSDP), and handed to a :class:`~torch.distributed.pipelining.PipelineStage` whose point-to-point
   traffic uses the ``pp`` sub-mesh's process group.

Layer split: ``L`` layers over ``P`` stages, stage ``s`` gets ``L // P`` layers plus one more when
``s < L % P`` (earlier stages take the remainder), contiguous and in order (:func:`split_layers`).

Loss and gradient scale: ``loss_fn(logits, labels)`` returns the mean cross-entropy of one microbatch; the
schedule runs a backward per microbatch and (``scale_grads=True``) divides the accumulated gradients by
``n_microbatches`` once at the end, after FSDP's reduce-scatter (which averages over the data-parallel
ranks). The gradients are those of ``mean over microbatches (and dp ranks) of per-microbatch mean CE``,
the same as the non-pipelined trainer's ``(loss / micro_batches).backward()`` accumulation.

Refused (``ConfigError``): ``pp > 1`` with tied input/output embeddings (the embedding and the head sit on
different stages; set ``model.tie_word_embeddings=false``), ``pp > 1`` with ``tp > 1`` (not supported
yet), more stages than layers, and a model type the stages are not built for (GPT-2: ``hf.model_types``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from transformers import PretrainedConfig

from trainguard.errors import ConfigError
from trainguard.hf.model_types import check_parallel_support
from trainguard.topology.layout import Layout
from trainguard.trainer.model import build_model
from trainguard.trainer.gradient_average import ensure_gradient_average
from trainguard.trainer.parallelize import data_parallel_mesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

__all__ = [
    "PipelineParts",
    "PipelineStageModule",
    "SCHEDULES",
    "build_pipeline",
    "check_pipeline_config",
    "prune_to_stage",
    "split_layers",
]


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges per stage, as even as possible; earlier stages take the remainder."""
    if num_stages < 1:
        raise ConfigError(f"impossible parallel layout: parallel.pp={num_stages} must be >= 1")
    if num_layers < num_stages:
        raise ConfigError(
            f"impossible parallel layout: parallel.pp={num_stages} stages need at least as many layers, "
            f"the model has model.num_layers={num_layers}"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def check_pipeline_config(model_config: PretrainedConfig, layout: Layout) -> None:
    """Raises ``ConfigError`` for what pipelining cannot do (pure: no mesh, no model needed)."""
    if layout.pp <= 1:
        return
    check_parallel_support(model_config.model_type, {"pp": layout.pp})
    if getattr(model_config, "tie_word_embeddings", False):
        raise ConfigError(
            "parallel.pp > 1 needs model.tie_word_embeddings=false: the embedding (first stage) and the "
            "output head (last stage) cannot share one weight across pipeline stages"
        )
    if layout.tp > 1:
        raise ConfigError("parallel.pp > 1 together with parallel.tp > 1 is not supported yet")
    split_layers(model_config.num_hidden_layers, layout.pp)


def prune_to_stage(model: nn.Module, stage_index: int, num_stages: int) -> list[int]:
    """Deletes in place what stage ``stage_index`` does not own; returns the global indices of its layers.

    ``model`` is a full ``LlamaForCausalLM``-like model (``model.model.{embed_tokens,layers,norm,rotary_emb}``
    and ``model.lm_head``). Kept parameters keep their global names.
    """
    inner = model.model
    owned = list(split_layers(len(inner.layers), num_stages)[stage_index])
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in owned})
    if stage_index != 0:
        inner.embed_tokens = None
    if stage_index != num_stages - 1:
        inner.norm = None
        model.lm_head = None
    return owned


@functools.cache
def _no_cache_argument() -> dict[str, None]:
    """``create_causal_mask``'s "no KV cache" argument: transformers renamed ``past_key_values`` to ``cache``
    within 5.x and warns on the old name on every call (a FutureWarning from every rank at every step)."""
    from transformers.masking_utils import create_causal_mask

    name = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    return {name: None}


class PipelineStageModule(nn.Module):
    """One stage of a pruned Hugging Face causal LM.

    Holds the pruned model's ``model`` and ``lm_head`` under those attribute names, so that its parameter
    and state-dict keys are the model's global names. ``forward`` takes ``input_ids`` [B, T] on the first
    stage and hidden states [B, T, H] elsewhere; it returns hidden states, or logits [B, T, V] on the last
    stage. Attention is causal, positions are ``0..T-1`` (no padding mask: the trainer's samples are full).
    """

    def __init__(self, pruned: nn.Module, stage_index: int, num_stages: int, layer_ids: list[int]):
        super().__init__()
        self.config = pruned.config
        self.model = pruned.model
        self.lm_head = pruned.lm_head
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_ids = list(layer_ids)

    def get_input_embeddings(self) -> nn.Module | None:
        """The input embedding, as a Hugging Face model answers it (None on the stages after the first)."""
        return self.model.embed_tokens

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        inner = self.model
        hidden = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # None for sdpa (its is_causal path); a materialized causal mask for eager and others.
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, position_ids=position_ids,
            **_no_cache_argument(),
        )
        position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
        for layer in inner.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                           position_embeddings=position_embeddings)
        if inner.norm is not None:
            hidden = inner.norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden


@dataclass
class PipelineParts:
    """This rank's share of the pipeline: its stage module, the schedule that drives it, and where it sits."""

    module: nn.Module
    schedule: ScheduleGPipe | Schedule1F1B
    stage: PipelineStage
    is_first: bool
    is_last: bool
    stage_index: int
    num_stages: int
    n_microbatches: int
    layer_ids: list[int] = field(default_factory=list)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch ``[n_microbatches * micro_batch_size, seq_len]`` through the
        schedule. Gradients are accumulated into ``module``'s parameters (zero them before, as usual).

        Returns the mean of the per-microbatch losses (detached scalar) on the last stage, None elsewhere.
        Call it on every rank of the pipeline with this data-parallel rank's batch (only the first stage
        reads ``input_ids`` and only the last ``labels``).
        """
        if input_ids.shape[0] % self.n_microbatches:
            raise ConfigError(
                f"batch of {input_ids.shape[0]} samples does not split into {self.n_microbatches} microbatches"
            )
        device = self.stage.device
        args = (input_ids.to(device),) if self.is_first else ()
        if self.is_last:
            losses: list[torch.Tensor] = []
            self.schedule.step(*args, target=labels.to(device), losses=losses, return_outputs=False)
            return torch.stack([loss.detach() for loss in losses]).mean()
        self.schedule.step(*args, return_outputs=False)
        return None


def build_pipeline(
    model_config: PretrainedConfig,
    seed: int,
    mesh: DeviceMesh,
    layout: Layout,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    schedule: str | None = None,
    microbatch_size: int | None = None,
    seq_len: int | None = None,
    reshard_after_forward: bool | None = None,
    empty: bool = False,
) -> PipelineParts:
    """Builds this rank's pipeline stage (FSDP2/HSDP-sharded) and its schedule.

    ``model_config`` is the Hugging Face config (``build_model_config``); ``mesh`` has the dims
    ``("pp", "dp_replicate", "dp_shard", "tp")`` (``build_mesh``). ``schedule``: ``"1f1b"`` or ``"gpipe"``;
    by default 1F1B when ``n_microbatches >= pp`` (less activation memory), else GPipe.
    ``microbatch_size`` and ``seq_len``, when both given, describe every stage's inputs and outputs
    up front (static metadata); otherwise torch infers them on the first ``step`` by running one extra
    forward and backward of microbatch 0 (its gradients are discarded). ``reshard_after_forward``
    defaults to False with pp > 1 (as torchtitan: no all-gather per microbatch; the stage's parameters
    stay unsharded from the first forward to the end of the step's backward). ``empty``: build on the
    ``meta`` device and allocate only this rank's shards, uninitialized (the caller loads the weights,
    e.g. ``trainguard.hf.init.load_hf_weights``), instead of initializing the full model from ``seed``.
    """
    check_pipeline_config(model_config, layout)
    if n_microbatches < 1:
        raise ConfigError(f"n_microbatches must be >= 1, got {n_microbatches}")
    num_stages = layout.pp
    name = schedule or ("1f1b" if n_microbatches >= num_stages else "gpipe")
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "1f1b" and n_microbatches < num_stages:
        raise ConfigError(f"the 1f1b schedule needs n_microbatches >= pp, got {n_microbatches} < {num_stages}")

    pp_mesh = mesh["pp"]
    stage_index = pp_mesh.get_local_rank()
    if empty:
        from trainguard.hf.config import build_empty_model

        model = build_empty_model(model_config)
    else:
        model = build_model(model_config, seed=seed)  # full model, same init as pp=1
    layer_ids = prune_to_stage(model, stage_index, num_stages)
    module = PipelineStageModule(model, stage_index, num_stages, layer_ids)
    if not empty:
        module = module.to(device)

    dp_mesh = data_parallel_mesh(mesh, layout)
    reshard = (num_stages == 1) if reshard_after_forward is None else reshard_after_forward
    for layer in module.model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard)
    ensure_gradient_average(module, dp_mesh)
    if empty:
        from trainguard.hf.init import materialize

        materialize(module, device, model)

    input_args = output_args = None
    if microbatch_size is not None and seq_len is not None:
        # Shapes only (meta tensors); requires_grad says which tensors carry gradients back.
        dtype = next(module.parameters()).dtype

        def meta(*shape: int, grad: bool = True, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=kind, device="meta").requires_grad_(grad)

        hidden = (microbatch_size, seq_len, model_config.hidden_size)
        input_args = meta(microbatch_size, seq_len, grad=False, kind=torch.long) if stage_index == 0 else meta(*hidden)
        output_args = (meta(microbatch_size, seq_len, model_config.vocab_size)
                       if stage_index == num_stages - 1 else meta(*hidden))

    stage = PipelineStage(module, stage_index, num_stages, device, input_args=input_args,
                          output_args=output_args, group=pp_mesh.get_group())
    sched = SCHEDULES[name](stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return PipelineParts(
        module=module, schedule=sched, stage=stage, is_first=stage_index == 0,
        is_last=stage_index == num_stages - 1, stage_index=stage_index, num_stages=num_stages,
        n_microbatches=n_microbatches, layer_ids=layer_ids,
    )
