"""A sandbox's memory: mixins of :class:`sbx.node.agent.LocalNode`, built on :class:`sbx.node.agentbase.NodeBase`.

- :mod:`sbx.node.memory.stopresume`: stop (CRIU checkpoint or halt) and resume (restore or cold boot)
  (``StopResumeMixin``);
- :mod:`sbx.node.memory.memcopy`: a new sandbox restored from another one's memory: forks with memory, the new
  identity (``MemoryCopyMixin``);
- :mod:`sbx.node.memory.templates`: memory templates of the base image, one per size (``TemplateMixin``);
- :mod:`sbx.node.memory.warmpool`: warm sandboxes restored from their template ahead of a create (``WarmPoolMixin``).

May import :mod:`sbx.node.agentbase` and the rooms below it (network, host, container, steps, types), not the other
mixins' rooms: a call into another mixin goes through the methods ``NodeBase`` declares.
"""
