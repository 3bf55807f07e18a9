"""The transport-neutral interface every training method is written against, and the
in-process engine.

An algorithm sends a `Command` to a set of agents and gets an `Outcome`: the replies, in
agent-id order (never arrival order, so runs are reproducible), and the agents that missed
the step with the reason. The MQTT engine (`server.mqtt_engine`) implements the same calls
over a broker; the in-process engine calls the agents' workers directly. Where the codec is
exact (fp32 and raw tensors, uncompressed) it hands each message over by reference
(jetsplit/wire/handover.py: the header built and checked as the wire would, tensors as
read-only views, the bytes booked those the encoding would have); where the codec would
change values or sizes it encodes and decodes every message. Either way codecs, checks
and byte counts are those of the wire.

Agents may also message each other directly (SHeRL-FL's clients and edge: `Kind.SMASHED`,
`Kind.GRADIENT`): over MQTT on their own peer topics, never through the coordinator; here
the engine hands them from one worker to the other the same way. Either way the
sender's reply reports what it sent (`sent`: bytes per kind) and the engine books it on the
sender's `up`, once per message: `up` is what an agent sent, `down` what the coordinator
sent it.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from jetsplit.devices import torch_threads
from jetsplit.protocol import PEER_KINDS
from jetsplit.server.engines.cutoff import Cutoff
from jetsplit.server.engines.registry import FleetRegistry, MissedStep
from jetsplit.transport import COORDINATOR, ByteCounters
from jetsplit.wire import (
    Allowance,
    Message,
    MessageType,
    WireError,
    decode_message,
    encode_message,
)
from jetsplit.wire.handover import hand_over

Tensors = dict[str, np.ndarray]
MAX_SENT_BYTES = 1 << 40  # a reply's claim about its peer traffic, per kind (untrusted)
log = logging.getLogger("jetsplit.coordinator")


@dataclass(frozen=True)
class Command:
    """What to ask of an agent: a kind (see `jetsplit.protocol.Kind`), arguments, arrays."""

    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: Tensors = field(default_factory=dict)
    codec: str = "fp32"
    compression: str = "none"
    # The least wait before the first retransmission (say, what the agent's downlink needs
    # for this command's bytes); the engine's own retry_s applies when larger.
    retry_s: float | None = None
    # The bound its reply was accounted for (the weights asked for, `accounted_bound` of
    # their sizes): a reply over the wire's cap is taken up to it; unset: the cap applies.
    reply_bytes: int | None = None
    # How much work it asks of the agent, in units alike across one exchange's commands
    # (samples to train on, rows to upload): the in-exchange cutoff waits for an agent given
    # more its share longer (server/engines/cutoff.py). Unset: alike work.
    work: float | None = None


@dataclass
class Reply:
    """One agent's answer; `wire_bytes` is what it cost on the wire (all chunks)."""

    agent: str
    kind: str
    meta: dict[str, Any]
    tensors: Tensors
    wire_bytes: int = 0
    # Seconds from sending the command to this reply's arrival (the step deadlines follow
    # it: server/defences/step_deadlines.py); None where nothing waits on a clock (in-process).
    elapsed_s: float | None = None


@dataclass
class Outcome:
    """Replies in agent-id order, and who missed the step with the reason."""

    replies: dict[str, Reply]
    missed: dict[str, str] = field(default_factory=dict)
    kind: str = ""  # the command's kind (to say what was missed)

    @property
    def agents(self) -> list[str]:
        return list(self.replies)

    def __getitem__(self, agent: str) -> Reply:
        return self.replies[agent]


@dataclass
class Posted:
    """Commands sent without waiting (`Engine.post`); `Engine.collect` reads their answers.
    `pending` is the engine's own record of what is still open."""

    kind: str
    agents: list[str]
    round: int
    step: int
    resolved: dict[str, Reply | str] = field(default_factory=dict)  # not yet collected
    pending: Any = None


class Engine(ABC):
    """Send commands to agents and collect replies with a deadline."""

    # Whether a missed exchange costs wall time (a deadline waited for). The in-process
    # engine runs every command to its answer, so nothing there waits on a clock.
    clocked: bool = False

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.counters = ByteCounters()
        self.registry = FleetRegistry()
        # The in-exchange cutoff of step exchanges (server/engines/cutoff.py), set by the
        # trainer; engines that wait on no clock ignore it.
        self.cutoff: Cutoff | None = None

    def online(self) -> list[str]:
        """Agents available for selection, sorted by id."""
        return self.registry.online()

    def wait_limits(self, commands: Mapping[str, Command], waiting: Iterable[str],
                    answered: Mapping[str, float], deadline_s: float) -> dict[str, float]:
        """Seconds from an exchange's start that each agent of `waiting` is waited for, given
        the exchange's `commands` (agent → command) and the answered agents' elapsed
        seconds: the in-exchange cutoff where it applies to the exchange's kind, else the
        deadline. The one place every exchange's wait is decided, whichever method sent it."""
        kind = next(iter(commands.values())).kind if commands else ""
        cutoff = self.cutoff
        if cutoff is None or not cutoff.applies(kind):
            return dict.fromkeys(waiting, deadline_s)
        work = {a: c.work for a, c in commands.items() if c.work is not None}
        return {a: cutoff.limit(a, answered, deadline_s, work, cutoff.floor(a, kind))
                for a in waiting}

    @abstractmethod
    def send_and_receive(self, commands: Mapping[str, Command], *, round: int = 0,
                         step: int = 0, deadline_s: float = 60.0) -> Outcome:
        """Send each agent its command; wait until all replied or the deadline passed."""

    def broadcast(self, command: Command, agents: list[str], *, round: int = 0, step: int = 0,
                  deadline_s: float = 60.0) -> Outcome:
        """The same command to many agents (the MQTT engine publishes it only once)."""
        return self.send_and_receive(dict.fromkeys(agents, command), round=round, step=step,
                                     deadline_s=deadline_s)

    def send_and_stream(self, commands: Mapping[str, Command], *, round: int = 0,
                        step: int = 0, deadline_s: float = 60.0) -> Iterator[Outcome]:
        """Like `send_and_receive`, but yields each agent's result (a one-agent Outcome: its
        reply, or its miss with the reason) as soon as it is in, so the caller can work on
        early replies while later ones still travel (Ampere trains on the first uploads).
        Results come in agent-id order, as everywhere: an early reply waits only for the
        agents before it, and runs stay reproducible. This fallback waits for all."""
        out = self.send_and_receive(commands, round=round, step=step, deadline_s=deadline_s)
        for agent in sorted(commands):
            yield _single(agent, out.replies.get(agent), out.missed.get(agent, "deadline"),
                          commands[agent].kind)

    def post(self, command: Command, agents: list[str], *, round: int = 0, step: int = 0
             ) -> Posted:
        """Send `command` to agents without waiting for them (a cheap probe alongside the
        next step); `collect` reads the answers. Here: run to its answer at once."""
        out = self.broadcast(command, sorted(agents), round=round, step=step)
        resolved: dict[str, Reply | str] = {**out.replies, **out.missed}
        return Posted(command.kind, sorted(agents), round, step, resolved)

    def collect(self, posted: Posted, *, final: bool = False) -> Outcome:
        """The answers to `posted` that came in since the last collect, without waiting;
        `final`: the agents still silent are missed ("deadline") and forgotten."""
        done, posted.resolved = posted.resolved, {}
        return _resolved(done, posted.kind)

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing here
        """Release connections and processes."""

    def book_sent(self, agent: str, meta: dict[str, Any]) -> None:
        """Book the direct messages an agent's reply says it sent to peers (`sent`: bytes
        per peer kind) on its `up`: the coordinator never sees them pass. A malformed claim
        is ignored (it is only bookkeeping)."""
        sent = meta.get("sent")
        if not isinstance(sent, dict):
            return
        for kind, nbytes in sorted(sent.items()):
            if kind in PEER_KINDS and isinstance(nbytes, int) and 0 < nbytes <= MAX_SENT_BYTES:
                self.counters.add(agent, kind, "up", nbytes)

    def _finish(self, replies: dict[str, Reply], missed: dict[str, str], kind: str,
                round: int, step: int) -> Outcome:
        for agent, reason in sorted(missed.items()):
            log.warning("agent %s missed %s (round %d step %d): %s", agent, kind, round, step,
                        reason)
            self.registry.record_missed(MissedStep(agent, round, step, kind, reason))
        return Outcome(dict(sorted(replies.items())), dict(sorted(missed.items())), kind)


def _resolved(done: Mapping[str, Reply | str], kind: str) -> Outcome:
    """Results (a reply, or why it missed) as an Outcome in agent-id order."""
    replies = {a: r for a, r in sorted(done.items()) if isinstance(r, Reply)}
    missed = {a: r for a, r in sorted(done.items()) if isinstance(r, str)}
    return Outcome(replies, missed, kind)


def _single(agent: str, reply: Reply | None, reason: str, kind: str = "") -> Outcome:
    """One agent's result as an Outcome (what `send_and_stream` yields)."""
    return Outcome({agent: reply}, {}, kind) if reply is not None \
        else Outcome({}, {agent: reason}, kind)


def command_message(run: str, seq: int, command: Command, *, round: int, step: int,
                    to: list[str] | None = None) -> Message:
    """The COMMAND envelope for `command`; `to` names the recipients of a broadcast."""
    meta = dict(command.meta)
    if to is not None:
        meta["to"] = to
    return Message(MessageType.COMMAND, run=run, sender=COORDINATOR, seq=seq, round=round,
                   step=step, kind=command.kind, meta=meta, tensors=command.tensors)


def reply_allowance(command: Command, agent: str) -> Allowance | None:
    """What `command`'s reply from `agent` may weigh over the wire's cap: its accounted
    `reply_bytes`, for a reply of its kind from that agent only."""
    bound = command.reply_bytes
    if bound is None:
        return None
    return lambda sender, kind: bound if (sender, kind) == (agent, command.kind) else None


def reply_from(agent: str, message: Message, wire_bytes: int) -> Reply:
    return Reply(agent, message.kind, dict(message.meta), message.tensors, wire_bytes)


class AgentLike(Protocol):
    """What the in-process engine needs from an agent (`edge_agent.worker.AgentWorker`)."""

    agent_id: str
    threads: int  # intra-op torch threads its compute runs with (0: the process's)
    peers: Any  # edge_agent.peers.PeerInbox: direct messages from other agents

    def registration(self) -> dict[str, Any]: ...

    def accepts(self, sender: str, kind: str) -> int | None: ...


class InProcessEngine(Engine):
    """Agents are objects in this process; commands run one agent after another in id order.

    Deterministic and fast: the engine for accuracy experiments with 100+ simulated clients.
    Each agent's compute runs under that agent's torch thread count, as in its own process,
    so a run here matches the same fleet over MQTT bit for bit whatever this process uses.
    """

    def __init__(self, workers: Mapping[str, AgentLike], run_id: str = "local", *,
                 by_reference: bool = True) -> None:
        """`by_reference=False` encodes and decodes every message even where the codec is
        exact (tests compare the two paths)."""
        super().__init__(run_id)
        self.by_reference = by_reference
        from jetsplit.edge_agent.worker import respond  # the same reply path as the MQTT daemon

        self._respond = respond
        self.workers = dict(sorted(workers.items()))
        self._seq = itertools.count(1)
        self.peak_agents_holding_blocks = 0
        self.peer_rejected: Counter[str] = Counter()  # direct messages a peer refused
        for agent, worker in self.workers.items():
            self.registry.register(agent, worker.registration())

    def send_and_receive(self, commands: Mapping[str, Command], *, round: int = 0,
                         step: int = 0, deadline_s: float = 60.0) -> Outcome:
        replies: dict[str, Reply] = {}
        missed: dict[str, str] = {}
        for agent in sorted(commands):
            result = self._run_one(agent, commands[agent], round, step)
            if isinstance(result, Reply):
                replies[agent] = result
            else:
                missed[agent] = result
        return self._finish(replies, missed, next(iter(commands.values())).kind
                            if commands else "", round, step)

    def send_and_stream(self, commands: Mapping[str, Command], *, round: int = 0,
                        step: int = 0, deadline_s: float = 60.0) -> Iterator[Outcome]:
        """Each agent runs when the caller asks for the next result, in id order."""
        for agent in sorted(commands):
            result = self._run_one(agent, commands[agent], round, step)
            reply, reason = (result, "") if isinstance(result, Reply) else (None, result)
            out = _single(agent, reply, reason)
            yield self._finish(out.replies, out.missed, commands[agent].kind, round, step)

    def _run_one(self, agent: str, command: Command, round: int, step: int) -> Reply | str:
        """One agent's command as the wire would carry it; its reply or why it missed."""
        worker = self.workers.get(agent)
        if worker is None or self.registry.state(agent) == "offline":
            return "offline"
        msg = command_message(self.run_id, next(self._seq), command, round=round, step=step)
        down, receive = self._transit(msg, command.codec, command.compression)
        self.counters.add(agent, command.kind, "down", down)
        try:  # an agent refuses what it did not account for, as over MQTT
            command_in = receive(worker.accepts)
        except WireError as exc:
            return f"deadline (the agent refused the command: {type(exc).__name__}: {exc})"
        with torch_threads(getattr(worker, "threads", 0)):
            response = self._respond(worker, command_in, lambda: next(self._seq))
        reply = response.reply
        sent = self._deliver(response.peers, response.codec, response.compression)
        if sent:
            reply.meta["sent"] = sent
        up, receive = self._transit(reply, response.codec, response.compression)
        self.counters.add(agent, reply.kind, "up", up)
        holding = sum(1 for w in self.workers.values() if getattr(w, "holds_blocks", False))
        self.peak_agents_holding_blocks = max(self.peak_agents_holding_blocks, holding)
        try:
            decoded = receive(reply_allowance(command, agent))
        except WireError as exc:
            return f"deadline (its reply was refused: {type(exc).__name__}: {exc})"
        self.book_sent(agent, decoded.meta)
        if decoded.type == MessageType.ERROR:
            return f"error: {decoded.meta.get('error', '?')}"
        return reply_from(agent, decoded, up)

    def _transit(self, message: Message, codec: str, compression: str
                 ) -> tuple[int, Callable[[Allowance | None], Message]]:
        """The bytes `message` costs on the wire, and how its recipient receives it (with
        the allowance it accounted; a refusal raises the wire's typed error): handed over
        by reference where the codec is exact, else encoded and decoded. Encoding errors
        raise here, as the sender's would."""
        handed = hand_over(message, codec=codec, compression=compression) \
            if self.by_reference else None
        if handed is not None:
            return handed.nbytes, lambda allowance: handed.receive(allowance=allowance)
        data = encode_message(message, codec=codec, compression=compression)
        return len(data), lambda allowance: decode_message(data, allowance=allowance)

    def _deliver(self, peers: list[tuple[str, Message]], codec: str, compression: str
                 ) -> dict[str, int]:
        """Hand direct messages to their recipients' peer inboxes as a broker would carry
        them; a refusal is counted by its error class. Bytes sent per kind."""
        sent: dict[str, int] = {}
        for to, message in peers:
            nbytes, receive = self._transit(message, codec, compression)
            sent[message.kind] = sent.get(message.kind, 0) + nbytes
            target = self.workers.get(to)
            if target is None:  # a topic nobody reads: the message just goes nowhere
                continue
            try:
                target.peers.accept(receive(None), nbytes)
            except WireError as exc:
                self.peer_rejected[type(exc).__name__] += 1
                log.warning("%s refused %s from %s: %s", to, message.kind, message.sender, exc)
        return sent
