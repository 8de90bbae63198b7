"""megatron-core 0.16 on CPU: the harness the example RL loop and wsync's megatron tests share.

megatron-core assumes CUDA in a few places; on CPU (gloo) with megatron's local layer spec it runs
once `setup()` has redirected them: torch.cuda.current_device -> "cpu", Tensor.cuda() a no-op (tied
embeddings under PP), the CUDA RNG tracker's fork() a no-op (no dropout is used),
moe_utils.te_general_gemm = None, and the allgather token dispatcher (the all-to-all one makes a
CUDA stream). Llama, Qwen2, Qwen3 and Qwen3-MoE build; TP 2
dense, EP 2 MoE and PP 2 train; PP also with virtual pipeline stages (gpt_model(vpp=...): the
list of model chunks) and uneven stages (num_layers_in_first/last_pipeline_stage,
account_for_embedding/loss_in_pipeline_split). TP 2 with MoE runs forward in eval() only: megatron's MoE layer
refuses to train with TP > 1 without sequence parallelism, which the local spec's torch norms do not
support (TransformerEngine's do). DeepSeek-V3 (MLA) does not build with the local spec in 0.16.1
(python/README.md, "How the Megatron -> HF conversion is proven").
"""

import contextlib
import json
import pathlib

import torch
import torch.nn.functional as F


def setup(tp=1, ep=1, pp=1, etp=None, vpp=None):
    """After torch.distributed.init_process_group("gloo", ...): the CPU redirections, then
    megatron's parallel state (etp: the experts' TP, megatron's default: tp; vpp: the virtual
    pipeline stages per pipeline rank, None without)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"
    # Tied embeddings under PP: megatron moves the last stage's copy of the embedding to the GPU to
    # all-reduce it with the first stage's (language_module.setup_embeddings_and_output_layer).
    torch.Tensor.cuda = lambda self, *args, **kw: self
    tp_random.get_cuda_rng_tracker().fork = lambda *args, **kw: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 pipeline_model_parallel_size=pp, expert_tensor_parallel_size=etp,
                                 virtual_pipeline_model_parallel_size=vpp)


def _linear_bias(cfg):
    """--add-bias-linear: every linear biased, which HF Llama is with attention_bias and mlp_bias
    (o_proj and the MLP take a bias only together in megatron-core; wsync refuses one without the other)."""
    return cfg["model_type"] == "llama" and bool(cfg.get("attention_bias")) and bool(cfg.get("mlp_bias"))


def transformer_config(cfg, tp=1, ep=1, pp=1, dtype=torch.bfloat16, etp=None, vpp=None, **pipeline_options):
    """megatron-core's TransformerConfig of HF config `cfg` (a dict: Llama, Qwen2, Qwen3, Qwen3-MoE,
    GLM-4.5, DeepSeek-V3), with parameters in `dtype` (bf16: as Float16Module casts them under --bf16), vpp
    virtual pipeline stages (None: none) and pipeline_options: TransformerConfig's
    num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage,
    account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    arch = cfg["model_type"]
    common = dict(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=cfg["rms_norm_eps"], gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=_linear_bias(cfg), params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype, sequence_parallel=False, attention_dropout=0.0, hidden_dropout=0.0,
        expert_tensor_parallel_size=etp, virtual_pipeline_model_parallel_size=vpp, **pipeline_options)
    if arch == "deepseek_v3":  # MLA; dense first layers, then MoE with a shared expert (sigmoid routing)
        dense = cfg.get("first_k_dense_replace", 0)
        return MLATransformerConfig(
            **common, q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"],
            qk_head_dim=cfg["qk_nope_head_dim"], qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"], rope_type="rope", rotary_base=cfg["rope_theta"], qk_layernorm=True,
            num_moe_experts=cfg["n_routed_experts"], moe_router_topk=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_layer_freq=[0] * dense + [1] * (cfg["num_hidden_layers"] - dense),
            moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=cfg["routed_scaling_factor"],
            moe_router_num_groups=cfg["n_group"], moe_router_group_topk=cfg["topk_group"],
            moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
            expert_model_parallel_size=ep)
    moe = {}
    if arch == "qwen3_moe":
        moe = dict(num_moe_experts=cfg["num_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                   moe_ffn_hidden_size=cfg["moe_intermediate_size"], moe_grouped_gemm=False,
                   moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                   expert_model_parallel_size=ep)
    elif arch == "glm4_moe":  # GLM-4.5: DeepSeek-V3's MoE (dense first layers, sigmoid routing, a shared expert)
        dense = cfg.get("first_k_dense_replace", 1)
        moe = dict(num_moe_experts=cfg["n_routed_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                   moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                   moe_layer_freq=[0] * dense + [1] * (cfg["num_hidden_layers"] - dense),
                   moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 1),
                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_topk_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                   moe_router_num_groups=cfg.get("n_group", 1), moe_router_group_topk=cfg.get("topk_group", 1),
                   moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                   moe_router_load_balancing_type="none", expert_model_parallel_size=ep)
    elif arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"model_type {arch!r}: megatron_cpu builds llama, qwen2, qwen3, qwen3_moe, glm4_moe, "
                         "deepseek_v3")
    qk_norm = arch in ("qwen3", "qwen3_moe") or (arch == "glm4_moe" and bool(cfg.get("use_qk_norm")))
    return TransformerConfig(
        **common, num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        qk_layernorm=qk_norm, add_qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias")), **moe)


def rotary_percent(cfg):
    """The share of each head RoPE rotates (GPTModel's rotary_percent): GLM-4.5's partial_rotary_factor
    (transformers' default 0.5), 1 for the others."""
    return float(cfg.get("partial_rotary_factor", 0.5)) if cfg["model_type"] == "glm4_moe" else 1.0


def gpt_model(cfg, padded_vocab, tp=1, ep=1, pp=1, max_sequence_length=128, *, dtype=torch.bfloat16,
              parallel_output=True, etp=None, vpp=None, mtp=False, **pipeline_options):
    """The GPTModel of HF config `cfg` (transformer_config) with megatron's local spec, its
    parameters in `dtype`, initialised by megatron-core (use_cpu_initialization: each weight drawn
    whole by its init_method from torch's RNG, then this rank's TP part taken). parallel_output=False:
    forward() returns the logits of the whole (padded) vocabulary on every TP rank.

    vpp (virtual pipeline stages; setup(vpp=) the same): the list of this rank's vpp model chunks,
    chunk v built with vp_stage=v (megatron's get_model), in that order, each drawing its weights
    from torch's RNG in turn. pipeline_options: TransformerConfig's uneven-split options
    (transformer_config). mtp: with the HF config's MTP layers (num_nextn_predict_layers; megatron's
    mtp_num_layers), which the last pipeline stage holds (mtp.layers.{k}.*)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    if mtp:  # the HF config's MTP layers (num_nextn_predict_layers), megatron's --mtp-num-layers
        pipeline_options = dict(pipeline_options, mtp_num_layers=int(cfg["num_nextn_predict_layers"]))
    tc = transformer_config(cfg, tp, ep, pp, dtype, etp, vpp, **pipeline_options)
    chunks = []
    for vp_stage in range(vpp) if vpp is not None else [None]:
        # the decoder's spec first: it sets the local spec's norm to RMSNorm, which the MTP spec's
        # norms (built without arguments) then take
        decoder_spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm",
                                                  vp_stage=vp_stage)
        mtp_spec = (get_gpt_mtp_block_spec(tc, decoder_spec, use_transformer_engine=False, vp_stage=vp_stage)
                    if mtp else None)
        model = GPTModel(config=tc, vocab_size=padded_vocab, max_sequence_length=max_sequence_length,
                         position_embedding_type="rope", rotary_base=int(cfg["rope_theta"]),
                         rotary_percent=rotary_percent(cfg),
                         share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings")),
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                         parallel_output=parallel_output, vp_stage=vp_stage,
                         transformer_layer_spec=decoder_spec, mtp_block_spec=mtp_spec)
        model.to(dtype)
        for name, buf in model.named_buffers():  # megatron keeps the routers' expert_bias in fp32
            if name.endswith("router.expert_bias"):
                buf.data = buf.data.float()
        chunks.append(model)
    return chunks if vpp is not None else chunks[0]


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
