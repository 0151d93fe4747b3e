"""The nodes a server drives, and the operations on a whole node or a whole account.

- ``router``: :class:`NodeRouter`, a node agent that sends each call to the node holding the sandbox;
- ``registry``: heartbeats, cordons, the ``nodes`` table; ``placement`` and ``capacity``: which node may take a
  sandbox, and whether a node has room; ``relocate``: a stopped sandbox's move between two nodes;
- ``replicas``: seal replicas of stopped sandboxes on a second node; ``trim``: freed space back to the host;
- ``drain``: emptying a node; ``consolidate`` and ``packing``: emptying a lightly used node onto fuller ones;
  ``orphans``: operations a dead server replica left in flight; ``view``: the part of the plane all of them read;
- ``accountend``: an account's suspension and deletion (its sandboxes stopped or deleted, its snapshots, secrets
  and routes removed; finished at start after a crash), refused while a drain or migration moves its sandboxes.

The node- and account-wide operations (drain, consolidate, orphans, the replicator, account ends) act on
sandboxes through the plane, which they take as a ``typing.Protocol`` declared in their own module
(:class:`sbx.control.service.ControlPlane` satisfies it). May import :mod:`sbx.control.accounts`,
:mod:`sbx.control.secrets`, :mod:`sbx.control.store`, :mod:`sbx.control.errors` and :mod:`sbx.node`; never
:mod:`sbx.control.sandboxes`, :mod:`sbx.control.service` or :mod:`sbx.control.reaper`.
"""
