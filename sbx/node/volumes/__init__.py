"""Persistent volumes on the node (issue 34): the JuiceFS mounts of a sandbox's volumes.

- ``mounts``: mount each volume of a sandbox's spec into its running container with the sandbox's uid map
  (:func:`sbx.storage.juicefs.mount_into`), unmount them before a stop, keep their daemons' process groups in the
  sandbox's record and mount again what a restarted node agent finds missing.

A mechanism below :class:`sbx.node.agentbase.NodeBase`: it knows no node object, only a record and a container's
init pid.
"""
