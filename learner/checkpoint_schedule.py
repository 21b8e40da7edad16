"""`SaveSchedule`: when the next periodic checkpoint is due.

Apart from the manager because it is pure timekeeping (an injectable clock, no I/O), so a trainer
loop and its tests can reason about it without torch.distributed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shoal.config import check_number


class SaveSchedule:
    """Decides when a periodic checkpoint is due: `interval_s` after the last save (or the start)."""

    def __init__(
        self, interval_s: float = 900.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = check_number("checkpoint.interval_s", interval_s, above=0, unit="seconds")
        self._clock = clock
        self._last = clock()

    def __repr__(self) -> str:
        return f"<SaveSchedule every {self.interval_s:g}s, due in {self.remaining():.1f}s>"

    def remaining(self) -> float:
        """Seconds until the next save is due (0 when it is already due)."""
        return max(0.0, self._last + self.interval_s - self._clock())

    def due(self) -> bool:
        return self.remaining() == 0.0

    def mark_saved(self) -> None:
        """Restart the interval: call after each save, periodic or on demand."""
        self._last = self._clock()
