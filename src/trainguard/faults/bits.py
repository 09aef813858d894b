"""Bit flips in floating-point tensors, the way a hardware fault corrupts one value.

No I/O. The element's bit pattern is read through an integer view of the same width and xor-ed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatLayout:
    """Where the sign, exponent and mantissa sit in a float format's bit pattern."""

    int_dtype: torch.dtype
    bits: int
    exponent_bits: int
    mantissa_bits: int

    @property
    def sign_bit(self) -> int:
        return self.bits - 1

    @property
    def top_exponent_bit(self) -> int:
        return self.mantissa_bits + self.exponent_bits - 1


LAYOUTS: dict[torch.dtype, FloatLayout] = {
    torch.float32: FloatLayout(torch.int32, 32, exponent_bits=8, mantissa_bits=23),
    torch.bfloat16: FloatLayout(torch.int16, 16, exponent_bits=8, mantissa_bits=7),
    torch.float16: FloatLayout(torch.int16, 16, exponent_bits=5, mantissa_bits=10),
}


@dataclass(frozen=True)
class BitFlip:
    """What a flip did: the element actually hit, the bit, and the value before and after."""

    index: int
    bit: int
    old: float
    new: float


def float_layout(dtype: torch.dtype) -> FloatLayout:
    try:
        return LAYOUTS[dtype]
    except KeyError:
        name = str(dtype).removeprefix("torch.")
        supported = ", ".join(str(d).removeprefix("torch.") for d in LAYOUTS)
        raise ValueError(f"cannot flip bits of a {name} tensor (supported: {supported})") from None


def exponent_flip_bit(pattern: int, layout: FloatLayout) -> int:
    """The highest exponent bit that is 0 in ``pattern``: setting it enlarges the magnitude the most.

    For |x| < 2 that is the top exponent bit (x times 2^128 in fp32/bf16, 2^16 in fp16; for
    1 <= |x| < 2 the result is Inf or NaN, as on real hardware). For Inf/NaN, whose exponent bits
    are all set, nothing can grow: the top exponent bit is flipped.
    """
    for bit in range(layout.top_exponent_bit, layout.mantissa_bits - 1, -1):
        if not (pattern >> bit) & 1:
            return bit
    return layout.top_exponent_bit


def choose_element(tensor: torch.Tensor, index: int) -> int:
    """``index`` unless that element is 0.0, then the first nonzero element after it, wrapping around.

    A zero is skipped because flipping a low bit of 0.0 gives a denormal nobody notices; an all-zero
    tensor keeps ``index``.
    """
    if not 0 <= index < tensor.numel():
        raise ValueError(f"index {index} is outside a tensor of {tensor.numel()} elements")
    flat = tensor.detach().reshape(-1)
    if flat[index] != 0:
        return index
    nonzero = (flat != 0).nonzero().flatten()
    if nonzero.numel() == 0:
        return index
    at_or_after = nonzero[nonzero >= index]
    return int((at_or_after if at_or_after.numel() else nonzero)[0])


def _position(shape: torch.Size, flat_index: int) -> tuple[int, ...]:
    # indexing by position, not through a flat view, also works on non-contiguous tensors
    position = []
    for size in reversed(shape):
        flat_index, coordinate = divmod(flat_index, size)
        position.append(coordinate)
    return tuple(reversed(position))


def flip_bit(tensor: torch.Tensor, index: int = 0, bit: int | str = "exp") -> BitFlip:
    """Flips one bit of one element in place; ``bit`` is a position, ``"exp"`` or ``"sign"``."""
    layout = float_layout(tensor.dtype)
    index = choose_element(tensor, index)
    position = _position(tensor.shape, index)
    element = tensor.detach()[position]
    pattern = int(element.view(layout.int_dtype).item()) & ((1 << layout.bits) - 1)
    if bit == "exp":
        bit = exponent_flip_bit(pattern, layout)
    elif bit == "sign":
        bit = layout.sign_bit
    elif not 0 <= bit < layout.bits:
        raise ValueError(f"bit {bit} does not exist in a {layout.bits}-bit float")
    flipped = pattern ^ (1 << bit)
    if flipped >= 1 << (layout.bits - 1):  # back to the signed integer the view holds
        flipped -= 1 << layout.bits
    new_element = torch.tensor(flipped, dtype=layout.int_dtype).view(tensor.dtype)
    old = element.item()
    with torch.no_grad():
        tensor[position] = new_element.to(tensor.device)
    return BitFlip(index=index, bit=bit, old=old, new=new_element.item())
