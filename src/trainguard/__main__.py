import logging
import os
import sys

from trainguard.runtime import early_signals

if early_signals.supervises(sys.argv[1:], os.environ):  # before the seconds of imports below and in main()
    early_signals.hold()

from trainguard.cli import main  # noqa: E402  (after the signals are held)

code = main()
# Every command has finished its work when main() returns (files closed, threads and children waited
# for); the interpreter's teardown with torch and transformers loaded would add about a second more
# to each command, and to each restart of a supervised node agent (which ends the same way).
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
