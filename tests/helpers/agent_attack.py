"""A client that reaches the node agents' control ports and does not hold the run secret (issue 40).

    python tests/helpers/agent_attack.py CONTROL_FILE...   (the files where the agents wrote their address)

Sends each agent every request it knows (stop, the signals, ping) bare, with a forged proof, and
garbage; prints one JSON list of the answers (None where the agent gave none). Plain sockets only, so it
runs in any network namespace without importing torch.
"""

from __future__ import annotations

import json
import socket
import sys
import time

REQUESTS = [b"stop\n", b"signal USR1\n", b"signal USR2\n", b"ping\n",
            f"stop proof={time.time():.3f}:00:{'0' * 64}\n".encode(), b"\xff\x00 stop\n"]


def ask(address: str, line: bytes) -> dict | None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as connection:
            connection.sendall(line)
            answer = connection.makefile("r").readline()
    except OSError:
        return None
    return json.loads(answer) if answer else None


def main() -> None:
    addresses = [open(path).read().strip() for path in sys.argv[1:]]
    print(json.dumps([ask(address, line) for address in addresses for line in REQUESTS]))


if __name__ == "__main__":
    main()
