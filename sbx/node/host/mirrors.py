"""Package registries the host is configured to use, read at run time, for image builds' ``RUN`` steps.

sbx names no registry itself: a build gets the host's choices as build arguments a Dockerfile may declare (``ARG
NPM_CONFIG_REGISTRY``): npm reads ``NPM_CONFIG_REGISTRY`` from its environment. Debian's mirror reaches builds through
the images' own apt sources (:mod:`sbx.node.host.aptsources`).
"""

from __future__ import annotations

import shutil
import subprocess


def build_args() -> dict[str, str]:
    """``{"NPM_CONFIG_REGISTRY": <the host's npm registry URL>}`` when npm is installed and answers (within 10 s),
    else ``{}``."""
    npm = shutil.which("npm")
    if npm is None:
        return {}
    try:
        p = subprocess.run([npm, "config", "get", "registry"], capture_output=True, text=True, timeout=10,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    url = p.stdout.strip()
    return {"NPM_CONFIG_REGISTRY": url} if p.returncode == 0 and url.startswith(("http://", "https://")) else {}
