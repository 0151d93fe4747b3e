"""The host-side pieces of one sandbox's container, as plain functions (no node object):

- :mod:`sbx.node.container.cgroup`: reading a sandbox's cgroup figures (memory, OOM kills, CPU); freezing it;
- :mod:`sbx.node.container.cgdelegate`: handing a sandbox its cgroups, and the node's aggregate limits;
- :mod:`sbx.node.container.lxcfs`: LXCFS, so a sandbox's ``/proc`` shows its own size;
- :mod:`sbx.node.container.rootfs`: the sandbox's uid range, the disk's two mounts, unmounting it;
- :mod:`sbx.node.container.guestfs`: writing into a sandbox's root filesystem without following its symlinks;
- :mod:`sbx.node.container.watch`: noticing a sandbox whose init ended, and the kernel's OOM kills;
- :mod:`sbx.node.container.recovery`: thawing a frozen root, memory image generations.

May import :mod:`sbx.config` and the layers below the node (:mod:`sbx.runtime`, :mod:`sbx.storage`); nothing else of
the node.
"""
