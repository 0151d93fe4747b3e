"""Run a command as root of a fresh user namespace whose ids 0..65535 are host ids ``BASE..BASE+65535``.

Run as a program by host root (``python usernsexec.py BASE [CGROUP_DIR...] -- ARGV...``; imports no sbx module): it
first moves itself into each ``CGROUP_DIR`` (a cgroup v1 directory, e.g. ``/sys/fs/cgroup/memory/sbx/n/layer-x``:
everything it starts stays under that cgroup's limits), then forks a child that
unshares a user namespace and waits; the parent writes the child's ``uid_map`` and ``gid_map`` (as host root, so no
``/etc/subuid`` entry is needed and ``setgroups`` stays allowed) and lets it go; the child becomes the namespace's
root (``setresgid``/``setgroups``/``setresuid`` 0, which is host uid ``BASE``) and execs ``ARGV``. Exec as root of
its namespace keeps the namespace's capabilities, so ``ARGV`` (typically ``unshare --mount --pid ...``) can make
namespaces owned by it. The exit status is the child's (128 + signal when killed). Killing this process kills the
child (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
SIZE = 65536


def main(argv: list[str]) -> int:
    """``argv``: ``BASE [CGROUP_DIR...] -- COMMAND...``; returns the command's exit status (126 when the namespace
    fails, 2 for bad arguments)."""
    if "--" not in argv or not argv[0].isdigit() or argv.index("--") == len(argv) - 1:
        print("usage: usernsexec.py BASE [CGROUP_DIR...] -- COMMAND...", file=sys.stderr)
        return 2
    sep = argv.index("--")
    base, cgroups, command = int(argv[0]), argv[1:sep], argv[sep + 1:]
    try:
        for d in cgroups:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    except OSError as e:
        print(f"usernsexec: joining {cgroups}: {e}", file=sys.stderr)
        return 126
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.close(go_w)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if libc.unshare(CLONE_NEWUSER) != 0:
                os.write(2, f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}\n".encode())
                os._exit(126)
            os.write(ready_w, b"1")
            if os.read(go_r, 1) != b"1":
                os._exit(126)
            os.setresgid(0, 0, 0)
            os.setgroups([])
            os.setresuid(0, 0, 0)
            os.execvp(command[0], command)
        except BaseException as e:  # noqa: BLE001 - the child must never return into the parent's code
            os.write(2, f"usernsexec: {e}\n".encode())
        os._exit(126)
    os.close(ready_w)
    os.close(go_r)
    try:
        if os.read(ready_r, 1) != b"1":
            os.waitpid(pid, 0)
            return 126
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 {base} {SIZE}\n")
        os.write(go_w, b"1")
    except OSError as e:
        print(f"usernsexec: uid map for {pid}: {e}", file=sys.stderr)
        os.kill(pid, signal.SIGKILL)
    finally:
        os.close(go_w)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
