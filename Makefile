# The two commands of the README. Each creates or reuses .venv and installs what it needs.
.PHONY: demo test test-slow bootstrap

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
