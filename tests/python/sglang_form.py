"""SGLang 0.5.15.post1's own parameters for a model, and what its weight loaders put in them: the
oracle of the SGLang tests, computed from SGLang's code (docs/sglang.md, "The model SGLang holds",
records every rule with its file:line), sharing no code with wsync (no EngineHost, no wsync C++).

    specs(config)          {SGLang parameter name: (shape, torch dtype)}: what `model.named_parameters()`
                           holds for an HF config.json (a dict) at TP 1 once loaded and processed
    zero_params(config)    those parameters zero-filled: what the SGLang stand-in is seeded with
    metadata(config)       the INT4 parameters no kernel reads and no weight sync rewrites
    load(config, hf)       the parameters after SGLang's `load_weights` took the HF tensors `hf`
                           ({HF name: tensor}) and `process_weights_after_loading` ran: q/k/v and
                           gate/up stacked by its loaders, the vocabulary padded to a multiple of 64
                           with zero rows, a tied lm_head dropped; INT4 repacked to Marlin
    compress(config, hf)   the compressed-tensors INT4 form of bf16 HF tensors, as a trainer sends it
    expected(dir[, quant]) load() of an HF checkpoint directory (compress()ed for an INT4 config)
    read_checkpoint(dir)   {HF name: tensor} of DIR/*.safetensors

Architectures: Qwen3ForCausalLM and Qwen2ForCausalLM (q/k/v bias), tied or not, in the dtype SGLang
picks for "--dtype auto"; Qwen3 also as compressed-tensors W4A16 (symmetric, group strategy, no
act-order), served by CompressedTensorsWNA16 in Marlin layout. SGLang with TP 1, PP 1, no DP
attention, no LoRA vocabulary and no `--rl-on-policy-target` (which makes norms and embeddings
float32): the server wsync.adapters.sglang drives.
"""

import json
import pathlib
import re

import torch

from safetensors_files import read_safetensors

SGLANG = "0.5.15.post1"
VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE, layers/vocab_parallel_embedding.py:45
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
              "I64": torch.int64, "U8": torch.uint8}
_CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
                  "float32": torch.float32, "float": torch.float32}
# Qwen3ForCausalLM.load_weights / Qwen2ForCausalLM.load_weights: stacked_params_mapping
# (qwen3.py:598-605, qwen2.py:572-579): (param_name, shard_name, shard_id).
_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


# The tests' INT4 engine: compressed-tensors W4A16 (group 128, symmetric) on every linear but
# lm_head, served by SGLang's CompressedTensorsWNA16 in Marlin layout.
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
             "actorder": None, "dynamic": False}}},
         "ignore": ["lm_head", "re:.*embed_tokens.*"]}


class Unsupported(ValueError):
    pass


def model_dtype(config):
    """configs/model_config.py:1542-1583 (_get_and_verify_dtype) with --dtype auto: the config's
    dtype ("dtype" or "torch_dtype", float32 if none), except float32 -> float16 (gemma: bfloat16)."""
    name = config.get("dtype") or config.get("torch_dtype")
    dt = _CONFIG_DTYPES.get(name, torch.float32) if isinstance(name, str) else torch.float32
    if dt == torch.float32:
        return torch.bfloat16 if config.get("model_type", "").startswith("gemma") else torch.float16
    return dt


def _pad(n, to=VOCAB_PADDING):
    return (n + to - 1) // to * to  # pad_vocab_size, vocab_parallel_embedding.py:54-56


def _geometry(config):
    arch = (config.get("architectures") or [""])[0]
    if arch not in ("Qwen3ForCausalLM", "Qwen2ForCausalLM"):
        raise Unsupported(f"{arch or 'no architecture'}: the SGLang oracle covers Qwen3ForCausalLM and "
                          "Qwen2ForCausalLM")
    h, nh = config["hidden_size"], config["num_attention_heads"]
    g = dict(arch=arch, h=h, nh=nh, nkv=config.get("num_key_value_heads", nh), f=config["intermediate_size"],
             v=config["vocab_size"], layers=config["num_hidden_layers"],
             tied=bool(config.get("tie_word_embeddings", False)))
    # Head size: Qwen3DecoderLayer passes getattr(config, "head_dim", None) (qwen3.py:334), Qwen2's
    # likewise unless original_num_attention_heads (qwen2.py:213-216); the attention falls back
    # to hidden // heads (qwen3.py:102, qwen2.py:139-142).
    if arch == "Qwen2ForCausalLM" and "original_num_attention_heads" in config:
        g["hd"] = h // config["original_num_attention_heads"]
    elif arch == "Qwen3ForCausalLM" and not config.get("head_dim"):
        raise Unsupported("Qwen3 without head_dim: transformers' Qwen3Config fills in its default (128)")
    else:
        g["hd"] = config.get("head_dim") or h // nh
    # Biases: Qwen2Attention's qkv_proj bias=True, o_proj bias=False (qwen2.py:149-162);
    # Qwen3Attention's qkv_proj and o_proj bias=config.attention_bias (qwen3.py:121-141, 347).
    if arch == "Qwen2ForCausalLM":
        g["qkv_bias"], g["o_bias"] = True, False
    else:
        g["qkv_bias"] = g["o_bias"] = bool(config["attention_bias"])
    g["int4"] = _w4a16(config.get("quantization_config"))
    if g["int4"] and arch != "Qwen3ForCausalLM":
        raise Unsupported(f"INT4 {arch}: the SGLang oracle covers INT4 Qwen3ForCausalLM")
    return g


def _w4a16(q):
    """(group size, ignore list) of a compressed-tensors W4A16 symmetric group quantization_config
    (what CompressedTensorsWNA16 serves through Marlin: compressed_tensors.py:494-507, 555), None
    for no quantization; anything else is Unsupported."""
    if not q:
        return None
    groups = list((q.get("config_groups") or {}).values())
    w = groups[0].get("weights") or {} if len(groups) == 1 else {}
    if (q.get("quant_method") != "compressed-tensors" or len(groups) != 1 or groups[0].get("targets") != ["Linear"]
            or groups[0].get("input_activations") or w.get("num_bits") != 4 or w.get("type") != "int"
            or w.get("strategy") != "group" or not w.get("symmetric") or w.get("actorder") or w.get("dynamic")
            or q.get("engine_layout", "marlin") != "marlin"):
        raise Unsupported(f"quantization_config {json.dumps(q)[:200]}: the SGLang oracle covers compressed-tensors "
                          "W4A16 (one group targeting Linear, symmetric, group strategy, no act-order)")
    return int(w["group_size"]), list(q.get("ignore") or [])


def _quantized(g, layer):
    """Whether SGLang quantizes linear layer `layer` (its prefix): CompressedTensorsConfig.get_quant_method
    (compressed_tensors.py:160-176) -> get_scheme_dict (815-841) -> should_ignore_layer
    (compressed_tensors/utils.py:23-75) with the model's packed_modules_mapping, which Qwen3ForCausalLM
    does not define (model_loader/loader.py:205): the fused name itself is matched against `ignore`,
    exactly or as a "re:" regex with re.match (utils.py:157-175). The target "Linear" matches every
    LinearBase by class name, case-insensitively contained (utils.py:123-126)."""
    if not g["int4"]:
        return False
    ignore = g["int4"][1]
    return not any(re.match(t[3:], layer) if t.startswith("re:") else t == layer for t in ignore)


def specs(config, processed=True):
    """{name: (shape, dtype)} in named_parameters() order (module comment), TP 1: after
    process_weights_after_loading (what a serving SGLang holds), or as created, before loading."""
    g, dt = _geometry(config), model_dtype(config)
    h, hd = g["h"], g["hd"]
    vp = _pad(g["v"])  # VocabParallelEmbedding: num_embeddings_padded (vocab_parallel_embedding.py:273-278)
    out = {"model.embed_tokens.weight": ((vp, h), dt)}  # UnquantizedEmbeddingMethod (unquant.py:128-137)
    qkv = (g["nh"] + 2 * g["nkv"]) * hd  # QKVParallelLinear.output_sizes (linear.py:965-969)

    def linear(prefix, n, k):
        if not _quantized(g, prefix):
            # UnquantizedLinearMethod.create_weights: [sum(output_partition_sizes), input_size_per_partition]
            # (unquant.py:165-174).
            out[prefix + ".weight"] = ((n, k), dt)
            return
        group = g["int4"][0]
        # create_weights asserts K % G (compressed_tensors_wNa16.py:127-129); gptq_marlin_repack
        # needs K % 16 and N % 64 (FORMATS.md §4.1; the Marlin kernel's TORCH_CHECKs).
        if k % group or k % 16 or n % 64:
            raise Unsupported(f"{prefix} [{n}, {k}]: not a Marlin shape for group {group}")
        if not processed:
            # CompressedTensorsWNA16.create_weights (compressed_tensors_wNa16.py:98-193):
            # weight_packed int32 [N, K/8], weight_scale [N, K/G] (params dtype), weight_shape int64 [2].
            out[prefix + ".weight_packed"] = ((n, k // 8), torch.int32)
            out[prefix + ".weight_scale"] = ((n, k // group), dt)
            out[prefix + ".weight_shape"] = ((2,), torch.int64)
            return
        # process_weights_after_loading (compressed_tensors_wNa16.py:210-301): weight_packed becomes
        # gptq_marlin_repack's int32 [K/16, 2N] (jit_kernel/gptq_marlin_repack.py:27-45),
        # weight_scale marlin_permute_scales' [K/G, N] (marlin_utils.py:335-346); weight_g_idx,
        # g_idx_sort_indices and weight_zero_point become empty int32 [0] parameters
        # (marlin_make_empty_g_idx, marlin_utils.py:308-311): no act-order, symmetric.
        out[prefix + ".weight_packed"] = ((k // 16, 2 * n), torch.int32)
        out[prefix + ".weight_scale"] = ((k // group, n), dt)
        out[prefix + ".weight_shape"] = ((2,), torch.int64)
        for placeholder in ("weight_g_idx", "g_idx_sort_indices", "weight_zero_point"):
            out[f"{prefix}.{placeholder}"] = ((0,), torch.int32)

    for i in range(g["layers"]):
        p = f"model.layers.{i}."
        linear(p + "self_attn.qkv_proj", qkv, h)
        if g["qkv_bias"]:  # a bias [output_size_per_partition] (linear.py:370-381, 1413-1422)
            out[p + "self_attn.qkv_proj.bias"] = ((qkv,), dt)
        linear(p + "self_attn.o_proj", h, g["nh"] * hd)
        if g["o_bias"]:
            out[p + "self_attn.o_proj.bias"] = ((h,), dt)
        if g["arch"] == "Qwen3ForCausalLM":  # RMSNorm(head_dim) (qwen3.py:118-119; layernorm.py:222)
            out[p + "self_attn.q_norm.weight"] = ((hd,), dt)
            out[p + "self_attn.k_norm.weight"] = ((hd,), dt)
        linear(p + "mlp.gate_up_proj", 2 * g["f"], h)  # Qwen2MLP (qwen2.py:73-86)
        linear(p + "mlp.down_proj", h, g["f"])
        out[p + "input_layernorm.weight"] = ((h,), dt)
        out[p + "post_attention_layernorm.weight"] = ((h,), dt)
    out["model.norm.weight"] = ((h,), dt)
    if not g["tied"]:  # tied: lm_head *is* model.embed_tokens (qwen3.py:489-490, qwen2.py:463-464)
        out["lm_head.weight"] = ((vp, h), dt)  # ParallelLMHead (qwen3.py:492-498)
    return out


def metadata(config):
    """Parameters a serving SGLang holds that no kernel reads and that a weight sync does not
    rewrite: INT4 weight_shape (loaded once, from the checkpoint) and the empty Marlin placeholders."""
    return sorted(n for n, (shape, _) in specs(config).items()
                  if n.endswith(".weight_shape") or (len(shape) == 1 and shape[0] == 0))


def zero_params(config):
    return {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in specs(config).items()}


def _check_shape(name, dst, src):
    if tuple(dst.shape) != tuple(src.shape):  # the loaders' asserts (linear.py:1333-1335, 1481-1485)
        raise AssertionError(f"{name}: param_data.shape={tuple(dst.shape)} != loaded_weight.shape={tuple(src.shape)}")


def load(config, hf):
    """The parameters after SGLang's load_weights took {HF name: tensor} `hf` (for an INT4 model
    its compressed-tensors form: X.weight_packed, X.weight_scale, X.weight_shape; compress()) and
    process_weights_after_loading ran, TP 1 (module comment). Each rule is the loader's, cited."""
    g = _geometry(config)
    params = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in specs(config, processed=False).items()}
    hd, nh, nkv = g["hd"], g["nh"], g["nkv"]
    for name, w in hf.items():
        # load_weights (qwen3.py:597-669, qwen2.py:571-649): rotary buffers skipped; stacked names
        # go through the fused layer's loader with a shard id; the rest by name if the model has
        # it (a tied checkpoint's lm_head.weight has no parameter: "not found", skipped).
        if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
            continue
        for param_name, shard_name, shard_id in _STACKED:
            if shard_name not in name:
                continue
            name = name.replace(shard_name, param_name)
            if name.endswith(".bias") and name not in params:
                break  # "Skip loading extra bias for GPTQ models"
            param = params[name]
            if name.endswith(".weight_shape"):
                # INT4 weight_shape, a BasevLLMParameter: load_qkv_weight / load_merged_column_weight
                # are _assert_and_load, a whole copy (parameter.py:109-123): the last shard loaded.
                _check_shape(name, param, w)
                param.copy_(w)
                break
            if param_name == "qkv_proj":
                # QKVParallelLinear.weight_loader, shard id given (linear.py:1238-1335), and for INT4
                # weight_loader_v2 -> _ColumnvLLMParameter.load_qkv_weight (linear.py:1080-1121,
                # parameter.py:226-274; weight_packed is packed along K, not along the output dim,
                # so rows as for bf16): q at 0 (nh*hd rows), k at nh*hd, v at (nh+nkv)*hd (nkv*hd
                # rows each); TP 1: start_idx 0, the whole shard.
                offset, size = {"q": (0, nh * hd), "k": (nh * hd, nkv * hd), "v": ((nh + nkv) * hd, nkv * hd)}[shard_id]
            else:
                # MergedColumnParallelLinear.weight_loader (linear.py:649-690), for INT4 weight_loader_v2
                # -> load_merged_column_weight (linear.py:828-891, parameter.py:177-224): shard_offset =
                # sum(output_sizes[:id]) // tp, shard_size = output_sizes[id] // tp; output_sizes [F, F].
                offset, size = shard_id * g["f"], g["f"]
            dst = param.narrow(0, offset, size)
            src = w.narrow(0, 0, size)  # loaded_weight.narrow(output_dim, start_idx 0, shard_size)
            _check_shape(name, dst, src)
            dst.copy_(src)
            break
        else:
            if name.endswith(".bias") and name not in params:
                continue
            if name not in params:
                continue  # logger.warning("Parameter ... not found in params_dict")
            param = params[name]
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                # VocabParallelEmbedding.weight_loader (vocab_parallel_embedding.py:444-499): asserts
                # the loaded rows == org_vocab_size, copies them, zero-fills the padding rows.
                if w.shape[0] != g["v"]:
                    raise AssertionError(f"{name}: {w.shape[0]} rows for org_vocab_size {g['v']}")
                param[: w.shape[0]].copy_(w)
                param[w.shape[0]:].fill_(0)
            else:
                # RowParallelLinear.weight_loader at TP 1 (linear.py:1426-1487; INT4: weight_loader_v2
                # -> load_row_parallel_weight, parameter.py:293-337, whole at TP 1), RMSNorm's
                # default_weight_loader (model_loader/weight_utils.py:1346-1360): a copy, shapes asserted.
                _check_shape(name, param, w)
                param.copy_(w)
    # process_weights_after_loading of every INT4 linear (compressed_tensors_wNa16.py:210-301).
    for n, (shape, dt) in specs(config).items():
        if n.endswith(".weight_packed"):
            k, two_n = shape[0] * 16, shape[1]
            # permute_param_layout_(input_dim=0, output_dim=1, packed_dim=0): [N, K/8] -> [K/8, N]
            # (parameter.py:528-575), then gptq_marlin_repack(perm empty, size_k K, size_n N, 4 bits).
            params[n] = marlin_repack(params[n].t().contiguous(), k, two_n // 2)
        elif n.endswith(".weight_scale"):
            group = g["int4"][0]
            params[n] = marlin_permute_scales(params[n].t().contiguous(), shape[0] * group, shape[1], group)
        elif n not in params:
            params[n] = torch.zeros(shape, dtype=dt)  # the empty placeholders
    return params


# --- INT4: Marlin as SGLang's kernels lay it out, and the trainer's compressed-tensors form -------

def marlin_repack(b_q_weight, size_k, size_n):
    """gptq_marlin_repack (4 bits, no act-order perm) as SGLang's kernel computes it, step by step
    (jit_kernel/csrc/gemm/marlin/gptq_marlin_repack.cuh:43-239): GPTQ int32 [K/8, N] (8 K-values per
    word, the smaller K lower) -> int32 [K/16, 2N]. Per 16 x 64 tile (k_tile_id, n_tile_id) the stage
    holds GPTQ rows 2k_tile_id, 2k_tile_id+1, columns 64n_tile_id..+63 (fetch_to_shared, 125-137);
    warp 0..3, lane th_id gathers vals[i] / vals[4+i] = nibble cur_elem % 8 of word cur_elem / 8 at
    column cur_n / cur_n + 8 (cur_elem = tc_row + {0, 1, 8, 9}[i], 188-206), packs them in the order
    pack_idx (0, 2, 4, 6, 1, 3, 5, 7) and writes out[(k_tile_id * n_tiles + n_tile_id) * 128 +
    th_id * 4 + warp_id] (209-223)."""
    k_tiles, n_tiles = size_k // 16, size_n // 64
    b = b_q_weight.to(torch.int64) & 0xFFFFFFFF
    assert tuple(b.shape) == (size_k // 8, size_n), (tuple(b.shape), size_k, size_n)
    # stage[kt, nt, row (2), col (64)]
    stage = b.view(k_tiles, 2, n_tiles, 64).permute(0, 2, 1, 3)
    warp = torch.arange(4).view(4, 1)
    th = torch.arange(32).view(1, 32)
    tc_col, tc_row = th // 4, (th % 4) * 2
    cur_n = warp * 16 + tc_col  # [4, 32]
    vals = []
    for col in (cur_n, cur_n + 8):
        for off in (0, 1, 8, 9):
            cur_elem = tc_row + off
            cur_int, cur_pos = cur_elem // 8, cur_elem % 8  # [1, 32]
            word = stage[:, :, cur_int.expand(4, 32), col]  # [kt, nt, 4, 32]
            vals.append((word >> (cur_pos * 4)) & 0xF)
    res = torch.zeros_like(vals[0])
    for i, j in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
        res |= vals[j] << (4 * i)
    out = torch.empty(k_tiles, n_tiles, 128, dtype=torch.int64)
    out[:, :, (th * 4 + warp).reshape(-1)] = res.reshape(k_tiles, n_tiles, 128)
    out = out.reshape(k_tiles, 2 * size_n)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def marlin_repack_reference(q, size_k, size_n):
    """A second formulation of the same layout, not the kernel's: vLLM's Python reference
    marlin_weights(q_w [K, N] of nibbles, get_weight_perm(4)) that vLLM's test_gptq_marlin_repack
    holds the kernel to (FORMATS.md §4.4). For the self-check of marlin_repack."""
    perm = []
    for i in range(32):
        col = i // 4
        rows = (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)
        perm1 = [16 * row + col + 8 * block for block in (0, 1) for row in rows]
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    perm = torch.tensor(perm).view(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)
    x = q.to(torch.int64).reshape(size_k // 16, 16, size_n // 16, 16).permute(0, 2, 1, 3).reshape(size_k // 16, -1)
    x = x.reshape(-1, perm.numel())[:, perm].reshape(size_k // 16, -1)
    packed = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        packed |= x[:, i::8] << (4 * i)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def marlin_permute_scales(s, size_k, size_n, group_size):
    """marlin_utils.py:325-346 (get_scale_perms, marlin_permute_scales): s [K/G, N]."""
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    scale_perm_single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    if group_size < size_k and group_size != -1:
        s = s.reshape(-1, len(scale_perm))[:, scale_perm]
    else:
        s = s.reshape(-1, len(scale_perm_single))[:, scale_perm_single]
    return s.reshape(-1, size_n).contiguous()


def quantize(w, group):
    """The compressed-tensors INT4 form of one bf16 weight [N, K] as the trainer sends it
    (FORMATS.md §1.1 variant qat, the one wsync's trainer agents use, and §2):
    scale = max(fl32(amax / 7), 1e-5) per row and group of `group` columns (float32), q =
    clamp(rint(fl32(W / scale)), -7, 7) (IEEE division, half to even), u = q + 8, nibble i of word
    j = u[8j + i]; weight_scale = bf16(scale). Returns (weight_packed int32 [N, K/8], weight_scale
    [N, K/G], weight_shape int64 [2])."""
    n, k = w.shape
    x = w.to(torch.float32).view(n, k // group, group)
    scale = x.abs().amax(dim=2) / torch.tensor(7.0, dtype=torch.float32)
    scale = torch.where(scale < torch.tensor(1e-5, dtype=torch.float32), torch.tensor(1e-5, dtype=torch.float32),
                        scale)
    q = torch.round(x / scale.unsqueeze(2)).clamp(-7, 7).to(torch.int64).view(n, k) + 8
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for i in range(8):
        words |= q[:, i::8] << (4 * i)
    packed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return packed, scale.to(w.dtype), torch.tensor([n, k], dtype=torch.int64)


def compress(config, hf):
    """{HF name: tensor} as the trainer sends an INT4 model (slime's quantize_params_compressed_tensors,
    FORMATS.md §1.2 table): every X.weight of a linear SGLang quantizes (_quantized, by its fused
    name) becomes X.weight_packed, X.weight_scale, X.weight_shape; the rest unchanged."""
    g = _geometry(config)
    out = {}
    for name, w in hf.items():
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        if layer is not None:
            for param_name, shard_name, _ in _STACKED:
                if shard_name in layer:
                    layer = layer.replace(shard_name, param_name)
                    break
        linear = layer is not None and w.dim() == 2 and not layer.endswith(("embed_tokens", "lm_head"))
        if linear and _quantized(g, layer):
            prefix = name[: -len(".weight")]
            out[prefix + ".weight_packed"], out[prefix + ".weight_scale"], out[prefix + ".weight_shape"] = \
                quantize(w, g["int4"][0])
        else:
            out[name] = w
    return out


def read_checkpoint(directory):
    """{HF name: tensor} of every *.safetensors file in `directory`."""
    out = {}
    for f in sorted(pathlib.Path(directory).glob("*.safetensors")):
        for name, (dtype, shape, data) in read_safetensors(f).items():
            out[name] = torch.frombuffer(bytearray(data), dtype=_ST_DTYPES[dtype]).view(shape)
    return out


def expected(directory, quantization_config=None):
    """SGLang's parameters after loading HF checkpoint `directory` (its config.json and tensors;
    with quantization_config, the model as that INT4 config serves it: its compressed-tensors form)."""
    config = json.loads((pathlib.Path(directory) / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    hf = read_checkpoint(directory)
    return load(config, compress(config, hf) if config.get("quantization_config") else hf)


def differences(held, want):
    """Names whose bytes, shape or dtype differ between two {name: tensor}, and names only in one."""
    bad = sorted(set(held) ^ set(want))
    for n in sorted(set(held) & set(want)):
        a, b = held[n], want[n]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8)):
            bad.append(n)
    return bad
