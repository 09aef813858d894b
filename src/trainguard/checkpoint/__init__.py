"""Checkpoints: layout, atomic file primitives, manifests, verification, retention and discovery."""
