"""ctypes bindings of libwsync_trainer_client (src/trainer_client/wsync_trainer_client.h).

The library is found, in this order, at $WSYNC_TRAINER_CLIENT, inside this package (wsync/_lib/,
where `pip install ./python` puts the one of the checkout's build), in a checkout's build/lib next
to this package's source, then through the dynamic loader's search path. Every failure of a
wsync_* call becomes a WsyncError carrying the C code and the library's message.
"""

import ctypes
import os
import pathlib
import threading

_LIB = "libwsync_trainer_client.so"
_ABI_VERSION = 1

# absl::StatusCode names, as the C header's WSYNC_* codes.
CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
    10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS",
}


class WsyncError(Exception):
    """A wsync call failed: `code` (int, absl::StatusCode), `code_name` ("UNAVAILABLE", ...), `message`."""

    def __init__(self, code, message):
        self.code = int(code)
        self.code_name = CODE_NAMES.get(self.code, f"CODE_{self.code}")
        self.message = message
        super().__init__(f"{self.code_name}: {message}")


class SyncInfo(ctypes.Structure):
    _fields_ = [("sync_id", ctypes.c_uint64), ("version", ctypes.c_uint64), ("coalesced", ctypes.c_int)]


def _candidates():
    env = os.environ.get("WSYNC_TRAINER_CLIENT")
    if env:
        yield env
    here = pathlib.Path(__file__).resolve().parent
    yield str(here / "_lib" / _LIB)
    yield str(here.parent.parent / "build" / "lib" / _LIB)  # python/wsync in a built checkout
    yield _LIB + ".1"


_lock = threading.Lock()
_lib = None


def library():
    """The loaded library (loaded once per process). WsyncError(NOT_FOUND) names every place tried."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append(f"{path} (missing)")
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
            _declare(lib)
            abi = lib.wsync_client_abi_version()
            if abi != _ABI_VERSION:
                raise WsyncError(9, f"{path} has client ABI {abi}; this package speaks {_ABI_VERSION}")
            _lib = lib
            return lib
        raise WsyncError(5, f"{_LIB} not found; tried: " + "; ".join(tried) +
                         " (build wsync, or set WSYNC_TRAINER_CLIENT to the library's path)")


def _declare(lib):
    c_int64_p = ctypes.POINTER(ctypes.c_int64)
    lib.wsync_last_error.restype = ctypes.c_char_p
    lib.wsync_last_error.argtypes = []
    lib.wsync_client_abi_version.restype = ctypes.c_int
    lib.wsync_client_abi_version.argtypes = []
    lib.wsync_client_open.restype = ctypes.c_int
    lib.wsync_client_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)]
    lib.wsync_client_add_tensor.restype = ctypes.c_int
    lib.wsync_client_add_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, c_int64_p, ctypes.c_int]
    lib.wsync_client_register.restype = ctypes.c_int
    lib.wsync_client_register.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64]
    lib.wsync_client_tensor.restype = ctypes.c_void_p
    lib.wsync_client_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64)]
    lib.wsync_client_begin_update.restype = ctypes.c_int
    lib.wsync_client_begin_update.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.wsync_client_end_update.restype = ctypes.c_int
    lib.wsync_client_end_update.argtypes = [ctypes.c_void_p]
    lib.wsync_client_request_sync.restype = ctypes.c_int
    lib.wsync_client_request_sync.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64,
                                              ctypes.POINTER(SyncInfo)]
    lib.wsync_client_close.restype = None
    lib.wsync_client_close.argtypes = [ctypes.c_void_p]


def check(lib, rc, what):
    """Raises WsyncError for a non-zero return code, with the library's message for this thread."""
    if rc != 0:
        message = (lib.wsync_last_error() or b"").decode("utf-8", "replace")
        raise WsyncError(rc, f"{what}: {message}" if message else what)
