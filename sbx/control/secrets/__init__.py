"""Secrets for the credential proxy: stored encrypted, bound to sandboxes, injected by each node's egress proxy.

- ``vault``: :class:`Secrets`, values (AES-GCM under a key outside the database), bindings, the proxy's questions
  and their audit;
- ``nodes``: which node may ask about which sandbox, and what each node's proxy is told (:class:`SecretNodes`);
- ``rules``: where a secret may go and what the proxy does there.

The plane and its router are reached through the protocols of ``nodes`` (:class:`SecretsPlane`,
:class:`NodeDirectory`). May import :mod:`sbx.control.store`, :mod:`sbx.control.errors` and :mod:`sbx.node`
types; not :mod:`sbx.control.accounts` nor any room above.
"""
