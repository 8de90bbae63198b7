"""The C ABI of libwsync_engine_host (src/engine_host/wsync_engine_host.h) in ctypes: its structs,
the callback types, the functions' signatures, and the library loaded once per process
(wsync._native). wsync.engine builds EngineHost and EngineView on it."""

from __future__ import annotations

import ctypes

from wsync import _native

LIB = "libwsync_engine_host.so"
ABI_VERSION = 2

PREPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)
GENERATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                            ctypes.c_uint32, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_size_t),
                            ctypes.c_void_p, ctypes.c_size_t)
PAUSE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
CONTINUE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)


class Options(ctypes.Structure):
    _fields_ = [("engine_id", ctypes.c_char_p), ("config_json", ctypes.c_char_p), ("quant_json", ctypes.c_char_p),
                ("listen", ctypes.c_char_p), ("agent", ctypes.c_char_p), ("agent_file", ctypes.c_char_p),
                ("token_file", ctypes.c_char_p), ("prepare", PREPARE), ("generate", GENERATE),
                ("ctx", ctypes.c_void_p), ("hold_timeout_s", ctypes.c_double), ("checkpoint", ctypes.c_char_p),
                ("on_pause", PAUSE), ("on_continue", CONTINUE), ("param_memory", ctypes.c_char_p)]


class ParamInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_char_p), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * 4), ("nbytes", ctypes.c_uint64), ("data", ctypes.c_void_p),
                ("kind", ctypes.c_int), ("device", ctypes.c_int)]


class LinearInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("quantized", ctypes.c_int), ("experts", ctypes.c_int64),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class SourceInfo(ctypes.Structure):
    _fields_ = [("hf_name", ctypes.c_char_p), ("dtype", ctypes.c_char_p), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * 4), ("action", ctypes.c_int), ("param", ctypes.c_char_p),
                ("expert", ctypes.c_int64), ("transpose", ctypes.c_int), ("dst_row0", ctypes.c_int64),
                ("dst_col0", ctypes.c_int64), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("shape_values", ctypes.c_int64 * 2)]


def declare(lib: ctypes.CDLL) -> None:
    """Sets the result and argument types of every wsync_engine_* function of the header."""
    P = ctypes.c_void_p
    for name, res, args in [
        ("wsync_engine_last_error", ctypes.c_char_p, []),
        ("wsync_engine_abi_version", ctypes.c_int, []),
        ("wsync_engine_create", ctypes.c_int, [ctypes.POINTER(Options), ctypes.POINTER(P)]),
        ("wsync_engine_param_count", ctypes.c_size_t, [P]),
        ("wsync_engine_param", ctypes.c_int, [P, ctypes.c_size_t, ctypes.POINTER(ParamInfo)]),
        ("wsync_engine_linear_count", ctypes.c_size_t, [P]),
        ("wsync_engine_linear", ctypes.c_int, [P, ctypes.c_size_t, ctypes.POINTER(LinearInfo)]),
        ("wsync_engine_dense_bf16", ctypes.c_int, [P, ctypes.c_char_p, P, ctypes.c_uint64]),
        ("wsync_engine_attach_info", ctypes.c_char_p, [P]),
        ("wsync_engine_attach", ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(P)]),
        ("wsync_engine_source_count", ctypes.c_size_t, [P]),
        ("wsync_engine_source", ctypes.c_int, [P, ctypes.c_size_t, ctypes.POINTER(SourceInfo)]),
        ("wsync_engine_loaded", ctypes.c_int, [P, ctypes.c_char_p, P, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64)]),
        ("wsync_engine_start", ctypes.c_int, [P]),
        ("wsync_engine_address", ctypes.c_char_p, [P]),
        ("wsync_engine_begin_request", ctypes.c_int, [P, ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64)]),
        ("wsync_engine_end_request", None, [P]),
        ("wsync_engine_request_stopped", ctypes.c_int, [P]),
        ("wsync_engine_update_weights", ctypes.c_int, [P, ctypes.c_uint64, ctypes.c_int64,
                                                       ctypes.POINTER(ctypes.c_uint64)]),
        ("wsync_engine_health", ctypes.c_int, [P, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)]),
        ("wsync_engine_destroy", None, [P]),
    ]:
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args


def library() -> ctypes.CDLL:
    """libwsync_engine_host, loaded once per process ($WSYNC_ENGINE_HOST, the package, build/lib)."""
    return _native.load(LIB, "WSYNC_ENGINE_HOST", declare, "wsync_engine_abi_version", ABI_VERSION)


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    """WsyncError for a non-zero return code, with wsync_engine_last_error()'s message."""
    _native.check(lib, rc, what, "wsync_engine_last_error")
