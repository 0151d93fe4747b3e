"""Docker inside a sandbox, as an agent uses it (issue 17): ``apt-get install docker.io`` as root (the sandbox's
apt uses the host's mirror configuration, written into the image by the recipe), ``docker import`` of a rootfs
tarball made from the sandbox's own binaries, ``docker run`` printing from inside the nested container. It runs
under the shifted uid map: dockerd sees delegated cgroups and overlayfs works in the user namespace."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

# A tiny image: dash and cat with the libraries ldd lists, tarred from the sandbox itself (no registry needed).
MAKE_TARBALL = r"""
set -e
rm -rf /tmp/tiny && mkdir -p /tmp/tiny/bin
cp /bin/dash /tmp/tiny/bin/sh
cp /bin/cat /bin/echo /tmp/tiny/bin/
for lib in $( (ldd /bin/dash; ldd /bin/cat; ldd /bin/echo) | grep -o '/lib[^ ]*' | sort -u); do
  cp --parents "$lib" /tmp/tiny/
done
tar -C /tmp/tiny -cf /tmp/tiny.tar .
"""


def _root(server: Any, sid: str, script: str, timeout: int = 900) -> Any:
    return server.sbx("exec", sid, "-u", "root", "--timeout", str(timeout), "--", script, timeout=timeout + 60)


def test_docker_install_import_and_run(server: Any) -> None:
    r = server.sbx("new", "--type", "default", "--json", check=True)
    sid = json.loads(r.stdout)["sandbox"]["id"]
    try:
        r = _root(server, sid, "export DEBIAN_FRONTEND=noninteractive; apt-get update -q && apt-get install -y -q "
                               "docker.io >/tmp/apt.log 2>&1 || { tail -20 /tmp/apt.log; exit 1; }")
        assert r.returncode == 0, r.stdout + r.stderr
        r = _root(server, sid, "for i in $(seq 120); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done; "
                               "systemctl status docker --no-pager; exit 1", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        r = _root(server, sid, MAKE_TARBALL + "docker import /tmp/tiny.tar tiny:1 >/dev/null", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        r = _root(server, sid, "docker run --rm tiny:1 /bin/sh -c 'echo hello from docker $((6*7))'", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == "hello from docker 42"
        # a file a nested container writes into a bind mount lands in the sandbox as the sandbox's root
        r = _root(server, sid, "mkdir -p /srv/out && docker run --rm -v /srv/out:/out tiny:1 /bin/sh -c "
                               "'echo written > /out/f' && stat -c '%u %n' /srv/out/f && cat /srv/out/f", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.split("\n")[:2] == ["0 /srv/out/f", "written"]
        # and the user `user` reaches docker through sudo, as an agent would
        r = server.sbx("exec", sid, "--timeout", "300", "--", "sudo docker images --format '{{.Repository}}'",
                       timeout=400)
        assert r.returncode == 0 and "tiny" in r.stdout, r.stdout + r.stderr
    finally:
        server.sbx("delete", sid, "--wait")
