#!/usr/bin/env bash
# Install sbx on a Debian 12 host, from nothing, as root. Idempotent: a second run only checks.
#   - Debian packages for Python (venv) and the host tools sbx drives;
#   - the Python virtualenv in .venv with sbx and its pinned dependencies (and the dev tools with --dev);
#   - node and npm (Debian's, when missing) to build the web console's assets (scripts/build-console.sh);
#   - `sbx setup`: runc, mmdebstrap, xfsprogs, nftables, LXCFS, CRIU 4.2.1 from Debian sid, runsc from trixie (through the ordinary
#     apt client, mirror taken from this host's apt sources), the reflink XFS data volume and the sandbox image.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "install.sh: run as root (sbx manages containers, loop devices and networks)" >&2; exit 1; }

pkgs=(python3 python3-venv python3-dev ca-certificates git)
# --dev: PostgreSQL for the tests of the shared store (they start a throwaway cluster; the system one is unused).
# --dev: Chromium for the console's browser tests (driven headless by Playwright's Python package, which never
# downloads a browser of its own).
# --dev: the OpenSSH clients (ssh, scp, sftp) the SSH gateway's tests drive.
[ "${1:-}" = "--dev" ] && pkgs+=(postgresql chromium openssh-client)
# node and npm build the web console's assets; a host that has them already (any origin) keeps its own
command -v node >/dev/null 2>&1 || pkgs+=(nodejs)
command -v npm >/dev/null 2>&1 || pkgs+=(npm)
need=()
for pkg in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "==> apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  /usr/bin/python3 -m venv .venv
fi
stamp=".venv/.sbx-installed${extra}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> pip install -e .${extra}"
  .venv/bin/pip install -q --disable-pip-version-check -e ".${extra}"
  touch "$stamp"
fi

# The egress proxy (credential injection, sbx/node/network/egressproxy.py) runs mitmproxy as its own process from its own
# virtualenv: mitmproxy pins h11, cryptography and others to versions that clash with the server's pins.
MITMPROXY_VERSION=11.0.2
if [ ! -x .venv-egress/bin/python ]; then
  echo "==> creating .venv-egress (mitmproxy for the egress proxy)"
  /usr/bin/python3 -m venv .venv-egress
fi
if [ "$(.venv-egress/bin/python -c 'import mitmproxy.version as v; print(v.VERSION)' 2>/dev/null)" != "$MITMPROXY_VERSION" ]; then
  echo "==> pip install mitmproxy==$MITMPROXY_VERSION (.venv-egress)"
  .venv-egress/bin/pip install -q --disable-pip-version-check "mitmproxy==$MITMPROXY_VERSION"
fi
echo "==> web console assets"
bash scripts/build-console.sh

echo "==> sbx setup"
.venv/bin/sbx setup
