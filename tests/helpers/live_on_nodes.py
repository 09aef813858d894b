"""Test fixture: runs ``trainguard.live.launcher.launch`` where it is started (the head namespace, for
the store to be on the head's address) and writes its result as JSON.

    python tests/helpers/live_on_nodes.py RUN_DIR RESULT_JSON LIVE_RUN_JSON   (LiveRun's fields)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from trainguard.live.launcher import LiveRun, launch


def main() -> None:
    run_dir, result_path, fields = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    run = LiveRun(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    result_path.write_text(json.dumps(dataclasses.asdict(launch(run_dir, run))))


if __name__ == "__main__":
    main()
