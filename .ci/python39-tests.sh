#!/usr/bin/env bash
# The device side on an older interpreter: Debian bullseye's python3.9 (from apt) runs the
# torch-free device tests (files marked `device_pure`) in .venv39, a venv that holds only
# their pure dependencies: no torch, so a test that needs it fails loudly. Needs .venv (its
# pip bootstraps pip into .venv39, as bullseye's python3.9 comes without ensurepip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/python39-apt.sh
PY39=/usr/bin/python3.9
VENV=.venv39
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  rm -rf "$VENV"
  "$PY39" -m venv --without-pip "$VENV"
  SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # Debian's 3.9 lacks distutils (python3.9-distutils is not installable next to bookworm's
  # python3): pip's documented distributor switch makes it use sysconfig instead.
  echo "import sysconfig; sysconfig._PIP_USE_SYSCONFIG = True" > "$SITE/_pip_use_sysconfig.pth"
  .venv/bin/python -m pip install --quiet --target "$SITE" --python-version 3.9 \
    --only-binary=:all: pip
fi
# What a device installs (the base dependencies and the agent extra), torch left out, plus
# the test tools: read from pyproject.toml so the two cannot drift.
mapfile -t DEPS < <(.venv/bin/python - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for dep in project["dependencies"] + project["optional-dependencies"]["agent"]:
    if not dep.startswith("torch"):
        print(dep)
PY
)
"$VENV/bin/python" -m pip install --quiet "${DEPS[@]}" "pytest>=8" "pytest-timeout>=2.2" \
  "hypothesis>=6.90"
"$VENV/bin/python" -m pip install --quiet --no-deps -e .
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "error: $VENV has torch; the device_pure tests must run without it" >&2
  exit 1
fi
mapfile -t FILES < <(grep -l "^pytestmark = pytest.mark.device_pure" tests/test_*.py)
"$VENV/bin/python" --version
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m device_pure "${FILES[@]}"
