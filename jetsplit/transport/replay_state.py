"""The newest command seq each sender got accepted, kept on disk across agent restarts.

A replay window lives in memory, so an agent that restarted would accept a command someone
captured before the restart, as long as its timestamp is within the skew (300 s). The agent
writes the highest accepted seq per sender to its state folder each time it accepts a
command, and a restarted endpoint refuses anything at or below it (`ReplayGuard` floors).
The file is untrusted input like any other: bounded, and a bad one costs its floors (one
log line), never the agent.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Dict

log = logging.getLogger("jetsplit.transport")

MAX_SENDERS = 4096
MAX_FILE_BYTES = 1 << 20
_MAX_SEQ = 1 << 63


class ReplayState:
    """`path` holds {sender: highest accepted seq}; `save` rewrites it atomically."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.floors: Dict[str, int] = {}

    def load(self) -> Dict[str, int]:
        """The floors a previous run saved; {} when none (or the file is unusable)."""
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"over {MAX_FILE_BYTES} bytes")
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.warning("replay state %s unusable (%s): starting without floors", self.path, exc)
            return {}
        self.floors = {str(k): v for k, v in list(data.items())[:MAX_SENDERS]
                       if isinstance(k, str) and len(k) <= 64 and isinstance(v, int)
                       and not isinstance(v, bool) and 0 <= v < _MAX_SEQ}
        return dict(self.floors)

    def save(self, sender: str, seq: int) -> None:
        """Raise `sender`'s floor to `seq` (never lower it) and write the file atomically."""
        if seq <= self.floors.get(sender, -1):
            return
        if sender not in self.floors and len(self.floors) >= MAX_SENDERS:
            self.floors.pop(next(iter(self.floors)))
        self.floors[sender] = seq
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.floors), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not save replay state %s: %s", self.path, exc)
