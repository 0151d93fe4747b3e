"""The rules of a secret: where it may go and what the egress proxy does there (:mod:`sbx.control.secrets.vault`).

A rule names hosts (exact ``api.example.com`` or ``*.example.com``, which matches any subdomain but not
``example.com`` itself), optionally a path prefix and methods, and one action (``header``, ``basic``, ``replace``).
:func:`normalise_rules` checks what an API caller sends (400 ``invalid_rules``); :func:`rule_matches` is the
proxy-time test.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from sbx.control.errors import ControlError

SECRET_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
"""Secret names: a letter, then up to 62 letters, digits, ``_`` or ``-``."""
VALUE_MAX_BYTES = 64 * 1024
"""Largest secret value, in UTF-8 bytes."""
PLACEHOLDER_PREFIX = "sbx-secret:"
"""A sandbox writes ``sbx-secret:NAME`` where the value of secret NAME should go (action ``replace``)."""
ACTIONS = ("header", "basic", "replace")


def host_matches(pattern: str, host: str) -> bool:
    """``pattern`` is ``api.example.com`` (that host only) or ``*.example.com`` (any name below example.com, not
    example.com itself); both sides are compared lowercase, without a trailing dot."""
    pattern, host = pattern.lower().rstrip("."), host.lower().rstrip(".")
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def rule_matches(rule: dict[str, Any], host: str, method: str, path: str) -> bool:
    """True when ``rule`` (a :func:`normalise_rules` dict) names this request: a host pattern matches, the path
    starts with ``path_prefix`` (when set) and the method is listed (when ``methods`` is set)."""
    if not any(host_matches(p, host) for p in rule["hosts"]):
        return False
    if rule.get("path_prefix") and not path.startswith(rule["path_prefix"]):
        return False
    methods = rule.get("methods") or []
    return not methods or method.upper() in methods


def bad_rules(message: str) -> ControlError:
    """400 ``invalid_rules`` with ``message`` (field ``rules``)."""
    return ControlError("invalid_rules", message, 400, field="rules")


_HOST_RE = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_HEADER_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")


def utf8(text: str) -> bool:
    """True when ``text`` encodes as UTF-8 (no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def normalise_rules(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check and normalise rule dicts ``{hosts, path_prefix?, methods?, action, header?, value?, username?}``:
    host patterns lowercase (exact or ``*.domain``; an IP address, a bare ``*`` or a single label is refused: the
    proxy checks names against the upstream's certificate), methods uppercase, a
    ``header`` action needs a header name and a ``value`` holding ``{secret}``, ``basic`` a ``username``.
    Raises 400 ``invalid_rules`` naming what is wrong."""
    out = []
    for i, r in enumerate(rules):
        if not all(utf8(str(v)) for v in r.values() if v is not None):
            raise bad_rules(f"rule {i}: text that is not valid Unicode (a lone surrogate)")
        hosts = [str(h).strip().lower().rstrip(".") for h in r.get("hosts") or []]
        if not hosts:
            raise bad_rules(f"rule {i}: name at least one host")
        for h in hosts:
            if not _HOST_RE.match(h) or len(h) > 253 or "." not in h.removeprefix("*.") or _is_ip(h):
                raise bad_rules(f"rule {i}: {h[:80]!r} is not a host name or *.domain pattern")
        action = r.get("action") or "replace"
        if action not in ACTIONS:
            raise bad_rules(f"rule {i}: action is one of {', '.join(ACTIONS)}")
        rule: dict[str, Any] = {"hosts": hosts, "action": action,
                                "path_prefix": r.get("path_prefix") or None,
                                "methods": sorted({str(m).upper() for m in r.get("methods") or []})}
        if rule["path_prefix"] is not None and not str(rule["path_prefix"]).startswith("/"):
            raise bad_rules(f"rule {i}: a path prefix starts with '/'")
        if action == "header":
            header, value = r.get("header") or "", r.get("value") or ""
            if not _HEADER_RE.match(header):
                raise bad_rules(f"rule {i}: {header[:80]!r} is not a header name")
            if "{secret}" not in value or any(c in value for c in "\r\n\0"):
                raise bad_rules(f"rule {i}: the header value must hold {{secret}} and no line break")
            rule.update(header=header, value=value)
        elif action == "basic":
            username = r.get("username") or ""
            if not username or ":" in username or any(c in username for c in "\r\n\0"):
                raise bad_rules(f"rule {i}: basic auth needs a username without ':'")
            rule["username"] = username
        out.append(rule)
    return out


def check_name(name: str) -> None:
    """Raise 400 ``invalid_name`` unless ``name`` matches :data:`SECRET_NAME_RE`."""
    if not SECRET_NAME_RE.match(name):
        raise ControlError("invalid_name", "secret names are a letter then up to 62 letters, digits, '_' or '-'",
                           400, field="name")
