#!/usr/bin/env bash
# Install the jetsplit edge agent on this device as a systemd service.
#
#   sudo scripts/install-agent.sh --agent nano-01 --broker mqtts://broker.lab:8883 --fleet lab
#   scripts/install-agent.sh --agent nano-01 --broker mqtt://10.0.0.2 --dry-run   # list steps
#
# This only finds a Python >= 3.8 (the system one first: NVIDIA's torch wheel is installed
# for it: 3.8 on JetPack 5, 3.10 on JetPack 6) and runs the installer in
# edge_agent/install.py from this checkout with it; every step and flag is defined there
# (same as `jetsplit agent install`; --help lists the flags).
set -euo pipefail

checkout="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 8))' 2>/dev/null; }

python="${PYTHON:-}"
if [[ -n "$python" ]] && ! new_enough "$python"; then
  python=""
elif [[ -z "$python" ]]; then
  for candidate in python3 python3.8 python3.10 python3.11 python3.12 python3.13; do
    if command -v "$candidate" >/dev/null 2>&1 && new_enough "$candidate"; then
      python="$(command -v "$candidate")"
      break
    fi
  done
fi
if [[ -z "$python" ]]; then
  if grep -qs '^# R32 ' /etc/nv_tegra_release; then  # edge_agent/jetpack.py: NANO_LINE
    echo "error: JetPack 4 (Jetson Nano: Ubuntu 18.04, Python 3.6) cannot run the agent, which needs Python >= 3.8 and torch >= 1.13: put an Ubuntu 20.04 image with Python 3.8 and a torch 1.13 built for it on the Nano, then re-run with PYTHON=python3.8" >&2
  else
    echo "error: the agent needs Python >= 3.8 (JetPack 5 ships 3.8, JetPack 6 3.10); set PYTHON=/path/to/python3.x" >&2
  fi
  exit 2
fi

# The checkout's folders install as jetsplit.edge_agent etc.; without installing anything,
# the same mapping comes from adding the checkout to the jetsplit package's path.
cd "$checkout"
exec "$python" -c 'import runpy, sys
sys.path.insert(0, sys.argv[1])
import jetsplit
jetsplit.__path__.append(sys.argv[1])
sys.argv = ["jetsplit agent install"] + sys.argv[2:]
runpy.run_module("jetsplit.edge_agent.install", run_name="__main__", alter_sys=True)' \
  "$checkout" --source "$checkout" "$@"
