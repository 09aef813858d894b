"""The local tier: every rank writes its own shard state, without communication, to a fast and possibly
node-local directory; lost or corrupt files are restored from replicas (online or offline)."""
