"""The checkpoint tiers: the commit, manifests, verification, the durable and local tiers, roles, retention,
discovery and resume, and ``CheckpointManager``."""
