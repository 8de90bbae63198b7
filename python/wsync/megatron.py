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

Virtual pipeline stages (interleaved schedule, ``--virtual-pipeline-model-parallel-size``): pass the
rank's list of model chunks, as megatron's get_model returns it. Each chunk's tensors are named as a
model's (its layers numbered from 0 within the chunk), then prefixed ``model{c}.`` for chunk c, as
Megatron's checkpoints key the chunks: ``model1.decoder.layers.0.self_attention.linear_qkv.weight``,
``model0.embedding.word_embeddings.weight``. parallel.json then carries ``vpp`` and
``layers_per_chunk`` (each chunk's layer count in global layer order: chunk k is pipeline rank
k % pp's chunk k // pp). A single model (or a list of one) keeps its plain names. Uneven stages
(num_layers_in_first/last_pipeline_stage, account_for_embedding/loss_in_pipeline_split) are
copied from the model's TransformerConfig into parallel.json when set, and so is its MTP layer count
(``mtp_num_layers``: a GPTModel built with an MTP block, ``mtp.layers.{k}.*``, synced as the HF
checkpoint's ``model.layers.{L+k}.*``; the HF config's num_nextn_predict_layers must match).

Errors: wsync.WsyncError naming the tensor or the setting (model chunks that do not hold contiguous
layers in order, a tensor the agent's plan does not have, a dtype it does not take), raised before
anything is registered.
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


# A transformer layer's prefix: a decoder layer's, or an MTP layer's (mtp.layers.{k}.transformer_layer.)
_LAYER = re.compile(r"^(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.transformer_layer\.)(.*)$")


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


def _chunks(model: Model) -> List[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a chunk's wrappers (DDP, Float16Module: ``.module``)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _chunk_tensors(chunk: torch.nn.Module) -> List[Tuple[str, str, torch.Tensor]]:
    """[(megatron name, wsync name, tensor)] of one model (chunk), names local to it."""
    named = list(chunk.named_parameters())
    named += [(n, b) for n, b in chunk.named_buffers() if n.endswith("mlp.router.expert_bias")]
    te = _te_norm_names([wsync_name(n) for n, _ in named])
    out = []
    for name, t in named:
        n = wsync_name(name)
        out.append((name, te.get(n, n), t))
    return out


def local_tensors(model: Model) -> List[Tuple[str, torch.Tensor]]:
    """[(name, tensor)] of this rank's weights, in model order: parameters (shared ones once) and
    the MoE routers' expert_bias buffers, under wsync's names (the TE spec's: wsync_name, and the
    norms of a model built with megatron's local spec renamed as _te_norm_names says). `model`: a
    model, or the rank's list of virtual pipeline chunks, whose names are each prefixed
    ``model{c}.`` (c: the chunk's index in the list) when there are more than one."""
    chunks = _chunks(model)
    out: List[Tuple[str, torch.Tensor]] = []
    seen: Dict[str, str] = {}
    for c, chunk in enumerate(chunks):
        prefix = f"model{c}." if len(chunks) > 1 else ""
        for name, n, t in _chunk_tensors(chunk):
            name, n = prefix + name, prefix + n
            if n in seen:
                raise WsyncError(6, f"{name} and {seen[n]} are both {n}")
            seen[n] = name
            out.append((n, t))
    return out


# TransformerConfig's options of an uneven pipeline split, and its MTP layer count, copied into
# parallel.json when set.
_SPLIT_OPTIONS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                  "mtp_num_layers")


def parallel_layout(model: Model, *, order: str = "tp-cp-ep-dp-pp") -> Dict[str, Any]:
    """The job's parallel.json (trainer_agent/convert/source_parallel.h) from megatron's parallel
    state and the model: sizes, rank order, the padded vocabulary (the embedding's rows x TP), each
    pipeline stage's layer count and, for a list of virtual pipeline chunks, ``vpp`` and each
    chunk's layer count in global layer order (``layers_per_chunk``), checked to hold contiguous
    layers in order; the config's uneven-split options and mtp_num_layers when set. Collective: every rank of the
    world calls it."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    chunks = [_unwrap(c) for c in _chunks(model)]
    vpp = len(chunks)
    mine: Dict[str, Any] = {"pp_rank": ps.get_pipeline_model_parallel_rank(), "chunks": [], "vocab_rows": 0,
                            "options": {}}
    for chunk in chunks:
        layers = chunk.decoder.layers if getattr(chunk, "decoder", None) is not None else []
        mine["chunks"].append({"layers": len(layers),
                               "first": int(layers[0].layer_number) - 1 if len(layers) else None})
        if getattr(chunk, "embedding", None) is not None:
            mine["vocab_rows"] = max(mine["vocab_rows"], int(chunk.embedding.word_embeddings.weight.shape[0]))
        config = getattr(chunk, "config", None)
        for key in _SPLIT_OPTIONS:
            value = getattr(config, key, None)
            if value is not None and value is not False:
                mine["options"][key] = value
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for r in everyone:
        if len(r["chunks"]) != vpp:
            raise WsyncError(9, f"this rank has {vpp} model chunks, pipeline rank {r['pp_rank']} has "
                                f"{len(r['chunks'])}")
    per_chunk = [0] * (pp * vpp)  # chunk (virtual stage v, pipeline rank p) at v * pp + p
    first: List[Any] = [None] * (pp * vpp)
    vocab_rows = 0
    options: Dict[str, Any] = {}
    for r in everyone:
        for v, ch in enumerate(r["chunks"]):
            k = v * pp + r["pp_rank"]
            per_chunk[k] = max(per_chunk[k], ch["layers"])
            if ch["first"] is not None:
                first[k] = ch["first"]
        vocab_rows = max(vocab_rows, r["vocab_rows"])
        options.update(r["options"])
    if vocab_rows == 0:
        raise WsyncError(9, "no rank holds embedding.word_embeddings.weight (the first pipeline stage must)")
    start = 0
    for k, n in enumerate(per_chunk):
        if n and first[k] != start:
            where = (f"model chunk {k // pp} of pipeline rank {k % pp}" if vpp > 1 else f"pipeline stage {k}")
            raise WsyncError(9, f"{where} starts at layer {first[k]}, not {start}: layers per "
                                f"{'chunk' if vpp > 1 else 'stage'} {per_chunk}, not contiguous in order")
        start += n
    out = {
        "tp": tp, "pp": pp, "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(), "world_size": dist.get_world_size(), "order": order,
        "padded_vocab_size": vocab_rows * tp,
        "layers_per_stage": [sum(per_chunk[v * pp + p] for v in range(vpp)) for p in range(pp)],
    }
    if vpp > 1:
        out["vpp"] = vpp
        out["layers_per_chunk"] = per_chunk
    out.update(options)
    return out


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
