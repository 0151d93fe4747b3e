"""The seal object store (sbx.storage.objects): content-addressed, encrypted per account, checksummed on read, in a
local directory and in a real S3 server (moto's server mode on loopback, tests/s3server.py)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.storage import objects
from sbx.storage.errors import StorageError
from sbx.storage.objects import SealObjects, account_key, open_store
from tests.s3server import ACCESS_KEY, SECRET_KEY, S3Server, s3_server

MASTER = bytes(range(32))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server("seals") as srv:
        yield srv


def _s3_store(srv: S3Server, bucket: str = "seals") -> objects.ObjectStore:
    return open_store(f"s3://{bucket}/pre", srv.endpoint, "us-east-1", ACCESS_KEY, SECRET_KEY)


@pytest.fixture(params=["dir", "s3"])
def seals(request: pytest.FixtureRequest, tmp_path: Path) -> SealObjects:
    if request.param == "dir":
        store = open_store(f"file://{tmp_path / 'store'}")
    else:
        store = _s3_store(request.getfixturevalue("s3"))
    return SealObjects(store, tmp_path / "spool")


def _chunks(data: bytes, n: int = 1 << 20) -> Iterator[bytes]:
    for i in range(0, len(data), n):
        yield data[i:i + n]


def test_round_trip_is_content_addressed_and_encrypted(seals: SealObjects) -> None:
    key = account_key(MASTER, "acct_a")
    data = os.urandom(3 * objects.FRAME + 12345)  # several frames, the last one short
    digest = hashlib.sha256(data).hexdigest()
    name, size = seals.put(key, "acct_a", _chunks(data))
    assert (name, size) == (f"acct_a/{digest}", len(data))
    assert b"".join(seals.get(key, name)) == data
    stored = b"".join(seals.store.read(name))
    assert data[:4096] not in stored and len(stored) > len(data)  # ciphertext at rest
    # the same content again is not sent again
    assert seals.put(key, "acct_a", _chunks(data), sha256=digest) == (name, -1)


def test_an_empty_file_round_trips(seals: SealObjects) -> None:
    key = account_key(MASTER, "acct_a")
    name, size = seals.put(key, "acct_a", iter([]))
    assert size == 0 and b"".join(seals.get(key, name)) == b""


def test_another_accounts_key_cannot_read(seals: SealObjects) -> None:
    mine, theirs = account_key(MASTER, "acct_a"), account_key(MASTER, "acct_b")
    assert mine != theirs
    name, _ = seals.put(mine, "acct_a", [b"private " * 1000])
    with pytest.raises(StorageError) as e:
        b"".join(seals.get(theirs, name))
    assert e.value.code == "decrypt_failed"


def test_a_changed_object_is_detected(seals: SealObjects, tmp_path: Path) -> None:
    key = account_key(MASTER, "acct_a")
    name, _ = seals.put(key, "acct_a", [b"x" * 100000])
    raw = bytearray(b"".join(seals.store.read(name)))
    raw[200] ^= 1  # one bit of ciphertext
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    seals.store.put_file(name, bad)
    with pytest.raises(StorageError) as e:
        b"".join(seals.get(key, name))
    assert e.value.code == "decrypt_failed"
    # cut after the first frame's header: detected too
    bad.write_bytes(bytes(raw[:len(objects.MAGIC) + 16]))
    seals.store.put_file(name, bad)
    with pytest.raises(StorageError) as e:
        b"".join(seals.get(key, name))
    assert e.value.code == "decrypt_failed"


def test_a_checksum_mismatch_is_detected(seals: SealObjects, tmp_path: Path) -> None:
    """Validly encrypted content stored under a name whose digest is not the content's: reading it fails."""
    key = account_key(MASTER, "acct_a")
    wrong = "acct_a/" + hashlib.sha256(b"something else").hexdigest()
    enc = tmp_path / "enc"
    objects.encrypt(key, wrong, [b"the real content"], enc)
    seals.store.put_file(wrong, enc)
    with pytest.raises(StorageError) as e:
        b"".join(seals.get(key, wrong))
    assert e.value.code == "checksum_mismatch"
    # and a put whose content is not the digest it claims stores nothing
    claimed = hashlib.sha256(b"claimed").hexdigest()
    with pytest.raises(StorageError) as e:
        seals.put(key, "acct_a", [b"not that"], sha256=claimed)
    assert e.value.code == "checksum_mismatch"
    assert not seals.store.exists(f"acct_a/{claimed}")


def test_a_missing_object_is_not_found(seals: SealObjects) -> None:
    with pytest.raises(StorageError) as e:
        b"".join(seals.get(account_key(MASTER, "a"), "a/" + "0" * 64))
    assert e.value.code == "not_found"


def test_large_files_go_up_in_parallel_parts(s3: S3Server, tmp_path: Path) -> None:
    seals = SealObjects(_s3_store(s3), tmp_path / "spool")
    key = account_key(MASTER, "acct_a")
    data = os.urandom(3 * objects.MULTIPART_BYTES + 5)
    name, _ = seals.put(key, "acct_a", _chunks(data))
    head = seals.store.client.head_object(Bucket="seals", Key="pre/" + name)  # type: ignore[attr-defined]
    assert head["ETag"].strip('"').endswith("-4")  # a multipart upload of 4 parts
    assert b"".join(seals.get(key, name)) == data


def test_check_names_a_missing_bucket_and_an_unreachable_server(s3: S3Server) -> None:
    _s3_store(s3).check()
    with pytest.raises(StorageError) as e:
        _s3_store(s3, "no-such-bucket").check()
    assert e.value.code == "bucket_not_found" and "no-such-bucket" in e.value.message
    dead = open_store("s3://seals", "http://127.0.0.1:9", "us-east-1", ACCESS_KEY, SECRET_KEY)
    with pytest.raises(StorageError) as e:
        dead.check()
    assert e.value.code == "store_unreachable"


@pytest.mark.parametrize("url", ["s3://", "s3://Bad_Bucket", "relative/dir", "ftp://x"])
def test_a_bad_store_url_is_refused(url: str) -> None:
    with pytest.raises(StorageError) as e:
        open_store(url)
    assert e.value.code == "bad_store"


def test_refused_credentials_are_named() -> None:
    """On an S3 server that checks signatures: the right key pair passes the check, a wrong secret or an unknown key
    is ``bad_credentials`` naming the bucket."""
    srv = S3Server(auth=True).start()
    try:
        key, secret = srv.make_user()
        srv.make_bucket("authed", key, secret)
        open_store("s3://authed", srv.endpoint, "us-east-1", key, secret).check()
        for k, s in ((key, "wrong"), ("AKIAUNKNOWN000000000", secret)):
            with pytest.raises(StorageError) as e:
                open_store("s3://authed", srv.endpoint, "us-east-1", k, s).check()
            assert e.value.code == "bad_credentials" and "authed" in e.value.message
    finally:
        srv.kill()
