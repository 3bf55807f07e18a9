"""The engine for real fleets: agents are processes or devices behind an MQTT broker.

Reliability rules, all here:

* a command has an id (`cmd`) that survives retransmission; agents answer a repeated id
  from their reply cache instead of running it twice (QoS 1 is at-least-once);
* pending commands are re-sent when the coordinator reconnects, when an agent announces
  itself again (it reconnected, perhaps to a restarted broker that lost its session), and
  after `retry_s` of silence (at least the command's own `retry_s`, e.g. the time its bytes
  need on the agent's downlink), backing off ×2 per retry up to `MAX_RETRY_S`;
* an agent whose presence turns `offline` (its last will) is dropped from the step at once;
  one that stays silent is dropped at the deadline, or earlier by the in-exchange cutoff
  once the others answered (server/engines/cutoff.py); both are recorded as missed;
* `post` sends without waiting (a probe alongside a step) and `collect` reads its answers.

Scale rules: a step costs O(selected) here, whatever the fleet's size (the registry keeps the
online set indexed); the receive pump drains what has arrived and handles replies before
presence and registrations, so a storm of hundreds of agents (re)connecting delays no step;
a registration identical to the one on record skips validation.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from jetsplit.broker_url import BrokerAddress
from jetsplit.errors import ConfigError
from jetsplit.protocol import Kind, ProtocolError, parse_registration
from jetsplit.server.defences.class_agreement import agree_classes
from jetsplit.server.engines.seam import (
    Command,
    Engine,
    Outcome,
    Posted,
    Reply,
    command_message,
    reply_from,
)
from jetsplit.transport import COORDINATOR, Topics
from jetsplit.transport.mqtt import EndpointOptions, Inbound, MqttEndpoint
from jetsplit.wire import Message, MessageType

PUMP_BATCH = 256  # messages drained per pass: replies in a batch jump the presence queue
log = logging.getLogger("jetsplit.coordinator")

DEFAULT_RETRY_S = 30.0
MAX_RETRY_S = 600.0


@dataclass
class _Pending:
    agent: str
    cmd: int
    message: Message
    command: Command
    sent_at: float = field(default_factory=time.monotonic)
    first_sent: float = field(default_factory=time.monotonic)
    reply: Message | None = None
    wire_bytes: int = 0
    wait_s: float = DEFAULT_RETRY_S  # silence before the next retransmission (backs off)


def _grouped(commands: Mapping[str, Command]) -> list[tuple[Command, list[str]]]:
    """Agents that share one Command object get it in one publish."""
    groups: dict[int, tuple[Command, list[str]]] = {}
    for agent in sorted(commands):
        groups.setdefault(id(commands[agent]), (commands[agent], []))[1].append(agent)
    return list(groups.values())


class MqttEngine(Engine):
    """Coordinator side of the MQTT runtime (one instance per fleet and run)."""

    clocked = True  # a silent agent costs wall time: the cutoff and rejoin rules apply

    def __init__(self, address: BrokerAddress, fleet: str, *, run_id: str,
                 options: EndpointOptions = EndpointOptions(),
                 retry_s: float = DEFAULT_RETRY_S,
                 classes: Sequence[str] | None = None) -> None:
        super().__init__(run_id)
        self.classes = None if classes is None else tuple(classes)  # the run's, by name
        self.topics = Topics(fleet)
        self.retry_s = retry_s
        self.endpoint = MqttEndpoint(
            address, f"jetsplit-{fleet}-{COORDINATOR}", options,
            subscriptions=(self.topics.presence_any, self.topics.up_any),
            on_connect=self._on_connect, sender=COORDINATOR, topic_owner=self.topics.agent_of,
            allowance=self._allowance)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._resend: set[str] = set()  # agents whose pending commands must go out again
        self._resend_all = False
        # devices known to be connected (a presence or a registration, accepted or not):
        # each can read the shared down/all topic
        self._present: set[str] = set()
        self.late_replies = 0
        self.rejected_agents = 0
        self._closed = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True, name="engine-pump")

    def start(self, wait_s: float = 10.0) -> MqttEngine:
        """Connect (raises a one-line ConfigError if the broker is unreachable)."""
        self.endpoint.start(wait_s=wait_s)
        self._pump_thread.start()
        return self

    def wait_for_agents(self, count: int, timeout_s: float) -> list[str]:
        return self.registry.wait_for(count, timeout_s)

    def close(self) -> None:
        self._closed.set()
        self.endpoint.close()
        if self._pump_thread.is_alive():
            self._pump_thread.join(timeout=2)

    def _allowance(self, sender: str, kind: str) -> int | None:
        """The bound a reply over the wire's cap was accounted for: the `reply_bytes` of a
        command of that kind still pending for that agent (the weights we asked for)."""
        with self._lock:
            bounds = [p.command.reply_bytes for p in self._pending.values()
                      if p.agent == sender and p.command.kind == kind and p.reply is None
                      and p.command.reply_bytes is not None]
        return max(bounds) if bounds else None

    def _silence(self, p: _Pending, waited_s: float = 0.0, cut: bool = False) -> str:
        """Why a pending command missed its deadline: silence, or a reply we refused; `cut`:
        the in-exchange cutoff ended the wait early (server/engines/cutoff.py)."""
        refused = self.endpoint.refused.get(p.agent)
        if refused is not None and refused[0] >= p.first_sent:
            return f"deadline (its reply was refused: {refused[1]})"
        if cut:
            return f"deadline (cut off after {waited_s:.1f} s: the others had answered)"
        return "deadline"

    # ------------------------------------------------------------------ receiving

    def _on_connect(self, count: int) -> None:
        discover = Message(MessageType.COMMAND, run=self.run_id, sender=COORDINATOR,
                           seq=self.endpoint.next_seq(), kind=Kind.DISCOVER.value)
        self.endpoint.send(self.topics.down_all, discover)
        if count > 1:
            with self._cond:
                self._resend_all = True
                self._cond.notify_all()

    def _pump(self) -> None:
        inbox = self.endpoint.inbox
        while not self._closed.is_set():
            try:
                batch = [inbox.get(timeout=0.2)]
            except queue.Empty:
                continue
            while len(batch) < PUMP_BATCH:
                try:
                    batch.append(inbox.get_nowait())
                except queue.Empty:
                    break
            # Replies first: a step waits on them; presence and registrations can wait.
            batch.sort(key=lambda i: i.message.type not in (MessageType.REPLY,
                                                            MessageType.ERROR))
            for inbound in batch:
                try:
                    self._dispatch(inbound)
                except Exception:  # noqa: BLE001 - one bad message must not stop us
                    log.exception("failed to handle a message on %s", inbound.topic)

    def _dispatch(self, inbound: Inbound) -> None:
        msg = inbound.message
        agent = self.topics.agent_of(inbound.topic)
        if agent is None or msg.sender != agent:
            self.endpoint.rejected["SenderMismatch"] += 1
            log.warning("dropped %s from %r on %s: sender does not own the topic",
                        msg.kind, msg.sender, inbound.topic)
            return
        self.registry.seen(agent)
        if msg.type == MessageType.PRESENCE:
            self._on_presence(agent, str(msg.meta.get("state", "")))
        elif msg.type == MessageType.REGISTER:
            self._on_register(agent, msg, inbound.wire_bytes)
        elif msg.type in (MessageType.REPLY, MessageType.ERROR):
            self.counters.add(agent, msg.kind, "up", inbound.wire_bytes)
            self.book_sent(agent, msg.meta)
            self._on_reply(agent, msg, inbound.wire_bytes)

    def _on_presence(self, agent: str, state: str) -> None:
        if state == "offline":
            log.info("agent %s is offline", agent)
            self.registry.set_state(agent, "offline")
        elif state == "online" and self.registry.state(agent) is not None:
            self.registry.set_state(agent, "online")
        with self._cond:
            if state == "offline":
                self._present.discard(agent)
            elif state == "online":
                self._present.add(agent)
            # Only an agent with a command in flight needs it again (idle ones: nothing).
            if state == "online" and self.registry.state(agent) == "busy":
                self._resend.add(agent)
            self._cond.notify_all()

    def _on_register(self, agent: str, msg: Message, wire_bytes: int) -> None:
        with self._cond:  # connected, whether or not its registration is accepted
            self._present.add(agent)
        if self.registry.same_registration(agent, msg.meta):
            self.counters.add(agent, Kind.REGISTER.value, "up", wire_bytes)
            self.registry.register(agent, msg.meta)  # validated before; back online
        else:
            try:
                registration = parse_registration(msg.meta)
            except ProtocolError as exc:
                self.rejected_agents += 1
                self.endpoint.rejected["BadRegistration"] += 1
                log.warning("rejected registration from %s: %s", agent, exc)
                return
            if registration.agent != agent:
                self.rejected_agents += 1
                self.endpoint.rejected["BadRegistration"] += 1
                log.warning("rejected registration from %s: it names %s", agent,
                            registration.agent)
                return
            try:
                record = agree_classes(registration, self.classes)
            except ConfigError as exc:
                self.rejected_agents += 1
                self.endpoint.rejected["UnknownClass"] += 1
                log.warning("refused registration from %s: %s", agent, exc)
                return
            first = self.registry.state(agent) is None
            self.counters.add(agent, Kind.REGISTER.value, "up", wire_bytes)
            self.registry.register(agent, record)
            if first:
                log.info("agent %s registered (%s, %d samples)", agent, registration.role,
                         registration.dataset.size)
        if msg.run != self.run_id:  # announced on (re)connect, not in answer to our DISCOVER
            with self._cond:
                self._resend.add(agent)
                self._cond.notify_all()

    def _on_reply(self, agent: str, msg: Message, wire_bytes: int) -> None:
        cmd = msg.meta.get("re")
        with self._cond:
            pending = self._pending.get((agent, cmd)) if isinstance(cmd, int) else None
            if pending is None or pending.reply is not None:
                self.late_replies += 1
                return
            pending.reply, pending.wire_bytes = msg, wire_bytes
            self._cond.notify_all()

    # ------------------------------------------------------------------ sending

    def _publish(self, topic: str, message: Message, command: Command,
                 recipients: list[str]) -> None:
        nbytes = self.endpoint.send(topic, message, codec=command.codec,
                                    compression=command.compression)
        for agent in recipients:  # what each device downloads, broadcast or not
            self.counters.add(agent, command.kind, "down", nbytes)

    def _only_readers(self, live: list[str]) -> bool:
        """Whether every device that can read down/all is among `live` (caller holds the
        lock): every registered online agent, every device seen connected (a refused
        registration still listens), and in a provisioned fleet every enrolled device (its
        persistent session would get the message on its next connect). Otherwise weights
        and bundles go per device, so only the round's participants receive the model."""
        recipients = set(live)
        keyring = self.endpoint.options.keyring
        enrolled = keyring.senders if keyring is not None else []
        # sizes first: O(selected) per step, never O(fleet) (docs/scale.md)
        return (len(self._present) <= len(recipients) and len(enrolled) <= len(recipients)
                and self.registry.covers_online(live) and self._present <= recipients
                and recipients.issuperset(enrolled))

    def _retransmit(self, pendings: list[_Pending]) -> None:
        for p in pendings:
            resent = Message(MessageType.COMMAND, run=p.message.run, sender=COORDINATOR,
                             seq=self.endpoint.next_seq(), round=p.message.round,
                             step=p.message.step, kind=p.message.kind,
                             meta={**p.message.meta, "to": [p.agent]},
                             tensors=p.message.tensors)
            log.info("re-sending %s (round %d step %d) to %s", p.message.kind, resent.round,
                     resent.step, p.agent)
            self._publish(self.topics.down(p.agent), resent, p.command, [p.agent])
            p.sent_at = time.monotonic()
            p.wait_s = min(p.wait_s * 2, max(MAX_RETRY_S, self.retry_s))

    def send_and_receive(self, commands: Mapping[str, Command], *, round: int = 0,
                         step: int = 0, deadline_s: float = 60.0) -> Outcome:
        return self._exchange(_grouped(commands), round, step, deadline_s)

    def send_and_stream(self, commands: Mapping[str, Command], *, round: int = 0,
                        step: int = 0, deadline_s: float = 60.0) -> Iterator[Outcome]:
        """Results as they land, released in agent-id order (see `Engine.send_and_stream`);
        replies that land while the caller works are kept, not lost to the deadline."""
        groups = _grouped(commands)
        mine, missed = self._send(groups, round, step)
        results: dict[str, Reply | str] = dict(missed)
        arrivals = self._arrivals(mine, deadline_s)
        try:
            for agent in sorted(commands):
                while agent not in results:
                    landed, result = next(arrivals, (agent, "deadline"))
                    results[landed] = result
                result = results.pop(agent)
                if isinstance(result, Reply):
                    yield self._finish({agent: result}, {}, commands[agent].kind, round, step)
                else:
                    yield self._finish({}, {agent: result}, commands[agent].kind, round, step)
        finally:
            arrivals.close()

    def broadcast(self, command: Command, agents: list[str], *, round: int = 0, step: int = 0,
                  deadline_s: float = 60.0) -> Outcome:
        return self._exchange([(command, sorted(agents))], round, step, deadline_s)

    def post(self, command: Command, agents: list[str], *, round: int = 0, step: int = 0
             ) -> Posted:
        """Send `command` and return at once; its replies are kept for `collect` (a probe
        that rides alongside the next step). Not retransmitted: probes are cheap, and the
        next round sends a fresh one."""
        mine, missed = self._send([(command, sorted(agents))], round, step)
        with self._cond:  # nobody waits on it: the agents stay selectable
            for p in mine:
                if self.registry.state(p.agent) == "busy":
                    self.registry.set_state(p.agent, "online")
        return Posted(command.kind, sorted(agents), round, step, dict(missed), pending=mine)

    def collect(self, posted: Posted, *, final: bool = False) -> Outcome:
        """What `posted`'s agents answered since the last collect (replies, errors, gone
        offline); `final`: the silent rest missed by "deadline", and forgotten."""
        done, posted.resolved = posted.resolved, {}
        still: list[_Pending] = []
        with self._cond:
            states = self.registry.states([p.agent for p in posted.pending or []])
            for p in posted.pending or []:
                if p.reply is not None:
                    done[p.agent] = _result(p.agent, p, time.monotonic() - p.first_sent)
                elif states[p.agent] == "offline":
                    done[p.agent] = "offline"
                elif final:
                    done[p.agent] = self._silence(p)
                else:
                    still.append(p)
                    continue
                self._pending.pop((p.agent, p.cmd), None)
        posted.pending = still
        replies = {a: r for a, r in done.items() if isinstance(r, Reply)}
        missed = {a: r for a, r in done.items() if isinstance(r, str)}
        return self._finish(replies, missed, posted.kind, posted.round, posted.step)

    def _exchange(self, groups: list[tuple[Command, list[str]]], round: int, step: int,
                  deadline_s: float) -> Outcome:
        """Send each group's command (once per group when it has several agents) and wait."""
        kind = groups[0][0].kind if groups else ""
        mine, missed = self._send(groups, round, step)
        replies: dict[str, Reply] = {}
        for agent, result in self._arrivals(mine, deadline_s):
            if isinstance(result, Reply):
                replies[agent] = result
            else:
                missed[agent] = result
        return self._finish(replies, missed, kind, round, step)

    def _send(self, groups: list[tuple[Command, list[str]]], round: int, step: int
              ) -> tuple[list[_Pending], dict[str, str]]:
        """Publish the commands; returns what is now pending and who was offline already."""
        missed: dict[str, str] = {}
        mine: list[_Pending] = []
        sends: list[tuple[str, Message, Command, list[str]]] = []
        with self._cond:
            # Fresh commands go out now; older reconnect signals do not apply to them.
            self._resend_all = False
            self._resend.difference_update(a for _, agents in groups for a in agents)
            states = self.registry.states([a for _, agents in groups for a in agents])
            for command, agents in groups:
                live = [a for a in agents if states[a] not in (None, "offline")]
                missed.update({a: "offline" for a in agents if a not in live})
                if not live:
                    continue
                cmd = self.endpoint.next_seq()
                message = command_message(self.run_id, cmd, command, round=round, step=step,
                                          to=live)
                message.meta["cmd"] = cmd
                for agent in live:
                    pending = _Pending(agent, cmd, message, command,
                                       wait_s=max(self.retry_s, command.retry_s or 0.0))
                    self._pending[(agent, cmd)] = pending
                    mine.append(pending)
                    self.registry.set_state(agent, "busy")
                # One publish on down/all only when it reaches nobody else: every agent
                # subscribed to down/all downloads it, and device links are the scarce ones.
                if len(live) > 1 and self._only_readers(live):
                    sends.append((self.topics.down_all, message, command, live))
                else:
                    sends.extend((self.topics.down(a), message, command, [a]) for a in live)
        for topic, message, command, recipients in sends:
            self._publish(topic, message, command, recipients)
        return mine, missed

    def _arrivals(self, mine: list[_Pending], deadline_s: float
                  ) -> Iterator[tuple[str, Reply | str]]:
        """Each pending agent once, as it resolves: its reply, or why it missed (error,
        offline, deadline). Retransmits on reconnects and silence; cleans up when done or
        closed early."""
        started = time.monotonic()
        open_ = {p.agent: p for p in mine}
        commands = {p.agent: p.command for p in mine}
        answered: dict[str, float] = {}  # agent → seconds its reply took (the cutoff's input)
        try:
            while open_:
                done: list[tuple[str, Reply | str]] = []
                with self._cond:
                    states = self.registry.states(list(open_))
                    for agent, p in list(open_.items()):
                        if p.reply is not None:
                            result = _result(agent, p, time.monotonic() - started)
                            if isinstance(result, Reply) and result.elapsed_s is not None:
                                answered[agent] = result.elapsed_s
                            done.append((agent, result))
                            del open_[agent]
                        elif states[agent] == "offline":
                            done.append((agent, "offline"))
                            del open_[agent]
                    now = time.monotonic()
                    limits = self.wait_limits(commands, open_, answered, deadline_s)
                    for agent, limit in limits.items():
                        if now - started >= limit:
                            done.append((agent, self._silence(open_.pop(agent), limit,
                                                              limit < deadline_s)))
                    deadline = started + min(limits.values(), default=deadline_s)
                    again = [p for p in open_.values()
                             if self._resend_all or p.agent in self._resend
                             or now - p.sent_at > p.wait_s]
                    self._resend.difference_update(open_)
                    self._resend_all = False
                    if open_ and not again and not done:
                        self._cond.wait(min(deadline - now, 0.2))
                if again:
                    self._retransmit(again)
                yield from done
        finally:
            with self._cond:
                for p in mine:
                    self._pending.pop((p.agent, p.cmd), None)
                    if self.registry.state(p.agent) == "busy":
                        self.registry.set_state(p.agent, "online")


def _result(agent: str, p: _Pending, elapsed_s: float) -> Reply | str:
    """A pending command's answer (call with its reply in): the reply timed, or the error
    it reported."""
    reply = p.reply
    if reply is None:
        return "deadline"
    if reply.type == MessageType.ERROR:
        return f"error: {reply.meta.get('error', '?')}"
    return _timed(reply_from(agent, reply, p.wire_bytes), elapsed_s)


def _timed(reply: Reply, elapsed_s: float) -> Reply:
    """`reply` with the seconds it took since its command went out."""
    reply.elapsed_s = round(elapsed_s, 4)
    return reply
