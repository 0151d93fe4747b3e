"""The plane: sandbox operations, as mixins that :class:`sbx.control.service.ControlPlane` combines.

- ``planebase``: :class:`PlaneBase`, the state every part shares (store, router, lifecycle, pool), views, events,
  new rows, lookups and waits;
- ``admission``: placement's view of the nodes and the plans' limits on a start (a base of :class:`PlaneBase`);
- ``operations``: create, stop, resume (and resize), fork, delete (:class:`LifecycleOps`);
- ``forking``, ``moving``, ``migrating``: a fork made on another node, a resume that moves, a live migration;
- ``snapshotting``: named and automatic snapshots; ``execjobs``: execs and detached jobs;
- ``files`` and ``filescripts``: files in and out of a running sandbox; ``routes``: hosted ports (each takes the
  plane as a protocol of its own);
- ``views``: API shapes of stats, jobs, snapshots; ``activity``: last use, for the TTL; ``sampler``: the console's
  resource graphs.

May import :mod:`sbx.control.cluster` and everything below it (accounts, secrets, store, errors), and
:mod:`sbx.node` types; never :mod:`sbx.control.service` or :mod:`sbx.control.reaper`.
"""
