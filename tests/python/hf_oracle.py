"""The oracle of the engine tests (test_engine.py, test_fresh_load.py): HuggingFace transformers
itself, loading the checkpoint a sync should have delivered, and generating greedily as
wsync.adapters.transformers.TransformersEngine does.

    python hf_oracle.py --hf DIR [--int4 FILE] [--float32] --prompt 1,2,3 [--prompt ...] --max-new-tokens 6

--int4 FILE: the engine serves INT4; FILE is the checkpoint's compressed-tensors INT4 form
(`wsync-int4 quantize`, what the trainer agents send). Every `X.weight_packed` / `X.weight_scale`
pair is dequantized here, independently of wsync's kernels, from FORMATS.md §2: eight 4-bit
values per int32, the low nibble first; value = bf16((nibble - 8) * scale), scale per group of G
input columns; and replaces `X.weight` before transformers loads the checkpoint (without its
quantization_config). An AWQ FILE (`X.qweight` / `X.qzeros` / `X.scales`, AWQ.md §2) likewise:
nibble i of a word holds output column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]; value = bf16((u - z) * scale).
No wsync code runs here (torch, transformers and safetensors only; checked at the end). Prints one
JSON line: {"tokens": [...] (the first prompt's), "outputs": [[...] per prompt], "params": {name: sha256 of bytes}}.
"""

import argparse
import hashlib
import json
import os
import pathlib
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file


def dequantize(packed, scale):
    """[N, K/8] int32 + [N, K/G] bf16 -> [N, K] bf16."""
    n, k8 = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8], low nibble first
    q = (nibbles.reshape(n, k8 * 8) - 8).to(torch.float32)
    g = (k8 * 8) // scale.shape[1]
    s = scale.to(torch.float32).repeat_interleave(g, dim=1)
    return (q * s).to(torch.bfloat16)  # q * s is exact in float32 (|q| <= 8, s a bf16): one rounding


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_codes(packed):
    """AWQ-packed [R, N/8] int32 -> [R, N] codes: nibble i of word j is column 8j + AWQ_ORDER[i]."""
    r, n8 = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, N/8, 8], nibble i at index i
    codes = torch.empty_like(nibbles)
    codes[:, :, list(AWQ_ORDER)] = nibbles
    return codes.reshape(r, n8 * 8)


def dequantize_awq(qweight, qzeros, scales):
    """qweight [K, N/8] + qzeros [K/G, N/8] + scales [K/G, N] -> [N, K] bf16."""
    u, z = awq_codes(qweight), awq_codes(qzeros)
    g = u.shape[0] // z.shape[0]
    q = (u - z.repeat_interleave(g, dim=0)).to(torch.float32)
    w = q * scales.to(torch.float32).repeat_interleave(g, dim=0)  # exact: |u - z| <= 15, a bf16 scale
    return w.to(torch.bfloat16).t().contiguous()


def load_model(hf, int4, dtype=torch.bfloat16):
    if not int4:
        return transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=dtype)
    tensors = {}
    for f in sorted(pathlib.Path(hf).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    q = load_file(int4)
    replaced = 0
    for name in list(q):
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            tensors[base] = dequantize(q[name], q[base + "_scale"])
            replaced += 1
        elif name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            tensors[prefix + ".weight"] = dequantize_awq(q[name], q[prefix + ".qzeros"], q[prefix + ".scales"])
            replaced += 1
    assert replaced > 0, f"{int4} holds no weight_packed or qweight tensor"
    config = json.loads((pathlib.Path(hf) / "config.json").read_text())
    config.pop("quantization_config", None)
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))
        return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype)


def parse_args():
    """--hf, --int4, --prompt (repeatable; args.prompts: lists of ints, args.prompt the first),
    --max-new-tokens: what the oracle and engine_check.py take."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--int4", default="")
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--float32", action="store_true",
                    help="compute in float32 on the checkpoint's values, as the reference engine does")
    args = ap.parse_args()
    args.prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
    args.prompt = args.prompts[0]
    return args


def greedy(model, prompt, max_new_tokens):
    """Exactly max_new_tokens greedy tokens (model.generate, no EOS stop)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def main():
    args = parse_args()
    model = load_model(args.hf, args.int4, torch.float32 if args.float32 else torch.bfloat16).eval()
    params = {n: hashlib.sha256(p.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
              for n, p in model.named_parameters()}
    outputs = [greedy(model, p, args.max_new_tokens) for p in args.prompts]
    loaded = sorted(m for m in sys.modules if m == "wsync" or m.startswith("wsync."))
    assert not loaded, f"the oracle ran wsync code: {loaded}"
    print(json.dumps({"tokens": outputs[0], "outputs": outputs, "params": params}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
