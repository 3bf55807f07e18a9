#!/usr/bin/env bash
# The torch-free device tests under Debian bullseye's python3.9 (from apt), in .venv39.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/python39-apt.sh
bash .ci/device-pure-tests.sh /usr/bin/python3.9 .venv39
