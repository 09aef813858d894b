"""A weights-only copy of a durable checkpoint (the reference's ``checkpoints-weights/`` backups):
the model's tensors, unsharded, in ``model.safetensors`` (names as in the checkpoint, without the
``model.`` prefix), the static files (``huggingface/``) and a manifest marked ``weights_only``.
It restores and loads like any checkpoint's files but cannot resume training (no optimizer state)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainguard.checkpoint.commit import seal
from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.checkpoint.manifest import Manifest, build_manifest, read_manifest
from trainguard.fs.layout import HF_DIR

WEIGHTS_FILE = "model.safetensors"
STATIC_DIRS = (HF_DIR,)


def export_weights_only(ckpt_dir: Path, out_dir: Path) -> Manifest:
    """Writes the weights-only copy of ``ckpt_dir`` into the new directory ``out_dir``."""
    source = read_manifest(ckpt_dir)
    state = read_full_state_dict(Path(ckpt_dir))  # flattened: "model.<name>", "optim.<...>"
    # Tied weights share storage, which safetensors refuses: each tensor gets its own contiguous copy.
    tensors = {key[len("model."):]: value.detach().clone().contiguous() for key, value in state.items()
               if key.startswith("model.") and isinstance(value, torch.Tensor)}
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt", "step": str(source.step)})
    for name in STATIC_DIRS:
        if (Path(ckpt_dir) / name).is_dir():
            shutil.copytree(Path(ckpt_dir) / name, out_dir / name)
    manifest = build_manifest(out_dir, step=source.step, world_size=source.world_size, mesh_shape=source.mesh_shape,
                              mesh_dim_names=source.mesh_dim_names, trainer_state=source.trainer_state,
                              health=source.health, extra={**source.extra, "weights_only": True})
    seal(out_dir, manifest)
    return manifest
