"""The engine side: an engine that wsync does not build follows the trainer's syncs.

``EngineHost`` (libwsync_engine_host, src/engine_host/wsync_engine_host.h) is one engine rank on a
rollout agent: the parameters in one shared-memory segment in the SGLang engine form the agents
write (fused qkv_proj / gate_up_proj, stacked experts, vocab padded to 64, INT4 in Marlin layout),
the RolloutEngine gRPC service (Pause, Flush, Continue, Health, WeightVersion, Generate) with the
reference engine's state machine, and the registration with the agent. An *adapter* is the
engine: it reads the parameters (``host.tensor(name)``, in place) and is called back

* ``prepare(version)`` when a sync has written version ``version`` into the segment (the engine is
  paused and idle then; a failure makes the engine UNHEALTHY until a later sync prepares), and
* ``generate(prompt, max_new_tokens)`` for the gRPC Generate (greedy; a list of token ids), and,
  for an engine that also serves requests of its own (an HTTP server), ``on_pause(mode)`` ("HOLD"
  or "ABORT") when a sync pauses the host and ``on_continue(version)`` when it serves again.

Requests the process computes itself go through ``with host.request() as version:``, which waits
while a sync holds the engine and names the weight version the request runs on, so no request
ever mixes two versions.

The adapters are in wsync.adapters (transformers, vllm, sglang); ``python -m wsync`` runs one as
a process with wsync-ref-engine's flags (``python -m wsync.engine``: the same). ``EngineView`` is
another process's view of a host's segment (a vLLM worker process). The C ABI itself is
wsync._engine_host.

Errors: every failure raises wsync.WsyncError (code_name, message) naming what is wrong; a failed
constructor leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from wsync import _engine_host
from wsync._native import WsyncError
from wsync.dtypes import ITEMSIZE, torch_dtype

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["EngineHost", "EngineView", "Linear", "Param", "Source", "find_host", "host_of"]

_HOSTS: Dict[str, "EngineHost"] = {}  # engine id -> the EngineHost of this process (find_host)


def find_host(engine_id: str) -> Optional["EngineHost"]:
    """The EngineHost of this process serving `engine_id`, or None (wsync.adapters.vllm's
    weight-transfer backend finds its host here when vLLM's worker runs in the host's process)."""
    return _HOSTS.get(engine_id)


def host_of(engine_id: str) -> "EngineHost":
    """The EngineHost of this process serving `engine_id`; WsyncError(NOT_FOUND) otherwise."""
    if engine_id not in _HOSTS:
        raise WsyncError(5, f"no wsync engine host '{engine_id}' in this process (pid {os.getpid()}); hosts: "
                            f"{sorted(_HOSTS) or 'none'}")
    return _HOSTS[engine_id]


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    _engine_host.check(lib, rc, what)


def _write_err(err: int, err_len: int, message: str) -> None:
    data = message.encode("utf-8", "replace")[: max(0, err_len - 1)] + b"\0"
    ctypes.memmove(err, data, len(data))


class Param:
    """One engine parameter: SGLang name, safetensors dtype, engine-form shape, kind ("plain",
    "packed": INT4 Marlin int32, "scale": permuted INT4 scales, "zeros": AWQ-Marlin zero points),
    its bytes in the segment, or on CUDA device `device` (-1: the segment, host memory)."""

    KINDS = ("plain", "packed", "scale", "zeros")

    def __init__(self, info: _engine_host.ParamInfo) -> None:
        self.name = info.name.decode()
        self.dtype = info.dtype.decode()
        self.shape = tuple(info.shape[i] for i in range(info.ndim))
        self.nbytes = int(info.nbytes)
        self.kind = self.KINDS[info.kind]
        self.address = int(info.data)
        self.device = int(info.device)


class Linear:
    """One GEMM weight of the engine: `name` of its bf16 weight, `quantized` (then held as
    name_packed + name_scale), `shape` of the dense weight ([n, k] or [experts, n, k])."""

    def __init__(self, info: _engine_host.LinearInfo) -> None:
        self.name = info.name.decode()
        self.quantized = bool(info.quantized)
        self.shape = (int(info.experts), int(info.n), int(info.k)) if info.experts else (int(info.n), int(info.k))


class Source:
    """One tensor of the HF checkpoint and where the engine keeps it (wsync_engine_source_info):
    action "copy" (the block of `param`'s loaded form described by expert / dst_row0 / dst_col0 /
    rows / cols / transpose), "shape" (an INT4 weight_shape: `shape_values`), "skip" (not held)."""

    ACTIONS = ("copy", "shape", "skip")

    def __init__(self, info: _engine_host.SourceInfo) -> None:
        self.hf_name = info.hf_name.decode()
        self.dtype = info.dtype.decode()
        self.shape = tuple(info.shape[i] for i in range(info.ndim))
        self.action = self.ACTIONS[info.action]
        self.param = info.param.decode()
        self.expert, self.transpose = int(info.expert), bool(info.transpose)
        self.dst_row0, self.dst_col0, self.rows, self.cols = info.dst_row0, info.dst_col0, info.rows, info.cols
        self.shape_values = (info.shape_values[0], info.shape_values[1])


class _CudaBytes:
    """`nbytes` bytes of CUDA memory at `address`, as the CUDA array interface (version 3) describes
    them: what torch.as_tensor wraps without a copy."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3}


class _Segment:
    """An engine rank's parameters in a segment: the lists and the accessors EngineHost and
    EngineView share."""

    _lib: ctypes.CDLL
    _h: Optional[ctypes.c_void_p]

    def _list(self, h: ctypes.c_void_p, engine_id: str, config_json: str, quant_json: Optional[str]) -> None:
        self._h = h
        self.engine_id = engine_id
        self.quant_json = quant_json or ""
        self.config = json.loads(config_json)
        self.params: Dict[str, Param] = {}
        for i in range(self._lib.wsync_engine_param_count(h)):
            pinfo = _engine_host.ParamInfo()
            _check(self._lib, self._lib.wsync_engine_param(h, i, ctypes.byref(pinfo)), "param")
            p = Param(pinfo)
            self.params[p.name] = p
        self.linears: Dict[str, Linear] = {}
        for i in range(self._lib.wsync_engine_linear_count(h)):
            linfo = _engine_host.LinearInfo()
            _check(self._lib, self._lib.wsync_engine_linear(h, i, ctypes.byref(linfo)), "linear")
            lin = Linear(linfo)
            self.linears[lin.name] = lin
        self.sources: List[Source] = []
        for i in range(self._lib.wsync_engine_source_count(h)):
            sinfo = _engine_host.SourceInfo()
            _check(self._lib, self._lib.wsync_engine_source(h, i, ctypes.byref(sinfo)), "source")
            self.sources.append(Source(sinfo))

    # --- the parameters -------------------------------------------------------------------------
    def buffer(self, name: str) -> ctypes.Array[ctypes.c_char]:
        """A writable ctypes char array over the parameter's bytes in the segment (valid until close).
        Host memory only: a param in CUDA memory has no such view (WsyncError FAILED_PRECONDITION)."""
        p = self._param(name)
        if p.device >= 0:
            raise WsyncError(9, f"engine {self.engine_id}: {name} is in CUDA memory (cuda:{p.device}); use tensor()")
        # A fresh array per call: torch 1.13's frombuffer releases the exporter once too often when
        # its tensor dies, so a cached array would be freed under the next tensor made from it.
        return (ctypes.c_char * p.nbytes).from_address(p.address)

    def tensor(self, name: str) -> "Tensor":
        """The parameter as a torch tensor over the segment's bytes (no copy), engine-form shape."""
        import torch

        if int(torch.__version__.split(".")[0]) < 2:
            raise WsyncError(9, f"wsync.engine needs torch >= 2, not {torch.__version__} (torch 1.13 crashed "
                                "reading the segment on the host's callback threads)")

        p = self._param(name)
        if p.device >= 0:  # a view of the CUDA allocation, through the CUDA array interface (no copy)
            raw = torch.as_tensor(_CudaBytes(p.address, p.nbytes), device=f"cuda:{p.device}")
            return raw.view(torch_dtype(p.dtype)).view(p.shape)
        return torch.frombuffer(self.buffer(name), dtype=torch_dtype(p.dtype)).view(p.shape)

    def loaded(self, name: str) -> "Tensor":
        """The parameter in its loaded form (wsync_engine_loaded): the segment's tensor itself for a
        plain one (no copy), a restored copy for INT4 (compressed-tensors / GPTQ orientation)."""
        import torch

        p = self._param(name)
        if p.kind == "plain":
            return self.tensor(name)
        # The same element count as the engine form (Marlin is a permutation of it).
        out = torch.empty(p.nbytes // ITEMSIZE[p.dtype], dtype=torch_dtype(p.dtype))
        shape = (ctypes.c_int64 * 4)()
        _check(self._lib, self._lib.wsync_engine_loaded(self._h, name.encode(), out.data_ptr(), p.nbytes, shape), name)
        return out.view(tuple(int(d) for d in shape if d))

    def hf_tensors(self) -> Iterator[Tuple[str, "Tensor"]]:
        """Yields (HF checkpoint name, tensor) for every tensor the engine holds, as an HF
        checkpoint of this engine rank would hold them (TP 1: whole tensors): views of the segment
        for plain params, restored copies for INT4 (compressed-tensors weight_packed [N, K/8],
        weight_scale [N, K/G], weight_shape). What a weight loader (vLLM's load_weights) takes."""
        import torch

        loaded = {}
        for s in self.sources:
            if s.action == "skip":
                continue
            if s.action == "shape":
                yield s.hf_name, torch.tensor(list(s.shape_values)[: s.shape[0]], dtype=torch_dtype(s.dtype))
                continue
            if s.param not in loaded:
                loaded[s.param] = self.loaded(s.param)
            t = loaded[s.param]
            m = t[s.expert] if t.dim() == 3 else t
            if m.dim() == 1:
                m = m.view(-1, 1)
            if s.transpose:
                block = m[s.dst_row0:s.dst_row0 + s.cols, s.dst_col0:s.dst_col0 + s.rows].t()
            else:
                block = m[s.dst_row0:s.dst_row0 + s.rows, s.dst_col0:s.dst_col0 + s.cols]
            if tuple(block.shape) != (s.rows, s.cols) or s.rows * s.cols != _numel(s.shape):
                raise WsyncError(13, f"{s.hf_name}: the block of {s.param} is {list(block.shape)}, the tensor "
                                     f"{list(s.shape)} (this engine rank holds part of it: TP 1 only)")
            yield s.hf_name, block.reshape(s.shape)

    def dense_bf16(self, linear_name: str, out: Optional["Tensor"] = None) -> "Tensor":
        """The linear's weight as bf16 in HF orientation ([n, k] / [experts, n, k]; INT4
        dequantized); written into `out` (a contiguous bf16 torch tensor of that shape) if given."""
        import torch

        if linear_name not in self.linears:
            raise WsyncError(5, f"engine {self.engine_id}: no linear '{linear_name}'")
        lin = self.linears[linear_name]
        if out is None:
            out = torch.empty(lin.shape, dtype=torch.bfloat16)
        if out.dtype != torch.bfloat16 or not out.is_contiguous() or tuple(out.shape) != lin.shape:
            raise WsyncError(3, f"{linear_name}: want a contiguous bf16 tensor {list(lin.shape)}, got "
                                f"{out.dtype} {list(out.shape)}")
        _check(self._lib, self._lib.wsync_engine_dense_bf16(self._h, linear_name.encode(), out.data_ptr(),
                                                            out.numel() * 2), linear_name)
        return out

    def _param(self, name: str) -> Param:
        if name not in self.params:
            raise WsyncError(5, f"engine {self.engine_id}: no parameter '{name}'")
        return self.params[name]


class EngineHost(_Segment):
    """See the module comment. `adapter` has prepare(version) and (optionally) generate(prompt,
    max_new_tokens); it may be attached after construction (attach()), before start().
    `param_memory`: None or "shm" (the segment), or "cuda:N" (one CUDA allocation on device N,
    registered with the agent by IPC handle: tensor() gives CUDA tensors over it)."""

    def __init__(self, engine_id: str, config_json: str, agent: Optional[str] = None, agent_file: Optional[str] = None,
                 quant_json: Optional[str] = None, listen: str = "127.0.0.1:0", token_file: Optional[str] = None,
                 hold_timeout: float = 600.0, checkpoint: Optional[str] = None,
                 param_memory: Optional[str] = None) -> None:
        self._lib = _engine_host.library()
        self._adapter: Optional[object] = None
        self._prepare_cb = _engine_host.PREPARE(self._on_prepare)
        self._generate_cb = _engine_host.GENERATE(self._on_generate)
        self._pause_cb = _engine_host.PAUSE(self._on_pause)
        self._continue_cb = _engine_host.CONTINUE(self._on_continue)
        opts = _engine_host.Options(engine_id=engine_id.encode(), config_json=config_json.encode(),
                        quant_json=(quant_json or "").encode(), listen=listen.encode(),
                        agent=agent.encode() if agent else None, agent_file=agent_file.encode() if agent_file else None,
                        token_file=token_file.encode() if token_file else None, prepare=self._prepare_cb,
                        generate=self._generate_cb, ctx=None, hold_timeout_s=float(hold_timeout),
                        checkpoint=checkpoint.encode() if checkpoint else None, on_pause=self._pause_cb,
                        on_continue=self._continue_cb,
                        param_memory=param_memory.encode() if param_memory else None)
        h = ctypes.c_void_p()
        _check(self._lib, self._lib.wsync_engine_create(ctypes.byref(opts), ctypes.byref(h)), f"engine {engine_id}")
        self._list(h, engine_id, config_json, quant_json)
        _HOSTS[engine_id] = self

    def attach_info(self) -> str:
        """What EngineView needs to map this host's segment in another process (a JSON string)."""
        return self._lib.wsync_engine_attach_info(self._h).decode()

    # --- serving --------------------------------------------------------------------------------
    def attach(self, adapter: object) -> None:
        """Makes `adapter` this host's engine (prepare, generate, on_pause, on_continue: module comment)."""
        self._adapter = adapter

    def start(self) -> str:
        """Prepares the checkpoint given at construction (version 0), serves RolloutEngine and
        registers with the agent; returns the address served."""
        if self._adapter is None:
            raise WsyncError(9, f"engine {self.engine_id}: attach an adapter before start()")
        _check(self._lib, self._lib.wsync_engine_start(self._h), f"engine {self.engine_id}: start")
        return self.address

    @property
    def address(self) -> str:
        return self._lib.wsync_engine_address(self._h).decode()

    @contextlib.contextmanager
    def request(self, timeout: float = 600.0) -> Iterator[int]:
        """Admits one request (waits while a sync holds the engine); yields the weight version it runs on."""
        v = ctypes.c_uint64()
        _check(self._lib, self._lib.wsync_engine_begin_request(self._h, int(timeout * 1000), ctypes.byref(v)),
               f"engine {self.engine_id}")
        try:
            yield v.value
        finally:
            self._lib.wsync_engine_end_request(self._h)

    def stopped(self) -> bool:
        """Inside a request: True once a sync paused the engine with ABORT (stop computing)."""
        return self._lib.wsync_engine_request_stopped(self._h) != 0

    def update_weights(self, min_version: int = 0, timeout: float = 60.0) -> int:
        """Brings this engine to a version >= min_version (0: the newest published) through its
        rollout agent, copied from a peer or by the next sync (wsync_engine_update_weights); returns
        the version served. Not inside a request(). For asynchronous RL: between batches."""
        v = ctypes.c_uint64()
        _check(self._lib, self._lib.wsync_engine_update_weights(self._h, int(min_version), int(timeout * 1000),
                                                                ctypes.byref(v)), f"engine {self.engine_id}")
        return v.value

    STATES = {1: "SERVING", 2: "PAUSED", 3: "NO_WEIGHTS", 4: "UNHEALTHY"}

    def health(self) -> Tuple[str, int]:
        """(state name, version served)."""
        state, version = ctypes.c_int(), ctypes.c_uint64()
        _check(self._lib, self._lib.wsync_engine_health(self._h, ctypes.byref(state), ctypes.byref(version)), "health")
        return self.STATES.get(state.value, str(state.value)), version.value

    def close(self) -> None:
        """Stops serving and unmaps the segment (its tensors die with it)."""
        if self._h:
            _HOSTS.pop(self.engine_id, None)
            self._lib.wsync_engine_destroy(self._h)
            self._h = None

    def __enter__(self) -> "EngineHost":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- callbacks (gRPC threads) ---------------------------------------------------------------
    def _call_adapter(self, hook_name: str, err: int, err_len: int, *args: Any) -> int:
        """Calls the adapter's hook (a missing optional hook is a success); an exception becomes
        the C callback's error (reported to the agent, never raised into C)."""
        hook = getattr(self._adapter, hook_name, None)
        if hook is None:
            return 0
        try:
            hook(*args)
            return 0
        except BaseException as e:  # noqa: BLE001
            _write_err(err, err_len, f"{type(e).__name__}: {e}")
            return 1

    def _on_prepare(self, _ctx: Optional[int], version: int, err: int, err_len: int) -> int:
        if getattr(self._adapter, "prepare", None) is None:
            _write_err(err, err_len, "the adapter has no prepare()")
            return 1
        return self._call_adapter("prepare", err, err_len, int(version))

    def _on_pause(self, _ctx: Optional[int], mode: int, err: int, err_len: int) -> int:
        return self._call_adapter("on_pause", err, err_len, "ABORT" if mode == 2 else "HOLD")

    def _on_continue(self, _ctx: Optional[int], version: int, err: int, err_len: int) -> int:
        return self._call_adapter("on_continue", err, err_len, int(version))

    def _on_generate(self, _ctx: Optional[int], prompt: Any, n: int, max_new: int, out: Any, out_len: Any, err: int,
                     err_len: int) -> int:
        try:
            gen = getattr(self._adapter, "generate", None)
            if gen is None:
                raise NotImplementedError("the adapter has no generate()")
            tokens = list(gen([prompt[i] for i in range(n)], int(max_new)))
            if len(tokens) > max_new:
                raise ValueError(f"generate returned {len(tokens)} tokens for max_new_tokens {max_new}")
            for i, t in enumerate(tokens):
                out[i] = int(t)
            out_len[0] = len(tokens)
            return 0
        except BaseException as e:  # noqa: BLE001
            _write_err(err, err_len, f"{type(e).__name__}: {e}")
            return 1


class EngineView(_Segment):
    """Another process's read-only view of an EngineHost's segment (a vLLM worker process beside
    the host's), from the host's attach_info(): the same params / linears / sources and tensor(),
    loaded(), hf_tensors(), dense_bf16(); it serves nothing. Same user only (the segment is 0600)."""

    def __init__(self, attach_info: str) -> None:
        self._lib = _engine_host.library()
        h = ctypes.c_void_p()
        _check(self._lib, self._lib.wsync_engine_attach(attach_info.encode(), ctypes.byref(h)), "attaching")
        info = json.loads(attach_info)
        self._list(h, info.get("engine_id", "attached"), info["config_json"], info.get("quant_json", ""))

    def close(self) -> None:
        """Unmaps the segment (its tensors die with it)."""
        if self._h:
            self._lib.wsync_engine_destroy(self._h)
            self._h = None


if __name__ == "__main__":
    # `python -m wsync.engine`: the same process as `python -m wsync` (wsync/__main__.py), run by
    # name (the library does not import its CLI). That main uses the imported wsync.engine, not this
    # __main__ copy of the module, whose registry of hosts no adapter would see.
    import runpy

    runpy.run_module("wsync", run_name="__main__", init_globals={"PROG": "python -m wsync.engine"})
