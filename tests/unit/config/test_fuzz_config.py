"""Hostile and careless configuration input (issue 24): each refused with one ConfigError line naming
the file, key or value (exit 2), never a hang or a traceback."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import yaml

from trainguard.config import load_config
from trainguard.config.load import MAX_YAML_DEPTH, BoundedYamlLoader, load_yaml
from trainguard.errors import ConfigError

from helpers.mounts import tmpfs

LAUGHS = "\n".join(
    ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
)


def _mapping_level(i: int) -> str:
    below = "m0" if i == 1 else f"m{i - 1}"
    return f"m{i}: &m{i} {{" + ", ".join(f"k{j}: *{below}" for j in range(9)) + "}"


MAPPING_LAUGHS = "m0: &m0 {x: 1, y: 2, z: 3}\n" + "\n".join(_mapping_level(i) for i in range(1, 9))

SHORT_LAUGHS = "\n".join(LAUGHS.splitlines()[:7])  # 54 aliases, 9**7 values

BAD_FILES = {
    "billion laughs": (LAUGHS, "more than 64 aliases"),
    "billion laughs under a known key": (LAUGHS.replace("l8:", "faults:"), "more than 64 aliases"),
    "billion laughs in a mapping": (MAPPING_LAUGHS, "more than 64 aliases"),
    "laughs with few aliases": (SHORT_LAUGHS, "values once its aliases are expanded"),
    "deeply nested lists": ("a: " + "[" * 5000 + "]" * 5000, "nested deeper than"),
    "deeply nested mappings": ("".join(f"{' ' * i}k{i}:\n" for i in range(200)) + " " * 200 + "v: 1\n", "nested deeper than"),
    "duplicate key": ("train:\n  steps: 3\n  steps: 4\n", "duplicate key 'steps' at line 3"),
    "duplicate section": ("train: {steps: 3}\ntrain: {steps: 4}\n", "duplicate key 'train'"),
    "not UTF-8": (b"train:\n  steps: \xff\xfe\n", "not UTF-8"),
    "binary": (bytes(range(256)) * 4, "not UTF-8"),
    "too large": ("#" * (2 << 20), "larger than"),
    "not YAML": ("train: [\n", "not valid YAML"),
    "a list": ("- 1\n- 2\n", "must hold a mapping"),
    "float for an int": ("train: {steps: 10.0}\n", "'train.steps' must be int"),
    "bool for an int": ("train: {steps: true}\n", "'train.steps' must be int"),
    "1e400 for an int": ("train: {steps: 1e400}\n", "'train.steps' must be int"),
    ".inf for an int": ("train: {steps: .inf}\n", "'train.steps' must be int"),
    ".nan for a float": ("optim: {lr: .nan}\n", "'optim.lr' must be float"),
    "-.inf for a float": ("optim: {lr: -.inf}\n", "'optim.lr' must be float"),
    "400-digit integer": ("train: {steps: " + "9" * 400 + "}\n", "must fit in 64 bits"),
    "negative 400-digit integer": ("data: {seed: -" + "9" * 400 + "}\n", "must fit in 64 bits"),
    "hidden_size 1e23": ("model: {hidden_size: 1e23}\n", "'model.hidden_size' must be int"),
    "hidden_size 10**23": ("model: {hidden_size: 100000000000000000000000}\n", "must fit in 64 bits"),
    "hidden_size 10**11": ("model: {hidden_size: 100000000000}\n", "'model.hidden_size' must be ≤"),
    "num_layers 10**9": ("model: {num_layers: 1000000000}\n", "'model.num_layers' must be ≤"),
}


def _write(tmp_path, content) -> str:
    path = tmp_path / "config.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


@pytest.mark.parametrize(("content", "message"), BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_config_file_is_one_line_naming_what_is_wrong(tmp_path, content, message):
    path = _write(tmp_path, content)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    text = str(caught.value)
    assert message in text and "\n" not in text, text
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.hidden_size=1e23", "must be int"),
        ("model.hidden_size=100000000000", "must be ≤"),
        ("train.steps=" + "9" * 400, "must fit in 64 bits"),
        ("train.steps=1e400", "must be int"),
        ("train.steps=.inf", "must be int"),
        ("train.steps=2.5", "must be int"),
        ("train.steps=false", "must be int"),
        ("optim.lr=.nan", "must be float"),
        ("train.steps=[" + "[" * 100 + "]" * 101, "nested deeper than"),
        ("checkpoint.mirror.url=bogus://x", "mirror URL"),
        ("faults=nonsense:step=1", "unknown fault kind"),
    ],
)
def test_a_bad_override_is_one_line(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_config_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    path = tmp_path / "config.yaml"
    os.mkfifo(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(str(path))


def test_deep_brackets_are_refused_at_the_first_one_too_many():
    # without the scanner's own check, the composer refused at depth 33 only after the scanner had read
    # every bracket ahead, in time that grows faster than the input (0.5 s for 100,000 under load)
    loader = BoundedYamlLoader("a: " + "[" * 10_000)
    with pytest.raises(yaml.YAMLError, match="nested deeper than 32 levels"):
        loader.get_single_node()
    assert loader.flow_level == MAX_YAML_DEPTH


def test_a_few_aliases_still_work():
    assert load_yaml("a: &n 7\nb: [*n, *n]\n") == {"a": 7, "b": [7, 7]}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200))
def test_random_yaml_never_escapes_as_anything_but_a_config_error(tmp_path, seed):
    rng = random.Random(seed)
    alphabet = list(":-[]{}&*!|>'\"#%@`, \n\t") + ["train", "steps", "model", "hidden_size", "1e400", ".inf",
                                                       "9" * 30, "true", "~", "&a", "*a", "<<"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200)))
    path = _write(tmp_path, text)
    try:
        load_config(path)
    except ConfigError as exc:
        assert "\n" not in str(exc)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only file system."""
    with tmpfs(tmp_path / "read-only", "size=64k,ro") as mount_point:
        yield mount_point


def _train(capsys, *args, run_dir: str) -> tuple[int, str]:
    from trainguard.cli import main

    code = main(["train", "--nproc", "2", "--run-dir", run_dir, *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.err.strip()


CLI_BAD_INPUTS = {  # issue 24's table, as `trainguard train` is given them: (file content, flags, env, expected)
    "billion laughs": (LAUGHS, [], {}, "more than 64 aliases"),
    "billion laughs in a mapping": (MAPPING_LAUGHS, [], {}, "more than 64 aliases"),
    "binary": (bytes(range(256)) * 4, [], {}, "not UTF-8"),
    "not UTF-8": (b"train:\n  steps: \xff\n", [], {}, "not UTF-8"),
    "very deeply nested": ("a: " + "[" * 100000 + "]" * 100000, [], {}, "nested deeper than"),
    "400-digit integer": ("train: {steps: " + "9" * 400 + "}\n", [], {}, "must fit in 64 bits"),
    "duplicate keys": ("train:\n  steps: 3\n  steps: 4\n", [], {}, "duplicate key 'steps'"),
    "float for an int": (None, ["--set", "train.steps=3.0"], {}, "'train.steps' must be int"),
    "bool for an int": (None, ["--set", "train.steps=true"], {}, "'train.steps' must be int"),
    "1e400 for an int": (None, ["--set", "train.steps=1e400"], {}, "'train.steps' must be int"),
    ".inf for an int": (None, ["--set", "train.steps=.inf"], {}, "'train.steps' must be int"),
    "hidden_size 1e23": (None, ["--set", "model.hidden_size=1e23"], {}, "'model.hidden_size' must be int"),
    "hidden_size 10**11": (None, ["--set", "model.hidden_size=100000000000"], {}, "'model.hidden_size' must be ≤"),
    "mirror URL of no protocol known": (None, ["--set", "checkpoint.mirror.url=bogus://x"], {}, "mirror URL bogus://x"),
    "mirror URL naming nothing": (None, ["--set", "checkpoint.mirror.url=file://"], {}, "names no location"),
    "mirror URL relative": (None, ["--set", "checkpoint.mirror.url=file://backups"], {}, "absolute path"),
    "mirror URL without bucket": (None, ["--set", "checkpoint.mirror.url=s3:///x"], {}, "names no bucket"),
    "fault rank outside the world": (None, ["--set", "faults=kill:rank=2,step=1"], {}, "rank 2 is outside the world size 2"),
    "fault rank outside the world (env)": (None, [], {"TRAINGUARD_FAULTS": "hang:rank=7,step=1"}, "TRAINGUARD_FAULTS"),
    "NPU_ASD_UPPER_THRESH too large": (None, [], {"NPU_ASD_UPPER_THRESH": "9" * 30 + ",1"}, "NPU_ASD_UPPER_THRESH"),
}


@pytest.mark.parametrize(("content", "flags", "env", "message"), CLI_BAD_INPUTS.values(), ids=CLI_BAD_INPUTS.keys())
def test_trainguard_train_refuses_bad_input_in_one_line_before_starting(tmp_path, capsys, monkeypatch, content,
                                                                        flags, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = (["--config", _write(tmp_path, content)] if content is not None else []) + flags
    run_dir = tmp_path / "run"
    code, err = _train(capsys, *args, run_dir=str(run_dir))
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not run_dir.exists()


def _run_dir(tmp_path: Path, where: str, request) -> str:
    if where == "''":
        return ""
    if where == "under a file":
        (tmp_path / "a-file").write_text("x")
        return str(tmp_path / "a-file" / "run")
    if where == "in /proc":
        return "/proc/trainguard-run"
    return str(request.getfixturevalue("read_only_dir") / "run")


@pytest.mark.parametrize("where", ["''", "under a file", "in /proc", "read-only"])
def test_a_run_directory_that_cannot_be_is_one_line(tmp_path, capsys, request, where):
    code, err = _train(capsys, run_dir=_run_dir(tmp_path, where, request))
    assert code == 2 and len(err.splitlines()) == 1 and "--run-dir" in err, err
