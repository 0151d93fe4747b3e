"""Storage benchmark: reflink clone and seal time of a 1 GiB vs a 20 GiB disk.

Reflink copies share extents instead of copying data, so clone and seal time should not grow with the disk's
size; the table's last column (median at the largest size / median at the smallest) shows whether that holds.

Each disk is a sparse ext4 image (``mkfs.ext4``) loop-mounted and filled with ``fill_fraction`` of its size in
random data. Per size, median / min / max of ``repeats`` runs (milliseconds) of:

- ``reflink``: :func:`sbx.storage.reflink.clone` of the unmounted disk (FICLONE alone);
- ``clone_disk``: :func:`sbx.storage.disk.clone_disk` of the unmounted disk (reflink + new filesystem UUID);
- ``fork_mounted``: ``clone_disk`` of the mounted disk (fsfreeze + reflink + thaw + new UUID);
- ``seal_1mib``: :func:`sbx.storage.seals_mod.seal` of the mounted disk right after 1 MiB was written and fsynced.

Run: ``python -m bench.storage [--home DIR] [--sizes 1,20] [--repeats 5] [--fill-fraction 0.25] [--json]``
(root; works in ``<volume>/nodes/<node>/sbx-bench-storage`` and removes it afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from sbx.config import Settings, load_settings
from sbx.storage import disk, reflink, volume
from sbx.storage import seals as seals_mod

MiB = 1024 * 1024
GiB = 1024 * MiB
OPS = ["reflink", "clone_disk", "fork_mounted", "seal_1mib"]


def _fill(directory: Path, nbytes: int) -> None:
    """Write ``nbytes`` of incompressible data as 256 MiB files (a fresh random 1 MiB block per MiB would be
    slow; a random block with a per-MiB counter is just as unshareable)."""
    block = bytearray(os.urandom(MiB))
    written, n = 0, 0
    while written < nbytes:
        with open(directory / f"fill-{n:04d}.bin", "wb") as f:
            part = 0
            while part < 256 * MiB and written < nbytes:
                block[:8] = written.to_bytes(8, "little")
                f.write(block)
                part += MiB
                written += MiB
            f.flush()
            os.fsync(f.fileno())
        n += 1


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def _stats(op: str, size_gib: int, fill_mib: int, ms: list[float]) -> dict[str, Any]:
    return {
        "op": op,
        "size_gib": size_gib,
        "data_mib": fill_mib,
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
    }


def _bench_size(work: Path, mnt: Path, size_gib: int, repeats: int, fill_fraction: float) -> list[dict[str, Any]]:
    img = work / f"disk-{size_gib}g.ext4"
    with open(img, "wb") as f:
        f.truncate(size_gib * GiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    fill_mib = int(size_gib * 1024 * fill_fraction)
    disk.mount(img, mnt)
    try:
        _fill(mnt, fill_mib * MiB)
    finally:
        disk.umount(mnt)
    rows = []

    ms = []
    for i in range(repeats):
        dst = work / f"reflink-{i}.ext4"
        ms.append(_timed(partial(reflink.clone, img, dst)))
        dst.unlink()
    rows.append(_stats("reflink", size_gib, fill_mib, ms))

    ms = []
    for i in range(repeats):
        dst = work / f"clone-{i}.ext4"
        ms.append(_timed(partial(disk.clone_disk, img, dst)))
        dst.unlink()
    rows.append(_stats("clone_disk", size_gib, fill_mib, ms))

    disk.mount(img, mnt)
    try:
        ms = []
        for i in range(repeats):
            dst = work / f"fork-{i}.ext4"
            ms.append(_timed(partial(disk.clone_disk, img, dst, mountpoint=mnt)))
            dst.unlink()
        rows.append(_stats("fork_mounted", size_gib, fill_mib, ms))

        ms = []
        seals = work / f"seals-{size_gib}g"
        target = mnt / "fill-0000.bin"
        for i in range(repeats):
            with open(target, "r+b") as f:  # change 1 MiB in place, at a different spot each time
                f.seek(i * 4 * MiB)
                f.write(os.urandom(MiB))
                f.flush()
                os.fsync(f.fileno())
            ms.append(_timed(lambda: seals_mod.seal(img, seals, mountpoint=mnt)))
        rows.append(_stats("seal_1mib", size_gib, fill_mib, ms))
    finally:
        disk.umount(mnt)
    for s in seals_mod.list_seals(seals):
        seals_mod.delete_seal(seals, s.seq)
    img.unlink()
    return rows


def run(
    settings: Settings, *, sizes_gib: tuple[int, ...] = (1, 20), repeats: int = 5, fill_fraction: float = 0.25
) -> list[dict[str, Any]]:
    """Run the benchmark on ``settings``' volume (made or mounted with ``ensure_volume``) and return one row
    per (op, size): ``{"op", "size_gib", "data_mib", "n", "median_ms", "min_ms", "max_ms"}``; rows of the
    largest size also carry ``"ratio"`` = their median / the smallest size's median for the same op.
    Needs about ``max(sizes_gib) * fill_fraction`` GiB free on the volume. Raises ``StorageError``."""
    volume.ensure_volume(settings)
    work = settings.node_dir / "sbx-bench-storage"
    mnt = settings.home / "mnt" / "sbx-bench-storage"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    mnt.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes_gib:
            rows += _bench_size(work, mnt, size, repeats, fill_fraction)
    finally:
        subprocess.run(["fsfreeze", "-u", str(mnt)], capture_output=True, check=False)
        disk.umount(mnt)
        shutil.rmtree(work, ignore_errors=True)
        try:
            mnt.rmdir()
        except OSError:
            pass
    lo, hi = min(sizes_gib), max(sizes_gib)
    if lo != hi:
        base = {r["op"]: r["median_ms"] for r in rows if r["size_gib"] == lo}
        for r in rows:
            if r["size_gib"] == hi and base.get(r["op"]):
                r["ratio"] = round(r["median_ms"] / base[r["op"]], 2)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a plain-text table: one line per op, median (min-max) ms per size, then the ratio."""
    sizes = sorted({r["size_gib"] for r in rows})
    head = ["op"] + [f"{s} GiB ({next(r['data_mib'] for r in rows if r['size_gib'] == s)} MiB data)" for s in sizes]
    if len(sizes) > 1:
        head.append(f"ratio {sizes[-1]}G/{sizes[0]}G")
    lines = [head]
    for op in OPS:
        line = [op]
        ratio = ""
        for s in sizes:
            r = next((r for r in rows if r["op"] == op and r["size_gib"] == s), None)
            line.append(f"{r['median_ms']:.1f} ms ({r['min_ms']:.1f}-{r['max_ms']:.1f})" if r else "-")
            if r and "ratio" in r:
                ratio = f"{r['ratio']:.2f}"
        if len(sizes) > 1:
            line.append(ratio)
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.storage", description=__doc__.split("\n")[0])
    p.add_argument("--home", type=Path, help="sbx home holding the volume (default: from the sbx config)")
    p.add_argument("--sizes", default="1,20", help="disk sizes in GiB, comma-separated (default 1,20)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fill-fraction", type=float, default=0.25, help="share of each disk filled with data")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    a = p.parse_args(argv)
    settings = load_settings(**({"home": a.home} if a.home else {}))
    sizes = tuple(int(s) for s in a.sizes.split(","))
    rows = run(settings, sizes_gib=sizes, repeats=a.repeats, fill_fraction=a.fill_fraction)
    print(json.dumps(rows, indent=1) if a.json else format_table(rows))


if __name__ == "__main__":
    main()
