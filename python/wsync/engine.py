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

``TransformersEngine`` is the adapter for a HuggingFace transformers model (a CPU engine for
small RL loops): every bf16 parameter of the model *is* a view of the segment (no copy: a sync
writes the model's weights), INT4 linears are dequantized into the model's own bf16 parameters at
``prepare``. ``python -m wsync.engine`` runs it as a process with wsync-ref-engine's flags.

Errors: every failure raises wsync.WsyncError (code_name, message) naming what is wrong; a failed
constructor leaves nothing behind.
"""

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import threading

from wsync import _native
from wsync._native import WsyncError
from wsync.trainer import ITEMSIZE, torch_dtype

_LIB = "libwsync_engine_host.so"
_ABI_VERSION = 1

_PREPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)
_GENERATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                             ctypes.c_uint32, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_size_t),
                             ctypes.c_void_p, ctypes.c_size_t)


_PAUSE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_CONTINUE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)


class _Options(ctypes.Structure):
    _fields_ = [("engine_id", ctypes.c_char_p), ("config_json", ctypes.c_char_p), ("quant_json", ctypes.c_char_p),
                ("listen", ctypes.c_char_p), ("agent", ctypes.c_char_p), ("agent_file", ctypes.c_char_p),
                ("token_file", ctypes.c_char_p), ("prepare", _PREPARE), ("generate", _GENERATE),
                ("ctx", ctypes.c_void_p), ("hold_timeout_s", ctypes.c_double), ("checkpoint", ctypes.c_char_p),
                ("on_pause", _PAUSE), ("on_continue", _CONTINUE)]


class _ParamInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_char_p), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * 4), ("nbytes", ctypes.c_uint64), ("data", ctypes.c_void_p),
                ("kind", ctypes.c_int)]


class _LinearInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("quantized", ctypes.c_int), ("experts", ctypes.c_int64),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _SourceInfo(ctypes.Structure):
    _fields_ = [("hf_name", ctypes.c_char_p), ("dtype", ctypes.c_char_p), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * 4), ("action", ctypes.c_int), ("param", ctypes.c_char_p),
                ("expert", ctypes.c_int64), ("transpose", ctypes.c_int), ("dst_row0", ctypes.c_int64),
                ("dst_col0", ctypes.c_int64), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("shape_values", ctypes.c_int64 * 2)]


def _declare(lib):
    P = ctypes.c_void_p
    for name, res, args in [
        ("wsync_engine_last_error", ctypes.c_char_p, []),
        ("wsync_engine_abi_version", ctypes.c_int, []),
        ("wsync_engine_create", ctypes.c_int, [ctypes.POINTER(_Options), ctypes.POINTER(P)]),
        ("wsync_engine_param_count", ctypes.c_size_t, [P]),
        ("wsync_engine_param", ctypes.c_int, [P, ctypes.c_size_t, ctypes.POINTER(_ParamInfo)]),
        ("wsync_engine_linear_count", ctypes.c_size_t, [P]),
        ("wsync_engine_linear", ctypes.c_int, [P, ctypes.c_size_t, ctypes.POINTER(_LinearInfo)]),
        ("wsync_engine_dense_bf16", ctypes.c_int, [P, ctypes.c_char_p, P, ctypes.c_uint64]),
        ("wsync_engine_attach_info", ctypes.c_char_p, [P]),
        ("wsync_engine_attach", ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(P)]),
        ("wsync_engine_source_count", ctypes.c_size_t, [P]),
        ("wsync_engine_source", ctypes.c_int, [P, ctypes.c_size_t, ctypes.POINTER(_SourceInfo)]),
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


def library():
    """libwsync_engine_host, loaded once per process ($WSYNC_ENGINE_HOST, the package, build/lib)."""
    return _native.load(_LIB, "WSYNC_ENGINE_HOST", _declare, "wsync_engine_abi_version", _ABI_VERSION)


_HOSTS = {}  # engine id -> the EngineHost of this process (wsync.vllm's weight-transfer backend finds it here)


def host_of(engine_id):
    """The EngineHost of this process serving `engine_id`; WsyncError(NOT_FOUND) otherwise."""
    if engine_id not in _HOSTS:
        raise WsyncError(5, f"no wsync engine host '{engine_id}' in this process (pid {os.getpid()}); hosts: "
                            f"{sorted(_HOSTS) or 'none'}")
    return _HOSTS[engine_id]


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _check(lib, rc, what):
    _native.check(lib, rc, what, last_error="wsync_engine_last_error")


def _write_err(err, err_len, message):
    data = message.encode("utf-8", "replace")[: max(0, err_len - 1)] + b"\0"
    ctypes.memmove(err, data, len(data))


class Param:
    """One engine parameter: SGLang name, safetensors dtype, engine-form shape, kind ("plain",
    "packed": INT4 Marlin int32, "scale": permuted INT4 scales, "zeros": AWQ-Marlin zero points),
    its bytes in the segment."""

    KINDS = ("plain", "packed", "scale", "zeros")

    def __init__(self, info):
        self.name = info.name.decode()
        self.dtype = info.dtype.decode()
        self.shape = tuple(info.shape[i] for i in range(info.ndim))
        self.nbytes = int(info.nbytes)
        self.kind = self.KINDS[info.kind]
        self.address = int(info.data)


class Linear:
    """One GEMM weight of the engine: `name` of its bf16 weight, `quantized` (then held as
    name_packed + name_scale), `shape` of the dense weight ([n, k] or [experts, n, k])."""

    def __init__(self, info):
        self.name = info.name.decode()
        self.quantized = bool(info.quantized)
        self.shape = (int(info.experts), int(info.n), int(info.k)) if info.experts else (int(info.n), int(info.k))


class Source:
    """One tensor of the HF checkpoint and where the engine keeps it (wsync_engine_source_info):
    action "copy" (the block of `param`'s loaded form described by expert / dst_row0 / dst_col0 /
    rows / cols / transpose), "shape" (an INT4 weight_shape: `shape_values`), "skip" (not held)."""

    ACTIONS = ("copy", "shape", "skip")

    def __init__(self, info):
        self.hf_name = info.hf_name.decode()
        self.dtype = info.dtype.decode()
        self.shape = tuple(info.shape[i] for i in range(info.ndim))
        self.action = self.ACTIONS[info.action]
        self.param = info.param.decode()
        self.expert, self.transpose = int(info.expert), bool(info.transpose)
        self.dst_row0, self.dst_col0, self.rows, self.cols = info.dst_row0, info.dst_col0, info.rows, info.cols
        self.shape_values = (info.shape_values[0], info.shape_values[1])




class _Segment:
    """An engine rank's parameters in a segment: the lists and the accessors EngineHost and
    EngineView share."""

    def _list(self, h, engine_id, config_json, quant_json):
        self._h = h
        self.engine_id = engine_id
        self.quant_json = quant_json or ""
        self.config = json.loads(config_json)
        self.params = {}
        for i in range(self._lib.wsync_engine_param_count(h)):
            info = _ParamInfo()
            _check(self._lib, self._lib.wsync_engine_param(h, i, ctypes.byref(info)), "param")
            p = Param(info)
            self.params[p.name] = p
        self.linears = {}
        for i in range(self._lib.wsync_engine_linear_count(h)):
            info = _LinearInfo()
            _check(self._lib, self._lib.wsync_engine_linear(h, i, ctypes.byref(info)), "linear")
            lin = Linear(info)
            self.linears[lin.name] = lin
        self.sources = []
        for i in range(self._lib.wsync_engine_source_count(h)):
            info = _SourceInfo()
            _check(self._lib, self._lib.wsync_engine_source(h, i, ctypes.byref(info)), "source")
            self.sources.append(Source(info))

    # --- the parameters -------------------------------------------------------------------------
    def buffer(self, name):
        """A writable ctypes char array over the parameter's bytes in the segment (valid until close)."""
        p = self._param(name)
        # A fresh array per call: torch 1.13's frombuffer releases the exporter once too often when
        # its tensor dies, so a cached array would be freed under the next tensor made from it.
        return (ctypes.c_char * p.nbytes).from_address(p.address)

    def tensor(self, name):
        """The parameter as a torch tensor over the segment's bytes (no copy), engine-form shape."""
        import torch

        if int(torch.__version__.split(".")[0]) < 2:
            raise WsyncError(9, f"wsync.engine needs torch >= 2, not {torch.__version__} (torch 1.13 crashed "
                                "reading the segment on the host's callback threads)")

        p = self._param(name)
        return torch.frombuffer(self.buffer(name), dtype=torch_dtype(p.dtype)).view(p.shape)

    def loaded(self, name):
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

    def hf_tensors(self):
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

    def dense_bf16(self, linear_name, out=None):
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

    def _param(self, name):
        if name not in self.params:
            raise WsyncError(5, f"engine {self.engine_id}: no parameter '{name}'")
        return self.params[name]


class EngineHost(_Segment):
    """See the module comment. `adapter` has prepare(version) and (optionally) generate(prompt,
    max_new_tokens); it may be attached after construction (attach()), before start()."""

    def __init__(self, engine_id, config_json, agent=None, agent_file=None, quant_json=None, listen="127.0.0.1:0",
                 token_file=None, hold_timeout=600.0, checkpoint=None):
        self._lib = library()
        self._adapter = None
        self._prepare_cb = _PREPARE(self._on_prepare)
        self._generate_cb = _GENERATE(self._on_generate)
        self._pause_cb = _PAUSE(self._on_pause)
        self._continue_cb = _CONTINUE(self._on_continue)
        opts = _Options(engine_id=engine_id.encode(), config_json=config_json.encode(),
                        quant_json=(quant_json or "").encode(), listen=listen.encode(),
                        agent=agent.encode() if agent else None, agent_file=agent_file.encode() if agent_file else None,
                        token_file=token_file.encode() if token_file else None, prepare=self._prepare_cb,
                        generate=self._generate_cb, ctx=None, hold_timeout_s=float(hold_timeout),
                        checkpoint=checkpoint.encode() if checkpoint else None, on_pause=self._pause_cb,
                        on_continue=self._continue_cb)
        h = ctypes.c_void_p()
        _check(self._lib, self._lib.wsync_engine_create(ctypes.byref(opts), ctypes.byref(h)), f"engine {engine_id}")
        self._list(h, engine_id, config_json, quant_json)
        _HOSTS[engine_id] = self

    def attach_info(self):
        """What EngineView needs to map this host's segment in another process (a JSON string)."""
        return self._lib.wsync_engine_attach_info(self._h).decode()

    # --- serving --------------------------------------------------------------------------------
    def attach(self, adapter):
        self._adapter = adapter

    def start(self):
        """Prepares the checkpoint given at construction (version 0), serves RolloutEngine and
        registers with the agent; returns the address served."""
        if self._adapter is None:
            raise WsyncError(9, f"engine {self.engine_id}: attach an adapter before start()")
        _check(self._lib, self._lib.wsync_engine_start(self._h), f"engine {self.engine_id}: start")
        return self.address

    @property
    def address(self):
        return self._lib.wsync_engine_address(self._h).decode()

    @contextlib.contextmanager
    def request(self, timeout=600.0):
        """Admits one request (waits while a sync holds the engine); yields the weight version it runs on."""
        v = ctypes.c_uint64()
        _check(self._lib, self._lib.wsync_engine_begin_request(self._h, int(timeout * 1000), ctypes.byref(v)),
               f"engine {self.engine_id}")
        try:
            yield v.value
        finally:
            self._lib.wsync_engine_end_request(self._h)

    def stopped(self):
        """Inside a request: True once a sync paused the engine with ABORT (stop computing)."""
        return self._lib.wsync_engine_request_stopped(self._h) != 0

    def update_weights(self, min_version=0, timeout=60.0):
        """Brings this engine to a version >= min_version (0: the newest published) through its
        rollout agent, copied from a peer or by the next sync (wsync_engine_update_weights); returns
        the version served. Not inside a request(). For asynchronous RL: between batches."""
        v = ctypes.c_uint64()
        _check(self._lib, self._lib.wsync_engine_update_weights(self._h, int(min_version), int(timeout * 1000),
                                                                ctypes.byref(v)), f"engine {self.engine_id}")
        return v.value

    STATES = {1: "SERVING", 2: "PAUSED", 3: "NO_WEIGHTS", 4: "UNHEALTHY"}

    def health(self):
        """(state name, version served)."""
        state, version = ctypes.c_int(), ctypes.c_uint64()
        _check(self._lib, self._lib.wsync_engine_health(self._h, ctypes.byref(state), ctypes.byref(version)), "health")
        return self.STATES.get(state.value, str(state.value)), version.value

    def close(self):
        if self._h:
            _HOSTS.pop(self.engine_id, None)
            self._lib.wsync_engine_destroy(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- callbacks (gRPC threads) ---------------------------------------------------------------
    def _call_adapter(self, hook_name, err, err_len, *args):
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

    def _on_prepare(self, _ctx, version, err, err_len):
        if getattr(self._adapter, "prepare", None) is None:
            _write_err(err, err_len, "the adapter has no prepare()")
            return 1
        return self._call_adapter("prepare", err, err_len, int(version))

    def _on_pause(self, _ctx, mode, err, err_len):
        return self._call_adapter("on_pause", err, err_len, "ABORT" if mode == 2 else "HOLD")

    def _on_continue(self, _ctx, version, err, err_len):
        return self._call_adapter("on_continue", err, err_len, int(version))

    def _on_generate(self, _ctx, prompt, n, max_new, out, out_len, err, err_len):
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

    def __init__(self, attach_info):
        self._lib = library()
        h = ctypes.c_void_p()
        _check(self._lib, self._lib.wsync_engine_attach(attach_info.encode(), ctypes.byref(h)), "attaching")
        info = json.loads(attach_info)
        self._list(h, info.get("engine_id", "attached"), info["config_json"], info.get("quant_json", ""))

    def close(self):
        if self._h:
            self._lib.wsync_engine_destroy(self._h)
            self._h = None


# --- transformers ----------------------------------------------------------------------------------

def _hf_source(name, cfg):
    """Where transformers parameter `name` lives in the SGLang engine form: (engine tensor name,
    row0, rows or None for all), TP 1. The engine tensor is a linear's weight name or a param name."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * hd
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    for proj, (r0, rows) in (("q_proj", (0, q)), ("k_proj", (q, kv)), ("v_proj", (q + kv, kv))):
        for suffix in (".weight", ".bias"):
            tail = f".self_attn.{proj}{suffix}"
            if name.endswith(tail):
                return name[: -len(tail)] + f".self_attn.qkv_proj{suffix}", r0, rows
    if cfg.get("q_lora_rank"):  # MLA (DeepSeek-V3): SGLang fuses q_a_proj and kv_a_proj_with_mqa, in that order
        qa, kva = cfg["q_lora_rank"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        for proj, (r0, rows) in (("q_a_proj", (0, qa)), ("kv_a_proj_with_mqa", (qa, kva))):
            tail = f".self_attn.{proj}.weight"
            if name.endswith(tail):
                return name[: -len(tail)] + ".self_attn.fused_qkv_a_proj_with_mqa.weight", r0, rows
    for proj, half in (("gate_proj", 0), ("up_proj", 1)):
        tail = f".{proj}.weight"
        if name.endswith(tail) and ".experts." not in name:
            return name[: -len(tail)] + ".gate_up_proj.weight", half, None  # half: resolved by the caller
    if name.endswith(".mlp.experts.gate_up_proj"):
        return name[: -len("gate_up_proj")] + "w13_weight", 0, None
    if name.endswith(".mlp.experts.down_proj"):
        return name[: -len("down_proj")] + "w2_weight", 0, None
    if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
        return "model.embed_tokens.weight", 0, cfg["vocab_size"]  # the engine holds no lm_head (tied)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return name, 0, cfg["vocab_size"]
    return name, 0, None


class TransformersEngine:
    """A HuggingFace transformers causal LM served from the engine host's segment (module comment).
    Its weights are bound at construction: every parameter and every persistent buffer (a weight
    a checkpoint holds, e.g. DeepSeek-V3's e_score_correction_bias), under each name it has (a tied
    lm_head included), is a view of the segment, or, for an INT4 linear or an engine tensor of
    another dtype, a tensor of its own that prepare() refills from the segment at every version.
    No copy made at load time survives a sync. Every weight must have a source of its shape in the
    engine, else WsyncError(INVALID_ARGUMENT) names every one that does not."""

    def __init__(self, host, model=None):
        import torch
        import transformers

        self.host = host
        self.torch = torch
        cfg = host.config
        if model is None:
            hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
        self.model = model.eval()
        self._dequantized = []  # (linear name, the model's tensor, row0, rows)
        self._converted = []  # (engine param name, the model's tensor, row0, rows): the engine's dtype differs
        problems = []
        bound = set()  # id of each Parameter bound: one under two names (a tied lm_head) is bound once
        with torch.no_grad():
            for name, param in self.model.named_parameters(remove_duplicate=False):
                try:
                    if id(param) not in bound:
                        param.data = self._bind(name, param, cfg)
                        bound.add(id(param))
                except WsyncError as e:
                    problems.append(e.message)
            for prefix, module in self.model.named_modules():
                for bname, buf in list(module._buffers.items()):
                    if buf is None or bname in module._non_persistent_buffers_set:
                        continue  # a non-persistent buffer (rotary inv_freq) is computed from the config
                    try:  # in the engine's dtype (DeepSeek-V3's F32 bias: transformers keeps it in fp32 too)
                        module._buffers[bname] = self._bind(f"{prefix}.{bname}" if prefix else bname, buf, cfg,
                                                            engine_dtype=True)
                    except WsyncError as e:
                        problems.append(e.message)
        if problems:
            raise WsyncError(3, f"engine {host.engine_id}: the transformers model does not fit the engine's "
                                f"parameters: " + "; ".join(problems))
        host.attach(self)

    def _bind(self, name, current, cfg, engine_dtype=False):
        """The tensor that serves model weight `name` (its current tensor `current`), in current's
        dtype or with `engine_dtype` the engine's: a view of the segment, or a tensor of its own
        recorded for prepare() to refill."""
        torch = self.torch
        shape = tuple(current.shape)
        src, row0, rows = _hf_source(name, cfg)
        host = self.host
        lin = host.linears.get(src)
        quantized = lin is not None and lin.quantized
        if not quantized:
            if src not in host.params:
                raise WsyncError(5, f"{name}: the engine has no {src}")
            p = host.params[src]
            if p.kind != "plain" or p.dtype not in ("BF16", "F32"):
                raise WsyncError(3, f"{name}: the engine's {src} is {p.dtype} {p.kind}")
        full = lin.shape if quantized else host.params[src].shape
        if src.endswith(".gate_up_proj.weight"):  # row0 is the half: 0 gate, 1 up
            rows = full[0] // 2
            row0 *= rows
        take = full[0] if rows is None else rows
        want = (take,) + tuple(full[1:])
        if want != shape or row0 + take > full[0]:
            raise WsyncError(3, f"{name} {list(shape)}: the engine's {src} gives {list(want)}")
        if quantized:
            t = torch.zeros(shape, dtype=torch.bfloat16)
            self._dequantized.append((src, t, row0, rows))
            return t
        view = host.tensor(src)
        view = view if rows is None else view[row0:row0 + rows]
        dtype = view.dtype if engine_dtype else current.dtype
        if view.dtype == dtype:
            return view
        t = view.to(dtype)  # refilled at every prepare
        self._converted.append((src, t, row0, rows))
        return t

    def prepare(self, version):
        """The segment holds `version`: dequantize the INT4 linears into the model's tensors, refill
        the converted ones; check every weight is finite (a NaN refuses the version, naming it)."""
        torch = self.torch
        dense = {}
        with torch.no_grad():
            for src, t, row0, rows in self._dequantized:
                if src not in dense:
                    dense[src] = self.host.dense_bf16(src)
                d = dense[src]
                t.copy_(d if rows is None else d[row0:row0 + rows])
            for src, t, row0, rows in self._converted:
                v = self.host.tensor(src)
                t.copy_(v if rows is None else v[row0:row0 + rows])
            for name, p in self.model.named_parameters():
                if not torch.isfinite(p).all():
                    raise ValueError(f"version {version}: {name} holds NaN or Inf")

    def generate(self, prompt, max_new_tokens):
        """Greedy decoding (model.generate), exactly max_new_tokens new tokens."""
        torch = self.torch
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                      eos_token_id=None, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    def generate_request(self, prompt, max_new_tokens, timeout=600.0):
        """generate() admitted by the host: (tokens, the weight version they were computed with)."""
        with self.host.request(timeout) as version:
            return self.generate(prompt, max_new_tokens), version


# --- the process: python -m wsync.engine -----------------------------------------------------------

def _quant_json(args, config):
    if args.quant_config == "none":
        return ""
    if args.quant_config:
        with open(args.quant_config) as f:
            j = json.load(f)
        return json.dumps(j.get("quantization_config", j))
    q = config.get("quantization_config")
    return json.dumps(q) if q else ""


def _model_dir(config, quant_json):
    """A directory holding config.json with the quantization_config the engine serves (vLLM reads a
    model directory); removed at exit."""
    import atexit
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="wsync-engine-model-")
    atexit.register(shutil.rmtree, d, True)
    config = dict(config)
    config.pop("quantization_config", None)
    if quant_json:
        config["quantization_config"] = json.loads(quant_json)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m wsync.engine",
                                 description="A transformers model, vLLM or SGLang served as a wsync rollout engine (TP 1).")
    ap.add_argument("--adapter", choices=("transformers", "vllm", "sglang"), default="transformers")
    ap.add_argument("--sglang-url", default="", help="sglang: the SGLang server, e.g. http://127.0.0.1:30000")
    ap.add_argument("--model", default="", help="config.json, or a directory holding one (default: --checkpoint's)")
    ap.add_argument("--quant-config", default="", help="FILE | none (default: the config's quantization_config)")
    ap.add_argument("--checkpoint", default="", help="an HF checkpoint to serve as version 0 until the first sync")
    ap.add_argument("--engine-id", default="transformers")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--address-file", default="")
    ap.add_argument("--agent", default="")
    ap.add_argument("--agent-file", default="")
    ap.add_argument("--token-file", default="")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    import faulthandler

    faulthandler.enable()  # a crash in a callback thread prints every thread's Python stack
    if (args.tp_size, args.tp_rank, args.ep_size) != (1, 0, 1):
        ap.error(f"--tp-size {args.tp_size} --tp-rank {args.tp_rank} --ep-size {args.ep_size}: "
                 "this engine serves TP 1, EP 1")
    if not args.agent and not args.agent_file:
        ap.error("--agent or --agent-file is required")
    model = args.model or args.checkpoint
    if not model:
        ap.error("--model or --checkpoint is required")
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    with open(path) as f:
        config_text = f.read()
    config = json.loads(config_text)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        host = EngineHost(args.engine_id, config_text, agent=args.agent or None, agent_file=args.agent_file or None,
                          quant_json=_quant_json(args, config), listen=args.listen,
                          token_file=args.token_file or None, checkpoint=args.checkpoint or None)
        if args.adapter == "sglang":
            from wsync.sglang import SglangEngine

            if not args.sglang_url:
                ap.error("--adapter sglang needs --sglang-url")
            SglangEngine(host, args.sglang_url)
        elif args.adapter == "vllm":
            from wsync.vllm import VllmEngine, start_llm

            VllmEngine(host, start_llm(_model_dir(config, host.quant_json), load_format="dummy"))
        else:
            TransformersEngine(host)
        address = host.start()
    except WsyncError as e:
        print(f"wsync.engine: {e}", file=sys.stderr)
        return 1
    print(f"listening on {address}", flush=True)
    if args.address_file:
        tmp = f"{args.address_file}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(address + "\n")
        os.replace(tmp, args.address_file)
    while not stop.wait(0.2):
        pass
    host.close()
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: wsync.vllm finds hosts in
    # wsync.engine's registry, which a second copy of this module would not share.
    from wsync.engine import main as _main

    sys.exit(_main())
