"""Object stores for seals (issue 34): where a stopped sandbox's disk delta and memory image go so that it outlives
its node. :class:`DirStore` (a local directory) and :class:`S3Store` (an S3-compatible bucket through boto3) keep
opaque objects by name; :class:`SealObjects` puts files there content-addressed, encrypted and checksummed.

- **Content-addressed**: an object's name is ``<account>/<sha256 of the plaintext>``: the same file of one account
  is stored once, whatever sandbox or seal names it.
- **Encrypted at rest** with the account's 256-bit key (AES-256-GCM, ``cryptography``), in frames of
  :data:`FRAME` bytes: ``b"SBXOBJ1\\0"`` then per frame ``u32 plaintext length, 12-byte random nonce, ciphertext
  + 16-byte tag``; each frame's associated data is ``name, frame index, last-frame flag``, so frames can't be
  reordered, dropped, cut off or moved to another object. Another account's key fails every frame's tag.
- **Checksummed on read**: the plaintext's SHA-256 must equal the name's, else ``StorageError("checksum_mismatch")``.
- **Parallel multipart** upload for files over :data:`MULTIPART_BYTES` (boto3's transfer manager,
  :data:`PARTS_AT_ONCE` parts at a time).

Errors are :class:`sbx.storage.errors.StorageError`: ``bucket_not_found``, ``bad_credentials``,
``store_unreachable``, ``store_failed``, ``not_found``, ``checksum_mismatch``, ``decrypt_failed``, ``bad_store``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sbx.storage.errors import StorageError

MAGIC = b"SBXOBJ1\0"
FRAME = 4 * 1024 * 1024
"""Plaintext bytes per encrypted frame."""
MULTIPART_BYTES = 8 * 1024 * 1024
"""Objects larger than this go up in parts of this size."""
PARTS_AT_ONCE = 4
_HEAD = struct.Struct("<I12s")
_TAG = 16
_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}/[0-9a-f]{64}$")


class ObjectStore(Protocol):
    """Opaque objects by name (``account/sha256``). Every method raises :class:`StorageError`."""

    def put_file(self, name: str, path: Path) -> None:
        """Store the bytes of ``path`` as ``name`` (whole or not at all)."""

    def read(self, name: str) -> Iterator[bytes]:
        """The bytes of ``name`` in pieces. Raises ``not_found``."""

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None:
        """Remove ``name`` (nothing when absent)."""

    def check(self) -> None:
        """Prove the store answers and may be written (a small object put, read and deleted)."""

    def names(self) -> Iterator[tuple[str, float]]:
        """``(name, last modified as a Unix time)`` of every object in the store."""


def account_key(master: bytes, account_id: str) -> bytes:
    """The 32-byte seal key of ``account_id``, derived from the server's 32-byte ``master`` key (HKDF-SHA256 with
    the account id as context): kept by the control plane only, never stored, never on a node."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"sbx seal store",
                info=b"account:" + account_id.encode()).derive(master)


def _aad(name: str, index: int, last: bool) -> bytes:
    return name.encode() + struct.pack("<QB", index, last)


def encrypt(key: bytes, name: str, chunks: Iterable[bytes], out: Path) -> tuple[str, int]:
    """Write ``chunks`` encrypted for object ``name`` under ``key`` to file ``out``. Returns ``(sha256 hex of the
    plaintext, plaintext bytes)``."""
    aead = AESGCM(key)
    h = hashlib.sha256()
    total = 0
    index = 0
    buf = bytearray()
    with out.open("wb") as f:
        f.write(MAGIC)

        def frame(data: bytes, last: bool) -> None:
            nonce = os.urandom(12)
            f.write(_HEAD.pack(len(data), nonce))
            f.write(aead.encrypt(nonce, data, _aad(name, index, last)))

        for c in chunks:
            h.update(c)
            total += len(c)
            buf += c
            while len(buf) > FRAME:
                frame(bytes(buf[:FRAME]), False)
                del buf[:FRAME]
                index += 1
        frame(bytes(buf), True)
    return h.hexdigest(), total


def decrypt(key: bytes, name: str, chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The plaintext of object ``name`` read as ``chunks``, frame by frame. Raises ``StorageError``:
    ``decrypt_failed`` (wrong key, altered, reordered or cut frames), ``checksum_mismatch`` (the plaintext's SHA-256
    is not the one in ``name``), after yielding what came before."""
    aead = AESGCM(key)
    want = name.rsplit("/", 1)[-1]
    h = hashlib.sha256()
    buf = bytearray()
    it = iter(chunks)

    def need(n: int) -> bytes | None:
        while len(buf) < n:
            c = next(it, None)
            if c is None:
                return None
            buf.extend(c)
        out = bytes(buf[:n])
        del buf[:n]
        return out

    if need(len(MAGIC)) != MAGIC:
        raise StorageError("decrypt_failed", f"{name}: not an sbx seal object")
    index = 0
    while True:
        head = need(_HEAD.size)
        if head is None:
            raise StorageError("decrypt_failed", f"{name}: cut off after {index} frames")
        size, nonce = _HEAD.unpack(head)
        if size > FRAME:
            raise StorageError("decrypt_failed", f"{name}: frame {index} claims {size} bytes")
        body = need(size + _TAG)
        if body is None:
            raise StorageError("decrypt_failed", f"{name}: frame {index} is cut off")
        last = not buf and _at_end(it, buf)
        try:
            plain = aead.decrypt(nonce, body, _aad(name, index, last))
        except InvalidTag:
            raise StorageError("decrypt_failed", f"{name}: frame {index} does not decrypt with this account's key "
                                                 "(another account's object, or altered)") from None
        h.update(plain)
        yield plain
        if last:
            break
        index += 1
    if h.hexdigest() != want:
        raise StorageError("checksum_mismatch", f"{name}: the content's SHA-256 is {h.hexdigest()}")


def _at_end(it: Iterator[bytes], buf: bytearray) -> bool:
    """Whether ``it`` has nothing more (a piece it still had is put into ``buf``)."""
    for c in it:
        if c:
            buf.extend(c)
            return False
    return True


class DirStore:
    """Objects as files under ``root`` (``root/<account>/<sha256>``), written to a temporary name and renamed."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, name: str) -> Path:
        if not _KEY.match(name):
            raise StorageError("bad_store", f"{name!r} is not an object name")
        return self.root / name

    def put_file(self, name: str, path: Path) -> None:
        dst = self._path(name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        try:
            shutil.copyfile(path, tmp)
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StorageError("store_failed", f"writing {name}: {e}") from e

    def read(self, name: str) -> Iterator[bytes]:
        try:
            f = self._path(name).open("rb")
        except FileNotFoundError:
            raise StorageError("not_found", f"no object {name}") from None

        def pieces() -> Iterator[bytes]:
            with f:
                while b := f.read(1 << 20):
                    yield b

        return pieces()

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def names(self) -> Iterator[tuple[str, float]]:
        for p in sorted(self.root.glob("*/*")) if self.root.is_dir() else []:
            name = f"{p.parent.name}/{p.name}"
            if _KEY.match(name):
                yield name, p.stat().st_mtime

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root):
                pass
        except OSError as e:
            raise StorageError("store_failed", f"the seal store {self.root} is not writable: {e}") from e


class S3Store:
    """Objects in bucket ``bucket`` under ``prefix`` of an S3-compatible server (``endpoint`` empty: AWS)."""

    def __init__(self, bucket: str, prefix: str = "", endpoint: str = "", region: str = "",
                 access_key: str = "", secret_key: str = ""):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.client: Any = boto3.client(
            "s3", endpoint_url=endpoint or None, region_name=region or "us-east-1",
            aws_access_key_id=access_key or None, aws_secret_access_key=secret_key or None,
            config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=30,
                          s3={"addressing_style": "path"}))
        self.transfer = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES,
                                       max_concurrency=PARTS_AT_ONCE, use_threads=True)

    def _key(self, name: str) -> str:
        if not _KEY.match(name):
            raise StorageError("bad_store", f"{name!r} is not an object name")
        return self.prefix + name

    def _fail(self, what: str, e: Exception) -> StorageError:
        from botocore.exceptions import ClientError, EndpointConnectionError

        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in ("NoSuchBucket", "404") and what == "checking":
                return StorageError("bucket_not_found", f"the bucket {self.bucket!r} does not exist")
            if code in ("NoSuchKey", "404"):
                return StorageError("not_found", f"{what}: no such object")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "InvalidToken"):
                return StorageError("bad_credentials", f"{what}: the bucket {self.bucket!r} refused the "
                                                       f"credentials ({code})")
            return StorageError("store_failed", f"{what}: {code} {err.get('Message', '')}".strip())
        if isinstance(e, EndpointConnectionError):
            return StorageError("store_unreachable", f"{what}: {e}")
        return StorageError("store_failed", f"{what}: {e}")

    def put_file(self, name: str, path: Path) -> None:
        try:
            self.client.upload_file(str(path), self.bucket, self._key(name), Config=self.transfer)
        except Exception as e:  # boto3 raises several families (S3UploadFailedError, ClientError, connection errors)
            raise self._fail(f"uploading {name}", e) from e

    def read(self, name: str) -> Iterator[bytes]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        except Exception as e:
            raise self._fail(f"reading {name}", e) from e

        def pieces() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(1 << 20)
            except Exception as e:
                raise self._fail(f"reading {name}", e) from e
            finally:
                body.close()

        return pieces()

    def exists(self, name: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(name))
            return True
        except Exception as e:
            err = self._fail(f"looking up {name}", e)
            if err.code == "not_found":
                return False
            raise err from e

    def delete(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
        except Exception as e:
            raise self._fail(f"deleting {name}", e) from e

    def names(self) -> Iterator[tuple[str, float]]:
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
                for o in page.get("Contents", []):
                    name = str(o["Key"])[len(self.prefix):]
                    if _KEY.match(name):
                        yield name, o["LastModified"].timestamp()
        except Exception as e:
            raise self._fail("listing the bucket", e) from e

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
            probe = self.prefix + ".sbx-check"
            self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
            self.client.delete_object(Bucket=self.bucket, Key=probe)
        except Exception as e:
            raise self._fail("checking", e) from e


def open_store(url: str, endpoint: str = "", region: str = "", access_key: str = "",
               secret_key: str = "") -> ObjectStore:
    """The store ``url`` names: ``s3://BUCKET[/PREFIX]`` (with ``endpoint``, ``region`` and credentials; empty
    credentials: boto3's usual sources) or ``file:///DIR`` / an absolute path. Raises ``StorageError("bad_store")``
    for anything else."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise StorageError("bad_store", f"{url!r}: {bucket!r} is not an S3 bucket name")
        return S3Store(bucket, prefix, endpoint, region, access_key, secret_key)
    path = url[len("file://"):] if url.startswith("file://") else url
    if not path.startswith("/"):
        raise StorageError("bad_store", f"{url!r} is neither s3://BUCKET[/PREFIX] nor an absolute directory")
    return DirStore(Path(path))


class SealObjects:
    """Files of seals in an :class:`ObjectStore`, content-addressed, encrypted and checksummed (module docstring).
    ``spool`` is a local directory for the encrypted copy being uploaded."""

    def __init__(self, store: ObjectStore, spool: Path):
        self.store = store
        self.spool = Path(spool)

    @staticmethod
    def name(account_id: str, sha256: str) -> str:
        return f"{account_id}/{sha256}"

    def put(self, key: bytes, account_id: str, chunks: Iterable[bytes], sha256: str | None = None) -> tuple[str, int]:
        """Store the file read as ``chunks`` for ``account_id`` (its key ``key``). When ``sha256`` (the expected
        content digest) is given and the object already exists, nothing is sent. Returns ``(object name,
        plaintext bytes)``. Raises ``StorageError`` (``checksum_mismatch`` when the content is not ``sha256``)."""
        if sha256 is not None and self.store.exists(self.name(account_id, sha256)):
            return self.name(account_id, sha256), -1
        self.spool.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.spool, suffix=".enc")
        os.close(fd)
        path = Path(tmp)
        try:
            if sha256 is None:  # the name is the digest, known once read: hash first
                h = hashlib.sha256()
                raw = path.with_suffix(".raw")
                with raw.open("wb") as f:
                    for c in chunks:
                        h.update(c)
                        f.write(c)
                sha256 = h.hexdigest()
                chunks = _file_chunks(raw)
            name = self.name(account_id, sha256)
            got, size = encrypt(key, name, chunks, path)
            if got != sha256:
                raise StorageError("checksum_mismatch", f"the file's SHA-256 is {got}, not {sha256}")
            self.store.put_file(name, path)
            return name, size
        finally:
            path.unlink(missing_ok=True)
            path.with_suffix(".raw").unlink(missing_ok=True)

    def get(self, key: bytes, name: str) -> Iterator[bytes]:
        """The plaintext of object ``name`` under ``key``, checked (see :func:`decrypt`)."""
        return decrypt(key, name, self.store.read(name))


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while b := f.read(1 << 20):
            yield b
