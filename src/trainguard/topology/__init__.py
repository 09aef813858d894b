"""Topology: mesh degrees, rank coordinates and the device mesh."""

from trainguard.topology.layout import MESH_DIMS, Layout, resolve_layout

__all__ = ["MESH_DIMS", "Layout", "resolve_layout"]
