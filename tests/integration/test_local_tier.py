"""The local tier in live runs: per-rank files, replica groups holding identical bytes, online recovery
of a wiped node (bitwise against an undisturbed run), offline repair and the fall-back to durable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers.runs import assert_same_tensors, events, ok, read_json, train, trainguard
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainguard.checkpoint.checksum import file_checksum
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.fs.layout import model_shard_name, optim_shard_name
from trainguard.faults.spec import parse_faults
from trainguard.topology import restore_group_info_list

HSDP = ["--save-interval", "4", "--set", "parallel.dp_replicate=2", "--set", "parallel.ranks_per_node=2",
        "--set", "checkpoint.local_interval=2"]
WIPE = "wipe:node=1,step=4;kill:rank=0,step=6"


def node_dir(run_dir: Path, node: int) -> Path:
    return run_dir / "local" / f"node{node}"


def rank_file(run_dir: Path, step: int, rank: int, kind: str) -> Path:
    name = (model_shard_name if kind == "model" else optim_shard_name)(4, rank)
    return node_dir(run_dir, rank // 2) / f"global_step_{step}" / name


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("local") / "undisturbed"
    ok(train(run_dir, 4, 8, *HSDP))
    return run_dir


@pytest.fixture(scope="module")
def wiped(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("local") / "wiped"
    first = train(run_dir, 4, 8, *HSDP, faults=WIPE)
    assert first.returncode != 0, "the kill fault should have ended the first attempt"
    assert not node_dir(run_dir, 1).exists() or not any(node_dir(run_dir, 1).glob("global_step_*"))
    ok(train(run_dir, 4, 8, *HSDP))
    return run_dir


def test_local_files_use_verl_names_and_group_info(undisturbed):
    step_dir = node_dir(undisturbed, 0) / "global_step_8"
    names = {p.name for p in step_dir.iterdir()}
    for rank in (0, 1):
        assert {f"model_world_size_4_rank_{rank}.pt", f"optim_world_size_4_rank_{rank}.pt",
                f"extra_state_world_size_4_rank_{rank}.pt", f"manifest_world_size_4_rank_{rank}.json"} <= names
    assert "fsdp_config.json" in names
    config = read_json(step_dir / "fsdp_config.json")
    assert config["FSDP_version"] == 2 and config["world_size"] == 4
    assert config["mesh_dim_names"] == ["pp", "dp_replicate", "dp_shard", "tp"] and config["mesh_shape"] == [1, 2, 2, 1]
    assert config["params"]["model.embed_tokens.weight"]["placements"] == ["Replicate()", "Replicate()", "Shard(0)",
                                                                          "Replicate()"]
    # the extra state of node 1's ranks survives on node 0 (their buddies)
    assert {p.name for p in (step_dir / "replica").iterdir()} == {f"extra_state_world_size_4_rank_{r}.pt" for r in (2, 3)}
    # keep the last 2 local steps
    assert sorted(p.name for p in node_dir(undisturbed, 0).glob("global_step_*")) == ["global_step_6", "global_step_8"]
    assert restore_group_info_list(node_dir(undisturbed, 0)) == [0, 2]
    assert restore_group_info_list(node_dir(undisturbed, 1) / "group_info.json", rank=3) == [1, 3]
    # verl's layout: each step self-contained (huggingface/ inside), the tracker beside the steps, and the
    # model files hold DTensors over verl's mesh names ("ddp", "fsdp"), loadable with weights_only=True
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (step_dir / "huggingface").iterdir()}
    assert (node_dir(undisturbed, 1) / "global_step_8" / "huggingface" / "config.json").is_file()
    assert (node_dir(undisturbed, 0) / "latest_checkpointed_iteration.txt").read_text() == "8\n"
    model = safe_torch_load(rank_file(undisturbed, 8, 0, "model"))
    embed = model["model.embed_tokens.weight"]
    assert isinstance(embed, DTensor) and embed.device_mesh.mesh_dim_names == ("ddp", "fsdp")
    assert embed.device_mesh.mesh.tolist() == [[0, 1], [2, 3]] and embed.placements == (Replicate(), Shard(0))
    assert embed.to_local().shape[0] * 2 == embed.shape[0]


def test_group_members_hold_identical_shards_and_others_differ(undisturbed):
    for kind in ("model", "optim"):
        sums = {rank: file_checksum(rank_file(undisturbed, 8, rank, kind)) for rank in range(4)}
        assert sums[0] == sums[2] and sums[1] == sums[3], kind
        assert sums[0] != sums[1], kind
    a, b, c = ({k: v.to_local() for k, v in safe_torch_load(rank_file(undisturbed, 8, rank, "model")).items()}
               for rank in (0, 2, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].shape == c[k].shape)


def test_replicas_are_identical_under_tensor_parallel(tmp_path):
    run_dir = tmp_path / "tp"
    ok(train(run_dir, 4, 2, "--save-interval", "0", "--set", "parallel.dp_replicate=2", "--set", "parallel.tp=2",
             "--set", "checkpoint.local_interval=2", "--set", "checkpoint.local_dir=local/rank{rank}"))
    assert restore_group_info_list(run_dir / "local" / "rank1") == [1, 3]
    for kind in ("model", "optim"):
        sums = [file_checksum(run_dir / "local" / f"rank{r}" / "global_step_2" /
                              (model_shard_name if kind == "model" else optim_shard_name)(4, r)) for r in range(4)]
        assert sums[0] == sums[2] and sums[1] == sums[3] and sums[0] != sums[1], kind


def test_wiped_node_recovers_online_and_matches_bitwise(undisturbed, wiped):
    wipes = [e for e in events(wiped, "fault_injected") if e["fault"] == "wipe"]
    assert len(wipes) == 1 and wipes[0]["removed"] == [str(node_dir(wiped, 1).resolve())]
    (recovery,) = events(wiped, "local_recovery")
    assert recovery["step"] == 4 and recovery["ranks"] == [2, 3] and recovery["bytes"] > 0 and recovery["seconds"] > 0
    received = {e["rank"]: e for e in events(wiped, "local_recovered")}
    assert sorted(received) == [2, 3] and received[2]["sources"] == [0] and received[3]["sources"] == [1]
    assert all(e["bytes"] > 0 and e["seconds"] > 0 for e in received.values())
    started = events(wiped, "run_started")[-1]
    assert started["step"] == 4 and started.get("tier") == "local"
    assert (node_dir(wiped, 1) / "global_step_8" / "huggingface" / "config.json").is_file()
    assert (node_dir(wiped, 1) / "latest_checkpointed_iteration.txt").read_text() == "8\n"
    assert assert_same_tensors(undisturbed / "checkpoints" / "global_step_8", wiped / "checkpoints" / "global_step_8") > 0


@pytest.fixture
def local_copy(undisturbed, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(undisturbed, copy)
    return copy


def test_offline_repair_restores_byte_identical_files(undisturbed, local_copy):
    damaged = [rank_file(local_copy, 8, 2, "model"), rank_file(local_copy, 8, 1, "optim")]  # groups {0,2} and {1,3}
    data = bytearray(damaged[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged[0].write_bytes(bytes(data))
    damaged[1].unlink()
    result = ok(trainguard("ckpt", "repair", str(local_copy), "--step", "8"))
    assert result.stdout.count("REPAIRED") == 2 and "OK global_step_8" in result.stdout
    assert "model_world_size_4_rank_2.pt (rank 2) from rank 0" in result.stdout
    assert "optim_world_size_4_rank_1.pt (rank 1) from rank 3" in result.stdout
    for path, rank, kind in ((damaged[0], 2, "model"), (damaged[1], 1, "optim")):
        assert path.read_bytes() == rank_file(undisturbed, 8, rank, kind).read_bytes()
    repaired = events(local_copy, "local_repaired")
    assert repaired and repaired[-1]["bytes"] > 0 and repaired[-1]["files"] == 2
    again = ok(trainguard("ckpt", "repair", str(local_copy)))
    assert "REPAIRED" not in again.stdout


def test_repair_rebuilds_a_wiped_node_whole_and_it_merges(undisturbed, local_copy, tmp_path):
    shutil.rmtree(node_dir(local_copy, 1))
    result = ok(trainguard("ckpt", "repair", str(local_copy / "local" / "node0")))
    assert "OK global_step_8" in result.stdout
    rebuilt = node_dir(local_copy, 1)
    info, original = read_json(rebuilt / "group_info.json"), read_json(node_dir(undisturbed, 1) / "group_info.json")
    assert info["rank_dirs"] == {str(r): str(node_dir(local_copy, r // 2).resolve()) for r in range(4)}
    assert {k: v for k, v in info.items() if k != "rank_dirs"} == {k: v for k, v in original.items() if k != "rank_dirs"}
    assert (rebuilt / "latest_checkpointed_iteration.txt").read_text() == "8\n"
    for step in (6, 8):
        for name in ("config.json", "tokenizer.json"):
            assert ((rebuilt / f"global_step_{step}" / "huggingface" / name).read_bytes()
                    == (node_dir(undisturbed, 1) / f"global_step_{step}" / "huggingface" / name).read_bytes())
    # a merge given the rebuilt node's step finds every rank (the other node's through group_info.json)
    ok(trainguard("ckpt", "merge", "--local_dir", str(rebuilt / "global_step_8"), "--target_dir", str(tmp_path / "hf"),
                  "--dtype", "fp32"))
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_lost_group_exits_1_and_resume_falls_back_to_durable(local_copy):
    for step in (6, 8):
        for rank in (0, 2):
            rank_file(local_copy, step, rank, "model").unlink()
    result = trainguard("ckpt", "repair", str(local_copy / "local"))
    assert result.returncode == 1, result.stderr
    assert "LOST global_step_8: ranks [0, 2]" in result.stdout
    assert str(local_copy / "checkpoints" / "global_step_8") in result.stdout
    ok(train(local_copy, 4, 9, *HSDP))
    started = events(local_copy, "run_started")[-1]
    assert started["step"] == 8 and started["resumed_from"].endswith("checkpoints/global_step_8")
    assert "tier" not in started


def test_bad_input_is_one_clear_line(local_copy, tmp_path):
    cases = []
    not_ckpt = tmp_path / "empty"
    not_ckpt.mkdir()
    cases.append((not_ckpt, "not a local checkpoint directory"))
    step_dir = node_dir(local_copy, 0) / "global_step_8"
    (step_dir / "manifest_world_size_4_rank_0.json").write_text("{not json")
    cases.append((local_copy, "manifest_world_size_4_rank_0.json: not valid JSON"))
    for path, message in cases:
        result = trainguard("ckpt", "repair", str(path))
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    (step_dir / "manifest_world_size_4_rank_0.json").unlink()
    shutil.copy(step_dir / "model_world_size_4_rank_1.pt", step_dir / "model_world_size_8_rank_1.pt")
    result = trainguard("ckpt", "repair", str(local_copy))
    assert result.returncode == 2 and "model_world_size_8_rank_1.pt: world size 8" in result.stderr
    assert "mixed world sizes" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_wipe_fault_grammar():
    (spec,) = parse_faults("wipe:node=1,step=4")
    assert spec.kind == "wipe" and spec.step == 4 and spec.params == {"node": 1} and spec.rank is None
    with pytest.raises(Exception, match="missing required key node"):
        parse_faults("wipe:step=4")


def test_wipe_of_a_node_that_does_not_exist_is_refused(tmp_path):
    result = train(tmp_path / "run", 2, 2, "--set", "checkpoint.local_interval=1", "--set", "parallel.ranks_per_node=1",
                   faults="wipe:node=2,step=1")
    assert result.returncode == 2 and "node 2 does not exist" in result.stderr
