"""SSH keys over the API with a FakeNode (issue 35): add, list, delete, errors that change nothing, isolation
between accounts; and the SSH gateway's decision of who may log in where (:func:`sbx.api.sshgateway.auth.authorize`)
on the same store."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from sbx.api.sshgateway.auth import GatewayKeys, authorize, install_command, parse_login
from sbx.control.accounts.sshkeys import SshKeys
from tests.fakes import Api, LiveServer, auth, serve_live


def _pub(key: asyncssh.SSHKey, comment: str = "me@laptop") -> str:
    key.set_comment(comment)
    return key.export_public_key("openssh").decode()


def _new_key(algorithm: str = "ssh-ed25519") -> asyncssh.SSHKey:
    return asyncssh.generate_private_key(algorithm)


def _account(api: Api, name: str) -> tuple[str, dict[str, str]]:
    r = api.post("/v1/accounts", json={"name": name, "plan": "team"})
    assert r.status_code == 201, r.text
    return r.json()["account"]["id"], auth(r.json()["key"]["token"])


def _err(r: Any) -> tuple[int, str]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) >= {"code", "message"}, body
    return r.status_code, body["error"]["code"]


def _keys(api: Api, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    r = api.c.get("/v1/ssh-keys", headers=headers or api.h)
    assert r.status_code == 200, r.text
    return list(r.json()["sshKeys"])


def test_add_list_delete(api: Api) -> None:
    key = _new_key()
    r = api.post("/v1/ssh-keys", json={"publicKey": _pub(key)})
    assert r.status_code == 201, r.text
    got = r.json()["sshKey"]
    assert got["name"] == "me@laptop" and got["algorithm"] == "ssh-ed25519" and got["account"] == "acct_default"
    assert got["fingerprint"] == key.get_fingerprint("sha256") and got["fingerprint"].startswith("SHA256:")
    assert got["publicKey"] == _pub(key).rsplit(" ", 1)[0]  # kept without its comment
    rsa = api.post("/v1/ssh-keys", json={"publicKey": _pub(_new_key("ssh-rsa")), "name": "ci"}).json()["sshKey"]
    assert rsa["name"] == "ci" and rsa["algorithm"] == "ssh-rsa"
    assert [k["id"] for k in _keys(api)] == [got["id"], rsa["id"]]
    r = api.delete(f"/v1/ssh-keys/{got['id']}")
    assert r.status_code == 200 and r.json() == {"deleted": got["id"]}
    assert [k["id"] for k in _keys(api)] == [rsa["id"]]
    assert _err(api.delete(f"/v1/ssh-keys/{got['id']}")) == (404, "not_found")


@pytest.mark.parametrize("text", [
    "",
    "hello",
    "ssh-ed25519 AAAAnotbase64!!",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA==",  # a truncated key
    "ssh-ed25519 " + "A" * 20000,  # too long
])
def test_bad_keys_are_400_invalid_ssh_key_and_nothing_is_stored(api: Api, text: str) -> None:
    assert _err(api.post("/v1/ssh-keys", json={"publicKey": text})) == (400, "invalid_ssh_key")
    assert _keys(api) == []


def test_private_keys_dsa_and_two_keys_are_refused(api: Api) -> None:
    key = _new_key()
    private = key.export_private_key("openssh").decode()
    r = api.post("/v1/ssh-keys", json={"publicKey": private})
    assert _err(r) == (400, "invalid_ssh_key") and "private key" in r.json()["error"]["message"]
    assert "PRIVATE" not in r.text.replace("private key", "")
    two = _pub(key) + "\n" + _pub(_new_key())
    assert _err(api.post("/v1/ssh-keys", json={"publicKey": two})) == (400, "invalid_ssh_key")
    assert _keys(api) == []


def test_a_duplicate_is_409_and_the_first_stays(api: Api) -> None:
    key = _new_key()
    first = api.post("/v1/ssh-keys", json={"publicKey": _pub(key), "name": "a"}).json()["sshKey"]
    r = api.post("/v1/ssh-keys", json={"publicKey": _pub(key, "other comment"), "name": "b"})
    assert _err(r) == (409, "ssh_key_exists") and first["id"] in r.json()["error"]["message"]
    assert [(k["id"], k["name"]) for k in _keys(api)] == [(first["id"], "a")]


def test_wrong_shapes_are_refused(api: Api) -> None:
    key = _pub(_new_key())
    assert _err(api.post("/v1/ssh-keys", json={"publicKey": key, "extra": 1})) == (422, "invalid_request")
    assert _err(api.post("/v1/ssh-keys", json={"publicKey": key, "name": ""})) == (400, "invalid_name")
    assert _err(api.post("/v1/ssh-keys", json={"publicKey": key, "name": "x" * 101})) == (400, "invalid_name")
    assert _err(api.post("/v1/ssh-keys", json={"publicKey": key, "name": "a\x00b"})) == (400, "invalid_name")
    assert _err(api.post("/v1/ssh-keys", json={"key": key})) == (422, "invalid_request")
    assert _err(api.post("/v1/ssh-keys", json={"publicKey": 5})) == (422, "invalid_request")
    assert _keys(api) == []


def test_accounts_see_and_delete_only_their_own_keys(api: Api) -> None:
    alice, a = _account(api, "alice")
    _, b = _account(api, "bob")
    key = _new_key()
    mine = api.c.post("/v1/ssh-keys", json={"publicKey": _pub(key)}, headers=a).json()["sshKey"]
    assert mine["account"] == alice
    assert _keys(api, b) == []
    assert _err(api.c.delete(f"/v1/ssh-keys/{mine['id']}", headers=b)) == (404, "not_found")
    # the same key in another account is that account's own (its sandboxes, not alice's)
    theirs = api.c.post("/v1/ssh-keys", json={"publicKey": _pub(key)}, headers=b)
    assert theirs.status_code == 201, theirs.text
    assert [k["id"] for k in _keys(api, a)] == [mine["id"]]
    # ?account= is the admin's
    assert _err(api.c.get(f"/v1/ssh-keys?account={alice}", headers=b)) == (403, "admin_only")
    assert [k["id"] for k in _keys(api)] == [mine["id"], theirs.json()["sshKey"]["id"]]  # the admin sees all
    assert [k["id"] for k in api.get(f"/v1/ssh-keys?account={alice}").json()["sshKeys"]] == [mine["id"]]
    added = api.post(f"/v1/ssh-keys?account={alice}", json={"publicKey": _pub(_new_key())})
    assert added.status_code == 201 and added.json()["sshKey"]["account"] == alice
    assert _err(api.post("/v1/ssh-keys?account=acct_nope", json={"publicKey": _pub(_new_key())})) == \
        (404, "not_found")


def test_the_routes_are_in_the_openapi_document(api: Api) -> None:
    doc = api.c.get("/openapi.json").json()
    post = doc["paths"]["/v1/ssh-keys"]["post"]
    assert {"201", "400", "409"} <= set(post["responses"])
    assert "404" in doc["paths"]["/v1/ssh-keys/{key_id}"]["delete"]["responses"]


def test_login_names() -> None:
    assert parse_login("sb_abcdefghij") == ("sb_abcdefghij", "user")
    assert parse_login("sb_abcdefghij+root") == ("sb_abcdefghij", "root")
    assert parse_login("my-box") == ("my-box", "user")
    assert parse_login("../etc") is None and parse_login("") is None and parse_login("a b") is None


def test_who_may_log_in_where(api: Api) -> None:
    alice, a = _account(api, "alice")
    bob, b = _account(api, "bob")
    ka, kb, stranger = _new_key(), _new_key(), _new_key()
    assert api.c.post("/v1/ssh-keys", json={"publicKey": _pub(ka)}, headers=a).status_code == 201
    assert api.c.post("/v1/ssh-keys", json={"publicKey": _pub(kb)}, headers=b).status_code == 201
    r = api.c.post("/v1/sandboxes?wait=true", json={"type": "small", "name": "alices-box"}, headers=a)
    assert r.status_code == 200, r.text
    sid = r.json()["sandbox"]["id"]
    cp = api.control
    keys = SshKeys(cp.store)

    def login(user: str, key: asyncssh.SSHKey) -> Any:
        return authorize(cp, keys, user, key)

    t = login(sid, ka)
    assert (t.sandbox_id, t.account_id, t.user) == (sid, alice, "user")
    assert login("alices-box", ka).sandbox_id == sid and login(sid + "+root", ka).user == "root"
    assert login(sid, kb) is None  # bob's key, alice's sandbox
    assert login(sid, stranger) is None  # no account's key
    assert login("sb_nosuchbox0", ka) is None and login("", ka) is None
    # a key deleted, an account suspended: refused from then on
    key_id = _keys(api, a)[0]["id"]
    assert api.post(f"/v1/accounts/{alice}/suspend").status_code == 200
    assert login(sid, ka) is None
    assert api.post(f"/v1/accounts/{alice}/resume").status_code == 200
    assert login(sid, ka) is not None
    assert api.c.delete(f"/v1/ssh-keys/{key_id}", headers=a).status_code == 200
    assert login(sid, ka) is None
    # a deleted account's keys go with it
    assert [k["account"] for k in _keys(api)] == [bob]
    assert api.delete(f"/v1/accounts/{bob}").status_code == 202
    assert _keys(api) == [] and keys.accounts_of(kb.get_fingerprint("sha256")) == []


def test_gateway_keys_are_kept_private_and_differ_per_sandbox(tmp_path: Path) -> None:
    folder = tmp_path / "ssh"
    keys = GatewayKeys(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("host_ed25519", "client_seed"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    one, two = keys.public_line("sb_aaaaaaaaaa"), keys.public_line("sb_bbbbbbbbbb")
    assert one != two and one.startswith("ssh-ed25519 ") and one.endswith(" sbx-gateway")
    again = GatewayKeys(folder)  # a restart: the same host key, the same client keys
    assert again.public_line("sb_aaaaaaaaaa") == one
    assert again.host_key.export_public_key() == keys.host_key.export_public_key()
    command = install_command(one)
    assert "PRIVATE" not in command and os.fsencode(one) in os.fsencode(command)


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    yield from serve_live(tmp_path, monkeypatch)


def test_the_cli_adds_lists_and_deletes_keys(live: LiveServer, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sbx.cli.main import app

    runner = CliRunner(mix_stderr=False)

    def sbx(*args: str, input: str | None = None) -> Any:
        return runner.invoke(app, list(args), catch_exceptions=False, input=input)

    home_ssh = Path(os.environ["HOME"]) / ".ssh"
    r = sbx("ssh-key", "add")  # no FILE and no ~/.ssh/id_*.pub
    assert r.exit_code != 0 and "ssh-keygen" in r.stderr
    home_ssh.mkdir(parents=True)
    default, piped = _new_key(), _new_key("ecdsa-sha2-nistp256")
    (home_ssh / "id_ed25519.pub").write_text(_pub(default, "from-home"))
    r = sbx("ssh-key", "add")
    assert r.exit_code == 0, r.stderr
    assert default.get_fingerprint("sha256") in r.stdout and "(from-home)" in r.stdout
    r = sbx("ssh-key", "add", "-", "--name", "piped", "--json", input=_pub(piped))
    assert r.exit_code == 0, r.stderr
    key_id = json.loads(r.stdout)["sshKey"]["id"]
    assert sbx("ssh-key", "add", "-", input=_pub(piped)).exit_code != 0  # 409
    bad = sbx("ssh-key", "add", "-", input="not a key")
    assert bad.exit_code != 0 and "invalid_ssh_key" in bad.stderr + bad.stdout
    listed = sbx("ssh-key", "list").stdout
    assert "from-home" in listed and "piped" in listed and piped.get_fingerprint("sha256") in listed
    assert sbx("ssh-key", "delete", key_id).exit_code == 0
    assert "piped" not in sbx("ssh-key", "list").stdout
    assert sbx("ssh-key", "delete", key_id).exit_code != 0


def test_the_gateway_logs_a_key_of_the_account_in_and_relays_to_the_sandboxs_sshd(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway in this process against a stand-in for the sandbox's sshd (an asyncssh server on a local port):
    the user's key is checked against the sandbox's account, the gateway logs in to sshd with its own key for that
    sandbox (never the user's), and a command's output, stderr, stdin and exit status pass through."""
    from sbx.api.sshgateway import SshGateway
    from sbx.api.sshgateway import server as gwserver
    from tests.fakes import FakeNode

    _, a = _account(api, "alice")
    _, b = _account(api, "bob")
    ka, kb = _new_key(), _new_key()
    assert api.c.post("/v1/ssh-keys", json={"publicKey": _pub(ka)}, headers=a).status_code == 201
    assert api.c.post("/v1/ssh-keys", json={"publicKey": _pub(kb)}, headers=b).status_code == 201
    sid = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=a).json()["sandbox"]["id"]
    monkeypatch.setattr(FakeNode, "address", lambda self, id: "127.0.0.1", raising=False)
    logins: list[tuple[str, bytes]] = []

    class Sshd(asyncssh.SSHServer):
        def begin_auth(self, username: str) -> bool:
            return True

        def public_key_auth_supported(self) -> bool:
            return True

        def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
            logins.append((username, key.export_public_key("openssh").split()[1]))
            return True

    async def command(process: Any) -> None:
        data = await process.stdin.read()
        process.stdout.write(f"{process.command}|stdin={len(data)}\n".encode())
        process.stderr.write(b"err\n")
        process.exit(3)

    async def scenario() -> None:
        sshd = await asyncssh.listen("127.0.0.1", 0, server_factory=Sshd, process_factory=command, encoding=None,
                                     server_host_keys=[asyncssh.generate_private_key("ssh-ed25519")])
        monkeypatch.setattr(gwserver, "SSHD_PORT", sshd.get_port())
        gw = SshGateway(api.control, api.control.settings)
        await gw.start("127.0.0.1", 0)
        opts: dict[str, Any] = {"known_hosts": None, "config": None, "agent_path": None}
        try:
            async with asyncssh.connect("127.0.0.1", gw.port, username=sid, client_keys=[ka], **opts) as conn:
                r = await conn.run("do-something", input=b"x" * 100000, encoding=None)
            assert r.exit_status == 3 and r.stdout == b"do-something|stdin=100000\n" and r.stderr == b"err\n"
            assert gw.keys is not None
            assert logins and {u for u, _ in logins} == {"user"}
            assert {k for _, k in logins} == {gw.keys.public_line(sid).split()[1].encode()}
            assert ka.export_public_key("openssh").split()[1] not in {k for _, k in logins}
            for user, keys, password in ((sid, [kb], None), ("sb_nosuchbox0", [ka], None), (sid, [], "pw")):
                with pytest.raises(asyncssh.PermissionDenied):
                    await asyncssh.connect("127.0.0.1", gw.port, username=user, client_keys=keys,
                                           password=password, **opts)
        finally:
            await gw.close()
            sshd.close()

    asyncio.run(scenario())
