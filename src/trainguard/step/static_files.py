"""``huggingface/`` in every checkpoint: the model's config (and tokenizer), so a merge needs nothing else."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.fs.fsio import fsync_file
from trainguard.fs.layout import HF_DIR


def huggingface_files(hf_config: Any, tokenizer: Any = None) -> Callable[[Path], None]:
    """A writer of ``DIR/huggingface/`` from a ``transformers`` config (and a tokenizer with
    ``save_pretrained``), each file fsynced: checkpoints are committed only after their files are durable.
    The config states its ``architectures`` (the causal-LM class of its ``model_type`` when the config
    has none): verl's merger and ``AutoModel`` pick the model class by it."""
    config = copy.deepcopy(hf_config)
    if not getattr(config, "architectures", None):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if causal_lm is not None:
            config.architectures = [causal_lm]

    def write(directory: Path) -> None:
        hf_dir = Path(directory) / HF_DIR
        config.save_pretrained(hf_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(hf_dir)
        for path in hf_dir.iterdir():
            fsync_file(path)

    return write
