"""Live progress of a running trial: a rich display on a terminal, plain lines elsewhere.

`jetsplit trial` calls `update(row)` once per round with the metrics row it just wrote and
`agent_states(...)` whenever the registry sees an agent change state (possibly from the MQTT
thread, hence the lock). On a terminal the display shows round i/R, accuracy, traffic so far,
the last round's time and a per-agent table; in CI or a pipe, where a live display would
spew control codes, it prints one plain line per round instead. All state is per instance.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from jetsplit.server.defences.untrusted_numbers import finite
from jetsplit.server.report.replan import moves_text

STATE_STYLES = {"online": "green", "busy": "yellow", "offline": "red"}
AGENT_FIELDS = (("compute s", "compute_s", ".2f"), ("transfer s", "transfer_s", ".2f"),
                ("wait s", "wait_s", ".2f"), ("RSS MB", "rss_mb", ".0f"),
                ("CPU %", "cpu_percent", ".0f"), ("°C", "temperature_c", ".1f"))


def _pct(value: Any) -> str:
    v = finite(value)
    return "n/a" if v is None else f"{100 * v:.2f}%"


def _cell(value: Any, spec: str) -> str:
    v = finite(value)
    return "—" if v is None else format(v, spec)


class TrialProgress:
    """Per-round progress of a trial of `rounds` rounds; use as a context manager."""

    def __init__(self, rounds: int, *, title: str = "trial", file: TextIO | None = None,
                 live: bool | None = None, console: Console | None = None) -> None:
        """Writes to `console`, else to `file` (default stdout); `live` defaults to
        whether that output is a terminal."""
        self.rounds, self.title = rounds, title
        self._console = console or Console(file=file if file is not None else sys.stdout)
        self._file: TextIO = self._console.file
        self.live = self._console.is_terminal if live is None else live
        self._lock = threading.RLock()
        self._live: Live | None = None
        self._row: dict[str, Any] = {}
        self._done = 0
        self._bytes_up = 0.0
        self._bytes_down = 0.0
        self._agents: dict[str, dict[str, Any]] = {}
        self._states: dict[str, str] = {}

    def __enter__(self) -> TrialProgress:
        if self.live:
            with self._lock:
                self._live = Live(self._render(), console=self._console,
                                  refresh_per_second=4)
                self._live.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            if self._live is not None:
                self._live.update(self._render(), refresh=True)
                self._live.stop()
                self._live = None

    # ------------------------------------------------------------------ inputs

    def update(self, row: Mapping[str, Any]) -> None:
        """A round finished: remember its row, then redraw (or print its line)."""
        with self._lock:
            self._row = dict(row)
            self._done += 1
            self._count_bytes(row)
            agents = row.get("agents")
            for agent, info in (agents.items() if isinstance(agents, Mapping) else ()):
                if isinstance(info, Mapping):
                    self._agents[str(agent)] = dict(info)
                    if isinstance(info.get("state"), str):
                        self._states[str(agent)] = info["state"]
            line = self.line()
            if self._live is None:
                if not self.live:
                    print(line, file=self._file, flush=True)
            else:
                self._live.console.print(line, markup=False, highlight=False)
                self._live.update(self._render())

    def agent_states(self, states: Mapping[str, str]) -> None:
        """Agents changed state (any time, any thread); shown live, or in the next line."""
        with self._lock:
            self._states.update({str(a): str(s) for a, s in states.items()})
            if self._live is not None:
                self._live.update(self._render())

    def _count_bytes(self, row: Mapping[str, Any]) -> None:
        """Traffic so far: the engine's running totals when the row has them, else the sum
        of the per-round training bytes."""
        up, down = finite(row.get("bytes_up_total")), finite(row.get("bytes_down_total"))
        self._bytes_up = up if up is not None else self._bytes_up + (
            finite(row.get("bytes_up")) or 0.0)
        self._bytes_down = down if down is not None else self._bytes_down + (
            finite(row.get("bytes_down")) or 0.0)

    # ------------------------------------------------------------------ output

    def _round_no(self) -> int:
        r = self._row.get("round")
        return int(r) + 1 if isinstance(r, int) and not isinstance(r, bool) else self._done

    def line(self) -> str:
        """The plain one-line summary of the last round."""
        row = self._row
        if not row:
            return f"{self.title}: waiting for round 1/{self.rounds}"
        seconds = finite(row.get("seconds"))
        selected = row.get("selected")
        parts = [f"round {self._round_no()}/{self.rounds}",
                 f"accuracy {_pct(row.get('accuracy'))}"
                 f" (balanced {_pct(row.get('balanced_accuracy'))})",
                 f"up {self._bytes_up / 1e6:.2f} MB, down {self._bytes_down / 1e6:.2f} MB so far",
                 "last round " + ("n/a" if seconds is None else f"{seconds:.2f} s")]
        if isinstance(selected, list):
            parts.append(f"{len(selected)} selected")
        offline = sorted(a for a, s in self._states.items() if s == "offline")
        if offline:
            parts.append("offline: " + ", ".join(offline))
        moves = moves_text(row.get("replan"))
        if moves:  # server/cuts/replanning.py switched cuts after this round
            parts.append("re-planned " + moves)
        algorithm = row.get("algorithm")
        prefix = f"{self.title} {algorithm}" if isinstance(algorithm, str) else self.title
        return f"{prefix}: " + "; ".join(parts)

    def _agent_table(self) -> Table:
        table = Table(title="agents", title_justify="left", expand=False)
        for header in ("agent", "profile", "state", *(h for h, _, _ in AGENT_FIELDS)):
            table.add_column(header, justify="left" if header in
                             ("agent", "profile", "state") else "right")
        for agent in sorted(set(self._agents) | set(self._states)):
            info = self._agents.get(agent, {})
            state = self._states.get(agent, "—")
            profile = info.get("profile")
            table.add_row(agent, profile if isinstance(profile, str) else "—",
                          Text(state, style=STATE_STYLES.get(state, "")),
                          *(_cell(info.get(key), spec) for _, key, spec in AGENT_FIELDS))
        return table

    def _render(self) -> RenderableType:
        header = Text(self.line(), style="bold")
        if not (self._agents or self._states):
            return header
        return Group(header, self._agent_table())
