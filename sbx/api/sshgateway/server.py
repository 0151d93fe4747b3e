"""The SSH gateway's listener and its connections (issue 35).

``ssh -p 2222 sb_2qw3qudhmi@HOST`` lands in that sandbox's own sshd as ``user`` (``sb_x+root@``: as root). The
gateway is an asyncssh server in the ``sbx server`` process (:class:`SshGateway`, on ``settings.host`` :
``settings.ssh_gateway_port``); each user connection is a :class:`GatewayConnection`:

1. **Authentication** (:mod:`sbx.api.sshgateway.auth`): public keys only, registered for the sandbox's account.
2. **The sandbox's side**, opened at the first session or forwarded channel: a stopped sandbox with ``autoResume``
   is resumed (as the hosted-port proxy does, :meth:`sbx.control.sandboxes.routes.Routes.ensure_running`), then the
   gateway connects to port 22 at the sandbox's address on its node's bridge, directly for the embedded node and
   through the node's port relay for a remote one (:mod:`sbx.node.remote.relay`), exactly the paths of
   :mod:`sbx.api.proxy`. It logs in with its own key for that sandbox (:meth:`GatewayKeys.client_key`); when sshd
   refuses it (a new sandbox, or one that dropped the line) the gateway adds the public key to the login user's
   ``authorized_keys`` with an exec (:func:`sbx.api.sshgateway.auth.install_command`) and tries once more.
3. **Relaying**: sessions through :mod:`sbx.api.sshgateway.relay`; ``direct-tcpip`` channels (``ssh -L``, ``-D``,
   VS Code's forwarded ports) tunnelled by asyncssh over the connection to the sandbox's sshd, so a forwarded
   connection starts *inside* the sandbox and reaches only what the sandbox could reach itself. Remote forwarding
   (``-R``), agent and X11 forwarding are refused.

Why a hostile sandbox gains nothing: what crosses into it is a public key (its own, derived for it alone) and the
user's session traffic, which is the sandbox's anyway; never the user's key (the user authenticates to the gateway
only), the gateway's host key or its seed. The sandbox may replace its sshd with anything: it then talks SSH to a
client that offers a key that opens no other sandbox and accepts no channel the sandbox opens towards it. The
sandbox's host key is not verified (``known_hosts=None``): the path is the node's own bridge, where no other
sandbox can take the address (a sandbox cannot send with another's IP or MAC), and what the gateway would protect
with it (the session) belongs to the sandbox already.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any

import asyncssh

from sbx.api.sshgateway.auth import GatewayKeys, Target, account_active, authorize, install_command
from sbx.api.sshgateway.relay import DownSession, GatewayRefusal
from sbx.config import Settings
from sbx.control.accounts.sshkeys import SshKeys
from sbx.control.errors import ControlError
from sbx.control.service import ControlPlane
from sbx.node.remote.relay import open_relay
from sbx.node.types import NodeError

Relay = tuple[str, int, str, ssl.SSLContext | None]
"""A node's port relay: host, port, token, and the TLS context when the node is reached over TLS."""

log = logging.getLogger("sbx.sshgateway")

SSHD_PORT = 22
CONNECT_TIMEOUT = 15.0
LOGIN_TIMEOUT = 30.0
INSTALL_TIMEOUT = 30.0
SSHD_WAIT = 30.0
PIPE_CHUNK = 64 * 1024


class SshGateway:
    """The listener: ``control`` resolves sandboxes and keys; keys under ``settings.state_dir/ssh``."""

    def __init__(self, control: ControlPlane, settings: Settings):
        self.control = control
        self.settings = settings
        self.ssh_keys = SshKeys(control.store)
        self.keys: GatewayKeys | None = None
        self._acceptor: asyncssh.SSHAcceptor | None = None

    async def start(self, host: str | None = None, port: int | None = None) -> None:
        """Listen on ``host:port`` (default ``settings.host:settings.ssh_gateway_port``); makes the host key on the
        first start. Raises ``OSError`` when the port can't be bound."""
        self.keys = await asyncio.to_thread(GatewayKeys, self.settings.state_dir / "ssh")
        self._acceptor = await asyncssh.listen(
            host or self.settings.host, port if port is not None else self.settings.ssh_gateway_port,
            server_factory=lambda: GatewayConnection(self), server_host_keys=[self.keys.host_key],
            encoding=None, line_editor=False, login_timeout=LOGIN_TIMEOUT, agent_forwarding=False,
            x11_forwarding=False, allow_scp=False, keepalive_interval=60, keepalive_count_max=3,
            config=None)
        log.info("SSH gateway on %s:%s, host key %s", host or self.settings.host, self.port,
                 self.keys.host_key.get_fingerprint("sha256"))

    @property
    def port(self) -> int:
        assert self._acceptor is not None
        return int(self._acceptor.get_port())

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._acceptor.wait_closed(), 5)


class GatewayConnection(asyncssh.SSHServer):
    """One user's connection to the gateway (see the module docstring)."""

    def __init__(self, gateway: SshGateway):
        self.gateway = gateway
        self.cp = gateway.control
        self.target: Target | None = None
        """Where the login goes: set once authentication has succeeded, for the name it succeeded with."""
        self._targets: dict[str, Target] = {}
        self._conn: asyncssh.SSHServerConnection | None = None
        self._up: asyncssh.SSHClientConnection | None = None
        self._up_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[Any]] = []
        self._active = False

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn

    def connection_lost(self, exc: Exception | None) -> None:
        if self._up is not None:
            self._up.close()
        for t in self._tasks:
            t.cancel()
        if self._active and self.target is not None:
            self.cp.activity.end(self.target.sandbox_id)
            self._active = False

    # authentication ----------------------------------------------------------------------------------------------
    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def host_based_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    async def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        try:
            target = await asyncio.to_thread(authorize, self.cp, self.gateway.ssh_keys, username, key)
        except Exception:
            log.exception("ssh gateway: checking a key failed")
            return False
        if target is None:
            return False
        # keyed by login name: a client may offer (without a signature) another key for another name first; what
        # counts is the name the successful, signed attempt used (auth_completed)
        self._targets[username] = target
        return True

    def auth_completed(self) -> None:
        assert self._conn is not None
        self.target = self._targets.get(str(self._conn.get_extra_info("username")))
        self._targets.clear()

    # channels ------------------------------------------------------------------------------------------------
    def session_requested(self) -> DownSession | bool:
        if self.target is None:
            return False
        return DownSession(self.upstream)

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> Any:
        if self.target is None or self._conn is None:
            return False
        conn = self._conn

        async def tunnel() -> Any:
            try:
                up = await self.upstream()
            except GatewayRefusal as e:
                raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, str(e)) from None
            return await conn.forward_tunneled_connection(up, dest_host, dest_port)

        return tunnel()

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return False  # no -R: a sandbox opens nothing towards the gateway's side

    # the sandbox's sshd -------------------------------------------------------------------------------------
    async def upstream(self) -> asyncssh.SSHClientConnection:
        """The connection to the sandbox's sshd as the login's user, opened once (resuming the sandbox when its
        ``autoResume`` allows). Raises :class:`GatewayRefusal` with the line the user sees."""
        target = self.target
        assert target is not None
        async with self._up_lock:
            if self._up is not None and not self._up.is_closed():
                return self._up
            self._up = await self._open(target)
            return self._up

    async def _open(self, target: Target) -> asyncssh.SSHClientConnection:
        cp, sid = self.cp, target.sandbox_id
        if not await asyncio.to_thread(account_active, cp, target.account_id):
            raise GatewayRefusal(f"sbx: the account of sandbox {sid} is not active")
        if not self._active:
            cp.activity.begin(sid)
            self._active = True
        try:
            await asyncio.to_thread(cp.routes.ensure_running, sid)
            relay = await asyncio.to_thread(cp.node.relay, sid)
            address = "" if relay is not None else await asyncio.to_thread(cp.node.address, sid)
        except ControlError as e:
            hint = ""
            if e.code == "not_running":
                hint = f" (start it with `sbx resume {sid}`, or create it with --auto-resume)"
            raise GatewayRefusal(f"sbx: {e.message}{hint}") from None
        except NodeError as e:
            log.warning("ssh gateway: no address for %s: %s", sid, e.message)
            raise GatewayRefusal(f"sbx: sandbox {sid} cannot be reached") from None
        keys = self.gateway.keys
        assert keys is not None
        key = keys.client_key(sid)
        try:
            try:
                return await self._connect_soon(target, relay, address, key)
            except asyncssh.PermissionDenied:
                await asyncio.to_thread(self._install_key, target, keys.public_line(sid))
                return await self._connect(target, relay, address, key)
        except (asyncssh.Error, OSError, TimeoutError, NodeError) as e:
            log.info("ssh gateway: %s's sshd: %s: %s", sid, type(e).__name__, e)
            raise GatewayRefusal(f"sbx: the SSH server of sandbox {sid} does not answer "
                                 f"({type(e).__name__}: {e})") from None

    async def _connect_soon(self, target: Target, relay: Relay | None, address: str,
                            key: asyncssh.SSHKey) -> asyncssh.SSHClientConnection:
        """:meth:`_connect`, again while nothing listens on port 22 yet, for up to :data:`SSHD_WAIT` seconds: a
        sandbox made from a memory template or a fork with memory answers before its sshd (re)starts with its own
        host keys."""
        deadline = asyncio.get_running_loop().time() + SSHD_WAIT
        while True:
            try:
                return await self._connect(target, relay, address, key)
            except (ConnectionRefusedError, NodeError) as e:
                if isinstance(e, NodeError) and e.code != "unreachable":
                    raise
                if asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.25)

    async def _connect(self, target: Target, relay: Relay | None, address: str,
                       key: asyncssh.SSHKey) -> asyncssh.SSHClientConnection:
        opts: dict[str, Any] = {"username": target.user, "client_keys": [key], "known_hosts": None,
                                "agent_path": None, "config": None, "preferred_auth": "publickey",
                                "encoding": None, "connect_timeout": CONNECT_TIMEOUT,
                                "login_timeout": CONNECT_TIMEOUT, "x11_forwarding": False,
                                "agent_forwarding": False, "keepalive_interval": 60}
        if relay is None:
            return await asyncssh.connect(address, SSHD_PORT, **opts)
        reader, writer = await open_relay(*relay, target.sandbox_id, SSHD_PORT, timeout=CONNECT_TIMEOUT)
        ours, theirs = socket.socketpair()
        try:
            r2, w2 = await asyncio.open_connection(sock=theirs)
        except OSError:
            ours.close()
            theirs.close()
            writer.close()
            raise
        self._tasks += [asyncio.get_running_loop().create_task(_pipe(reader, w2)),
                        asyncio.get_running_loop().create_task(_pipe(r2, writer))]
        # a host name for asyncssh's logs (a socketpair has no peer address); with sock= it connects nowhere
        return await asyncssh.connect(target.sandbox_id, SSHD_PORT, sock=ours, **opts)

    def _install_key(self, target: Target, public_line: str) -> None:
        """Add the gateway's public key for this sandbox to the login user's ``authorized_keys`` (an exec in the
        sandbox as that user). Raises ``GatewayRefusal`` when the exec fails."""
        try:
            result: dict[str, Any] = {}
            for piece in self.cp.exec(target.sandbox_id, install_command(public_line), timeout=INSTALL_TIMEOUT,
                                      user=target.user):
                if "exitCode" in piece or "error" in piece:
                    result = piece
        except ControlError as e:
            raise GatewayRefusal(f"sbx: {e.message}") from None
        if result.get("exitCode") != 0:
            log.info("ssh gateway: installing the key in %s failed: %s", target.sandbox_id, result)
            raise GatewayRefusal(f"sbx: could not let the gateway into sandbox {target.sandbox_id} as "
                                 f"{target.user} (its ~/.ssh is not writable?)")


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy ``src`` to ``dst`` until EOF, then close ``dst``."""
    try:
        while chunk := await src.read(PIPE_CHUNK):
            dst.write(chunk)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        dst.close()
