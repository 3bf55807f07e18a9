#!/usr/bin/env bash
# The torch-free device tests under a real CPython 3.8 (JetPack 5's Python), in .venv38:
# pyenv's 3.8 where the machine has one, else python3.8 on PATH; a machine with neither
# says so in one line and skips (Debian has no 3.8 package).
set -euo pipefail
cd "$(dirname "$0")/.."
PY38=""
if command -v pyenv >/dev/null 2>&1; then
  PREFIX=$(pyenv prefix "$(pyenv versions --bare | grep -E '^3\.8\.[0-9]+$' | tail -1)" \
    2>/dev/null || true)
  [ -n "$PREFIX" ] && [ -x "$PREFIX/bin/python3.8" ] && PY38="$PREFIX/bin/python3.8"
fi
if [ -z "$PY38" ] && command -v python3.8 >/dev/null 2>&1; then
  PY38=$(command -v python3.8)
fi
if [ -z "$PY38" ]; then
  echo "skipped: no CPython 3.8 on this machine (pyenv install 3.8 to run these)"
  exit 0
fi
bash .ci/device-pure-tests.sh "$PY38" .venv38
