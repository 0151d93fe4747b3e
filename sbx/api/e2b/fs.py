"""envd's ``filesystem.Filesystem`` calls (Stat, ListDir, MakeDir, Move, Remove), each one small shell program run
in the sandbox as the calling user through an attached exec (:meth:`sbx.control.service.ControlPlane.exec`), so
the sandbox's own permissions, mount namespace and symlinks decide, never the host's. Paths are shell-quoted
arguments; a relative path (or ``~``) is relative to the user's home, as in envd.

Each program prints ``find -printf`` records of NUL-separated fields (:data:`FIELDS`) and exits with one of
:data:`CODES` for the failures envd reports with a Connect code of its own (``not_found``, ``already_exists``,
``invalid_argument``).

File metadata (envd 0.6.2) is the file's ``user.e2b.<key>`` extended attributes: an upload with ``X-Metadata-<key>``
headers sets them (:func:`set_metadata`), and every entry answered carries them as ``metadata``. Reading them takes
a ``python3`` in the sandbox, so a listing looks for them only in a sandbox where an upload has set some (it left
:data:`META_MARK`): attributes set by hand in a sandbox that never had metadata uploaded are not seen.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import posixpath
import shlex
import stat as st
from typing import TYPE_CHECKING, Any

from sbx.api.e2b.connect import ConnectError
from sbx.api.e2b.procs import control_to_connect
from sbx.control.errors import ControlError

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

FIELDS = r"%Y\0%y\0%s\0%m\0%u\0%g\0%T@\0%p\0%l\0"
"""Per entry: type (symlinks followed), own type, size, permission bits (octal), owner, group, mtime, path,
symlink target."""
NFIELDS = 9
META_MARK = "/var/lib/sbx-e2b/metadata"
"""Left in a sandbox by its first metadata upload: its listings then read ``user.e2b.*`` attributes too."""
XATTR_PREFIX = "user.e2b."
_META_SEP = b"\0\0sbx-e2b-metadata\0\0"
_READ_XATTRS = (
    "import os,sys\n"
    "for p in sys.stdin.buffer.read().split(b'\\0'):\n"
    "  try: names=os.listxattr(p) if p else []\n"
    "  except OSError: names=[]\n"
    "  for n in names:\n"
    f"    if not n.startswith('{XATTR_PREFIX}'): continue\n"
    "    try: v=os.getxattr(p,n)\n"
    "    except OSError: continue\n"
    f"    sys.stdout.buffer.write(p+b'\\0'+n[{len(XATTR_PREFIX)}:].encode()+b'\\0'+v+b'\\0')\n"
)
"""Prints ``path NUL key NUL value NUL`` for each ``user.e2b.*`` attribute of the NUL-separated paths it reads."""
_WRITE_XATTRS = (
    "import base64,json,os,sys\n"
    "d=json.loads(base64.b64decode(sys.argv[1]))\n"
    "for p in d['paths']:\n"
    f"  for k,v in d['metadata'].items(): os.setxattr(p,'{XATTR_PREFIX}'+k,v.encode())\n"
)
CODES = {44: ("not_found", "no such file or directory"), 45: ("already_exists", "already exists"),
         46: ("invalid_argument", "not a directory")}
_TYPES = {"f": "FILE_TYPE_FILE", "d": "FILE_TYPE_DIRECTORY", "l": "FILE_TYPE_SYMLINK"}
_KIND_CHAR = {"d": "d", "l": "l", "p": "p", "s": "s", "c": "c", "b": "b"}


def home_of(user: str) -> str:
    """The home directory of sandbox user ``user``."""
    return "/root" if user == "root" else "/home/user"


def absolute(path: Any, user: str, field: str = "path") -> str:
    """``path`` made absolute and normalised (``~`` and relative paths are the user's home's); ``invalid_argument``
    for a path that is not a non-empty string of at most 4096 bytes without NUL."""
    if not isinstance(path, str) or not path or "\0" in path or len(path.encode("utf-8", "replace")) > 4096:
        raise ConnectError("invalid_argument", f"{field} must be a non-empty path of at most 4096 bytes")
    if path == "~" or path.startswith("~/"):
        path = home_of(user) + path[1:]
    if not path.startswith("/"):
        path = home_of(user) + "/" + path
    return posixpath.normpath(path) if path != "/" else "/"


def permissions(kind: str, mode: int) -> str:
    """``ls -l``-style permissions of an entry of find type ``kind`` and permission bits ``mode``."""
    return _KIND_CHAR.get(kind, "-") + st.filemode(mode)[1:]


def listing(where: str) -> str:
    """The shell program printing the records of ``find WHERE`` (its arguments, already quoted), then, in a
    sandbox with :data:`META_MARK`, the ``user.e2b.*`` attributes of the same paths."""
    return (f"find {where} -printf '{FIELDS}' && {{ [ ! -e {META_MARK} ] || {{ printf "
            f"'\\000\\000sbx-e2b-metadata\\000\\000'; find {where} -printf '%p\\0' | "
            f"python3 -IS -c {shlex.quote(_READ_XATTRS)}; }}; }}")


def entries(raw: bytes) -> list[dict[str, Any]]:
    """``EntryInfo`` messages (proto3 JSON) from the records a :func:`listing` printed (with ``metadata`` for
    entries that have some)."""
    raw, _, meta = raw.partition(_META_SEP)
    found: dict[str, dict[str, str]] = {}
    triples = meta.split(b"\0")
    for i in range(0, len(triples) - 2, 3):
        path, key, value = (t.decode("utf-8", "surrogateescape") for t in triples[i:i + 3])
        found.setdefault(path, {})[key] = value
    parts = raw.split(b"\0")
    out = []
    for i in range(0, len(parts) - NFIELDS + 1, NFIELDS):
        kind, own, size, mode, owner, group, mtime, path, target = (
            p.decode("utf-8", "surrogateescape") for p in parts[i:i + NFIELDS])
        try:
            bits = int(mode, 8)
            when = dt.datetime.fromtimestamp(float(mtime), dt.UTC)
            nbytes = int(size)
        except ValueError:
            continue
        entry: dict[str, Any] = {
            "name": posixpath.basename(path) or "/", "type": _TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
            "path": path, "size": str(nbytes), "mode": bits, "permissions": permissions(kind, bits),
            "owner": owner, "group": group, "modifiedTime": when.isoformat().replace("+00:00", "Z"),
        }
        if own == "l":
            entry["symlinkTarget"] = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
        if path in found:
            entry["metadata"] = found[path]
        out.append(entry)
    return out


def run(cp: ControlPlane, sandbox_id: str, script: str, user: str) -> bytes:
    """Run ``script`` as ``user``; its stdout. Exit codes of :data:`CODES` become their Connect errors, any other
    failure ``permission_denied`` (when the sandbox says so) or ``failed_precondition`` with its message."""
    out, err = bytearray(), bytearray()
    code: int | None = None
    try:
        for line in cp.exec(sandbox_id, script, 30.0, user, None, None, "base64"):
            if "stream" in line:
                (out if line["stream"] == "stdout" else err).extend(base64.b64decode(line["data"]))
            elif "exitCode" in line:
                code = int(line["exitCode"])
            elif "error" in line:
                raise ConnectError("unavailable", str(line["error"].get("message", "the sandbox failed")))
    except ControlError as e:
        raise control_to_connect(e) from None
    if code is None:
        raise ConnectError("unavailable", "the sandbox ended the call without an exit status")
    if code in CODES:
        kind, what = CODES[code]
        raise ConnectError(kind, what)
    if code != 0:
        text = err.decode("utf-8", "replace").strip()[-500:]
        if "Permission denied" in text or "Operation not permitted" in text:
            raise ConnectError("permission_denied", text)
        raise ConnectError("failed_precondition", text or f"the operation failed (exit {code})")
    return bytes(out)


def _q(path: str) -> str:
    return shlex.quote(path)


def stat(cp: ControlPlane, sandbox_id: str, path: str, user: str) -> dict[str, Any]:
    """``StatResponse`` ``{"entry"}`` of ``path``; ``not_found`` when it does not exist."""
    p = absolute(path, user)
    raw = run(cp, sandbox_id, f'p={_q(p)}; [ -e "$p" ] || [ -L "$p" ] || exit 44; '
                              + listing('"$p" -maxdepth 0'), user)
    found = entries(raw)
    if not found:
        raise ConnectError("not_found", f"{p}: no such file or directory")
    return {"entry": found[0]}


def list_dir(cp: ControlPlane, sandbox_id: str, path: str, depth: Any, user: str) -> dict[str, Any]:
    """``ListDirResponse`` ``{"entries"}``: everything under directory ``path`` down to ``depth`` levels (1: its
    own entries), sorted by path; ``not_found``, ``invalid_argument`` for a file or a depth outside 1..64."""
    p = absolute(path, user)
    levels = 1 if depth in (None, 0) else depth
    if not isinstance(levels, int) or isinstance(levels, bool) or not 1 <= levels <= 64:
        raise ConnectError("invalid_argument", "depth must be an integer from 1 to 64")
    raw = run(cp, sandbox_id, f'p={_q(p)}; [ -e "$p" ] || exit 44; [ -d "$p" ] || exit 46; '
                              + listing(f'-H "$p" -mindepth 1 -maxdepth {levels}'), user)
    return {"entries": sorted(entries(raw), key=lambda e: e["path"])}


def make_dir(cp: ControlPlane, sandbox_id: str, path: str, user: str) -> dict[str, Any]:
    """``MakeDirResponse`` ``{"entry"}``: ``path`` made with its parents; ``already_exists`` when it exists."""
    p = absolute(path, user)
    raw = run(cp, sandbox_id, f'p={_q(p)}; {{ [ -e "$p" ] || [ -L "$p" ]; }} && exit 45; mkdir -p -- "$p" && '
                              + listing('"$p" -maxdepth 0'), user)
    return {"entry": (entries(raw) or [{}])[0]}


def move(cp: ControlPlane, sandbox_id: str, source: str, destination: str, user: str) -> dict[str, Any]:
    """``MoveResponse`` ``{"entry"}`` of ``destination`` after renaming ``source`` to it (parents made);
    ``not_found`` when ``source`` does not exist."""
    s, d = absolute(source, user, "source"), absolute(destination, user, "destination")
    raw = run(cp, sandbox_id, f's={_q(s)}; d={_q(d)}; [ -e "$s" ] || [ -L "$s" ] || exit 44; '
                              'mkdir -p -- "$(dirname -- "$d")" && mv -T -- "$s" "$d" && '
                              + listing('"$d" -maxdepth 0'), user)
    return {"entry": (entries(raw) or [{}])[0]}


def remove(cp: ControlPlane, sandbox_id: str, path: str, user: str) -> dict[str, Any]:
    """``RemoveResponse`` ``{}`` after removing ``path`` (a directory with everything in it); a path that does
    not exist is removed already (as envd answers)."""
    p = absolute(path, user)
    if p == "/":
        raise ConnectError("invalid_argument", "refusing to remove /")
    run(cp, sandbox_id, f'rm -rf -- {_q(p)}', user)
    return {}


def set_metadata(cp: ControlPlane, sandbox_id: str, paths: list[str], metadata: dict[str, str], user: str) -> None:
    """Give each of ``paths`` the ``user.e2b.<key>`` attributes of ``metadata`` (as ``user``, who just wrote them),
    and leave :data:`META_MARK` so that listings read them. ``failed_precondition`` when the filesystem refuses
    them (too long, too many)."""
    data = base64.b64encode(json.dumps({"paths": paths, "metadata": metadata}).encode()).decode()
    run(cp, sandbox_id, f"python3 -IS -c {_q(_WRITE_XATTRS)} {data}", user)
    run(cp, sandbox_id, f"mkdir -p -- {_q(posixpath.dirname(META_MARK))} && touch -- {_q(META_MARK)}", "root")
