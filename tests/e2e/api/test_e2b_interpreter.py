"""Issue 31 end to end: E2B's ``e2b-code-interpreter`` SDK (pinned, unmodified) runs code in a real sandbox of the
``images/code-interpreter`` image, built as its README says under the SDK's default template name. Its calls reach
the image's server on port 49999 through ``E2B_SANDBOX_URL`` with ``E2b-Sandbox-Port: 49999``
(:mod:`sbx.api.e2b.ports`): cells with their value, streamed output, errors and a figure; per-cell environment
variables; a DataFrame's columns; contexts; a cell past its timeout interrupted while the kernel keeps its state; a
pause and a connect that keep the kernel's variables."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.api.test_e2b_sdk import e2b_env  # noqa: F401  (a fixture: the SDK's URLs and key)
from tests.e2e.conftest import Server

pytest.importorskip("e2b_code_interpreter")

pytestmark = pytest.mark.e2e

RECIPE = Path(__file__).resolve().parents[3] / "images" / "code-interpreter"
TEMPLATE = "code-interpreter-v1"  # the SDK's default template


@pytest.fixture
def interpreter(e2b_env: Server) -> Iterator[Server]:  # noqa: F811 (the fixture imported above)
    """The image built under the SDK's default template name, and the SDK's three variables."""
    server = e2b_env
    server.sbx("image", "build", str(RECIPE), "--name", TEMPLATE, timeout=1500, check=True)
    yield server
    deadline = time.monotonic() + 60  # a killed sandbox holds the image until its deletion ends
    while server.sbx("image", "delete", TEMPLATE).returncode != 0 and time.monotonic() < deadline:
        time.sleep(1)


def test_run_code_through_the_e2b_code_interpreter_sdk(interpreter: Server) -> None:
    from e2b import TimeoutException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=600)
    try:
        streamed: list[str] = []
        ex = sbx.run_code("x = 21\nprint('hello')\nx * 2", on_stdout=lambda m: streamed.append(m.line))
        assert ex.error is None, ex.error
        assert ex.text == "42" and ex.logs.stdout == ["hello\n"] and streamed == ["hello\n"]
        assert ex.execution_count is not None and ex.execution_count >= 1

        ex = sbx.run_code("import sys\nprint('to err', file=sys.stderr)\n1 / 0")
        assert ex.logs.stderr == ["to err\n"]
        assert ex.error is not None and (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")

        ex = sbx.run_code("import os\nos.environ.get('FOO'), os.getuid()", envs={"FOO": "bar"})
        assert ex.text == "('bar', 0)"  # the cell's own variable; cells run as root, as on E2B
        assert sbx.run_code("os.environ.get('FOO')").text is None  # ... for that cell only: None shows nothing

        ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
        assert ex.error is None, ex.error
        assert any(r.png for r in ex.results), [r.formats() for r in ex.results]

        ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2, 3]})")
        assert ex.results[0].data == {"a": [1, 2, 3]} and "<table" in ex.results[0].html

        ctx = sbx.create_code_context(cwd="/tmp")
        assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "/tmp"  # a string reads unquoted
        assert sbx.run_code("x", context=ctx).error.name == "NameError"  # a context has its own variables
        assert ctx.id in [c.id for c in sbx.list_code_contexts()]
        sbx.remove_code_context(ctx)
        assert ctx.id not in [c.id for c in sbx.list_code_contexts()]

        with pytest.raises(TimeoutException):
            sbx.run_code("import time\ntime.sleep(60)", timeout=3)
        assert sbx.run_code("x").text == "21"  # the cell was interrupted; the kernel kept its state

        sbx.pause()
        again = Sandbox.connect(sbx.sandbox_id)
        ex = again.run_code("x + 1")
        why = interpreter.sbx("info", sbx.sandbox_id, "--json").stdout  # memorySaved, stopError, memoryRestored
        assert ex.text == "22", (ex.error, why)  # the kernel's memory came back with the sandbox's
    finally:
        sbx.kill()
