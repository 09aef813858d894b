"""Switches of silent-data-corruption detection: the ``SdcConfig`` dataclass and its environment aliases.

Levels (``enabled_level``, the reference's ``NPU_ASD_ENABLE``):

==  ======================================================================================
0   off: no hooks are installed, nothing is computed
1   detect and log (level-1 detections are logged at ERROR, level-2 at WARNING); training goes on
2   detect, and on a level-1 detection stop the step and recover (rerun attribution, skip or use
    the rerun's gradients, strikes); level-2 detections are logged
3   as 2, plus every check's value is logged (INFO) at every step
==  ======================================================================================

Environment (the environment wins over the config; trainguard's names win over the reference's):

==========================  ===========================  =====================
trainguard                  reference alias              config key
==========================  ===========================  =====================
TRAINGUARD_SDC_ENABLE       NPU_ASD_ENABLE               enabled_level
TRAINGUARD_SDC_UPPER_THRESH NPU_ASD_UPPER_THRESH         upper
TRAINGUARD_SDC_SIGMA_THRESH NPU_ASD_SIGMA_THRESH         sigma
==========================  ===========================  =====================

A variable that is unset or blank is ignored. A threshold pair is two decimal integers, each at
least 3, the first larger than the second, separated by one comma (``"1000000,10000"``); anything
else is a ``ConfigError`` naming the variable and the value, never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.errors import ConfigError

RULES = ("v1", "v3")
LEVELS = (0, 1, 2, 3)

DEFAULT_UPPER = (1000000, 10000)
DEFAULT_SIGMA = (100000, 5000)
PAIR_MINIMUM = 3

# (trainguard's name, the reference's alias), in precedence order
ENABLE_VARS = ("TRAINGUARD_SDC_ENABLE", "NPU_ASD_ENABLE")
UPPER_VARS = ("TRAINGUARD_SDC_UPPER_THRESH", "NPU_ASD_UPPER_THRESH")
SIGMA_VARS = ("TRAINGUARD_SDC_SIGMA_THRESH", "NPU_ASD_SIGMA_THRESH")

_PAIR = re.compile(r"\s*([0-9]+)\s*,\s*([0-9]+)\s*")
_LEVEL = re.compile(r"\s*([0-3])\s*")


@dataclass
class SdcConfig:
    enabled_level: int = 0  # 0 off, 1 detect+log, 2 detect+stop the step+recover, 3 as 2 + log every value
    rule: str = "v1"  # "v1" (L2 norm, absolute + jump thresholds) | "v3" (max g², bias-corrected EMA bound)
    upper: tuple[int, int] = DEFAULT_UPPER  # v1 absolute thresholds (level 1, level 2)
    sigma: tuple[int, int] = DEFAULT_SIGMA  # v1 jump thresholds (level 1, level 2)
    rerun: bool = True  # on a level-1 detection (enabled_level >= 2) rerun the step to attribute it
    strikes: int = 3  # strikes within the window that mark a device faulty
    strike_window_hours: float = 8.0
    points: list[str] = field(default_factory=list)  # extra detection points: dotted module names
    # trainguard's ratio criterion, on top of either rule: after the warm-up, level 1 when a point's value
    # exceeds ratio x the max of its last 16 clean values (v3: ratio**2, max(g²) being a square); 0 = off
    ratio: float = 0.0
    # trainguard's peak criterion, on top of either rule: after the warm-up, level 1 when one element
    # carries more than this share of the point's squared L2 norm (max(g²)/Σg²: the mark of one blown-up
    # element, i.e. a bit flip) and the value is over 4x the median of its last 16 clean values
    # (v3: 16x); 0 = off (the reference's rules alone). On by default: without it the rules miss x2^16
    # flips of small elements that do change the loss, and at 0.5 it raised no false alarm
    # (benchmarks/README.md, sdc_detection.py)
    peak: float = 0.5
    # trainguard's row criterion, on the parameter-gradient points of weight matrices: after the warm-up,
    # level 1 when one row (output channel) carries over 10x the energy of all other rows together and
    # that ratio is over row_jump x its median over the point's last 16 clean checks. A flipped element
    # of a layer's output gradient lands in one row of its weight's gradient (the flip times the token's
    # input), however it spreads in the activation gradients; with v1 also its joint test (row odds over
    # 1 and 20x their median, the L2 norm over 4x its median: detectors.py); 0 = off (benchmarks/RESULTS.md)
    row_jump: float = 100.0
    # detection points beyond the norm layers: every transformer block's output gradient, and every
    # parameter's gradient as the optimizer sees it (after the reduction)
    blocks: bool = True
    gradients: bool = True
    # the gradient at the output head's output (the logits'; ``get_output_embeddings()``): a flipped
    # element of it lands in one vocabulary row of the head's weight gradient, which for a tied table is
    # the embedding's and exempt from the row criterion (issue 39: 1 of 35 such flips that mattered was
    # detected without it); the peak criterion finds it here
    lm_head: bool = True
    # the loss scale the gradients carry (fp16 training): statistics are divided by it before the rules
    # look at them; 1 = none. A loop with a dynamic scale passes the current one to the check instead
    loss_scale: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.enabled_level > 0

    @property
    def recover(self) -> bool:
        """A level-1 detection stops the step (levels 2 and 3)."""
        return self.enabled_level >= 2

    @property
    def log_values(self) -> bool:
        """Every check's value is logged (level 3)."""
        return self.enabled_level >= 3

    def validate(self) -> None:
        """Raises ConfigError naming the first bad key; normalises ``upper``/``sigma`` lists to tuples."""
        level = self.enabled_level
        if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
            raise ConfigError(f"config key guards.sdc.enabled_level (NPU_ASD_ENABLE) must be 0, 1, 2 or 3, got {level!r}")
        if self.rule not in RULES:
            raise ConfigError(f"config key guards.sdc.rule must be 'v1' or 'v3', got {self.rule!r}")
        self.upper = parse_pair(self.upper, "config key guards.sdc.upper (NPU_ASD_UPPER_THRESH)")
        self.sigma = parse_pair(self.sigma, "config key guards.sdc.sigma (NPU_ASD_SIGMA_THRESH)")
        if not isinstance(self.rerun, bool):
            raise ConfigError(f"config key guards.sdc.rerun must be true or false, got {self.rerun!r}")
        strikes = self.strikes
        if isinstance(strikes, bool) or not isinstance(strikes, int) or strikes < 1:
            raise ConfigError(f"config key guards.sdc.strikes must be a positive integer, got {strikes!r}")
        hours = self.strike_window_hours
        if isinstance(hours, bool) or not isinstance(hours, (int, float)) or not math.isfinite(hours) or hours <= 0:
            raise ConfigError(f"config key guards.sdc.strike_window_hours must be a positive number, got {hours!r}")
        points = self.points
        if not isinstance(points, (list, tuple)) or not all(isinstance(p, str) and p for p in points):
            raise ConfigError(f"config key guards.sdc.points must be a list of module names, got {points!r}")
        self.points = list(points)
        for key, example in (("ratio", ""), ("row_jump", " (e.g. 100)")):
            factor = getattr(self, key)
            if (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor)
                    or not (factor == 0 or factor > 1)):
                raise ConfigError(f"config key guards.sdc.{key} must be 0 (off) or a finite number > 1{example}, "
                                  f"got {factor!r}")
            setattr(self, key, float(factor))
        peak = self.peak
        if (isinstance(peak, bool) or not isinstance(peak, (int, float)) or not math.isfinite(peak)
                or not (peak == 0 or 0 < peak < 1)):
            raise ConfigError(f"config key guards.sdc.peak must be 0 (off) or a share between 0 and 1 "
                              f"(e.g. 0.5), got {peak!r}")
        self.peak = float(peak)
        for key in ("blocks", "gradients", "lm_head"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"config key guards.sdc.{key} must be true or false, got {getattr(self, key)!r}")
        scale = self.loss_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ConfigError(f"config key guards.sdc.loss_scale must be a positive number, got {scale!r}")
        self.loss_scale = float(scale)


def parse_pair(value: Any, what: str) -> tuple[int, int]:
    """A threshold pair from ``"A,B"`` or a sequence of two integers; A > B >= 3.

    ``what`` names the source in the error (``"environment variable NPU_ASD_UPPER_THRESH"``).
    """
    pair: tuple[int, int] | None = None
    if isinstance(value, str):
        match = _PAIR.fullmatch(value)
        if match:
            pair = (int(match.group(1)), int(match.group(2)))
    elif isinstance(value, Sequence) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        pair = (int(value[0]), int(value[1]))
    if pair is None or pair[1] < PAIR_MINIMUM or pair[0] <= pair[1]:
        raise ConfigError(
            f"{what} must be two integers >= {PAIR_MINIMUM}, the first larger than the second "
            f"(e.g. \"1000000,10000\"), got {value!r}"
        )
    return pair


def _lookup(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        text = environ.get(name)
        if text is not None and text.strip():
            return name, text
    return None


def sdc_config_from_env(base: SdcConfig, environ: Mapping[str, str] = os.environ) -> SdcConfig:
    """``base`` with the environment's overrides applied, validated (``base`` is left untouched).

    For each setting the first set, non-blank variable of (``TRAINGUARD_SDC_*``, ``NPU_ASD_*``) wins
    over the config; only the variable in force is parsed.
    """
    changes: dict[str, Any] = {}
    found = _lookup(environ, ENABLE_VARS)
    if found is not None:
        name, text = found
        match = _LEVEL.fullmatch(text)
        if not match:
            raise ConfigError(f"environment variable {name} must be 0, 1, 2 or 3, got {text!r}")
        changes["enabled_level"] = int(match.group(1))
    for key, names in (("upper", UPPER_VARS), ("sigma", SIGMA_VARS)):
        found = _lookup(environ, names)
        if found is not None:
            name, text = found
            changes[key] = parse_pair(text, f"environment variable {name}")
    points = list(base.points) if isinstance(base.points, (list, tuple)) else base.points  # a copy; bad ones fail below
    config = dataclasses.replace(base, points=points, **changes)
    config.validate()
    return config
