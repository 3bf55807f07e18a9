#!/usr/bin/env bash
# Install Debian bullseye's python3.9 on a newer Debian (bookworm) without letting bullseye
# replace anything else: every bullseye package is pinned to priority 1 (taken only where no
# other suite has the package, i.e. python3.9's own bullseye-only libraries), python3.9 itself
# to 500. Idempotent; touches only its own two files under /etc/apt.
set -euo pipefail
if [ -x /usr/bin/python3.9 ] && /usr/bin/python3.9 -c "import venv, ssl" 2>/dev/null; then
  exit 0
fi
cat > /etc/apt/sources.list.d/jetsplit-bullseye.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bullseye
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
cat > /etc/apt/preferences.d/jetsplit-bullseye <<'PIN'
Package: *
Pin: release n=bullseye
Pin-Priority: 1

Package: python3.9 python3.9-minimal libpython3.9-minimal libpython3.9-stdlib
Pin: release n=bullseye
Pin-Priority: 500
PIN
apt-get update -qq
apt-get install -y -qq --no-install-recommends python3.9
