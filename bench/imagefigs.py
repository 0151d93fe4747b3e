"""The ``images`` figure (issue 32): how long a small Dockerfile takes to build, uncached and cached, and create →
first exec from a user image next to the default image in the same run (issue 32's goal: equal within 10 % once the
image's memory template exists).

The Dockerfile is ``FROM sbx-debian`` (sbx's own image as a base), one ``RUN`` writing a file and one ``ENV``: the
build's fixed costs (buildah in a fresh store, the sbx layer, the ext4 image), no package download. Each uncached
build writes a different nonce, so nothing is reused; the cached build sends the same inputs again under another
name. An untimed first build makes the ``sbx-debian`` base archive (once per recipe).
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from pathlib import Path

from bench.context import TTL, Ctx, check, delete, new, since, tracked
from bench.memfigs import wait_template, wait_warm
from bench.registry import figure
from bench.report import Anchor, Row
from sbx.sdk import images as I
from sbx.sdk.client import Sandbox

DOCKERFILE = "FROM sbx-debian\nRUN echo {nonce} > /etc/bench-nonce\nENV BENCH_IMAGE=1\n"
TEMPLATE_WAIT = 600.0


def _build(ctx: Ctx, name: str, nonce: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="bench-image-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(DOCKERFILE.format(nonce=nonce))
        return dict(ctx.sdk.run(I.build_image(name, I.tar_folder(tmp))))


def _wait_image_template(node_dir: Path, key: str, size: str = "small") -> None:
    meta = node_dir / "templates" / f"{key}-{size}" / "template.json"
    deadline = time.monotonic() + TEMPLATE_WAIT
    while not meta.is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the image's {size} memory template was not built within {TEMPLATE_WAIT:.0f} s")
        time.sleep(0.5)


def _started_from(node_dir: Path, sid: str) -> str:
    """How the node started sandbox ``sid`` (``pool``, ``template`` or ``boot``: its record's ``startedFrom``)."""
    try:
        return str(json.loads((node_dir / "sandboxes" / sid / "node.json").read_text()).get("startedFrom", "?"))
    except (OSError, ValueError):
        return "?"


def _count(kinds: list[str]) -> str:
    return ", ".join(f"{k} ×{kinds.count(k)}" for k in sorted(set(kinds))) or "-"


@figure("images", order=170)
def fig_images(ctx: Ctx) -> list[Row]:
    """``images``: ``min(repeats, 3)`` uncached and cached builds of a small Dockerfile through the SDK, then
    ``repeats`` creates → first ``exec("true")`` alternating between a user image and the default image, once each
    has its small memory template and warm sandboxes (a user image's pool starts with its first create from the
    template), as a running installation has them. The notes say where each create came from."""
    names: list[str] = []
    uncached: list[float] = []
    cached: list[float] = []
    run = secrets.token_hex(4)
    try:
        names.append(f"bench-{run}-warm")
        _build(ctx, names[-1], f"{run}-warm")  # untimed: the sbx-debian archive, buildah's first start
        built: dict[str, object] = {}
        for i in range(min(ctx.repeats, 3)):
            names.append(f"bench-{run}-{i}")
            t0 = time.perf_counter()
            img = _build(ctx, names[-1], f"{run}-{i}")
            uncached.append(since(t0))
            built = built or img
            names.append(f"bench-{run}-{i}-again")
            t0 = time.perf_counter()
            again = _build(ctx, names[-1], f"{run}-{i}")
            cached.append(since(t0))
            check(again["digest"] == img["digest"], "a cached build gave another digest")
        image, key = names[1], str(built["digest"]).removeprefix("sha256:")  # the first timed build's
        img_times: list[float] = []
        default_times: list[float] = []
        origin: dict[str, list[str]] = {"default": [], "image": []}
        with tracked(ctx) as ids:
            first = new(ctx, ids, "small", "bench-images-default-first")  # the default's template, as in `create`
            delete(ctx, first.id)
            ids.discard(first.id)
            wait_template(ctx.srv.settings.node_dir)
            sb = Sandbox.create(type="small", name="bench-images-first", ttl=TTL, image=image, client=ctx.sdk)
            ids.add(sb.id)
            delete(ctx, sb.id)
            ids.discard(sb.id)
            _wait_image_template(ctx.srv.settings.node_dir, key)
            if ctx.srv.settings.warm_pool > 0:  # a create from the template starts the image's warm sandboxes
                sb = Sandbox.create(type="small", name="bench-images-second", ttl=TTL, image=image, client=ctx.sdk)
                ids.add(sb.id)
                delete(ctx, sb.id)
                ids.discard(sb.id)
                wait_warm(ctx.srv.settings.node_dir, type=f"small@{key}", count=ctx.srv.settings.warm_pool)
                wait_warm(ctx.srv.settings.node_dir, count=ctx.srv.settings.warm_pool)
            for i in range(ctx.repeats):
                for kind, out in (("default", default_times), ("image", img_times)):
                    t0 = time.perf_counter()
                    if kind == "image":
                        sb = Sandbox.create(type="small", name=f"bench-images-{i}", ttl=TTL, image=image,
                                            client=ctx.sdk)
                        ids.add(sb.id)
                    else:
                        sb = new(ctx, ids, "small", f"bench-images-default-{i}")
                    r = sb.exec("true")
                    out.append(since(t0))
                    origin[kind].append(_started_from(ctx.srv.settings.node_dir, sb.id))
                    check(r.exit_code == 0, f"first exec in {sb.id} exited {r.exit_code}")
                    check(kind == "default" or sb.data.get("image") == image,
                          f"{sb.id} is not of image {image}")
                    delete(ctx, sb.id)
                    ids.discard(sb.id)
    finally:
        for name in names:
            try:
                ctx.sdk.run(I.delete_image(name))
            except Exception:  # noqa: BLE001 (a build that failed left no image)
                pass
    med = sorted(default_times)[len(default_times) // 2]
    ratio = sorted(img_times)[len(img_times) // 2] / med if med else 0.0
    goal = Anchor(med * 1.10, "default +10 %", "issue 32 goal: create → exec from a user image within 10 % of the "
                  "default image's, same run")
    return [
        Row("images", "build a small Dockerfile (FROM sbx-debian, RUN, ENV), uncached", "s", uncached),
        Row("images", "the same build again (cached: same inputs, another name)", "s", cached),
        Row("images", "create small from a user image → first exec", "s", img_times, anchor=goal,
            note=f"{ratio:.2f}× the default's median; started from: {_count(origin['image'])}"),
        Row("images", "create small, default image → first exec (same run)", "s", default_times,
            note=f"started from: {_count(origin['default'])}"),
    ]
