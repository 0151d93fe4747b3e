"""The programs :mod:`sbx.control.sandboxes.files` runs inside a sandbox (POSIX sh, with ``cat``, ``tar``, ``find``,
``rm`` of the image), and the exit codes by which each names its error (:data:`ERRORS`). A path is always ``"$1"``, an
argv entry, never shell text; every check runs before anything changes, so an error answer means nothing changed.
"""

from __future__ import annotations

# Exit codes of the in-sandbox scripts: each names one error.
ERRORS = {
    40: ("invalid_path", 400, "{path}: bad path"),
    41: ("is_a_directory", 400, "{path} is a directory"),
    42: ("not_a_directory", 400, "{path} is not a directory"),
    43: ("permission_denied", 403, "{path}: permission denied"),
    44: ("not_found", 404, "{path} not found"),
    45: ("protected_path", 403, "{path}: refusing to remove /, a home directory or a mount point (or a folder "
         "holding one)"),
}

# "$1" is the path. `~` expansion happens in sbx.control.sandboxes.files (norm_path), never in a shell.
READ = r'''p="$1"
[ -e "$p" ] || exit 44
[ -d "$p" ] && exit 41
[ -r "$p" ] || exit 43
exec cat -- "$p"'''

# An upload goes to a temporary file next to the target, named on stdout as "<temp>\0<target>\0" (a symlink is
# written through, as `cat >` would); :data:`COMMIT` renames it over the target once the whole body has arrived,
# so an upload cut short leaves the old file as it was. An existing file in a folder the user can't write to is
# written in place (the temp name is then empty).
MKPARENT = r'''
if [ ! -d "$d" ]; then
  a="$d"; while [ ! -e "$a" ] && [ ! -L "$a" ]; do a=$(dirname -- "$a"); done
  [ -d "$a" ] || exit 42
  [ -w "$a" ] && [ -x "$a" ] || exit 43
  mkdir -p -- "$d" 2>/dev/null || exit 43
fi'''

# Every check runs before anything is made: an error answer means nothing changed.
WRITE = r'''p="$1"
if [ -L "$p" ]; then p=$(readlink -f -- "$p") || exit 44; fi
d=$(dirname -- "$p")
[ -d "$p" ] && exit 41
[ -e "$p" ] && { [ -w "$p" ] || exit 43; }''' + MKPARENT + r'''
if [ ! -w "$d" ]; then
  [ -e "$p" ] || exit 43
  printf '\0%s\0' "$p"
  exec cat > "$p"
fi
t=$(mktemp -- "$d/.sbx-upload.XXXXXX" 2>/dev/null) || exit 43
printf '%s\0%s\0' "$t" "$p"
exec cat > "$t"'''

# "$1" the finished temp file, "$2" the target: keep an existing target's mode (and owner, as root), else the
# mode a new file gets from the umask; then rename over the target.
COMMIT = r'''t="$1"; p="$2"
if [ -e "$p" ]; then
  chmod --reference="$p" -- "$t" 2>/dev/null
  [ "$(id -u)" = 0 ] && chown --reference="$p" -- "$t" 2>/dev/null
else
  chmod "$(printf '%o' $(( 0666 & ~$(umask) )))" -- "$t"
fi
mv -f -- "$t" "$p" 2>/dev/null && exit 0
rm -f -- "$t"
exit 43'''

DISCARD = r'''rm -f -- "$1"'''

ISDIR = r'''p="$1"
[ -e "$p" ] || exit 44
[ -d "$p" ] || exit 42
[ -x "$p" ] || exit 43'''

TAR_OUT = r'''p="$1"
[ -e "$p" ] || exit 44
[ -d "$p" ] || exit 42
[ -r "$p" ] && [ -x "$p" ] || exit 43
exec tar -C "$p" -cf - .'''

TAR_IN = r'''p="$1"; d="$p"
[ -e "$p" ] && [ ! -d "$p" ] && exit 42
[ -d "$p" ] && { [ -w "$p" ] && [ -x "$p" ] || exit 43; }''' + MKPARENT + r'''
exec tar -C "$p" -xf - --no-same-owner'''

# One record per entry: "type size mode mtime" NUL name NUL (names may hold any byte but NUL and '/').
FIND_FMT = r"%y %s %m %T@\0%f\0"
LIST = r'''p="$1"
[ -e "$p" ] || exit 44
[ -d "$p" ] || exit 42
[ -r "$p" ] && [ -x "$p" ] || exit 43
exec find -H "$p" -mindepth 1 -maxdepth 1 -printf "$2"'''

STAT = r'''p="$1"
[ -e "$p" ] || [ -L "$p" ] || exit 44
exec find -H "$p" -maxdepth 0 -printf "$2"'''

# Refused before anything is removed: /, /home, a home directory, a mount point or a folder holding one (45), and
# anything rm could only remove in part (43): the parent must be writable (and, if sticky, ours), every folder
# inside readable, writable and searchable. The path is resolved (a symlink itself is removed, not its target).
REMOVE = r'''p="$1"
[ -e "$p" ] || [ -L "$p" ] || exit 44
pd=$(readlink -f -- "$(dirname -- "$p")") || exit 44
if [ -L "$p" ]; then r="${pd%/}/$(basename -- "$p")"
else r=$(readlink -f -- "$p") || exit 44; pd=$(dirname -- "$r"); fi
case "$r" in /|/home|/home/user|/root) exit 45;; esac
if [ ! -L "$p" ]; then
  awk -v r="$r" '{ m = $5; gsub(/\\040/, " ", m); if (m == r || index(m, r "/") == 1) { f = 1; exit } }
                 END { exit !f }' /proc/self/mountinfo && exit 45
fi
[ -w "$pd" ] && [ -x "$pd" ] || exit 43
u=$(id -u)
if [ "$u" != 0 ] && [ -k "$pd" ] && [ "$(stat -c %u -- "$pd")" != "$u" ] && [ "$(stat -c %u -- "$r")" != "$u" ]; then
  exit 43
fi
if [ -d "$p" ] && [ ! -L "$p" ]; then
  bad=$(find "$p" -type d \( ! -readable -o ! -writable -o ! -executable \) -print -quit 2>&1) || exit 43
  [ -z "$bad" ] || exit 43
fi
rm -rf -- "$p" 2>/dev/null
[ -e "$p" ] || [ -L "$p" ] || exit 0
exit 43'''
