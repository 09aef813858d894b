"""Merge to Hugging Face, ckpt test, convert and resuming on another topology, on real multi-process
checkpoints of the reference trainer (HSDP 2x2 and FSDP 2 x TP 2) in all three formats: its durable
tier (DCP), its local tier (per-rank files spread over two simulated nodes) and verl's FSDP files."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.runs import TINY, flat_state, ok, trainguard, worker_env
from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.checkpoint.manifest import verify_checkpoint
from trainguard.cli import main
from trainguard.trainer.model import build_model

WRITER = Path(__file__).resolve().parents[1] / "helpers" / "rank_ckpt_writer.py"
LAYOUTS = {
    "hsdp2x2": ["--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=2"],
    "fsdp2_tp2": ["--set", "parallel.dp_shard=2", "--set", "parallel.tp=2"],
}
STEP = 2
LOCAL_TIER = ["--set", f"checkpoint.local_interval={STEP}", "--set", "parallel.ranks_per_node=2"]


def ranks(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``nproc`` ranks of the fixture's writer (gloo), from torch's elastic agent in its launcher process."""
    return subprocess.run([sys.executable, str(WRITER), "--nproc", str(nproc), *TINY, *args],
                          env=worker_env(), capture_output=True, text=True, timeout=600)


def _train(tmp_path_factory, layout: str) -> Path:
    """A run trained 2 steps on 4 ranks (2 nodes of 2): durable and local-tier checkpoints of step 2, and a
    verl-format copy."""
    run_dir = tmp_path_factory.mktemp(layout) / "run"
    ok(ranks(4, "--run-dir", str(run_dir), "--steps", str(STEP), "--save-interval", str(STEP), *LOCAL_TIER,
                *LAYOUTS[layout]))
    return run_dir


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory, "hsdp2x2")


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory, "fsdp2_tp2")


@pytest.fixture(params=["hsdp_run", "tp_run"])
def run(request) -> Path:
    return request.getfixturevalue(request.param)


def sources(run_dir: Path) -> dict[str, tuple[str, Path]]:
    return {"dcp": ("dcp", run_dir / "checkpoints/global_step_2"),
            # node 1's directory holds ranks 2 and 3 only: the merger gathers the others from node 0's
            "local": ("fsdp", run_dir / "local/node1/global_step_2"),
            "verl": ("fsdp", run_dir / "verl/global_step_2/actor")}


def local_step(run_dir: Path) -> Path:
    return run_dir / "local/node0/global_step_2"


def flat_local_copy(run_dir: Path, target: Path) -> Path:
    """The local step with every node's rank files copied into one directory, with the step's
    huggingface/ (the documented way to merge a step whose node directories are not reachable from one
    machine)."""
    shutil.copytree(local_step(run_dir), target, ignore=shutil.ignore_patterns("replica"))
    for path in (run_dir / "local/node1/global_step_2").glob("*_world_size_4_rank_*"):
        shutil.copy(path, target)
    assert (target / "huggingface" / "config.json").is_file()
    return target


def trainer_logits(ckpt: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """The trainer's own model with the checkpoint's weights (read through DCP, not the merge code)."""
    model = build_model(AutoConfig.from_pretrained(ckpt / "huggingface"), seed=0)
    full = read_full_state_dict(ckpt)
    model.load_state_dict({k[len("model."):]: v for k, v in full.items() if k.startswith("model.")})
    return model(input_ids=input_ids).logits


def cli(*args: str) -> subprocess.CompletedProcess:
    """``trainguard ARGS`` in this process (the command's own code path, without a Python start-up per
    call on a loaded machine); the tests that need a separate process use ``trainguard``."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["trainguard", *args], code, out.getvalue(), err.getvalue())


def merge(source: Path, target: Path, *extra: str, backend: str = "auto") -> subprocess.CompletedProcess:
    return cli("ckpt", "merge", "--backend", backend, "--local_dir", str(source), "--target_dir", str(target), *extra)


def test_merge_every_format_gives_the_trainers_logits(run, tmp_path):
    input_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = trainer_logits(run / "checkpoints/global_step_2", input_ids)
    for name, (backend, source) in sources(run).items():
        target = tmp_path / name
        ok(merge(source, target, backend=backend))
        assert (target / "model.safetensors").is_file() and (target / "tokenizer_config.json").is_file()
        assert "lm_head.weight" not in load_file(target / "model.safetensors")  # the trainer ties embeddings
        model = AutoModelForCausalLM.from_pretrained(target)
        assert torch.equal(model(input_ids=input_ids).logits, expected), name
        # ckpt test: the merged model against the checkpoint it came from and against another merge
        check = trainguard if name == "verl" else cli  # once as users run it, in its own process
        ok(check("ckpt", "test", "--local_dir", str(target), "--reference", str(source)))
        ok(cli("ckpt", "test", "--local_dir", str(target), "--reference", str(tmp_path / "dcp")))


def test_sharded_output_with_index_and_dtype(run, tmp_path):
    source = local_step(run)
    ok(merge(source, tmp_path / "fp32"))
    ok(merge(source, tmp_path / "sharded", "--max-shard-size", "100KB", "--dtype", "bf16"))
    index = json.loads((tmp_path / "sharded/model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = load_file(tmp_path / "fp32/model.safetensors")
    merged = {k: v for f in files for k, v in load_file(tmp_path / "sharded" / f).items()}
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k].to(torch.bfloat16)) for k in reference)


def test_ckpt_test_catches_a_planted_difference(run, tmp_path):
    source = run / "checkpoints/global_step_2"
    ok(merge(source, tmp_path / "good"))
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "good", bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    proc = trainguard("ckpt", "test", "--local_dir", str(bad), "--reference", str(source))
    assert proc.returncode == 1
    assert "model.layers.1.mlp.up_proj.weight: 1 of" in proc.stdout
    assert proc.stdout.count("values") == 1
    proc = cli("ckpt", "test", "--local_dir", str(bad), "--reference", str(tmp_path / "good"))
    assert proc.returncode == 1 and "model.layers.1.mlp.up_proj.weight" in proc.stdout


def test_bad_input_is_one_clear_error_and_leaves_no_target(run, tmp_path):
    local = flat_local_copy(run, tmp_path / "local")
    cases = []
    lost_node = tmp_path / "lost-node"
    shutil.copytree(run / "local", lost_node)
    shutil.rmtree(lost_node / "node1/global_step_2")
    cases.append((lost_node / "node0/global_step_2", "fsdp", "model_world_size_4_rank_2.pt: missing"))
    missing = tmp_path / "missing"
    shutil.copytree(local, missing)
    (missing / "model_world_size_4_rank_2.pt").unlink()
    cases.append((missing, "auto", "model_world_size_4_rank_2.pt: missing"))
    mixed = tmp_path / "mixed"
    shutil.copytree(local, mixed)
    shutil.copy(local / "model_world_size_4_rank_0.pt", mixed / "model_world_size_2_rank_0.pt")
    cases.append((mixed, "auto", "different world sizes"))
    cases.append((local, "dcp", "--backend dcp"))
    cases.append((run / "checkpoints/global_step_2", "fsdp", "--backend fsdp"))
    for source, backend, message in cases:
        target = tmp_path / "out"
        proc = merge(source, target, backend=backend)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not target.exists() and not list(tmp_path.glob(".out*"))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    proc = merge(local, taken)
    assert proc.returncode == 2 and "not empty (pass --force" in proc.stderr
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    ok(merge(local, taken, "--force"))
    assert not (taken / "keep.txt").exists() and (taken / "model.safetensors").exists()


def test_convert_local_to_dcp_and_universal_round_trips(run, tmp_path):
    original = flat_state(run / "checkpoints/global_step_2")
    for fmt in ("dcp", "universal"):
        target = tmp_path / fmt
        ok(cli("ckpt", "convert", "--from", str(local_step(run)), "--to", str(target), "--format", fmt))
        assert not verify_checkpoint(target)  # a committed checkpoint whose manifest vouches for every file
        converted = flat_state(target)
        assert converted.keys() == original.keys()
        for key, value in original.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(converted[key], value), (fmt, key)
            else:
                assert converted[key] == value, (fmt, key)
        # and merging the converted checkpoint gives the same model
        ok(merge(target, tmp_path / f"{fmt}-hf"))
        ok(cli("ckpt", "test", "--local_dir", str(tmp_path / f"{fmt}-hf"),
                      "--reference", str(run / "checkpoints/global_step_2")))
    index = json.loads((tmp_path / "universal/universal.json").read_text())
    entry = index["params"]["model.layers.0.mlp.up_proj.weight"]
    assert (tmp_path / "universal" / entry["file"]).is_file()
    assert {"model.model.layers.0.mlp.up_proj.weight", "optim.state.model.layers.0.mlp.up_proj.weight.exp_avg",
            "optim.state.model.layers.0.mlp.up_proj.weight.exp_avg_sq"} <= set(entry["keys"])


TARGET_LAYOUTS = {
    "fsdp2": (2, ["--set", "parallel.dp_shard=2"]),
    "fsdp2_tp2": (4, ["--set", "parallel.dp_shard=2", "--set", "parallel.tp=2"]),
}


@pytest.mark.parametrize("target_layout", list(TARGET_LAYOUTS))
def test_resume_on_another_layout_keeps_state_and_sample_position(hsdp_run, tmp_path, target_layout):
    """Saved on 4 ranks HSDP 2x2, resumed on another layout (from the durable checkpoint, and on 2 ranks
    also from a dcp and a universal one converted from the local tier's step)."""
    run = hsdp_run
    nproc, layout = TARGET_LAYOUTS[target_layout]
    source = run / "checkpoints/global_step_2"
    sources_ = {"durable": source}
    if target_layout == "fsdp2":
        for fmt in ("dcp", "universal"):
            ok(cli("ckpt", "convert", "--from", str(local_step(run)), "--to", str(tmp_path / fmt), "--format", fmt))
            sources_[fmt] = tmp_path / fmt
    original = flat_state(source)
    for name, ckpt in sources_.items():
        out = tmp_path / f"resaved-{name}"
        ok(ranks(nproc, "--run-dir", str(tmp_path / f"run-{name}"), "--steps", "8", "--resume", str(ckpt),
                    "--resave", str(out), *layout))
        resaved = flat_state(out / "global_step_2")
        tensors = [k for k, v in original.items() if isinstance(v, torch.Tensor)]
        assert resaved.keys() == original.keys() and len(tensors) > 20
        assert all(torch.equal(resaved[k], original[k]) for k in tensors), name
        facts = json.loads((out / "indices.json").read_text())
        # the source ran 2 steps on 4 data ranks x 2 samples: positions 0..15 were consumed
        assert facts["consumed_before"] == 2 * 4 * 2
        from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens

        dataset = TokenDataset(load_corpus_tokens(), 32)
        sampler = StatefulSampler(len(dataset), 0, 1, 1, seed=1234)  # data.seed's default
        seen = sampler.peek_global_indices(0, 16)
        drawn = [i for dp in range(facts["dp_size"]) for batch in facts["by_dp_rank"][str(dp)] for i in batch]
        assert drawn == sampler.peek_global_indices(16, len(drawn))  # continues the global order exactly
        assert not set(drawn) & set(seen)
