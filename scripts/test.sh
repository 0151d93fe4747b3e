#!/usr/bin/env bash
# Install everything (as scripts/install.sh --dev) and run the whole test suite as root: ruff, mypy, the layering
# contracts, unit tests, and end-to-end tests on real sandboxes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
export PATH="$PWD/.venv/bin:$PATH"
echo "==> ruff"
ruff check sbx tests bench
echo "==> mypy"
mypy sbx
echo "==> import-linter (layering)"
lint-imports
echo "==> pytest"
pytest -q -ra -n 2 --dist loadfile "$@"
