"""ctypes bindings of libwsync_trainer_client (src/trainer_client/wsync_trainer_client.h), and the
loader that wsync.engine uses for libwsync_engine_host too.

A library is found, in this order, at its environment variable ($WSYNC_TRAINER_CLIENT,
$WSYNC_ENGINE_HOST), inside this package (wsync/_lib/,
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


def _candidates(lib_name, env_var):
    env = os.environ.get(env_var)
    if env:
        yield env
    here = pathlib.Path(__file__).resolve().parent
    yield str(here / "_lib" / lib_name)
    yield str(here.parent.parent / "build" / "lib" / lib_name)  # python/wsync in a built checkout
    yield lib_name + ".1"


_lock = threading.Lock()
_loaded = {}


def load(lib_name, env_var, declare, abi_function, abi_version):
    """`lib_name` loaded once per process from the places above, `declare`d, its ABI checked.
    WsyncError(NOT_FOUND) names every place tried."""
    with _lock:
        if lib_name in _loaded:
            return _loaded[lib_name]
        tried = []
        for path in _candidates(lib_name, env_var):
            if os.sep in path and not os.path.exists(path):
                tried.append(f"{path} (missing)")
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
            declare(lib)
            abi = getattr(lib, abi_function)()
            if abi != abi_version:
                raise WsyncError(9, f"{path} has ABI {abi}; this package speaks {abi_version}")
            _loaded[lib_name] = lib
            return lib
        raise WsyncError(5, f"{lib_name} not found; tried: " + "; ".join(tried) +
                         f" (build wsync, or set {env_var} to the library's path)")


def library():
    """libwsync_trainer_client, loaded once per process."""
    return load(_LIB, "WSYNC_TRAINER_CLIENT", _declare, "wsync_client_abi_version", _ABI_VERSION)


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
    lib.wsync_client_add_cuda_tensor.restype = ctypes.c_int
    lib.wsync_client_add_cuda_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, c_int64_p,
                                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                 ctypes.c_uint64]
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


def check(lib, rc, what, last_error="wsync_last_error"):
    """Raises WsyncError for a non-zero return code, with the library's message for this thread."""
    if rc != 0:
        message = (getattr(lib, last_error)() or b"").decode("utf-8", "replace")
        raise WsyncError(rc, f"{what}: {message}" if message else what)
