"""Issue 32 over the API with a FakeNode: the image routes (build from an uploaded context, import, list, show,
delete), their errors (a bad name, a name clash, an image in use, a bad context, a missing Dockerfile, shared
images for the admin only, the node's build errors mapped to 400/422), streamed progress, accounts kept apart, and
sandboxes made from an image (the node gets its facts; forks and snapshots keep them)."""

from __future__ import annotations

import io
import json
import tarfile
from typing import Any

from tests.fakes import Api, auth


def _tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


CONTEXT = {"Dockerfile": "FROM base\nCOPY hello.txt /opt/app/\nENV GREETING=hi\n", "hello.txt": "hello\n"}


def _build(api: Api, name: str, files: dict[str, str] | None = None, headers: dict[str, str] | None = None,
           **params: Any) -> Any:
    return api.c.post("/v1/images/build", params={"name": name, **params}, content=_tar(files or CONTEXT),
                      headers=headers or api.h)


def _account(api: Api, name: str) -> dict[str, str]:
    r = api.post("/v1/accounts", json={"name": name, "plan": "team"})
    assert r.status_code == 201, r.text
    return auth(r.json()["key"]["token"])


def test_build_list_show_delete(api: Api) -> None:
    r = _build(api, "tools")
    assert r.status_code == 201, r.text
    img = r.json()["image"]
    assert img["name"] == "tools" and img["id"].startswith("img_") and img["digest"].startswith("sha256:")
    assert img["env"] == {"GREETING": "hi"} and img["workdir"] == "/opt/app" and img["init"] == "systemd"
    op, _, details = next(c for c in api.node.calls if c[0] == "build_image")
    assert details["dockerfile"] == CONTEXT["Dockerfile"] and details["files"] == ["Dockerfile", "hello.txt"]
    assert [i["name"] for i in api.get("/v1/images").json()["images"]] == ["tools"]
    assert api.get("/v1/images/tools").json()["image"]["id"] == img["id"]
    assert api.delete("/v1/images/tools").json() == {"deleted": "tools"}
    assert api.get("/v1/images/tools").json()["error"]["code"] == "image_not_found"
    assert any(c[0] == "delete_image" for c in api.node.calls)


def test_progress_streams_as_ndjson_lines(api: Api) -> None:
    r = _build(api, "streamed", stream="true")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[0] == {"progress": "STEP 1/1: FROM fake"} and lines[-1]["image"]["name"] == "streamed"


def test_a_failed_build_is_an_error_in_the_stream_and_records_nothing(api: Api) -> None:
    api.node.fail_next("build_image", "build_step_failed", "step 2/3 RUN false: exit 1")
    r = _build(api, "broken", stream="true")
    last = json.loads(r.text.splitlines()[-1])
    assert last == {"error": {"code": "build_step_failed", "message": "step 2/3 RUN false: exit 1"}}
    assert api.get("/v1/images").json()["images"] == []


def test_node_build_errors_keep_their_code_with_400_or_422(api: Api) -> None:
    for code, status in (("bad_dockerfile", 400), ("copy_source_missing", 400), ("build_step_failed", 422),
                         ("image_no_shell", 422)):
        api.node.fail_next("build_image", code, f"fake {code}")
        r = _build(api, "x")
        assert (r.status_code, r.json()["error"]["code"]) == (status, code)
    api.node.fail_next("import_image", "bad_archive", "not an archive")
    r = api.c.post("/v1/images/import", params={"name": "y"}, content=b"junk", headers=api.h)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_archive")
    assert api.get("/v1/images").json()["images"] == []


def test_bad_requests_are_refused_before_any_build(api: Api) -> None:
    assert _build(api, "Bad Name").status_code == 400  # the query pattern
    assert _build(api, "tools").status_code == 201
    r = _build(api, "tools")
    assert (r.status_code, r.json()["error"]["code"]) == (409, "image_exists")
    r = api.c.post("/v1/images/build", params={"name": "t2"}, content=b"not a tar at all", headers=api.h)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_context")
    r = _build(api, "t3", files={"hello.txt": "hi"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "dockerfile_missing")
    r = _build(api, "t4", dockerfile="../../etc/passwd")
    assert (r.status_code, r.json()["error"]["code"]) == (400, "dockerfile_missing")
    r = api.c.post("/v1/images/import", params={"name": "empty"}, content=b"", headers=api.h)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_archive")
    assert sum(1 for c in api.node.calls if c[0] == "build_image") == 1
    assert list((api.control.settings.images_dir / ".uploads").iterdir()) == []  # no upload left behind


def test_a_context_tar_cannot_write_outside_its_folder(api: Api) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    r = api.c.post("/v1/images/build", params={"name": "evil"}, content=buf.getvalue(), headers=api.h)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_context")
    assert not (api.control.settings.images_dir / "escaped.txt").exists()


def test_sandboxes_start_from_an_image_and_keep_it(api: Api) -> None:
    _build(api, "tools")
    sb = api.new(image="tools")
    assert sb["image"] == "tools"
    spec = api.node.boxes[sb["id"]].spec
    assert spec.image is not None and spec.image["name"] == "tools" and spec.image["env"] == {"GREETING": "hi"}
    r = api.post(f"/v1/sandboxes/{sb['id']}/fork?wait=true", json={})
    assert r.status_code == 200, r.text
    fork = r.json()["sandbox"]
    assert fork["image"] == "tools" and api.node.boxes[fork["id"]].spec.image["name"] == "tools"
    assert api.post(f"/v1/sandboxes/{sb['id']}/snapshot", json={"name": "snap1"}).status_code == 201
    again = api.new(fromSnapshot="snap1")
    assert again["image"] == "tools"
    r = api.delete("/v1/images/tools")
    assert (r.status_code, r.json()["error"]["code"]) == (409, "image_in_use")
    assert sb["id"] in r.json()["error"]["message"]
    assert api.new()["image"] is None
    r = api.post("/v1/sandboxes", json={"image": "nope"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "image_not_found")
    r = api.post("/v1/sandboxes", json={"image": "tools", "fromSnapshot": "snap1"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_image")
    for sid in (fork["id"], again["id"]):
        assert api.delete(f"/v1/sandboxes/{sid}?wait=true").status_code == 200
    api.control.store.update_sandbox(sb["id"], state="deleting")  # a delete without --wait answers before it is gone
    r = api.delete("/v1/images/tools")
    assert (r.status_code, r.json()["error"]["code"]) == (409, "image_in_use")
    assert f"{sb['id']} (being deleted): wait for their deletion" in r.json()["error"]["message"]
    api.control.store.update_sandbox(sb["id"], state="deleted")
    assert api.delete("/v1/images/tools").status_code == 200


def test_accounts_see_only_their_own_and_shared_images(api: Api) -> None:
    a, b = _account(api, "alice"), _account(api, "bob")
    assert _build(api, "mine", headers=a).status_code == 201
    assert [i["name"] for i in api.c.get("/v1/images", headers=b).json()["images"]] == []
    r = api.c.post("/v1/sandboxes", json={"image": "mine"}, headers=b)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "image_not_found")
    assert api.c.delete("/v1/images/mine", headers=b).status_code == 404
    assert _build(api, "mine", headers=b).status_code == 201  # names are per account
    r = _build(api, "common", headers=a, shared="true")
    assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_only")
    assert _build(api, "common", shared="true").status_code == 201  # the admin's key
    names = [(i["name"], i["owned"]) for i in api.c.get("/v1/images", headers=b).json()["images"]]
    assert names == [("common", False), ("mine", True)]
    assert api.c.delete("/v1/images/common", headers=b).status_code == 404  # shared, not bob's


def test_openapi_describes_the_image_routes(api: Api) -> None:
    doc = api.c.get("/openapi.json").json()
    for path in ("/v1/images", "/v1/images/{name}", "/v1/images/build", "/v1/images/import"):
        assert path in doc["paths"]
    build = doc["paths"]["/v1/images/build"]["post"]["responses"]
    assert {"201", "400", "403", "409", "413", "422"} <= set(build)
    for path in ("/v1/images/build", "/v1/images/import"):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True and "application/octet-stream" in body["content"]  # an empty one is invalid


def test_an_e2b_template_id_names_an_image(api: Api) -> None:
    _build(api, "agent-box")
    e2b = {"X-API-Key": api.h["Authorization"].split()[1]}
    r = api.c.post("/e2b/sandboxes", json={"templateID": "agent-box"}, headers=e2b)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["templateID"] == "agent-box"
    assert api.node.boxes[created["sandboxID"]].spec.image["name"] == "agent-box"
    listed = api.c.get("/e2b/v2/sandboxes", params={"template": "agent-box"}, headers=e2b).json()
    assert [s["sandboxID"] for s in listed] == [created["sandboxID"]]
    r = api.c.post("/e2b/sandboxes", json={"templateID": "no-such-image"}, headers=e2b)
    assert r.status_code == 400 and "no-such-image" in r.json()["message"]


def test_an_image_larger_than_the_sizes_disk_is_refused_before_anything_is_made(api: Api) -> None:
    _build(api, "big")
    from sqlalchemy import update

    from sbx.control.images.catalog import ImageRow

    with api.control.store.session() as s, s.begin():  # the image's file is 3 GiB
        row = s.get(ImageRow, api.get("/v1/images/big").json()["image"]["id"])
        s.execute(update(ImageRow).where(ImageRow.id == row.id).values(facts={**row.facts, "size_bytes": 3 << 30}))
    before = len(api.get("/v1/sandboxes").json()["sandboxes"])
    r = api.post("/v1/sandboxes", json={"image": "big", "type": "small"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "image_too_large")
    assert "pick a larger type" in r.json()["error"]["message"]
    assert len(api.get("/v1/sandboxes").json()["sandboxes"]) == before
    assert api.post("/v1/sandboxes?wait=true", json={"image": "big", "type": "xlarge"}).status_code == 200
