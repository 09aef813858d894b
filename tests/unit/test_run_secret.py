"""The per-run secret (``trainguard.run_secret``): created owner-only, loaded from the environment or
the run directory, refused when others could read it; store values sealed per key; control requests
proved with a time and a nonce, refused without a valid proof, stale or replayed."""

from __future__ import annotations

import os
import stat

import pytest

from trainguard.errors import EXIT_USAGE
from trainguard.run_secret import (ENV_SECRET, MAX_SKEW_S, OwnerOnlyError, RequestCheck, SecretError, create_secret,
                                   load_secret, open_value, owner_only_dir, prove_request, seal_value, secret_path)


@pytest.fixture
def permissive_umask():
    """A umask that lets others read: the modes made must not depend on it."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_secret_is_created_owner_only_and_loaded_back(tmp_path, permissive_umask):
    secret = create_secret(tmp_path / "run")
    path = secret_path(tmp_path / "run")
    assert (_mode(path), _mode(path.parent)) == (0o600, 0o700)
    assert len(secret) == 32 and load_secret(tmp_path / "run", environ={}) == secret
    assert create_secret(tmp_path / "run") != secret  # a new one per launch
    assert load_secret(tmp_path / "elsewhere", environ={ENV_SECRET: secret.hex()}) == secret  # the ranks' way


def test_a_missing_malformed_or_readable_secret_is_one_error_naming_the_file(tmp_path):
    with pytest.raises(SecretError, match="no run secret") as missing:
        load_secret(tmp_path, environ={})
    assert str(secret_path(tmp_path)) in str(missing.value) and missing.value.exit_code == EXIT_USAGE
    create_secret(tmp_path)
    os.chmod(secret_path(tmp_path), 0o644)
    with pytest.raises(OwnerOnlyError, match=r"closed to other users \(found uid \d+, mode 0644\)"):
        load_secret(tmp_path, environ={})
    os.chmod(secret_path(tmp_path), 0o600)
    os.chmod(secret_path(tmp_path).parent, 0o755)
    with pytest.raises(OwnerOnlyError, match="the run secret.s directory must be"):
        load_secret(tmp_path, environ={})
    with pytest.raises(SecretError, match=f"\\${ENV_SECRET}: not a run secret"):
        load_secret(tmp_path, environ={ENV_SECRET: "pwned"})


def test_an_owner_only_directory_is_made_0700_and_an_open_one_closed(tmp_path, permissive_umask):
    assert _mode(owner_only_dir(tmp_path / "new", "a test directory")) == 0o700
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    assert _mode(owner_only_dir(tmp_path / "open", "a test directory")) == 0o700


def test_a_value_opens_only_under_its_key_with_the_secret():
    secret, other = os.urandom(32), os.urandom(32)
    sealed = seal_value(secret, "report/0/1", b"12")
    assert open_value(secret, "report/0/1", sealed) == b"12"
    assert open_value(secret, "report/0/2", sealed) is None  # copied under another key
    assert open_value(other, "report/0/1", sealed) is None
    assert open_value(secret, "report/0/1", sealed[:-1] + b"3") is None  # altered
    for garbage in (b"pwned", b"", b"tg1:", b"tg1:" + b"0" * 64 + b":12", os.urandom(100)):
        assert open_value(secret, "report/0/1", garbage) is None


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_request_is_accepted_once_with_a_valid_fresh_proof():
    secret, clock = os.urandom(32), Clock()
    check = RequestCheck(secret, clock)
    line = prove_request(secret, "signal USR1", now=clock.now)
    verdict = check.check(line)
    assert (verdict.words, verdict.refused) == (["signal", "USR1"], None)
    assert check.check(line).refused == "a replayed proof"
    assert check.check(prove_request(secret, "signal USR1", now=clock.now)).refused is None  # a new nonce


@pytest.mark.parametrize("line, why", [
    ("stop", "no proof of the run secret"),
    ("", "no proof of the run secret"),
    ("stop proof=abc", "a malformed proof"),
    ("stop proof=1000000.000:00:" + "0" * 64, "a bad proof (not made with this run's secret)"),
])
def test_a_request_without_a_valid_proof_is_refused(line, why):
    assert RequestCheck(os.urandom(32), Clock()).check(line).refused == why


def test_a_proof_made_with_another_secret_or_for_another_request_is_refused():
    secret, clock = os.urandom(32), Clock()
    check = RequestCheck(secret, clock)
    assert check.check(prove_request(os.urandom(32), "stop", now=clock.now)).refused.startswith("a bad proof")
    words = prove_request(secret, "ping", now=clock.now).split()
    assert check.check(f"stop {words[-1]}").refused.startswith("a bad proof")  # ping's proof on a stop


def test_a_stale_or_future_proof_is_refused():
    secret, clock = os.urandom(32), Clock()
    check = RequestCheck(secret, clock)
    assert "old" in check.check(prove_request(secret, "stop", now=clock.now - MAX_SKEW_S - 1)).refused
    assert "old" in check.check(prove_request(secret, "stop", now=clock.now + MAX_SKEW_S + 1)).refused


def test_a_directory_reached_through_a_symlink_is_judged_by_its_target(tmp_path, permissive_umask):
    """A node's local directory is often a symlink to scratch space: the target is made owner-only."""
    (tmp_path / "scratch").mkdir(mode=0o755)
    (tmp_path / "local").symlink_to(tmp_path / "scratch")
    owner_only_dir(tmp_path / "local", "a test directory")
    assert _mode(tmp_path / "scratch") == 0o700
