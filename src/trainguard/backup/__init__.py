"""Backups of committed checkpoints to object storage (any fsspec URL), restore, and mirror retention."""
