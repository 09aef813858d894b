# The two commands of the README. Each creates or reuses .venv and installs what it needs.
.PHONY: demo test test-fast test-slow test-wheel test-compat lint bootstrap

# Python sources ruff checks ([tool.ruff.lint] in pyproject.toml); run_all has no .py suffix
LINTED = src tests benchmarks benchmarks/run_all tools examples scripts

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	.venv/bin/trainguard demo

# make test's pytest-xdist workers: 1 (the default) runs the suite in one process; PYTEST_WORKERS=2 make test
# shares the files out over two (tests/helpers/suite_schedule.py; not the default: docs/testing.md)
PYTEST_WORKERS ?= 1
WORKERS_OPTION = $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS),-p no:xdist)

# The whole suite, what CI runs (.ci/run): the linter, then every test; installs Chromium and Slurm
# for the report and Slurm tests.
test: lint
	@bash scripts/bootstrap.sh --with-browser --with-slurm --with-torchtitan
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q --durations=15 $(WORKERS_OPTION)

# For a change to a pure rule: the linter and the unit tests, no system packages, a few minutes.
test-fast: bootstrap lint
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q --durations=15 tests/unit

lint: bootstrap
	.venv/bin/ruff check $(LINTED)

test-slow:
	@bash scripts/bootstrap.sh --with-browser --with-slurm --with-torchtitan
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow

# The built wheel alone in a new venv outside the repository runs the drill (not in CI: minutes).
test-wheel:
	@bash scripts/wheel_check.sh

# Not in CI: PyPI's torch wheels are CUDA builds, several GB with their libraries (docs/compat.md).
# TORCH_VERSIONS="2.10.0 2.13.0" make test-compat picks the versions.
test-compat: bootstrap
	python3 scripts/test_compat.py
