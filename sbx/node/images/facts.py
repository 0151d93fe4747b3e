"""What the node knows of a built image: :class:`ImageFacts`, and the readers that fill it from the final root
filesystem (``/etc/os-release``, ``/etc/passwd``) and the OCI image config (``Env``, ``WorkingDir``, ``User``).

Pure parsing: the readers take text or parsed JSON and never run a tool.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

_KEY = re.compile(r"^[0-9a-f]{64}$")

#: The sources an image can come from (:attr:`ImageFacts.source`).
SOURCES = ("dockerfile", "archive", "registry")
#: The two ways a sandbox of an image starts (:attr:`ImageFacts.init`).
INITS = ("systemd", "minimal")


@dataclass(frozen=True)
class ImageFacts:
    """One built image (``settings.images_dir / f"{key}.ext4"``, its facts in ``f"{key}.json"``).

    - ``key``: 64 hex chars, sha256 over the source image's digest, the recipe hash and the layer version;
    - ``os_id`` / ``os_name``: ``ID`` and ``PRETTY_NAME`` of the image's ``/etc/os-release`` (``""`` when absent);
    - ``init``: ``"systemd"`` (systemd is PID 1) or ``"minimal"`` (sbx's minimal init, :mod:`sbx.guest.minimal`);
    - ``shell``: ``"/bin/bash"`` when the image has bash, else ``"/bin/sh"``;
    - ``env``: the image config's ``Env`` (Dockerfile ``ENV``) as a dict, ``PATH`` included when set;
    - ``workdir``: the config's ``WorkingDir``, ``None`` when unset or ``/``;
    - ``user``: the config's ``User`` as a name (a numeric uid resolved through the image's ``/etc/passwd``),
      ``None`` when unset or root;
    - ``users``: name -> ``[uid, gid, home]`` for ``root``, ``user`` and ``user`` (when set), from the final
      ``/etc/passwd``;
    - ``content_bytes`` / ``size_bytes``: bytes of files, bytes of the sparse ext4 file (its apparent size);
    - ``source``: ``"dockerfile"``, ``"archive"`` or ``"registry"``;
    - ``built_at``: ISO 8601 UTC (``2026-12-06T23:00:00Z``); ``build_seconds``: wall time of the build.
    """

    key: str
    os_id: str
    os_name: str
    init: str
    shell: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    users: dict[str, list[Any]] = field(default_factory=dict)
    content_bytes: int = 0
    size_bytes: int = 0
    source: str = "archive"
    built_at: str = ""
    build_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not _KEY.match(self.key):
            raise ValueError(f"image key must be 64 hex chars, not {self.key!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, not {self.init!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {self.source!r}")

    def to_json(self) -> dict[str, Any]:
        """The facts as JSON-ready data (the ``<key>.json`` file): every field under its own name."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ImageFacts:
        """The facts :meth:`to_json` wrote; unknown fields are ignored (a newer writer). Raises ``KeyError`` /
        ``ValueError`` / ``TypeError`` on data that isn't facts."""
        names = set(cls.__dataclass_fields__)
        data = {k: v for k, v in d.items() if k in names}
        data["env"] = {str(k): str(v) for k, v in dict(data.get("env") or {}).items()}
        data["users"] = {str(k): list(v) for k, v in dict(data.get("users") or {}).items()}
        return cls(**data)


def parse_os_release(text: str) -> dict[str, str]:
    """``/etc/os-release`` (os-release(5): ``KEY=value`` lines, values optionally quoted) as a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        out[key.strip()] = value
    return out


def parse_passwd(text: str) -> dict[str, tuple[int, int, str, str]]:
    """``/etc/passwd`` as name -> ``(uid, gid, home, shell)``; malformed lines are skipped."""
    out: dict[str, tuple[int, int, str, str]] = {}
    for line in text.splitlines():
        f = line.split(":")
        if len(f) < 7 or not f[2].isdigit() or not f[3].isdigit():
            continue
        out.setdefault(f[0], (int(f[2]), int(f[3]), f[5], f[6]))
    return out


def parse_env(env: list[str] | None) -> dict[str, str]:
    """An OCI config's ``Env`` (``["KEY=value", ...]``) as a dict; entries without ``=`` are skipped."""
    out: dict[str, str] = {}
    for item in env or []:
        key, sep, value = item.partition("=")
        if sep and key:
            out[key] = value
    return out


def workdir_of(config: dict[str, Any]) -> str | None:
    """The config's ``WorkingDir``; ``None`` when unset, empty or ``/``."""
    wd = str(config.get("WorkingDir") or "").rstrip("/")
    return wd or None


def user_name(spec: str | None, passwd: dict[str, tuple[int, int, str, str]]) -> str | None:
    """The config's ``User`` (``name``, ``uid``, ``name:group`` or ``uid:gid``) as an account name of ``passwd``;
    ``None`` for unset or root. A uid with no account keeps its number as the name. Raises ``ValueError`` for a
    name the image does not have."""
    if not spec:
        return None
    who = spec.split(":", 1)[0].strip()
    if not who or who in ("root", "0"):
        return None
    if who.isdigit():
        for name, (uid, _gid, _home, _shell) in passwd.items():
            if uid == int(who):
                return None if uid == 0 else name
        return who
    if who not in passwd:
        raise ValueError(f"USER {who!r} has no account in the image's /etc/passwd")
    return who


def users_of(passwd: dict[str, tuple[int, int, str, str]], extra: str | None) -> dict[str, list[Any]]:
    """name -> ``[uid, gid, home]`` for ``root``, ``user`` and ``extra`` (when set) among ``passwd``'s accounts."""
    out: dict[str, list[Any]] = {}
    for name in ("root", "user", extra):
        if name and name in passwd:
            uid, gid, home, _shell = passwd[name]
            out[name] = [uid, gid, home]
    return out
