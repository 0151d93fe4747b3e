"""A node agent in its own process (``sbx node serve``) and the client the control plane reaches it with.

- :mod:`sbx.node.remote.wire`: how calls, results and errors travel (JSON; the dataclasses of
  :mod:`sbx.node.types` by name), and which :class:`sbx.node.types.NodeAgent` methods a node serves;
- :mod:`sbx.node.remote.server`: the node's HTTP API (FastAPI) around a :class:`sbx.node.agent.LocalNode`;
- :mod:`sbx.node.remote.client`: :class:`RemoteNode`, a NodeAgent whose calls go to such a node over HTTP;
- :mod:`sbx.node.remote.spawned`: a spawned process (pipes or a pty) relayed over a WebSocket.
"""
