"""wsync.adapters.transformers.TransformersEngine in one process, against transformers itself (hf_oracle.py): run
by test_engine.py in the torch 2 environment ($WSYNC_MEGATRON_PYTHON, which has transformers).

    python engine_check.py --hf DIR [--int4 FILE] --prompt 1,2,3 --max-new-tokens 6

An EngineHost loads the checkpoint into its segment (the engine form a sync writes), a
TransformersEngine binds a transformers model to it, and every parameter of that model must equal
the oracle's bit for bit, and so must every persistent buffer (bf16: the checkpoint as transformers
loads it; INT4: dequantized from FILE independently); the bf16 ones must be views of the segment (no
copy); a tied model's lm_head, even one holding a Parameter of its own, serves the embedding; greedy
tokens must equal
the oracle's. Then the refusals: a model whose shapes differ from the engine's names every
parameter that does not fit, and nothing is served. Prints "engine check passed" at the end.
"""

import json
import pathlib
import sys

import torch
import transformers

from hf_oracle import greedy, load_model, parse_args
from wsync import WsyncError
from wsync.adapters.transformers import TransformersEngine
from wsync.engine import EngineHost


def weights(model):
    """{name: tensor} of every parameter and every persistent buffer (a checkpoint's tensor too, e.g.
    DeepSeek-V3's e_score_correction_bias) of `model`."""
    out = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def check_cuda_params(args, config_text, quant, prompt):
    """The engine's parameters in CUDA memory (param_memory="cuda:0"): a bad value refused; without a
    GPU the host refused naming CUDA; with one, the model runs on the GPU over views of the host's
    allocation and its greedy tokens equal a fresh transformers model's on the GPU (bf16)."""
    try:
        EngineHost("check-bad-memory", config_text, agent="127.0.0.1:1", quant_json=quant, param_memory="gpu")
        raise AssertionError("param_memory 'gpu' was accepted")
    except WsyncError as e:
        assert e.code_name == "INVALID_ARGUMENT" and "want shm or cuda:N" in str(e), e
    if not torch.cuda.is_available():
        try:
            EngineHost("check-cuda", config_text, agent="127.0.0.1:1", quant_json=quant, param_memory="cuda:0")
            raise AssertionError("CUDA parameter memory was created without a GPU")
        except WsyncError as e:
            assert "CUDA" in str(e), e
        print("CUDA parameter memory refused without a GPU")
        return
    host = EngineHost("check-cuda", config_text, agent="127.0.0.1:1", quant_json=quant, checkpoint=args.hf,
                      param_memory="cuda:0")
    engine = TransformersEngine(host)
    host.start()
    assert all(p.device == 0 for p in host.params.values())
    assert all(t.device.type == "cuda" for t in weights(engine.model).values())
    tokens, version = engine.generate_request(prompt, args.max_new_tokens)
    if not args.int4:
        fresh = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.bfloat16).to("cuda:0").eval()
        want = greedy(fresh, prompt, args.max_new_tokens)
        assert version == 0 and tokens == want, (version, tokens, want)
    host.close()
    print(f"CUDA parameter memory: the model on cuda:0, tokens {tokens}")


def main():
    args = parse_args()
    config_text = (pathlib.Path(args.hf) / "config.json").read_text()
    config = json.loads(config_text)
    quant = json.dumps(config["quantization_config"]) if args.int4 else ""
    prompt = args.prompt

    host = EngineHost("check", config_text, agent="127.0.0.1:1", quant_json=quant, checkpoint=args.hf)
    engine = TransformersEngine(host)
    host.start()
    assert host.health() == ("SERVING", 0), host.health()
    oracle = load_model(args.hf, args.int4).eval()
    ours, theirs = weights(engine.model), weights(oracle)
    assert sorted(ours) == sorted(theirs), set(ours) ^ set(theirs)
    segment = [(p.address, p.address + p.nbytes) for p in host.params.values()]
    views = copies = 0
    for name, p in ours.items():
        assert p.dtype == theirs[name].dtype and p.shape == theirs[name].shape, name
        assert torch.equal(p.view(torch.uint8), theirs[name].view(torch.uint8)), f"{name} differs from the oracle"
        in_segment = any(lo <= p.data_ptr() < hi for lo, hi in segment)
        views += in_segment
        copies += not in_segment
    assert views > 0
    if not args.int4:
        assert copies == 0, f"{copies} bf16 parameters are copies, not views of the segment"
    tokens, version = engine.generate_request(prompt, args.max_new_tokens)
    want = greedy(oracle, prompt, args.max_new_tokens)
    assert version == 0 and tokens == want, (version, tokens, want)
    # The segment as an HF checkpoint (what vLLM's load_weights takes): equal to the checkpoint's
    # tensors, INT4 ones to their compressed-tensors (or AWQ) form (FILE), bit for bit.
    from safetensors.torch import load_file

    want_tensors = {}
    for f in sorted(pathlib.Path(args.hf).glob("*.safetensors")):
        want_tensors.update(load_file(str(f)))
    if args.int4:
        q = load_file(args.int4)
        for name in q:
            if name.endswith(".weight_packed"):
                del want_tensors[name[: -len("_packed")]]
            elif name.endswith(".qweight"):  # AWQ
                del want_tensors[name[: -len(".qweight")] + ".weight"]
        want_tensors.update(q)
    got = dict(host.hf_tensors())
    assert sorted(got) == sorted(want_tensors), set(got) ^ set(want_tensors)
    for name, t in got.items():
        w = want_tensors[name]
        assert t.dtype == w.dtype and t.shape == w.shape, (name, t.dtype, w.dtype, t.shape, w.shape)
        assert torch.equal(t.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), f"{name} differs"
    print(f"{views} parameters are views of the segment, {copies} dequantized copies; all equal the oracle; "
          f"tokens {tokens}; {len(got)} checkpoint tensors restored bit-exact")
    # Writing the segment is what a sync does: the model sees it at once (bf16) or at prepare (INT4).
    name = "model.norm.weight"
    with torch.no_grad():
        host.tensor(name).mul_(2)
    assert torch.equal(ours[name], theirs[name] * 2)
    host.close()

    if config.get("tie_word_embeddings"):
        # A model whose config ties the word embeddings but whose lm_head holds a Parameter of its own
        # (built or loaded so): its lm_head is bound to the embedding in the segment too, and it serves
        # the oracle's tokens (a head left on its own Parameter would keep the weights it was built with).
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        own = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**plain),
                                                            dtype=torch.bfloat16)
        own.lm_head.weight = torch.nn.Parameter(own.lm_head.weight.detach().clone(), requires_grad=False)
        assert own.lm_head.weight is not own.model.embed_tokens.weight
        host = EngineHost("check-own-head", config_text, agent="127.0.0.1:1", quant_json=quant, checkpoint=args.hf)
        own_engine = TransformersEngine(host, model=own)
        host.start()
        got, _ = own_engine.generate_request(prompt, args.max_new_tokens)
        assert got == want, (got, want)
        assert own.lm_head.weight.data_ptr() == own.model.embed_tokens.weight.data_ptr()
        host.close()
        print("a tied model with an lm_head Parameter of its own serves the embedding")

    check_cuda_params(args, config_text, quant, prompt)

    # A model that does not fit the engine: every mis-shaped parameter named, nothing served.
    key = "moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size"
    small = dict(config, **{key: config[key] // 2})
    small.pop("quantization_config", None)
    wrong = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**small),
                                                          dtype=torch.bfloat16)
    host = EngineHost("check-wrong", config_text, agent="127.0.0.1:1", quant_json=quant)
    try:
        TransformersEngine(host, model=wrong)
        raise AssertionError("a mis-shaped model was accepted")
    except WsyncError as e:
        assert e.code_name == "INVALID_ARGUMENT", e
        want = ([".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"] if key.startswith("moe")
                else ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"])
        assert all(w in str(e) for w in want), e
        print(f"refused: {str(e)[:200]}...")
    try:
        host.start()
        raise AssertionError("started without an adapter")
    except WsyncError as e:
        assert e.code_name == "FAILED_PRECONDITION", e
    assert host.health() == ("NO_WEIGHTS", 0)
    host.close()
    print("engine check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
