"""examples/hf_trainer.py with accelerate's FSDP turned on for CPU ranks (gloo), which accelerate itself
never does: it turns FSDP on only on accelerators (a CPU run with an FSDP plugin stays ``MULTI_CPU``,
and the Trainer runs DDP). Here ``AcceleratorState`` takes the plugin it was given on CPU as well, so
the rest is accelerate's own FSDP2 path (``fsdp2_prepare_model``: ``fully_shard`` per decoder layer,
the optimizer switched to the DTensor parameters) under ``GuardedTrainer``: what the CPU tests can
run of the path a GPU runs. Arguments: the example's (pass ``--fsdp``)."""

from __future__ import annotations

import sys
from pathlib import Path

import accelerate.state
from accelerate.utils import DistributedType

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hf_trainer  # noqa: E402

accelerators_only = accelerate.state.AcceleratorState.__init__


def taking_the_fsdp_plugin_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    accelerators_only(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP  # what accelerate sets for MULTI_GPU with a plugin
        self.fsdp_plugin = fsdp_plugin


if __name__ == "__main__":
    accelerate.state.AcceleratorState.__init__ = taking_the_fsdp_plugin_on_cpu
    hf_trainer.main()
