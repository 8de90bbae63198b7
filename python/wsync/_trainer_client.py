"""The C ABI of libwsync_trainer_client (src/trainer_client/wsync_trainer_client.h) in ctypes:
its structs, the functions' signatures, and the library loaded once per process (wsync._native)."""

from __future__ import annotations

import ctypes

from wsync import _native

LIB = "libwsync_trainer_client.so"
ABI_VERSION = 1


class SyncInfo(ctypes.Structure):
    _fields_ = [("sync_id", ctypes.c_uint64), ("version", ctypes.c_uint64), ("coalesced", ctypes.c_int)]


def declare(lib: ctypes.CDLL) -> None:
    """Sets the result and argument types of every wsync_* function of the header."""
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


def library() -> ctypes.CDLL:
    """libwsync_trainer_client, loaded once per process."""
    return _native.load(LIB, "WSYNC_TRAINER_CLIENT", declare, "wsync_client_abi_version", ABI_VERSION)


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    """WsyncError for a non-zero return code, with wsync_last_error()'s message."""
    _native.check(lib, rc, what, "wsync_last_error")
