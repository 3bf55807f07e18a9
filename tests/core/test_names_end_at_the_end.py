r"""Names checked by a pattern end where the string ends: a regex `$` also matches before a
trailing newline, so `"a0\n"` passed as an agent id, a file hash or a bundle entry name
until every such pattern ended in `\Z`. Each check is driven through the function that
uses it, with the name as it was allowed and as it is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jetsplit.bundle import ENGINE_NAME
from jetsplit.edge_agent.file_cache import FileCache
from jetsplit.errors import BundleError
from jetsplit.profiles import _toml_key
from jetsplit.server.methods.activation_store import ActivationStore

pytestmark = pytest.mark.fast

SHA = "0123456789abcdef" * 4


def test_a_file_hash_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    cache = FileCache(tmp_path)
    assert cache.path(SHA) == tmp_path / "files" / SHA
    with pytest.raises(BundleError, match="expected 64 hex digits"):
        cache.path(SHA + "\n")


def test_an_activation_upload_from_an_agent_named_with_a_newline_is_refused(
        tmp_path: Path) -> None:
    store = ActivationStore(tmp_path, (2,), 3, max_bytes=1 << 20)
    acts, labels = np.zeros((1, 2), np.float32), np.zeros(1, np.int64)
    assert store.problem("a0", 0, 1, acts, labels) is None
    assert store.problem("a0\n", 0, 1, acts, labels) == "agent name 'a0\\n' is not allowed"


def test_an_engine_name_and_a_toml_key_end_at_the_end() -> None:
    assert ENGINE_NAME.match("client.orin-nx.engine")
    assert not ENGINE_NAME.match("client.orin-nx.engine\n")
    assert _toml_key("orin_nx") == "orin_nx"
    assert _toml_key("orin_nx\n") != "orin_nx\n"  # quoted, not written bare
