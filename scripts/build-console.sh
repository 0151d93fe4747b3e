#!/usr/bin/env bash
# Build the web console's assets: install its libraries (xterm.js, the fit add-on, uPlot) from the npm registry at
# the versions in sbx/api/console/package-lock.json, and copy the files the page loads into
# sbx/api/console/static/vendor (git-ignored). Needs node and npm (scripts/install.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/../sbx/api/console"
npm ci --no-audit --no-fund --loglevel=error >/dev/null
mkdir -p static/vendor
cp node_modules/@xterm/xterm/lib/xterm.mjs static/vendor/xterm.js
cp node_modules/@xterm/xterm/css/xterm.css static/vendor/xterm.css
cp node_modules/@xterm/addon-fit/lib/addon-fit.mjs static/vendor/addon-fit.js
cp node_modules/uplot/dist/uPlot.esm.js static/vendor/uPlot.js
cp node_modules/uplot/dist/uPlot.min.css static/vendor/uPlot.css
echo "console assets: $(ls static/vendor | tr '\n' ' ')"
