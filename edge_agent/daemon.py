"""The agent daemon: one MQTT session, one command at a time, forever.

It announces itself (retained presence, last will `offline`), registers, then executes the
coordinator's commands through `AgentWorker` and answers on `up/<agent>`. Direct messages
a command produces for peers (SHeRL-FL's smashed data and gradients) go out first, on
`peer/<peer>/<agent>`; those peers send to `peer/<agent>/+`, which the MQTT thread hands
straight to the worker's peer inbox (a command may be waiting for them). A command id seen
before is answered from the reply cache instead of running twice (its peer messages are
sent again), so QoS 1 redelivery and the coordinator's retransmissions are harmless.
Connection loss is paho's to repair (with backoff); the session is persistent and the
daemon re-announces on every reconnect.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

from jetsplit.broker_url import BrokerAddress
from jetsplit.edge_agent.log_tail import LogTail
from jetsplit.edge_agent.service import SystemdNotifier
from jetsplit.edge_agent.worker import AgentWorker, Response, respond
from jetsplit.errors import ConfigError
from jetsplit.protocol import Kind
from jetsplit.transport import COORDINATOR, Topics
from jetsplit.transport.mqtt import EndpointOptions, Inbound, MqttEndpoint, presence_payload
from jetsplit.wire import Message, MessageType

REPLAY_STATE = "replay.json"  # in the agent's state folder: transport/replay_state.py

log = logging.getLogger("jetsplit.agent")

REPLY_CACHE_ENTRIES = 32
REPLY_CACHE_BYTES = 256 * 1024 * 1024


Peers = Sequence[Tuple[str, Message]]


class ReplyCache:
    """Recent replies (and their peer messages) by (run, command id), bounded by count and
    tensor bytes."""

    def __init__(self, entries: int = REPLY_CACHE_ENTRIES, max_bytes: int = REPLY_CACHE_BYTES):
        self.entries, self.max_bytes = entries, max_bytes
        self._items: OrderedDict[tuple[str, int], tuple[Message, str, str, Peers, int]] = \
            OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[str, int]) -> tuple[Message, str, str, Peers] | None:
        item = self._items.get(key)
        return None if item is None else item[:4]

    def put(self, key: tuple[str, int], reply: Message, codec: str, compression: str,
            peers: Peers = ()) -> None:
        size = sum(t.nbytes for m in [reply, *(p for _, p in peers)]
                   for t in m.tensors.values())
        old = self._items.pop(key, None)
        self._bytes += size - (old[4] if old else 0)
        self._items[key] = (reply, codec, compression, tuple(peers), size)
        while self._items and (len(self._items) > self.entries or self._bytes > self.max_bytes):
            self._bytes -= self._items.popitem(last=False)[1][4]


class AgentDaemon:
    """Runs a worker behind an MQTT session until `stop` is set."""

    def __init__(self, worker: AgentWorker, address: BrokerAddress, fleet: str,
                 options: EndpointOptions = EndpointOptions(),
                 cache: ReplyCache | None = None) -> None:
        self.worker = worker
        self.agent = worker.agent_id
        self.topics = Topics(fleet)
        if options.replay_state is None:  # replay floors survive a restart (its own state)
            options = replace(options, replay_state=str(worker.state_dir / REPLAY_STATE))
        self.options = options
        self.cache = cache or ReplyCache()
        self.ignored = 0
        self.log_tail = LogTail()
        worker.log_tail = self.log_tail
        self._offline = presence_payload("-", self.agent, "offline", fleet_key=options.fleet_key,
                                         signer=options.signer)
        self.endpoint = MqttEndpoint(
            address, f"jetsplit-{fleet}-{self.agent}", options,
            subscriptions=(self.topics.down(self.agent), self.topics.down_all,
                           self.topics.peer_inbox(self.agent)),
            will=(self.topics.presence(self.agent), self._offline),
            on_connect=self._announce, sender=self.agent,
            # down/* speaks for the coordinator only, peer/<us>/X for X only
            topic_owner=lambda topic: self.topics.peer_sender(topic) or COORDINATOR,
            route=self._from_peer, allowance=worker.accepts)

    def _from_peer(self, inbound: Inbound) -> bool:
        """A peer's direct message goes to the worker's inbox at once (on the MQTT thread:
        a command may be waiting for it); raises its typed rejection, which the endpoint
        counts. Returns whether it was one."""
        if self.topics.peer_sender(inbound.topic) is None:
            return False
        self.worker.peers.accept(inbound.message, inbound.wire_bytes)
        return True

    def _announce(self, count: int) -> None:
        """On every (re)connect: retained presence `online`, then a fresh registration."""
        online = presence_payload("-", self.agent, "online", fleet_key=self.options.fleet_key,
                                  extra={"role": self.worker.role}, signer=self.options.signer)
        self.endpoint.publish_raw(self.topics.presence(self.agent), online, retain=True)
        self._register("-")

    def _register(self, run: str) -> None:
        msg = Message(MessageType.REGISTER, run=run, sender=self.agent,
                      seq=self.endpoint.next_seq(), kind=Kind.REGISTER.value,
                      meta=self.worker.registration())
        self.endpoint.send(self.topics.up(self.agent), msg)

    def handle(self, inbound: Inbound) -> None:
        """One message from the coordinator (already verified by the endpoint)."""
        msg = inbound.message
        if msg.type != MessageType.COMMAND or msg.sender != COORDINATOR:
            self.ignored += 1
            return
        recipients = msg.meta.get("to")
        if isinstance(recipients, list) and self.agent not in recipients:
            return  # a broadcast for others
        if msg.kind == Kind.DISCOVER.value:
            self._register(msg.run)
            return
        cmd = msg.meta.get("cmd", msg.seq)
        key = (msg.run, cmd if isinstance(cmd, int) else msg.seq)
        attack = self.worker.attack
        if not attack.takes(msg.kind, key, msg.round):  # tests only (edge_agent/faults.py)
            return
        self.worker.clock.transfer(inbound.wire_bytes, "down")
        cached = self.cache.get(key)
        if cached is None:
            response = respond(self.worker, msg, self.endpoint.next_seq)
            reply, codec, compression, peers = response
            self.cache.put(key, reply, codec, compression, peers)
        else:
            log.info("repeated command %s (round %d step %d): re-sending the reply",
                     msg.kind, msg.round, msg.step)
            old, codec, compression, old_peers = cached
            peers = [(to, replace(p, seq=self.endpoint.next_seq())) for to, p in old_peers]
            reply = replace(old, seq=self.endpoint.next_seq())
        sent = self._send_peers(Response(reply, codec, compression, list(peers)))
        if sent:  # the coordinator books what went to peers from this
            reply = replace(reply, meta={**reply.meta, "sent": sent})
        parts = self.endpoint.prepare(reply, codec=codec, compression=compression,
                                      chunk_bytes=attack.fault.chunk_bytes(msg.round))
        parts = attack.fault.published(parts, msg.round)  # hang-upload: half, then nothing
        self.worker.clock.transfer(sum(len(p) for p in parts), "up")
        self.endpoint.publish_parts(self.topics.up(self.agent), parts)

    def _send_peers(self, response: Response) -> Dict[str, int]:
        """Publish a command's direct messages to peers; returns bytes sent per kind."""
        sent: Dict[str, int] = {}
        for to, message in response.peers:
            parts: List[bytes] = self.endpoint.prepare(message, codec=response.codec,
                                                       compression=response.compression)
            self.worker.clock.transfer(sum(len(p) for p in parts), "up")
            nbytes = self.endpoint.publish_parts(self.topics.peer(to, self.agent), parts)
            sent[message.kind] = sent.get(message.kind, 0) + nbytes
        return sent

    def run(self, stop: threading.Event, notifier: SystemdNotifier | None = None) -> None:
        """Serve until `stop` is set; the endpoint retries the broker with backoff. Under
        systemd: READY=1 once serving, WATCHDOG=1 from this loop, STOPPING=1 at the end."""
        notifier = notifier or SystemdNotifier()
        logging.getLogger().addHandler(self.log_tail)
        self.endpoint.start()
        log.info("agent %s serving fleet %s via %s", self.agent, self.topics.fleet,
                 self.endpoint.address.url())
        notifier.ready(f"agent {self.agent} serving fleet {self.topics.fleet}")
        try:
            while not stop.is_set():
                if self.endpoint.fatal:  # e.g. a kit from another fleet: retrying won't help
                    raise ConfigError(self.endpoint.fatal)
                notifier.tick()
                try:
                    inbound = self.endpoint.inbox.get(timeout=_poll_s(notifier))
                except queue.Empty:
                    continue
                self.handle(inbound)
                if self.worker.shutdown_requested:
                    log.info("agent %s: shutdown requested by the coordinator", self.agent)
                    break
        finally:
            logging.getLogger().removeHandler(self.log_tail)
            notifier.stopping()
            self.endpoint.close(final=(self.topics.presence(self.agent), self._offline))


def _poll_s(notifier: SystemdNotifier) -> float:
    """Wake often enough to keep the watchdog fed while idle."""
    return min(0.5, notifier.interval_s or 0.5)
