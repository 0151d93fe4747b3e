"""A real S3 server for tests: moto's server mode (``moto_server``) on loopback, in its own process so a test can
kill it (``kill()``) and start it again (``start()``) on the same port. Its buckets live in memory: a restart
empties them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

ACCESS_KEY = "sbxtest"
SECRET_KEY = "sbxtestsecret"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``moto_server`` at ``endpoint`` (``http://127.0.0.1:PORT``, or ``host`` when given, e.g. an address nodes
    in other network namespaces reach)."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, auth: bool = False):
        self.host = host
        self.port = port or _free_port()
        self.auth = auth
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> S3Server:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        if self.auth:  # requests are signed and checked against its IAM users, after the 3 calls of make_user
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(self.endpoint + "/moto-api/", timeout=2)
                return self
            except httpx.HTTPError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moto_server exited with {self.proc.returncode}") from None
                time.sleep(0.2)
        raise RuntimeError("moto_server did not answer within 60 s")

    def kill(self) -> None:
        """SIGKILL the server (its objects are gone with it)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def make_user(self) -> tuple[str, str]:
        """With ``auth``: an IAM user allowed everything; its ``(access key id, secret key)``. Call it first."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                           aws_secret_access_key=SECRET_KEY)
        iam.create_user(UserName="sbx")
        iam.put_user_policy(UserName="sbx", PolicyName="all", PolicyDocument='{"Version": "2012-10-17", "Statement": '
                            '[{"Effect": "Allow", "Action": "*", "Resource": "*"}]}')
        key = iam.create_access_key(UserName="sbx")["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def make_bucket(self, name: str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=access_key,
                     aws_secret_access_key=secret_key).create_bucket(Bucket=name)


@contextmanager
def s3_server(bucket: str) -> Iterator[S3Server]:
    """A started :class:`S3Server` holding an empty ``bucket``, killed on exit."""
    srv = S3Server().start()
    try:
        srv.make_bucket(bucket)
        yield srv
    finally:
        srv.kill()
