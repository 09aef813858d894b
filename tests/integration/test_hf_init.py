"""Starting from Hugging Face weights (trainguard.hf): ``model.init_from`` on every layout (each rank reads
only its slices), ``hf_to_durable``, pipeline checkpoints under global names, and bad input.

Real runs of ``trainguard train`` (gloo, CPU). Source models are random Llama models written with
``save_pretrained`` in float32, so every comparison with the source is bitwise."""

from __future__ import annotations

import json
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers.ports import free_port
from helpers.runs import TINY, assert_same_tensors, events, flat_state, ok, read_json, train, trainguard
from trainguard.checkpoint.manifest import verify_checkpoint
from trainguard.config import load_config
from trainguard.errors import ConfigError

SEQ_LEN, MICRO_BATCH = 32, 2  # as conftest.TINY


def write_hf_model(path: Path, *, tied: bool, shard: str | None = None, seed: int = 3, **arch) -> Path:
    params = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=160, vocab_size=320, max_position_embeddings=64)
    params.update(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(tie_word_embeddings=tied, **params), dtype=torch.float32)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return path


def source_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def model_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a durable checkpoint, under their Hugging Face names."""
    return {key[len("model."):]: value for key, value in flat_state(ckpt).items() if key.startswith("model.")}


def reference_loss(hf_dir: Path, dp_size: int, micro_batches: int) -> float:
    """The first step's loss computed by plain transformers on the source model: the mean over data-parallel
    ranks and micro-batches of the mean cross-entropy, on the batches the trainer's sampler draws first."""
    from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens, make_batch

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    dataset = TokenDataset(load_corpus_tokens(), SEQ_LEN)
    losses = []
    for rank in range(dp_size):
        sampler = StatefulSampler(len(dataset), rank, dp_size, MICRO_BATCH, seed=1234)
        for _ in range(micro_batches):
            inputs, labels = make_batch(dataset, sampler.next_batch_indices())
            with torch.no_grad():
                logits = model(input_ids=inputs).logits
            losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)).item())
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "tied": write_hf_model(root / "tied", tied=True),  # one model.safetensors
        "untied": write_hf_model(root / "untied", tied=False, shard="60KB", seed=4),  # index + many shards
    }


LAYOUTS = {  # name: (ranks, source, extra args)
    "fsdp2": (2, "tied", []),
    "hsdp": (4, "tied", ["--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=2"]),
    "tp": (2, "tied", ["--set", "parallel.tp=2"]),
    "pp": (2, "untied", ["--set", "parallel.pp=2", "--set", "train.micro_batches=2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_each_layout_is_bitwise(tmp_path, hf_dirs, layout):
    """HF dir -> 0 steps on the layout -> its step-0 checkpoint holds the source tensors, bitwise, under the
    source's names (the pipeline's stages keep global names), and nothing else."""
    nproc, source, extra = LAYOUTS[layout]
    run = tmp_path / "run"
    ok(train(run, nproc, 3, "--set", f"model.init_from={hf_dirs[source]}", "--set", "train.exit_at_step=0", *extra))
    ckpt = run / "checkpoints" / "global_step_0"
    assert verify_checkpoint(ckpt) == []
    saved, expected = model_tensors(ckpt), source_tensors(hf_dirs[source])
    if source == "tied":
        assert torch.equal(saved.pop("lm_head.weight"), expected["model.embed_tokens.weight"])
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[name], expected[name]) for name in expected)
    assert not any(key.startswith("optim.") for key in flat_state(ckpt))  # no optimizer step, no optimizer state
    loads = events(run, "init_from")
    assert sorted(e["rank"] for e in loads) == list(range(nproc))


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory, hf_dirs) -> Path:
    """pp=2 from the untied source: one step, checkpoint at step 1 in both tiers."""
    run = tmp_path_factory.mktemp("pp") / "run"
    ok(train(run, 2, 1, "--set", f"model.init_from={hf_dirs['untied']}", "--set", "checkpoint.local_interval=1",
             *LAYOUTS["pp"][2]))
    return run


def test_first_step_loss_equals_transformers_pp(pp_run, hf_dirs):
    (step,) = events(pp_run, "step")
    expected = reference_loss(hf_dirs["untied"], dp_size=1, micro_batches=2)
    assert abs(step["loss"] - expected) <= 1e-5 * abs(expected), (step["loss"], expected)


def test_converted_checkpoint_resumes_like_init_from(tmp_path, pp_run, hf_dirs):
    """hf_to_durable -> a committed step-0 checkpoint with the source tensors; a pp=2 run resuming from it
    trains exactly as the run that started with model.init_from (loss and step-1 checkpoint bitwise)."""
    from trainguard.hf.convert import hf_to_durable

    target = tmp_path / "converted"
    hf_to_durable(hf_dirs["untied"], target)
    ckpt = target / "checkpoints" / "global_step_0"
    assert verify_checkpoint(ckpt) == []
    assert (target / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    saved, expected = model_tensors(ckpt), source_tensors(hf_dirs["untied"])
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)
    assert read_json(ckpt / "huggingface" / "config.json")["hidden_size"] == 64

    ok(train(target, 2, 1, "--set", f"model.init_from={hf_dirs['untied']}", *LAYOUTS["pp"][2]))
    (started,) = events(target, "run_started")
    assert started["resumed_from"] == str(ckpt)
    assert not events(target, "init_from")  # resume wins over init_from
    assert events(target, "step")[0]["loss"] == events(pp_run, "step")[0]["loss"]
    assert_same_tensors(target / "checkpoints" / "global_step_1", pp_run / "checkpoints" / "global_step_1")

    with pytest.raises(ConfigError, match="already exists"):
        hf_to_durable(hf_dirs["untied"], target)


def test_cli_convert_from_hf_then_resume_on_another_layout(tmp_path, hf_dirs):
    """``trainguard ckpt convert --from-hf`` as users run it, then ``trainguard train --resume`` on tp=2:
    the first step's loss is transformers' on the source model; converting again is refused."""
    target = tmp_path / "converted"
    proc = ok(trainguard("ckpt", "convert", "--from-hf", str(hf_dirs["untied"]), "--to", str(target)))
    ckpt = target / "checkpoints" / "global_step_0"
    assert f"into {target}" in proc.stdout and verify_checkpoint(ckpt) == []
    run = tmp_path / "run"
    ok(train(run, 2, 1, "--resume", str(ckpt), "--set", f"model.init_from={hf_dirs['untied']}",
             "--set", "parallel.tp=2"))
    (started,) = events(run, "run_started")
    assert started["resumed_from"] == str(ckpt) and not events(run, "init_from")
    (step,) = events(run, "step")
    expected = reference_loss(hf_dirs["untied"], dp_size=1, micro_batches=1)
    assert abs(step["loss"] - expected) <= 1e-5 * abs(expected), (step["loss"], expected)
    before = sorted(p.name for p in ckpt.iterdir())
    again = trainguard("ckpt", "convert", "--from-hf", str(hf_dirs["untied"]), "--to", str(target))
    assert again.returncode == 2 and "already exists" in again.stderr and len(again.stderr.splitlines()) == 1
    assert sorted(p.name for p in ckpt.iterdir()) == before


# ------------------------------------------------------------------------- pp=2 -> pp=1, and transformers
def _resume_worker(rank: int, world: int, port: int, args: dict) -> None:
    """A Trainer of layout pp=1 (dp_shard=world) restores the pp=2 checkpoint and saves it again as its own;
    rank 0 also writes the restored model's logits for a fixed input."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from trainguard.trainer.loop import Trainer

        config = load_config(None, [*args["overrides"], f"checkpoint.resume={args['resume']}",
                                    "checkpoint.async_save=false"])
        trainer = Trainer(config, Path(args["run_dir"]))
        checkpoints = trainer.guard.checkpoints
        step = trainer.guard.resume()
        checkpoints.save_durable(step, trainer.guard.trainer_state())
        checkpoints.close()
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor(args["input_ids"])).logits
        if rank == 0:
            torch.save(logits, Path(args["run_dir"]) / "logits.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_pp2_checkpoint_resumes_bitwise_on_pp1_and_loads_in_transformers(tmp_path, pp_run, hf_dirs):
    source_ckpt = pp_run / "checkpoints" / "global_step_1"
    run_dir = tmp_path / "pp1"
    overrides = [item for item in TINY if item != "--set"]
    overrides += [f"model.init_from={hf_dirs['untied']}", "parallel.dp_shard=2", "train.steps=1"]
    input_ids = [[5, 17, 200, 33, 99, 4, 250, 12]]
    args = dict(overrides=overrides, resume=str(source_ckpt), run_dir=str(run_dir), input_ids=input_ids)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    workers = [ctx.Process(target=_resume_worker, args=(rank, 2, port, args)) for rank in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=240)
    assert [w.exitcode for w in workers] == [0, 0]

    # pp=2 -> pp=1: model and optimizer state restored bitwise (same names, resharded)
    assert assert_same_tensors(source_ckpt, run_dir / "checkpoints" / "global_step_1") > 0

    # the pp=2 checkpoint is a Hugging Face model: same names and shapes, strict load, the trained logits
    trained = model_tensors(source_ckpt)
    source = source_tensors(hf_dirs["untied"])
    assert {k: v.shape for k, v in trained.items()} == {k: v.shape for k, v in source.items()}
    model = AutoModelForCausalLM.from_pretrained(hf_dirs["untied"], dtype=torch.float32)
    with torch.no_grad():
        before = model(input_ids=torch.tensor(input_ids)).logits
        model.load_state_dict(trained, strict=True)
        after = model(input_ids=torch.tensor(input_ids)).logits
    restored = torch.load(run_dir / "logits.pt", weights_only=True)
    torch.testing.assert_close(after, restored, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(before, after)  # one step of training did change the model


def test_pp2_checkpoints_merge_into_the_trained_transformers_model(tmp_path, pp_run, hf_dirs):
    """Issue #10: a pp=2 run's durable checkpoint and its local-tier step (each stage's ranks hold only
    their layers) merge with ``trainguard ckpt merge`` into a directory ``from_pretrained`` loads, whose
    logits are the trained model's (the source architecture with the checkpoint's tensors read via DCP)."""
    ckpt = pp_run / "checkpoints" / "global_step_1"
    input_ids = torch.tensor([[5, 17, 200, 33, 99, 4, 250, 12]])
    model = AutoModelForCausalLM.from_pretrained(hf_dirs["untied"], dtype=torch.float32)
    model.load_state_dict(model_tensors(ckpt), strict=True)
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    for name, source in {"durable": ckpt, "local": pp_run / "local" / "node0" / "global_step_1"}.items():
        target = tmp_path / name
        ok(trainguard("ckpt", "merge", "--local_dir", str(source), "--target_dir", str(target)))
        assert "lm_head.weight" in load_file(target / "model.safetensors")  # untied: the stages' own head
        merged = AutoModelForCausalLM.from_pretrained(target)
        with torch.no_grad():
            assert torch.equal(merged(input_ids=input_ids).logits, expected), name


# ---------------------------------------------------------------------------------- memory on 4 ranks
def test_four_ranks_each_read_a_quarter_and_first_loss_matches(tmp_path):
    """A 140 MB model on 4 FSDP2 ranks: each rank's peak memory grows by well under the model's size
    (its quarter of the parameters plus what it is reading), and the first step's loss is transformers'."""
    hf_dir = write_hf_model(tmp_path / "big", tied=False, shard="40MB", hidden_size=1024, num_hidden_layers=3,
                            num_attention_heads=16, num_key_value_heads=4, intermediate_size=2048, vocab_size=4096)
    model_bytes = sum(t.numel() * 4 for t in source_tensors(hf_dir).values())
    assert model_bytes > 130e6
    run = tmp_path / "run"
    ok(train(run, 4, 1, "--set", f"model.init_from={hf_dir}", "--set", "parallel.dp_shard=4", "--save-interval", "0",
             timeout=400))
    loads = events(run, "init_from")
    assert sorted(e["rank"] for e in loads) == [0, 1, 2, 3]
    for load in loads:
        # holding a quarter is unavoidable (>= 0.2 proves the measurement sees it); a full copy would be >= 1
        assert 0.2 * model_bytes < load["peak_rss_increase_bytes"] < 0.5 * model_bytes, (load, model_bytes)
    print(f"model {model_bytes / 1e6:.0f} MB; peak RSS increase per rank (MB): "
          f"{[round(e['peak_rss_increase_bytes'] / 1e6) for e in sorted(loads, key=lambda e: e['rank'])]}")
    (step,) = events(run, "step")
    expected = reference_loss(hf_dir, dp_size=4, micro_batches=1)
    assert abs(step["loss"] - expected) <= 1e-5 * abs(expected), (step["loss"], expected)


# ------------------------------------------------------------------------------------------ bad input
def _init_from_error(hf_dir: Path, *extra: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"model.init_from={hf_dir}", *extra])
    return str(caught.value)


def test_bad_hf_dirs_name_the_file_or_tensor(tmp_path, hf_dirs):
    import shutil

    missing = tmp_path / "nowhere"
    assert "no such Hugging Face model directory" in _init_from_error(missing)

    no_config = shutil.copytree(hf_dirs["tied"], tmp_path / "no_config")
    (no_config / "config.json").unlink()
    assert f"{no_config}: no config.json" in _init_from_error(no_config)

    lost_shard = shutil.copytree(hf_dirs["untied"], tmp_path / "lost_shard")
    index = json.loads((lost_shard / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (lost_shard / gone).unlink()
    message = _init_from_error(lost_shard)
    assert f"{lost_shard / gone}: missing, but model.safetensors.index.json names it for tensor" in message

    wrong_shape = shutil.copytree(hf_dirs["tied"], tmp_path / "wrong_shape")
    config = json.loads((wrong_shape / "config.json").read_text())
    config["intermediate_size"] = 128
    (wrong_shape / "config.json").write_text(json.dumps(config))
    message = _init_from_error(wrong_shape)
    assert "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [160, 64]" in message
    assert "expects [128, 64]" in message and str(wrong_shape / "model.safetensors") in message

    from safetensors.torch import save_file

    lacking = shutil.copytree(hf_dirs["tied"], tmp_path / "lacking")
    weights = load_file(lacking / "model.safetensors")
    norm = weights.pop("model.norm.weight")
    save_file(weights, lacking / "model.safetensors", metadata={"format": "pt"})
    assert f"tensor 'model.norm.weight' of the model is in none of the safetensors files of {lacking}" in \
        _init_from_error(lacking)
    save_file({**weights, "model.norm.weight": norm, "extra.weight": norm.clone()}, lacking / "model.safetensors")
    assert "tensor 'extra.weight' is not a parameter of the model" in _init_from_error(lacking)

    assert "model.hidden_size=128 disagrees with" in _init_from_error(hf_dirs["tied"], "model.hidden_size=128")
    assert "tie_word_embeddings=true, but parallel.pp > 1" in _init_from_error(
        hf_dirs["tied"], "parallel.pp=2", "train.micro_batches=2")

    from trainguard.hf.convert import hf_to_durable

    with pytest.raises(ConfigError, match="no config.json"):
        hf_to_durable(no_config, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_bad_hf_dir_stops_train_before_any_process_starts(tmp_path, hf_dirs):
    import shutil

    broken = shutil.copytree(hf_dirs["tied"], tmp_path / "broken")
    (broken / "config.json").unlink()
    proc = trainguard("train", "--nproc", "2", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                      *TINY, "--set", f"model.init_from={broken}")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.init_from" in lines[0] and f"{broken}: no config.json" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
