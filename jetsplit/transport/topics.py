"""The MQTT topic tree, in one place: ``jetsplit/v1/<fleet>/{presence,up,down}/<agent>``,
and ``jetsplit/v1/<fleet>/peer/<recipient>/<sender>`` for direct agent-to-agent messages
(SHeRL-FL's clients and their edge), which never pass the coordinator."""

from __future__ import annotations

import re

from jetsplit.errors import ConfigError

ROOT = "jetsplit/v1"
# Fleet and agent ids end up in topics, client ids and file names: no wildcards, no slashes.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
COORDINATOR = "coordinator"


def check_id(value: str, what: str) -> str:
    """A fleet or agent id that is safe in a topic; anything else is a one-line ConfigError."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ConfigError(f"{what} {value!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return value


class Topics:
    """Topic names for one fleet; agents publish up and presence, the coordinator down,
    and an agent publishes peer/<recipient>/<itself> to reach a peer directly."""

    def __init__(self, fleet: str) -> None:
        self.fleet = check_id(fleet, "fleet")
        self.base = f"{ROOT}/{fleet}"

    def presence(self, agent: str) -> str:
        return f"{self.base}/presence/{agent}"

    def up(self, agent: str) -> str:
        return f"{self.base}/up/{agent}"

    def down(self, agent: str) -> str:
        return f"{self.base}/down/{agent}"

    @property
    def down_all(self) -> str:
        return f"{self.base}/down/all"

    @property
    def presence_any(self) -> str:
        return f"{self.base}/presence/+"

    @property
    def up_any(self) -> str:
        return f"{self.base}/up/+"

    def peer(self, recipient: str, sender: str) -> str:
        """`sender`'s direct topic to `recipient` (the sender is in the topic, so a receiver
        can check that the message's signer owns it, as for up/X)."""
        return f"{self.base}/peer/{recipient}/{sender}"

    def peer_inbox(self, agent: str) -> str:
        """What `agent` subscribes to: every peer's direct topic to it."""
        return f"{self.base}/peer/{agent}/+"

    def peer_sender(self, topic: str) -> str | None:
        """The sender a peer topic belongs to (None for any other topic)."""
        prefix, _, sender = topic.rpartition("/")
        head, _, recipient = prefix.rpartition("/")
        if head == f"{self.base}/peer" and _ID.match(recipient) and _ID.match(sender):
            return sender
        return None

    def agent_of(self, topic: str) -> str | None:
        """The agent id a presence/up topic belongs to (None for foreign topics)."""
        prefix, _, agent = topic.rpartition("/")
        if prefix in (f"{self.base}/presence", f"{self.base}/up") and _ID.match(agent):
            return agent
        return None
