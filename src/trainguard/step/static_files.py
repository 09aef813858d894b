"""``huggingface/`` in every checkpoint: the model's config (and tokenizer), so a merge needs nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.fs.fsio import fsync_file
from trainguard.fs.layout import HF_DIR


def huggingface_files(hf_config: Any, tokenizer: Any = None) -> Callable[[Path], None]:
    """A writer of ``DIR/huggingface/`` from a ``transformers`` config (and a tokenizer with
    ``save_pretrained``), each file fsynced: checkpoints are committed only after their files are durable."""

    def write(directory: Path) -> None:
        hf_dir = Path(directory) / HF_DIR
        hf_config.save_pretrained(hf_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(hf_dir)
        for path in hf_dir.iterdir():
            fsync_file(path)

    return write
