# The two commands of the README. Each creates or reuses .venv and installs what it needs.
.PHONY: demo test test-slow test-compat bootstrap

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	.venv/bin/trainguard demo

test:
	@bash scripts/bootstrap.sh --with-browser --with-slurm
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q

test-slow:
	@bash scripts/bootstrap.sh --with-browser --with-slurm
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow

# Not in CI: PyPI's torch wheels are CUDA builds, several GB with their libraries (docs/compat.md).
# TORCH_VERSIONS="2.10.0 2.13.0" make test-compat picks the versions.
test-compat: bootstrap
	python3 scripts/test_compat.py
