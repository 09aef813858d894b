"""trainguard: keeps large-model training runs alive and their checkpoints trustworthy."""

__version__ = "0.1.0"
