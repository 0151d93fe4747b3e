"""Sandbox networking on one node, as plain functions and servers (no node object):

- :mod:`sbx.node.network.bridge`: the host bridge, each sandbox's veth pair, its pin and lease;
- :mod:`sbx.node.network.ruleset`: the nftables rulesets (isolation, egress policy, pinning);
- :mod:`sbx.node.network.nft`: nftables batches through libnftables, in process;
- :mod:`sbx.node.network.netlink`: netlink dumps the kernel interrupted, read again;
- :mod:`sbx.node.network.nsjoin`: work inside one namespace of a sandbox from a thread;
- :mod:`sbx.node.network.egress`: what sandboxes may reach outside the node (the egress policy);
- :mod:`sbx.node.network.resolver`: the sandboxes' DNS resolver on the bridge gateway (per-sandbox query limits, logs);
- :mod:`sbx.node.network.egressproxy`: the egress proxy that injects bound secrets (mitmproxy, its CA);
- :mod:`sbx.node.network.egressaddon`: the proxy's mitmproxy addon (runs in the proxy's own virtualenv);
- :mod:`sbx.node.network.hookd`: the node's hook server, doing the prestart hook's work in process;
- :mod:`sbx.node.network.hookclient`: the prestart hook runc runs, a stdlib-only client of the hook server;
- :mod:`sbx.node.network.nethook`: the hook's work (cgroups handed over, network wired), and its fallback entry point.

May import :mod:`sbx.node.container`, :mod:`sbx.node.types`, :mod:`sbx.config` and the layers below the node, not
:mod:`sbx.node.host` (the node passes in what it needs of the host, e.g. the apt mirrors);
``hookclient`` and ``egressaddon`` run outside the node process and import no sbx module at all.
"""
