"""Checks of the ``checkpoint.mirror`` section (``MirrorConfig``, in ``checkpoint.config``): ranges, and a client
for the URL's protocol."""

from __future__ import annotations

from trainguard.checkpoint.config import MirrorConfig


def validate_mirror_config(config: MirrorConfig, source: str) -> None:
    """Range checks, and that a client for the URL's protocol is installed (exit 2 otherwise)."""
    from trainguard.errors import ConfigError

    for key in ("every", "keep_every", "bandwidth_mbps", "workers"):
        value = getattr(config, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{source}: config key 'checkpoint.mirror.{key}' must be > 0, got {value!r}")
    if config.url is not None:
        from trainguard.backup.url import check_mirror_url

        try:
            check_mirror_url(config.url)
        except ConfigError as exc:
            raise ConfigError(f"{source}: config key 'checkpoint.mirror.url': {exc}") from None
