"""The SDK (sync and async) against the real app on a real port with a FakeNode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import tomli_w

from sbx.sdk import AsyncClient, AsyncSandbox, Client, Sandbox, SbxError, load_config
from sbx.sdk import protocol as P
from tests.fakes import LiveServer


def test_sync_lifecycle(live: LiveServer) -> None:
    with Sandbox.create(type="small", name="sdk", ttl=600) as sb:
        assert sb.state == "running" and sb.data["name"] == "sdk"
        res = sb.exec("echo hi; echo oops >&2; exit 4")
        assert (res.stdout, res.stderr, res.exit_code, res.timed_out) == ("hi\n", "oops\n", 4, False)
        assert sb.exec("sleep 20", timeout=0.3).exit_code == 124
        sb.stop()
        assert sb.state == "stopped"
        sb.resume(type="default")
        assert (sb.type, sb.data["memoryRestored"], sb.data["resumeReason"]) == ("default", False, "resized")
        fork = sb.fork(name="copy")
        assert fork.id != sb.id and fork.data["name"] == "copy" and fork.data["memoryRestored"] is None
        fork.delete()
        snap = sb.snapshot("sdk-snap")
        assert snap["name"] == "sdk-snap" and [s["name"] for s in sb.snapshots()] == ["sdk-snap"]
        assert sb.info()["state"] == "running"
        sid = sb.id
    with pytest.raises(SbxError) as e:
        Sandbox.get(sid)
    assert (e.value.code, e.value.status) == ("not_found", 404)


def test_sync_errors_carry_code_message_status(live: LiveServer) -> None:
    with pytest.raises(SbxError) as e:
        Sandbox.create(type="huge")
    assert (e.value.code, e.value.status) == ("invalid_type", 400) and "huge" in e.value.message
    with Sandbox.create() as sb:
        sb.stop()
        with pytest.raises(SbxError) as e:
            sb.resume(type="default", require_memory=True)
        assert e.value.code == "invalid_require_memory"
    with pytest.raises(SbxError) as e:
        Client(url=live.url, token="wrong").list()
    assert (e.value.code, e.value.status) == ("unauthorized", 401)


def test_detached_jobs(live: LiveServer) -> None:
    with Sandbox.create() as sb:
        job = sb.exec_detached("echo bg; exit 2")
        done = sb.wait_job(job["id"])
        assert (done["running"], done["exitCode"]) == (False, 2)
        logs = sb.job_logs(job["id"])
        assert (logs.stdout, logs.exit_code) == ("bg\n", 2)
        assert [j["id"] for j in sb.jobs()] == [job["id"]]


def test_exec_streams_to_callbacks(live: LiveServer) -> None:
    seen: list[str] = []
    with Sandbox.create() as sb:
        res = sb.exec("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == res.stdout == "1\n2\n3\n"


def test_async_twin(live: LiveServer) -> None:
    async def main() -> None:
        async with AsyncClient() as client:
            async with await AsyncSandbox.create(type="small", client=client) as sb:
                res = await sb.exec("echo async")
                assert (res.stdout, res.exit_code) == ("async\n", 0)
                await sb.stop()
                await sb.resume()
                assert sb.data["memoryRestored"] is True
                fork = await sb.fork(type="default")
                assert fork.type == "default"
                await fork.delete()
                with pytest.raises(SbxError) as e:
                    await sb.resume(type="default", wait=False)
                assert (e.value.code, e.value.status) == ("invalid_state", 409)
            assert [s for s in await client.list() if s["state"] != "deleted"] == []

    asyncio.run(main())


def test_sync_and_async_share_the_protocol_calls() -> None:
    call = P.resume("sb_x", type="default", require_memory=False, ttl=60, wait=False)
    req = next(call)
    assert (req.method, req.path, req.body, req.params) == (
        "POST", "/v1/sandboxes/sb_x/resume", {"type": "default", "ttl": 60}, {})
    with pytest.raises(StopIteration) as done:
        call.send(P.Response(202, {"sandbox": {"id": "sb_x"}}))
    assert done.value.value == {"id": "sb_x"}
    assert P.error_from(409, b'{"error":{"code":"busy","message":"m"}}').code == "busy"
    assert P.error_from(502, b"<html>").code == "bad_response"


def test_config_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("SBX_URL", raising=False)
    monkeypatch.delenv("SBX_TOKEN", raising=False)
    with pytest.raises(SbxError) as e:
        load_config()
    assert e.value.code == "no_config"
    cfg = tmp_path / ".config" / "sbx" / "config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_bytes(tomli_w.dumps({"url": "http://127.0.0.1:1/", "token": "file"}).encode())
    assert load_config() == load_config(None, None)
    assert (load_config().url, load_config().token) == ("http://127.0.0.1:1", "file")
    monkeypatch.setenv("SBX_TOKEN", "env")
    assert load_config().token == "env"
    with pytest.raises(SbxError) as e:
        Client().list()
    assert e.value.code == "unreachable"


def test_connect_labels_and_close(live: LiveServer) -> None:
    """Issue 9: a handle from another process (connect), labels with list filters, handles closing their client."""
    with Sandbox.create(labels={"team": "ml", "tier": "gpu"}) as sb, Sandbox.create(labels={"team": "web"}) as other:
        assert sb.labels == {"team": "ml", "tier": "gpu"}
        with Sandbox.connect(sb.id) as again:  # leaving the block closes its client, keeps the sandbox
            assert again.exec("echo hi").stdout == "hi\n"
        assert again.client._http.is_closed
        assert Sandbox.connect(sb.id).state == "running"
        with Client() as c:
            assert [s.id for s in Sandbox.list(labels={"team": "ml"}, client=c)] == [sb.id]
            assert {s.id for s in Sandbox.list(client=c)} == {sb.id, other.id}
            assert Sandbox.list(labels={"team": "ml", "tier": "cpu"}, client=c) == []
    assert sb.client._http.is_closed  # made by create: closed with the block


def test_async_with_create_needs_no_await(live: LiveServer) -> None:
    async def main() -> tuple[str, bool]:
        async with AsyncSandbox.create(name="async-with", labels={"a": "b"}) as sb:
            out = (await sb.exec("echo in-async")).stdout
            sid = sb.id
        assert sb.client._http.is_closed
        async with AsyncClient() as c:
            gone = all(s.id != sid for s in await AsyncSandbox.list(client=c))
        return out, gone

    assert asyncio.run(main()) == ("in-async\n", True)


def test_background_jobs_take_env_stdin_timeout_and_kill(live: LiveServer) -> None:
    with Sandbox.create() as sb:
        job = sb.exec_detached("cat; echo $X", env={"X": "y"}, stdin="fed\n")
        assert sb.wait_job(job["id"], timeout=30)["exitCode"] == 0
        assert sb.job_logs(job["id"]).stdout == "fed\ny\n"
        slow = sb.exec_detached("sleep 30", timeout=0.5)
        assert sb.wait_job(slow["id"], timeout=30)["exitCode"] == 124
        long = sb.exec_detached("sleep 60")
        killed = sb.kill_job(long["id"])
        assert (killed["running"], killed["exitCode"]) == (False, 137)
        seen: list[bytes] = []
        res = sb.exec("printf '\\377\\000x'", binary=True, on_stdout=seen.append)
        assert res.stdout_bytes == b"\xff\x00x" and b"".join(seen) == b"\xff\x00x"


def test_tar_folder_packs_the_folder_and_extra_files(tmp_path: Path) -> None:
    import tarfile

    from sbx.sdk.images import tar_folder

    (tmp_path / "ctx" / "sub").mkdir(parents=True)
    (tmp_path / "ctx" / "a.txt").write_text("a")
    (tmp_path / "ctx" / "sub" / "b.txt").write_text("b")
    (tmp_path / "elsewhere.Dockerfile").write_text("FROM sbx-debian\n")
    packed = tar_folder(tmp_path / "ctx", extra={".sbx-Dockerfile": tmp_path / "elsewhere.Dockerfile"})
    with tarfile.open(fileobj=packed) as tf:
        assert sorted(tf.getnames()) == [".sbx-Dockerfile", "a.txt", "sub", "sub/b.txt"]
        df = tf.extractfile(".sbx-Dockerfile")
        assert df is not None and df.read() == b"FROM sbx-debian\n"
    with pytest.raises(SbxError) as e:
        tar_folder(tmp_path / "ctx" / "a.txt")
    assert e.value.code == "bad_context"
