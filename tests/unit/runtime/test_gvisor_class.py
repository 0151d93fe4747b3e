"""The pure parts of the gvisor runtime class: the runsc config made from the container class's, the wrapped start
command, runsc's log errors, and how :class:`sbx.runtime.classes.ClassRuntime` picks a runtime per sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sbx.guest import minimal
from sbx.node.lifecycle.gvisor import gvisor_config
from sbx.runtime.classes import ClassRuntime
from sbx.runtime.oci import ContainerSpec, build_config
from sbx.runtime.runc import RuncRuntime
from sbx.runtime.runsc import GLOBAL_FLAGS, RunscRuntime, last_log_error, netns_name, start_argv


def _container_config(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    spec = ContainerSpec(hostname="h", memory_bytes=256 << 20, vcpus=2, cpuset_cpus="0-1", cgroup_path="/sbx/n/sb_x",
                         hook_argv=["/hook"], lxcfs_dir="/var/lib/lxcfs", uid_base=100000, mask_dir=str(tmp_path),
                         annotations={"org.criu.config": "/b/criu.conf"})
    return build_config(spec)


def test_the_gvisor_config_keeps_limits_and_drops_what_runsc_does_its_own_way(tmp_path: Path) -> None:
    base = _container_config(tmp_path)
    before = json.dumps(base)
    cfg = gvisor_config(base, "/run/sbx/n/bundles/sb_x/disk", "/run/netns/sbx-sb_x")
    assert json.dumps(base) == before  # the container config is not changed
    assert cfg["root"] == {"path": "/run/sbx/n/bundles/sb_x/disk", "readonly": False}
    assert cfg["process"]["args"] == [minimal.MINIMAL_TINI, "-g", "--", "/bin/sh", "/usr/lib/sbx/sbx-init-gvisor"]
    assert not any(e.startswith("SYSTEMD_") for e in cfg["process"]["env"])
    linux = cfg["linux"]
    assert "uidMappings" not in linux and "gidMappings" not in linux and "seccomp" not in linux
    assert "maskedPaths" not in linux
    types = {ns["type"]: ns for ns in linux["namespaces"]}
    assert "user" not in types and "cgroup" not in types
    assert types["network"] == {"type": "network", "path": "/run/netns/sbx-sb_x"}
    assert cfg["hooks"] == {} and "org.criu.config" not in cfg["annotations"]
    # the same limits and cgroup, but no cpuset (runsc can't write it here)
    assert linux["resources"]["memory"] == {"limit": 256 << 20, "swap": 256 << 20}
    assert linux["resources"]["cpu"] == {"quota": 200_000, "period": 100_000}
    assert linux["cgroupsPath"] == "/sbx/n/sb_x"
    # no host /proc or /sys binds (LXCFS, masks) and no cgroupfs; the tmpfs mounts stay
    kinds = {m["destination"]: m["type"] for m in cfg["mounts"]}
    assert "bind" not in kinds.values() and "cgroup" not in kinds.values()
    assert kinds["/tmp"] == kinds["/run"] == "tmpfs" and kinds["/proc"] == "proc"


def test_start_argv_hides_proc_sys_net_in_a_private_mount_namespace() -> None:
    argv = start_argv(["/usr/local/lib/sbx/runsc", "run", "x"])
    assert argv[:4] == ["unshare", "--mount", "--propagation", "private"]
    assert "/proc/sys/net" in argv[6] and argv[6].endswith('exec "$@"')
    assert argv[-3:] == ["/usr/local/lib/sbx/runsc", "run", "x"]


def test_last_log_error_quotes_runscs_last_message(tmp_path: Path) -> None:
    log = tmp_path / "l.log"
    assert last_log_error(log) == ""
    log.write_text('{"msg":"first","level":"info"}\n{"msg":"starting container: boom","level":"error"}\n')
    assert last_log_error(log) == "starting container: boom"
    log.write_text("not json at all\n")
    assert last_log_error(log) == "not json at all"


def test_class_runtime_routes_each_sandbox_to_its_class(tmp_path: Path) -> None:
    classes = {"sb_g": "gvisor", "sb_c": "container"}

    def class_of(cid: str) -> str:
        if cid not in classes:
            raise KeyError(cid)
        return classes[cid]

    runc = RuncRuntime(tmp_path / "runc", tmp_path / "criu", runc="/bin/false")
    runsc = RunscRuntime(tmp_path / "runsc", runsc=tmp_path / "runsc-bin")
    rt = ClassRuntime(runc, runsc, class_of)
    assert rt.of("sb_g") is runsc and rt.of("sb_c") is runc
    assert rt.of("sb_unknown") is runc  # no record: the container class, not remembered
    classes["sb_unknown"] = "gvisor"
    assert rt.of("sb_unknown") is runsc
    assert rt.cmd("exec", "sb_g", "true")[:3] == [str(tmp_path / "runsc-bin"), "--root", str(tmp_path / "runsc")]
    assert rt.cmd("exec", "sb_g", "true")[3:3 + len(GLOBAL_FLAGS)] == list(GLOBAL_FLAGS)
    assert rt.cmd("exec", "sb_c", "true")[0] == "/bin/false"
    assert rt.cmd("list")[0] == "/bin/false"
    assert rt.state_root == runc.state_root
    assert runsc.state("sb_g") is None and runsc.list() == []


def test_runsc_exec_has_no_terminal_and_names_the_user(tmp_path: Path) -> None:
    from sbx.runtime.base import RuntimeError_

    runsc = RunscRuntime(tmp_path / "runsc", runsc=tmp_path / "runsc-bin")
    argv = runsc.exec_command("sb_g", ["id"], uid=1000, gid=1000, cwd="/home/user", env=["A=b"])
    assert argv[-2:] == ["sb_g", "id"]
    assert argv[argv.index("--user") + 1] == "1000:1000" and argv[argv.index("--env") + 1] == "A=b"
    tty = runsc.exec_command("sb_g", ["sh"], uid=1000, gid=1000, cwd="/home/user", env=["A=b"], extra=("--tty",))
    assert tty[-3] == "--process" and tty[-1] == "sb_g" and "--tty" not in tty
    assert json.loads(Path(tty[-2]).read_text()) == {"terminal": True, "user": {"uid": 1000, "gid": 1000},
                                                     "args": ["sh"], "env": ["A=b"], "cwd": "/home/user"}
    with pytest.raises(RuntimeError_):
        runsc.checkpoint("sb_g", tmp_path / "img", tmp_path / "work", page_server="10.0.0.1:1234")
    assert netns_name("sb_g") == "sbx-sb_g"


def _fake_relay(answer: bytes) -> tuple[int, list[bytes]]:
    """A one-connection TCP server on 127.0.0.1 that records what it got and answers ``answer`` then closes."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            got.append(conn.recv(100))
            if answer:
                conn.sendall(answer)
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], got


def test_connect_relay_sends_the_token_and_wants_the_agents_hello() -> None:
    from sbx.node.exec import channel

    port, got = _fake_relay(channel.frame(b"H", channel.HELLO))
    sock = channel.connect_relay("127.0.0.1", port, b"a" * 32)
    sock.close()
    assert got == [b"a" * 32 + b"\n"]
    port, _ = _fake_relay(channel.frame(b"H", b"not-the-agent"))
    with pytest.raises(channel.Unavailable) as e:
        channel.connect_relay("127.0.0.1", port, b"a" * 32)
    assert e.value.suspect
    port, _ = _fake_relay(b"")  # closed before a hello: the agent is not up yet, not suspect
    with pytest.raises(channel.Unavailable) as e:
        channel.connect_relay("127.0.0.1", port, b"a" * 32)
    assert not e.value.suspect


def test_relay_token_is_read_and_checked() -> None:
    from sbx.node.exec import channel

    assert channel.relay_token(lambda: b"0123456789abcdef0123\n") == b"0123456789abcdef0123"
    for bad in (b"", b"short", b"has spaces in it and more\n", b"../../etc/passwd-but-long"):
        with pytest.raises(channel.Unavailable):
            channel.relay_token(lambda bad=bad: bad)  # type: ignore[misc]

    def missing() -> bytes:
        raise FileNotFoundError("etc/sbx/relay-token")

    with pytest.raises(channel.Unavailable):
        channel.relay_token(missing)
