"""A node agent in its own process (``sbx node serve``) and the client the control plane reaches it with.

- :mod:`sbx.node.remote.wire`: how calls, results and errors travel (JSON; the dataclasses of
  :mod:`sbx.node.types` by name), and which :class:`sbx.node.types.NodeAgent` methods a node serves;
- :mod:`sbx.node.remote.server`: the node's HTTP API (FastAPI) around a :class:`sbx.node.types.NodeAgent` (in
  ``sbx node serve`` a :class:`sbx.node.agent.LocalNode`);
- :mod:`sbx.node.remote.streams`: the API's two streams, an attached exec's events and a spawned process's pipes;
- :mod:`sbx.node.remote.relay`: the node's port relay, how a server's port proxy reaches a sandbox's port;
- :mod:`sbx.node.remote.egresslink`: the egress proxy's questions to the control plane, long-polled;
- :mod:`sbx.node.remote.client`: :class:`sbx.node.remote.client.RemoteNode`, a NodeAgent whose calls go to such a
  node over HTTP;
- :mod:`sbx.node.remote.spawned`: a spawned process (pipes or a pty) relayed over a WebSocket.

May import every room of the node but :mod:`sbx.node.agent` (a server serves whatever NodeAgent it is given), and
nothing of the node imports it.
"""
