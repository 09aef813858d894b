"""torchtitan's own ``Trainer`` (torchtitan 0.2.x, CUDA) under trainguard: ``GuardedTrainer`` instead of ``Trainer``.

    trainguard run --max-restarts 3 -- torchrun --standalone --nproc-per-node 1 examples/torchtitan_trainer.py \\
        --run-dir runs/titan --steps 20 [--set checkpoint.save_interval=5] [torchtitan flags ...]
    python examples/torchtitan_trainer.py --probe        # the imports only: versions, what is missing

Nothing is downloaded: the model is torchtitan's Llama 3 (its ``TrainSpec`` for ``llama3``, a tiny flavour
of its ``debugmodel``'s shape), the tokenizer torchtitan's ``HuggingFaceTokenizer`` reading the files of
trainguard's byte tokenizer (``ByteTokenizer.save_pretrained`` into ``RUN_DIR/tokenizer``), the data
windows of trainguard's shipped corpus through torchtitan's ``ParallelAwareDataloader``. The run
directory is torchtitan's ``job.dump_folder`` and trainguard's run directory. Run it again after a kill
and it continues from trainguard's newest verified checkpoint, bitwise as if it had never stopped
(``debug.deterministic``, a fixed ``debug.seed``, and SDPA's math kernel, whose backward is deterministic).
``--set`` takes trainguard's keys; any other flag is torchtitan's (``--training.local_batch_size 8``, ...).

torchtitan imports ``datasets`` when it starts (``torchtitan/hf_datasets/text_datasets.py``) although
this run reads no Hugging Face data set; where ``datasets`` is not installed (it needs pyarrow, 40 MB and
more), a placeholder module stands in whose loaders say so when called.
"""

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import types
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

PROBED = ("datasets", "pyarrow", "tensorboard", "tyro", "torchdata", "triton", "wandb")


def datasets_placeholder() -> dict[str, types.ModuleType]:
    """Modules ``datasets`` and ``datasets.distributed`` for torchtitan's imports where the package is
    missing: what torchtitan names exists, and calling a loader raises ImportError naming the package."""

    def missing(*_args, **_kwargs):
        raise ImportError("Hugging Face data sets need the `datasets` package (pip install datasets)")

    package = types.ModuleType("datasets")
    package.Dataset = type("Dataset", (), {})
    package.IterableDataset = type("IterableDataset", (), {})
    package.load_dataset = missing
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = missing
    package.distributed = distributed
    return {"datasets": package, "datasets.distributed": distributed}


def register_datasets_placeholder() -> None:
    """``datasets_placeholder()`` in ``sys.modules``, unless ``datasets`` is installed or already imported."""
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        sys.modules.update(datasets_placeholder())


class CorpusWindows(IterableDataset):
    """Windows of ``seq_len + 1`` tokens of trainguard's shipped corpus (bytes, eos between documents):
    this data-parallel rank's every ``dp_world_size``-th, looping. Its state is the count it yielded."""

    def __init__(self, seq_len: int, dp_rank: int, dp_world_size: int):
        from trainguard.trainer.data import load_corpus_tokens

        self.tokens, self.seq_len = load_corpus_tokens(), seq_len
        self.windows = (len(self.tokens) - 1) // seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.yielded = 0

    def __iter__(self):
        while True:
            start = (self.yielded * self.dp_world_size + self.dp_rank) % self.windows * self.seq_len
            window = self.tokens[start:start + self.seq_len + 1]
            self.yielded += 1
            yield {"input": window[:-1]}, window[1:]

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.yielded = state["yielded"]


def build_corpus_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config):
    """torchtitan's ``build_dataloader_fn`` over ``CorpusWindows`` (the tokenizer is not needed: the
    corpus is stored as byte ids, which the byte tokenizer's ids are)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    dataset = CorpusWindows(job_config.training.seq_len, dp_rank, dp_world_size)
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=job_config.training.local_batch_size)


def register_train_spec() -> str:
    """torchtitan's ``llama3`` TrainSpec with a tiny flavour and the corpus data loader, as ``trainguard_llama3``."""
    from torchtitan.models import llama3
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper
    from torchtitan.protocols.train_spec import register_train_spec as register
    from torch.nn.attention import SDPBackend

    from trainguard.trainer.tokenizer import ByteTokenizer

    # SDPA's math kernel: cuDNN's and flash's backward are not guaranteed deterministic, and the bitwise
    # resume check compares two runs
    ScaledDotProductAttentionWrapper.sdpa_backends = [SDPBackend.MATH]
    tiny = llama3.TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=ByteTokenizer().vocab_size,
                                       rope_theta=500000)
    register("trainguard_llama3", dataclasses.replace(
        llama3.get_train_spec(), model_args={"tiny": tiny}, build_dataloader_fn=build_corpus_dataloader,
        build_validator_fn=None))
    return "trainguard_llama3"


def write_tokenizer(run_dir: Path) -> Path:
    """trainguard's byte tokenizer files in ``run_dir/tokenizer`` (every rank may call it: written aside, renamed)."""
    from trainguard.trainer.tokenizer import ByteTokenizer

    target = run_dir / "tokenizer"
    if not target.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(dir=run_dir, prefix=".tokenizer-"))
        ByteTokenizer().save_pretrained(aside)
        try:
            aside.rename(target)
        except OSError:  # another rank's is there
            for item in aside.iterdir():
                item.unlink()
            aside.rmdir()
    return target


def probe() -> None:
    """Versions and what imports: the check that a machine can run this example."""
    found = {name: importlib.util.find_spec(name) is not None for name in PROBED}
    register_datasets_placeholder()
    import torchtitan
    import torchtitan.train  # noqa: F401  (what fails here fails the run)

    print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda} "
          f"available {torch.cuda.is_available()} torchtitan {getattr(torchtitan, '__version__', '?')} "
          f"from {Path(torchtitan.__file__).parent}")
    print("installed: " + " ".join(f"{name}={'yes' if ok else 'no'}" for name, ok in found.items()))
    register_train_spec()
    from trainguard.integrations.torchtitan_trainer import GuardedTrainer  # noqa: F401

    print("probe ok: torchtitan.train, the TrainSpec and GuardedTrainer import")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)  # the rest: torchtitan's
    parser.add_argument("--run-dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="trainguard key=value")
    parser.add_argument("--config", help="trainguard's guard.yaml")
    parser.add_argument("--probe", action="store_true", help="check the imports and exit")
    args, titan_flags = parser.parse_known_args()
    if args.probe:
        probe()
        return
    if not args.run_dir:
        parser.error("--run-dir is required")
    register_datasets_placeholder()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from trainguard.integrations.torchtitan_trainer import GuardedTrainer

    init_logger()
    run_dir = Path(args.run_dir).resolve()
    job_config = ConfigManager().parse_args([
        "--model.name", register_train_spec(), "--model.flavor", "tiny",
        "--model.hf_assets_path", str(write_tokenizer(run_dir)), "--job.dump_folder", str(run_dir),
        "--training.steps", str(args.steps), "--training.local_batch_size", "4", "--training.seq_len", "64",
        "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", "none",
        "--debug.seed", "0", "--debug.deterministic", *titan_flags])
    trainer = GuardedTrainer(job_config, guard_config=args.config, guard_overrides=args.overrides)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    raise SystemExit(trainer.exit_code)


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, as debug.deterministic asks
    main()
