"""``make_run_dir``: the one check of ``--run-dir`` for ``trainguard train`` and ``trainguard run``'s live path."""

from __future__ import annotations

import pytest

from trainguard.cli.arguments import make_run_dir
from trainguard.errors import ConfigError


def test_a_new_directory_is_made_and_returned_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made = make_run_dir("runs/a")
    assert made == tmp_path / "runs" / "a" and made.is_dir()
    assert make_run_dir(made) == made  # an existing directory is taken as it is


@pytest.mark.parametrize("case, message", [
    ("empty", "--run-dir '': an empty path"),
    ("file", "exists and is not a directory"),
    ("under a file", "cannot create it"),
])
def test_what_cannot_be_a_run_directory_is_one_config_error(tmp_path, case, message):
    afile = tmp_path / "afile"
    afile.write_text("x")
    path = {"empty": "", "file": afile, "under a file": afile / "run"}[case]
    with pytest.raises(ConfigError, match=message):
        make_run_dir(path)
