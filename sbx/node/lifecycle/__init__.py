"""A sandbox's life on the node: mixins of :class:`sbx.node.agent.LocalNode`, built on
:class:`sbx.node.agentbase.NodeBase`.

- :mod:`sbx.node.lifecycle.containers`: create, the OCI bundle, identity, cold boot, delete (``LifecycleMixin``);
- :mod:`sbx.node.lifecycle.snapshots`: forks and named snapshots of the disk (``SnapshotMixin``);
- :mod:`sbx.node.lifecycle.stats`: status and resource samples (``StatsMixin``);
- :mod:`sbx.node.lifecycle.watching`: settling sandboxes whose init ended on their own (``WatchMixin``);
- :mod:`sbx.node.lifecycle.reconcile`: putting the node back in order after a crash, and its shutdown
  (``ReconcileMixin``);
- :mod:`sbx.node.lifecycle.egressnode`: which sandboxes go through the egress proxy, their CA and environment
  (``EgressMixin``).

May import :mod:`sbx.node.agentbase` and the rooms below it (network, host, container, steps, types), not the other
mixins' rooms: a call into another mixin goes through the methods ``NodeBase`` declares.
"""
