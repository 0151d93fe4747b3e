"""Sandboxes leaving and arriving: mixins of :class:`sbx.node.agent.LocalNode` (built on
:class:`sbx.node.agentbase.NodeBase`) and what a caller drives them with.

- :mod:`sbx.node.migration.live`: the steps of a live migration and :func:`sbx.node.migration.live.migrate`, which a
  control plane runs with two nodes;
- :mod:`sbx.node.migration.outgoing`: live migration, the source's side (``MigrationMixin``);
- :mod:`sbx.node.migration.incoming`: live migration, the destination's side (``IncomingMixin``);
- :mod:`sbx.node.migration.transfer`: a stopped sandbox's export and import (``TransferMixin``);
- :mod:`sbx.node.migration.replicas`: seal replicas kept for other nodes (``ReplicaMixin``);
- :mod:`sbx.node.migration.filestream`: a folder of files as one HTTP body (the format the moves send).

May import :mod:`sbx.node.agentbase` and the rooms below it (network, host, container, steps, types), not the other
mixins' rooms: a call into another mixin goes through the methods ``NodeBase`` declares.
"""
