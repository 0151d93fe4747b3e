"""Issue 34 over the API with a FakeNode: the volume routes (create, list, show, delete: a real ``juicefs format``
and ``destroy`` under the test's own home), their errors (a bad name or size, a name taken, an unknown volume,
another account's volume, a volume in use, a path over /proc or not absolute), sandboxes made with volumes (the node
gets each volume's mount in the spec; forks mount the same; the sandbox's view lists them) and the OpenAPI
document declaring the routes and their errors. Every error changes nothing."""

from __future__ import annotations

import stat

from tests.fakes import Api, auth


def _account(api: Api, name: str) -> dict[str, str]:
    r = api.post("/v1/accounts", json={"name": name, "plan": "team"})
    assert r.status_code == 201, r.text
    return auth(r.json()["key"]["token"])


def _err(r) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    body = r.json()
    assert set(body["error"]) >= {"code", "message"}, body
    return r.status_code, body["error"]["code"]


def test_create_list_show_delete(api: Api) -> None:
    r = api.post("/v1/volumes", json={"name": "data", "size": 5})
    assert r.status_code == 201, r.text
    vol = r.json()["volume"]
    assert vol["name"] == "data" and vol["id"].startswith("vol_") and vol["sizeGiB"] == 5 and vol["sandboxes"] == []
    vdir = api.control.settings.volumes_dir
    meta = vdir / "meta" / f"{vol['id']}.db"
    assert meta.is_file()  # juicefs format made its metadata
    assert stat.S_IMODE(vdir.stat().st_mode) == 0o700 and stat.S_IMODE((vdir / "store").stat().st_mode) == 0o700
    assert [v["name"] for v in api.get("/v1/volumes").json()["volumes"]] == ["data"]
    assert api.get("/v1/volumes/data").json()["volume"]["id"] == vol["id"]
    assert api.delete("/v1/volumes/data").json() == {"deleted": "data"}
    assert _err(api.get("/v1/volumes/data")) == (404, "volume_not_found")
    assert not meta.exists()
    assert api.get("/v1/volumes").json()["volumes"] == []


def test_bad_input_is_refused_and_changes_nothing(api: Api) -> None:
    assert api.post("/v1/volumes", json={"name": "data"}).status_code == 201
    assert _err(api.post("/v1/volumes", json={"name": "data"})) == (409, "volume_exists")
    for bad in ("Bad", "-x", "a/b", "a" * 64, "é"):
        assert _err(api.post("/v1/volumes", json={"name": bad})) == (400, "invalid_volume_name"), bad
    for size in (0, -1, 65537):
        assert _err(api.post("/v1/volumes", json={"name": "sized", "size": size})) == (400, "invalid_volume_size")
    assert _err(api.delete("/v1/volumes/nope")) == (404, "volume_not_found")
    assert [v["name"] for v in api.get("/v1/volumes").json()["volumes"]] == ["data"]
    before = {p.name for p in (api.control.settings.volumes_dir / "meta").glob("*.db")}
    assert len(before) == 1


def test_accounts_are_kept_apart(api: Api) -> None:
    b = _account(api, "bob")
    assert api.post("/v1/volumes", json={"name": "data"}).status_code == 201
    assert _err(api.c.get("/v1/volumes/data", headers=b)) == (404, "volume_not_found")
    assert _err(api.c.delete("/v1/volumes/data", headers=b)) == (404, "volume_not_found")
    assert api.c.get("/v1/volumes", headers=b).json()["volumes"] == []
    r = api.c.post("/v1/sandboxes", json={"volumes": [{"name": "data", "path": "/data"}]}, headers=b)
    assert _err(r) == (404, "volume_not_found")
    # the same name is free in another account
    assert api.c.post("/v1/volumes", json={"name": "data"}, headers=b).status_code == 201


def test_sandboxes_mount_volumes_and_forks_keep_them(api: Api) -> None:
    api.post("/v1/volumes", json={"name": "data"})
    api.post("/v1/volumes", json={"name": "ref"})
    vid = api.get("/v1/volumes/data").json()["volume"]["id"]
    sb = api.new(volumes=[{"name": "data", "path": "/data"}, {"name": "ref", "path": "/opt/ref/", "readOnly": True}])
    assert sb["volumes"] == [{"name": "data", "path": "/data", "readOnly": False},
                             {"name": "ref", "path": "/opt/ref", "readOnly": True}]
    spec = api.node.boxes[sb["id"]].spec
    assert [(v["name"], v["path"], v["readOnly"]) for v in spec.volumes] == [("data", "/data", False),
                                                                             ("ref", "/opt/ref", True)]
    assert spec.volumes[0]["id"] == vid and spec.volumes[0]["meta"].endswith(f"/meta/{vid}.db")
    assert api.get("/v1/volumes/data").json()["volume"]["sandboxes"] == [sb["id"]]
    r = api.post(f"/v1/sandboxes/{sb['id']}/fork?wait=true", json={})
    assert r.status_code == 200, r.text
    fork = r.json()["sandbox"]
    assert fork["volumes"] == sb["volumes"] and api.node.boxes[fork["id"]].spec.volumes == spec.volumes
    assert api.get("/v1/volumes/data").json()["volume"]["sandboxes"] == sorted([sb["id"], fork["id"]])
    # in use: refused (naming the sandboxes), nothing changes; free once both are deleted
    r = api.delete("/v1/volumes/data")
    assert _err(r) == (409, "volume_in_use") and sb["id"] in r.json()["error"]["message"]
    assert api.get("/v1/volumes/data").status_code == 200
    for sid in (sb["id"], fork["id"]):
        assert api.delete(f"/v1/sandboxes/{sid}?wait=true").status_code == 200
    assert api.get("/v1/volumes/data").json()["volume"]["sandboxes"] == []
    assert api.delete("/v1/volumes/data").status_code == 200
    # a resume tells the node the volumes again
    other = api.new(volumes=[{"name": "ref", "path": "/ref"}])
    assert api.post(f"/v1/sandboxes/{other['id']}/stop?wait=true", json={}).status_code == 200
    assert api.post(f"/v1/sandboxes/{other['id']}/resume?wait=true", json={}).status_code == 200
    resumed = [c for c in api.node.calls if c[0] == "resume" and c[1] == other["id"]]
    assert resumed and api.node.boxes[other["id"]].spec.volumes[0]["path"] == "/ref"


def test_bad_mounts_are_refused_and_create_nothing(api: Api) -> None:
    api.post("/v1/volumes", json={"name": "data"})
    before = len(api.get("/v1/sandboxes").json()["sandboxes"])
    for path in ("/proc", "/proc/x", "/sys/fs", "/dev", "/dev/shm", "/run/sbx", "/run/sbx/agent", "relative/path",
                 "/", "/data/../proc", "", "/run"):
        r = api.post("/v1/sandboxes", json={"volumes": [{"name": "data", "path": path}]})
        assert _err(r) == (400, "invalid_volume_path"), (path, r.text)
    assert _err(api.post("/v1/sandboxes", json={"volumes": [{"name": "nope", "path": "/x"}]})) == (
        404, "volume_not_found")
    assert _err(api.post("/v1/sandboxes", json={"volumes": [{"name": "data", "path": "/a"},
                                                             {"name": "data", "path": "/a/b"}]})) == (
        400, "invalid_volume")
    assert _err(api.post("/v1/sandboxes", json={"volumes": [{"name": "data", "path": "/a"}],
                                                "runtime": "gvisor"})) == (400, "invalid_volume")
    assert len(api.get("/v1/sandboxes").json()["sandboxes"]) == before
    assert api.get("/v1/volumes/data").json()["volume"]["sandboxes"] == []


def test_openapi_declares_the_routes_and_errors(api: Api) -> None:
    doc = api.c.get("/openapi.json").json()
    paths = doc["paths"]
    assert {"post", "get"} <= set(paths["/v1/volumes"]) and {"get", "delete"} <= set(paths["/v1/volumes/{name}"])
    assert {"400", "409"} <= set(paths["/v1/volumes"]["post"]["responses"])
    assert {"404", "409"} <= set(paths["/v1/volumes/{name}"]["delete"]["responses"])
    body = doc["components"]["schemas"]["CreateSandbox"]["properties"]
    assert "volumes" in body
    assert "volumes" in doc["components"]["schemas"]["Sandbox"]["properties"]
