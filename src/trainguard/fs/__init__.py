"""The ground floor: durable file primitives (fsync, atomic writes and renames) and the names of
the checkpoint layout. Imports nothing of trainguard."""
