"""Where the installed agent lives on a device: the fixed paths and names every installer
step, the systemd unit and `jetsplit doctor` agree on."""

from __future__ import annotations

# Fixed paths: systemd/jetsplit-agent.service names the same ones (a test holds them equal).
VENV = "/opt/jetsplit/venv"
PROFILES_DIR = "/opt/jetsplit/profiles"
CONFIG_DIR = "/etc/jetsplit"
CONFIG = "/etc/jetsplit/agent.toml"
KIT_DIR = "/etc/jetsplit/kit"
ENV_FILE = "/etc/jetsplit/agent.env"
STATE_DIR = "/var/lib/jetsplit"
UNIT_NAME = "jetsplit-agent.service"
UNIT = f"/etc/systemd/system/{UNIT_NAME}"
USER = "jetsplit"
# Where checks with the venv's Python run: never a checkout, whose jetsplit/ folder would be
# imported instead of the installed package.
NEUTRAL_CWD = "/"
PROFILES_ENV = "JETSPLIT_PROFILES_DIR"
# A .pth file in the venv's site-packages that sets OPENBLAS_CORETYPE on JetPack 4.
OPENBLAS_PTH = "jetsplit-openblas.pth"
