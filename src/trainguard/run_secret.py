"""The per-run secret, and the proofs made with it: whoever holds it may drive the run's control surfaces.

A run's launcher (the live launcher, the supervisor) creates it at launch: 32 random bytes, written as
hex to ``RUN_DIR/.trainguard/secret`` (mode 0600, in a 0700 directory, owned by this user, created
with those modes: never readable by another user, not even for an instant) and handed to the live
run's ranks in their environment (``ENV_SECRET``); never on a command line, which any local user
reads in ``/proc``. Node agents on other hosts read the file from the run's shared directory.

Two kinds of proof:

- a **request** (a node agent's control line, ``runtime/agent_control.py``): its words, then
  ``proof=<time>:<nonce>:<hmac>``, the HMAC-SHA256 over the words, the time and the nonce. The receiver
  refuses a request without one, with a bad one, one older or newer than ``MAX_SKEW_S``, or a nonce it
  has already seen (a replay), with one reason (``RequestCheck``);
- a **value** (a live store value, ``live/signed_store.py``): ``tg1:<hmac>:<value>``, the HMAC over
  the key and the value, so a value signed for one key is not valid under another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.errors import ConfigError

ENV_SECRET = "TRAINGUARD_RUN_SECRET"
SECRET_DIR = ".trainguard"
SECRET_FILE = "secret"
SECRET_BYTES = 32
MAX_SKEW_S = 300.0  # a request older or newer than this (by the sender's clock) is refused: the hosts' clocks must agree
# within it (NTP keeps them within milliseconds); a refusal says by how much they did not
VALUE_TAG = b"tg1:"
_MAC_HEX = 64  # SHA-256's digest in hex


class SecretError(ConfigError):
    """No usable run secret: missing or malformed (exit 2, one line naming the file or variable)."""


class OwnerOnlyError(ConfigError):
    """A file or directory that must be this user's alone is not (exit 2, one line naming it)."""


def secret_path(run_dir: Path) -> Path:
    return Path(run_dir) / SECRET_DIR / SECRET_FILE


def require_owner_only(path: Path, what: str) -> None:
    """Raises ``OwnerOnlyError`` unless ``path`` belongs to this user and no other user may read, write or
    enter it (a directory 0700, a file 0600 or stricter)."""
    info = os.stat(path)  # a symlink is judged by what it points to (a node directory may be one)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise OwnerOnlyError(f"{path}: {what} must be owned by uid {os.geteuid()} and closed to other users "
                             f"(found uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})")


def owner_only_dir(path: Path, what: str) -> Path:
    """``path`` as a directory only this user may enter: made 0700 if new, checked if it exists."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)  # the mode applies to the last part, umask aside
    if os.stat(path).st_uid == os.geteuid():
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & 0o700)
    require_owner_only(path, what)
    return path


def create_secret(run_dir: Path) -> bytes:
    """A new secret for this launch, written to ``secret_path(run_dir)`` (replacing an older launch's)."""
    directory = owner_only_dir(Path(run_dir) / SECRET_DIR, "the run secret's directory")
    secret = secrets.token_bytes(SECRET_BYTES)
    temporary = directory / f".{SECRET_FILE}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older leftover of the same name kept its mode through O_TRUNC
        os.write(fd, secret.hex().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, directory / SECRET_FILE)
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
    return secret


def load_secret(run_dir: Path, environ: dict[str, str] | None = None) -> bytes:
    """The run's secret: from ``ENV_SECRET`` when the launcher handed it down, else from the run
    directory's file, whose directory and file must be owner-only (``OwnerOnlyError`` otherwise); ``SecretError``
    when there is none or it is malformed."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_SECRET):
        return _decode(environ[ENV_SECRET], f"${ENV_SECRET}")
    path = secret_path(run_dir)
    if not path.exists():
        raise SecretError(f"{path}: no run secret (the run's launcher creates it; ${ENV_SECRET} is not set either)")
    require_owner_only(path.parent, "the run secret's directory")
    require_owner_only(path, "the run secret")
    return _decode(path.read_text().strip(), str(path))


def _decode(text: str, source: str) -> bytes:
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise SecretError(f"{source}: not a run secret (expected {SECRET_BYTES * 2} hex digits)")
    return secret


def mac(secret: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 of ``parts``, each length-prefixed (so no two lists of parts sign alike), in hex."""
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------ store values
def seal_value(secret: bytes, key: str, value: bytes) -> bytes:
    return VALUE_TAG + mac(secret, b"value", key.encode(), value).encode() + b":" + value


def open_value(secret: bytes, key: str, sealed: bytes) -> bytes | None:
    """The value ``seal_value`` sealed for ``key``; None for anything else (unsealed, another key's, altered)."""
    head = len(VALUE_TAG)
    if not sealed.startswith(VALUE_TAG) or len(sealed) < head + _MAC_HEX + 1 or sealed[head + _MAC_HEX:][:1] != b":":
        return None
    value = sealed[head + _MAC_HEX + 1:]
    expected = mac(secret, b"value", key.encode(), value).encode()
    return value if hmac.compare_digest(expected, sealed[head:head + _MAC_HEX]) else None


# ------------------------------------------------------------------------------------ requests
def prove_request(secret: bytes, request: str, now: float | None = None) -> str:
    """``request`` with its proof appended: the line to send."""
    stamp, nonce = f"{time.time() if now is None else now:.3f}", secrets.token_hex(16)
    return f"{request} proof={stamp}:{nonce}:{mac(secret, b'request', request.encode(), stamp.encode(), nonce.encode())}"


@dataclass(frozen=True)
class RequestVerdict:
    words: list[str]  # the request without its proof
    refused: str | None  # why it is refused; None: accepted


@dataclass
class RequestCheck:
    """The receiver's side: remembers the nonces of the last ``2 × MAX_SKEW_S`` to refuse replays."""
    secret: bytes
    clock: Callable[[], float] = time.time
    seen: dict[str, float] = field(default_factory=dict)  # nonce -> its request's time

    def check(self, line: str) -> RequestVerdict:
        words = line.split()
        if not words or not words[-1].startswith("proof="):
            return RequestVerdict(words, "no proof of the run secret")
        request, proof = " ".join(words[:-1]), words[-1].removeprefix("proof=")
        stamp, _, rest = proof.partition(":")
        nonce, _, signature = rest.partition(":")
        try:
            sent = float(stamp)
        except ValueError:
            return RequestVerdict(words[:-1], "a malformed proof")
        expected = mac(self.secret, b"request", request.encode(), stamp.encode(), nonce.encode())
        if not hmac.compare_digest(expected.encode(), signature.encode()):
            return RequestVerdict(words[:-1], "a bad proof (not made with this run's secret)")
        now = self.clock()
        if not abs(now - sent) <= MAX_SKEW_S:
            return RequestVerdict(words[:-1], f"a proof {now - sent:+.0f} s old (more than {MAX_SKEW_S:.0f} s)")
        self.seen = {n: t for n, t in self.seen.items() if now - t <= 2 * MAX_SKEW_S}
        if nonce in self.seen:
            return RequestVerdict(words[:-1], "a replayed proof")
        self.seen[nonce] = sent
        return RequestVerdict(words[:-1], None)
