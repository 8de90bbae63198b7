"""wsync.adapters.sglang in one process, against sglang_server.py (a server answering as SGLang
0.5.15.post1's routes do): run by test_sglang.py in the torch 2 environment ($WSYNC_MEGATRON_PYTHON)
that wsync.engine needs.

    python sglang_check.py --hf DIR

The server is seeded with SGLang's own parameters for DIR's config (sglang_form: SGLang's names,
shapes and dtypes, zero-filled, read from SGLang's code, not from wsync). An engine host loaded from
checkpoint DIR, the adapter pushing it into the server ("direct", in 1 MiB buckets, the version
named): the server then holds exactly what SGLang's own loaders make of DIR (sglang_form.expected,
computed without wsync), every parameter written once; generation on the server; the ABORT pause and
the resume (HOLD sends nothing). An engine form with k and v swapped or non-zero vocabulary padding
(the adapter's tensors wrapped) loads but fails the comparison. The premise breaking fails:
expectations stacked, transposed or padded otherwise than SGLang's loaders do differ from what the
server holds, naming exactly those parameters; a server whose model has another shape (a transposed
down_proj, a wrong size) or lacks a name refuses the version (named, nothing served). Qwen3 with
attention_bias (q/k/v and o_proj biases) likewise. INT4 (compressed-tensors W4A16): the host
quantizes the checkpoint as the trainer agents do, and the server then holds SGLang's Marlin form of
its compressed-tensors form (sglang_form: FORMATS.md's quantizer, SGLang's loaders and repack);
unpermuted scales or GPTQ-ordered weights differ; a server holding the unrepacked shapes refuses.
Refusals: a server that is not there, SGLang TP > 1, an engine of TensorRT-LLM's layout. Prints
"sglang check passed".
"""

import argparse
import json
import sys
import tempfile

import torch

import sglang_form
from safetensors_files import read_safetensors, write_safetensors
from sglang_server import FakeSglang
from wsync import WsyncError
from wsync.adapters.sglang import SglangEngine
from wsync.engine import EngineHost


def raises(fn):
    try:
        fn()
    except WsyncError as e:
        return e
    raise AssertionError(f"{fn} did not raise")


def _mutated(want, name, fn):
    out = dict(want)
    out[name] = fn(want[name])
    return out


def check_premise_breaks(held, want, config):
    """Expectations laid out otherwise than SGLang's loaders do must fail against what the server
    holds, naming exactly the parameters that differ."""
    hd = config["head_dim"]
    q, kv, f, v = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd, \
        config["intermediate_size"], config["vocab_size"]
    layers = range(config["num_hidden_layers"])
    wrong = {}
    kv_swapped = dict(want)  # q | v | k: k and v stacked in the other order
    for i in layers:
        n = f"model.layers.{i}.self_attn.qkv_proj.weight"
        w = want[n]
        kv_swapped[n] = torch.cat([w[:q], w[q + kv:], w[q:q + kv]])
    wrong["k/v stacked in the other order"] = (kv_swapped, [f"model.layers.{i}.self_attn.qkv_proj.weight"
                                                            for i in layers])
    n = "model.layers.1.mlp.gate_up_proj.weight"
    wrong["up before gate"] = (_mutated(want, n, lambda w: torch.cat([w[f:], w[:f]])), [n])
    n = "model.layers.0.self_attn.o_proj.weight"
    wrong["o_proj transposed"] = (_mutated(want, n, lambda w: w.t().contiguous()), [n])
    n = "model.layers.0.mlp.down_proj.weight"
    wrong["down_proj as [F, H] read row-major"] = (_mutated(want, n, lambda w: w.t().contiguous().view(w.shape)), [n])
    n = "model.embed_tokens.weight"
    wrong["vocabulary not padded"] = (_mutated(want, n, lambda w: w[:v].clone()), [n])
    wrong["padding rows first"] = (_mutated(want, n, lambda w: torch.cat([w[v:], w[:v]])), [n])
    for what, (expectation, names) in wrong.items():
        got = sglang_form.differences(held, expectation)
        assert got == sorted(names), (what, got)


def check_loads_direct_and_follows_pauses(hf):
    config_text = open(f"{hf}/config.json").read()
    config = json.loads(config_text)
    want = sglang_form.expected(hf)  # SGLang's loaders on the checkpoint, without wsync
    host = EngineHost("sgl", config_text, agent="127.0.0.1:1", checkpoint=str(hf))
    fake = FakeSglang(sglang_form.zero_params(config), vocab_size=config["vocab_size"])
    try:
        eng = SglangEngine(host, fake.url, bucket_bytes=1 << 20)
        host.start()  # prepares the checkpoint as version 0: into SGLang
        assert host.health() == ("SERVING", 0)
        assert sglang_form.differences(fake.params, want) == []
        assert sorted(fake.written["0"]) == sorted(want), "every parameter written, once"
        check_premise_breaks(fake.params, want, config)
        updates = [b for m, p, b in fake.log if p == "/update_weights_from_tensor"]
        assert len(updates) > 1, "1 MiB buckets: several requests"
        assert all(b["load_format"] == "direct" and b["weight_version"] == "0" for b in updates)
        assert [b["flush_cache"] for b in updates] == [False] * (len(updates) - 1) + [True]
        assert all(len(b["serialized_named_tensors"]) == 1 for b in updates)  # one per TP rank
        assert eng.weight_version() == "0"
        # Generation through the adapter runs on the server, with the weights it holds.
        assert eng.generate([1, 2, 3], 5) == fake.tokens_for(want, [1, 2, 3], 5)
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


def check_a_wrong_engine_form_fails(hf):
    """What the oracle is for: had wsync's engine form k and v swapped in qkv_proj, or non-zero
    vocabulary padding rows, the version would load (the names and shapes fit) and the server would
    hold something other than SGLang's form, and the comparison names exactly those parameters. The
    engine form is broken here by wrapping the host's tensor() the adapter sends from."""
    config_text = open(f"{hf}/config.json").read()
    config = json.loads(config_text)
    want = sglang_form.expected(hf)
    hd, v = config["head_dim"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    layers = range(config["num_hidden_layers"])
    bugs = {
        "k and v swapped": (lambda n, t: torch.cat([t[:q], t[q + kv:], t[q:q + kv]])
                            if n.endswith("qkv_proj.weight") else t,
                            [f"model.layers.{i}.self_attn.qkv_proj.weight" for i in layers]),
        "padding rows not zero": (lambda n, t: torch.cat([t[:v], t[:1].expand(t.shape[0] - v, -1)])
                                  if n == "lm_head.weight" else t, ["lm_head.weight"]),
    }
    for what, (bug, names) in bugs.items():
        host = EngineHost("sgl-bug", config_text, agent="127.0.0.1:1", checkpoint=str(hf))
        fake = FakeSglang(sglang_form.zero_params(config), vocab_size=v)
        try:
            tensor = host.tensor
            host.tensor = lambda n, tensor=tensor, bug=bug: bug(n, tensor(n)).contiguous()
            SglangEngine(host, fake.url)
            host.start()
            assert sglang_form.differences(fake.params, want) == sorted(names), what
        finally:
            host.close()
            fake.close()


def check_qwen3_attention_bias(hf):
    """Qwen3 with attention_bias: SGLang gives qkv_proj and o_proj a bias (qwen3.py:121-141). The
    checkpoint hf with q/k/v/o biases added is served as SGLang holds it."""
    config = dict(json.loads(open(f"{hf}/config.json").read()), attention_bias=True)
    tensors = read_safetensors(f"{hf}/model.safetensors")
    gen = torch.Generator().manual_seed(3)
    hd = config["head_dim"]
    sizes = {"q": config["num_attention_heads"] * hd, "k": config["num_key_value_heads"] * hd,
             "v": config["num_key_value_heads"] * hd, "o": config["hidden_size"]}
    for i in range(config["num_hidden_layers"]):
        for proj, n in sizes.items():
            b = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
            data = b.view(torch.uint8).numpy().tobytes()
            tensors[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = ("BF16", (n,), data)
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump(config, f)
        write_safetensors(f"{d}/model.safetensors", tensors)
        want = sglang_form.expected(d)
        assert sum(n.endswith((".qkv_proj.bias", ".o_proj.bias")) for n in want) == 2 * config["num_hidden_layers"]
        host = EngineHost("sgl-bias", json.dumps(config), agent="127.0.0.1:1", checkpoint=d)
        fake = FakeSglang(sglang_form.zero_params(config), vocab_size=config["vocab_size"])
        try:
            SglangEngine(host, fake.url)
            host.start()
            assert sglang_form.differences(fake.params, want) == []
            assert sorted(fake.written["0"]) == sorted(want)
        finally:
            host.close()
            fake.close()


def _refused(hf, config_text, params, name, why):
    """An SGLang server holding `params` refuses checkpoint hf as version 0, naming `name`."""
    host = EngineHost("sgl-wrong", config_text, agent="127.0.0.1:1", checkpoint=str(hf))
    fake = FakeSglang(params, vocab_size=1000)
    try:
        SglangEngine(host, fake.url)
        e = raises(host.start)
        assert name in str(e) and "SGLang refused version 0" in str(e), (why, e)
        assert host.health()[0] == "NO_WEIGHTS", why
    finally:
        host.close()
        fake.close()


def check_refusals(hf):
    config_text = open(f"{hf}/config.json").read()
    config = json.loads(config_text)
    for name, shape, why in [
            ("model.layers.0.mlp.down_proj.weight", (config["intermediate_size"], config["hidden_size"]),
             "down_proj held transposed"),
            ("model.layers.1.self_attn.qkv_proj.weight", (4, 4), "a wrong size"),
            ("model.embed_tokens.weight", (config["vocab_size"], config["hidden_size"]), "vocabulary not padded")]:
        params = sglang_form.zero_params(config)
        params[name] = torch.zeros(shape, dtype=params[name].dtype)
        _refused(hf, config_text, params, name, why)
    params = sglang_form.zero_params(config)  # a name SGLang does not have: refused, named
    params["model.layers.0.mlp.gate_proj.weight"] = params.pop("model.layers.0.mlp.gate_up_proj.weight")
    _refused(hf, config_text, params, "model.layers.0.mlp.gate_up_proj.weight", "a name the server lacks")
    host = EngineHost("sgl-gone", config_text, agent="127.0.0.1:1", checkpoint=str(hf))
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
    host = EngineHost("sgl-trtllm", config_text, agent="127.0.0.1:1", quant_json=json.dumps(trtllm))
    try:
        e = raises(lambda: SglangEngine(host, "http://127.0.0.1:1"))
        assert e.code_name == "UNIMPLEMENTED" and "trtllm-sm80" in str(e), e
    finally:
        host.close()
    # A Llama with MLP biases: SGLang's LlamaMLP has none (it would serve the model without them).
    llama = dict(config, architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True, mlp_bias=True)
    host = EngineHost("sgl-mlp-bias", json.dumps(llama), agent="127.0.0.1:1")
    try:
        e = raises(lambda: SglangEngine(host, "http://127.0.0.1:1"))
        assert e.code_name == "UNIMPLEMENTED" and "mlp_bias" in str(e), e
    finally:
        host.close()


def check_int4(hf):
    """The same for an INT4 engine (compressed-tensors W4A16 -> SGLang's Marlin form): the host
    quantizes checkpoint hf as the trainer agents do, and the server then holds SGLang's form of its
    compressed-tensors INT4 form (sglang_form.compress, from FORMATS.md, then SGLang's loaders and
    Marlin repack); scales left unpermuted or weights left in GPTQ order differ; a server holding
    the compressed-tensors shapes (no Marlin repack) refuses the version."""
    config_text = open(f"{hf}/config.json").read()
    config = dict(json.loads(config_text), quantization_config=sglang_form.W4A16)
    quant = json.dumps(sglang_form.W4A16)
    want = sglang_form.expected(hf, sglang_form.W4A16)
    metadata = sglang_form.metadata(config)
    synced = sorted(set(want) - set(metadata))
    seed = sglang_form.zero_params(config)
    host = EngineHost("sgl-int4", config_text, agent="127.0.0.1:1", quant_json=quant, checkpoint=str(hf))
    fake = FakeSglang(sglang_form.zero_params(config), vocab_size=config["vocab_size"])
    try:
        SglangEngine(host, fake.url)
        host.start()
        assert sglang_form.differences({n: fake.params[n] for n in synced}, {n: want[n] for n in synced}) == []
        assert sglang_form.differences({n: fake.params[n] for n in metadata}, {n: seed[n] for n in metadata}) == []
        assert sorted(fake.written["0"]) == synced
        held = {n: fake.params[n] for n in synced}
        expect = {n: want[n] for n in synced}
        n = "model.layers.0.self_attn.qkv_proj.weight_scale"
        g = sglang_form.W4A16["config_groups"]["group_0"]["weights"]["group_size"]
        k = config["hidden_size"]
        # The scales as loaded ([N, K/G] transposed), not marlin_permute_scales'd.
        unpermuted = dict(expect)
        unpermuted[n] = _inverse_scale_perm(want[n], k, g)
        assert sglang_form.differences(held, unpermuted) == [n]
        # The weight in GPTQ order ([K/8, N] words, reshaped), not Marlin's tiles.
        m = "model.layers.1.mlp.down_proj.weight_packed"
        gptq = dict(expect)
        gptq[m] = _gptq_of(hf, "model.layers.1.mlp.down_proj.weight", g).reshape(want[m].shape)
        assert sglang_form.differences(held, gptq) == [m]
    finally:
        host.close()
        fake.close()
    params = sglang_form.zero_params(config)  # compressed-tensors shapes, as if never repacked
    name = "model.layers.0.mlp.gate_up_proj.weight_packed"
    params[name] = torch.zeros(2 * config["intermediate_size"], config["hidden_size"] // 8, dtype=torch.int32)
    host = EngineHost("sgl-int4-wrong", config_text, agent="127.0.0.1:1", quant_json=quant, checkpoint=str(hf))
    fake = FakeSglang(params, vocab_size=config["vocab_size"])
    try:
        SglangEngine(host, fake.url)
        e = raises(host.start)
        assert name in str(e) and "SGLang refused version 0" in str(e), e
    finally:
        host.close()
        fake.close()


def _inverse_scale_perm(permuted, size_k, group):
    """The [K/G, N] scales before marlin_permute_scales (its permutation inverted)."""
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    inverse = sorted(range(64), key=lambda i: scale_perm[i])
    assert group < size_k
    return permuted.reshape(-1, 64)[:, inverse].reshape(permuted.shape).contiguous()


def _gptq_of(hf, name, group):
    """GPTQ words [K/8, N] of one checkpoint weight, quantized as sglang_form does."""
    w = sglang_form.read_checkpoint(hf)[name]
    packed, _, _ = sglang_form.quantize(w, group)
    return packed.t().contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    hf = ap.parse_args().hf
    check_loads_direct_and_follows_pauses(hf)
    check_a_wrong_engine_form_fails(hf)
    check_qwen3_attention_bias(hf)
    check_refusals(hf)
    check_int4(hf)
    print("sglang check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
