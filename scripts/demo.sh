#!/usr/bin/env bash
# The main job: install sbx, start the embedded single-node server, and take one sandbox through
# new -> exec -> stop (with memory) -> resume -> resume --type (resize) -> fork, printing what happens.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"

log=$(mktemp /tmp/sbx-server.XXXXXX.log)
echo "==> starting sbx server (log: $log)"
sbx server >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do sbx list >/dev/null 2>&1 && break; kill -0 $server || { cat "$log"; exit 1; }; sleep 0.5; done

# Print a command as it would be typed (arguments with spaces or shell characters in single quotes), then run it.
step() {
  local shown="" a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@%+-]+$ ]]; then shown+=" $a"; else shown+=" '${a//\'/\'\\\'\'}'"; fi
  done
  printf '\n\033[1m$%s\033[0m\n' "$shown"
  "$@"
}

id=$(sbx new --type small --name demo --json | jq -r .sandbox.id)
echo "created $id"
step sbx exec "$id" 'echo "hello from $(hostname)"; nproc; free -m | head -2'
step sbx exec "$id" --detach "python3 -u -c 'import os,time;print(\"counter pid\",os.getpid(),flush=True);[time.sleep(1) for _ in iter(int,1)]'"
sleep 1
step sbx exec "$id" 'echo "work in progress" > ~/notes.txt; pgrep -a python3'
step sbx stop "$id" --wait
step sbx resume "$id" --wait
step sbx info "$id" --json
step sbx exec "$id" 'pgrep -a python3; cat ~/notes.txt'
step sbx stop "$id" --wait
step sbx resume "$id" --type default --wait
sbx info "$id" --json | jq -c '.sandbox | {type, memoryGB, memoryRestored, resumeReason}'
step sbx exec "$id" 'pgrep -a python3 || echo "no python3 (cold boot)"; cat ~/notes.txt; df -h / | tail -1'
fork=$(sbx fork "$id" --type default --wait --json | tail -1 | jq -r .id)
echo "forked $fork"
step sbx exec "$fork" 'hostname; cat ~/notes.txt'
step sbx list
sbx delete "$fork" >/dev/null
sbx delete "$id" >/dev/null
echo
echo "demo finished: sandbox $id went through new, exec, stop/resume with memory, resize and fork"
