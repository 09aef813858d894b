"""The injector: module hooks, gradient faults, the once-per-run ledger, checkpoint damage, kill and hang."""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainguard
from trainguard.checkpoint.durable import DurableCheckpointer, read_full_state_dict
from trainguard.errors import ConfigError
from trainguard.events import EventLog, read_events
from trainguard.faults import FaultInjector, parse_faults


class Recorder:
    """An ``emit`` callback that keeps the events."""

    def __init__(self):
        self.events: list[dict] = []

    def __call__(self, kind, step=None, **fields):
        self.events.append({"kind": kind, "step": step, **fields})


def make_injector(text, run_dir, rank=0, world_size=2):
    recorder = Recorder()
    return FaultInjector(parse_faults(text), run_dir, rank, world_size, recorder), recorder


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def train_steps(model, injector, steps, record=None):
    """Forward and backward on fixed data; returns the output and the first layer's weight grad per step."""
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    results = []
    for step in range(steps):
        model.zero_grad()
        if injector is not None:
            injector.at_step_start(step)
        output = model(inputs)
        output.square().sum().backward()
        results.append((output.detach().clone(), model[0].weight.grad.clone()))
    return results


def changed_steps(faulty, clean):
    return [
        step
        for step, ((out, grad), (clean_out, clean_grad)) in enumerate(zip(faulty, clean))
        if not (torch.equal(out, clean_out) and torch.equal(grad, clean_grad))
    ]


# --- module hooks --------------------------------------------------------------------------------


def test_output_bitflip_fires_only_at_its_step(tmp_path):
    model = tiny_model()
    clean = train_steps(copy.deepcopy(model), None, 4)
    injector, recorder = make_injector("bitflip:rank=0,step=2,site=1,where=output,index=5", tmp_path)
    injector.install(model)
    seen = []
    model[1].register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))

    faulty = train_steps(model, injector, 4)

    assert changed_steps(faulty, clean) == [2]
    (event,) = recorder.events
    assert event["kind"] == "fault_injected" and event["step"] == 2
    assert (event["fault"], event["module"], event["where"], event["index"]) == ("bitflip", "1", "output", 5)
    assert event["dtype"] == "torch.float32" and event["bit"] in range(23, 31)
    assert seen[2].flatten()[5].item() == event["new"]
    assert abs(event["new"]) >= 1000 * abs(event["old"]) or not torch.isfinite(torch.tensor(event["new"]))


def test_grad_input_scale_scales_the_gradient_flowing_into_the_module(tmp_path):
    model = tiny_model()
    clean = train_steps(copy.deepcopy(model), None, 3)
    injector, recorder = make_injector("scale:rank=0,step=1,site=1,where=grad_input,factor=8", tmp_path)
    injector.install(model)

    faulty = train_steps(model, injector, 3)

    assert changed_steps(faulty, clean) == [1]
    # the forward is untouched; everything upstream of the LayerNorm sees an 8x gradient
    assert torch.equal(faulty[1][0], clean[1][0])
    assert torch.equal(faulty[1][1], 8 * clean[1][1])
    (event,) = recorder.events
    assert (event["step"], event["fault"], event["where"], event["factor"]) == (1, "scale", "grad_input", 8.0)


def test_grad_input_bitflip_changes_one_gradient_element(tmp_path):
    model = tiny_model()
    clean = train_steps(copy.deepcopy(model), None, 2)
    injector, recorder = make_injector("bitflip:rank=0,step=0,site=1,where=grad_input,bit=sign", tmp_path)
    injector.install(model)
    faulty = train_steps(model, injector, 2)
    assert changed_steps(faulty, clean) == [0]
    (event,) = recorder.events
    assert event["new"] == -event["old"] and event["bit"] == 31


def test_output_scale_persistent_fires_at_every_step_from_its_start_once_per_forward(tmp_path):
    model = tiny_model()
    clean = train_steps(copy.deepcopy(model), None, 4)
    injector, recorder = make_injector("scale:rank=0,step=2,site=2,where=output,factor=2,persistent=1", tmp_path)
    injector.install(model)
    injector.install(model)  # a second install replaces the hooks instead of doubling them
    faulty = train_steps(model, injector, 4)
    assert changed_steps(faulty, clean) == [2, 3]
    assert torch.equal(faulty[3][0], 2 * clean[3][0])
    assert [event["step"] for event in recorder.events] == [2, 3]


def test_site_faults_of_another_rank_install_nothing(tmp_path):
    model = tiny_model()
    clean = train_steps(copy.deepcopy(model), None, 2)
    injector, recorder = make_injector("scale:rank=1,step=0,site=1,where=output,factor=0", tmp_path, rank=0)
    injector.install(model)
    assert changed_steps(train_steps(model, injector, 2), clean) == []
    assert recorder.events == []


def test_hooks_do_nothing_before_the_first_step(tmp_path):
    model = tiny_model()
    injector, recorder = make_injector("scale:rank=0,step=0,site=1,where=output,factor=0,persistent=1", tmp_path)
    injector.install(model)
    model(torch.ones(1, 4))
    assert recorder.events == []


def test_unknown_site_is_a_clear_error(tmp_path):
    injector, _ = make_injector("bitflip:rank=0,step=1,site=11,where=output", tmp_path)
    with pytest.raises(ConfigError, match=r"bad fault .*the model has no module '11' \(did you mean '1'"):
        injector.install(tiny_model())
    injector, _ = make_injector("bitflip:rank=0,step=1,site=model.layers.1.input_layernorm,where=output", tmp_path)
    with pytest.raises(ConfigError, match=r"no module 'model.layers.1.input_layernorm' \(see model.named_modules\(\)\)"):
        injector.install(tiny_model())


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_a_site_without_an_input_gradient_is_a_clear_error(tmp_path):
    model = tiny_model()
    injector, _ = make_injector("bitflip:rank=0,step=0,site=0,where=grad_input", tmp_path)
    injector.install(model)
    injector.at_step_start(0)
    with pytest.raises(ConfigError, match="module '0' has no tensor grad_input to change"):
        model(torch.ones(1, 4)).sum().backward()


def test_bitflip_on_a_bf16_output(tmp_path):
    model = tiny_model().to(torch.bfloat16)
    injector, recorder = make_injector("bitflip:rank=0,step=0,site=1,where=output,bit=15", tmp_path)
    injector.install(model)
    injector.at_step_start(0)
    model(torch.ones(2, 4, dtype=torch.bfloat16))
    (event,) = recorder.events
    assert event["dtype"] == "torch.bfloat16" and event["new"] == -event["old"]


def test_a_bit_outside_the_dtype_is_a_clear_error(tmp_path):
    model = tiny_model().to(torch.float16)
    injector, _ = make_injector("bitflip:rank=0,step=0,site=1,where=output,bit=20", tmp_path)
    injector.install(model)
    injector.at_step_start(0)
    with pytest.raises(ConfigError, match="bit 20 does not exist in a 16-bit float"):
        model(torch.ones(2, 4, dtype=torch.float16))


# --- gradient faults -----------------------------------------------------------------------------


def backward_once(model):
    model.zero_grad()
    model(torch.ones(2, 4)).square().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_spike_multiplies_every_gradient(tmp_path):
    model = tiny_model()
    injector, recorder = make_injector("spike:step=3,factor=1e3", tmp_path, rank=1)
    clean = backward_once(model)
    injector.after_backward(2, model)
    injector.after_backward(3, model)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, 1e3 * clean[name])
    (event,) = recorder.events
    assert (event["step"], event["fault"], event["factor"], event["gradients"]) == (3, "spike", 1e3, 6)


def test_nan_goes_into_the_first_parameter_with_a_gradient_on_rank_0_by_default(tmp_path):
    model = tiny_model()
    model[0].requires_grad_(False)
    backward_once(model)
    other_rank, other_events = make_injector("nan:step=1", tmp_path, rank=1)
    other_rank.after_backward(1, model)
    assert other_events.events == []
    injector, recorder = make_injector("nan:step=1", tmp_path, rank=0)
    injector.after_backward(1, model)
    assert torch.isnan(model[1].weight.grad[0])
    assert sum(int(torch.isnan(p.grad).sum()) for p in model.parameters() if p.grad is not None) == 1
    assert recorder.events[0]["parameter"] == "1.weight"


def test_a_planted_nan_comes_back_when_its_step_is_rerun_and_never_after(tmp_path):
    model = tiny_model()
    injector, recorder = make_injector("nan:step=2", tmp_path, rank=0)
    for step in (1, 2, 2, 3):  # step 2 runs twice: an SDC rerun
        backward_once(model)
        injector.after_backward(step, model)
        assert bool(torch.isnan(model[0].weight.grad).any()) == (step == 2)
    assert [e["step"] for e in recorder.events] == [2, 2]


@pytest.fixture
def single_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_spike_and_nan_act_on_the_local_shard_of_dtensor_gradients(tmp_path, single_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    model = nn.Linear(3, 2)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    model.bias = nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Shard(0)]))
    for parameter in model.parameters():
        parameter.grad = distribute_tensor(torch.ones_like(parameter.full_tensor()), mesh, [Shard(0)])
    injector, _ = make_injector("spike:step=0,factor=5;nan:step=0", tmp_path, world_size=1)
    injector.after_backward(0, model)
    assert isinstance(model.weight.grad, DTensor)
    local = model.weight.grad.to_local()
    assert torch.isnan(local[0, 0]) and torch.all(local.flatten()[1:] == 5)
    assert torch.all(model.bias.grad.to_local() == 5)


# --- once per run directory ----------------------------------------------------------------------


@pytest.fixture
def kills(monkeypatch):
    """Replaces the real SIGKILL with a record of it, so that a wrong firing fails a test, not pytest."""
    sent = []
    monkeypatch.setattr("trainguard.faults.injector.os.kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_a_fault_fires_once_per_run_directory(tmp_path, kills):
    text = "kill:rank=1,step=4"
    first, first_events = make_injector(text, tmp_path, rank=1)
    for step in range(6):
        first.at_step_start(step)
    assert kills == [(os.getpid(), signal.SIGKILL)]
    assert first_events.events[0]["step"] == 4 and first_events.events[0]["action"] == "SIGKILL"
    (marker,) = (tmp_path / "faults" / "fired").iterdir()
    assert marker.name.startswith("0-") and marker.name.endswith("-rank1")

    restarted, restarted_events = make_injector(text, tmp_path, rank=1)
    restarted.at_step_start(4)
    assert len(kills) == 1 and restarted_events.events == []

    edited, _ = make_injector("kill:rank=1,step=4,persistent=0", tmp_path, rank=1)
    edited.at_step_start(4)
    assert len(kills) == 2, "an edited entry is a new fault"


def test_other_ranks_keep_their_own_ledger(tmp_path):
    model = tiny_model()
    for rank in (0, 1):
        injector, recorder = make_injector("spike:step=0", tmp_path, rank=rank)
        backward_once(model)
        injector.after_backward(0, model)
        assert len(recorder.events) == 1
    assert sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "faults" / "fired").iterdir()) == ["rank0", "rank1"]


def test_persistent_faults_fire_again_after_a_restart(tmp_path, kills):
    for _ in range(2):
        injector, _ = make_injector("kill:rank=0,step=2,persistent=1", tmp_path)
        for step in range(4):
            injector.at_step_start(step)
    assert len(kills) == 4  # steps 2 and 3, twice
    assert not (tmp_path / "faults").exists()


def test_hang_sleeps_for_the_given_seconds(tmp_path):
    injector, recorder = make_injector("hang:rank=0,step=1,seconds=0.1", tmp_path)
    injector.at_step_start(0)
    started = time.monotonic()
    injector.at_step_start(1)
    assert time.monotonic() - started >= 0.1
    assert recorder.events[0]["seconds"] == 0.1 and recorder.events[0]["action"] == "hang"


def test_kill_dies_by_sigkill_after_recording_the_firing(tmp_path):
    script = textwrap.dedent(
        f"""
        from trainguard.events import EventLog, read_events
        from trainguard.faults import FaultInjector
        log = EventLog({str(tmp_path / "events.jsonl")!r}, rank=1)
        injector = FaultInjector.from_env({str(tmp_path)!r}, rank=1, world_size=2, emit=log.emit)
        injector.at_step_start(2)
        injector.at_step_start(3)
        print("survived")
        """
    )
    source_root = str(Path(trainguard.__file__).parents[1])
    env = {**os.environ, "TRAINGUARD_FAULTS": "kill:rank=1,step=3", "PYTHONPATH": source_root}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "survived" not in result.stdout
    assert len(list((tmp_path / "faults" / "fired").iterdir())) == 1
    (event,) = read_events(tmp_path / "events.jsonl", kind="fault_injected")
    assert (event["step"], event["rank"], event["fault"], event["spec"]) == (3, 1, "kill", "kill:rank=1,step=3")
    assert event["fault_index"] == 0


# --- checkpoint damage ---------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    directory = tmp_path / "global_step_10"
    (directory / "huggingface").mkdir(parents=True)
    for name in ("model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt", "trainguard.json"):
        (directory / name).write_bytes(bytes(range(200)))
    (directory / "huggingface" / "config.json").write_bytes(b"{}" * 50)
    return directory


def files_under(directory):
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def test_corrupt_flips_the_middle_byte_of_each_matching_file(tmp_path, checkpoint):
    injector, recorder = make_injector("corrupt:step=10,file=*rank_0.pt", tmp_path / "run")
    injector.after_commit(9, checkpoint)
    assert recorder.events == []
    injector.after_commit(10, checkpoint)
    damaged = (checkpoint / "model_world_size_2_rank_0.pt").read_bytes()
    assert [i for i, (a, b) in enumerate(zip(damaged, bytes(range(200)))) if a != b] == [100]
    assert damaged[100] == 100 ^ 0xFF
    assert (checkpoint / "model_world_size_2_rank_1.pt").read_bytes() == bytes(range(200))
    (event,) = recorder.events
    assert event["files"] == ["model_world_size_2_rank_0.pt"]
    assert event["changes"][0]["offset"] == 100 and event["checkpoint"] == str(checkpoint)


def test_truncate_cuts_matching_files_in_half_matching_relative_paths(tmp_path, checkpoint):
    injector, recorder = make_injector("truncate:step=10,file=huggingface/*", tmp_path / "run")
    injector.after_commit(10, checkpoint)
    assert (checkpoint / "huggingface" / "config.json").stat().st_size == 50
    assert recorder.events[0]["files"] == ["huggingface/config.json"]


def test_delete_matches_basenames_recursively(tmp_path, checkpoint):
    injector, recorder = make_injector("delete:step=10,file=*.json", tmp_path / "run")
    injector.after_commit(10, checkpoint)
    assert recorder.events[0]["files"] == ["huggingface/config.json", "trainguard.json"]
    assert files_under(checkpoint) == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]


def test_star_matches_every_file_but_not_symlinks(tmp_path, checkpoint):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep")
    (checkpoint / "link.bin").symlink_to(outside)
    injector, recorder = make_injector("delete:step=10,file=*", tmp_path / "run")
    injector.after_commit(10, checkpoint)
    assert len(recorder.events[0]["files"]) == 4
    assert files_under(checkpoint) == ["link.bin"] and outside.read_bytes() == b"keep"


def test_a_pattern_matching_nothing_warns_and_reports_no_files(tmp_path, checkpoint, caplog):
    injector, recorder = make_injector("delete:step=10,file=*.safetensors", tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="trainguard.faults"):
        injector.after_commit(10, checkpoint)
    assert recorder.events[0]["files"] == []
    assert "matched no file" in caplog.text
    assert len(files_under(checkpoint)) == 4


def test_checkpoint_damage_happens_once_per_run_directory(tmp_path, checkpoint):
    for _ in range(2):
        injector, _ = make_injector("truncate:step=10,file=trainguard.json", tmp_path / "run")
        injector.after_commit(10, checkpoint)
    assert (checkpoint / "trainguard.json").stat().st_size == 100


# --- construction --------------------------------------------------------------------------------


def test_a_rank_outside_the_world_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rank 4 is outside the world size 4 \(ranks 0..3\)"):
        make_injector("kill:rank=4,step=1", tmp_path, world_size=4)
    with pytest.raises(ConfigError, match="rank 2 is outside the world size 2"):
        make_injector("nan:step=1,rank=2", tmp_path, world_size=2)


def test_from_env_prefers_a_non_blank_environment_variable(tmp_path, monkeypatch):
    config = "spike:step=1"
    monkeypatch.setenv("TRAINGUARD_FAULTS", "kill:rank=0,step=2")
    assert [s.kind for s in FaultInjector.from_env(tmp_path, 0, 1, Recorder(), config).specs] == ["kill"]
    monkeypatch.setenv("TRAINGUARD_FAULTS", "  ")
    assert [s.kind for s in FaultInjector.from_env(tmp_path, 0, 1, Recorder(), config).specs] == ["spike"]
    monkeypatch.delenv("TRAINGUARD_FAULTS")
    injector = FaultInjector.from_env(tmp_path, 0, 1, Recorder())
    assert not injector.active and injector.specs == []
    assert FaultInjector.from_env(tmp_path, 0, 1, Recorder(), config).active


def test_from_env_errors_name_their_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_FAULTS", "kill:rank=0")
    with pytest.raises(ConfigError, match=r"^TRAINGUARD_FAULTS: bad fault 'kill:rank=0': missing required key step for kill$"):
        FaultInjector.from_env(tmp_path, 0, 1, Recorder())
    monkeypatch.delenv("TRAINGUARD_FAULTS")
    with pytest.raises(ConfigError, match=r"^config key 'faults': bad fault 'kill:rank=3,step=1': rank 3 is outside"):
        FaultInjector.from_env(tmp_path, 0, 2, Recorder(), "kill:rank=3,step=1")


# --- state at rest -------------------------------------------------------------------------------


def test_stateflip_flips_one_bit_of_a_weight_or_an_adam_moment_at_its_step(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    backward_once(model)
    optimizer.step()
    text = "stateflip:rank=0,step=2,site=0.weight,state=weight,index=5;stateflip:rank=0,step=2,site=2.bias,state=exp_avg"
    injector, recorder = make_injector(text, tmp_path)
    injector.install(model)
    weight, moment = model[0].weight.detach().clone(), optimizer.state[model[2].bias]["exp_avg"].clone()
    injector.at_rest(1, model, optimizer)
    assert recorder.events == []
    injector.at_rest(2, model, optimizer)
    changed = (model[0].weight.detach() != weight).flatten().nonzero().flatten().tolist()
    assert changed == [5]
    assert (optimizer.state[model[2].bias]["exp_avg"] != moment).sum() == 1
    assert [(e["fault"], e["state"], e["flipped"]) for e in recorder.events] == [
        ("stateflip", "weight", True), ("stateflip", "exp_avg", True)]


def test_stateflip_waits_for_the_lazy_copy_of_the_save_before_it_so_the_checkpoint_holds_the_saved_state(tmp_path):
    # An async save copies the parameters while the next step runs; the copy is held back here (its
    # background thread blocks in the static files, before the copy) so the flip of the next step
    # always comes first. The flip must let the copy be made before it: the checkpoint a recompute then
    # loads holds the state of its step (without the wait it held the flipped weight, as in 1 of ~8 Guard
    # runs of a stateflip at step 5 with a save at step 4).
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    backward_once(model)
    optimizer.step()
    saved = model[0].weight.detach().clone()
    checkpointer = DurableCheckpointer(
        tmp_path / "ckpts", rank=0, world_size=1, mesh_shape=[1], mesh_dim_names=["dp_shard"], run_token="t",
        process_group=None, async_save=True, keep_last=3, keep_every=None,
        events=EventLog(tmp_path / "events.jsonl", rank=0, host="h"))
    copy_may_start = threading.Event()
    checkpointer.save(1, model, optimizer, {"step": 1}, {"step": 1}, lambda directory: copy_may_start.wait(30))
    injector, recorder = make_injector("stateflip:rank=0,step=2,site=0.weight,state=weight,index=5,bit=29", tmp_path)
    injector.at_rest(2, model, optimizer, checkpointer.wait_for_staging)
    copy_may_start.set()
    checkpointer.wait()
    assert [e["flipped"] for e in recorder.events] == [True]
    assert not torch.equal(model[0].weight.detach(), saved)
    assert torch.equal(read_full_state_dict(tmp_path / "ckpts/global_step_1")["model.0.weight"], saved)


def test_stateflip_of_an_unknown_parameter_is_a_clear_error(tmp_path):
    injector, _ = make_injector("stateflip:rank=0,step=2,site=0.wieght,state=weight", tmp_path)
    with pytest.raises(ConfigError, match=r"no parameter '0.wieght' \(did you mean '0.weight'"):
        injector.install(tiny_model())
    with pytest.raises(ConfigError, match="state must be one of weight|exp_avg|exp_avg_sq"):
        parse_faults("stateflip:rank=0,step=2,site=0.weight,state=momentum")
