"""Silent-data-corruption ("feature value") detection: detection points, rules, rerun attribution.

Detection points take one statistic per point per micro-batch from the gradients flowing into the
model's norm layers (plus declared custom points), without a host synchronisation per point. Once
per step the trainer collects them, reads them with one ``.tolist()`` and passes them to the rule
(v1: absolute + jump thresholds on the L2 norm; v3: bias-corrected EMA bound on ``max(g²)``). A
level-1 detection stops the step (``enabled_level >= 2``), the step is rerun, and the rerun decides
whether a transient fault on this rank (use the rerun) or the data/math/a persistent fault (skip)
produced it; strikes per device mark it faulty for exclusion. See ``docs/sdc.md``.

Detections are local to each rank; nothing here communicates. The trainer all-reduces the verdict
(the maximum level over the ranks) so that every rank takes the same decision at the same step.
"""

from trainguard._lazy import lazy_exports

_EXPORTS = {
    "config": ("DEFAULT_SIGMA", "DEFAULT_UPPER", "ENABLE_VARS", "SIGMA_VARS", "UPPER_VARS", "SdcConfig", "parse_pair",
               "sdc_config_from_env"),
    "detectors": ("ABNORMAL", "NOT_CHECKED", "STATISTIC", "Detection", "SdcDetector", "V1Detector", "V3Detector",
                  "SdcLevel", "Severity", "Verdict", "format_detection", "format_values", "severity"),
    "points": ("DetectionPoints", "GradientPoints", "active_points", "block_modules", "gradient_statistic",
               "is_norm_module", "isolated_peak_share", "peak_share", "row_odds",
               "watch_function", "watch_tensor"),
    "rerun": ("Attribution", "FaultyDeviceError", "RerunAttribution", "RerunVerdict", "StrikeBook", "faulty_ranks_path",
              "read_faulty_ranks", "write_faulty_ranks"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
