"""The MQTT topic tree and the ids that go into it: every topic name of a fleet, the owner
of a presence/up topic, the sender of a peer topic, and `check_id`'s edges (1-64
characters, a leading letter or digit, then letters, digits, '.', '_', '-'). The coordinator
trusts `agent_of` and `peer_sender` to say who may speak on a topic, so a foreign or
malformed topic must yield None, never a wrong id."""

from __future__ import annotations

import typing

import pytest

from jetsplit.errors import ConfigError
from jetsplit.transport import topics as topics_module
from jetsplit.transport.topics import COORDINATOR, ROOT, Topics, check_id

pytestmark = pytest.mark.fast


def test_constants() -> None:
    assert ROOT == "jetsplit/v1"
    assert COORDINATOR == "coordinator"


@pytest.mark.parametrize("value", ["a", "A", "0", "a" * 64, "0" * 64, "a.b", "a_b", "a-b",
                                   "Z9._-", "a" + "-" * 63])
def test_check_id_accepts(value: str) -> None:
    assert check_id(value, "agent") is value


@pytest.mark.parametrize("value", ["", "a" * 65, ".a", "-a", "_a", "a/b", "a+b", "a#",
                                   "a b", "a\nb", "\na", "é", "a*", "a" * 63 + "\n" + "a"])
def test_check_id_refuses(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_id(value, "agent")
    assert str(err.value) == f"agent {value!r}: use 1-64 letters, digits, '.', '_' or '-'"


@pytest.mark.parametrize("value", ["a0\n", "a" * 64 + "\n"])
def test_check_id_refuses_a_trailing_newline(value: str) -> None:
    """A `$` also matches before a trailing newline: 'a0\\n' passed as an id (topics,
    client ids, file names, broker ACL lines) until the pattern ended in `\\Z`."""
    with pytest.raises(ConfigError):
        check_id(value, "agent")


def test_topic_owners_refuse_a_trailing_newline() -> None:
    topics = Topics("f1")
    assert topics.agent_of("jetsplit/v1/f1/up/a0\n") is None
    assert topics.peer_sender("jetsplit/v1/f1/peer/e0/a1\n") is None


@pytest.mark.parametrize("value", [5, None, b"a0", ["a0"]])
def test_check_id_refuses_a_non_string_with_a_config_error(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^fleet .*: use 1-64 letters"):
        check_id(value, "fleet")  # type: ignore[arg-type]


def test_topics_of_a_fleet() -> None:
    topics = Topics("f1")
    assert topics.fleet == "f1"
    assert topics.base == "jetsplit/v1/f1"
    assert topics.presence("a0") == "jetsplit/v1/f1/presence/a0"
    assert topics.up("a0") == "jetsplit/v1/f1/up/a0"
    assert topics.down("a0") == "jetsplit/v1/f1/down/a0"
    assert topics.down_all == "jetsplit/v1/f1/down/all"
    assert topics.presence_any == "jetsplit/v1/f1/presence/+"
    assert topics.up_any == "jetsplit/v1/f1/up/+"
    assert topics.peer("e0", "a1") == "jetsplit/v1/f1/peer/e0/a1"
    assert topics.peer_inbox("e0") == "jetsplit/v1/f1/peer/e0/+"


def test_a_bad_fleet_id_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^fleet 'a/b': use 1-64"):
        Topics("a/b")


def test_agent_of_presence_and_up_topics_only() -> None:
    topics = Topics("f1")
    assert topics.agent_of("jetsplit/v1/f1/presence/a0") == "a0"
    assert topics.agent_of("jetsplit/v1/f1/up/a-1.x") == "a-1.x"
    assert topics.agent_of("jetsplit/v1/f1/down/a0") is None
    assert topics.agent_of("jetsplit/v1/f1/peer/e0/a0") is None
    assert topics.agent_of("jetsplit/v1/f2/up/a0") is None  # another fleet
    assert topics.agent_of("jetsplit/v1/f1/up/x/a0") is None
    assert topics.agent_of("jetsplit/v1/f1/up/") is None  # empty id
    assert topics.agent_of("jetsplit/v1/f1/up/.a0") is None
    assert topics.agent_of("jetsplit/v1/f1/up/" + "a" * 65) is None
    assert topics.agent_of("jetsplit/v1/f1/up/" + "a" * 64) == "a" * 64
    assert topics.agent_of("a0") is None


def test_peer_sender_of_peer_topics_only() -> None:
    topics = Topics("f1")
    assert topics.peer_sender("jetsplit/v1/f1/peer/e0/a1") == "a1"
    assert topics.peer_sender(topics.peer("e0", "a.1")) == "a.1"
    assert topics.peer_sender("jetsplit/v1/f2/peer/e0/a1") is None  # another fleet
    assert topics.peer_sender("jetsplit/v1/f1/up/e0/a1") is None
    assert topics.peer_sender("jetsplit/v1/f1/up/a1") is None
    assert topics.peer_sender("jetsplit/v1/f1/peer/a1") is None  # no recipient
    assert topics.peer_sender("jetsplit/v1/f1/peer/x/e0/a1") is None
    assert topics.peer_sender("jetsplit/v1/f1/peer/-e0/a1") is None  # bad recipient
    assert topics.peer_sender("jetsplit/v1/f1/peer//a1") is None
    assert topics.peer_sender("jetsplit/v1/f1/peer/e0/_a1") is None  # bad sender
    assert topics.peer_sender("jetsplit/v1/f1/peer/e0/") is None
    assert topics.peer_sender("jetsplit/v1/f1/peer/e0/+") is None


def test_annotations_resolve() -> None:
    """Every annotation is a real type on the Python the tests run."""
    namespace = vars(topics_module)
    assert typing.get_type_hints(Topics.peer_sender, namespace)["return"] == (str | None)
    assert typing.get_type_hints(Topics.agent_of, namespace)["return"] == (str | None)
    assert typing.get_type_hints(check_id, namespace)["return"] is str
