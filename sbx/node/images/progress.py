"""A build or an import answered as NDJSON while it runs: ``{"progress": line}`` for each line it reports, then one
final line (its result, or its error). Used by the API's image routes (:mod:`sbx.api.images_api`) and the node's
(:mod:`sbx.node.remote.imagelink`), which differ only in what the final line says."""

from __future__ import annotations

import json
import queue
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Progress = Callable[[str], None]

#: Longest progress line sent (characters); a longer one is cut.
LINE_MAX = 2000


def ndjson_progress(work: Path, run: Callable[[Progress], T], done: Callable[[T], dict[str, Any]],
                    failed: Callable[[Exception], dict[str, Any]]) -> Iterator[bytes]:
    """Run ``run(progress)`` in a thread and yield its progress lines, then ``done(result)`` or ``failed(error)``,
    each as one JSON line (bytes). ``work`` (the upload the run used) is removed when it ends, however it ends. A
    client that stops reading does not stop the run: it finishes, and its result is kept (a built image stays)."""
    lines: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def worker() -> None:
        try:
            result = run(lambda msg: lines.put({"progress": str(msg)[:LINE_MAX]}))
            lines.put(done(result))
        except Exception as e:  # the stream has begun: the error goes in it
            lines.put(failed(e))
        finally:
            shutil.rmtree(work, ignore_errors=True)
            lines.put(None)

    threading.Thread(target=worker, name="image-progress", daemon=True).start()
    while (item := lines.get()) is not None:
        yield (json.dumps(item) + "\n").encode()
