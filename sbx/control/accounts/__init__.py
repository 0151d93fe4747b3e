"""Accounts and what they may do and pay (issue 12).

- ``keys``: accounts and API keys (:class:`Accounts`, :class:`Principal`);
- ``plans``: what a plan allows (sizes, starts per hour, sandboxes at once, storage);
- ``metering``: intervals of running time and stored GiB, and the plan's starts (:class:`Meter`);
- ``pricing``: prices and the arithmetic of usage reports (pure functions).

May import :mod:`sbx.control.store` and :mod:`sbx.control.errors` only: no node, no cluster, no sandbox operation
(contract "Accounts ... know no node and no sandbox operation"), and not :mod:`sbx.control.secrets`.
"""
