"""``torchrun`` under the supervisor, without its traceback when the ranks stopped on purpose.

When the first rank to fail exited with a code it chose (``policy.MEANINGFUL_EXIT_CODES``: a config
error, the data-skip abort, no checkpoint, a resumable stop, faulty hardware) and the others did too or were ended by
torchrun after it, each has said why in one line and the supervisor says what it does next in one more; torchrun's own ``ChildFailedError``
traceback and failure table (about 40 lines, on every planned stop) repeat nothing, and its exit code
1 hides the ranks' code. ``python -m trainguard.runtime.quiet_torchrun ARGS`` is ``torchrun ARGS``
that, in that case alone, prints nothing more and exits with the ranks' code; any other failure (a
crash, a signal) keeps torchrun's report. The supervisor starts it in place of the ``torchrun`` of
the same installation (``quiet``); the command it shows and records stays the user's.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
from pathlib import Path

from trainguard.runtime.policy import MEANINGFUL_EXIT_CODES, exit_code_of


def quiet(command: list[str]) -> list[str]:
    """``command`` with a leading ``torchrun`` that this interpreter runs (its ``#!`` line names it: the
    installation that can import trainguard) replaced by this module; any other command as is."""
    if not command or Path(command[0]).name != "torchrun":
        return list(command)
    found = shutil.which(command[0])
    if found is None or interpreter_of(Path(found)) != Path(sys.executable).absolute():
        return list(command)
    return [sys.executable, "-m", __name__, *command[1:]]


def interpreter_of(script: Path) -> Path | None:
    """The interpreter a script's ``#!`` line names (None for a binary or no such line)."""
    try:
        with script.open("rb") as file:
            first = file.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    return Path(words[0]).absolute() if words else None


def planned_stop_code(root_cause: int, others: list[int]) -> int | None:
    """The code to exit with when the first rank to fail (``root_cause``, torchrun's) chose its code and
    every other failed rank chose its own too or was ended by torchrun (SIGTERM, once the first had
    failed); None otherwise."""
    if root_cause not in MEANINGFUL_EXIT_CODES:
        return None
    if any(code not in MEANINGFUL_EXIT_CODES and code != -signal.SIGTERM for code in others):
        return None
    return exit_code_of([root_cause, *others])


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # the agent's "failed (exitcode: 16) local_rank: 0" line: the failure table below repeats it for a
    # crash, and for a planned stop the rank's own line said more
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    sys.argv[0] = "torchrun"
    try:
        torchrun_main()
    except ChildFailedError as failed:
        root_rank, root = failed.get_first_failure()
        code = planned_stop_code(root.exitcode, [failure.exitcode for rank, failure in failed.failures.items()
                                                 if rank != root_rank])
        if code is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
