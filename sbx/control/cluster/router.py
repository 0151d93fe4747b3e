"""Several node agents behind one control plane (issue 10): :class:`NodeRouter`.

A server has one node it is configured with (the embedded :class:`sbx.node.agent.LocalNode`, or the agent at
``SBX_NODE_URL``) and any number of node agents an admin added (``sbx node add URL --token T``, ``POST /v1/nodes``).
Added nodes live in the store's ``nodes`` table (url, and the node token sealed with the server's secrets key,
bound to ``node/<name>``), so every replica on a shared database drives the same set; :meth:`NodeRouter.refresh`
(each registry heartbeat) opens a :class:`sbx.node.remote.client.RemoteNode` for a node another replica added and
drops one that was removed.

The router is itself a :class:`sbx.node.types.NodeAgent`: each per-sandbox call goes to the node named in the
sandbox's ``node`` column (a row without one belongs to the configured node); calls about the whole node
(``info``) go to the configured node; every node's egress proxy is answered (:meth:`NodeRouter.serve_egress_nodes`,
the rule of :mod:`sbx.control.secrets.nodes`); ``snapshots`` is the union of every reachable node's;
``reconcile`` asks each node about its own sandboxes. Which node a new sandbox goes to is
:mod:`sbx.control.cluster.placement`'s decision, written into the row before the node is called.
"""

from __future__ import annotations

import logging
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sbx.config import Settings
from sbx.control.secrets.vault import seal, unseal
from sbx.control.store.database import Store
from sbx.node.remote.client import RemoteNode
from sbx.node.types import (
    ExecEvent,
    JobInfo,
    NodeAgent,
    NodeError,
    NodeInfo,
    NodeStatus,
    ResumeResult,
    SandboxSpec,
    SnapshotInfo,
    Stats,
    StopResult,
)

log = logging.getLogger("sbx.control")

EgressHandler = Callable[[str, dict[str, Any]], dict[str, Any]]


def _aad(name: str) -> bytes:
    return f"node/{name}".encode()


class NodeRouter:
    """The configured node ``default`` (reached at ``default_url``: ``local`` for the embedded one) plus the added
    nodes of ``store``; ``key`` returns the secrets key that seals their tokens. Thread-safe."""

    def __init__(self, store: Store, settings: Settings, default: NodeAgent, default_url: str,
                 key: Callable[[], bytes]):
        self.store = store
        self.settings = settings
        self.default = default
        self.default_url = default_url
        self.default_name = settings.node_name  # the registry replaces it with the name the node reports
        self._key = key
        self._added: dict[str, tuple[str, str, RemoteNode]] = {}  # name -> (url, sealed token, client)
        self._attached: dict[str, tuple[str, NodeAgent]] = {}  # name -> (url, agent): see attach()
        self._guard = threading.Lock()
        self._on_exit: Callable[[str, str, str | None], None] | None = None
        self._egress: tuple[Callable[[str | None], EgressHandler], Callable[[str | None], Any]] | None = None

    # --- which node --------------------------------------------------------------------------------------------
    def agents(self) -> dict[str, tuple[str, NodeAgent]]:
        """Every node this server drives: ``{name: (url, agent)}``, the configured node first."""
        with self._guard:
            added: dict[str, tuple[str, NodeAgent]] = {
                n: (url, cli) for n, (url, _t, cli) in self._added.items() if n != self.default_name}
            added.update((n, v) for n, v in self._attached.items() if n != self.default_name)
        return {self.default_name: (self.default_url, self.default), **added}

    def agent(self, name: str | None) -> NodeAgent:
        """The agent of node ``name`` (None: the configured node). Raises ``NodeError("node_unknown")`` for a
        node that is not (or no longer) registered."""
        if name is None or name == self.default_name:
            return self.default
        with self._guard:
            entry = self._added.get(name)
            attached = self._attached.get(name)
        if attached is not None:
            return attached[1]
        if entry is None:
            self.refresh()
            with self._guard:
                entry = self._added.get(name)
        if entry is None:
            if any(r.name == name and r.token for r in self.store.list_nodes()):
                raise NodeError("node_unknown", f"node {name!r} can't be used by this server (its token does not "
                                                "unseal with this server's secrets key)")
            return self.default  # not an added node: the configured one (its name is learnt at the first beat)
        return entry[2]

    def node_of(self, sandbox_id: str) -> str:
        """The name of the node that holds sandbox ``sandbox_id`` (the configured node for an unknown id)."""
        row = self.store.get_sandbox(sandbox_id)
        return (row.node if row is not None else None) or self.default_name

    def _for(self, sandbox_id: str) -> NodeAgent:
        return self.agent(self.node_of(sandbox_id))

    # --- added nodes -------------------------------------------------------------------------------------------
    def add(self, url: str, token: str) -> tuple[str, NodeInfo]:
        """Add the node agent at ``url`` with its node ``token``: asks it for its heartbeat first (so a wrong url
        or token changes nothing), then stores url and sealed token. Returns ``(name, info)``. Raises
        ``NodeError`` (``node_unreachable``, ``node_unauthorized``)."""
        try:
            client = RemoteNode(url, token, self.settings)
        except NodeError:  # node_tls_required, node_tls_missing
            raise
        except Exception as e:  # httpx refuses the URL (a host it can't encode...)
            raise NodeError("invalid_url", f"{url!r} is not a usable node URL: {e}") from None
        try:
            info = client.info()
        except NodeError:
            client.close()
            raise
        except Exception as e:  # the URL parsed but can't be requested (httpx.InvalidURL, UnicodeError...)
            client.close()
            raise NodeError("invalid_url", f"{url!r} is not a usable node URL: {e}") from None
        if info.name == self.default_name:
            client.close()
            raise NodeError("invalid_node_name", f"the node at {url} is named {info.name}, like this server's own "
                                                 "node: give it another SBX_NODE_NAME")
        from dataclasses import asdict

        self.store.add_node(info.name, client.url, seal(self._key(), token, _aad(info.name)), asdict(info))
        with self._guard:
            old = self._added.pop(info.name, None)
            self._added[info.name] = (client.url, self.store_token(info.name), client)
        if old is not None:
            old[2].close()
        if self._on_exit is not None:
            client.watch(self._exit_from(info.name))
        self._serve_egress(info.name, client)
        return info.name, info

    def attach(self, name: str, url: str, agent: NodeAgent) -> None:
        """Drive ``agent`` (an agent object this process already holds, e.g. an in-process node; the unit tests'
        fakes) as node ``name`` at ``url``; nothing is stored, so other replicas don't see it."""
        with self._guard:
            self._attached[name] = (url, agent)
        if self._on_exit is not None:
            agent.watch(self._exit_from(name))
        self._serve_egress(name, agent)

    def store_token(self, name: str) -> str:
        """The sealed token stored for node ``name`` ("" when none)."""
        for row in self.store.list_nodes():
            if row.name == name:
                return row.token or ""
        return ""

    def forget(self, name: str) -> None:
        """Stop driving the added node ``name`` (its row is removed by the caller)."""
        with self._guard:
            entry = self._added.pop(name, None)
        if entry is not None:
            entry[2].unwatch()
            entry[2].close()

    def refresh(self) -> None:
        """Open a client for each added node in the store this router lacks (or whose url or token changed) and
        drop the ones no longer there."""
        rows = {r.name: r for r in self.store.list_nodes() if r.token and r.name != self.default_name}
        opened: list[tuple[str, RemoteNode]] = []
        closed: list[RemoteNode] = []
        with self._guard:
            for name in list(self._added):
                if name not in rows:
                    closed.append(self._added.pop(name)[2])
            for name, row in rows.items():
                have = self._added.get(name)
                if have is not None and have[0] == row.url and have[1] == row.token:
                    continue
                try:
                    token = unseal(self._key(), row.token or "", _aad(name))
                except Exception:  # another replica's key: this one can't use the node
                    log.warning("node %s: its token can't be unsealed with this server's secrets key", name)
                    continue
                try:
                    client = RemoteNode(row.url, token, self.settings)
                except NodeError as e:  # another replica's TLS setting, or a URL this one refuses
                    log.warning("node %s: %s", name, e.message)
                    continue
                if have is not None:
                    closed.append(have[2])
                self._added[name] = (row.url, row.token or "", client)
                opened.append((name, client))
        for c in closed:
            c.unwatch()
            c.close()
        for name, c in opened:
            if self._on_exit is not None:
                c.watch(self._exit_from(name))
            self._serve_egress(name, c)

    def pool_take(self, size: str) -> str | None:
        """:meth:`pool_take_on` the configured node."""
        return self.pool_take_on(self.default_name, size)

    def pool_take_on(self, node: str, size: str) -> str | None:
        """The id of a warm sandbox of ``size`` (a size name) reserved on node ``node`` for the create about to be
        sent there (:meth:`sbx.node.types.NodeAgent.pool_take`), or None: also when that node has none, is not
        known here or doesn't answer (the create then goes on without one)."""
        try:
            return self.agent(node).pool_take(size)
        except NodeError as e:
            log.info("no warm sandbox from node %s: %s", node, e.message)
            return None

    # --- NodeAgent: images, on the server's own node (sbx.control.images.catalog) ----------------------------
    def build_image(self, dockerfile: Path, context: Path, progress: Callable[[str], None] | None = None,
                    bases: dict[str, str] | None = None) -> Any:
        return self.agent(None).build_image(dockerfile, context, progress, bases=bases)

    def import_image(self, archive: Path, progress: Callable[[str], None] | None = None) -> Any:
        return self.agent(None).import_image(archive, progress)

    def delete_image(self, key: str) -> None:
        self.agent(None).delete_image(key)

    # --- NodeAgent: per sandbox --------------------------------------------------------------------------------
    def create(self, spec: SandboxSpec, from_snapshot: str | None = None, cold: bool = False) -> str:
        return self._for(spec.id).create(spec, from_snapshot=from_snapshot, cold=cold)

    def exec(self, id: str, command: str, *, user: str = "user", timeout: float | None = None,
             env: dict[str, str] | None = None, cwd: str | None = None,
             stop: Callable[[], bool] | None = None) -> Iterator[ExecEvent]:
        return self._for(id).exec(id, command, user=user, timeout=timeout, env=env, cwd=cwd, stop=stop)

    def exec_detached(self, id: str, command: str, *, user: str = "user", env: dict[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None, stdin: str | None = None) -> JobInfo:
        return self._for(id).exec_detached(id, command, user=user, env=env, cwd=cwd, timeout=timeout, stdin=stdin)

    def kill_job(self, id: str, job: str) -> None:
        self._for(id).kill_job(id, job)

    def jobs(self, id: str) -> list[JobInfo]:
        return self._for(id).jobs(id)

    def job_output(self, id: str, job: str, stream: str, offset: int = 0) -> bytes:
        return self._for(id).job_output(id, job, stream, offset)

    def stop(self, id: str, keep_memory: bool = True) -> StopResult:
        return self._for(id).stop(id, keep_memory=keep_memory)

    def resume(self, id: str, spec: SandboxSpec, *, cold: bool = False, require_memory: bool = False) -> ResumeResult:
        return self._for(id).resume(id, spec, cold=cold, require_memory=require_memory)

    def fork(self, source_id: str, spec: SandboxSpec, memory: bool = False) -> None:
        self._for(spec.id).fork(source_id, spec, memory=memory)

    def snapshot(self, id: str, name: str) -> SnapshotInfo:
        return self._for(id).snapshot(id, name)

    def delete(self, id: str) -> None:
        self._for(id).delete(id)

    def stats(self, id: str, space: bool = True) -> Stats:
        return self._for(id).stats(id, space=space)

    def status(self, id: str, settled: bool = False) -> NodeStatus:
        return self._for(id).status(id, settled=settled)

    def spawn(self, id: str, argv: list[str], *, user: str = "user", stdin: bool = False,
              tty: bool = False, env: dict[str, str] | None = None,
              size: tuple[int, int] | None = None) -> subprocess.Popen[bytes]:
        return self._for(id).spawn(id, argv, user=user, stdin=stdin, tty=tty, env=env, size=size)

    def address(self, id: str) -> str:
        return self._for(id).address(id)

    def relay(self, id: str) -> tuple[str, int, str, ssl.SSLContext | None] | None:
        """How the port proxy reaches sandbox ``id``: None when it connects to :meth:`address` itself (the
        embedded node: the sandbox's bridge is on this host), else ``(host, port, token, tls)`` of the node's port relay
        (:mod:`sbx.node.remote.relay`)."""
        agent = self._for(id)
        if isinstance(agent, RemoteNode):
            return agent.relay_target()
        return None

    def set_egress_proxy(self, id: str, enabled: bool) -> None:
        self._for(id).set_egress_proxy(id, enabled)

    # --- NodeAgent: snapshots (a snapshot lives on the node that sealed it) ------------------------------------
    def snapshot_node(self, name: str) -> str | None:
        """The node holding snapshot ``name`` (asks each node that answers), or None."""
        for node, (_url, agent) in self.agents().items():
            try:
                if any(s.name == name for s in agent.snapshots()):
                    return node
            except NodeError:
                continue
        return None

    def delete_snapshot(self, name: str) -> None:
        for _url, agent in self.agents().values():
            try:
                agent.delete_snapshot(name)
            except NodeError as e:
                if e.code != "not_found":
                    log.warning("deleting snapshot %s: %s", name, e.message)

    def snapshots(self) -> list[SnapshotInfo]:
        out: list[SnapshotInfo] = []
        for node, (_url, agent) in self.agents().items():
            try:
                out.extend(agent.snapshots())
            except NodeError as e:
                if node == self.default_name:
                    raise
                log.info("snapshots of %s unknown: %s", node, e.message)
        return out

    # --- NodeAgent: the whole node -----------------------------------------------------------------------------
    def info(self) -> NodeInfo:
        return self.default.info()

    def egress_ready(self) -> bool:
        return self.default.egress_ready()

    def egress_nodes(self) -> set[str]:
        """The nodes that answer that they run an egress proxy (a remote one is asked over its node API: one that
        doesn't answer may take seconds, so callers ask outside the lifecycle lock)."""
        out: set[str] = set()
        for name, (_url, agent) in self.agents().items():
            try:
                if agent.egress_ready():
                    out.add(name)
            except NodeError:
                continue
        return out

    def serve_egress(self, handler: EgressHandler) -> None:
        self.default.serve_egress(handler)

    def serve_egress_nodes(self, handler_for: Callable[[str | None], EgressHandler],
                           on_link: Callable[[str | None], Any]) -> None:
        """Answer every node's egress proxy, now and for nodes added later: node N's questions go to
        ``handler_for(N)`` (None for the configured node, whose name may still change at its first heartbeat);
        ``on_link(N)`` runs when a server reaches a remote node's process anew (:mod:`sbx.node.remote.egresslink`)."""
        self._egress = (handler_for, on_link)
        for name, (_url, agent) in self.agents().items():
            self._serve_egress(None if agent is self.default else name, agent)

    def _serve_egress(self, name: str | None, agent: NodeAgent) -> None:
        if self._egress is None:
            return
        handler_for, on_link = self._egress
        if isinstance(agent, RemoteNode):
            agent.serve_egress(handler_for(name), on_link=lambda: on_link(name))
        else:
            agent.serve_egress(handler_for(name))

    def close_egress(self) -> None:
        self._egress = None
        for _url, agent in self.agents().values():
            agent.close_egress()

    def watch(self, on_exit: Callable[[str, str, str | None], None]) -> None:
        self._on_exit = on_exit
        for name, (_url, agent) in self.agents().items():
            agent.watch(self._exit_from(None if agent is self.default else name))

    def _exit_from(self, name: str | None) -> Callable[[str, str, str | None], None]:
        """The exit callback for the agent of node ``name`` (None: the configured node, whatever its name): the
        exit of a sandbox the store puts on another node is not that sandbox's (a copy left on a node that was lost
        meanwhile, :mod:`sbx.control.cluster.rescue`, or a source a move left) and is dropped."""
        def on_exit(sandbox_id: str, kind: str, detail: str | None) -> None:
            row = self.store.get_sandbox(sandbox_id)
            node = name or self.default_name
            if row is not None and (row.node or self.default_name) != node:
                log.info("node %s: %s ended (%s), but it runs on %s now: ignored", node, sandbox_id, kind, row.node)
                return
            if self._on_exit is not None:
                self._on_exit(sandbox_id, kind, detail)

        return on_exit

    def unwatch(self) -> None:
        self._on_exit = None
        for _url, agent in self.agents().values():
            agent.unwatch()

    def reconcile(self, known: dict[str, str]) -> dict[str, NodeStatus]:
        """Each node reconciles its own sandboxes (``known`` split by their ``node`` column). A sandbox on an
        added node that does not answer keeps what the store says (``running``/``checkpointed``/``stopped``) until
        the node is back."""
        self.refresh()
        rows = {r.id: r for r in self.store.list_sandboxes()}
        by_node: dict[str, dict[str, str]] = {}
        for sid, state in known.items():
            row = rows.get(sid)
            by_node.setdefault((row.node if row else None) or self.default_name, {})[sid] = state
        found: dict[str, NodeStatus] = {}
        agents = self.agents()
        for node, ids in by_node.items():
            entry = agents.get(node)
            try:
                agent = entry[1] if entry else self.agent(node)
            except NodeError as e:
                log.warning("node %s holds %d sandboxes: %s", node, len(ids), e.message)
                continue
            try:
                found.update(agent.reconcile(ids))
            except NodeError as e:
                if agent is self.default:
                    raise
                log.warning("node %s did not reconcile (%s); its sandboxes keep their state", node, e.message)
                for sid, state in ids.items():
                    row = rows.get(sid)
                    if state == "running":
                        found[sid] = "running"
                    elif state == "stopped":
                        found[sid] = "checkpointed" if row is not None and row.has_memory else "stopped"
        for node, (_url, agent) in agents.items():  # an added node with no sandboxes still drops its orphans
            if node not in by_node and node != self.default_name:
                try:
                    agent.reconcile({})
                except NodeError:
                    pass
        return found
