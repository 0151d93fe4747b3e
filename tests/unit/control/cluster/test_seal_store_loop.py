"""The seal store's upload loop (issue 34, sbx.control.cluster.archive) on a fake node and a real S3 server (moto's
server mode, tests/s3server.py): a seal is recorded only once every file is in the bucket; the S3 server killed
between two parts of an upload records nothing and the next pass uploads it whole; objects no seal names any more
are deleted (shared ones stay); a missing bucket or unreachable server stops the loop's start."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sbx.control.cluster.archive import Archiver
from sbx.storage.errors import StorageError
from tests.fakes import FakeNode, make_control, wait_until
from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, s3_server

BUCKET = "unit-seals"


class ExportingNode(FakeNode):
    """A fake node whose stopped sandboxes export a disk delta and a memory file (the transfer calls the loop uses):
    ``files[sid]`` holds their bytes; ``shared`` is the same memory file in every sandbox."""

    shared = os.urandom(100_000)

    def __init__(self, root: Path):
        super().__init__(root)
        self.files: dict[str, dict[str, bytes]] = {}

    def transfer_parent(self) -> dict[str, str]:
        return {"image": "base.ext4", "sha256": "0" * 64}

    def export_stopped(self, id: str, parent: dict[str, str] | None = None, kind: str = "move") -> dict[str, Any]:
        assert kind == "archive"
        files = self.files.setdefault(id, {"disk.delta": os.urandom(20 << 20), "memory/pages-1.img": self.shared})
        return {"id": id, "memory": True, "fingerprint": {"cpu": "x"}, "parent": parent,
                "files": {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}}

    def export_file(self, id: str, name: str, kind: str = "move") -> Iterator[bytes]:
        data = self.files[id][name]
        return iter([data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)])

    def end_export(self, id: str, kind: str = "move") -> None:
        pass


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server(BUCKET) as srv:
        yield srv


def _plane(tmp_path: Path, s3: S3Server, bucket: str = BUCKET) -> tuple[Any, ExportingNode]:
    node = ExportingNode(tmp_path / "node")
    cp = make_control(tmp_path, node, seal_store=f"s3://{bucket}/p", s3_endpoint=s3.endpoint, s3_region=REGION,
                      s3_access_key=ACCESS_KEY, s3_secret_key=SECRET_KEY, seal_store_seconds=0)
    return cp, node


def _stopped(cp: Any) -> str:
    sid = str(cp.create("small").id)
    wait_until(lambda: cp.get(sid).state == "running")
    cp.stop(sid)
    wait_until(lambda: cp.get(sid).state == "stopped")
    return sid


def _gone(cp: Any, sid: str) -> bool:
    row = cp.store.get_sandbox(sid)
    return row is None or row.state == "deleted"


def test_a_seal_cut_by_the_s3_server_dying_is_never_half_recorded(tmp_path: Path, s3: S3Server,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cp, node = _plane(tmp_path, s3)
    try:
        sid = _stopped(cp)
        loop = Archiver(cp)
        client = cp.archive.objects.store.client
        real, parts = client.upload_part, []

        def upload_part(**kw: Any) -> Any:  # the server dies as the second part goes up
            parts.append(kw["PartNumber"])
            if len(parts) == 2:
                s3.kill()
            return real(**kw)

        monkeypatch.setattr(client, "upload_part", upload_part)
        out = loop.run_once()
        assert [f["id"] for f in out["failed"]] == [sid] and out["stored"] == []
        assert cp.archive.get(sid) is None and cp.view(cp.get(sid))["sealStored"] is False
        assert loop.run_once()["failed"][0]["error"] == "store_unreachable"  # tried again: still down

        s3.start()
        s3.make_bucket(BUCKET)
        out = loop.run_once()
        assert [s["id"] for s in out["stored"]] == [sid], out
        arch = cp.archive.get(sid)
        assert arch is not None and cp.view(cp.get(sid))["sealStored"] is True
        key = cp.archive.key(cp.get(sid).account_id)
        for name, obj in arch.objects.items():  # every file whole in the bucket
            assert b"".join(cp.archive.objects.get(key, obj)) == node.files[sid][name]
        assert loop.run_once()["stored"] == []  # current: not sent again
    finally:
        cp.close()


def test_objects_go_when_no_seal_names_them(tmp_path: Path, s3: S3Server) -> None:
    cp, node = _plane(tmp_path, s3)
    try:
        a, b = _stopped(cp), _stopped(cp)
        loop = Archiver(cp)
        assert {s["id"] for s in loop.run_once()["stored"]} == {a, b}
        objs = {sid: dict(cp.archive.get(sid).objects) for sid in (a, b)}
        shared = objs[a]["memory/pages-1.img"]
        assert shared == objs[b]["memory/pages-1.img"]  # content-addressed: one object for both
        store = cp.archive.objects.store

        # a new seal of a replaces the old: its old disk delta goes, the shared memory file stays
        cp.resume(a)
        wait_until(lambda: cp.get(a).state == "running")
        node.files.pop(a)
        cp.stop(a)
        wait_until(lambda: cp.get(a).state == "stopped")
        out = loop.run_once()
        assert [s["id"] for s in out["stored"]] == [a]
        assert out["freed"] == [objs[a]["disk.delta"]] and not store.exists(objs[a]["disk.delta"])
        assert store.exists(shared)

        # a deleted: its objects go, except what b still names; b deleted: the rest go
        now_a = dict(cp.archive.get(a).objects)
        cp.delete(a)
        wait_until(lambda: _gone(cp, a))
        out = loop.run_once()
        assert out["freed"] == [now_a["disk.delta"]] and store.exists(shared)
        cp.delete(b)
        wait_until(lambda: _gone(cp, b))
        assert sorted(loop.run_once()["freed"]) == sorted(objs[b].values())
        assert not store.exists(shared) and cp.archive.all() == {}
    finally:
        cp.close()


def test_a_store_that_cannot_be_used_stops_the_start(tmp_path: Path, s3: S3Server) -> None:
    cp, _ = _plane(tmp_path, s3, bucket="no-such-bucket")
    try:
        with pytest.raises(StorageError) as e:
            Archiver(cp).start()
        assert e.value.code == "bucket_not_found" and "no-such-bucket" in e.value.message
    finally:
        cp.close()


def test_without_a_seal_store_nothing_runs(tmp_path: Path) -> None:
    cp = make_control(tmp_path, FakeNode(tmp_path / "node"))
    try:
        assert cp.archive is None
        loop = Archiver(cp)
        loop.start()  # period 0: no thread, no check
        assert loop._thread is None and not any(loop.run_once().values())
        sid = _stopped(cp)
        assert (cp.view(cp.get(sid))["sealStored"], cp.view(cp.get(sid))["sealStoredAt"]) == (False, None)
    finally:
        cp.close()


def test_a_sweep_deletes_what_no_seal_names(tmp_path: Path, s3: S3Server) -> None:
    """What a cut upload left (an object no row names) goes at a sweep once old enough; named objects stay."""
    cp, node = _plane(tmp_path, s3)
    try:
        sid = _stopped(cp)
        assert [s["id"] for s in Archiver(cp).run_once()["stored"]] == [sid]
        named = set(cp.archive.get(sid).objects.values())
        stray, _ = cp.archive.objects.put(cp.archive.key("acct_x"), "acct_x", [b"left by a cut upload"])
        assert cp.archive.sweep() == []  # younger than an hour: may be an upload under way
        assert stray in cp.archive.sweep(min_age=0)  # (and what earlier tests of this bucket left)
        left = {n for n, _ in cp.archive.objects.store.names()}
        assert named <= left and stray not in left
    finally:
        cp.close()
