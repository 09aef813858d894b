"""Code that ends a stand-in rank as a finished live rank ends: its end marked in the launcher's store.

The live launcher takes a rank's exit 0 for the run's end only once the rank wrote its final state or the
quorum recorded its stop (``quorum.done_key``); a stand-in that says what it found and exits 0 without it
is a rank that ended before the first step. Appended to a stand-in's source, it reads ``--store`` and
``--run-dir`` from the arguments the launcher gave it."""

MARK_FINISHED = r"""
import sys as _sys
from datetime import timedelta as _timedelta
from pathlib import Path as _Path
import torch.distributed as _dist
from trainguard.live.quorum import done_key as _done_key
from trainguard.live.signed_store import SignedStore as _SignedStore
from trainguard.run_secret import load_secret as _load_secret
_host, _port = _sys.argv[_sys.argv.index("--store") + 1].rsplit(":", 1)
_store = _SignedStore(_dist.TCPStore(_host, int(_port), is_master=False, timeout=_timedelta(seconds=30)),
                      _load_secret(_Path(_sys.argv[_sys.argv.index("--run-dir") + 1])))
_store.set(_done_key(int(_sys.argv[_sys.argv.index("--rank") + 1])), "1")
"""
