"""Run inside a network namespace of its own whose kernel hands out only the ports of
``ip_local_port_range`` (``tests/unit/runtime/test_local_nodes.py`` sets it): two runs' ``LocalNodes``
take their rendezvous endpoints at once, in two threads, holding them as a run does until its slot-0 store
binds. Prints one JSON line: ``{"ports": [...]}``, each run's port or its error (``"OSError 98"``)."""

from __future__ import annotations

import json
import threading

from trainguard.runtime.nodes import LocalNodes


def main() -> None:
    runs = [LocalNodes(2), LocalNodes(2)]
    ports: list[int | str | None] = [None, None]
    both_ready = threading.Barrier(2)

    def take(index: int) -> None:
        both_ready.wait()
        try:
            ports[index] = int(runs[index].endpoint("node0").rpartition(":")[2])
        except OSError as error:
            ports[index] = f"OSError {error.errno}"

    threads = [threading.Thread(target=take, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"ports": ports}))


if __name__ == "__main__":
    main()
