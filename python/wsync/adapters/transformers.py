"""A HuggingFace transformers causal LM as a wsync rollout engine: the engine host's adapter
(wsync.engine.EngineHost) for small RL loops, on the CPU, or on the GPU when the host's parameters
are in CUDA memory (``EngineHost(param_memory="cuda:N")``: the model and its generation then run on
that device, over views of the host's allocation).

Every bf16 parameter of the model *is* a view of the host's segment (no copy: a sync writes the
model's weights); INT4 linears, and engine tensors of another dtype than the model's, get tensors
of their own that ``prepare`` refills from the segment at every version. ``python -m wsync
--adapter transformers`` runs it as a process. Engine TP 1.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from wsync._native import WsyncError
from wsync.engine import EngineHost

__all__ = ["TransformersEngine"]


def _hf_source(name: str, cfg: Dict[str, Any]) -> Tuple[str, int, Optional[int]]:
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
        for suffix in (".weight", ".bias"):  # the bias: Llama's mlp_bias
            tail = f".{proj}{suffix}"
            if name.endswith(tail) and ".experts." not in name:
                return name[: -len(tail)] + f".gate_up_proj{suffix}", half, None  # half: resolved by the caller
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

    def __init__(self, host: EngineHost, model: Any = None) -> None:
        import torch
        import transformers

        self.host = host
        self.torch = torch
        cfg = host.config
        devices = {p.device for p in host.params.values()}
        if len(devices) != 1:
            raise WsyncError(3, f"engine {host.engine_id}: its parameters are on several devices {sorted(devices)}")
        d = devices.pop()
        self.device = torch.device("cpu" if d < 0 else f"cuda:{d}")
        if model is None:
            hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
        self.model = model.to(self.device).eval()
        self._dequantized: List[Tuple[str, Any, int, Optional[int]]] = []  # (linear name, the model's tensor, row0, rows)
        self._converted: List[Tuple[str, Any, int, Optional[int]]] = []  # (engine param name, the model's tensor, row0, rows): the engine's dtype differs
        problems: List[str] = []
        bound: Set[int] = set()  # id of each Parameter bound: one under two names (a tied lm_head) is bound once
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

    def _bind(self, name: str, current: Any, cfg: Dict[str, Any], engine_dtype: bool = False) -> Any:
        """The tensor that serves model weight `name` (its current tensor `current`), in current's
        dtype or with `engine_dtype` the engine's: a view of the segment, or a tensor of its own
        recorded for prepare() to refill."""
        torch = self.torch
        shape = tuple(current.shape)
        src, row0, rows = _hf_source(name, cfg)
        host = self.host
        lin = host.linears.get(src)
        quantized = lin is not None and lin.quantized
        if lin is None or not lin.quantized:
            if src not in host.params:
                raise WsyncError(5, f"{name}: the engine has no {src}")
            p = host.params[src]
            if p.kind != "plain" or p.dtype not in ("BF16", "F32"):
                raise WsyncError(3, f"{name}: the engine's {src} is {p.dtype} {p.kind}")
        full = lin.shape if lin is not None and lin.quantized else host.params[src].shape
        if src.endswith((".gate_up_proj.weight", ".gate_up_proj.bias")):  # row0 is the half: 0 gate, 1 up
            half = int(full[0]) // 2
            rows, row0 = half, row0 * half
        take = full[0] if rows is None else rows
        want = (take,) + tuple(full[1:])
        if want != shape or row0 + take > full[0]:
            raise WsyncError(3, f"{name} {list(shape)}: the engine's {src} gives {list(want)}")
        if quantized:
            t = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
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

    def prepare(self, version: int) -> None:
        """The segment holds `version`: dequantize the INT4 linears into the model's tensors, refill
        the converted ones; check every weight is finite (a NaN refuses the version, naming it)."""
        torch = self.torch
        dense: Dict[str, Any] = {}
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

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> List[int]:
        """Greedy decoding (model.generate), exactly max_new_tokens new tokens."""
        torch = self.torch
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                      eos_token_id=None, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    def generate_request(self, prompt: Sequence[int], max_new_tokens: int,
                         timeout: float = 600.0) -> Tuple[List[int], int]:
        """generate() admitted by the host: (tokens, the weight version they were computed with)."""
        with self.host.request(timeout) as version:
            return self.generate(prompt, max_new_tokens), version
