#!/usr/bin/env python3
"""Golden data for wsync's FP8 quantizers (docs/spec/FP8.md), computed by torch.

Each case is a weight W (bf16 or fp16, seeded random values plus the spec's edge cases) and what
the upstream expression gives for it, written the way the upstream code writes it, in torch ops:
float32 amax / floor / 448 / reciprocal, the clamp, and torch's own `.to(torch.float8_e4m3fn)`
cast (c10's encoder, which the C++ does not share). kernels/fp8_test.cc requires its quantizers
to reproduce every byte of q and every bit of the scales.

Run (from the repository root, with a torch that has float8_e4m3fn):

    python tools/golden/fp8_golden.py --out tests/data/golden

Output is deterministic (torch.Generator seeded with SEED, stored in the file's metadata).
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

SEED = 20261129
F8 = torch.float8_e4m3fn
MAX = 448.0


def tiles(w, bn, bk):
    """[E, N, K] -> zero-padded [E, nb, bn, kb, bk] float32 and the padded sizes."""
    e, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    p = torch.zeros(e, nb * bn, kb * bk, dtype=torch.float32)
    p[:, :n, :k] = w.float()
    return p.view(e, nb, bn, kb, bk), nb, kb


def untile(q, e, n, k, nb, bn, kb, bk):
    return q.view(e, nb * bn, kb * bk)[:, :n, :k].contiguous()


def block(w, bn, bk, variant):
    """slime: fp8_kernel.py blockwise_cast_to_fp8_triton in IEEE float32; vllm: per_block_cast_to_fp8;
    ue8m0: sglang per_block_cast_to_fp8 with ceil_to_ue8m0 (bit form)."""
    e, n, k = w.shape
    x, nb, kb = tiles(w, bn, bk)
    amax = x.abs().amax(dim=(2, 4), keepdim=True)
    if variant == "slime":
        s = torch.clamp(amax, min=torch.tensor(1e-10, dtype=torch.float32)) / MAX
        r = 1.0 / s
        q = torch.clamp(x * r, -MAX, MAX).to(F8)
    elif variant == "vllm":
        s = amax.clamp(1e-4) / MAX
        q = (x * (1.0 / s)).to(F8)
    else:  # ue8m0
        t = amax.clamp(1e-4) / MAX
        bits = t.view(torch.int32)
        exp = (bits >> 23) & 0xFF
        exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        s = (exp.clamp(1, 254) << 23).view(torch.float32)
        q = (x * (1.0 / s)).to(F8)
    return untile(q, e, n, k, nb, bn, kb, bk), s.view(e, nb, kb).contiguous()


def channel(w, variant):
    """slime: convert_hf_to_fp8.py channel_fp8 (clamp in the weight's dtype, then float32);
    compressed-tensors: MinMaxObserver + calculate_qparams + _quantize, all in the weight's dtype."""
    if variant == "slime":
        if w.dtype == torch.bfloat16:
            amax = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12).to(torch.float32)
        else:  # slime's fp16 clamp underflows to 0 (NaN rows); the spec's floor is bf16(1e-12) in float32
            floor = torch.tensor(1e-12).to(torch.bfloat16).float()
            amax = torch.maximum(w.abs().amax(dim=-1, keepdim=True).float(), floor)
        s = amax / MAX
        q = torch.clamp(w / s, -MAX, MAX).to(F8)  # bf16 / f32 promotes to f32
        return q, s
    amax = w.abs().amax(dim=-1, keepdim=True)
    s = amax / (2 * MAX / 2)
    eps = torch.finfo(w.dtype).eps
    s = torch.where(s == 0, torch.full_like(s, eps), s)
    q = torch.clamp(w / s, -MAX, MAX).to(F8)
    return q, s


def weight(gen, e, n, k, dtype, kind):
    w = torch.randn(e, n, k, generator=gen) * 0.02
    if kind == "edges":
        flat = w.view(-1)
        m = flat.numel()
        specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e-39, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 1.0625,
                                 -17.0, 1e4, -3e4, 65504.0, 448.0, -448.0, 464.0, 480.0, 1e-8])
        idx = torch.randint(0, m, (len(specials) * 8,), generator=gen)
        flat[idx] = specials.repeat(8)
        w[0, : min(n, 128), : min(k, 128)] = 0.0  # an all-zero block
        w[-1, -1, :] = 0.0                           # an all-zero row
        if e > 1:  # a block whose amax is 448: x * r (r = 1) lands on the codes' midpoints exactly
            w[1, : min(n, 128), : min(k, 128)] = torch.randn(min(n, 128), min(k, 128), generator=gen) * 0.02
            mids = torch.tensor([1.0625, 17.0, 3 * 2.0 ** -10, 0.5625, 2.0 ** -10, 240.0, 208.0, 448.0])
            w[1, :8, :8] = mids.repeat(8).view(8, 8)
    if dtype == torch.float16:
        w = w.clamp(-65504, 65504)
    return w.to(dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(SEED)
    tensors, cases = {}, []
    shapes = {"bf16": [(1, 160, 256), (2, 130, 200), (3, 33, 140), (1, 1, 7)], "f16": [(2, 130, 200), (1, 1, 7)]}
    for dtype, dname in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
        for e, n, k in shapes[dname]:
            for kind in ("edges",):  # seeded N(0, 0.02) values with the edge values scattered in
                w = weight(gen, e, n, k, dtype, kind)
                base = f"{dname}_{e}x{n}x{k}_{kind}"
                tensors[f"{base}.w"] = w
                for v in ("slime", "vllm", "ue8m0"):
                    q, s = block(w, 128, 128, v)
                    tensors[f"{base}.block_{v}.q"] = q
                    tensors[f"{base}.block_{v}.s"] = s
                    cases.append(f"{base}.block_{v}")
                for v in ("slime", "compressed-tensors"):
                    q, s = channel(w, v)
                    tensors[f"{base}.channel_{v}.q"] = q
                    tensors[f"{base}.channel_{v}.s"] = s.contiguous()
                    cases.append(f"{base}.channel_{v}")
    for c in cases:  # the expressions must not produce NaN codes on finite input
        assert not tensors[f"{c}.q"].float().isnan().any(), c
    os.makedirs(args.out, exist_ok=True)
    meta = {"seed": str(SEED), "torch": torch.__version__, "cases": json.dumps(cases)}
    save_file(tensors, os.path.join(args.out, "fp8_golden.safetensors"), metadata=meta)
    print(f"wrote {len(cases)} cases to {args.out}/fp8_golden.safetensors")


if __name__ == "__main__":
    main()
