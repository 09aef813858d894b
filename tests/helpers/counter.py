"""A loop's own stateful object (``Guard(stateful=...)``) for unit tests: a counter the loop advances."""


class Counter:
    def __init__(self):
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]
