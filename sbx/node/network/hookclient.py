"""The OCI ``prestart`` hook runc runs (``python3 -I -S hookclient.py SOCKET LEASE_FILE BRIDGE NODE CGROUP UID_BASE``).

It imports only ``os``, ``socket`` and ``sys``, so it starts in ~10 ms: it hands runc's container state (stdin) and its
arguments to the node's hook server (:mod:`sbx.node.network.hookd`, a thread of the node process that already has
pyroute2 loaded) over the root-only unix socket ``SOCKET`` and exits with the server's verdict. Without a server
(a node process that did not start one) it runs :mod:`sbx.node.network.nethook` itself, as before, at the cost of its
imports (~0.25 s, in the middle of every restore). Exit status 0 on success, 1 with the reason on stderr.
"""

import os
import socket
import sys

TIMEOUT = 25.0  # seconds; runc gives the hook 30


def main(argv):
    sock_path, args = argv[1], argv[2:]
    state = sys.stdin.buffer.read()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(TIMEOUT)
    try:
        s.connect(sock_path)
    except OSError:
        s.close()
        import subprocess

        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ)
        env["PYTHONPATH"] = env.get("PYTHONPATH") or here
        argv = [sys.executable, "-m", "sbx.node.network.nethook", *args]
        return subprocess.run(argv, input=state, env=env).returncode
    try:
        # the arguments, NUL-separated, on the first line; runc's state JSON after it
        s.sendall("\0".join(args).encode() + b"\n" + state)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    except OSError as e:
        sys.stderr.write(f"sbx hook: {e}\n")
        return 1
    finally:
        s.close()
    text = answer.decode(errors="replace").strip()
    if text == "ok":
        return 0
    sys.stderr.write(f"sbx hook: {text or 'no answer from the node'}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
