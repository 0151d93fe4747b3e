"""The egress proxy's questions from a node agent to the control plane: a long poll the control plane holds open.

On the embedded node the proxy's control socket (:mod:`sbx.node.network.egressproxy`) calls the control plane's handler
in process. A node agent (``sbx node serve``) can't call its servers (it knows no server's address, and a server
replica may come and go), so the questions travel the other way round, over the node API and its token:

- the node's proxy hands each question to :meth:`EgressLink.ask` (``(sandbox id, question)``, the sandbox id
  from the proxy's own address map), which queues it and waits up to :data:`ANSWER_SECONDS` for an answer (an
  audit record, ``op: used``, is queued and answered ``{}`` at once: the response it follows doesn't wait);
- every server driving the node keeps a :class:`EgressPoller` on ``POST /v1/node/egress/poll`` (body ``{"wait":
  S}``, at most 30 s), which answers at once with the queued questions (``{"boot", "questions": [{"qid",
  "sandbox", "question"}]}``) or with none after ``S`` seconds;
- the server answers them in its next poll's body (``{"wait", "answers": [{"qid", "answer"}]}``: one request per
  batch, not two), or with ``POST /v1/node/egress/answer`` (``{"answers": [...]}``).

Nothing waits when no server polls: with no poll seen for :data:`POLL_FRESH_SECONDS`, and for a question nobody
answers within :data:`ANSWER_SECONDS`, the request passes without secrets (``{"actions": []}``), as on an
embedded node with no handler. ``boot`` is this node process's link id: a server that sees it change (the agent
restarted, its redirect set is empty) tells the node again which sandboxes go through the proxy
(``on_link``). Which sandbox a node may ask about is the control plane's rule (:mod:`sbx.control.secrets.nodes`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI

from sbx.node.types import NodeError

log = logging.getLogger("sbx.node.remote")

ANSWER_SECONDS = 10.0
"""How long a question waits for a server's answer before its request passes without secrets."""
POLL_FRESH_SECONDS = 30.0
"""A poll this recent means a server is listening; without one, questions are not queued at all."""
POLL_WAIT_SECONDS = 10.0
"""How long a server's poll waits on the node for a question (as long as the exits poll: a node agent stopping waits
for both)."""
BATCH = 64
"""Most questions one poll carries."""
QUEUE_MAX = 10000
"""Most questions waiting at once; an audit record (``op: used``, which nobody waits for) beyond it is dropped."""

Handler = Callable[[str, dict[str, Any]], dict[str, Any]]


@dataclass
class _Question:
    sandbox: str
    question: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] | None = None
    oneway: bool = False  # "used": nobody waits for the answer


class EgressLink:
    """The node side: questions of the node's egress proxy, waiting for a polling server (module docstring).
    Thread-safe; ``clock`` is ``time.monotonic`` (tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.boot = secrets.token_hex(8)
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[str] = deque()
        self._pending: dict[str, _Question] = {}
        self._last_poll = float("-inf")

    def listening(self) -> bool:
        """True when a server polled within :data:`POLL_FRESH_SECONDS`."""
        with self._cond:
            return self._clock() - self._last_poll < POLL_FRESH_SECONDS

    def ask(self, sandbox_id: str, question: dict[str, Any], timeout: float = ANSWER_SECONDS) -> dict[str, Any]:
        """The proxy's handler: ``question`` of sandbox ``sandbox_id`` answered by a server, or ``{"actions": []}``
        when none listens or none answers within ``timeout`` seconds. An audit record (``op: used``) is queued
        for the servers and answered ``{}`` at once."""
        if not self.listening():
            return {"actions": []}
        qid = secrets.token_hex(8)
        q = _Question(sandbox_id, question, oneway=question.get("op") == "used")
        with self._cond:
            if q.oneway and len(self._queue) >= QUEUE_MAX:
                log.warning("egress: %d questions wait for a server: %s's audit record is dropped", QUEUE_MAX,
                            sandbox_id)
                return {}
            self._pending[qid] = q
            self._queue.append(qid)
            self._cond.notify_all()
        if q.oneway:  # the audit record: the response need not wait for the server to store it
            return {}
        answered = q.done.wait(timeout)
        with self._cond:
            self._pending.pop(qid, None)
            try:
                self._queue.remove(qid)
            except ValueError:
                pass
        if not answered or q.answer is None:
            log.warning("egress: no server answered %s's question in %.0f s: no secret for it", sandbox_id, timeout)
            return {"actions": []}
        return q.answer

    def poll(self, wait: float) -> dict[str, Any]:
        """``{"boot", "questions": [...]}``: up to :data:`BATCH` waiting questions, waiting up to ``wait`` seconds
        for one. A question handed out is not handed out again."""
        with self._cond:
            self._last_poll = self._clock()
            self._cond.wait_for(lambda: bool(self._queue), timeout=max(0.0, wait))
            self._last_poll = self._clock()
            out: list[dict[str, Any]] = []
            while self._queue and len(out) < BATCH:
                qid = self._queue.popleft()
                q = self._pending.get(qid)
                if q is None:
                    continue
                if q.oneway:  # nobody waits for its answer: handed out, it is done here
                    del self._pending[qid]
                out.append({"qid": qid, "sandbox": q.sandbox, "question": q.question})
            return {"boot": self.boot, "questions": out}

    def answer(self, qid: str, answer: dict[str, Any]) -> bool:
        """Give question ``qid`` its ``answer``; False for a question no longer waiting (timed out, unknown)."""
        with self._cond:
            q = self._pending.get(qid)
        if q is None or not isinstance(answer, dict):
            return False
        q.answer = answer
        q.done.set()
        return True


def egress_routes(app: FastAPI, link: EgressLink) -> None:
    """``POST /v1/node/egress/poll`` and ``POST /v1/node/egress/answer`` on the node API (its middleware checks the
    node token)."""

    def take(answers: Any) -> int:
        taken = 0
        for item in answers if isinstance(answers, list) else []:
            if isinstance(item, dict) and link.answer(str(item.get("qid", "")), item.get("answer")):  # type: ignore[arg-type]
                taken += 1
        return taken

    @app.post("/v1/node/egress/poll")
    def poll(body: dict[str, Any]) -> dict[str, Any]:
        take(body.get("answers"))  # the answers to the previous batch ride on the next poll
        try:
            wait = float(body.get("wait", POLL_WAIT_SECONDS))
        except (TypeError, ValueError):
            wait = POLL_WAIT_SECONDS
        return link.poll(min(max(wait, 0.0), 30.0))

    @app.post("/v1/node/egress/answer")
    def answer(body: dict[str, Any]) -> dict[str, Any]:
        return {"taken": take(body.get("answers"))}


class EgressPoller:
    """The server side, one per node client: polls the node over ``http`` (an ``httpx.Client`` with the node
    token), answers each question with ``handler(sandbox_id, question)`` and calls ``on_link()`` (in a thread of
    its own) whenever it reaches a node process it hadn't reached yet. ``threads`` polls run at once, so one slow
    answer doesn't hold the next request."""

    def __init__(self, http: httpx.Client, handler: Handler, on_link: Callable[[], None] | None = None,
                 threads: int = 2):
        self._http = http
        self._handler = handler
        self._on_link = on_link
        self._threads = threads
        self._running = threading.Event()
        self._boot = ""
        self._guard = threading.Lock()

    def start(self) -> None:
        """Start the poll threads (daemons)."""
        self._running.set()
        for i in range(self._threads):
            threading.Thread(target=self._loop, name=f"egress-poll-{i}", daemon=True).start()

    def stop(self) -> None:
        """Stop polling (a poll in flight ends with its wait)."""
        self._running.clear()

    def _linked(self, boot: str) -> None:
        with self._guard:
            if boot == self._boot:
                return
            self._boot = boot
        if self._on_link is not None:
            threading.Thread(target=self._call_on_link, name="egress-link-sync", daemon=True).start()

    def _call_on_link(self) -> None:
        try:
            self._on_link()  # type: ignore[misc]
        except Exception:
            log.exception("egress: re-telling the node its proxied sandboxes failed")

    def _answer(self, item: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._handler(str(item["sandbox"]), dict(item["question"]))
        except Exception as e:  # a bad question or a failing store: that request passes without secrets
            log.warning("egress: answering %s failed: %s", item.get("sandbox"), e)
            return {"actions": [], "error": str(e)[:200]}

    def _loop(self) -> None:
        answers: list[dict[str, Any]] = []  # for the last batch: sent with the next poll (one request, not two)
        while self._running.is_set():
            try:
                wait = POLL_WAIT_SECONDS if self._boot else 0.0  # the first answers at once: on_link runs
                resp = self._http.post("/v1/node/egress/poll", json={"wait": wait, "answers": answers},
                                       timeout=httpx.Timeout(POLL_WAIT_SECONDS + 10, connect=5.0))
                if resp.status_code != 200:
                    raise httpx.HTTPError(f"poll answered {resp.status_code}")
                answers = []
                data = resp.json()
                self._linked(str(data.get("boot", "")))
                questions = (data.get("questions") or [])[:BATCH]  # a node is not trusted to keep to its batch
                answers = [{"qid": q["qid"], "answer": self._answer(q)} for q in questions]
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                answers = []
                if self._running.is_set():
                    log.debug("egress poll: %s", e)
                    time.sleep(1.0)


class EgressClient:
    """The egress proxy part of :class:`sbx.node.remote.client.RemoteNode` (which supplies ``url``, ``_http``,
    ``_check``, ``_unreachable`` and ``_call``): whether the node runs a proxy, which sandboxes go through it,
    and the :class:`EgressPoller` answering its questions."""

    url: str
    _http: httpx.Client
    _egress_poller: EgressPoller | None = None
    _egress_seen: tuple[float, bool] = (float("-inf"), False)

    if TYPE_CHECKING:
        def _call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...
        def _check(self, resp: httpx.Response) -> None: ...
        def _unreachable(self, e: Exception) -> NodeError: ...

    def egress_ready(self) -> bool:
        """True when the node's health says its egress proxy runs (asked at most every 2 s; False while the node
        does not answer)."""
        at, ready = self._egress_seen
        if time.monotonic() - at < 2.0:
            return ready
        try:
            resp = self._http.get("/v1/node/health", timeout=5.0)
            self._check(resp)
            ready = bool(resp.json().get("egress"))
        except (httpx.HTTPError, NodeError, ValueError):
            return False
        self._egress_seen = (time.monotonic(), ready)
        return ready

    def serve_egress(self, handler: Handler, on_link: Callable[[], None] | None = None) -> None:
        """Answer the node's egress proxy with ``handler(sandbox_id, question)`` from now on (an
        :class:`EgressPoller`); ``on_link()`` runs each time a new node process is reached."""
        self.close_egress()
        self._egress_poller = EgressPoller(self._http, handler, on_link)
        self._egress_poller.start()

    def set_egress_proxy(self, id: str, enabled: bool) -> None:
        """As :meth:`sbx.node.types.NodeAgent.set_egress_proxy`, on the node (409 ``egress_proxy_unavailable``
        when it runs no proxy)."""
        self._call("set_egress_proxy", id, enabled)

    def close_egress(self) -> None:
        """Stop answering the node's proxy (its questions then pass without secrets)."""
        if self._egress_poller is not None:
            self._egress_poller.stop()
            self._egress_poller = None
