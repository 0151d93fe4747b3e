#!/usr/bin/env bash
# Install sbx on a Debian 12 host, from nothing, as root. Idempotent: a second run only checks.
#   - Debian packages for Python (venv) and the host tools sbx drives;
#   - the Python virtualenv in .venv with sbx and its pinned dependencies (and the dev tools with --dev);
#   - `sbx setup`: runc, mmdebstrap, xfsprogs, nftables, LXCFS, CRIU 4.2.1 from Debian sid (through the ordinary
#     apt client, mirror taken from this host's apt sources), the reflink XFS data volume and the sandbox image.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "install.sh: run as root (sbx manages containers, loop devices and networks)" >&2; exit 1; }

pkgs=(python3 python3-venv python3-dev ca-certificates git)
# --dev: PostgreSQL for the tests of the shared store (they start a throwaway cluster; the system one is unused).
[ "${1:-}" = "--dev" ] && pkgs+=(postgresql)
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

echo "==> sbx setup"
.venv/bin/sbx setup
