#!/usr/bin/env bash
# The agent's install inside a container image (Dockerfile.jetson runs it from the source
# folder with the image's python3; `make device-check` runs it in the arm64 userland). pip is
# held to the image's torch and to the numpy that torch was built against
# (edge_agent/jetpack.py); CPU onnxruntime only where no onnxruntime(-gpu) imports.
set -euo pipefail
python3 -m pip install --upgrade pip  # the image's distro pip builds this project as UNKNOWN
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
python3 edge_agent/jetpack.py constraints > "$constraints"
cat "$constraints"
python3 -m pip install --constraint "$constraints" ".[agent]"
if [ -n "${MODEL_PACKAGES:-}" ]; then  # the operator's model code (Dockerfile.jetson ARG)
  # shellcheck disable=SC2086  # one requirement per word
  python3 -m pip install --constraint "$constraints" $MODEL_PACKAGES
fi
python3 -c "import onnxruntime" 2>/dev/null \
  || python3 -m pip install --constraint "$constraints" onnxruntime
# From a neutral folder: here, the source folder's jetsplit/ would shadow the installed package.
cd /
python3 -c "import torch, jetsplit.edge_agent.daemon, jetsplit.export.profile_cli; print('installed: torch', torch.__version__, '| jetsplit', jetsplit.__version__)" 2>&1 | tail -1
