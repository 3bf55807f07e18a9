#!/usr/bin/env bash
# No path may assume the checkout: `pip install .` (not editable) into a fresh venv, then a
# field trial from a neutral folder (its own broker, 2 agents, 1 round) must complete.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKOUT="$(pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet --upgrade pip
# The CPU torch wheel this machine carries (as the Makefile does), then the project.
"$WORK/venv/bin/python" -m pip install --quiet "$(sed -n 's/^TORCH_PIN := //p' Makefile)"
# What a coordinator host needs for a trial: the coordinator, the export tool (bundles are
# written with their ONNX twins) and the bundled datasets.
"$WORK/venv/bin/python" -m pip install --quiet "$CHECKOUT[server,export,data]"
mkdir "$WORK/neutral"
cd "$WORK/neutral"
if "$WORK/venv/bin/python" -c "import jetsplit, sys; sys.exit('site-packages' not in jetsplit.__file__)"; then
  echo "wheel install: jetsplit from $("$WORK/venv/bin/python" -c 'import jetsplit; print(jetsplit.__file__)')"
else
  echo "error: the venv's jetsplit is not the installed package" >&2
  exit 1
fi
"$WORK/venv/bin/jetsplit" trial --agents 2 --rounds 1 --out "$WORK/neutral/t1" 2>&1 | tail -3
test -s "$WORK/neutral/t1/report.md"
echo "wheel install: trial completed, report at t1/report.md"
