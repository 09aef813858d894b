"""The ``checkpoint.mirror`` section: where and how often committed checkpoints are backed up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MirrorConfig:
    url: str | None = None  # any fsspec URL (s3://bucket/prefix, file:///path, ...); None: no mirror
    every: int = 1  # mirror committed checkpoints whose step is a multiple of this (1 = every one)
    keep_every: int | None = None  # in the mirror keep only multiples of this step (and the newest); None = all
    bandwidth_mbps: float | None = None  # upload cap in megabytes (10^6 bytes) per second; None = no cap
    endpoint_url: str | None = None  # S3-compatible endpoint; default AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    workers: int = 4  # files uploaded at once


def validate_mirror_config(config: MirrorConfig, source: str) -> None:
    """Range checks, and that a client for the URL's protocol is installed (exit 2 otherwise)."""
    from trainguard.errors import ConfigError

    for key in ("every", "keep_every", "bandwidth_mbps", "workers"):
        value = getattr(config, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{source}: config key 'checkpoint.mirror.{key}' must be > 0, got {value!r}")
    if config.url is not None:
        from trainguard.backup.url import open_mirror

        try:
            open_mirror(config.url, config.endpoint_url)
        except ConfigError as exc:
            raise ConfigError(f"{source}: config key 'checkpoint.mirror.url': {exc}") from None
