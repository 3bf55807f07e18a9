"""The agent's reply cache (a re-sent command is answered from it, not run twice): bounded
by its number of entries and by its bytes, oldest first."""

from __future__ import annotations

from jetsplit.wire import Message, MessageType


def test_reply_cache_is_bounded_by_entries_and_bytes() -> None:
    import numpy as np

    from jetsplit.edge_agent.daemon import ReplyCache

    def reply(n: int) -> Message:
        return Message(MessageType.REPLY, run="r", sender="a", seq=n,
                       tensors={"x": np.zeros(n, np.uint8)})

    cache = ReplyCache(entries=3, max_bytes=100)
    for i in range(5):
        cache.put(("r", i), reply(10), "fp32", "none")
    assert [cache.get(("r", i)) is not None for i in range(5)] == [False, False, True, True,
                                                                     True]
    cache.put(("r", 9), reply(90), "fp32", "none")  # 10 + 10 + 90 > 100: oldest go first
    assert cache.get(("r", 3)) is None and cache.get(("r", 4)) is not None
    cache.put(("r", 9), reply(5), "fp32", "none")  # replacing an entry frees its bytes
    cache.put(("r", 10), reply(80), "fp32", "none")
    assert cache.get(("r", 4)) is not None and cache.get(("r", 10)) is not None

