"""``buildah bud`` for a Dockerfile build: a fresh store per build, RUN steps in an OCI container on a shifted uid
range, its output streamed, its failures turned into :class:`~sbx.node.images.errors.ImageError` codes.

The command: ``buildah --root <work>/store --runroot <work>/run --storage-driver vfs bud --isolation oci --runtime
runc --userns-uid-map 0:<base>:65536 --userns-gid-map 0:<base>:65536 --network none|host --memory 4g --cgroup-parent
/sbx/<node>/build-<id> --layers=false``. RUN steps run in a cgroup below the node's own (its limits hold them too);
without ``--cgroup-parent`` buildah put them at the hierarchy's root and its ``--memory`` was not applied. A store
per build because a store that has held one uid map fails (EACCES) under another; vfs because it needs no mounts
that could outlive a killed build (each step copies the rootfs: a few seconds for a 170 MB base). With a build network
buildah runs inside the network namespace (``nsenter --net=<path>``) with ``--network host``: ``--network ns:<path>``
fails here with a user namespace (runc can't mount sysfs for a network namespace its user namespace does not own).
"""

from __future__ import annotations

import re
import subprocess
from collections import deque
from collections.abc import Callable
from pathlib import Path

from sbx.node.container import cgroup
from sbx.node.images.errors import ImageError

#: The tag of the built image in the build's own store.
BUILT = "localhost/sbx-build:latest"
#: Memory limit of each RUN step's container.
RUN_MEMORY = "4g"
#: Lines of a failed step's output quoted in the error.
TAIL_LINES = 12
_STEP = re.compile(r"^STEP (\d+)/(\d+): (.*)$")
_FAILED = re.compile(r'building at STEP "(.*?)": (.*)$')
_EXIT = re.compile(r"exit status (\d+)")


def store_args(work: Path) -> list[str]:
    """buildah's global options for the build's own store under ``work``."""
    return ["buildah", "--root", str(work / "store"), "--runroot", str(work / "run"), "--storage-driver", "vfs"]


def bud_argv(work: Path, dockerfile: Path, context: Path, uid_base: int, netns: str | None,
             dns: list[str], cgroup_parent: str, ca_file: str | None = None,
             build_args: dict[str, str] | None = None) -> list[str]:
    """The full command of the build (module docstring); ``cgroup_parent`` is the cgroup path RUN steps run in;
    ``ca_file`` a PEM bundle bound read-only over the image's CA bundle while RUN steps run
    (:attr:`sbx.config.Settings.build_ca_file`); ``build_args`` values for the Dockerfile's ``ARG`` s (the host's
    registries, :func:`sbx.node.host.mirrors.build_args`)."""
    m = f"0:{uid_base}:65536"
    ca = ["--volume", f"{ca_file}:/etc/ssl/certs/ca-certificates.crt:ro"] if ca_file else []
    ca += [a for k, v in sorted((build_args or {}).items()) for a in ("--build-arg", f"{k}={v}")]
    argv = [*store_args(work), "bud", "--isolation", "oci", "--runtime", "runc", "--userns-uid-map", m,
            "--userns-gid-map", m, *ca, "--network", "host" if netns else "none",
            *[a for d in dns for a in ("--dns", d)],
            "--memory", RUN_MEMORY, "--cgroup-parent", cgroup_parent, "--layers=false", "--format", "oci",
            "-f", str(dockerfile), "-t", BUILT, str(context)]
    return ["nsenter", f"--net={netns}", "--", *argv] if netns else argv


def classify(lines: list[str], code: int) -> ImageError:
    """The :class:`ImageError` of a failed ``buildah bud`` from its output ``lines`` and exit ``code``: a missing
    ``COPY``/``ADD`` source, an unknown instruction, a failed step (named ``step N/M INSTRUCTION: exit X`` with the last
    lines of its output), a missing base archive, or anything else."""
    step, total, instr, at = 0, 0, "", -1
    for i, line in enumerate(lines):
        m = _STEP.match(line)
        if m:
            step, total, instr, at = int(m.group(1)), int(m.group(2)), m.group(3), i
    errors = [line for line in lines if line.startswith("Error:") or "level=error" in line]
    err = errors[-1] if errors else (lines[-1] if lines else f"exit {code}")
    failed = _FAILED.search(err)
    if "Unknown instruction" in err or "unknown instruction" in err:
        return ImageError("bad_dockerfile", err.removeprefix("Error: ").split(" &imagebuilder")[0])
    if failed and "checking on sources" in failed.group(2) and "no such file or directory" in failed.group(2):
        return ImageError("copy_source_missing", f"step {step}/{total} {failed.group(1)}: a source is not in the "
                                                 f"build context ({failed.group(2).split(': ')[-2]})")
    if "creating build container" in err and "no such file" in err:
        return ImageError("bad_archive", f"step {step}/{total} {instr}: {err.removeprefix('Error: ')}")
    if failed or step:
        exit_m = _EXIT.search(err)
        status = f"exit {exit_m.group(1)}" if exit_m else err.removeprefix("Error: ")
        out = [line for line in lines[at + 1:] if line not in errors][-TAIL_LINES:]
        name = failed.group(1) if failed else instr
        detail = "".join(f"\n  {o}" for o in out)
        return ImageError("build_step_failed", f"step {step}/{total} {name}: {status}{detail}")
    return ImageError("image_build_failed", f"buildah bud failed (exit {code}): {err}")


def bud(work: Path, dockerfile: Path, context: Path, uid_base: int, netns: str | None, dns: list[str],
        cgroup_parent: str, say: Callable[[str], None], ca_file: str | None = None,
        build_args: dict[str, str] | None = None) -> None:
    """Run the build (``work``: its scratch folder; the result is :data:`BUILT` in the store there) with its RUN
    steps in cgroup ``cgroup_parent`` (removed after, whatever is left of it); ``say`` gets every output line.
    Raises :class:`ImageError` (:func:`classify`)."""
    argv = bud_argv(work, dockerfile, context, uid_base, netns, dns, cgroup_parent, ca_file, build_args)
    lines: deque[str] = deque(maxlen=400)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", cwd=work)
    except FileNotFoundError as e:
        raise ImageError("image_build_failed", "buildah is not installed (run `sbx setup`)") from e
    assert proc.stdout is not None
    try:
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            say(line)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cgroup.kill_all(cgroup_parent)
        cgroup.remove_tree(cgroup_parent)
    if code != 0:
        raise classify(list(lines), code)


def push(work: Path, layout: Path, tag: str) -> None:
    """Copy the built image into the OCI layout ``layout`` under ``tag`` (``buildah push``). Raises
    ``ImageError("image_build_failed")``."""
    proc = subprocess.run([*store_args(work), "push", "--quiet", BUILT, f"oci:{layout}:{tag}"], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise ImageError("image_build_failed", f"buildah push failed: {(proc.stderr or proc.stdout)[-1500:]}")


def clean(work: Path) -> None:
    """Remove the build's containers and images from its store (best effort; the folder goes after)."""
    for argv in (["rm", "--all"], ["rmi", "--all", "--force"]):
        subprocess.run([*store_args(work), *argv], capture_output=True, stdin=subprocess.DEVNULL, check=False)
