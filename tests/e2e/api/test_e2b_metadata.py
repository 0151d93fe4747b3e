"""Issue 31 end to end, through E2B's own SDK: file metadata (envd 0.6.2), the ``metadata`` of ``files.write`` kept
as the file's ``user.e2b.*`` extended attributes in the sandbox and answered by ``get_info``, ``list`` and
``rename``; bad metadata is refused before anything is written."""

from __future__ import annotations

import os

import pytest

from tests.e2e.api.test_e2b_sdk import e2b_env  # noqa: F401  (a fixture: the SDK's URLs and key)

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.e2e


@pytest.mark.usefixtures("e2b_env")
def test_file_metadata_is_kept_as_extended_attributes_and_answered_everywhere() -> None:
    import httpx
    from e2b import Sandbox
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    sbx = Sandbox.create(timeout=300)
    try:
        plain = sbx.files.write("plain.txt", "no metadata")
        assert plain.metadata is None and sbx.files.get_info("plain.txt").metadata is None

        meta = {"Owner": "ml-team", "run.id": "42 of 7"}
        want = {"owner": "ml-team", "run.id": "42 of 7"}  # keys lowercased, as envd does
        written = sbx.files.write("data/m.txt", "with metadata", metadata=meta)
        assert written.metadata == want
        assert sbx.files.get_info("data/m.txt").metadata == want
        assert {e.name: e.metadata for e in sbx.files.list("data")} == {"m.txt": want}
        got = sbx.commands.run("python3 -c 'import os; print(os.getxattr(\"data/m.txt\", \"user.e2b.owner\"))'")
        assert got.stdout == "b'ml-team'\n"  # the sandbox's own attribute

        moved = sbx.files.rename("data/m.txt", "data/n.txt")
        assert moved.metadata == want and sbx.files.read("data/n.txt") == "with metadata"
        many = sbx.files.write_files([WriteEntry(path="a.txt", data="a"), WriteEntry(path="b.txt", data="b")],
                                     metadata={"batch": "1"})
        assert [w.metadata for w in many] == [{"batch": "1"}, {"batch": "1"}]
        # an attribute set by hand is metadata too
        sbx.commands.run("python3 -c 'import os; os.setxattr(\"plain.txt\", \"user.e2b.by\", b\"hand\")'")
        assert sbx.files.get_info("plain.txt").metadata == {"by": "hand"}
        assert sbx.files.read("plain.txt") == "no metadata"

        # a value the SDK itself refuses (not printable ASCII), sent by hand: 400, envd's error body, nothing written
        r = httpx.post(os.environ["E2B_SANDBOX_URL"] + "/files", params={"path": "/home/user/bad.txt"},
                       content=b"x", headers=[(b"E2b-Sandbox-Id", sbx.sandbox_id.encode()),
                                              (b"E2b-Sandbox-Port", b"49983"),
                                              (b"X-Access-Token", (sbx._envd_access_token or "").encode()),
                                              (b"Content-Type", b"application/octet-stream"),
                                              (b"X-Metadata-name", b"caf\xe9")])
        assert r.status_code == 400 and r.json()["code"] == 400
        assert not sbx.files.exists("bad.txt")
    finally:
        sbx.kill()
