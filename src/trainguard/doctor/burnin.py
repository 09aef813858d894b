"""Compute burn-in: the same matrix product repeated on one device, checked two ways.

Every repetition must be bitwise identical to the first (a checksum of its bytes): a device that
returns a different result for the same inputs is miscomputing, however small the difference. The
first result must agree with a float64 product computed on the CPU within the classical
floating-point error bound ``|C - C64| <= n * 2^-23 * (|A| @ |B|)`` element by element, which catches
a device that is consistently wrong. TF32 is switched off for the burn-in so the bound holds on CUDA.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import xxhash

from trainguard.doctor.report import CheckResult
from trainguard.faults.bits import flip_bit
from trainguard.faults.spec import FaultSpec

UNIT_ROUNDOFF_MARGIN = 2.0**-23  # twice float32's unit roundoff


def _checksum(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_64(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _ranges(reps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    for rep in reps:
        if out and int(out[-1].split("-")[-1]) == rep - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{rep}"
        else:
            out.append(str(rep))
    return ", ".join(out)


def burn_in(device: torch.device, reps: int, size: int, *, seed: int = 0,
            faults: Iterable[FaultSpec] = (), target: str | None = None) -> CheckResult:
    """``reps`` products of two seeded ``size`` x ``size`` float32 matrices on ``device``.

    ``faults``: ``miscompute`` specs meant for this device; each flips a bit of its repetition's result
    (how the doctor's own detection is drilled).
    """
    started = time.perf_counter()
    target = target or str(device)
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    reference = a.double() @ b.double()
    bound = size * UNIT_ROUNDOFF_MARGIN * (a.abs().double() @ b.abs().double())
    perturb = {spec.params["rep"]: spec for spec in faults}
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a_dev, b_dev = a.to(device), b.to(device)
        first_sum: str | None = None
        first: torch.Tensor | None = None
        differing: list[int] = []
        compute = 0.0
        for rep in range(reps):
            tick = time.perf_counter()
            result = a_dev @ b_dev
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            compute += time.perf_counter() - tick
            if rep in perturb:
                flip_bit(result, perturb[rep].params["index"], perturb[rep].params["bit"])
            checksum = _checksum(result)
            if first_sum is None:
                first_sum, first = checksum, result.detach().cpu()
            elif checksum != first_sum:
                differing.append(rep)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    error = (first.double() - reference).abs()
    worst = float((error / bound).max())  # > 1: outside the error bound somewhere
    flops = 2.0 * size**3 * reps
    metrics = {"reps": reps, "size": size, "max_error_over_bound": worst,
               "gflops": flops / compute / 1e9 if compute > 0 else None, "differing_reps": differing}
    problems = []
    if not worst <= 1.0:  # NaN counts as outside
        problems.append(f"rep 0 deviates from the float64 CPU reference ({worst:.3g} x the error bound)")
    if differing:
        many = len(differing) > 1
        problems.append(f"rep{'s' if many else ''} {_ranges(differing)} of {reps} differ{'' if many else 's'} "
                        f"from rep 0 (checksum mismatch)")
    if problems:
        detail = "; ".join(problems)
    else:
        detail = (f"{reps} x {size}x{size} float32 matmul bitwise identical; largest error {worst:.2g} x the "
                  f"float64 error bound")
    return CheckResult("burn-in", target, not problems, detail, time.perf_counter() - started, metrics)
