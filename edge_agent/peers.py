"""Direct messages between agents (SHeRL-FL: a client's smashed data to its edge, the edge's
gradients back to each client), held until the command that consumes them runs.

They come through the broker on their own topics, not with a command: often before the
command that needs them, and from anyone able to publish there. So an agent's inbox takes
only what its last commands told it to expect (kind, senders, run, round and, for a
client's gradient, the step); anything else is a typed rejection that the caller counts,
and what it holds is bounded per sender, in count and in bytes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from jetsplit.wire import Message, MessageType
from jetsplit.wire.errors import PeerBacklog, StalePeerMessage, UnexpectedPeer

MAX_HELD_PER_SENDER = 2  # this step's message and the next one's, no more
MAX_HELD_BYTES = 512 * 1024 * 1024


@dataclass
class PeerSend:
    """A direct message a command asks its caller to deliver (`Result.peers`)."""

    to: str
    kind: str
    tensors: Dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class _Expected:
    run: str
    round: int
    step: Optional[int]  # None: any step of the round not yet consumed


class PeerInbox:
    """What one agent expects from its peers and holds of what they sent (thread-safe:
    the MQTT thread delivers while a command may wait in `take`)."""

    def __init__(self, max_per_sender: int = MAX_HELD_PER_SENDER,
                 max_bytes: int = MAX_HELD_BYTES) -> None:
        self.max_per_sender, self.max_bytes = max_per_sender, max_bytes
        self._cond = threading.Condition()
        self._expected: Dict[str, Dict[str, _Expected]] = {}  # kind → sender → what
        self._floor: Dict[Tuple[str, str], int] = {}  # (kind, sender) → first step still open
        self._held: OrderedDict[Tuple[str, str, int], Tuple[Message, int]] = OrderedDict()
        self._bytes = 0

    def expect(self, kind: str, senders: Sequence[str], run: str, round_: int,
               step: Optional[int] = None) -> None:
        """From now on accept `kind` only from `senders`, for this run and round (and step,
        if given); held messages that no longer fit are dropped."""
        with self._cond:
            before = self._expected.get(kind, {})
            self._expected[kind] = {s: _Expected(run, round_, step) for s in senders}
            for sender in set(before) | set(senders):  # steps restart with each round
                old = before.get(sender)
                if sender not in senders or old is None or (old.run, old.round) != (run, round_):
                    self._floor.pop((kind, sender), None)
            for key in [k for k, (m, _) in self._held.items() if k[0] == kind
                        and self._problem(m) is not None]:
                self._drop(key)

    def clear(self) -> None:
        """Expect nothing and hold nothing (a new bundle, released blocks)."""
        with self._cond:
            self._expected.clear()
            self._floor.clear()
            self._held.clear()
            self._bytes = 0

    def accept(self, message: Message, wire_bytes: int) -> None:
        """Hold one direct message, or raise why not (UnexpectedPeer, StalePeerMessage,
        PeerBacklog); the caller counts the error by its class and keeps running."""
        if message.type != MessageType.PEER:
            raise UnexpectedPeer(f"a {message.type.name} message on a peer topic")
        with self._cond:
            problem = self._problem(message)
            if problem is not None:
                raise problem
            key = (message.kind, message.sender, message.step)
            if key in self._held:
                raise PeerBacklog(f"{message.kind} from {message.sender} for step "
                                  f"{message.step}: already held")
            mine = sum(1 for k in self._held if k[:2] == key[:2])
            if mine >= self.max_per_sender or self._bytes + wire_bytes > self.max_bytes:
                raise PeerBacklog(f"{message.kind} from {message.sender}: over what is held "
                                  f"for commands to come")
            self._held[key] = (message, wire_bytes)
            self._bytes += wire_bytes
            self._cond.notify_all()

    def take(self, kind: str, senders: Sequence[str], run: str, round_: int, step: int,
             wait_s: float) -> Dict[str, Tuple[Message, int]]:
        """The `kind` messages of (run, round, step) from `senders` that are in, waiting up
        to `wait_s` for the rest; returns {sender: (message, wire bytes)} and closes that
        step for them (a late copy is stale)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            for sender in senders:
                want = self._expected.get(kind, {}).get(sender)
                if want is None or (want.run, want.round) != (run, round_):
                    raise UnexpectedPeer(f"no {kind} expected from {sender} in round {round_}")
            while True:
                missing = [s for s in senders if (kind, s, step) not in self._held]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    break
                self._cond.wait(left)
            out: Dict[str, Tuple[Message, int]] = {}
            for sender in senders:
                item = self._held.get((kind, sender, step))
                if item is not None:
                    out[sender] = item
                    self._drop((kind, sender, step))
                self._floor[(kind, sender)] = step + 1
            return out

    def held(self) -> List[Tuple[str, str, int]]:
        """(kind, sender, step) of what is held, oldest first (status, tests)."""
        with self._cond:
            return list(self._held)

    def _problem(self, message: Message) -> Optional[Exception]:
        """Why `message` is not expected now, or None (caller holds the lock)."""
        want = self._expected.get(message.kind, {}).get(message.sender)
        if want is None:
            return UnexpectedPeer(f"{message.kind!r} from {message.sender}: not an assigned "
                                  f"peer for it")
        if (message.run, message.round) != (want.run, want.round) or \
                (want.step is not None and message.step != want.step) or \
                message.step < self._floor.get((message.kind, message.sender), 0):
            return StalePeerMessage(f"{message.kind} from {message.sender} for run "
                                    f"{message.run} round {message.round} step {message.step}:"
                                    f" not the current one")
        return None

    def _drop(self, key: Tuple[str, str, int]) -> None:
        _, nbytes = self._held.pop(key)
        self._bytes -= nbytes
