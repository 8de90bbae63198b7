"""Megatron-core: publish a GPTModel's weights to wsync after each optimizer step.

A few lines in the training loop of every rank (the trainer agents run beside the job with
``--source shm:NAME``, one per rank, same world size and rank order)::

    from wsync.megatron import MegatronPublisher
    pub = MegatronPublisher(model, hf_config_json, "job42")   # collective: every rank, after
                                                               # initialize_model_parallel
    for step in ...:
        train_step(...)                                        # forward, backward, optimizer.step()
        pub.publish(step)                                      # copies the weights, then one sync

The names are the rank's Megatron names as MEGATRON_TO_HF.md gives them for the Transformer Engine
spec (local_tensors below): wrapper prefixes (DDP, Float16Module: ``module.``) stripped, a model
built with megatron's local spec renamed to the TE names (SequentialMLP experts under their
grouped-GEMM names, the fused norms' layer_norm_weight), the MoE routers' ``expert_bias`` buffers
included. The parallel layout
(parallel.json) is read from ``megatron.core.parallel_state`` and the model (parallel_layout below).
publish() copies every tensor into the shared segment under the update lock (one memcpy per
step, from host or CUDA memory: Megatron's DDP keeps parameters as views into its own buffers,
so they are copied, not moved), then requests the sync.

Errors: wsync.WsyncError naming the tensor or the setting (virtual pipeline stages, a tensor the
agent's plan does not have, a dtype it does not take), raised before anything is registered.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist

from wsync._native import WsyncError
from wsync.dtypes import torch_dtype_name
from wsync.trainer import JsonText, Publisher, SyncResult

# A GPTModel (wrapped or not: DDP, Float16Module), or the list of its virtual pipeline chunks.
Model = Union[torch.nn.Module, Sequence[torch.nn.Module]]

_SEQUENTIAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def wsync_name(name: str) -> str:
    """A GPTModel parameter name as wsync's Megatron plan names it (MEGATRON_TO_HF.md)."""
    while name.startswith("module."):
        name = name[len("module."):]
    m = _SEQUENTIAL_EXPERT.match(name)
    if m:  # SequentialMLP -> the grouped-GEMM name, local expert index
        name = f"{m.group(1)}{m.group(3)}.weight{m.group(2)}"
    return name


_LAYER = re.compile(r"^(decoder\.layers\.\d+\.)(.*)$")


def _te_norm_names(names: Sequence[str]) -> Dict[str, str]:
    """Local-spec norm names -> the TE spec's (MEGATRON_TO_HF.md §1): a GQA layer's
    input_layernorm is fused into linear_qkv (layer_norm_weight), a dense MLP's pre_mlp_layernorm
    into linear_fc1; MLA layers and MoE layers keep theirs."""
    layers: Dict[str, Set[str]] = {}
    for n in names:
        m = _LAYER.match(n)
        if m:
            layers.setdefault(m.group(1), set()).add(m.group(2))
    renamed = {}
    for prefix, rest in layers.items():
        if "input_layernorm.weight" in rest and "self_attention.linear_qkv.weight" in rest:
            renamed[prefix + "input_layernorm.weight"] = prefix + "self_attention.linear_qkv.layer_norm_weight"
        if "pre_mlp_layernorm.weight" in rest and "mlp.linear_fc1.weight" in rest:
            renamed[prefix + "pre_mlp_layernorm.weight"] = prefix + "mlp.linear_fc1.layer_norm_weight"
    return renamed


def local_tensors(model: Model) -> List[Tuple[str, torch.Tensor]]:
    """[(name, tensor)] of this rank's weights, in model order: parameters (shared ones once) and
    the MoE routers' expert_bias buffers, under wsync's names (the TE spec's: wsync_name, and the
    norms of a model built with megatron's local spec renamed as _te_norm_names says)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise WsyncError(12, f"{len(chunks)} model chunks: virtual pipeline stages are not supported")
    out: List[Tuple[str, torch.Tensor]] = []
    seen: Dict[str, str] = {}
    named = list(chunks[0].named_parameters())
    named += [(n, b) for n, b in chunks[0].named_buffers() if n.endswith("mlp.router.expert_bias")]
    te = _te_norm_names([wsync_name(n) for n, _ in named])
    for name, t in named:
        n = wsync_name(name)
        n = te.get(n, n)
        if n in seen:
            raise WsyncError(6, f"{name} and {seen[n]} are both {n}")
        seen[n] = name
        out.append((n, t))
    return out


def parallel_layout(model: Model, *, order: str = "tp-cp-ep-dp-pp") -> Dict[str, Any]:
    """The job's parallel.json (trainer_agent/convert/source_parallel.h) from megatron's parallel
    state and the model: sizes, rank order, the padded vocabulary (the embedding's rows x TP) and
    each pipeline stage's layer count. Collective: every rank of the world calls it."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    chunk = list(model)[0] if isinstance(model, (list, tuple)) else model
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    mine = {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "layers": len(chunk.decoder.layers) if getattr(chunk, "decoder", None) is not None else 0,
        "vocab_rows": int(chunk.embedding.word_embeddings.weight.shape[0])
        if getattr(chunk, "embedding", None) is not None else 0,
    }
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    layers = [0] * pp
    vocab_rows = 0
    for r in everyone:
        layers[r["pp_rank"]] = max(layers[r["pp_rank"]], r["layers"])
        vocab_rows = max(vocab_rows, r["vocab_rows"])
    if vocab_rows == 0:
        raise WsyncError(9, "no rank holds embedding.word_embeddings.weight (the first pipeline stage must)")
    return {
        "tp": tp, "pp": pp, "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(), "world_size": dist.get_world_size(), "order": order,
        "padded_vocab_size": vocab_rows * tp, "layers_per_stage": layers,
    }


class MegatronPublisher:
    """Publishes one Megatron rank's weights (see the module docstring). Collective at creation."""

    def __init__(self, model: Model, hf_config_json: JsonText, source_name: str, *, order: str = "tp-cp-ep-dp-pp",
                 timeout: float = 60.0) -> None:
        self.tensors = local_tensors(model)
        dtypes: Dict[str, str] = {}
        for name, t in self.tensors:
            dtype = torch_dtype_name(t)
            if dtype is None:
                raise WsyncError(3, f"tensor {name}: dtype {t.dtype} is not one the agent takes")
            dtypes[name] = dtype
        self.parallel = parallel_layout(model, order=order)
        self.publisher = Publisher(source_name, dist.get_rank(), timeout=timeout)
        for name, t in self.tensors:
            self.publisher.declare(name, dtypes[name], tuple(t.shape))
        self.publisher.register(hf_config_json, json.dumps(self.parallel), timeout=timeout)
        self._pairs = [(t, self.publisher.torch(name)) for name, t in self.tensors]

    def publish(self, version: int = 0, *, wait: bool = True, timeout: float = 600.0) -> SyncResult:
        """Copies the weights into the shared segment and requests the sync of `version`."""
        with self.publisher.update(timeout=timeout), torch.no_grad():
            for t, shared in self._pairs:
                shared.copy_(t.detach())
        return self.publisher.publish(version, wait=wait, timeout=timeout)

    def close(self) -> None:
        self.publisher.close()
