"""agent.toml: the optional sections load, and every mistake is one line naming the field.
Torch-free: these also run under Python 3.8 and 3.9 in `.ci/run` (marker `device_pure`),
where a run-time annotation that only 3.10 understands fails at import."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetsplit.edge_agent.config import load_agent_config
from jetsplit.errors import ConfigError

pytestmark = pytest.mark.device_pure


def test_agent_config_loads_with_optional_sections(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('fleet = "f1"\nagent = "nx-07"\nprofile = "xavier-nx-8gb"\n'
                    '[mqtt]\nbroker = "mqtt://user:pw@broker.local:1884"\n'
                    'tls_ca = "/etc/jetsplit/ca.pem"\n'
                    '[data]\ndataset = "npz:/data/local.npz"\n'
                    '[emulation]\nprofile = "jetson-nano-4gb"\nuplink_mbps = 50.0\n')
    cfg = load_agent_config(path)
    assert (cfg.fleet, cfg.agent, cfg.profile) == ("f1", "nx-07", "xavier-nx-8gb")
    address = cfg.mqtt.address()
    assert (address.host, address.port, address.username) == ("broker.local", 1884, "user")
    assert cfg.emulation is not None and cfg.emulation.uplink_mbps == 50.0
    assert cfg.emulation.downlink_mbps is None
    assert cfg.state_path() == Path("~/.local/state/jetsplit/f1/nx-07").expanduser()


@pytest.mark.parametrize(("body", "needle"), [
    ('agent = "a0"\nthreads = -1\n', "threads"),
    ('agent = "a0"\n[mqtt]\nkeepalive_s = "30"\n', "keepalive_s"),
    ('agent = "a0"\nsurprise = 1\n', "surprise"),
    ('agent = "a 0"\n', "agent"),
    ('agent = "a0"\n[emulation]\nuplink_mbps = 0\n', "uplink_mbps"),
])
def test_bad_agent_config_is_one_line(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    assert needle in str(info.value) and "\n" not in str(info.value)
