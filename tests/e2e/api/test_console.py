"""Issue 15: the web console, driven in Debian's Chromium (headless, through Playwright's Python package) against a
real `sbx server` with real sandboxes: sign in, a wrong key refused, create from the page, a terminal that runs
``echo hi``, upload (picker and drag and drop) and download, stop and resume, memory and CPU graphs with points.
The API side of the console's sign-in is attacked too: a cookie-only change without the CSRF header, a terminal
opened from another origin, a signed-out cookie, and a hosted port that must never see the console's cookie.
The console signs in with an account's key (``sbx admin key create``) and sees that account only: another
account's sandbox is not found through its pages, its stats route and its terminal. The Usage page plots the
account's cost and GiB-hours per day and per size and shows the plan's limits with what is used.

Screenshots of each page go to ``docs/console/`` (linked from the README)."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, start_server

pytestmark = pytest.mark.e2e

SHOTS = Path(__file__).resolve().parents[3] / "docs" / "console"
CHROMIUM = "/usr/bin/chromium"
WAIT_MS = 120_000

HEADER_ECHO = r'''
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("cookie=" + (self.headers.get("Cookie") or "")).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("0.0.0.0", 8002), H).serve_forever()
'''


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own, sampling stats every 2 s so the graphs fill quickly."""
    with start_server(tmp_path_factory.mktemp("sbx-console"), node="console", bridge="sbxcon0",
                      subnet="10.93.0.0/16", SBX_STATS_SAMPLE_SECONDS="2") as s:
        yield s


@pytest.fixture(scope="module")
def alice(srv: Server) -> dict[str, str]:
    """An account on the pro plan and a key of its own made by ``sbx admin key create``: the console signs in
    with it. ``{"id", "token", "key"}``."""
    made = json.loads(srv.sbx("admin", "account", "create", "alice", "--plan", "pro", "--json", check=True).stdout)
    account = made["account"]["id"]
    key = json.loads(srv.sbx("admin", "key", "create", account, "--name", "console", "--json", check=True).stdout)
    return {"id": account, "token": key["key"]["token"], "key": key["key"]["id"]}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is missing: scripts/install.sh --dev installs it")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser: Any, srv: Server) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = ctx.new_page()
    pg.set_default_timeout(WAIT_MS)
    yield pg
    ctx.close()


def shot(pg: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def until(pg: Any, js: str, timeout: float = WAIT_MS / 1000) -> Any:
    """Poll ``js`` (a function expression) in the page until it returns something truthy. (Playwright's
    wait_for_function compiles its predicate with eval, which the console's Content-Security-Policy forbids.)"""
    deadline = time.monotonic() + timeout
    while True:
        value = pg.evaluate(js)
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {js}"
        time.sleep(0.2)


def bearer(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.token}"}, timeout=300)


def sandbox(srv: Server, sid: str) -> dict[str, Any]:
    with bearer(srv) as c:
        return c.get(f"/v1/sandboxes/{sid}").json()["sandbox"]  # type: ignore[no-any-return]


def the_sandbox(pg: Any) -> str:
    sid = pg.evaluate("window.sbxConsoleSandbox")
    assert sid, "the create test did not run first"
    return str(sid)


def test_a_wrong_key_is_refused_with_the_api_words(page: Any, srv: Server) -> None:
    page.goto(srv.url + "/")
    page.wait_for_selector("#signin-form")
    page.fill("#signin-key", "sbx_not-the-key")
    page.click("#signin-form button")
    page.wait_for_selector("#signin-error:has-text('unauthorized')")
    assert page.inner_text("#signin-error") == "unauthorized: wrong, revoked or expired API key"
    assert page.is_hidden("#nav")
    assert page.context.cookies() == []  # no session for a wrong key
    shot(page, "signin-refused")


def test_sign_in_and_create_a_sandbox_from_the_page(page: Any, srv: Server, alice: dict[str, str]) -> None:
    page.fill("#signin-key", alice["token"])
    page.click("#signin-form button")
    page.wait_for_selector("#create-form")
    cookie = next(c for c in page.context.cookies() if c["name"] == "sbx_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert alice["token"] not in cookie["value"]  # the browser holds a session id, never the key
    session = page.evaluate("fetch('/v1/console/session').then((r) => r.json())")["session"]
    assert (session["account"], session["keyId"], session["admin"]) == (alice["id"], alice["key"], False)
    assert page.evaluate("document.cookie") == ""  # and the page's scripts cannot read it
    page.select_option("#create-form select[name=type]", "small")
    page.fill("#create-form input[name=name]", "console-e2e")
    page.fill("#create-form input[name=ttl]", "3600")
    page.click("#create-form button[type=submit]")
    row = page.wait_for_selector("#sandboxes tr:has-text('console-e2e')")
    sid = row.get_attribute("data-id")
    assert sid and re.fullmatch(r"sb_[a-z0-9]{10}", sid)
    # the list updates itself (no reload) until the sandbox runs, with live memory and CPU
    page.wait_for_selector(f"#sandboxes tr[data-id='{sid}'][data-state='running']")
    cells = page.inner_text(f"#sandboxes tr[data-id='{sid}']")
    assert re.search(r"\d+ / 256 MiB", cells) and re.search(r"\d+\.\d %", cells), cells
    info = sandbox(srv, sid)
    assert (info["name"], info["type"], info["ttl"], info["state"]) == ("console-e2e", "small", 3600, "running")
    with bearer(srv) as c:  # made in the session's account
        assert sid in [x["key"] for x in c.get("/v1/usage", params={"by": "sandbox", "account": alice["id"]})
                       .json()["groups"]]
    page.evaluate(f"window.sbxConsoleSandbox = {json.dumps(sid)}")
    shot(page, "sandboxes")


def test_an_error_is_shown_as_the_api_words_it(page: Any, srv: Server) -> None:
    page.fill("#create-form input[name=ttl]", "999999999999")  # over ten years
    page.click("#create-form button[type=submit]")
    page.wait_for_selector("#banner.error")
    assert page.inner_text("#banner").startswith("invalid_ttl: ")
    page.fill("#create-form input[name=ttl]", "")


def test_a_gvisor_sandbox_from_the_page(page: Any, srv: Server) -> None:
    """The create form's runtime select offers the classes of the account's plan; a gvisor sandbox made there
    runs under runsc."""
    page.wait_for_selector("#create-form select[name=runtime] option[value=gvisor]", state="attached")
    options = page.eval_on_selector_all("#create-form select[name=runtime] option", "os => os.map(o => o.value)")
    assert options == ["", "container", "gvisor"], options
    page.fill("#create-form input[name=name]", "console-gvisor")
    page.select_option("#create-form select[name=runtime]", "gvisor")
    page.click("#create-form button[type=submit]")
    row = page.wait_for_selector("#sandboxes tr:has-text('console-gvisor')")
    gid = row.get_attribute("data-id")
    page.wait_for_selector(f"#sandboxes tr[data-id='{gid}'][data-state='running']", timeout=120_000)
    assert sandbox(srv, gid)["runtime"] == "gvisor"
    with bearer(srv) as c:
        assert c.delete(f"/v1/sandboxes/{gid}", params={"wait": "true"}).status_code in (200, 202, 204)


def test_the_terminal_runs_echo_hi(page: Any, srv: Server) -> None:
    sid = the_sandbox(page)
    page.goto(f"{srv.url}/#/terminal/{sid}")
    page.wait_for_selector("#term-status:has-text('connected')")
    until(page, "() => { const t = window.sbxTerminal; if (!t) return false; const b = t.buffer.active; "
                "return /[$#] *$/.test(b.getLine(b.cursorY + b.baseY).translateToString(true)); }")
    page.click("#terminal")
    page.keyboard.type("echo hi\n")
    screen = """() => { const b = window.sbxTerminal.buffer.active; const out = [];
        for (let i = 0; i < b.length; i++) out.push(b.getLine(i).translateToString(true)); return out; }"""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = page.evaluate(screen)
        if "hi" in [line.strip() for line in lines]:
            break
        time.sleep(0.2)
    assert "hi" in [line.strip() for line in lines], lines
    assert any(line.rstrip().endswith("echo hi") for line in lines)
    # the terminal follows the page's size: a narrower window gives the shell fewer columns
    cols = page.evaluate("window.sbxTerminal.cols")
    page.set_viewport_size({"width": 700, "height": 700})
    until(page, f"() => window.sbxTerminal.cols < {cols}")
    page.keyboard.type("echo cols=$(tput cols)\n")
    want = page.evaluate("window.sbxTerminal.cols")
    until(page, f"""() => {{ const b = window.sbxTerminal.buffer.active;
        for (let i = 0; i < b.length; i++) if (b.getLine(i).translateToString(true).trim() === "cols={want}")
        return true; return false; }}""")
    page.set_viewport_size({"width": 1280, "height": 860})
    shot(page, "terminal")


def test_upload_by_picker_and_by_drop_then_download(page: Any, srv: Server, tmp_path: Path) -> None:
    sid = the_sandbox(page)
    page.goto(f"{srv.url}/#/files/{sid}")
    page.wait_for_selector("#files tbody tr")
    f = tmp_path / "hello.txt"
    f.write_text("hello from the console\n")
    page.set_input_files("#upload-input", str(f))
    page.wait_for_selector("#files tr[data-name='hello.txt']")
    # drag and drop: a drop event carrying a file, as a person dragging it from their desktop makes
    page.evaluate("""() => { const dt = new DataTransfer();
        dt.items.add(new File(["dropped bytes\\n"], "dropped.txt", {type: "text/plain"}));
        document.getElementById("drop").dispatchEvent(new DragEvent("drop", {dataTransfer: dt, bubbles: true,
            cancelable: true})); }""")
    page.wait_for_selector("#files tr[data-name='dropped.txt']")
    with bearer(srv) as c:
        assert c.get(f"/v1/sandboxes/{sid}/files", params={"path": "hello.txt"}).text == "hello from the console\n"
        assert c.get(f"/v1/sandboxes/{sid}/files", params={"path": "dropped.txt"}).text == "dropped bytes\n"
    with page.expect_download() as dl:
        page.click("#files tr[data-name='hello.txt'] a[download]")
    assert Path(dl.value.path()).read_text() == "hello from the console\n"
    shot(page, "files")


def test_the_sandbox_page_draws_memory_and_cpu_graphs_with_points(page: Any, srv: Server) -> None:
    sid = the_sandbox(page)
    with bearer(srv) as c:  # a job, a route and a snapshot for the page to show
        c.post(f"/v1/sandboxes/{sid}/jobs", json={"command": "echo job-output; sleep 1"}).raise_for_status()
        c.post(f"/v1/sandboxes/{sid}/routes", json={"port": 8000}).raise_for_status()
        c.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "console-snap"}).raise_for_status()
    page.goto(f"{srv.url}/#/sandbox/{sid}")
    until(page, "() => Number(document.getElementById('chart-memory').dataset.points) >= 3")
    assert page.query_selector("#chart-memory canvas") and page.query_selector("#chart-cpu canvas")
    with bearer(srv) as c:
        series = c.get(f"/v1/sandboxes/{sid}/stats").json()
    assert len(series["samples"]) >= 3 and all(s["memoryUsedMb"] > 0 for s in series["samples"])
    assert series["samples"] == sorted(series["samples"], key=lambda s: s["at"])
    page.wait_for_selector("#routes code:has-text('https://8000-')")
    page.wait_for_selector("#snapshots li:has-text('console-snap')")
    page.wait_for_selector("#events li[data-event='ready']")
    assert page.inner_text("#facts [data-fact=memoryRestored]") == "null"
    page.click("#jobs li:has-text('echo job-output') button")
    page.wait_for_selector("#job-logs:has-text('job-output')")
    shot(page, "sandbox")


def test_stop_and_resume_from_the_list(page: Any, srv: Server) -> None:
    sid = the_sandbox(page)
    page.goto(f"{srv.url}/#/sandboxes")
    page.click(f"#sandboxes tr[data-id='{sid}'] button[data-action=stop]")
    page.wait_for_selector(f"#sandboxes tr[data-id='{sid}'][data-state='stopped']")
    assert sandbox(srv, sid)["state"] == "stopped"
    shot(page, "sandboxes-stopped")
    page.click(f"#sandboxes tr[data-id='{sid}'] button[data-action=resume]")
    page.wait_for_selector("dialog.ask[open] select[name=type]")
    page.click("dialog.ask button[type=submit]")
    page.wait_for_selector(f"#sandboxes tr[data-id='{sid}'][data-state='running']")
    info = sandbox(srv, sid)
    assert (info["state"], info["memoryRestored"], info["resumeReason"]) == ("running", True, None)
    # stop again and resume at a bigger size: a resize, cold boot
    page.click(f"#sandboxes tr[data-id='{sid}'] button[data-action=stop]")
    page.wait_for_selector(f"#sandboxes tr[data-id='{sid}'][data-state='stopped']")
    page.click(f"#sandboxes tr[data-id='{sid}'] button[data-action=resume]")
    page.select_option("dialog.ask[open] select[name=type]", "default")
    page.click("dialog.ask button[type=submit]")
    page.wait_for_selector(f"#sandboxes tr[data-id='{sid}'][data-state='running']:has-text('default')")
    info = sandbox(srv, sid)
    assert (info["type"], info["memoryRestored"], info["resumeReason"]) == ("default", False, "resized")
    page.goto(f"{srv.url}/#/sandbox/{sid}")
    page.wait_for_selector("#facts [data-fact=resumeReason]:has-text('resized')")
    assert page.inner_text("#facts [data-fact=memoryRestored]") == "false"


@pytest.fixture(scope="module")
def theirs(srv: Server) -> Iterator[str]:
    """A running sandbox of another account (the installation's first one, made with the admin key)."""
    with bearer(srv) as c:
        r = c.post("/v1/sandboxes?wait=true", json={"type": "small", "name": "not-alices"})
        assert r.status_code == 200, r.text
        sid = r.json()["sandbox"]["id"]
        yield sid
        c.delete(f"/v1/sandboxes/{sid}?wait=true")


def test_the_console_shows_only_its_accounts_sandboxes(page: Any, srv: Server, theirs: str) -> None:
    from websockets.sync.client import connect

    mine = the_sandbox(page)
    page.goto(srv.url + "/#/sandboxes")
    page.wait_for_selector(f"#sandboxes tr[data-id='{mine}']")
    time.sleep(3.5)  # one more poll of the list
    ids = page.eval_on_selector_all("#sandboxes tr[data-id]", "(rows) => rows.map((r) => r.dataset.id)")
    assert mine in ids and theirs not in ids, ids
    # another account's sandbox URL: not found, like a missing one, and nothing of it is shown
    page.goto(f"{srv.url}/#/sandbox/{theirs}")
    page.wait_for_selector("#banner.error:has-text('not_found')")
    assert "not-alices" not in page.inner_text("#page")
    c, csrf = session_client(srv, page)
    try:
        for path in (f"/v1/sandboxes/{theirs}", f"/v1/sandboxes/{theirs}/stats", f"/v1/sandboxes/{theirs}/events"):
            r = c.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
        r = c.post(f"/v1/sandboxes/{theirs}/stop", json={}, headers={"X-Sbx-Csrf": csrf})
        assert r.status_code == 404
        assert c.get(f"/v1/sandboxes/{mine}/stats").status_code == 200
    finally:
        c.close()
    assert sandbox(srv, theirs)["state"] == "running"
    cookie = next(x["value"] for x in page.context.cookies() if x["name"] == "sbx_console")
    ws_url = srv.url.replace("http://", "ws://") + f"/v1/sandboxes/{theirs}/pty?csrf={csrf}"
    with connect(ws_url, additional_headers={"Cookie": f"sbx_console={cookie}", "Origin": srv.url},
                 open_timeout=60) as ws:
        msg = json.loads(ws.recv(timeout=60))
    assert (msg["type"], msg["code"]) == ("error", "not_found")


def test_the_usage_page_plots_cost_and_shows_the_plan(page: Any, srv: Server, alice: dict[str, str]) -> None:
    sid = the_sandbox(page)
    assert sandbox(srv, sid)["state"] == "running"  # it has been running for the whole module
    page.goto(srv.url + "/#/sandboxes")
    cost = page.wait_for_selector(f"#sandboxes tr[data-id='{sid}'] td.cost")
    until(page, f"() => /^\\$0\\.\\d*[1-9]/.test(document.querySelector(\"#sandboxes tr[data-id='{sid}'] td.cost\")"
          ".textContent)")
    assert re.fullmatch(r"\$\d+\.\d{6}", cost.inner_text()), cost.inner_text()
    page.goto(srv.url + "/#/usage")
    page.wait_for_selector("#plan-limits")
    points = int(until(page, "() => Number(document.querySelector('#chart-cost')?.dataset.points || 0)"))
    assert points >= 1  # today's cost of the running size(s)
    assert page.query_selector("#chart-cost canvas") and page.query_selector("#chart-gibh canvas")
    assert page.get_attribute("#chart-cost", "data-days") == "7"  # the last seven UTC days by default
    total = page.inner_text("#usage-total-cost")
    assert re.fullmatch(r"\$0\.\d{6}", total) and float(total[1:]) > 0, total
    assert float(page.inner_text("#usage-totals tr[data-size=small] td:nth-child(2)")) > 0  # seconds on small
    plan = {r.get_attribute("data-limit"): r.inner_text().split("\t")
            for r in page.query_selector_all("#plan-limits tr[data-limit]")}
    assert plan["plan"][1].startswith("pro ($20"), plan
    assert plan["running at once"][1:] == ["10", "1"], plan
    assert plan["starts per hour"][1] == "200" and int(plan["starts per hour"][2]) >= 2, plan  # create + resume
    assert plan["included storage"][1] == "200 GiB", plan
    with bearer(srv) as c:  # the page's figures are the API's
        mine = c.get("/v1/account", params={"account": alice["id"]}).json()
    assert mine["plan"]["name"] == "pro" and mine["used"]["running"] == 1
    # a range with nothing in it plots zeros
    page.fill("#usage-range input[name=from]", "2025-01-01")
    page.fill("#usage-range input[name=to]", "2025-01-03")
    page.click("#usage-range button[type=submit]")
    until(page, "() => document.querySelector('#chart-cost')?.dataset.days === '3'")
    assert page.get_attribute("#chart-cost", "data-points") == "0"
    assert page.inner_text("#usage-total-cost") == "$0.000000"
    page.fill("#usage-range input[name=from]", time.strftime("%Y-%m-%d", time.gmtime(time.time() - 6 * 86400)))
    page.fill("#usage-range input[name=to]", time.strftime("%Y-%m-%d", time.gmtime()))
    page.click("#usage-range button[type=submit]")
    until(page, "() => Number(document.querySelector('#chart-cost')?.dataset.points || 0) > 0")
    shot(page, "usage")


def test_narrow_screen_and_reserved_pages(browser: Any, page: Any, srv: Server) -> None:
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, storage_state=page.context.storage_state())
    try:
        pg = ctx.new_page()
        pg.set_default_timeout(WAIT_MS)
        pg.goto(srv.url + "/#/sandboxes")
        pg.wait_for_selector("#sandboxes tr[data-state]")
        width = pg.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the list overflows a phone screen ({width}px)"
        shot(pg, "sandboxes-narrow")
        pg.click("#nav a[data-page=usage]")
        pg.wait_for_selector("#page[data-page=usage] h1:has-text('Usage')")
    finally:
        ctx.close()


def session_client(srv: Server, page: Any) -> tuple[httpx.Client, str]:
    """An HTTP client holding the browser's session cookie only (no bearer key), and the session's CSRF token."""
    cookie = next(c["value"] for c in page.context.cookies() if c["name"] == "sbx_console")
    c = httpx.Client(base_url=srv.url, cookies={"sbx_console": cookie}, timeout=120)
    c.__enter__()
    return c, c.get("/v1/console/session").json()["session"]["csrf"]


def test_a_cookie_only_change_needs_the_csrf_header(page: Any, srv: Server) -> None:
    c, csrf = session_client(srv, page)
    try:
        before = len(c.get("/v1/sandboxes").json()["sandboxes"])  # reads work with the cookie alone
        r = c.post("/v1/sandboxes", json={"type": "small", "name": "forged"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
        r = c.post("/v1/sandboxes", json={"type": "small", "name": "forged"}, headers={"X-Sbx-Csrf": "wrong"})
        assert r.status_code == 403
        assert len(c.get("/v1/sandboxes").json()["sandboxes"]) == before  # nothing was made
        # a form posted from another site signs nobody in
        r = c.post("/v1/console/session", json={"key": srv.token}, headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
        assert c.get("/v1/sandboxes", headers={"X-Sbx-Csrf": csrf}).status_code == 200
    finally:
        c.close()


def test_a_terminal_from_another_origin_is_refused(page: Any, srv: Server) -> None:
    from websockets.sync.client import connect

    sid = the_sandbox(page)
    c, csrf = session_client(srv, page)
    c.close()
    cookie = next(c["value"] for c in page.context.cookies() if c["name"] == "sbx_console")
    ws_url = srv.url.replace("http://", "ws://") + f"/v1/sandboxes/{sid}/pty?csrf={csrf}"
    for origin in ("http://8000-x.sbx.localhost", None):
        headers = {"Cookie": f"sbx_console={cookie}", **({"Origin": origin} if origin else {})}
        with connect(ws_url, additional_headers=headers, open_timeout=60) as ws:
            msg = json.loads(ws.recv(timeout=60))
        assert (msg["type"], msg["code"]) == ("error", "csrf_failed")


def test_a_hosted_port_never_sees_the_console_cookie(page: Any, srv: Server) -> None:
    sid = the_sandbox(page)
    cookie = next(c["value"] for c in page.context.cookies() if c["name"] == "sbx_console")
    with bearer(srv) as c:
        c.put(f"/v1/sandboxes/{sid}/files", params={"path": "echo.py"}, content=HEADER_ECHO).raise_for_status()
        c.post(f"/v1/sandboxes/{sid}/jobs", json={"command": "python3 ~/echo.py"}).raise_for_status()
        route = c.post(f"/v1/sandboxes/{sid}/routes", json={"port": 8002, "public": True}).json()["route"]
        c.post(f"/v1/sandboxes/{sid}/exec", json={"command": "for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"
                                                  "8002) 2>/dev/null && exit 0; sleep 0.2; done; exit 1"})
    req = urllib.request.Request(f"http://127.0.0.1:{srv.proxy_port}/", headers={
        "Host": route["host"], "Cookie": f"theirs=1; sbx_console={cookie}; other=2"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        body = resp.read().decode()
    assert body == "cookie=theirs=1; other=2"  # the sandbox's own cookies pass; the console's never does


def test_the_nodes_page_needs_the_admin_key_and_cordons(page: Any, browser: Any, srv: Server) -> None:
    page.goto(srv.url + "/#/nodes")  # alice's key: the API's own words, no table rows
    page.wait_for_selector("p.empty:has-text('admin_only')")
    assert page.locator("#nodes tbody tr").count() == 0
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    try:
        admin = ctx.new_page()
        admin.set_default_timeout(WAIT_MS)
        admin.goto(srv.url + "/")
        admin.fill("#signin-key", srv.token)
        admin.click("#signin-form button")
        admin.wait_for_selector("#nav")
        admin.goto(srv.url + "/#/nodes")
        admin.wait_for_selector("#nodes tbody tr [data-status='ready']")
        name = admin.get_attribute("#nodes tbody tr", "data-node")
        assert name == srv.env["SBX_NODE_NAME"]
        shot(admin, "nodes")
        admin.click("#nodes [data-action='cordon']")
        admin.wait_for_selector("#nodes [data-action='uncordon']")
        with bearer(srv) as c:
            assert c.get("/v1/nodes").json()["nodes"][0]["cordoned"] is True
        admin.click("#nodes [data-action='uncordon']")
        admin.wait_for_selector("#nodes [data-action='cordon']")
        with bearer(srv) as c:
            assert c.get("/v1/nodes").json()["nodes"][0]["cordoned"] is False
    finally:
        ctx.close()


def test_sign_out_ends_the_session(page: Any, srv: Server) -> None:
    c, _ = session_client(srv, page)
    page.goto(srv.url + "/#/sandboxes")
    page.wait_for_selector("#signout")
    page.click("#signout")
    page.wait_for_selector("#signin-form")
    assert not [x for x in page.context.cookies() if x["name"] == "sbx_console"]
    try:  # the old cookie is dead on the server too, not only forgotten by the browser
        r = c.get("/v1/sandboxes")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    finally:
        c.close()
    page.reload()
    page.wait_for_selector("#signin-form")
    shot(page, "signin")
