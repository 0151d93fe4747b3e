"""The HTTP API through the real FastAPI app with a FakeNode: shapes, every error code, lifecycle rules."""

from __future__ import annotations

import json
import re
import threading

import pytest

from tests.fakes import Api, make_api, wait_until

SANDBOX_KEYS = {
    "id", "name", "type", "state", "memoryGB", "vcpus", "diskGB", "memoryRestored", "resumeReason", "createdAt",
    "updatedAt", "subdomain", "url", "ttl", "autoResume", "noSnapshots", "labels", "stats",
    "memorySaved", "stopReason", "stopError", "error", "node", "nodeStatus", "replicaNode", "sealStored",
    "sealStoredAt", "image", "runtime", "volumes",
}
STATS_KEYS = {"memoryTotalMb", "memoryUsedMb", "cpuPercent", "diskUsedMb", "oomKills", "diskAllocatedBytes",
              "diskUniqueBytes"}
SNAPSHOT_KEYS = {"name", "sandboxId", "auto", "sizeMB", "createdAt", "allocatedBytes", "uniqueBytes"}
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def err(r) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    body = r.json()
    assert set(body) == {"error"}, body
    assert {"code", "message"} <= set(body["error"]), body
    return r.status_code, body["error"]["code"]


def settle(api: Api, sid: str, state: str) -> dict:  # type: ignore[type-arg]
    return wait_until(lambda: (s := api.sandbox(sid))["state"] == state and s)


# --- shapes ------------------------------------------------------------------------------------------------------
def test_create_returns_202_with_the_seed_sandbox_shape(api: Api) -> None:
    r = api.post("/v1/sandboxes", json={"type": "small", "name": "demo", "ttl": 600})
    assert r.status_code == 202
    sb = r.json()["sandbox"]
    assert set(sb) == SANDBOX_KEYS and set(sb["stats"]) == STATS_KEYS
    assert re.fullmatch(r"sb_[a-z0-9]{10}", sb["id"])
    assert re.fullmatch(r"[a-z]+-[a-z]+-[a-z]+", sb["subdomain"])
    assert sb["url"] == f"https://{sb['subdomain']}.sbx.localhost"
    assert (sb["name"], sb["type"], sb["ttl"], sb["vcpus"]) == ("demo", "small", 600, 2)
    assert sb["memoryRestored"] is None and sb["resumeReason"] is None
    assert ISO.match(sb["createdAt"]) and ISO.match(sb["updatedAt"])
    running = settle(api, sb["id"], "running")
    assert running["stats"]["memoryTotalMb"] == 256


def test_list_and_info(api: Api) -> None:
    a = api.new(name="a")
    b = api.new(name="b", type="default")
    ids = [s["id"] for s in api.get("/v1/sandboxes").json()["sandboxes"]]
    assert ids == [a["id"], b["id"]]
    assert api.sandbox(b["id"])["memoryGB"] == 0.5


def test_openapi_is_served(api: Api) -> None:
    spec = api.c.get("/openapi.json").json()
    assert "/v1/sandboxes/{sandbox_id}/fork" in spec["paths"]
    assert api.c.get("/healthz").json()["ok"] is True


# --- auth and generic errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"}])
def test_401_without_or_with_a_wrong_token(api: Api, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/v1/sandboxes"), ("POST", "/v1/sandboxes"), ("GET", "/v1/snapshots")]:
        r = api.c.request(method, path, headers=headers, json={})
        assert err(r) == (401, "unauthorized")


def test_404_for_unknown_things(api: Api) -> None:
    missing = "sb_0000000000"
    assert err(api.get(f"/v1/sandboxes/{missing}")) == (404, "not_found")
    assert err(api.post(f"/v1/sandboxes/{missing}/stop")) == (404, "not_found")
    assert err(api.post(f"/v1/sandboxes/{missing}/resume")) == (404, "not_found")
    assert err(api.post(f"/v1/sandboxes/{missing}/fork")) == (404, "not_found")
    assert err(api.post(f"/v1/sandboxes/{missing}/snapshot", json={"name": "x"})) == (404, "not_found")
    assert err(api.delete(f"/v1/sandboxes/{missing}")) == (404, "not_found")
    assert err(api.get(f"/v1/sandboxes/{missing}/events")) == (404, "not_found")
    assert err(api.post(f"/v1/sandboxes/{missing}/exec", json={"command": "true"})) == (404, "not_found")
    assert err(api.delete("/v1/snapshots/nope")) == (404, "not_found")
    assert err(api.post("/v1/sandboxes", json={"fromSnapshot": "nope"})) == (404, "not_found")
    assert err(api.get("/v1/nothing-here")) == (404, "not_found")
    sb = api.new()
    assert err(api.get(f"/v1/sandboxes/{sb['id']}/jobs/job_nope")) == (404, "not_found")


@pytest.mark.parametrize(
    "body",
    [
        {"type": 3},
        {"ttl": "soon"},
        {"unknown": True},
        {"env": {"A": 1}},
        [1, 2],
    ],
)
def test_422_invalid_request_keeps_the_error_shape(api: Api, body: object) -> None:
    assert err(api.post("/v1/sandboxes", json=body)) == (422, "invalid_request")


def test_a_negative_ttl_is_400_invalid_ttl_everywhere(api: Api) -> None:
    assert err(api.post("/v1/sandboxes", json={"ttl": -1})) == (400, "invalid_ttl")
    sb = api.new()
    assert err(api.post(f"/v1/sandboxes/{sb['id']}/fork", json={"ttl": -5})) == (400, "invalid_ttl")
    api.post(f"/v1/sandboxes/{sb['id']}/stop?wait=true", json={})
    assert err(api.post(f"/v1/sandboxes/{sb['id']}/resume", json={"ttl": -5})) == (400, "invalid_ttl")


def test_422_for_a_body_that_is_not_json(api: Api) -> None:
    r = api.c.post("/v1/sandboxes", content=b"{nope", headers={**api.h, "Content-Type": "application/json"})
    assert err(r) == (422, "invalid_request")
    assert r.json()["error"]["message"].startswith("the body is not valid JSON at byte 1")
    form = {**api.h, "Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d` sends by default
    r = api.c.post("/v1/sandboxes", content=b'{"type": "small"}', headers=form)
    assert err(r) == (422, "invalid_request")
    assert "Content-Type: application/json" in r.json()["error"]["message"]
    sb = api.new()
    assert err(api.post(f"/v1/sandboxes/{sb['id']}/exec", json={})) == (422, "invalid_request")


def test_400_invalid_type_everywhere(api: Api) -> None:
    assert err(api.post("/v1/sandboxes", json={"type": "huge"})) == (400, "invalid_type")
    sb = api.new()
    assert err(api.post(f"/v1/sandboxes/{sb['id']}/fork", json={"type": "huge"})) == (400, "invalid_type")
    api.post(f"/v1/sandboxes/{sb['id']}/stop?wait=true")
    assert err(api.post(f"/v1/sandboxes/{sb['id']}/resume", json={"type": "huge"})) == (400, "invalid_type")


# --- stop / resume / resize --------------------------------------------------------------------------------------
def test_resume_smaller_is_invalid_resize_and_require_memory_with_resize_is_refused(api: Api) -> None:
    sb = api.new(type="default")
    sid = sb["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    assert err(api.post(f"/v1/sandboxes/{sid}/resume", json={"type": "small"})) == (400, "invalid_resize")
    r = api.post(f"/v1/sandboxes/{sid}/resume", json={"type": "large", "requireMemory": True})
    assert err(r) == (400, "invalid_require_memory")
    assert api.sandbox(sid)["state"] == "stopped"


def test_resize_resume_cold_boots_and_reports_resized_with_fresh_stats(api: Api) -> None:
    sb = api.new(type="small", ttl=900)
    sid = sb["id"]
    assert api.post(f"/v1/sandboxes/{sid}/stop?wait=true").json()["sandbox"]["state"] == "stopped"
    r = api.post(f"/v1/sandboxes/{sid}/resume", json={"type": "default"})
    assert r.status_code == 202
    accepted = r.json()["sandbox"]
    assert (accepted["type"], accepted["memoryRestored"], accepted["resumeReason"]) == ("default", False, "resized")
    done = settle(api, sid, "running")
    assert (done["id"], done["subdomain"]) == (sid, sb["subdomain"])
    assert (done["type"], done["memoryGB"], done["memoryRestored"], done["resumeReason"]) == (
        "default", 0.5, False, "resized")
    assert done["stats"]["memoryTotalMb"] == 512
    assert done["ttl"] == 900
    resume_calls = [c for c in api.node.calls if c[0] == "resume"]
    assert resume_calls[-1][2]["cold"] is True and resume_calls[-1][2]["size"] == "default"


def test_plain_resume_restores_memory_and_takes_a_new_ttl(api: Api) -> None:
    sid = api.new()["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    r = api.post(f"/v1/sandboxes/{sid}/resume?wait=true", json={"ttl": 120, "requireMemory": True})
    assert r.status_code == 200, r.text
    sb = r.json()["sandbox"]
    assert (sb["state"], sb["memoryRestored"], sb["resumeReason"], sb["ttl"]) == ("running", True, None, 120)


def test_resume_after_a_cpu_mismatch_reports_it(api: Api) -> None:
    sid = api.new()["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    api.node.cpu_mismatch = True
    sb = api.post(f"/v1/sandboxes/{sid}/resume?wait=true").json()["sandbox"]
    assert (sb["memoryRestored"], sb["resumeReason"]) == (False, "cpu_mismatch")


def test_require_memory_without_a_memory_image_is_409(api: Api) -> None:
    sid = api.new()["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true", json={"keepMemory": False})
    r = api.post(f"/v1/sandboxes/{sid}/resume", json={"requireMemory": True})
    assert err(r) == (409, "memory_unavailable")


def test_require_memory_refused_by_the_node_leaves_it_stopped(api: Api) -> None:
    sid = api.new()["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    api.node.cpu_mismatch = True
    r = api.post(f"/v1/sandboxes/{sid}/resume?wait=true", json={"requireMemory": True})
    assert err(r) == (409, "cpu_mismatch")
    assert api.sandbox(sid)["state"] == "stopped"


def test_stop_then_immediate_resume_waits_and_never_404s(api: Api) -> None:
    sid = api.new()["id"]
    gate = api.node.gate("stop")
    r = api.post(f"/v1/sandboxes/{sid}/stop")
    assert r.status_code == 202 and r.json()["sandbox"]["state"] == "stopping"
    assert api.sandbox(sid)["state"] == "stopping"
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    r = api.post(f"/v1/sandboxes/{sid}/resume")
    timer.join()
    api.node.ungate("stop")
    assert r.status_code == 202, r.text
    assert r.json()["sandbox"]["state"] in ("resuming", "running")
    assert settle(api, sid, "running")["memoryRestored"] is True


def test_a_conflicting_request_gets_409_busy_after_the_bounded_wait(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for api in make_api(tmp_path, wait=0.3):
        sid = api.new()["id"]
        api.node.gate("stop")
        assert api.post(f"/v1/sandboxes/{sid}/stop").status_code == 202
        r = api.post(f"/v1/sandboxes/{sid}/resume")
        assert err(r) == (409, "busy")
        assert r.json()["error"]["state"] == "stopping"
        assert api.sandbox(sid)["state"] == "stopping"  # still there: never a 404
        api.node.ungate("stop")
        settle(api, sid, "stopped")


def test_ten_stop_resume_cycles_keep_the_id(api: Api) -> None:
    sb = api.new()
    sid = sb["id"]
    api.exec(sid, "echo kept > ~/f")
    for _ in range(10):
        assert api.post(f"/v1/sandboxes/{sid}/stop?wait=true").json()["sandbox"]["state"] == "stopped"
        got = api.post(f"/v1/sandboxes/{sid}/resume?wait=true").json()["sandbox"]
        assert (got["id"], got["subdomain"], got["url"], got["state"]) == (sid, sb["subdomain"], sb["url"], "running")
        assert got["memoryRestored"] is True
    status, lines = api.exec(sid, "cat ~/f")
    assert lines[0] == {"stream": "stdout", "data": "kept\n"}


def test_stop_of_a_stopped_sandbox_and_resume_of_a_running_one_are_no_ops(api: Api) -> None:
    sid = api.new()["id"]
    assert api.post(f"/v1/sandboxes/{sid}/resume").json()["sandbox"]["state"] == "running"
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    assert api.post(f"/v1/sandboxes/{sid}/stop").json()["sandbox"]["state"] == "stopped"
    assert len([c for c in api.node.calls if c[0] == "stop"]) == 1


def test_resize_of_a_running_sandbox_asks_for_a_stop_first(api: Api) -> None:
    sid = api.new()["id"]
    assert err(api.post(f"/v1/sandboxes/{sid}/resume", json={"type": "default"})) == (409, "invalid_state")


# --- no_snapshots -------------------------------------------------------------------------------------------------
def test_no_snapshots_sandbox_cannot_be_resumed_forked_or_snapshotted(api: Api) -> None:
    sid = api.new(noSnapshots=True)["id"]
    assert err(api.post(f"/v1/sandboxes/{sid}/fork")) == (409, "snapshots_disabled")
    assert err(api.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "s1"})) == (409, "snapshots_disabled")
    assert api.post(f"/v1/sandboxes/{sid}/stop?wait=true").json()["sandbox"]["state"] == "stopped"
    assert [c[2]["keep_memory"] for c in api.node.calls if c[0] == "stop"] == [False]
    assert err(api.post(f"/v1/sandboxes/{sid}/resume")) == (409, "snapshots_disabled")


# --- fork --------------------------------------------------------------------------------------------------------
def test_fork_defaults(api: Api) -> None:
    src = api.new(name="worker", type="small", ttl=300, env={"FOO": "bar"})
    api.exec(src["id"], "echo on-disk > ~/marker")
    r = api.post(f"/v1/sandboxes/{src['id']}/fork", json={})
    assert r.status_code == 202
    fork = r.json()["sandbox"]
    assert fork["id"] != src["id"] and fork["subdomain"] != src["subdomain"]
    assert (fork["name"], fork["type"], fork["ttl"], fork["state"]) == ("worker (fork)", "small", 3600, "forking")
    done = settle(api, fork["id"], "running")
    assert done["memoryRestored"] is None and done["resumeReason"] is None
    _, lines = api.exec(fork["id"], "cat ~/marker; echo $FOO")
    assert "".join(x.get("data", "") for x in lines) == "on-disk\nbar\n"
    assert api.sandbox(src["id"])["state"] == "running"


def test_fork_overrides_and_a_stopped_source_stays_stopped(api: Api) -> None:
    src = api.new(type="small")
    api.post(f"/v1/sandboxes/{src['id']}/stop?wait=true")
    body = {"type": "default", "ttl": 1800, "name": "big copy", "env": {"X": "1"}}
    r = api.post(f"/v1/sandboxes/{src['id']}/fork?wait=true", json=body)
    assert r.status_code == 200, r.text
    fork = r.json()["sandbox"]
    assert (fork["type"], fork["memoryGB"], fork["ttl"], fork["name"], fork["state"]) == (
        "default", 0.5, 1800, "big copy", "running")
    assert fork["memoryRestored"] is None
    src_now = api.sandbox(src["id"])
    assert (src_now["state"], src_now["type"]) == ("stopped", "small")


def test_a_fork_cannot_be_smaller_than_its_source(api: Api) -> None:
    src = api.new(type="default")
    assert err(api.post(f"/v1/sandboxes/{src['id']}/fork", json={"type": "small"})) == (400, "invalid_resize")
    assert api.sandbox(src["id"])["state"] == "running"
    assert [s["id"] for s in api.get("/v1/sandboxes").json()["sandboxes"]] == [src["id"]]


def test_fork_event_stream_has_the_seed_shape(api: Api) -> None:
    src = api.new()
    fork_id = api.post(f"/v1/sandboxes/{src['id']}/fork", json={"type": "default"}).json()["sandbox"]["id"]
    with api.c.stream("GET", f"/v1/sandboxes/{fork_id}/events?until=settled", headers=api.h) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in r.iter_lines() if line.strip()]
    kinds = [(e["event"], e.get("state")) for e in events]
    assert kinds == [("forking", None), ("state", "provisioning"), ("ready", "ready")]
    forking, provisioning, ready = events
    assert forking["id"] == fork_id and forking["source"] == src["id"]
    assert forking["sandbox"]["memoryRestored"] is None
    assert set(provisioning) == {"event", "id", "state", "seq"}
    assert ready["url"] == ready["sandbox"]["url"] and ready["sandbox"]["type"] == "default"
    assert ready["sandbox"]["memoryGB"] == 0.5 and ready["sandbox"]["memoryRestored"] is None


def test_events_of_a_stop_resume_cycle(api: Api) -> None:
    sid = api.new()["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    api.post(f"/v1/sandboxes/{sid}/resume?wait=true")
    r = api.get(f"/v1/sandboxes/{sid}/events")
    events = [json.loads(line) for line in r.text.splitlines()]
    assert [(e["event"], e["state"]) for e in events] == [
        ("state", "provisioning"), ("ready", "ready"), ("state", "stopping"), ("state", "stopped"),
        ("state", "resuming"), ("ready", "ready"),
    ]
    later = api.get(f"/v1/sandboxes/{sid}/events", params={"after": events[3]["seq"]}).text.splitlines()
    assert len(later) == 2


# --- snapshots ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["", "   ", "a" * 64, "bad name", "semi;colon", "-lead", "slash/x", "ünï"])
def test_invalid_snapshot_names(api: Api, name: str) -> None:
    sid = api.new()["id"]
    assert err(api.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": name})) == (400, "invalid_snapshot_name")


def test_snapshot_lifecycle_and_new_from_snapshot(api: Api) -> None:
    sid = api.new()["id"]
    api.exec(sid, "echo template > ~/t")
    r = api.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "my-stack"})
    assert r.status_code == 201
    assert r.json()["snapshot"]["name"] == "my-stack" and r.json()["snapshot"]["sandboxId"] == sid
    assert err(api.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "my-stack"})) == (409, "snapshot_exists")
    assert [s["name"] for s in api.get("/v1/snapshots").json()["snapshots"]] == ["my-stack"]
    assert [s["name"] for s in api.get(f"/v1/sandboxes/{sid}/snapshots").json()["snapshots"]] == ["my-stack"]
    copy = api.new(fromSnapshot="my-stack")
    _, lines = api.exec(copy["id"], "cat ~/t")
    assert lines[0]["data"] == "template\n"
    assert api.delete("/v1/snapshots/my-stack").json() == {"deleted": "my-stack"}
    assert api.get("/v1/snapshots").json()["snapshots"] == []
    assert err(api.delete("/v1/snapshots/my-stack")) == (404, "not_found")


def test_snapshot_of_a_stopped_sandbox_works(api: Api) -> None:
    sid = api.new()["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    assert api.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "cold.1"}).status_code == 201


# --- exec and jobs -----------------------------------------------------------------------------------------------
def test_exec_streams_ndjson_and_passes_the_exit_code(api: Api) -> None:
    sid = api.new()["id"]
    status, lines = api.exec(sid, "echo out; echo err >&2; printf 'caf\\xc3\\xa9'; exit 7")
    assert status == 200
    assert lines[-1] == {"exitCode": 7, "timedOut": False}
    text = {"stdout": "", "stderr": ""}
    for line in lines[:-1]:
        assert set(line) == {"stream", "data"}
        text[line["stream"]] += line["data"]
    assert text == {"stdout": "out\ncafé", "stderr": "err\n"}


def test_exec_timeout_gives_124(api: Api) -> None:
    sid = api.new()["id"]
    _, lines = api.exec(sid, "echo start; sleep 30", timeout=0.5)
    assert lines[0] == {"stream": "stdout", "data": "start\n"}
    assert lines[-1] == {"exitCode": 124, "timedOut": True}


def test_exec_on_a_stopped_sandbox_is_409_not_running(api: Api) -> None:
    sid = api.new()["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    status, body = api.exec(sid, "true")
    assert (status, body["error"]["code"], body["error"]["state"]) == (409, "not_running", "stopped")


def test_exec_on_a_resuming_sandbox_waits_for_it(api: Api) -> None:
    sid = api.new()["id"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    gate = api.node.gate("resume")
    assert api.post(f"/v1/sandboxes/{sid}/resume", json={"type": "default"}).status_code == 202
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    status, lines = api.exec(sid, "echo after-resume")
    timer.join()
    api.node.ungate("resume")
    assert status == 200 and lines[0]["data"] == "after-resume\n"


def test_detached_jobs_logs_and_wait(api: Api) -> None:
    sid = api.new()["id"]
    r = api.post(f"/v1/sandboxes/{sid}/jobs", json={"command": "echo one; sleep 0.3; echo two >&2; exit 3"})
    assert r.status_code == 201
    job = r.json()["job"]
    assert job["id"].startswith("job_") and job["running"] is True
    assert [j["id"] for j in api.get(f"/v1/sandboxes/{sid}/jobs").json()["jobs"]] == [job["id"]]
    with api.c.stream("GET", f"/v1/sandboxes/{sid}/jobs/{job['id']}/logs?follow=true", headers=api.h) as resp:
        lines = [json.loads(x) for x in resp.iter_lines() if x.strip()]
    assert lines[-1] == {"exitCode": 3, "timedOut": False}
    assert {"stream": "stdout", "data": "one\n"} in lines and {"stream": "stderr", "data": "two\n"} in lines
    waited = api.get(f"/v1/sandboxes/{sid}/jobs/{job['id']}/wait").json()["job"]
    assert (waited["running"], waited["exitCode"]) == (False, 3)


# --- delete ------------------------------------------------------------------------------------------------------
def test_delete_then_404(api: Api) -> None:
    sid = api.new()["id"]
    r = api.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 202 and r.json()["sandbox"]["state"] == "deleting"
    wait_until(lambda: api.get(f"/v1/sandboxes/{sid}").status_code == 404)
    assert api.get("/v1/sandboxes").json()["sandboxes"] == []
    assert sid not in api.node.boxes


def test_node_failure_is_an_error_state_not_a_500(api: Api) -> None:
    api.node.fail_next("create", "boot_failed", "systemd did not come up")
    r = api.post("/v1/sandboxes?wait=true", json={})
    assert err(r) == (502, "boot_failed")
    sid = api.get("/v1/sandboxes").json()["sandboxes"][0]["id"]
    assert api.sandbox(sid)["state"] == "error"
    assert api.delete(f"/v1/sandboxes/{sid}?wait=true").json()["sandbox"]["state"] == "deleted"


# --- space accounting --------------------------------------------------------------------------------------------
def test_stats_and_snapshots_carry_space_figures(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    from sbx.node.types import SnapshotInfo, Stats

    sid = api.new()["id"]

    def stats(id: str, space: bool = True) -> Stats:
        if api.node.status(id) != "running":
            return Stats(0, 0, 0.0, 0, 0, disk_allocated_bytes=300 << 20, disk_unique_bytes=5 << 20)
        return Stats(256, 42, 1.5, 7, 0, disk_allocated_bytes=300 << 20, disk_unique_bytes=60 << 20)

    real_snapshots = api.node.snapshots

    def snapshots() -> list[SnapshotInfo]:
        return [SnapshotInfo(i.name, i.source_id, i.size_mib, 290 << 20, 1 << 20) for i in real_snapshots()]

    monkeypatch.setattr(api.node, "stats", stats)
    monkeypatch.setattr(api.node, "snapshots", snapshots)
    st = api.sandbox(sid)["stats"]
    assert set(st) == STATS_KEYS
    assert (st["diskAllocatedBytes"], st["diskUniqueBytes"], st["memoryUsedMb"]) == (300 << 20, 60 << 20, 42)
    snap = api.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "space"}).json()["snapshot"]
    assert set(snap) == SNAPSHOT_KEYS and (snap["allocatedBytes"], snap["uniqueBytes"]) == (290 << 20, 1 << 20)
    for path in ("/v1/snapshots", f"/v1/sandboxes/{sid}/snapshots"):
        [listed] = api.get(path).json()["snapshots"]
        assert set(listed) == SNAPSHOT_KEYS and listed["uniqueBytes"] == 1 << 20
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    stopped = api.sandbox(sid)["stats"]  # a stopped sandbox still reports its disk's space, nothing else
    assert (stopped["diskAllocatedBytes"], stopped["diskUniqueBytes"], stopped["memoryUsedMb"]) == (
        300 << 20, 5 << 20, 0)


def test_a_nul_character_in_a_body_is_refused_not_a_500(api: Api) -> None:
    sid = api.new()["id"]
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"command": "echo a\u0000b"})
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["field"]) == (400, "invalid_command",
                                                                                     "command")
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true", "env": {"A": "x\u0000"}})
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["field"]) == (400, "invalid_env", "env.A")
    r = api.post(f"/v1/sandboxes/{sid}/jobs", json={"command": "sleep 1\u0000"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_command")
    assert "NUL" in r.json()["error"]["message"]


def test_exec_runs_as_user_or_root_only(api: Api) -> None:
    sid = api.new()["id"]
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"command": "id", "user": "bob"})
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["field"]) == (400, "invalid_user", "user")
    r = api.post(f"/v1/sandboxes/{sid}/jobs", json={"command": "id", "user": "bob"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_user")


def test_cold_create_and_fork_with_memory_reach_the_node(api: Api) -> None:
    cold = api.new(type="small", cold=True)
    warm = api.new(type="small")
    creates = {c[1]: c[2]["cold"] for c in api.node.calls if c[0] == "create"}
    assert creates[cold["id"]] is True and creates[warm["id"]] is False
    r = api.post(f"/v1/sandboxes/{warm['id']}/fork?wait=true", json={"memory": True})
    assert r.status_code == 200, r.text
    fork = r.json()["sandbox"]
    assert fork["memoryRestored"] is True and fork["state"] == "running"
    assert [c[2]["memory"] for c in api.node.calls if c[0] == "fork"] == [True]


def test_fork_with_memory_of_a_stopped_sandbox_is_409_and_changes_nothing(api: Api) -> None:
    src = api.new(type="small")
    api.post(f"/v1/sandboxes/{src['id']}/stop?wait=true")
    before = len(api.c.get("/v1/sandboxes", headers=api.h).json()["sandboxes"])
    r = api.post(f"/v1/sandboxes/{src['id']}/fork", json={"memory": True})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
    assert len(api.c.get("/v1/sandboxes", headers=api.h).json()["sandboxes"]) == before
    bad = api.post(f"/v1/sandboxes/{src['id']}/fork", json={"memory": "yes"})
    assert bad.status_code == 422 and bad.json()["error"]["field"].endswith("memory")


def test_a_bad_label_or_env_key_is_named_in_the_error(api: Api) -> None:
    r = api.post("/v1/sandboxes", json={"labels": {"bad key": "x"}})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_labels")
    assert "'bad key'" in r.json()["error"]["message"] and "{key" not in r.json()["error"]["message"]
    r = api.post("/v1/sandboxes", json={"env": {"1A": "x"}})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_env")
    assert "'1A'" in r.json()["error"]["message"] and "{key" not in r.json()["error"]["message"]
