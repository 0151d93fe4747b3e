"""Sandbox ids, subdomains and URLs.

- id: ``sb_`` + 10 characters from ``[a-z0-9]`` (e.g. ``sb_dz2cxig1dv``), as in the seed guides.
- subdomain: ``adjective-adjective-animal`` from :mod:`sbx.control.store.words` (e.g. ``regal-daring-cricket``).
- url: ``https://<subdomain>.<settings.domain>``.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Callable

from sbx.control.store.words import ADJECTIVES, ANIMALS

_ALPHABET = string.ascii_lowercase + string.digits
ID_RE = re.compile(r"^sb_[a-z0-9]{10}$")


def new_id(prefix: str) -> str:
    """A fresh random id: ``prefix`` + 10 lowercase alphanumerics (accounts ``acct_``, API keys ``key_``)."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(10))


def new_sandbox_id() -> str:
    """A fresh random sandbox id, ``sb_`` + 10 lowercase alphanumerics (~51 bits)."""
    return new_id("sb_")


def new_subdomain(taken: Callable[[str], bool] = lambda _s: False) -> str:
    """A random ``adjective-adjective-animal`` (two different adjectives) for which ``taken`` is False.

    After 50 collisions a 4-digit suffix is added so this always returns.
    """
    for attempt in range(60):
        first, second = secrets.SystemRandom().sample(ADJECTIVES, 2)
        name = f"{first}-{second}-{secrets.choice(ANIMALS)}"
        if attempt >= 50:
            name += f"-{secrets.randbelow(10000):04d}"
        if not taken(name):
            return name
    raise RuntimeError("could not find a free subdomain")


def sandbox_url(subdomain: str, domain: str) -> str:
    """The public URL of a sandbox: ``https://<subdomain>.<domain>``."""
    return f"https://{subdomain}.{domain}"
