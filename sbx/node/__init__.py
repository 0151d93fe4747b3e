"""The node: what runs sandboxes on one machine (runc containers, CRIU memory images, reflink disks).

At the root:

- :mod:`sbx.node.types`: the node's interface (:class:`sbx.node.types.NodeAgent`) and the shapes it passes;
- :mod:`sbx.node.steps`: wall time of each step of an operation;
- :mod:`sbx.node.agentbase`: :class:`sbx.node.agentbase.NodeBase`, the state and helpers every part of the agent
  shares;
- :mod:`sbx.node.agent`: :class:`sbx.node.agent.LocalNode`, the node agent, made of the mixins below.

The rooms, from the top down (each imports only the rooms below it; the layers contract in ``pyproject.toml``):

- :mod:`sbx.node.remote`: the node's HTTP API (``sbx node serve``) and the client a control plane reaches it with;
  beside :mod:`sbx.node.agent`, not above it: both only meet through ``NodeAgent``;
- the mixins of ``LocalNode``, independent of each other: :mod:`sbx.node.lifecycle` (create, boot, delete,
  snapshots, stats, watching, reconcile, egress settings), :mod:`sbx.node.memory` (stop and resume, forks with
  memory, templates, warm pool), :mod:`sbx.node.exec` (commands, jobs, spawned processes), :mod:`sbx.node.migration`
  (live migration, stopped moves, seal replicas);
- then ``agentbase``, and the mechanisms it is built from, which know no node object: :mod:`sbx.node.network`
  (bridge, nftables, egress policy and proxy, the prestart hook) and :mod:`sbx.node.host` (``sbx setup``, CRIU, the
  base image), independent of each other, above :mod:`sbx.node.container` (cgroups, the root filesystem, the
  watcher, crash-safety pieces);
- ``steps`` and ``types`` at the bottom.
"""
