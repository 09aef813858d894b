"""A mirror location from a URL: the fsspec file system, its root path, and one-line errors.

Credentials come from where the storage client looks for them (for S3: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``~/.aws/credentials``, instance roles); trainguard
never reads, prints or logs them. The S3 endpoint is ``checkpoint.mirror.endpoint_url`` (or
``--endpoint-url``), else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from trainguard.errors import CheckpointError, ConfigError

# Connection failures fail fast rather than after the client's default minute of retries.
_S3_CLIENT_CONFIG = {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 3, "mode": "standard"}}
_USERINFO = re.compile(r"(?<=://)[^/@]*@")


class MirrorError(CheckpointError):
    """The mirror cannot be reached or used; the message is one line and never holds a secret."""


def is_url(text: str | None) -> bool:
    return bool(text) and "://" in text


def redact(url: str) -> str:
    """``url`` without any ``user:password@`` part, for messages and events."""
    return _USERINFO.sub("***@", url)


@dataclass
class Mirror:
    """A mirror root: ``fs`` and ``root`` (the URL's path as fsspec names it), and the URL as shown."""

    fs: Any
    root: str
    url: str

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *parts])

    @property
    def is_s3(self) -> bool:
        protocol = self.fs.protocol
        return "s3" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def endpoint_from_env() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def check_mirror_url(url: str) -> None:
    """``ConfigError`` (exit 2) for a URL no installed client can open. Nothing is connected or started:
    an fsspec client of an async protocol starts an event-loop thread, and a process that checks its
    config before it forks the ranks' fork server must still have one thread."""
    import fsspec

    if not is_url(url):
        raise ConfigError(f"mirror URL {url!r}: expected PROTOCOL://PATH, such as s3://bucket/prefix or file:///path")
    protocol, location = url.split("://", 1)
    if not location.strip("/"):
        raise ConfigError(f"mirror URL {redact(url)}: names no location (a bucket or a directory)")
    if protocol in ("file", "local") and not location.startswith("/"):
        # fsspec would take it relative to the working directory, which differs between a run and its restart
        raise ConfigError(f"mirror URL {redact(url)}: file:// takes an absolute path (file:///path)")
    if protocol in ("s3", "s3a") and location.startswith("/"):
        raise ConfigError(f"mirror URL {redact(url)}: names no bucket (s3://bucket/prefix)")
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        raise ConfigError(f"mirror URL {redact(url)}: no client for {protocol}:// is installed ({exc})") from None
    except ValueError as exc:
        raise ConfigError(f"mirror URL {redact(url)}: {exc}") from None


def open_mirror(url: str, endpoint_url: str | None = None) -> Mirror:
    """The mirror at ``url``; ``ConfigError`` (exit 2) for a URL no installed client can open."""
    import fsspec

    check_mirror_url(url)
    protocol = url.split("://", 1)[0]
    options: dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        endpoint = endpoint_url or endpoint_from_env()
        if endpoint:
            options["endpoint_url"] = endpoint
        options["config_kwargs"] = dict(_S3_CLIENT_CONFIG)
        # A cached instance would keep the credentials it was made with after the environment changed.
        options["skip_instance_cache"] = True
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise ConfigError(f"mirror URL {redact(url)}: no client for {protocol}:// is installed ({exc})") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"mirror URL {redact(url)}: {exc}") from None
    return Mirror(fs=fs, root=root.rstrip("/") or root, url=redact(url.rstrip("/")))


def describe_error(exc: BaseException, mirror_url: str) -> str:
    """One line saying what went wrong with the mirror, naming the URL; never a credential."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    name = type(exc).__name__
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "SignatureDoesNotMatch" in text \
            or "InvalidAccessKeyId" in text:
        return (f"{mirror_url}: access denied ({text}); check the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the credentials file)")
    if "NoSuchBucket" in text or "specified bucket does not exist" in text:
        return f"{mirror_url}: the bucket does not exist"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") \
            or isinstance(exc, ConnectionError) or "Could not connect to the endpoint" in text:
        return f"{mirror_url}: cannot reach the storage endpoint ({text})"
    if isinstance(exc, FileNotFoundError):
        return f"{mirror_url}: not found ({text})"
    return f"{mirror_url}: {name}: {text}"


def check_reachable(mirror: Mirror) -> None:
    """Fails early with one clear line when the mirror's bucket or directory cannot be listed."""
    try:
        if mirror.is_s3:
            bucket = mirror.root.split("/", 1)[0]
            mirror.fs.ls(bucket, detail=False)
        elif not mirror.fs.exists(mirror.root):
            mirror.fs.makedirs(mirror.root, exist_ok=True)
    except Exception as exc:
        raise MirrorError(describe_error(exc, mirror.url)) from None
