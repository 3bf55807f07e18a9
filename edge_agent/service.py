"""systemd integration without dependencies: `Type=notify` readiness and the watchdog.

The protocol is one datagram per state to the unix socket in `$NOTIFY_SOCKET` ("@" means
the abstract namespace). With `WatchdogSec=` systemd sets `$WATCHDOG_USEC`; the agent then
sends `WATCHDOG=1` from its main loop every half interval, so a hung loop gets restarted.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("jetsplit.agent")


class SystemdNotifier:
    """Talks to systemd when run under it; every call is a no-op otherwise."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path
        self.interval_s: float | None = None
        pid = env.get("WATCHDOG_PID")
        usec = env.get("WATCHDOG_USEC", "")
        if usec.isdigit() and int(usec) > 0 and (pid is None or pid == str(os.getpid())):
            self.interval_s = int(usec) / 2e6  # ping at half the timeout
        self._last_ping = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, state: str) -> bool:
        """Send one state line (e.g. READY=1); False when not under systemd or on error."""
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(state.encode(), self.address)
            return True
        except OSError as exc:
            log.warning("systemd notify failed: %s", exc)
            return False

    def ready(self, status: str = "") -> None:
        self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def tick(self) -> None:
        """Called from the main loop: a watchdog ping when half the interval has passed."""
        if self.interval_s is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.interval_s:
            self._last_ping = now
            self.notify("WATCHDOG=1")
