"""An HTTP server that answers as SGLang 0.5.15.post1's routes do (docs/sglang.md records them from
its code: sglang/srt/entrypoints/http_server.py, sglang/srt/managers/io_struct.py), for testing
wsync.adapters.sglang on a machine where SGLang cannot run (its kernels are CUDA-only). It is not SGLang:
its "model" is a dict of parameter tensors under SGLang's names, and /generate answers tokens
derived from a hash of those parameters and the prompt (so the tests can tell versions apart).

What it reproduces, route by route (request validation included, as SGLang's pydantic/msgspec
schemas do it: a missing JSON body or a wrong literal is HTTP 400, unknown keys are ignored):
  POST /pause_generation     {"mode": "abort"|"retract"|"in_place" = "abort"}
                             -> 200 {"message": "Generation paused successfully.", "status": "ok"}
  POST /continue_generation  {"torch_empty_cache": bool = true}
                             -> 200 {"message": "Generation continued successfully.", "status": "ok"}
  GET|POST /flush_cache      -> 200 text "Cache flushed.\\n..."
  POST /update_weights_from_tensor  {"serialized_named_tensors": [base64, one per TP rank] (required),
                             "load_format": null|"direct"|"flattened_bucket", "flush_cache": bool = true,
                             "abort_all_requests": bool = false, "weight_version": str|null}
                             -> 200 {"success": true, "message": "Success[ Weight version updated to V.]"},
                             400 {"success": false, "message": ...} when the load fails
  POST /generate             {"input_ids": [int], "sampling_params": {...}} -> 200 {"output_ids": [...],
                             "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version",
                             "completion_tokens", ...}}; waits while paused, as SGLang's is_pause does
  GET /model_info            -> 200 {"model_path", ..., "weight_version"}
The payload is unpickled with an allowlist like SGLang's SafeUnpickler (torch, builtins,
collections, copyreg, _codecs); "direct" copies each tensor into the parameter of the same name
(SGLang's _model_load_weights_direct, model_runner.py:3411-3414: params_dict[name], a KeyError for
an unknown name; default_weight_loader, weight_utils.py:1346-1360: the size asserted, param.copy_),
refusing unknown names and other shapes. It also refuses another dtype, where SGLang's copy_ would
cast: stricter, so that wsync must send each tensor in the dtype SGLang holds.
"""

import base64
import binascii
import hashlib
import io
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

_ALLOWED = ("torch", "builtins", "collections", "copyreg", "_codecs", "numpy")


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.split(".")[0] not in _ALLOWED:
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


class _BadRequest(Exception):
    pass


class FakeSglang:
    """params: {SGLang name: torch tensor}: the server's model, as SGLang would hold it for the
    model config (sglang_form.zero_params: SGLang's own names, shapes and dtypes, zero-filled).
    After the updates: held[version] (every parameter after that version's last update) and
    written[version] (the names its updates wrote, in order)."""

    def __init__(self, params, vocab_size, tp_size=1):
        self.params, self.vocab_size, self.tp_size = params, vocab_size, tp_size
        self.weight_version = "default"
        self.paused = False
        self.cond = threading.Condition()
        self.log = []  # (method, path, body or None)
        self.fail_next_update = None  # a message: the next update fails as a load error would
        # What the tests check after each sync: per weight version named by the updates, a copy of
        # every parameter after that version's last successful update, and the names it wrote.
        self.held, self.written = {}, {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, body):
                data = (json.dumps(body) if not isinstance(body, str) else body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                if not raw:
                    raise _BadRequest("Field required: body")
                try:
                    body = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise _BadRequest(f"JSON decode error: {e}") from None
                if not isinstance(body, dict):
                    raise _BadRequest("Input should be a valid dictionary")
                return body

            def _handle(self, method):
                try:
                    body = self._body() if method == "POST" and self.path != "/flush_cache" else None
                    fake.log.append((method, self.path, body))
                    code, reply = fake.route(method, self.path, body)
                except _BadRequest as e:  # SGLang rewrites validation errors to 400
                    code, reply = 400, {"object": "error", "message": str(e), "type": "Bad Request", "param": None,
                                        "code": 400}
                self._reply(code, reply)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    # --- routes ---------------------------------------------------------------------------------
    def route(self, method, path, body):
        if path == "/pause_generation" and method == "POST":
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise _BadRequest(f"mode: Input should be 'abort', 'retract' or 'in_place', not {mode!r}")
            with self.cond:
                self.paused = True
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation" and method == "POST":
            if not isinstance(body.get("torch_empty_cache", True), bool):
                raise _BadRequest("torch_empty_cache: Input should be a valid boolean")
            with self.cond:
                self.paused = False
                self.cond.notify_all()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/flush_cache":
            return 200, ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                         "waiting requests, the operation will not be performed.)\n")
        if path == "/update_weights_from_tensor" and method == "POST":
            return self.update(body)
        if path == "/generate" and method == "POST":
            return self.generate(body)
        if path == "/model_info" and method == "GET":
            return 200, {"model_path": "fake", "tokenizer_path": None, "is_generation": True,
                         "preferred_sampling_params": None, "weight_version": self.weight_version}
        return 404, {"detail": "Not Found"}

    def update(self, body):
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
            raise _BadRequest("serialized_named_tensors: Field required (a list of base64 strings)")
        try:
            blobs = [base64.b64decode(p, validate=True) for p in payloads]
        except (binascii.Error, ValueError):
            raise _BadRequest("serialized_named_tensors: Expected base64-encoded bytes") from None
        load_format = body.get("load_format")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise _BadRequest("weight_version: Input should be a valid string")
        try:
            if len(blobs) < self.tp_size:
                raise IndexError(f"list index out of range (tp rank {len(blobs)})")
            if load_format not in (None, "direct", "flattened_bucket"):
                raise NotImplementedError(f"Unknown load_format={load_format}")
            if self.fail_next_update:
                msg, self.fail_next_update = self.fail_next_update, None
                raise RuntimeError(msg)
            named = _SafeUnpickler(io.BytesIO(blobs[0])).load()
            if load_format != "direct":
                raise NotImplementedError("this server reproduces load_format 'direct' only")
            for name, t in named:
                if name not in self.params:
                    raise KeyError(f"{name} is not a parameter of the model")
                p = self.params[name]
                if p.shape != t.shape or p.dtype != t.dtype:
                    raise RuntimeError(f"{name}: parameter {tuple(p.shape)} {p.dtype}, tensor {tuple(t.shape)} "
                                       f"{t.dtype}")
            for name, t in named:
                self.params[name].copy_(t)
            if version is not None:
                self.held[version] = {n: p.clone() for n, p in self.params.items()}
                self.written.setdefault(version, []).extend(n for n, _ in named)
        except Exception as e:  # noqa: BLE001 (SGLang reports a failed load as success: false)
            return 400, {"success": False, "message": f"Failed to update weights: {e}."}
        msg = "Success"
        if version is not None:
            self.weight_version = version
            msg += f" Weight version updated to {version}."
        return 200, {"success": True, "message": msg}

    def generate(self, body):
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise _BadRequest("input_ids: a list of ints")
        sp = body.get("sampling_params") or {}
        n = int(sp.get("max_new_tokens", 128))
        with self.cond:
            self.cond.wait_for(lambda: not self.paused)
            h = hashlib.sha256()
            for name in sorted(self.params):
                h.update(self.params[name].contiguous().view(torch.uint8).numpy().tobytes())
            h.update(json.dumps(ids).encode())
            seed = h.digest()
            version = self.weight_version
        out = [int.from_bytes(hashlib.sha256(seed + bytes([i])).digest()[:4], "little") % self.vocab_size
               for i in range(n)]
        return 200, {"output_ids": out, "meta_info": {
            "id": hashlib.md5(seed).hexdigest(), "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids), "weight_version": version, "num_retractions": 0, "completion_tokens": n,
            "cached_tokens": 0}}

    def tokens_for(self, params, prompt, n):
        """What /generate answers for `prompt` when the model holds `params`."""
        saved = self.params
        try:
            self.params = params
            return self.generate({"input_ids": list(prompt), "sampling_params": {"max_new_tokens": n}})[1]["output_ids"]
        finally:
            self.params = saved


def serve(params, vocab_size, url_file):
    """Runs a FakeSglang until killed, writing its URL to url_file (for an engine process)."""
    fake = FakeSglang(params, vocab_size)
    with open(url_file, "w") as f:
        f.write(fake.url)
    fake.thread.join()
