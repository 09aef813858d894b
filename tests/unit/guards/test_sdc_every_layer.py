"""Detection points beyond norms: every transformer block's output gradient, every parameter's gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainguard.guards import sdc
from trainguard.guards.sdc import NOT_CHECKED, DetectionPoints, GradientPoints, block_modules


class DecoderLayer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class FusedLayer(nn.Module):  # no norm module at all: the norm is fused into the block's code
    def __init__(self, dim: int):
        super().__init__()
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.mlp(x / x.norm(dim=-1, keepdim=True))


class Stack(nn.Module):
    def __init__(self, layer=DecoderLayer, n: int = 3, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(layer(dim) for _ in range(n))
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))  # not blocks: Linear
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x + self.experts[0](x))


@pytest.fixture(autouse=True)
def no_active_points():
    yield
    active = sdc.active_points()
    if active is not None:
        active.remove()


def test_blocks_are_the_layer_members_of_module_lists():
    assert [name for name, _ in block_modules(Stack())] == ["layers.0", "layers.1", "layers.2"]


def test_block_points_check_the_gradient_at_each_block_output():
    model = Stack()
    points = DetectionPoints("l2")
    names = points.install(model, blocks=True)
    assert names == ["layers.0.norm", "layers.1.norm", "layers.2.norm", "layers.0", "layers.1", "layers.2"]
    x = torch.randn(4, 8)
    outputs = []
    h = x
    for layer in model.layers:  # the same forward by hand, keeping each block's output gradient
        h = layer(h)
        h.retain_grad()
        outputs.append(h)
    model.head(h + model.experts[0](h)).sum().backward()
    expected = [torch.linalg.vector_norm(o.grad).item() for o in outputs]
    model.zero_grad()
    points.reset()
    model(x).sum().backward()
    values = points.collect().tolist()
    assert values[3:] == pytest.approx(expected, rel=1e-6)


def test_a_fused_norm_model_gets_block_points_only():
    points = DetectionPoints("l2")
    assert points.install(Stack(FusedLayer)) == []  # norms alone: nothing to check on this model
    assert points.install(Stack(FusedLayer), blocks=True) == ["layers.0", "layers.1", "layers.2"]


@pytest.mark.parametrize("shares", [False, True])
def test_gradient_points_measure_every_parameter_gradient(shares):
    model = Stack()
    points = GradientPoints(model, "l2", shares=shares)
    assert points.names[:2] == ["grad:layers.0.norm.weight", "grad:layers.0.norm.bias"]
    model(torch.randn(4, 8)).sum().backward()
    model.experts[1].weight.grad = None  # a parameter without a gradient is not checked
    collected = points.collect(with_shares=shares)
    values = (collected[0] if shares else collected).tolist()
    params = [p for _, p in model.named_parameters()]
    for value, parameter in zip(values, params):
        expected = NOT_CHECKED if parameter.grad is None else torch.linalg.vector_norm(parameter.grad).item()
        assert value == pytest.approx(expected, rel=1e-6)
    if shares:  # no share for a small parameter: one element may legitimately carry its gradient
        assert collected[1].tolist() == [NOT_CHECKED] * len(params)


def test_gradient_points_give_a_large_parameter_its_peak_share():
    model = nn.Linear(128, 64)
    model(torch.randn(2, 128)).sum().backward()
    with torch.no_grad():
        model.weight.grad[3, 5] = 1e6
    shares = GradientPoints(model, "l2", shares=True).collect(with_shares=True)[1].tolist()
    assert shares[0] == pytest.approx(1.0, abs=1e-6) and shares[1] == NOT_CHECKED


def test_a_matrix_measured_by_rows_gets_its_norm_and_an_exact_peak_share_above_one_half():
    torch.manual_seed(0)
    model = nn.Linear(128, 64)
    model(torch.randn(2, 128)).sum().backward()
    by_rows = GradientPoints(model, "l2", shares=True, rows=True)
    plain = GradientPoints(model, "l2", shares=True)
    grad = model.weight.grad
    for planted in (None, 1e-2, 1e6):
        if planted is not None:
            grad[3, 5] = planted
        true_share = (grad.abs().max() ** 2 / grad.square().sum()).item()
        values, shares, _ = by_rows.collect(with_shares=True, with_rows=True).tolist()
        reference_values, reference_shares = plain.collect(with_shares=True).tolist()
        assert values == pytest.approx(reference_values, rel=1e-6)
        # the largest row's largest element: the true share when it is above 1/2, never above it
        assert shares[0] <= true_share * (1 + 1e-6)
        if true_share > 0.5:
            assert shares[0] == pytest.approx(reference_shares[0], rel=1e-6)
    assert shares[0] == pytest.approx(1.0, abs=1e-6) and shares[1] == NOT_CHECKED


def test_matrix_statistics_read_each_matrix_by_its_rows():
    grad = torch.tensor([[3.0, 4.0], [0.0, -4.5], [1.0, 0.0]])  # rows' energies 25, 20.25, 1
    conv = torch.zeros(2, 3, 2, 2)
    conv[1, 0, 0, 0] = -2.0
    norms, peaks, odds = sdc.points.matrix_statistics([grad, grad.t(), conv], [False, True, False])
    assert norms.tolist() == pytest.approx([grad.norm().item(), grad.norm().item(), 2.0])
    # max|g| of the row with the most energy (4, not the 4.5 of another row); a Conv1D's rows are columns
    assert peaks.tolist() == [4.0, 4.0, 2.0]
    assert odds.tolist() == pytest.approx([25 / 21.25, 25 / 21.25, sdc.points.ROW_ODDS_MAX])


def test_gradient_points_give_v3_the_largest_square():
    model = Stack()
    model(torch.randn(4, 8)).sum().backward()
    values = GradientPoints(model, "max_sq").collect().tolist()
    assert values[0] == pytest.approx(model.layers[0].norm.weight.grad.abs().max().item() ** 2, rel=1e-6)


def test_row_odds_are_the_largest_rows_energy_over_the_other_rows():
    grad = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])  # rows' squared norms 25, 1, 4
    assert sdc.row_odds(grad).item() == pytest.approx(25 / 5)
    assert sdc.row_odds(torch.zeros(3, 2)).item() == 0.0
    assert sdc.row_odds(torch.tensor([[1.0, 1.0], [0.0, 0.0]])).item() == pytest.approx(sdc.points.ROW_ODDS_MAX)  # one row
    conv = torch.zeros(4, 2, 3, 3)
    conv[1] = 1.0  # more dimensions: rows are the first one's slices
    conv[2, 0, 0, 0] = 3.0
    assert sdc.row_odds(conv).item() == pytest.approx(18 / 9)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 16, bias=False)

    def get_output_embeddings(self):  # as Hugging Face models name their head
        return self.out

    def forward(self, ids):
        return self.out(self.norm(self.proj(self.embed(ids))))


@pytest.mark.parametrize("shares", [False, True])
def test_gradient_points_give_row_odds_to_weight_matrices_only(shares):
    model = TinyLM()
    points = GradientPoints(model, "l2", shares=shares, rows=True)
    assert points.names == ["grad:embed.weight", "grad:proj.weight", "grad:proj.bias", "grad:norm.weight",
                            "grad:norm.bias", "grad:out.weight"]
    model(torch.randint(0, 16, (2, 5))).sum().backward()
    collected = points.collect(with_shares=shares, with_rows=True)
    assert collected.shape == (2 + shares, 6)
    # embedding tables (input and output) and vectors get none; the projection's matrix gets its own
    rows = collected[-1].tolist()
    assert rows[:1] + rows[2:] == [NOT_CHECKED] * 5
    assert rows[1] == pytest.approx(sdc.row_odds(model.proj.weight.grad).item())
    assert collected[0].tolist() == pytest.approx(points.collect().tolist())
    with pytest.raises(ValueError, match="rows=True"):
        GradientPoints(model, "l2").collect(with_rows=True)


def test_a_flipped_output_gradient_element_makes_its_weights_row_odds_jump():
    """The row criterion's premise, on a real backward: one element of a layer's output gradient
    multiplied by 2^16 puts the layer's weight gradient's energy into one row."""
    torch.manual_seed(1)
    layer = nn.Linear(64, 64)
    x = torch.randn(128, 64)
    target = torch.randn(128, 64)

    def odds(flip: bool) -> float:
        layer.zero_grad()
        out = layer(x)
        if flip:
            out.register_hook(lambda g: g.index_put((torch.tensor(17), torch.tensor(40)), g[17, 40] * 2.0 ** 16))
        ((out - target) ** 2).mean().backward()
        return GradientPoints(layer, "l2", rows=True).collect(with_rows=True)[-1, 0].item()

    clean, flipped = odds(False), odds(True)
    assert clean < 1.0
    assert flipped > sdc.detectors.ROW_ODDS_FLOOR and flipped > 100 * clean


def test_a_transposed_linear_gets_the_odds_of_its_output_channels():
    """Hugging Face's GPT-2 Conv1D stores its weight [in, out]: a flipped output-gradient element
    lands in a column, and the columns are what its row odds measure."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(2)
    layer = Conv1D(48, 32)  # 32 inputs, 48 outputs: weight [32, 48]
    out = layer(torch.randn(64, 32))
    out.register_hook(lambda g: g.index_put((torch.tensor(5), torch.tensor(7)), g[5, 7] * 2.0 ** 16))
    (out ** 2).mean().backward()
    odds = GradientPoints(layer, "l2", rows=True).collect(with_rows=True)[-1, 0].item()
    assert odds == pytest.approx(sdc.row_odds(layer.weight.grad.t()).item())
    assert odds > sdc.detectors.ROW_ODDS_FLOOR
    assert sdc.row_odds(layer.weight.grad).item() < 1.0  # its first dimension (inputs) sees nothing
