"""nftables batches through libnftables (the library behind the ``nft`` command), in process.

Starting the ``nft`` command costs ~25 ms of process start and ruleset cache fetch per call on a loaded 2-core
host; the same batch through the library's ``nft_run_cmd_from_buffer`` takes well under a millisecond once a
context exists. Sandbox wiring runs one batch per start, restore and stop, so this keeps the network pinning off the
stop/resume figures. The library is ``libnftables.so.1`` from Debian's ``libnftables1`` (a dependency of the
``nftables`` package that ``sbx setup`` installs); without it, batches go to the ``nft`` command.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_ctx: int | None = None
_tried = False


class NftError(RuntimeError):
    """nftables rejected a batch; the message is nft's (``Error: Could not process rule: ...``)."""


def _context() -> tuple[ctypes.CDLL, int] | None:
    """The library and one context for this process (made on first use); ``None`` when the library is missing."""
    global _lib, _ctx, _tried
    if not _tried:
        _tried = True
        try:
            lib = ctypes.CDLL("libnftables.so.1")
        except OSError:
            return None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        ctx = lib.nft_ctx_new(0)  # NFT_CTX_DEFAULT
        if not ctx:
            return None
        lib.nft_ctx_buffer_output(ctx)  # keep nft's output off our stdout
        lib.nft_ctx_buffer_error(ctx)
        _lib, _ctx = lib, ctx
    if _lib is None or _ctx is None:
        return None
    return _lib, _ctx


def run(script: str) -> None:
    """Apply ``script`` (``nft -f`` syntax) as one transaction: all of it applies or none. Thread-safe (one
    context per process, used under a lock). Raises :class:`NftError` with nft's message when it is rejected."""
    with _lock:
        found = _context()
        if found is not None:
            lib, ctx = found
            rc = lib.nft_run_cmd_from_buffer(ctx, script.encode())
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
            lib.nft_ctx_get_output_buffer(ctx)  # drain
            if rc != 0:
                raise NftError(err.strip() or f"nft rejected the batch (status {rc})")
            return
    p = subprocess.run(["nft", "-f", "-"], input=script.encode(), capture_output=True)
    if p.returncode != 0:
        raise NftError(p.stderr.decode(errors="replace").strip() or f"nft exited with {p.returncode}")
