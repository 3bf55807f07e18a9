#!/usr/bin/env bash
# The device side on an older interpreter: PYTHON runs the torch-free device tests (files
# marked `device_pure`: wire, protocol, config, the device CLIs' parsing and one-line errors)
# in VENV, a venv that holds only their pure dependencies: no torch, so a test that needs it
# fails loudly. Needs .venv (its pip bootstraps pip where PYTHON comes without ensurepip).
#   usage: .ci/device-pure-tests.sh PYTHON VENV
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$1"
VENV="$2"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  rm -rf "$VENV"
  if "$PY" -c "import ensurepip" 2>/dev/null; then
    "$PY" -m venv "$VENV"
  else
    "$PY" -m venv --without-pip "$VENV"
    SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # Debian's 3.9 lacks distutils (python3.9-distutils is not installable next to bookworm's
    # python3): pip's documented distributor switch makes it use sysconfig instead.
    echo "import sysconfig; sysconfig._PIP_USE_SYSCONFIG = True" > "$SITE/_pip_use_sysconfig.pth"
    VERSION=$("$VENV/bin/python" -c "import sys; print('%d.%d' % sys.version_info[:2])")
    .venv/bin/python -m pip install --quiet --target "$SITE" --python-version "$VERSION" \
      --only-binary=:all: pip
  fi
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
"$VENV/bin/python" -m pip install --quiet "${DEPS[@]}" "pytest>=7" "pytest-timeout>=2.1" \
  "hypothesis>=6.90"
# Non-editable, as a device installs it; the tests then import the installed package.
"$VENV/bin/python" -m pip install --quiet --no-deps --force-reinstall .
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "error: $VENV has torch; the device_pure tests must run without it" >&2
  exit 1
fi
mapfile -t FILES < <(grep -rl --include="test_*.py" "^pytestmark = pytest.mark.device_pure" tests \
  | sort)
"$VENV/bin/python" --version
# The pytest script, not `python -m pytest`: the latter would put this checkout's jetsplit/
# folder ahead of the installed package.
"$VENV/bin/pytest" -q -p no:cacheprovider -m device_pure "${FILES[@]}"
