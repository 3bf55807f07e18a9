#!/usr/bin/env bash
# Install the jetsplit edge agent on this device as a systemd service.
#
#   sudo scripts/install-agent.sh --agent nano-01 --broker mqtts://broker.lab:8883 --fleet lab
#   scripts/install-agent.sh --agent nano-01 --broker mqtt://10.0.0.2 --dry-run   # list steps
#
# This only finds a Python >= 3.10 (the system one first: NVIDIA's torch wheel is installed
# for it) and runs the installer in edge_agent/install.py from this checkout with it; every
# step and flag is defined there (same as `jetsplit agent install`; --help lists the flags).
set -euo pipefail

checkout="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  for candidate in python3 python3.10 python3.11 python3.12 python3.13; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      python="$(command -v "$candidate")"
      break
    fi
  done
fi
if [[ -z "$python" ]]; then
  echo "error: jetsplit needs Python >= 3.10 (JetPack 6 ships 3.10); set PYTHON=/path/to/python3.x" >&2
  exit 2
fi

cd "$checkout"
export PYTHONPATH="$checkout${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m jetsplit.edge_agent.install --source "$checkout" "$@"
