"""SGLang as a wsync rollout engine, over SGLang's own HTTP API.

Written against SGLang **0.5.15.post1** (the version slime's images are built on), read from its
code: ``sglang/srt/entrypoints/http_server.py`` and ``sglang/srt/managers/io_struct.py`` (the
request and reply shapes are recorded in docs/sglang.md). SGLang's kernels are CUDA-only, so it
cannot run on wsync's CI machine: the adapter is tested against a server that answers exactly as
those routes do (tests/python/sglang_server.py), not against SGLang itself.

The engine host (wsync.engine.EngineHost, TP 1) holds the engine rank's parameters in SGLang's
*own* engine form: the same names (``qkv_proj.weight``, ``gate_up_proj.weight``,
``experts.w13_weight``, INT4 ``weight_packed`` / ``weight_scale``) and, for INT4, the Marlin layout
SGLang keeps after ``process_weights_after_loading``. So a version goes into SGLang with
``load_format: "direct"`` (a ``param.copy_()`` by exact name): no weight loader, no Marlin repack on
SGLang's side, no ``restore_weights_before_load`` / ``post_process_weights`` round (slime's
patched routes), and the bytes SGLang serves are the bytes ``wsyncctl verify`` checks.

The sync protocol, mapped onto SGLang:

| wsync (the rollout agent calls the host) | SGLang |
|---|---|
| Pause(HOLD) | nothing: the update below takes SGLang's model-update writer lock, so running requests finish first and new ones wait |
| Pause(ABORT) | ``POST /pause_generation {"mode": "abort"}`` |
| Continue(v), v new | ``POST /update_weights_from_tensor`` (buckets of at most ``bucket_bytes``; ``serialized_named_tensors`` = one base64 pickle per TP rank, ``load_format: "direct"``, ``flush_cache`` on the last bucket, ``weight_version: "v"``) |
| Continue(v), then | ``POST /continue_generation {}`` if it was paused with ABORT |

Every reply is checked (HTTP status, ``success``); a failed update fails the Continue and the
host turns UNHEALTHY (refusing its own requests) rather than claim a version SGLang does not hold.

Scope: SGLang with tensor parallelism 1 (one host per SGLang server); the tensors travel by value
in the request (a copy through HTTP per sync). Not built: SGLang's scheduler registering its CUDA
parameters with the rollout agent (CUDA IPC) for the agent to write them in place, as the engine
host's CUDA parameters are. Tested against a stand-in server only (tests/python/sglang_server.py,
docs/sglang.md): SGLang's kernels are CUDA-only.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import threading
import urllib.error
import urllib.request
from typing import Any, List, Optional, Sequence, Tuple

from wsync._native import WsyncError
from wsync.engine import EngineHost

__all__ = ["SGLANG_VERSION", "SglangEngine"]

SGLANG_VERSION = "0.5.15.post1"


class SglangEngine:
    """The engine host's adapter for an SGLang HTTP server at `url` (module comment)."""

    def __init__(self, host: EngineHost, url: str, *, api_key: Optional[str] = None, timeout: float = 600.0,
                 bucket_bytes: int = 256 << 20, tp_size: int = 1) -> None:
        if tp_size != 1:
            raise WsyncError(12, f"SGLang with tensor parallelism {tp_size}: this adapter serves TP 1")
        layout = json.loads(host.quant_json).get("engine_layout", "marlin") if host.quant_json else "marlin"
        if layout != "marlin":  # docs/engine-formats.md: SGLang holds Marlin and AWQ-Marlin
            raise WsyncError(12, f"SGLang holds Marlin weights; this engine declares engine_layout {layout!r}")
        if host.config.get("model_type") == "llama" and host.config.get("mlp_bias"):
            # sglang/srt/models/llama.py LlamaMLP: gate_up_proj and down_proj are built bias=False
            raise WsyncError(12, "SGLang's LlamaMLP has no biases: a Llama with mlp_bias=true would be served "
                                 "without them (vLLM serves it)")
        self.host, self.url, self.timeout = host, url.rstrip("/"), timeout
        self.api_key, self.bucket_bytes = api_key, int(bucket_bytes)
        self._paused = False
        self._lock = threading.Lock()
        self.calls: List[Tuple[str, str]] = []  # (method, route) of every request sent, for logs and tests
        host.attach(self)

    # --- HTTP ---------------------------------------------------------------------------------
    def _request(self, method: str, route: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        self.calls.append((method, route))
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                text = r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")
            try:
                reply = json.loads(detail)
                if isinstance(reply, dict) and "success" in reply:
                    return reply  # a refused update (HTTP 400 {"success": false, "message": ...}): the caller says so
            except json.JSONDecodeError:
                pass
            raise WsyncError(14, f"SGLang {method} {route}: HTTP {e.code}: {detail[:500]}") from None
        except (urllib.error.URLError, OSError) as e:
            raise WsyncError(14, f"SGLang at {self.url}: {method} {route}: {e}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text  # /flush_cache answers plain text

    # --- the host's callbacks -------------------------------------------------------------------
    def on_pause(self, mode: str) -> None:
        """ABORT: SGLang's /pause_generation (HOLD needs nothing: module comment)."""
        if mode == "ABORT":
            self._request("POST", "/pause_generation", {"mode": "abort"})
            self._paused = True

    def prepare(self, version: int) -> None:
        """Sends the segment's tensors (SGLang's names and layout) in buckets, "direct"."""
        buckets: List[List[str]] = []
        current: List[str] = []
        size = 0
        for name, p in self.host.params.items():
            if current and size + p.nbytes > self.bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(name)
            size += p.nbytes
        if current:
            buckets.append(current)
        with self._lock:
            for i, names in enumerate(buckets):
                named = [(n, self.host.tensor(n)) for n in names]  # pickled by value: the bytes travel
                buf = io.BytesIO()  # torch's own tensor pickling: what SGLang's SafeUnpickler rebuilds
                pickle.dump(named, buf, protocol=pickle.HIGHEST_PROTOCOL)
                body = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()],
                        "load_format": "direct", "flush_cache": i == len(buckets) - 1,
                        "weight_version": str(version)}
                reply = self._request("POST", "/update_weights_from_tensor", body)
                if not isinstance(reply, dict) or not reply.get("success"):
                    raise WsyncError(13, f"SGLang refused version {version} (bucket {i + 1} of {len(buckets)}): "
                                         f"{reply}")

    def on_continue(self, version: int) -> None:
        """SGLang's /continue_generation after an ABORT pause."""
        if self._paused:
            self._request("POST", "/continue_generation", {})
            self._paused = False

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> List[int]:
        """Greedy decoding of exactly max_new_tokens tokens through SGLang's /generate."""
        reply = self._request("POST", "/generate", {
            "input_ids": list(prompt),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
        if not isinstance(reply, dict) or "output_ids" not in reply:
            raise WsyncError(13, f"SGLang /generate answered {str(reply)[:300]}")
        return reply["output_ids"]

    def weight_version(self) -> Any:
        """The version SGLang reports (GET /model_info's weight_version)."""
        return self._request("GET", "/model_info").get("weight_version")
