"""The trainer side: a training process publishes its weights to its local wsync trainer agent.

One Publisher per training rank, beside ``wsync-trainer-agent --source shm:NAME`` (same NAME, same
global rank). The parameters live in one shared-memory segment that the agent maps read-only; the
training process writes them in place under the update lock and declares each step a version::

    from wsync.trainer import Publisher
    pub = Publisher("job42", rank)                            # the agent's socket (it may start later)
    pub.share(model.named_parameters(), config_json, parallel_json)  # torch: params now live in shm
    for step in ...:
        with pub.update():                                    # waits while a sync reads the weights
            optimizer.step()                                  # writes the shared parameters in place
        pub.publish(step)                                     # every rank; one sync per version

Without torch, declare() + register() and write through buffer(name) (a writable memoryview) or
numpy(name). Names are the rank's Megatron local names (GPTModel.named_parameters(), as
MEGATRON_TO_HF.md gives them); the agent checks every name, dtype and shape against the rank's
parameter plan at register() and names what does not fit.

Errors: every failure raises wsync.WsyncError (code_name, message); a failed call changes
nothing (a refused register keeps the declarations: fix and retry). Thread-safety: the calls
are serialized by the library; the tensor memory is the caller's to synchronize (update()).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

from wsync import _trainer_client
from wsync._native import WsyncError
from wsync.dtypes import ITEMSIZE, numpy_dtype, torch_dtype, torch_dtype_name

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["ITEMSIZE", "Publisher", "SyncResult", "cuda_ipc", "torch_dtype"]


@dataclass(frozen=True)
class SyncResult:
    sync_id: int
    version: int  # the version the sync published
    coalesced: bool  # another rank had already requested this version


# config.json / parallel.json: the text, or the parsed dict (dumped here).
JsonText = Union[str, bytes, Dict[str, Any], List[Any]]


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    _trainer_client.check(lib, rc, what)


def _ms(seconds: Optional[float]) -> int:
    return int(seconds * 1000) if seconds is not None else -1


def cuda_ipc(t: "Tensor") -> Tuple[bytes, int, int]:
    """(cudaIpcMemHandle_t bytes, CUDA device, byte offset of the tensor's data in its allocation)
    of a CUDA tensor, through the driver API (libcuda.so.1, present wherever the NVIDIA driver is):
    the allocation holding the data (cuMemGetAddressRange) and its IPC handle (cuIpcGetMemHandle).
    torch's caching allocator hands out pieces of larger cudaMalloc blocks, hence the offset.
    WsyncError naming the tensor when the driver refuses (e.g. expandable_segments memory, which
    has no legacy IPC handle)."""
    import torch

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise WsyncError(9, f"CUDA tensor on {t.device}: the NVIDIA driver library: {e}") from None
    torch.cuda.set_device(t.device)
    torch.cuda.synchronize(t.device)  # the device's primary context is current on this thread
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(t.data_ptr()))
    if rc != 0:
        raise WsyncError(13, f"cuMemGetAddressRange of a tensor on {t.device} failed (CUresult {rc})")
    handle = (ctypes.c_char * 64)()
    rc = cuda.cuIpcGetMemHandle(handle, base)
    if rc != 0:
        raise WsyncError(12, f"cuIpcGetMemHandle of a tensor on {t.device} failed (CUresult {rc}): its memory "
                             "cannot be shared by IPC (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True?)")
    return bytes(handle), t.device.index, t.data_ptr() - base.value


class Publisher:
    """One training rank's connection to its trainer agent (see the module docstring)."""

    def __init__(self, source_name: str, rank: int, *, timeout: Optional[float] = 60.0) -> None:
        """Connects to the agent of `--source shm:<source_name>` for Megatron global `rank`, retrying
        for `timeout` seconds (UNAVAILABLE when nothing answers)."""
        self._lib = _trainer_client.library()
        if not isinstance(source_name, str) or not isinstance(rank, int) or isinstance(rank, bool):
            raise WsyncError(3, f"Publisher(source_name: str, rank: int), not ({source_name!r}, {rank!r})")
        handle = ctypes.c_void_p()
        _check(self._lib, self._lib.wsync_client_open(source_name.encode(), rank, _ms(timeout),
                                                       ctypes.byref(handle)),
               f"connecting to the trainer agent of shm:{source_name} rank {rank}")
        self._c: Optional[ctypes.c_void_p] = handle
        self.source_name, self.rank = source_name, rank
        self._declared: Dict[str, Tuple[str, Tuple[int, ...]]] = {}  # name -> (dtype, shape), in declaration order
        self._cuda: Set[str] = set()  # the declared CUDA tensors (read by the agent in place)
        self._registered = False
        self._in_update = False

    # --- declaring and registering ------------------------------------------------------------

    def declare(self, name: str, dtype: str, shape: Iterable[int]) -> None:
        """Declares a host tensor (before register): safetensors dtype name ("BF16", "F32", ...) and shape."""
        self._check_open()
        if not isinstance(name, str) or not name:
            raise WsyncError(3, f"a tensor name is a non-empty str, not {name!r}")
        if dtype not in ITEMSIZE:
            raise WsyncError(3, f"tensor {name}: dtype {dtype!r} (one of {', '.join(ITEMSIZE)})")
        try:
            dims = [int(d) for d in shape]
        except (TypeError, ValueError):
            raise WsyncError(3, f"tensor {name}: shape {shape!r} is not a sequence of ints") from None
        arr = (ctypes.c_int64 * max(len(dims), 1))(*dims)
        _check(self._lib, self._lib.wsync_client_add_tensor(self._c, name.encode(), dtype.encode(), arr,
                                                            len(dims)), f"declaring tensor {name}")
        self._declared[name] = (dtype, tuple(dims))

    def declare_cuda(self, name: str, tensor: "Tensor") -> None:
        """Declares a contiguous CUDA torch tensor (before register): the agent reads it in place
        from the device through its IPC handle at every sync (no copy into the segment). Write it
        only inside update(), like the host tensors."""
        self._check_open()
        dtype = torch_dtype_name(tensor)
        if dtype is None:
            raise WsyncError(3, f"tensor {name}: dtype {tensor.dtype} is not one the agent takes")
        if not tensor.is_contiguous():
            raise WsyncError(3, f"tensor {name} is not contiguous")
        handle, device, offset = cuda_ipc(tensor)
        dims = [int(d) for d in tensor.shape]
        arr = (ctypes.c_int64 * max(len(dims), 1))(*dims)
        _check(self._lib, self._lib.wsync_client_add_cuda_tensor(self._c, name.encode(), dtype.encode(), arr,
                                                                 len(dims), handle, len(handle), device,
                                                                 offset),
               f"declaring CUDA tensor {name}")
        self._declared[name] = (dtype, tuple(dims))
        self._cuda.add(name)

    def register(self, config_json: JsonText, parallel_json: JsonText, *, timeout: Optional[float] = 60.0) -> None:
        """Creates the shared segment and registers every declared tensor; the agent checks them
        against its model (config.json text) and parallel layout (parallel.json text)."""
        self._check_open()
        config_json, parallel_json = _text(config_json, "config_json"), _text(parallel_json, "parallel_json")
        _check(self._lib, self._lib.wsync_client_register(self._c, config_json.encode(), parallel_json.encode(),
                                                          _ms(timeout)),
               f"registering {len(self._declared)} tensors with shm:{self.source_name} rank {self.rank}")
        self._registered = True

    def share(self, named_tensors: Iterable[Tuple[str, "Tensor"]], config_json: JsonText,
              parallel_json: JsonText, *, timeout: Optional[float] = 60.0) -> "Publisher":
        """Declares, registers and moves host torch tensors into the shared segment in one step:
        each tensor's values are copied there and its storage is replaced by the shared one
        (``param.data = shared``), so the optimizer then writes the shared memory in place.
        `named_tensors`: (name, torch.Tensor) pairs, e.g. model.named_parameters(). CUDA tensors stay
        where they are: they are declared by IPC handle (declare_cuda) and the agent reads them on the
        device. Refused before anything is declared: a tensor neither on the CPU nor on a CUDA
        device, a dtype the agent does not take, a non-contiguous tensor, a repeated name."""
        import torch

        pairs = list(named_tensors)
        dtypes: Dict[str, str] = {}  # the host tensors' dtype names
        for name, t in pairs:
            if not isinstance(t, torch.Tensor):
                raise WsyncError(3, f"tensor {name}: a torch.Tensor, not {type(t).__name__}")
            if t.device.type not in ("cpu", "cuda"):
                raise WsyncError(12, f"tensor {name} is on {t.device}: the publisher shares host and CUDA tensors")
            dtype = torch_dtype_name(t)
            if dtype is None:
                raise WsyncError(3, f"tensor {name}: dtype {t.dtype} is not one the agent takes")
            if not t.is_contiguous():
                raise WsyncError(3, f"tensor {name} is not contiguous")
            if name in dtypes or name in self._declared:
                raise WsyncError(6, f"tensor {name} is declared twice")
            dtypes[name] = dtype
        for name, t in pairs:
            if t.device.type == "cuda":
                self.declare_cuda(name, t)
            else:
                self.declare(name, dtypes[name], tuple(t.shape))
        self.register(config_json, parallel_json, timeout=timeout)
        with torch.no_grad():
            for name, t in pairs:
                if t.device.type == "cuda":
                    continue  # read in place by the agent
                shared = self.torch(name)
                shared.copy_(t)
                t.data = shared
        return self

    # --- the shared tensors ---------------------------------------------------------------------

    @property
    def names(self) -> List[str]:
        return list(self._declared)

    def buffer(self, name: str) -> memoryview:
        """The tensor's bytes in the shared segment: a writable memoryview (format "B")."""
        self._check_open()
        if not self._registered:
            raise WsyncError(9, f"tensor {name}: register() first")
        nbytes = ctypes.c_uint64()
        ptr = self._lib.wsync_client_tensor(self._c, name.encode(), ctypes.byref(nbytes))
        if not ptr:
            raise WsyncError(5, f"tensor {name} is not a registered host tensor of shm:{self.source_name} "
                                f"rank {self.rank}")
        return memoryview((ctypes.c_char * nbytes.value).from_address(ptr)).cast("B")

    def numpy(self, name: str) -> Any:
        """The tensor as a numpy array over the shared memory (BF16: its raw uint16 bit patterns)."""
        import numpy as np

        buf = self.buffer(name)  # raises for a name not declared
        dtype, shape = self._declared[name]
        return np.frombuffer(buf, dtype=numpy_dtype(dtype)).reshape(shape)

    def torch(self, name: str) -> "Tensor":
        """The tensor as a torch tensor over the shared memory."""
        import torch

        buf = self.buffer(name)
        dtype, shape = self._declared[name]
        return torch.frombuffer(buf, dtype=torch_dtype(dtype)).view(shape)

    # --- steps ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def update(self, *, timeout: Optional[float] = 60.0) -> Iterator["Publisher"]:
        """Holds the update lock while the block writes the weights (waits while a sync reads them;
        DEADLINE_EXCEEDED after `timeout` seconds)."""
        self._check_open()
        _check(self._lib, self._lib.wsync_client_begin_update(self._c, _ms(timeout)), "begin_update")
        self._in_update = True
        try:
            yield self
        finally:
            self._in_update = False
            _check(self._lib, self._lib.wsync_client_end_update(self._c), "end_update")

    def publish(self, version: int = 0, *, wait: bool = True, timeout: Optional[float] = 600.0) -> SyncResult:
        """Declares the weights as last written to be `version` (0: the next one) and asks for its
        sync; with `wait`, returns when the sync has ended (raising if it failed)."""
        self._check_open()
        if self._in_update:
            raise WsyncError(9, f"publish({version}) inside update(): end the update first")
        info = _trainer_client.SyncInfo()
        _check(self._lib, self._lib.wsync_client_request_sync(self._c, int(version), 1 if wait else 0,
                                                              _ms(timeout), ctypes.byref(info)),
               f"version {version}")
        return SyncResult(info.sync_id, info.version, bool(info.coalesced))

    # --- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Disconnects and unmaps the segment (views from buffer() / numpy() / torch() die with it)."""
        if getattr(self, "_c", None):
            self._lib.wsync_client_close(self._c)
            self._c = None

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _check_open(self) -> None:
        if not getattr(self, "_c", None):
            raise WsyncError(9, "the publisher is closed")


def _text(value: JsonText, what: str) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bytes):
        return value.decode()
    if not isinstance(value, str):
        raise WsyncError(3, f"{what}: JSON text (str) or a dict, not {type(value).__name__}")
    return value
