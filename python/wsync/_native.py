"""How the package finds and loads its native libraries (ctypes), and WsyncError.

libwsync_trainer_client (wsync._trainer_client) and libwsync_engine_host (wsync._engine_host) are
found, in this order, at their environment variable ($WSYNC_TRAINER_CLIENT, $WSYNC_ENGINE_HOST),
inside this package (wsync/_lib/: where `pip install ./python` and tools/python-venv.sh put the
ones they built or took from a build), in a checkout's build/lib next to this package's source
(python/wsync run from the checkout), then through the dynamic loader's search path. Every
failure of a wsync_* call becomes a WsyncError carrying the C code and the library's message.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading
from typing import Callable, Dict, Iterator

# absl::StatusCode names, as the C headers' WSYNC_* codes.
CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
    10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS",
}


class WsyncError(Exception):
    """A wsync call failed: `code` (int, absl::StatusCode), `code_name` ("UNAVAILABLE", ...), `message`."""

    def __init__(self, code: int, message: str) -> None:
        self.code = int(code)
        self.code_name = CODE_NAMES.get(self.code, f"CODE_{self.code}")
        self.message = message
        super().__init__(f"{self.code_name}: {message}")


def _candidates(lib_name: str, env_var: str) -> Iterator[str]:
    env = os.environ.get(env_var)
    if env:
        yield env
    here = pathlib.Path(__file__).resolve().parent
    yield str(here / "_lib" / lib_name)
    yield str(here.parent.parent / "build" / "lib" / lib_name)  # python/wsync in a built checkout
    yield lib_name + ".1"


_lock = threading.Lock()
_loaded: Dict[str, ctypes.CDLL] = {}


def load(lib_name: str, env_var: str, declare: Callable[[ctypes.CDLL], None], abi_function: str,
         abi_version: int) -> ctypes.CDLL:
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


def check(lib: ctypes.CDLL, rc: int, what: str, last_error: str) -> None:
    """Raises WsyncError for a non-zero return code, with the library's message for this thread
    (its `last_error` function)."""
    if rc != 0:
        message = (getattr(lib, last_error)() or b"").decode("utf-8", "replace")
        raise WsyncError(rc, f"{what}: {message}" if message else what)
