"""wsync.sglang in one process, against sglang_server.py (a server answering as SGLang
0.5.15.post1's routes do): run by test_sglang.py in the torch 2 environment ($WSYNC_MEGATRON_PYTHON)
that wsync.engine needs.

    python sglang_check.py --hf DIR

An engine host loaded from checkpoint DIR, the adapter pushing it into the server ("direct", in
1 MiB buckets, the version named): the server's parameters bit-exact with the host's; generation
on the server; the ABORT pause and the resume (HOLD sends nothing); refusals: a server whose model
has another shape (named, nothing served), a server that is not there, SGLang TP > 1. Prints
"sglang check passed".
"""

import argparse
import json
import sys

import torch

from sglang_server import FakeSglang
from wsync import WsyncError
from wsync.engine import EngineHost
from wsync.sglang import SglangEngine

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32}


def raises(fn):
    try:
        fn()
    except WsyncError as e:
        return e
    raise AssertionError(f"{fn} did not raise")


def _zeros_like_host(host, drop=None, reshape=None):
    params = {}
    for n, p in host.params.items():
        if n == drop:
            continue
        shape = reshape[1] if reshape and n == reshape[0] else p.shape
        params[n] = torch.zeros(shape, dtype=DTYPES[p.dtype])
    return params


def check_loads_direct_and_follows_pauses(hf):
    config = open(f"{hf}/config.json").read()
    host = EngineHost("sgl", config, agent="127.0.0.1:1", checkpoint=str(hf))
    fake = FakeSglang(_zeros_like_host(host), vocab_size=1000)
    try:
        eng = SglangEngine(host, fake.url, bucket_bytes=1 << 20)
        host.start()  # prepares the checkpoint as version 0: into SGLang
        assert host.health() == ("SERVING", 0)
        for n in host.params:
            assert torch.equal(fake.params[n].view(torch.uint8), host.tensor(n).view(torch.uint8)), n
        updates = [b for m, p, b in fake.log if p == "/update_weights_from_tensor"]
        assert len(updates) > 1, "1 MiB buckets: several requests"
        assert all(b["load_format"] == "direct" and b["weight_version"] == "0" for b in updates)
        assert [b["flush_cache"] for b in updates] == [False] * (len(updates) - 1) + [True]
        assert all(len(b["serialized_named_tensors"]) == 1 for b in updates)  # one per TP rank
        assert eng.weight_version() == "0"
        # Generation through the adapter runs on the server, with the weights it holds.
        assert eng.generate([1, 2, 3], 5) == fake.tokens_for(fake.params, [1, 2, 3], 5)
        # ABORT pauses SGLang and the next Continue resumes it; HOLD sends nothing (the update's lock holds).
        n = len(fake.log)
        eng.on_pause("HOLD")
        assert len(fake.log) == n
        eng.on_pause("ABORT")
        assert fake.log[-1][1:] == ("/pause_generation", {"mode": "abort"}) and fake.paused
        eng.on_continue(0)
        assert fake.log[-1][1] == "/continue_generation" and not fake.paused
        eng.on_continue(0)
        assert fake.log[-1][1] == "/continue_generation", "resumed once"
    finally:
        host.close()
        fake.close()


def check_refusals(hf):
    config = open(f"{hf}/config.json").read()
    host = EngineHost("sgl-wrong", config, agent="127.0.0.1:1", checkpoint=str(hf))
    name = "model.layers.0.mlp.down_proj.weight"
    fake = FakeSglang(_zeros_like_host(host, reshape=(name, (4, 4))), vocab_size=1000)
    try:
        SglangEngine(host, fake.url)
        e = raises(host.start)
        assert name in str(e) and "SGLang refused version 0" in str(e), e
        assert host.health()[0] == "NO_WEIGHTS"
    finally:
        host.close()
        fake.close()
    host = EngineHost("sgl-gone", config, agent="127.0.0.1:1", checkpoint=str(hf))
    try:
        SglangEngine(host, "http://127.0.0.1:1")
        e = raises(host.start)
        assert "SGLang at http://127.0.0.1:1" in str(e), e
        e = raises(lambda: SglangEngine(host, "http://127.0.0.1:1", tp_size=2))
        assert e.code_name == "UNIMPLEMENTED"
    finally:
        host.close()
    # An engine that declares TensorRT-LLM's layout is not an SGLang engine (docs/engine-formats.md).
    trtllm = {"quant_method": "compressed-tensors", "format": "pack-quantized", "engine_layout": "trtllm-sm80",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}}},
              "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"]}
    host = EngineHost("sgl-trtllm", config, agent="127.0.0.1:1", quant_json=json.dumps(trtllm))
    try:
        e = raises(lambda: SglangEngine(host, "http://127.0.0.1:1"))
        assert e.code_name == "UNIMPLEMENTED" and "trtllm-sm80" in str(e), e
    finally:
        host.close()



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    hf = ap.parse_args().hf
    check_loads_direct_and_follows_pauses(hf)
    check_refusals(hf)
    print("sglang check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
