"""The fault grammar and the bit flips: pure logic, no process, no file."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.errors import ConfigError
from trainguard.faults import FaultSpec, parse_faults
from trainguard.faults.bits import LAYOUTS, choose_element, exponent_flip_bit, flip_bit, float_layout

# --- grammar -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [None, "", "   ", ";", " ; ;"])
def test_no_faults(text):
    assert parse_faults(text) == []


@pytest.mark.parametrize(
    "text, rank, step, persistent, params",
    [
        ("kill:rank=1,step=5", 1, 5, False, {}),
        ("kill:rank=0,step=5,persistent=1", 0, 5, True, {}),
        ("hang:rank=2,step=3", 2, 3, False, {"seconds": None}),
        ("hang:rank=2,step=3,seconds=0.5", 2, 3, False, {"seconds": 0.5}),
        ("spike:step=7", None, 7, False, {"factor": 1e4}),
        ("spike:step=7,factor=-3", None, 7, False, {"factor": -3.0}),
        ("nan:step=4", 0, 4, False, {}),
        ("nan:step=4,rank=3,persistent=true", 3, 4, True, {}),
        (
            "bitflip:rank=1,step=2,site=model.layers.1.input_layernorm,where=grad_input",
            1, 2, False, {"site": "model.layers.1.input_layernorm", "where": "grad_input", "bit": "exp", "index": 0},
        ),
        (
            "bitflip:rank=0,step=2,site=norm,where=output,bit=30,index=17",
            0, 2, False, {"site": "norm", "where": "output", "bit": 30, "index": 17},
        ),
        ("bitflip:rank=0,step=2,site=n,where=output,bit=sign", 0, 2, False, {"site": "n", "where": "output", "bit": "sign", "index": 0}),
        ("scale:rank=0,step=9,site=n,where=output,factor=1e3", 0, 9, False, {"site": "n", "where": "output", "factor": 1e3}),
        ("corrupt:step=10,file=*.pt", None, 10, False, {"file": "*.pt"}),
        ("truncate:step=10,file=huggingface/*", None, 10, False, {"file": "huggingface/*"}),
        ("delete:step=0,file=*", None, 0, False, {"file": "*"}),
    ],
)
def test_each_kind(text, rank, step, persistent, params):
    (spec,) = parse_faults(text)
    assert spec == FaultSpec(index=0, kind=text.split(":")[0], text=text, rank=rank, step=step, persistent=persistent, params=params)


def test_node_is_a_name_for_every_kind_but_wipe_where_it_is_the_local_tier_node_index():
    (flip,) = parse_faults("bitflip:rank=1,node=node1,step=3,site=model.norm,where=output,persistent=1")
    assert flip.params["node"] == "node1" and flip.persistent
    (kill,) = parse_faults("kill:rank=0,step=2,node=7")
    assert kill.params["node"] == "7"  # a host may be named by digits: still a name
    (wipe,) = parse_faults("wipe:node=1,step=4")
    assert wipe.params == {"node": 1}
    with pytest.raises(ConfigError, match="node must be a non-negative integer, got 'node1'"):
        parse_faults("wipe:node=node1,step=4")
    with pytest.raises(ConfigError, match="node must not be empty"):
        parse_faults("kill:rank=0,step=2,node=")


def test_entries_are_indexed_in_order_and_spaces_ignored():
    specs = parse_faults(" kill : rank = 1 , step = 5 ;; spike:step=2 ; ")
    assert [(s.index, s.kind, s.text) for s in specs] == [
        (0, "kill", "kill : rank = 1 , step = 5"),
        (1, "spike", "spike:step=2"),
    ]
    assert specs[0].rank == 1 and specs[0].step == 5


@pytest.mark.parametrize(
    "text, reason",
    [
        ("explode:step=1", "unknown fault kind 'explode'"),
        ("kill rank=1 step=2", "expected <kind>:<key>=<value>"),
        ("kill:rank=1", "missing required key step"),
        ("bitflip:step=1", "missing required keys rank, site, where"),
        ("kill:rank=1,step=2,seconds=3", "unknown key 'seconds' for kill"),
        ("corrupt:step=1,file=*,persistent=1", "unknown key 'persistent' for corrupt"),
        ("kill:rank=1,step=2,step=3", "key 'step' given twice"),
        ("kill:rank=1,step", "expected <key>=<value>, got 'step'"),
        ("kill:rank=1,step=two", "step must be a non-negative integer, got 'two'"),
        ("kill:rank=1,step=2.5", "step must be a non-negative integer"),
        ("kill:rank=-1,step=2", "rank must be a non-negative integer, got '-1'"),
        ("nan:step=-3", "step must be a non-negative integer"),
        ("bitflip:rank=0,step=1,site=n,where=input", "where must be one of grad_input|output, got 'input'"),
        ("bitflip:rank=0,step=1,site=n,where=output,bit=32", "bit must be 0..31, 'exp' or 'sign'"),
        ("bitflip:rank=0,step=1,site=n,where=output,index=x", "index must be a non-negative integer"),
        ("bitflip:rank=0,step=1,site=,where=output", "site must not be empty"),
        ("spike:step=1,factor=big", "factor must be a number, got 'big'"),
        ("spike:step=1,factor=nan", "use the nan fault"),
        ("hang:rank=0,step=1,seconds=-1", "seconds must be a finite number >= 0"),
        ("kill:rank=0,step=1,persistent=yes", "persistent must be 0, 1, true or false"),
        ("scale:rank=0,step=1,site=n,where=output", "missing required key factor"),
        ("delete:step=1,file=", "file must not be empty"),
    ],
)
def test_bad_entries_name_the_entry_and_the_reason(text, reason):
    with pytest.raises(ConfigError) as error:
        parse_faults(f"spike:step=1;{text}")
    message = str(error.value)
    assert reason in message
    assert repr(text) in message
    assert "\n" not in message


_VALID_VALUES = {
    "rank": st.integers(0, 64),
    "step": st.integers(0, 10**6),
    "index": st.integers(0, 10**4),
    "seconds": st.floats(0, 100, allow_nan=False),
    "factor": st.floats(allow_nan=False),
    "site": st.from_regex(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+){0,3}", fullmatch=True),
    "file": st.from_regex(r"[a-z0-9_*?/.\[\]-]+", fullmatch=True),
    "where": st.sampled_from(["grad_input", "output"]),
    "bit": st.one_of(st.integers(0, 15), st.sampled_from(["exp", "sign"])),
    "persistent": st.booleans(),
}
_KEYS = {
    "kill": (["rank", "step"], ["persistent"]),
    "hang": (["rank", "step"], ["seconds", "persistent"]),
    "spike": (["step"], ["factor", "persistent"]),
    "nan": (["step"], ["rank", "persistent"]),
    "bitflip": (["rank", "step", "site", "where"], ["bit", "index", "persistent"]),
    "scale": (["rank", "step", "site", "where", "factor"], ["persistent"]),
    "corrupt": (["step", "file"], []),
    "truncate": (["step", "file"], []),
    "delete": (["step", "file"], []),
}


@st.composite
def _fault_entries(draw):
    kind = draw(st.sampled_from(sorted(_KEYS)))
    required, optional = _KEYS[kind]
    keys = required + [key for key in optional if draw(st.booleans())]
    values = {key: draw(_VALID_VALUES[key]) for key in keys}
    order = draw(st.permutations(keys))
    text = f"{kind}:" + ",".join(f"{key}={int(values[key]) if key == 'persistent' else values[key]}" for key in order)
    return kind, values, text


@settings(deadline=None)
@given(st.lists(_fault_entries(), min_size=1, max_size=5))
def test_round_trip(entries):
    specs = parse_faults(";".join(text for _, _, text in entries))
    assert [spec.index for spec in specs] == list(range(len(entries)))
    for spec, (kind, values, text) in zip(specs, entries):
        assert (spec.kind, spec.text, spec.step) == (kind, text, values["step"])
        assert spec.persistent == values.get("persistent", False)
        assert spec.rank == values.get("rank", 0 if kind == "nan" else None)
        for key, value in spec.params.items():
            assert value == values.get(key, value)
    assert parse_faults(";".join(spec.text for spec in specs)) == specs


_TOKENS = st.sampled_from(
    ["kill", "hang", "spike", "nan", "bitflip", "scale", "corrupt", "delete", ":", ";", ",", "=", "rank", "step",
     "site", "where", "bit", "index", "factor", "seconds", "file", "persistent", "output", "grad_input", "exp",
     "1", "-1", "0.5", "inf", "nan", " ", "x", "*", "1e400", "٣"]
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(_TOKENS, max_size=20).map("".join)))
def test_parse_raises_only_config_error(text):
    try:
        specs = parse_faults(text)
    except ConfigError as error:
        assert "\n" not in str(error)
    else:
        assert all(isinstance(spec, FaultSpec) for spec in specs)


# --- bit flips -----------------------------------------------------------------------------------

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TYPICAL = [0.01, 0.03, 0.1, 0.25, 0.5, 0.9, 1.0, 1.5, 1.99, 2.0, 3.0, 5.0, 7.5, 10.0]


def _pattern(tensor: torch.Tensor) -> int:
    """The unsigned bit pattern of a one-element tensor."""
    layout = float_layout(tensor.dtype)
    return int(tensor.view(layout.int_dtype).item()) & ((1 << layout.bits) - 1)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("value", TYPICAL + [-v for v in TYPICAL])
def test_exp_flip_makes_typical_values_huge(dtype, value):
    tensor = torch.tensor([value], dtype=dtype)
    flip = flip_bit(tensor, 0, "exp")
    layout = float_layout(dtype)
    assert layout.mantissa_bits <= flip.bit <= layout.top_exponent_bit
    if 1 <= abs(flip.old) < 2:
        # the exponent is 0111..1: the only bit that can grow it makes it all ones
        assert not math.isfinite(flip.new)
    elif dtype == torch.float16 and abs(flip.old) >= 2:
        # five exponent bits with the top one already set leave at most 2^8 to gain
        assert abs(flip.new) >= 256 * abs(flip.old)
    else:
        assert abs(flip.new) >= 1000 * abs(flip.old)
    assert math.copysign(1, flip.new) == math.copysign(1, flip.old) or math.isnan(flip.new)
    assert tensor.item() == flip.new or math.isnan(flip.new)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_exp_flip_of_small_value_sets_the_top_exponent_bit(dtype):
    layout = float_layout(dtype)
    assert exponent_flip_bit(_pattern(torch.tensor(0.3, dtype=dtype)), layout) == layout.top_exponent_bit
    assert exponent_flip_bit(_pattern(torch.tensor(float("inf"), dtype=dtype)), layout) == layout.top_exponent_bit


@pytest.mark.parametrize("dtype, sign_bit", [(torch.float32, 31), (torch.bfloat16, 15), (torch.float16, 15)])
def test_sign_flip(dtype, sign_bit):
    for bit in ("sign", sign_bit):
        tensor = torch.tensor([0.75, -2.5], dtype=dtype)
        flip = flip_bit(tensor, 1, bit)
        assert (flip.index, flip.bit, flip.old, flip.new) == (1, sign_bit, -2.5, 2.5)
        assert tensor.tolist() == [0.75, 2.5]


@pytest.mark.parametrize(
    "dtype, expected", [(torch.float32, 1 + 2**-23), (torch.bfloat16, 1 + 2**-7), (torch.float16, 1 + 2**-10)]
)
def test_bit_zero_is_the_lowest_mantissa_bit(dtype, expected):
    assert flip_bit(torch.tensor([1.0], dtype=dtype), 0, 0).new == expected


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@settings(deadline=None)
@given(value=st.floats(width=16, allow_nan=False), bit=st.integers(0, 15))
def test_flipping_twice_restores_the_pattern(dtype, value, bit):
    tensor = torch.tensor([value], dtype=dtype)
    before = _pattern(tensor)
    flip_bit(tensor, 0, bit)
    assert _pattern(tensor) == before ^ (1 << bit)
    flip_bit(tensor, 0, bit)
    assert _pattern(tensor) == before


def test_a_zero_element_is_skipped_for_the_next_nonzero_one_wrapping_around():
    tensor = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.0])
    assert choose_element(tensor, 0) == 1
    assert choose_element(tensor, 3) == 3
    assert choose_element(tensor, 4) == 1
    assert choose_element(torch.zeros(3), 2) == 2
    flip = flip_bit(tensor, 2, "sign")
    assert (flip.index, flip.new) == (3, -0.25)


def test_flip_on_a_non_contiguous_tensor_hits_the_logical_element():
    tensor = torch.arange(1.0, 7.0).reshape(2, 3).t()  # logical order 1 4 2 5 3 6
    flip = flip_bit(tensor, 3, "sign")
    assert flip.old == 5.0
    assert tensor.tolist() == [[1.0, 4.0], [2.0, -5.0], [3.0, 6.0]]


def test_flip_errors():
    with pytest.raises(ValueError, match="outside a tensor of 2 elements"):
        flip_bit(torch.ones(2), 2)
    with pytest.raises(ValueError, match="bit 16 does not exist in a 16-bit float"):
        flip_bit(torch.ones(2, dtype=torch.bfloat16), 0, 16)
    with pytest.raises(ValueError, match="cannot flip bits of a int64 tensor"):
        flip_bit(torch.ones(2, dtype=torch.int64), 0)


def test_layouts_match_torch():
    for dtype, layout in LAYOUTS.items():
        info = torch.finfo(dtype)
        assert layout.bits == info.bits
        assert layout.mantissa_bits == -int(math.log2(info.eps))
