"""The self-test's default amounts of work, in a module without torch: ``trainguard doctor --help`` shows them."""

DEFAULT_REPS = 20  # burn-in repetitions
DEFAULT_STORAGE_MB = 64  # MiB written per checkpoint directory
