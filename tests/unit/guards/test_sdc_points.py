"""SDC detection points: hooks on norm layers and custom points, one statistic per point per micro-batch."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainguard.errors import ConfigError
from trainguard.guards import sdc
from trainguard.guards.sdc import (
    NOT_CHECKED,
    DetectionPoints,
    GradientPoints,
    RerunAttribution,
    SdcDetector,
    StrikeBook,
)


def _deactivate() -> None:
    active = sdc.active_points()
    if active is not None:
        active.remove()


@pytest.fixture(autouse=True)
def no_active_points():
    """Each test starts and ends with no active DetectionPoints (the one-liners report to it)."""
    _deactivate()
    yield
    _deactivate()


class MyRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def tiny(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), MyRMSNorm(8), nn.Linear(8, 2))


def manual_gradients(model: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """The gradients flowing into modules 1 and 3 (their inputs are used by them alone)."""
    h0 = model[0](x)
    h0.retain_grad()
    h2 = model[2](model[1](h0))
    h2.retain_grad()
    model[4](model[3](h2)).square().sum().backward()
    return [h0.grad, h2.grad]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().sum()


def test_norm_layers_are_found_and_their_grad_input_norms_match():
    x = torch.randn(5, 4)
    expected = [g.norm().item() for g in manual_gradients(tiny(), x)]
    model = tiny()
    points = DetectionPoints()
    assert points.install(model) == ["1", "3"]
    assert [points.where(n) for n in points.names] == ["auto", "auto"]
    loss(model, x).backward()
    assert points.fired == [1, 1]
    values = points.collect()
    assert values.shape == (2,) and values.dtype == torch.float32
    assert values.tolist() == pytest.approx(expected, rel=1e-6)
    assert points.fired == [0, 0] and points.collect().tolist() == [NOT_CHECKED, NOT_CHECKED]  # cleared


def test_max_sq_statistic_for_v3():
    x = torch.randn(5, 4)
    expected = [g.square().max().item() for g in manual_gradients(tiny(), x)]
    model = tiny()
    points = DetectionPoints(statistic=SdcDetector("v3").statistic)
    points.install(model)
    loss(model, x).backward()
    assert points.collect().tolist() == pytest.approx(expected, rel=1e-6)


def test_one_slot_per_point_per_micro_batch_combined_by_max():
    batches = [torch.randn(3, 4), 10 * torch.randn(3, 4), torch.randn(3, 4)]
    expected = [[g.norm().item() for g in manual_gradients(tiny(), x)] for x in batches]
    model = tiny()
    points = DetectionPoints(micro_batches=3)
    points.install(model)
    assert tuple(points._buffer.shape) == (2, 3, 1)
    for x in batches:
        loss(model, x).backward()
    assert points.fired == [3, 3]
    assert tuple(points._buffer.shape) == (2, 3, 1)  # preallocated, not grown
    assert points.collect().tolist() == pytest.approx([max(col) for col in zip(*expected)], rel=1e-6)
    # more backwards than micro-batches: the buffer grows, nothing is lost
    for x in batches + batches:
        loss(model, x).backward()
    assert points.collect().tolist() == pytest.approx([max(col) for col in zip(*expected)], rel=1e-6)


def test_nan_in_any_micro_batch_propagates():
    model = tiny()
    points = DetectionPoints(micro_batches=2)
    points.install(model)
    loss(model, torch.randn(3, 4)).backward()
    bad = torch.randn(3, 4)
    bad[0, 0] = float("nan")
    loss(model, bad).backward()
    assert all(math.isnan(v) for v in points.collect().tolist())


def test_hooks_never_synchronise_with_the_host(monkeypatch):
    """Every way of reading a tensor on the host raises inside the hooks; one .tolist() after collect()."""
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), MyRMSNorm(8))
    points = DetectionPoints(micro_batches=2)
    points.install(model, ["0"])
    ids = torch.randint(0, 10, (4, 3))
    outputs = [model(ids).square().sum() for _ in range(2)]

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation inside a detection hook")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"):
            patch.setattr(torch.Tensor, name, forbidden)
        for output in outputs:
            output.backward()
        values = points.collect()
    assert points.names == ["2", "4", "0"]
    assert all(v > 0 for v in values.tolist())


def test_a_point_that_does_not_fire_is_not_checked():
    class Maybe(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(4)
            self.other = nn.LayerNorm(4)

        def forward(self, x, use_other=False):
            return self.other(x) if use_other else self.norm(x)

    model = Maybe()
    points = DetectionPoints()
    points.install(model)
    (model(torch.randn(2, 4, requires_grad=True)) * torch.randn(2, 4)).sum().backward()
    values = dict(zip(points.names, points.collect().tolist()))
    assert values["other"] == NOT_CHECKED and values["norm"] > 0
    detector = SdcDetector("v1", points.names)
    assert detector.detect(list(values.values()), step=1) == [] and "other" not in detector.points


class EmbeddingModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.norm(self.embed_tokens(ids)))


def embedding_loss(model, ids):
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def test_a_custom_embedding_point_checks_the_gradient_of_its_output():
    ids = torch.randint(0, 16, (2, 5))
    reference = EmbeddingModel()
    h = reference.embed_tokens(ids)
    h.retain_grad()
    F.cross_entropy(reference.head(reference.norm(h)).flatten(0, 1), ids.flatten()).backward()
    model = EmbeddingModel()
    points = DetectionPoints()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "full backward hook ... no inputs require gradients" warning
        assert points.install(model, extra_points=["embed_tokens"]) == ["norm", "embed_tokens"]
        assert points.where("embed_tokens") == "grad_output"
        embedding_loss(model, ids).backward()
    assert points.collect()[1].item() == pytest.approx(h.grad.norm().item(), rel=1e-6)


@pytest.mark.parametrize("how", ["name", "object", "tuple"])
def test_custom_points_by_name_object_or_with_where(how):
    model = EmbeddingModel()
    points = DetectionPoints()
    if how == "name":
        points.install(model)
        assert points.add("embed_tokens") == "embed_tokens"
    elif how == "object":
        points.install(model)
        assert points.add(model.embed_tokens) == "embed_tokens"
    else:
        points.install(model, [(model.embed_tokens, "grad_output"), ("head", "grad_input")])
        assert points.where("head") == "grad_input"
    assert points.where("embed_tokens") == "grad_output"
    assert points.add("norm") == "norm" and points.names.count("norm") == 1  # already a point: one point
    points.add("norm", where="grad_output")
    assert points.where("norm") == "grad_output" and points.names.count("norm") == 1


def test_bad_custom_points_are_one_clear_error():
    model = EmbeddingModel()
    points = DetectionPoints()
    with pytest.raises(ConfigError, match=r"detection point 'embed_token': the model has no module of that name "
                                          r"\(did you mean 'embed_tokens'\?\)"):
        points.install(model, ["embed_token"])
    assert points.names == [] and not model.norm._forward_pre_hooks  # nothing half-installed
    points.install(model)
    with pytest.raises(ConfigError, match="where must be one of auto, grad_input, grad_output, got 'input'"):
        points.add("head", where="input")
    with pytest.raises(ConfigError, match="not part of the installed model"):
        points.add(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="call install"):
        DetectionPoints().add("head")


def test_grad_output_differs_from_grad_input_where_the_module_changes_the_gradient():
    x = torch.randn(3, 4)
    model = tiny()
    points = DetectionPoints()
    points.install(model, norms=False, extra_points=[("2", "grad_input"), ("4", "grad_output")])
    h = model[0](x)
    h1 = model[1](h)
    h1.retain_grad()
    out = model[4](model[3](model[2](h1)))
    out.retain_grad()
    out.square().sum().backward()
    values = points.collect().tolist()
    assert values == pytest.approx([h1.grad.norm().item(), out.grad.norm().item()], rel=1e-6)


def test_watch_tensor_and_watch_function_inside_a_forward():
    gather = sdc.watch_function("embedding.gather", F.embedding)  # wrapped before any install, as in a model

    class Llamaish(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.weight = nn.Parameter(torch.randn(16, 8))
            self.norm = MyRMSNorm(8)

        def forward(self, ids):
            h = gather(ids, self.weight)
            return sdc.watch_tensor("normed", self.norm(h))

    ids = torch.randint(0, 16, (2, 5))
    model = Llamaish()
    model(ids).sum().backward()  # nothing installed: the one-liners are no-ops
    assert sdc.active_points() is None
    reference = Llamaish()
    h = F.embedding(ids, reference.weight)
    h.retain_grad()
    normed = reference.norm(h)
    normed.retain_grad()
    (normed * 3).sum().backward()
    points = DetectionPoints()
    points.install(model)
    points.declare("normed")
    assert sdc.active_points() is points and points.names == ["norm", "normed"]
    (model(ids) * 3).sum().backward()
    assert points.names == ["norm", "normed", "embedding.gather"]  # declared on first use
    assert points.where("embedding.gather") == "tensor"
    values = dict(zip(points.names, points.collect().tolist()))
    assert values["embedding.gather"] == pytest.approx(h.grad.norm().item(), rel=1e-6)
    assert values["norm"] == pytest.approx(h.grad.norm().item(), rel=1e-6)  # the same gradient here
    assert values["normed"] == pytest.approx(normed.grad.norm().item(), rel=1e-6)
    points.remove()
    assert sdc.active_points() is None and points.names == []
    with torch.no_grad():
        model(ids)  # no grad: nothing to watch


def test_disabled_and_removed_points_do_nothing():
    model = tiny()
    points = DetectionPoints()
    points.install(model)
    points.enabled = False
    loss(model, torch.randn(2, 4)).backward()
    assert points.fired == [0, 0]
    points.enabled = True
    points.remove()
    loss(model, torch.randn(2, 4)).backward()
    assert points.collect().numel() == 0
    assert not any(m._forward_pre_hooks or m._forward_hooks or m._backward_hooks for m in model)


def test_activation_checkpointing_fires_once_per_micro_batch():
    x = torch.randn(3, 4)
    expected = [g.norm().item() for g in manual_gradients(tiny(), x)]
    model = tiny()
    points = DetectionPoints()
    points.install(model)
    for use_reentrant in (False, True):
        inputs = x.clone().requires_grad_(use_reentrant)
        out = checkpoint(lambda t: model[:4](t), inputs, use_reentrant=use_reentrant)
        model[4](out).square().sum().backward()
        assert points.fired == [1, 1]
        assert points.collect().tolist() == pytest.approx(expected, rel=1e-5)


def judged_share(g: torch.Tensor) -> float:
    """The isolated peak share written out element by element (rows: the last dimension)."""
    rows = [[float(v) ** 2 for v in row] for row in g.reshape(-1, g.shape[-1])]
    total = sum(map(sum, rows))
    row = max(rows, key=sum)
    peak = max(row)
    return peak / (peak + max(total - peak, len(rows) * (sum(row) - peak)))


def test_the_isolated_peak_share_is_a_flips_share_but_small_for_an_element_whose_whole_row_is_large():
    g = torch.full((64, 32), 0.01)
    g[5, 7] = 0.01 * 2.0**16  # one exponent flip: it dominates its row and the point
    assert sdc.isolated_peak_share([g]).item() == pytest.approx(sdc.peak_share([g]).item(), rel=1e-6)
    assert sdc.isolated_peak_share([g]).item() > 0.999
    natural = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 1e-3
    natural[9] *= 300  # one token's gradient jumped: 99.7 % of the energy, its largest element ~10 % of it
    assert sdc.peak_share([natural]).item() > 0.05
    assert sdc.isolated_peak_share([natural]).item() == pytest.approx(judged_share(natural), rel=1e-5)
    assert sdc.isolated_peak_share([natural]).item() < 0.01
    # a vector is one row: its plain share; several tensors: the rows of all of them
    v = torch.randn(50)
    assert sdc.isolated_peak_share([v]).item() == pytest.approx(sdc.peak_share([v]).item(), rel=1e-6)
    assert sdc.isolated_peak_share([torch.ones(3), torch.zeros(1)]).item() == pytest.approx(1 / (1 + 2 * 2))
    assert sdc.isolated_peak_share([torch.zeros(4, 2)]).item() == 0.0
    nan = g.clone()
    nan[1, 1] = float("nan")
    assert math.isnan(sdc.isolated_peak_share([nan]).item())


def test_peak_shares_are_recorded_with_the_statistic_in_one_buffer():
    g = torch.full((100,), 0.01)
    assert sdc.peak_share([g]).item() == pytest.approx(0.01)  # spread evenly: 1/n
    g[7] = 0.01 * 2.0**16  # one exponent flip: that element carries nearly everything
    assert sdc.peak_share([g]).item() > 0.999
    assert sdc.peak_share([torch.zeros(5)]).item() == 0.0
    assert sdc.peak_share([torch.ones(3), torch.zeros(1)]).item() == pytest.approx(1 / 3)
    x = torch.randn(5, 4)
    expected = [g.norm().item() for g in manual_gradients(tiny(), x)]
    shares = [judged_share(g) for g in manual_gradients(tiny(), x)]
    points = DetectionPoints(shares=True)
    points.install(tiny_model := tiny())
    loss(tiny_model, x).backward()
    values, got = points.collect(with_shares=True).tolist()
    assert values == pytest.approx(expected, rel=1e-5) and got == pytest.approx(shares, rel=1e-5)
    with pytest.raises(ValueError, match="needs DetectionPoints"):
        DetectionPoints().collect(with_shares=True)


class TwoInputs(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


def test_a_grad_input_point_with_several_inputs_measures_them_together_and_auto_falls_back():
    module = TwoInputs()
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    points = DetectionPoints()
    points.install(module, [("", "grad_input")], norms=False)
    module(a, b).sum().backward()
    assert points.fired == [1]
    assert points.collect().item() == pytest.approx(torch.cat([a.grad, b.grad]).norm().item(), rel=1e-6)
    # auto on a call whose inputs need no gradient: the output's gradient (no torch warning)
    outer = nn.Sequential(nn.Identity(), nn.Linear(3, 3))
    points.install(outer, [("0", "auto")], norms=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = outer(torch.randn(2, 3))
        out.sum().backward()
    assert points.fired == [0]  # an Identity whose output needs no gradient either: nothing to check
    h = torch.randn(2, 3)
    inner = nn.Sequential(nn.Linear(3, 3), nn.Identity())
    points.install(inner, [("1", "auto")], norms=False)
    inner(h).square().sum().backward()
    assert points.fired == [1]  # its input (the Linear's output) needs a gradient: grad_input


def test_bf16_gradients_are_measured_in_float32():
    g = torch.full((1000,), 300.0, dtype=torch.float16)  # the fp16 sum of squares would overflow
    assert sdc.gradient_statistic([g], "l2").item() == pytest.approx(300.0 * 1000**0.5, rel=1e-3)
    assert sdc.gradient_statistic([g.bfloat16(), -2 * g], "max_sq").item() == 360000.0
    assert sdc.gradient_statistic([torch.empty(0)], "l2") is None


@pytest.fixture
def single_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_hooks_work_on_fsdp2_wrapped_modules(single_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(5, 4)
    expected = [g.norm().item() for g in manual_gradients(tiny(), x)]
    model = tiny()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[3], mesh=mesh)  # a norm that is itself an FSDP module
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root holds the LayerNorm's parameters
    assert type(model[3]).__name__ == "FSDPMyRMSNorm"
    points = DetectionPoints()
    assert points.install(model) == ["1", "3"]
    loss(model, x).backward()
    assert points.collect().tolist() == pytest.approx(expected, rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_synchronisation_on_cuda():
    model = tiny().cuda()
    points = DetectionPoints(micro_batches=2)
    points.install(model, [("0", "grad_output")])
    outputs = [loss(model, torch.randn(3, 4, device="cuda")) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for output in outputs:
            output.backward()
        values = points.collect()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert values.is_cuda and all(v > 0 for v in values.tolist())


def test_the_reference_llama_is_covered_and_its_gradients_stay_deterministic():
    from trainguard.config.schema import ModelConfig
    from trainguard.trainer.model import build_model, build_model_config

    config = build_model_config(ModelConfig(preset="llama-micro"), max_position_embeddings=16)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def gradients(extra_points=None, norms=True):
        model = build_model(config, seed=0)
        points = DetectionPoints()
        if extra_points is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                points.install(model, extra_points, norms=norms)
                model(input_ids=ids, labels=ids).loss.backward()
        else:
            model(input_ids=ids, labels=ids).loss.backward()
        return points, {name: p.grad for name, p in model.named_parameters()}

    _, plain = gradients()
    points, hooked = gradients(["model.embed_tokens"])
    assert points.names == [f"model.layers.{i}.{n}" for i in range(2)
                            for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm", "model.embed_tokens"]
    assert points.fired == [1] * 6 and all(v > 0 for v in points.collect().tolist())
    _, again = gradients(["model.embed_tokens"])
    assert all(torch.equal(hooked[k], again[k]) for k in hooked)  # deterministic with the hooks in place
    # A grad_input point adds an identity node in front of the norm, so the gradient contributions to the
    # residual stream are summed in another order: the same values up to rounding, not bit for bit.
    for name in plain:
        torch.testing.assert_close(hooked[name], plain[name], rtol=1e-5, atol=1e-7)
    # grad_output points (tensor hooks on outputs) add no node: bit for bit the plain gradients
    _, output_only = gradients(["model.embed_tokens", ("model.norm", "grad_output")], norms=False)
    assert all(torch.equal(output_only[k], plain[k]) for k in plain)


# ------------------------------------------------------------------------------------ end to end
def test_a_scaled_embedding_gradient_is_detected_and_attributed_by_a_rerun():
    """The loop a trainer runs: collect, one .tolist(), detect; on a level-1 detection rerun the step."""
    model = EmbeddingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    points = DetectionPoints()
    names = points.install(model, ["embed_tokens"])
    detector = SdcDetector("v1", names)
    attribution = RerunAttribution(StrikeBook(), host="localhost", device="cpu")
    fault = {"step": 15, "factor": 2.0**20}  # an exponent bit
    state = {"step": 0}

    def corrupt(module, grad_input, grad_output):  # a transient fault in the norm's backward
        if state["step"] == fault["step"]:
            return tuple(g * fault["factor"] if g is not None else None for g in grad_input)
        return None

    model.norm.register_full_backward_hook(corrupt)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 21):
        state["step"] = step
        ids = torch.randint(0, 16, (4, 6), generator=generator)
        optimizer.zero_grad()
        embedding_loss(model, ids).backward()
        detections = detector.detect(points.collect().tolist(), step)
        if step != fault["step"]:
            assert detections == [], f"false alarm at step {step}: {detections}"
            optimizer.step()
            continue
        # the norm's own point sees the corrupted grad_input (a user's full backward hook runs inside the
        # point's view, whenever it was registered), and so does the embedding's, downstream of it
        assert [(d.point, d.level) for d in detections] == [("norm", 1), ("embed_tokens", 1)]
        first = {d.point: d.value for d in detections}
        state["step"] = -1  # the rerun: the transient fault is gone
        optimizer.zero_grad()
        embedding_loss(model, ids).backward()
        rerun_values = points.collect().tolist()
        verdict = attribution.on_detection(step, 0, first, dict(zip(names, rerun_values)))
        assert (verdict.kind, verdict.action, verdict.strikes) == ("transient", "use_rerun", 1)
        assert detector.detect(rerun_values, step) == []  # the rerun is clean and absorbed
        optimizer.step()


def test_the_output_heads_point_sees_a_flip_of_the_logits_gradient_that_no_other_point_flags():
    """Issue 39: a x2^16 flip of one element of the logits' gradient lands in one vocabulary row of the
    lm-head's weight gradient, which on llama-micro is the tied embedding table (exempt from the row
    criterion): 1 of 35 such flips that mattered was detected. The head's grad_output point (the
    default ``lm_head=True``) gives the peak criterion the flipped element itself."""
    from trainguard.config.schema import ModelConfig
    from trainguard.faults.bits import flip_bit
    from trainguard.trainer.model import build_model, build_model_config

    def run(lm_head: bool) -> list[tuple[int, str, str]]:
        model = build_model(build_model_config(ModelConfig(preset="llama-micro"), max_position_embeddings=32), seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        flip_at = 24

        def flip(grad: torch.Tensor) -> torch.Tensor:
            flat = grad.detach().clone().reshape(-1)
            small = ((flat.abs() > 2.0 ** -31) & (flat.abs() < 2.0 ** -15)).nonzero().flatten()
            flip_bit(flat, int(small[len(small) // 2]), 27)  # exponent bit 4 of an element where it is 0: x2^16
            return flat.view_as(grad)

        def arm(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if step == flip_at:
                out.register_hook(flip)

        # registered before the points: the flip happens before the head's point sees the gradient
        model.lm_head.register_forward_hook(arm)
        points = DetectionPoints("l2", shares=True)
        names = points.install(model, blocks=True, lm_head=lm_head)
        assert ("lm_head" in names) == lm_head and (not lm_head or points.where("lm_head") == "grad_output")
        gradients = GradientPoints(model, "l2", shares=True, rows=True)
        detector = SdcDetector("v1", names + gradients.names, peak=0.5, row_jump=100.0)
        generator = torch.Generator().manual_seed(1)
        found = []
        for step in range(1, flip_at + 1):
            tokens = torch.randint(0, 320, (4, 33), generator=generator)
            optimizer.zero_grad(set_to_none=True)
            points.reset()
            logits = model(input_ids=tokens[:, :-1]).logits
            F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)).backward()
            module_part = points.collect(with_shares=True)
            module_part = torch.cat([module_part, torch.full_like(module_part[:1], NOT_CHECKED)])
            values, shares, rows = torch.cat([module_part, gradients.collect(with_shares=True, with_rows=True)],
                                             dim=1).tolist()
            found += [(step, d.point, d.reason) for d in detector.detect(values, step, shares=shares, rows=rows)]
            optimizer.step()
        points.remove()
        return found

    assert run(lm_head=True) == [(24, "lm_head", "peak")]
    assert run(lm_head=False) == []
