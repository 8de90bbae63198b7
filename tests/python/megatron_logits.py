"""The Megatron -> HF conversion proved by a forward pass: megatron-core's GPTModel and HuggingFace
transformers, loading the HF checkpoint wsync converted from that model's weights, compute the same
logits on the same tokens.

Both forwards run in float32 on weights that are bf16 values (the checkpoint is bf16; transformers
loads it with dtype=torch.float32, an exact widening; the Megatron side's weights are those bf16
values too), so the only differences are the order of floating-point operations (matmul blocking,
fused vs separate softmax and RoPE, where each sum is taken), i.e. float32 rounding noise. TOLERANCE
bounds that noise relative to the logits' scale; `fp32_noise` measures it independently on every
check (transformers float32 against transformers float64, the same model): the observed Megatron vs
transformers difference must be of that order, and a conversion error (a permuted head, gate and up
swapped, experts exchanged: corruptions() below) is orders of magnitude above it. python/README.md
("How the Megatron -> HF conversion is proven") records the figures.

Used by megatron_forward.py (megatron's own initialisation, every architecture and layout) and by
megatron_train.py (every synced training step). Nothing here uses wsync code: the Megatron side is
megatron-core, the HF side transformers' from_pretrained of the checkpoint directory.
"""

import json
import pathlib
import shutil
import tempfile

import torch

# max |logits_megatron - logits_hf| over the real vocabulary <= TOLERANCE * max |logits_hf|.
# float32's unit roundoff is 2**-24 = 6.0e-8. float32's error on these computations, measured as
# transformers float32 against float64 (fp32_noise; 2-4 layers, hidden 256-512), is 3.4e-7..1.3e-6
# of the logits' scale, so two float32 evaluations in different orders differ by at most ~2.6e-6;
# 1e-5 is 4x above that, and the smallest conversion error tried (corruptions) is 1.8e-2, 1800x
# above it (python/README.md, "How the Megatron -> HF conversion is proven", has the figures).
TOLERANCE = 1e-5


def tokens_for(vocab, batch=2, seq=16, seed=7):
    """A seeded [batch, seq] batch over the real vocabulary, holding its first and last ids."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (batch, seq), generator=gen)
    t[0, 1], t[-1, -2] = 0, vocab - 1
    return t


def megatron_logits(model, tokens):
    """Collective over the world: the float32 logits [batch, seq, padded vocab] of `model` (a
    GPTModel built with parallel_output=False, or the rank's list of virtual pipeline chunks; every
    rank of every stage holding `tokens`), on world rank 0 (None elsewhere). Pipeline stages are run
    one after the other, in megatron's order: virtual stage 0 on pipeline ranks 0..pp-1, then
    virtual stage 1, ...; a stage's hidden states go to the next stage's rank (megatron's
    set_input_tensor; the last pipeline rank's to the first's for the next virtual stage), the
    logits from the last stage to rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True: masked (causal)
    dtype = next(p for c in chunks for p in c.parameters()).dtype
    first_rank, last_rank = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    # eval(): no dropout, and megatron's MoE layer refuses TP > 1 without sequence parallelism only
    # in training mode (moe_layer.py), so TP 2 MoE runs here though it cannot train on CPU
    training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            if not (first_rank and v == 0):  # from the previous stage (virtual stage v - 1's last rank)
                hidden = torch.empty(s, b, chunk.config.hidden_size, dtype=dtype)
                dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(hidden)
            out = chunk(tokens, pos, mask)
            if not (last_rank and v == len(chunks) - 1):
                dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
    for c, t in zip(chunks, training):
        c.train(t)
    rank = dist.get_rank()
    last = ps.get_pipeline_model_parallel_last_rank()  # of this rank's pipeline
    if first_rank and rank == 0:
        if last == 0:
            return out.float()
        logits = torch.empty(b, s, chunks[-1].vocab_size, dtype=dtype)
        dist.recv(logits, last)
        return logits.float()
    if last_rank and ps.get_pipeline_model_parallel_first_rank() == 0:
        dist.send(out.contiguous(), 0)
    return None


def megatron_mtp_logits(model, tokens):
    """(main logits, first MTP layer's logits), float32 [batch, seq, padded vocab], of `model` (a
    GPTModel with an MTP block, pipeline parallel size 1, built with parallel_output=False), every
    rank holding `tokens`; collective over its TP group. Megatron computes MTP logits only inside
    its training loss (GPTModel._postprocess: each MTP layer's output through output_layer, then the
    main output; forward() without labels fails with MTP layers), so both are taken from
    output_layer's calls while forward() computes the loss on `tokens` as labels. Position i's MTP logits predict token i + 2 from the main hidden state at i and the
    embedding of token i + 1 (the last position sees token 0: megatron's roll_tensor)."""
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    calls = []
    # cloned: megatron's cross entropy then works in place on the logits it is given
    hook = model.output_layer.register_forward_hook(lambda mod, args, out: calls.append(out[0].detach().clone()))
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(tokens, pos, mask, labels=tokens)
    finally:
        hook.remove()
        model.train(training)
    assert len(calls) == 1 + model.config.mtp_num_layers, len(calls)
    # [seq, batch, vocab] -> [batch, seq, vocab]
    return calls[-1].transpose(0, 1).float(), calls[0].transpose(0, 1).float()


def hf_mtp_logits(hf_dir, tokens, dtype=torch.float32):
    """The logits [batch, seq, vocab] of the checkpoint's first MTP layer model.layers.{L}.* as the
    engines' NextN draft models compute it (SGLang deepseek_nextn.py / glm4_moe_nextn.py, HF
    DeepSeek-V3's MTP module): lm_head(shared_head.norm(layer_L(eh_proj(cat(enorm(embed(next
    tokens)), hnorm(h)))))), h the main model's last hidden state (after model.norm) and the next
    tokens those of position i + 1 (0 at the last position, as in Megatron's training). The main
    model and layer L are transformers' own modules: the checkpoint loaded by from_pretrained once
    as it is (transformers leaves the MTP layer out) and once with num_hidden_layers L + 1, which
    loads layer L as a decoder layer (its enorm / hnorm / eh_proj / shared_head tensors, which no
    transformers module holds, are applied here by hand). Attention in layer L is causal over the
    sequence, with the main model's rotary embedding of the positions 0..seq-1."""
    import transformers
    from safetensors.torch import load_file

    hf_dir = pathlib.Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    L = cfg["num_hidden_layers"]
    weights = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    kw = dict(dtype=dtype, attn_implementation="eager", experts_implementation="eager")
    with tempfile.TemporaryDirectory() as d:
        models = []
        for layers in (L, L + 1):
            sub = pathlib.Path(d) / str(layers)
            sub.mkdir()
            (sub / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=layers)))
            for f in hf_dir.glob("*.safetensors"):
                (sub / f.name).symlink_to(f.resolve())
            models.append(transformers.AutoModelForCausalLM.from_pretrained(str(sub), **kw).eval())
    main, extended = models
    p = f"model.layers.{L}."
    norm_cls = type(main.model.norm)

    def rms(x, name):
        n = norm_cls(cfg["hidden_size"], eps=cfg["rms_norm_eps"]).to(dtype)
        n.weight.data.copy_(weights[name].to(dtype))
        return n(x)

    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        h = main.model(tokens, attention_mask=torch.ones_like(tokens)).last_hidden_state
        nxt = torch.roll(tokens, -1, dims=-1)
        nxt[:, -1] = 0
        e = main.model.embed_tokens(nxt)
        x = torch.cat([rms(e, p + "enorm.weight"), rms(h, p + "hnorm.weight")], dim=-1)
        x = torch.nn.functional.linear(x, weights[p + "eh_proj.weight"].to(dtype))
        causal = torch.full((s, s), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None].expand(b, 1, s, s)
        layer = extended.model.layers[L]
        x = layer(x, attention_mask=causal, position_ids=pos,
                  position_embeddings=extended.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        return main.lm_head(rms(x, p + "shared_head.norm.weight"))


def check_mtp(meg, hf_dir, tokens):
    """check() for the MTP layer's logits (hf_mtp_logits against megatron_mtp_logits)."""
    hf32 = hf_mtp_logits(hf_dir, tokens)
    out = compare(meg, hf32)
    noise = compare(hf32, hf_mtp_logits(hf_dir, tokens, torch.float64))
    out.update(fp32_noise=noise["rel"], tolerance=TOLERANCE, ok=out["rel"] <= TOLERANCE)
    return out


def mtp_corruptions(config):
    """{name: f(tensors)}: conversion errors in the MTP layer model.layers.{L}.* (MEGATRON_TO_HF.md
    §5.7), each of which hf_mtp_logits must see."""
    cfg = json.loads(pathlib.Path(config).read_text())
    p = f"model.layers.{cfg['num_hidden_layers']}."
    h = cfg["hidden_size"]

    def eh_proj_halves_swapped(t):  # the hidden state's columns taken for the embedding's
        w = t[p + "eh_proj.weight"]
        t[p + "eh_proj.weight"] = torch.cat([w[:, h:], w[:, :h]], dim=1).contiguous()

    def eh_proj_tp_rows_swapped(t):  # eh_proj's two TP row blocks concatenated in the wrong order
        w = t[p + "eh_proj.weight"]
        t[p + "eh_proj.weight"] = torch.cat([w[h // 2:], w[:h // 2]]).contiguous()

    def head_norm_is_final_norm(t):  # final_layernorm of the MTP layer taken from the decoder's
        t[p + "shared_head.norm.weight"] = t["model.norm.weight"].clone()
    return {"eh_proj_halves_swapped": eh_proj_halves_swapped, "eh_proj_tp_rows_swapped": eh_proj_tp_rows_swapped,
            "enorm_hnorm_swapped": lambda t: _swap(t, p + "enorm.weight", p + "hnorm.weight"),
            "mtp_head_norm_is_final_norm": head_norm_is_final_norm,
            "mtp_k_v_swapped": lambda t: _swap(t, p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight")}


def hf_logits(hf_dir, tokens, dtype=torch.float32):
    """transformers' logits [batch, seq, vocab] of the checkpoint in hf_dir, loaded by
    AutoModelForCausalLM.from_pretrained with `dtype` (eager attention; MoE experts in transformers'
    eager loop, its grouped_mm taking no float64). A quantization_config in config.json is left out:
    the checkpoint holds the bf16 weights a sync quantizes, not the INT4 form the engines serve."""
    import transformers

    hf_dir = pathlib.Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    moe = {"experts_implementation": "eager"} if "num_experts" in cfg or "n_routed_experts" in cfg else {}
    with tempfile.TemporaryDirectory() as plain:
        if "quantization_config" in cfg:
            # What the engines serve in INT4 is not what this checkpoint holds (bf16, before quantization).
            cfg.pop("quantization_config")
            (pathlib.Path(plain) / "config.json").write_text(json.dumps(cfg))
            for f in hf_dir.glob("*.safetensors"):
                (pathlib.Path(plain) / f.name).symlink_to(f.resolve())
            hf_dir = pathlib.Path(plain)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype,
                                                                  attn_implementation="eager", **moe).eval()
        with torch.no_grad():
            return model(tokens, attention_mask=torch.ones_like(tokens)).logits


def compare(meg, hf):
    """{max_diff, scale, rel}: max |meg - hf| over the real vocabulary (hf's last dimension; Megatron's
    padded rows beyond it are left out), max |hf|, and their ratio."""
    vocab = hf.shape[-1]
    diff = float((meg[..., :vocab].double() - hf.double()).abs().max())
    scale = float(hf.double().abs().max())
    return {"max_diff": diff, "scale": scale, "rel": diff / scale}


def check(meg, hf_dir, tokens):
    """Megatron's float32 logits against transformers' (float32) on the checkpoint in hf_dir, and
    transformers' own float32 noise (float32 vs float64, the same checkpoint). Returns the figures
    with ok = rel <= TOLERANCE."""
    hf32 = hf_logits(hf_dir, tokens)
    out = compare(meg, hf32)
    noise = compare(hf32, hf_logits(hf_dir, tokens, torch.float64))
    out.update(fp32_noise=noise["rel"], tolerance=TOLERANCE, ok=out["rel"] <= TOLERANCE)
    return out


def _swap(t, name_a, name_b):
    t[name_a], t[name_b] = t[name_b].clone(), t[name_a].clone()


def corruptions(config):
    """{name: f(tensors)}: conversion errors made by hand in a copy of an HF checkpoint, each the
    kind of mistake a Megatron -> HF converter can make (MEGATRON_TO_HF.md §2)."""
    cfg = json.loads(pathlib.Path(config).read_text())
    p = "model.layers.0."
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", cfg["hidden_size"] // heads)
    out = {}

    def q_heads_across_groups(t):
        # query head 0 (group 0) and the last head (last group) exchanged: a wrong de-interleaving
        # of linear_qkv's query groups
        w = t[p + "self_attn.q_proj.weight"].clone()
        w[:hd], w[-hd:] = t[p + "self_attn.q_proj.weight"][-hd:], t[p + "self_attn.q_proj.weight"][:hd]
        t[p + "self_attn.q_proj.weight"] = w
    if groups > 1:
        out["q_heads_across_groups"] = q_heads_across_groups
    out["k_v_swapped"] = lambda t: _swap(t, p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight")
    if cfg["model_type"] == "qwen2" or cfg.get("attention_bias"):
        out["k_v_bias_swapped"] = lambda t: _swap(t, p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias")
    if cfg.get("mlp_bias"):  # fc1's bias halves in the wrong order; o_proj's bias taken for down_proj's
        out["gate_up_bias_swapped"] = lambda t: _swap(t, p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")
        out["o_down_bias_swapped"] = lambda t: _swap(t, p + "self_attn.o_proj.bias", p + "mlp.down_proj.bias")
    if cfg["model_type"] in ("qwen3", "qwen3_moe") or cfg.get("use_qk_norm"):
        out["q_k_norm_swapped"] = lambda t: _swap(t, p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")
    if cfg["model_type"] == "qwen3_moe":
        e = cfg["num_experts"]
        x = p + "mlp.experts."
        out["gate_up_swapped"] = lambda t: _swap(t, x + "0.gate_proj.weight", x + "0.up_proj.weight")
        out["experts_exchanged"] = lambda t: [_swap(t, f"{x}0.{w}.weight", f"{x}{e - 1}.{w}.weight")
                                              for w in ("gate_proj", "up_proj", "down_proj")]
    else:
        if cfg["model_type"] == "glm4_moe":  # layer 0 is dense; the first MoE layer's experts and router
            x = f"model.layers.{cfg.get('first_k_dense_replace', 1)}.mlp."
            e = cfg["n_routed_experts"]
            def experts_shifted(t):  # every expert under the next one's id: an EP offset off by one
                for w in ("gate_proj", "up_proj", "down_proj"):
                    ws = [t[f"{x}experts.{i}.{w}.weight"] for i in range(e)]
                    for i in range(e):
                        t[f"{x}experts.{i}.{w}.weight"] = ws[(i + 1) % e]
            out["experts_shifted"] = experts_shifted
            out["shared_gate_up_swapped"] = lambda t: _swap(t, x + "shared_experts.gate_proj.weight",
                                                            x + "shared_experts.up_proj.weight")

            def expert_bias_reversed(t):  # e_score_correction_bias in the wrong expert order
                t[x + "gate.e_score_correction_bias"] = t[x + "gate.e_score_correction_bias"].flip(0).contiguous()
            out["expert_bias_reversed"] = expert_bias_reversed

        def gate_up_halves(t):
            # the first half of gate's rows exchanged with up's: fc1's TP shards cat'ed without the
            # GLU reordering (MEGATRON_TO_HF.md §2.3)
            g, u = t[p + "mlp.gate_proj.weight"].clone(), t[p + "mlp.up_proj.weight"].clone()
            h = g.shape[0] // 2
            g[:h], u[:h] = t[p + "mlp.up_proj.weight"][:h], t[p + "mlp.gate_proj.weight"][:h]
            t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = g, u
        out["gate_up_halves_swapped"] = gate_up_halves
    out["norms_swapped"] = lambda t: _swap(t, p + "input_layernorm.weight", p + "post_attention_layernorm.weight")
    last = cfg["num_hidden_layers"] - 1

    def layers_exchanged(t):
        # the first and last layers exchanged whole: a pipeline stage's local layer numbers taken as
        # global ones (MEGATRON_TO_HF.md §4); where one is dense and the other MoE (GLM-4.5's first
        # layers), the tensors both have (attention, norms)
        for name in [n for n in t if n.startswith(p)]:
            if name.replace(p, f"model.layers.{last}.", 1) in t:
                _swap(t, name, name.replace(p, f"model.layers.{last}.", 1))
    out["layers_exchanged"] = layers_exchanged

    def vocab_shards_exchanged(t):
        # lm_head's two halves of rows exchanged (the embedding's, tied): the vocabulary shards of
        # TP 2 concatenated in the wrong order
        name = "lm_head.weight" if "lm_head.weight" in t else "model.embed_tokens.weight"
        w = t[name]
        h = w.shape[0] // 2
        t[name] = torch.cat([w[h:2 * h], w[:h], w[2 * h:]])
    out["vocab_shards_exchanged"] = vocab_shards_exchanged
    return out


def corrupt(hf_dir, out_dir, fn):
    """A copy of the HF checkpoint in hf_dir at out_dir, fn(tensors) applied to its tensors."""
    from safetensors.torch import load_file, save_file

    hf_dir, out_dir = pathlib.Path(hf_dir), pathlib.Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    shutil.copy(hf_dir / "config.json", out_dir / "config.json")
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    before = {k: v.clone() for k, v in tensors.items()}
    fn(tensors)
    assert any(not torch.equal(before[k], tensors[k]) for k in tensors), "the corruption changed nothing"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir
