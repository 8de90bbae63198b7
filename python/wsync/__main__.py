"""``python -m wsync``: an engine process, wsync-ref-engine's flags. An EngineHost (wsync.engine)
with one adapter (wsync.adapters: transformers, vllm, sglang) serves one engine rank (TP 1) on a
rollout agent until SIGTERM or SIGINT; it prints "listening on ADDRESS" once it serves.
``python -m wsync.engine`` is the same command."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any, Dict, Optional, Sequence

from wsync._native import WsyncError
from wsync.engine import EngineHost


def _quant_json(args: argparse.Namespace, config: Dict[str, Any]) -> str:
    if args.quant_config == "none":
        return ""
    if args.quant_config:
        with open(args.quant_config) as f:
            j = json.load(f)
        return json.dumps(j.get("quantization_config", j))
    q = config.get("quantization_config")
    return json.dumps(q) if q else ""


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m wsync") -> int:
    """The engine process: parses `argv` (default: sys.argv), serves until SIGTERM or SIGINT; the
    exit status. `prog` names the command in usage and error messages."""
    name = prog.split()[-1]  # "wsync" or "wsync.engine", as error messages begin
    ap = argparse.ArgumentParser(prog=prog,
                                 description="A transformers model, vLLM or SGLang served as a wsync rollout engine (TP 1).")
    ap.add_argument("--adapter", choices=("transformers", "vllm", "sglang"), default="transformers")
    ap.add_argument("--sglang-url", default="", help="sglang: the SGLang server, e.g. http://127.0.0.1:30000")
    ap.add_argument("--model", default="", help="config.json, or a directory holding one (default: --checkpoint's)")
    ap.add_argument("--quant-config", default="", help="FILE | none (default: the config's quantization_config)")
    ap.add_argument("--checkpoint", default="", help="an HF checkpoint to serve as version 0 until the first sync")
    ap.add_argument("--engine-id", default="transformers")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--address-file", default="")
    ap.add_argument("--agent", default="")
    ap.add_argument("--agent-file", default="")
    ap.add_argument("--token-file", default="")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--param-memory", default="shm",
                    help="shm, or cuda:N: the parameters in one CUDA allocation on device N (transformers adapter: "
                         "the model and its generation on that GPU)")
    args = ap.parse_args(argv)
    import faulthandler

    faulthandler.enable()  # a crash in a callback thread prints every thread's Python stack
    if (args.tp_size, args.tp_rank, args.ep_size) != (1, 0, 1):
        ap.error(f"--tp-size {args.tp_size} --tp-rank {args.tp_rank} --ep-size {args.ep_size}: "
                 "this engine serves TP 1, EP 1")
    if not args.agent and not args.agent_file:
        ap.error("--agent or --agent-file is required")
    if args.param_memory != "shm" and args.adapter != "transformers":
        ap.error(f"--param-memory {args.param_memory}: the {args.adapter} adapter reads its parameters from host "
                 "memory (shm); only the transformers adapter runs on CUDA parameters")
    model = args.model or args.checkpoint
    if not model:
        ap.error("--model or --checkpoint is required")
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    with open(path) as f:
        config_text = f.read()
    config = json.loads(config_text)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        host = EngineHost(args.engine_id, config_text, agent=args.agent or None, agent_file=args.agent_file or None,
                          quant_json=_quant_json(args, config), listen=args.listen,
                          token_file=args.token_file or None, checkpoint=args.checkpoint or None,
                          param_memory=args.param_memory)
        if args.adapter == "sglang":
            from wsync.adapters.sglang import SglangEngine

            if not args.sglang_url:
                ap.error("--adapter sglang needs --sglang-url")
            SglangEngine(host, args.sglang_url)
        elif args.adapter == "vllm":
            from wsync.adapters.vllm import VllmEngine, model_dir, start_llm

            VllmEngine(host, start_llm(model_dir(config, host.quant_json), load_format="dummy"))
        else:
            from wsync.adapters.transformers import TransformersEngine

            TransformersEngine(host)
        address = host.start()
    except WsyncError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    print(f"listening on {address}", flush=True)
    if args.address_file:
        tmp = f"{args.address_file}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(address + "\n")
        os.replace(tmp, args.address_file)
    while not stop.wait(0.2):
        pass
    host.close()
    return 0


if __name__ == "__main__":
    # PROG: set by the `python -m wsync.engine` alias (wsync/engine.py) when it runs this module.
    sys.exit(main(prog=globals().get("PROG", "python -m wsync")))
