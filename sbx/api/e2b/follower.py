"""The shell programs that follow an E2B process's job (:mod:`sbx.api.e2b.procs`): run as root through an attached
exec, they find the job's folder (by its id, by the nonce its command carries, or by claiming a ready job:
:mod:`sbx.api.e2b.pool`), print its pid line, then its output, and exit with its exit code."""

from __future__ import annotations

import shlex

JOBS_DIR = "/var/lib/sbx-jobs"
NONCE_MARK = "# sbx-e2b-started-by:"
"""The comment line of a job's command that names the nonce of the ``Start`` that made it."""
START_WAIT = 120.0
"""Seconds a follower waits for the job it was started for (and the server for that job's start)."""
NAP = "if [ $i -lt 25 ]; then sleep 0.001; else sleep 0.005; fi"
"""The wait between two polls of a loop counting in ``i``: 1 ms for the first 25, then 5 ms (each is a ``sleep``
process)."""
WATCH_NAP = "if [ $i -lt 25 ]; then sleep 0.001; elif [ $i -lt 125 ]; then sleep 0.005; else sleep 0.03; fi"
"""The wait between two polls for a job's end: 1 ms at first, 5 ms after 25 ms, 30 ms after 0.5 s."""
QUICK_POLLS = 15
"""Polls 1 ms apart (some 30 ms in all) for a quick job's end before its output is streamed: a job that ends by
then has it printed at once (output is at most that late)."""
TAIL_POLL = 0.01
"""Seconds between two checks by ``tail -f`` that the job has ended (it sees new output at once, by inotify)."""

def _locate(nonce: str) -> str:
    """Shell setting ``d`` to the folder of the job whose command carries ``nonce`` (a job started at most 10 s
    ago), polling every 5 ms for 2 s, then every 50 ms up to :data:`START_WAIT`; ``none`` and exit 0 when none
    appears."""
    return (
        f'n={shlex.quote(NONCE_MARK + nonce)}; m=$(mktemp) && touch -d "-10 seconds" "$m" || exit 1; d=; i=0\n'
        'while :; do\n'
        f'  for f in {JOBS_DIR}/job_*/cmd; do\n'
        '    [ "$f" -nt "$m" ] || continue; c=; IFS= read -r -d "" c < "$f"\n'
        '    case "$c" in *"$n"*) d=${f%/cmd}; break;; esac\n'
        '  done\n'
        '  [ -n "$d" ] && break; i=$((i+1))\n'
        f'  if [ $i -gt {400 + int(START_WAIT * 20)} ]; then rm -f "$m"; echo none; exit 0; fi\n'
        '  if [ $i -gt 400 ]; then sleep 0.05; else sleep 0.005; fi\n'
        'done; rm -f "$m"\n'
    )


def follower_script(job: str, from_now: bool, nonce: str | None = None, locate: str | None = None) -> str:
    """The root command that prints job ``job``'s pid line (``<pid> <job>``), then its output (stdout to stdout,
    stderr to stderr; from the start, or from what is there now with ``from_now``) until it ends, and exits with
    its exit code. A first line that is not a number means there is no such job. The output of a job that ends
    within :data:`QUICK_POLLS` polls is printed at once; a longer one's is streamed by ``tail -f`` as the job
    writes it, and its end noticed within some 10 ms (:data:`WATCH_NAP`, :data:`TAIL_POLL`). With ``nonce``
    (``job`` unused) the job is found by the nonce its command carries (:func:`sbx.api.e2b.procs.job_command`): the
    follower may start before the job does. With ``locate``, that shell finds the job (it sets ``d``, its
    folder)."""
    where = locate or (_locate(nonce) if nonce else f'd={shlex.quote(f"{JOBS_DIR}/{job}")}; ')
    start = ('o=$(stat -c %s "$d/stdout" 2>/dev/null || echo 0); e=$(stat -c %s "$d/stderr")' if from_now
             else 'o=0; e=$(( ${#p} + 1 ))')
    return (
        f'{where}[ -d "$d" ] || {{ echo none; exit 0; }}\n'
        'i=0; until { IFS= read -r p < "$d/stderr"; } 2>/dev/null && [ -n "$p" ]; do\n'
        '  i=$((i+1)); if [ $i -gt 2000 ] || [ -e "$d/exit" ]; then p=0; break; fi; ' + NAP + '; done\n'
        'printf "%s %s\\n" "$p" "${d##*/}"\n'
        f'{start}\n'
        f'i=0; while [ ! -s "$d/exit" ] && [ $i -lt {QUICK_POLLS} ]; do i=$((i+1)); sleep 0.001; done\n'
        'if [ -s "$d/exit" ]; then tail -c +$((o+1)) "$d/stdout"; tail -c +$((e+1)) "$d/stderr" >&2; '
        'x=; IFS= read -r x < "$d/exit"; exit "${x:-1}"; fi\n'
        f'( i=0; while [ ! -s "$d/exit" ]; do i=$((i+1)); {WATCH_NAP}; done ) & w=$!\n'
        f'tail -s {TAIL_POLL} --pid=$w -c +$((o+1)) -f "$d/stdout" & a=$!\n'
        f'tail -s {TAIL_POLL} --pid=$w -c +$((e+1)) -f "$d/stderr" >&2 & b=$!\n'
        'wait $a $b; x=; IFS= read -r x < "$d/exit"; exit "${x:-1}"'
    )
