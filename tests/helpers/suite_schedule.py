"""How ``make test`` shares the suite between pytest-xdist workers (docs/testing.md, "Running the suite
on two workers").

A work unit is a test file, as with ``--dist loadfile`` (a module's fixtures run once), except that the
files sharing a costly session fixture, or a cache one of them installs, are one unit: a session fixture
runs once per worker, so their tests on two workers would start it twice. The units go out longest
first (the longest ones measured on two workers, the others in collection order: the integration
modules, then the short unit-test files that fill the end), so no long module starts last, alone.
"""

from __future__ import annotations

# files that must run on one worker, by what they share
SAME_WORKER = {
    # the session fixture ``slurm`` (tests/integration/conftest.py): one Slurm cluster, eight slurmd
    "slurm": ("test_slurm.py", "test_live_slurm.py", "test_live_train_hosts.py"),
    # the session fixture ``live_fsdp_clean``: the fault-free live FSDP2 run both compare with
    "live_fsdp_clean": ("test_live_fsdp.py", "test_live_fsdp_sdc.py"),
    # helpers/verl_env.py installs verl once into a directory under the system's temporary directory
    "verl": ("test_verl_checkpoints.py", "test_verl_interop.py"),
}
INTEGRATION = "tests/integration/"
# the units started first, longest first (seconds of their tests on two workers, idle machine)
LONGEST_FIRST = ("slurm",)


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its file, or the name of the group its file belongs to."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(INTEGRATION):
        name = path.removeprefix(INTEGRATION)
        for group, files in SAME_WORKER.items():
            if name in files:
                return group
    return path


def schedule_rank(nodeid: str) -> int:
    """Where a test's unit goes out: ``LONGEST_FIRST``'s units by their place there, the rest after them
    in collection order (sorted by this rank, stably, every test keeps its place inside its unit)."""
    unit = unit_of(nodeid)
    return LONGEST_FIRST.index(unit) if unit in LONGEST_FIRST else len(LONGEST_FIRST)


def make_scheduler(config, log):
    """pytest-xdist's scheduler with the units above (imported here: only a run with workers has xdist).
    The units go out in the workers' collection order, which tests/conftest.py sorts by ``schedule_rank``
    (the controller hands out tests by their index in that collection, so it must not reorder them)."""
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    # LoadScopeScheduling otherwise puts the units with the most tests first (the unit-test files)
    config.option.loadscopereorder = False
    return SuiteScheduling(config, log)
