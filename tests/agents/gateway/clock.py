"""A hand-driven monotonic clock for the pure routing state machines."""


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
