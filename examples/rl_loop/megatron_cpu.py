"""megatron-core 0.16 on CPU: the harness the example RL loop and wsync's megatron tests share.

megatron-core assumes CUDA in a few places; on CPU (gloo) with megatron's local layer spec it runs
once `setup()` has redirected them: torch.cuda.current_device -> "cpu", the CUDA RNG tracker's
fork() a no-op (no dropout is used), moe_utils.te_general_gemm = None, and the allgather token
dispatcher (the all-to-all one makes a CUDA stream). TP 2 dense and EP 2 MoE work; TP 2 with MoE
does not (sequence parallelism needs TransformerEngine).
"""

import contextlib
import json
import pathlib

import torch
import torch.nn.functional as F


def setup(tp=1, ep=1, pp=1):
    """After torch.distributed.init_process_group("gloo", ...): the CPU redirections, then
    megatron's parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"
    tp_random.get_cuda_rng_tracker().fork = lambda *args, **kw: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 pipeline_model_parallel_size=pp)


def gpt_model(cfg, padded_vocab, tp=1, ep=1, pp=1, max_sequence_length=128):
    """The GPTModel of HF config `cfg` (a dict: Qwen3 / Qwen3-MoE) with megatron's local spec, in
    bf16 as Float16Module casts it under --bf16."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = "num_experts" in cfg
    tc = TransformerConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg["head_dim"], ffn_hidden_size=cfg["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=cfg["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=True, params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16,
        sequence_parallel=False, attention_dropout=0.0, hidden_dropout=0.0,
        **(dict(num_moe_experts=cfg["num_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                moe_ffn_hidden_size=cfg["moe_intermediate_size"], moe_grouped_gemm=False,
                moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                expert_model_parallel_size=ep) if moe else {}))
    model = GPTModel(config=tc, vocab_size=padded_vocab, max_sequence_length=max_sequence_length,
                     position_embedding_type="rope", rotary_base=int(cfg["rope_theta"]),
                     share_embeddings_and_output_weights=False, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=cfg.get("num_experts"), moe_grouped_gemm=False, qk_layernorm=True))
    return model.bfloat16()


def load_source(model, source_dir, rank):
    """Loads this rank's weights from a Megatron source directory (wsync-shard's rank files),
    every model tensor by its wsync name (wsync.megatron.local_tensors), checking names and shapes.
    Returns the directory's config.json text."""
    from safetensors.torch import load_file
    from wsync.megatron import local_tensors

    src = pathlib.Path(source_dir)
    loaded = load_file(str(src / f"rank-{rank:05d}.safetensors"))
    names = [n for n, _ in local_tensors(model)]
    assert sorted(names) == sorted(loaded), f"rank {rank}: model and file differ in {sorted(set(names) ^ set(loaded))}"
    with torch.no_grad():
        for name, t in local_tensors(model):
            assert t.shape == loaded[name].shape, f"{name}: model {tuple(t.shape)}, file {tuple(loaded[name].shape)}"
            t.copy_(loaded[name])
    return (src / "config.json").read_text()


def padded_vocab(source_dir):
    return json.loads((pathlib.Path(source_dir) / "parallel.json").read_text())["padded_vocab_size"]
