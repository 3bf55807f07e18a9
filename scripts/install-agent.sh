#!/usr/bin/env bash
# Install the jetsplit edge agent on this device as a systemd service.
#
#   sudo scripts/install-agent.sh --agent nano-01 --broker mqtts://broker.lab:8883 --fleet lab
#   scripts/install-agent.sh --agent nano-01 --broker mqtt://10.0.0.2 --dry-run   # list steps
#
# This only finds a Python >= 3.8 (the system one first: NVIDIA's torch wheel is installed
# for it: 3.8 on JetPack 5, 3.10 on JetPack 6) and runs the installer in
# edge_agent/install.py from this checkout with it; every step and flag is defined there
# (same as `jetsplit agent install`; --help lists the flags). On JetPack 4 (L4T R32, whose
# python3 is 3.6) it first installs Ubuntu's python3.8 with apt, asking (or --yes); the
# installer then takes the CPU route (edge_agent/jetpack.py).
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
root="/"
yes=""
dry_run=""
previous=""
for arg in "$@"; do
  case "$arg" in
    --yes|-y) yes=1 ;;
    --dry-run) dry_run=1 ;;
    --root=*|--prefix=*) root="${arg#*=}" ;;
  esac
  if [[ "$previous" == "--root" || "$previous" == "--prefix" ]]; then root="$arg"; fi
  previous="$arg"
done

if [[ -z "$python" ]] && grep -qs '^# R32 ' "$root/etc/nv_tegra_release"; then
  # edge_agent/jetpack.py: apt_packages(R32_PYTHON); a test holds them equal.
  packages=(python3.8 python3.8-venv python3.8-dev)
  echo "JetPack 4 (L4T R32: Ubuntu 18.04, Python 3.6): the agent runs on Ubuntu's python3.8: apt-get install ${packages[*]}"
  if [[ -n "$dry_run" ]]; then
    echo "dry run: would apt-get update and install ${packages[*]}; the installer's own steps are listed once python3.8 is there"
    exit 0
  fi
  if [[ -z "$yes" ]]; then
    if [[ ! -t 0 ]]; then
      echo "error: installing ${packages[*]} needs your consent: re-run with --yes, or install them first" >&2
      exit 2
    fi
    read -r -p "run apt-get update and apt-get install -y ${packages[*]}? [y/N] " answer
    if [[ "$answer" != [yY]* ]]; then
      echo "error: not installing ${packages[*]}: nothing was changed; re-run with --yes, or install them first" >&2
      exit 2
    fi
  fi
  if [[ "$(id -u)" -ne 0 ]]; then
    echo "error: apt-get needs root: run it with sudo" >&2
    exit 2
  fi
  if ! apt-get update || ! apt-get install -y "${packages[@]}"; then
    echo "error: apt-get could not install ${packages[*]} (its output is above); Ubuntu 18.04 carries them in bionic-updates universe" >&2
    exit 2
  fi
  python="$(command -v python3.8 || true)"
fi
if [[ -z "$python" ]]; then
  if grep -qs '^# R32 ' "$root/etc/nv_tegra_release"; then  # edge_agent/jetpack.py: NANO_LINE
    echo "error: JetPack 4 (L4T R32: Ubuntu 18.04, Python 3.6) needs Ubuntu's python3.8 for the agent: re-run scripts/install-agent.sh, which installs it with apt (asking first, or --yes), or set PYTHON=python3.8" >&2
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
