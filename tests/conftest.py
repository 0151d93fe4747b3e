"""Settings for every test run.

pytest-xdist's workers inherit ``COLUMNS=80`` from execnet, which makes the CLI lay tables out for 80 columns
(sbx/cli/common.py lets ``COLUMNS`` win over its wide piped layout); a worker drops it so the CLI behaves as
it does under a plain run and for a user piping its output.
"""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)
