"""Commands in a sandbox: mixins of :class:`sbx.node.agent.LocalNode`, built on :class:`sbx.node.agentbase.NodeBase`.

- :mod:`sbx.node.exec.jobs`: attached execs, detached jobs, spawned processes with pipes or a pty (``ExecMixin``);
- :mod:`sbx.node.exec.attached`: attached execs through the sandbox's exec agent (``ChannelMixin``);
- :mod:`sbx.node.exec.channel`: the host's side of the exec agent's protocol (framing, the socket).

May import :mod:`sbx.node.agentbase` and the rooms below it (network, host, container, steps, types), not the other
mixins' rooms: a call into another mixin goes through the methods ``NodeBase`` declares.
"""
