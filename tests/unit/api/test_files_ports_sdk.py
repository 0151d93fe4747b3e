"""SDK ``sb.files`` and ``sb.host`` (sync and async) against the real app on a real port with a spawning FakeNode."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.sdk import AsyncClient, AsyncSandbox, Client, Sandbox, SbxError
from tests.fakes import LiveServer, wait_until
from tests.unit.api.test_files_ports import SpawnNode


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    monkeypatch.setattr("tests.fakes.FakeNode", SpawnNode)
    server = LiveServer(tmp_path).start()
    yield server
    server.stop()


def test_sync_files_and_routes(live: LiveServer) -> None:
    with Client(live.url, live.token) as c:
        sb = Sandbox.create(client=c, auto_resume=True)
        assert sb.data["autoResume"] is True
        data = os.urandom(1_500_000)
        assert sb.files.write("d/blob", data) == {"path": "d/blob", "size": len(data)}
        assert sb.files.read("d/blob") == data
        assert sb.files.write("d/parts", (bytes([i]) * 1000 for i in range(5)))["size"] == 5000
        got: list[bytes] = []
        assert sb.files.read_to("d/parts", got.append) == 5000 and b"".join(got)[:1000] == b"\0" * 1000
        sb.files.write("d/text", "héllo")
        assert sb.files.read("d/text") == "héllo".encode()
        assert [e["name"] for e in sb.files.list("d")] == ["blob", "parts", "text"]
        assert sb.files.stat("d/blob")["size"] == len(data)
        assert sb.files.exists("d/blob") and not sb.files.exists("d/none")
        sb.files.remove("d")
        with pytest.raises(SbxError) as e:
            sb.files.read("d/blob")
        assert (e.value.code, e.value.status) == ("not_found", 404)

        route = sb.host(8080)
        assert route["url"].startswith("https://8080-") and route["token"].startswith("sbxr_")
        assert [r["port"] for r in sb.routes()] == [8080]
        sb.unhost(8080)
        assert sb.routes() == []
        sb.delete()


def test_async_files_and_routes(live: LiveServer) -> None:
    async def main() -> None:
        async with AsyncClient(live.url, live.token) as c:
            sb = await AsyncSandbox.create(client=c)
            await sb.files.write("f", b"abc")
            assert await sb.files.read("f") == b"abc"
            assert [e["name"] for e in await sb.files.list(".")] == ["f"]
            assert await sb.files.exists("f")
            await sb.files.remove("f")
            assert not await sb.files.exists("f")
            assert (await sb.host(9000, public=True))["public"] is True
            assert [r["port"] for r in await sb.routes()] == [9000]
            await sb.delete()

    asyncio.run(main())


def test_an_upload_cut_short_leaves_the_old_file(live: LiveServer) -> None:
    with Client(live.url, live.token) as c:
        sb = Sandbox.create(client=c)
        sb.files.write("d/f", b"old")
        os.chmod(live.node.root / sb.id / "d" / "f", 0o640)

        def gives_up() -> Iterator[bytes]:
            yield b"new" * 400_000
            raise RuntimeError("the client gave up")

        with pytest.raises(RuntimeError, match="gave up"):
            sb.files.write("d/f", gives_up())
        # the temporary file is removed; the target never saw a byte of the cut upload
        wait_until(lambda: [e["name"] for e in sb.files.list("d")] == ["f"])
        assert sb.files.read("d/f") == b"old"

        assert sb.files.write("d/f", b"new" * 10)["size"] == 30
        assert sb.files.read("d/f") == b"new" * 10
        assert sb.files.stat("d/f")["mode"] == 0o640  # a replaced file keeps its mode
        assert [e["name"] for e in sb.files.list("d")] == ["f"]
        sb.delete()
