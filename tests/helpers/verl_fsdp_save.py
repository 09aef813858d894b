"""Run under torchrun where verl imports (helpers/verl_env.py): writes checkpoints with verl's own
``FSDPCheckpointManager`` (FSDP2 on CPU, gloo), as verl's trainer lays them out, and beside them what
the tests compare against (rank 0, ``reference_<role>_<step>.pt``: the full model and optimizer state
gathered by torch's ``get_state_dict``, keyed by parameter name).

    OUT/global_step_1/actor    model, optimizer, extra, hf_model (huggingface/model.safetensors)
    OUT/global_step_1/critic   model, optimizer, extra (a second model, trained with its own optimizer)
    OUT/global_step_2/actor    model, optimizer, extra
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

# the reference trainer's llama-micro preset, so that the converted checkpoint resumes in it
CONFIG = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
              architectures=["LlamaForCausalLM"])


def build(seed: int, mesh):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))


def train_step(model, optimizer, scheduler, seed: int) -> None:
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def save(out: str, step: int, role: str, model, optimizer, scheduler, contents: list[str]) -> None:
    manager = FSDPCheckpointManager(model, optimizer, scheduler, checkpoint_config={"save_contents": contents})
    manager.save_checkpoint(os.path.join(out, f"global_step_{step}", role), global_step=step)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(out, f"reference_{role}_{step}.pt"))


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    actor, critic = build(0, mesh), build(1, mesh)
    for seed, role in ((10, actor), (11, critic)):
        train_step(*role, seed)
    save(out, 1, "actor", *actor, ["model", "optimizer", "extra", "hf_model"])
    save(out, 1, "critic", *critic, ["model", "optimizer", "extra"])
    train_step(*actor, 12)
    save(out, 2, "actor", *actor, ["model", "optimizer", "extra"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
