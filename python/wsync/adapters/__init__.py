"""The engine host's adapters (wsync.engine.EngineHost.attach): an engine that wsync does not build,
driven by the host's callbacks (prepare, generate, on_pause, on_continue).

* wsync.adapters.transformers.TransformersEngine: a HuggingFace transformers model, its weights
  views of the host's segment;
* wsync.adapters.vllm.VllmEngine: vLLM through its weight-transfer backend "wsync" (registered as
  a vllm.general_plugins entry point);
* wsync.adapters.sglang.SglangEngine: an SGLang server over its HTTP API.

Each imports its engine's library only when used.
"""
