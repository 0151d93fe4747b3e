"""``sbx image``: the images sandboxes start from.

::

    sbx image build [CONTEXT] -f Dockerfile --name NAME [--shared]   build from a Dockerfile (progress on stderr)
    sbx image import ARCHIVE --name NAME [--shared]                  docker save / OCI archive or layout / rootfs tar
    sbx image list | show NAME | delete NAME
    sbx new --image NAME                                              a sandbox of it
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import typer

from sbx.cli.common import JSON_OPT, client, err, fail, handle_errors, out, print_json, print_table
from sbx.sdk import images as I

app = typer.Typer(help="Images sandboxes start from: build from a Dockerfile, import an OCI or docker archive.",
                  no_args_is_help=True)

NAME_HELP = "The image's name (a lower-case letter or digit, then up to 62 of a-z, 0-9, '.', '_', '-')."


def _say(quiet: bool) -> Any:
    if quiet:
        return None
    return lambda line: err.print(line, markup=False, highlight=False)


def _show(img: dict[str, Any], json_: bool) -> None:
    if json_:
        print_json({"image": img})
        return
    out.print(f"{img['name']} {img['digest'][:19]} {_mib(img['sizeBytes'])} {img['os'] or '-'} "
              f"(init: {img['init']})", markup=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@app.command("build")
@handle_errors
def build(
    context: Path = typer.Argument(Path("."), help="The build context folder (default: the current folder)."),
    file: Path = typer.Option(None, "--file", "-f", help="The Dockerfile (default: CONTEXT/Dockerfile)."),
    name: str = typer.Option(..., "--name", "-n", help=NAME_HELP),
    shared: bool = typer.Option(False, "--shared", help="Every account may use it (admin key only)."),
    json_: bool = JSON_OPT,
) -> None:
    """Build an image from a Dockerfile. Steps stream to stderr; FROM may name an image of yours
    (`sbx image list`) or an oci-archive:/docker-archive: path on the server."""
    if not context.is_dir():
        raise fail("bad_context", f"{context} is not a folder")
    dockerfile = file if file is not None else context / "Dockerfile"
    if not dockerfile.is_file():
        raise fail("dockerfile_missing", f"no Dockerfile at {dockerfile}")
    body = I.tar_folder(context, extra={".sbx-Dockerfile": dockerfile})  # the Dockerfile may live elsewhere
    with client() as c:
        img = c.run(I.build_image(name, body, dockerfile=".sbx-Dockerfile", shared=shared,
                                  on_progress=_say(json_)))
    _show(img, json_)


@app.command("import")
@handle_errors
def import_(
    archive: Path = typer.Argument(..., help="A `docker save` or OCI archive, an OCI layout folder, or a flat root "
                                   "filesystem tar (`docker export`)."),
    name: str = typer.Option(..., "--name", "-n", help=NAME_HELP),
    shared: bool = typer.Option(False, "--shared", help="Every account may use it (admin key only)."),
    json_: bool = JSON_OPT,
) -> None:
    """Import an image from an archive or an OCI layout folder (sent as an OCI archive)."""
    if archive.is_dir():
        body: IO[bytes] = I.tar_folder(archive)
    elif archive.is_file():
        body = open(archive, "rb")  # noqa: SIM115 (closed below)
    else:
        raise fail("bad_archive", f"{archive} does not exist")
    try:
        with client() as c:
            img = c.run(I.import_image(name, body, shared=shared, on_progress=_say(json_)))
    finally:
        body.close()
    _show(img, json_)


@app.command("list")
@handle_errors
def list_(json_: bool = JSON_OPT) -> None:
    """Your images and the shared ones."""
    with client() as c:
        items = c.run(I.images())
    if json_:
        print_json({"images": items})
        return
    print_table(("NAME", "OS", "INIT", "SIZE", "SHARED", "CREATED"),
                ((i["name"], i["os"] or "-", i["init"], _mib(i["sizeBytes"]), "yes" if i["shared"] else "-",
                  i["createdAt"] or "-") for i in items))


@app.command("show")
@handle_errors
def show(name: str = typer.Argument(..., help="Image name."), json_: bool = JSON_OPT) -> None:
    """One image: OS, init, user, workdir, env."""
    with client() as c:
        img = c.run(I.image(name))
    if json_:
        print_json({"image": img})
        return
    for k in ("name", "digest", "os", "init", "shell", "user", "workdir", "source", "node", "createdAt"):
        out.print(f"{k}: {img.get(k) if img.get(k) is not None else '-'}", markup=False)
    out.print(f"size: {_mib(img['sizeBytes'])}", markup=False)
    for k, v in sorted(img["env"].items()):
        out.print(f"env: {k}={v}", markup=False)


@app.command("delete")
@handle_errors
def delete(name: str = typer.Argument(..., help="Image name.")) -> None:
    """Delete an image (refused while a sandbox made from it is not deleted)."""
    with client() as c:
        c.run(I.delete_image(name))
