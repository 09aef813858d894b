"""Gradient norms: the true global norm under FSDP2/HSDP/TP in one collective."""

from trainguard.norms.global_norm import KnownNorms, clip_grad_norm_, clip_grads_, global_norm_and_sums, local_sq_sum
from trainguard.norms.local_norm import local_grad_norms

__all__ = ["KnownNorms", "clip_grad_norm_", "clip_grads_", "global_norm_and_sums", "local_grad_norms", "local_sq_sum"]
