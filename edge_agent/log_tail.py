"""The agent's last log lines in memory, so `jetsplit fleet logs AGENT` can show them over
MQTT without a shell on the device (bounded: a few hundred short lines)."""

from __future__ import annotations

import logging
import threading
from collections import deque

MAX_LINES = 200
MAX_LINE_CHARS = 500


class LogTail(logging.Handler):
    """A logging handler that keeps the last `capacity` formatted records."""

    def __init__(self, capacity: int = MAX_LINES) -> None:
        super().__init__(level=logging.INFO)
        self._lines: deque = deque(maxlen=capacity)
        self._guard = threading.Lock()
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record).replace("\n", " | ")[:MAX_LINE_CHARS]
        except Exception:  # noqa: BLE001 - a broken record must not break logging
            return
        with self._guard:
            self._lines.append(line)

    def lines(self, count: int) -> list[str]:
        """The last `count` lines, oldest first."""
        with self._guard:
            items = list(self._lines)
        return items[-count:] if count > 0 else []
