/* wsync_engine_host: puts an engine that wsync does not build (vLLM, transformers, one's own) on a
 * rollout agent. Python's `wsync._engine_host` loads it with ctypes; any C program can link it.
 *
 * One host is one engine rank (TP 1: an engine that shards over devices does so itself). The host:
 *   - lays the rank's parameters out in one POSIX shared-memory segment, in the SGLang engine form
 *     the rollout agents write (docs/spec/ENGINE_LAYOUT.md: fused qkv_proj / gate_up_proj,
 *     stacked experts w13 / w2, vocab padded to a multiple of 64, INT4 in Marlin layout), and lists
 *     them with their addresses (wsync_engine_param) so the engine can read them in place;
 *   - serves the RolloutEngine gRPC service (proto/wsync/v1/engine.proto: Pause, Flush, Continue,
 *     Health, WeightVersion, Generate) with the reference engine's state machine (engine_side/core.h):
 *     requests are admitted one version at a time; the agent writes the memory only while the
 *     engine is paused with no request in flight, then calls Continue(version), which calls the
 *     engine's `prepare` callback before anything is admitted again;
 *   - registers with its rollout agent and registers again whenever that agent restarts.
 *
 * The engine brackets the requests it computes itself with wsync_engine_begin_request /
 * wsync_engine_end_request (they wait while a sync holds the engine, and name the version the
 * request is computed with); gRPC Generate calls the `generate` callback inside such a bracket.
 *
 * Typical use:
 *   wsync_engine_options o = {...};            // config, agent, listen address, callbacks
 *   wsync_engine* e;
 *   wsync_engine_create(&o, &e);               // the segment, zero-filled; nothing served yet
 *   for (i < wsync_engine_param_count(e)) wsync_engine_param(e, i, &p);   // map them in
 *   wsync_engine_start(e);                     // serve + register; NO_WEIGHTS until the first sync
 *   ... wsync_engine_begin_request(e, 60000, &v); compute on version v; wsync_engine_end_request(e);
 *   wsync_engine_destroy(e);                   // stops serving, unlinks the segment
 *
 * Errors: every int function returns WSYNC_OK (0) or an absl::StatusCode value (the WSYNC_* codes
 * of wsync_trainer_client.h); wsync_engine_last_error() describes the calling thread's last failure.
 * A failed call changes nothing. Callbacks return 0, or non-zero after writing a message into
 * `err` (err_len bytes, NUL-terminated): prepare's failure makes the engine UNHEALTHY until a
 * later Continue prepares, as with the reference engine.
 * Threads: callbacks run on gRPC threads (prepare never concurrently with a request of this
 * host's admission); every function may be called from any thread.
 */
#ifndef WSYNC_ENGINE_HOST_H_
#define WSYNC_ENGINE_HOST_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WSYNC_ENGINE_HOST_ABI_VERSION 2

#if defined(__GNUC__)
#define WSYNC_ENGINE_API __attribute__((visibility("default")))
#else
#define WSYNC_ENGINE_API
#endif

typedef struct wsync_engine wsync_engine;

/* Re-read the parameter memory: it now holds `version`. */
typedef int (*wsync_engine_prepare_fn)(void* ctx, uint64_t version, char* err, size_t err_len);
/* Greedy decoding: write at most `max_new` tokens to `out`, their count to *out_len. */
typedef int (*wsync_engine_generate_fn)(void* ctx, const int32_t* prompt, size_t prompt_len, uint32_t max_new,
                                        int32_t* out, size_t* out_len, char* err, size_t err_len);

/* For an engine that also serves requests of its own (an HTTP server: SGLang): the agent paused the
 * host (mode 1 HOLD: let running requests finish, hold new ones; 2 ABORT: fail them). Errors are
 * logged. */
typedef int (*wsync_engine_pause_fn)(void* ctx, int mode, char* err, size_t err_len);
/* ... and the host serves `version` again (after prepare, or on the same version after an aborted
 * sync): resume the engine's own serving. An error fails the agent's Continue. */
typedef int (*wsync_engine_continue_fn)(void* ctx, uint64_t version, char* err, size_t err_len);

typedef struct {
  const char* engine_id;                /* e.g. "vllm-0"; [A-Za-z0-9._-]{1,64} */
  const char* config_json;              /* the HF config.json text the engine serves */
  const char* quant_json;               /* a compressed-tensors quantization_config object; NULL or "" = bf16 */
  const char* listen;                   /* RolloutEngine address, "HOST:PORT" (port 0 picks one); NULL = 127.0.0.1:0 */
  const char* agent;                    /* the rollout agent's address, or NULL with agent_file */
  const char* agent_file;               /* re-read before every registration (the agent's --address-file) */
  const char* token_file;               /* bearer token for both directions; NULL = $WSYNC_TOKEN, else none */
  wsync_engine_prepare_fn prepare;      /* required */
  wsync_engine_generate_fn generate;    /* NULL: gRPC Generate answers UNIMPLEMENTED */
  void* ctx;                            /* passed to the callbacks */
  double hold_timeout_s;                /* longest a request waits for a sync's HOLD; 0 = 600 */
  const char* checkpoint;               /* an HF checkpoint directory loaded at create (bf16 weights of an INT4
                                           engine quantized as the trainer agents do), prepared and served as
                                           version 0 at start; NULL: NO_WEIGHTS until the first sync */
  wsync_engine_pause_fn on_pause;       /* NULL: nothing to pause besides the host's own admission */
  wsync_engine_continue_fn on_continue; /* NULL: nothing to resume */
  const char* param_memory;             /* NULL or "shm": the POSIX shared-memory segment; "cuda:N": one CUDA
                                           allocation on device N, registered with the agent by IPC handle
                                           (the agent repacks into it on the device); the params' `data` are
                                           then device pointers */
} wsync_engine_options;

typedef struct {
  const char* name;  /* SGLang name, e.g. "model.layers.0.self_attn.qkv_proj.weight" */
  const char* dtype; /* safetensors name: "BF16", "F32", "I32" */
  int ndim;
  int64_t shape[4]; /* the engine form (Marlin for INT4) */
  uint64_t nbytes;
  void* data; /* in the segment, or on `device`; valid until wsync_engine_destroy */
  int kind;   /* 0 plain, 1 INT4 packed (Marlin), 2 INT4 scales (permuted), 3 AWQ zero points (Marlin) */
  int device; /* -1: host memory (the segment); else the CUDA device `data` is on */
} wsync_engine_param_info;

typedef struct {
  const char* name; /* the bf16 weight's name ("...qkv_proj.weight", "...experts.w13_weight") */
  int quantized;    /* 1: held as name + "_packed" / name + "_scale" */
  int64_t experts;  /* 0 dense [n, k]; else stacked [experts, n, k] */
  int64_t n, k;
} wsync_engine_linear_info;

/* One tensor of the HF checkpoint and where this engine rank keeps it (EngineLayout's HfSource):
 * the whole tensor (TP 1), viewed as a matrix ([n] as [n, 1]), is the block at (dst_row0, dst_col0)
 * of `param`'s loaded form (of its local expert `expert` when stacked), rows x cols, or cols x rows
 * stored transposed when `transpose`. action 0: copy (as above); 1: an INT4 `weight_shape`, whose
 * values are shape_values; 2: known and not held (a tied lm_head.weight). */
typedef struct {
  const char* hf_name;
  const char* dtype;
  int ndim;
  int64_t shape[4];
  int action;
  const char* param; /* "" unless action 0 */
  int64_t expert;
  int transpose;
  int64_t dst_row0, dst_col0, rows, cols;
  int64_t shape_values[2];
} wsync_engine_source_info;

WSYNC_ENGINE_API const char* wsync_engine_last_error(void);
WSYNC_ENGINE_API int wsync_engine_abi_version(void);

/* Validates the options and the model (EngineLayout: INVALID_ARGUMENT / UNIMPLEMENTED naming the
 * config values wsync cannot serve), creates the zero-filled segment (and loads the checkpoint into
 * it: NOT_FOUND / INVALID_ARGUMENT naming a missing or mis-shaped tensor). Serves nothing yet. */
WSYNC_ENGINE_API int wsync_engine_create(const wsync_engine_options* options, wsync_engine** out);
WSYNC_ENGINE_API size_t wsync_engine_param_count(const wsync_engine* e);
WSYNC_ENGINE_API int wsync_engine_param(const wsync_engine* e, size_t index, wsync_engine_param_info* out);
WSYNC_ENGINE_API size_t wsync_engine_linear_count(const wsync_engine* e);
WSYNC_ENGINE_API int wsync_engine_linear(const wsync_engine* e, size_t index, wsync_engine_linear_info* out);
WSYNC_ENGINE_API size_t wsync_engine_source_count(const wsync_engine* e);
WSYNC_ENGINE_API int wsync_engine_source(const wsync_engine* e, size_t index, wsync_engine_source_info* out);
/* The param in its loaded form (what SGLang's / vLLM's weight loaders take: plain params as they
 * are; INT4 restored from Marlin: compressed-tensors [N, K/8] int32 + [N, K/G] scales for a dense
 * linear, GPTQ orientation [E, K/8, N] + [E, K/G, N] for stacked experts), written to `out` (exactly
 * its bytes); *shape gets its loaded shape (4 entries) when not NULL. From `prepare` or a request. */
WSYNC_ENGINE_API int wsync_engine_loaded(const wsync_engine* e, const char* param_name, void* out, uint64_t out_bytes,
                                         int64_t* shape);
/* The linear's weight as bf16 in HF orientation (INT4: bf16((nibble - 8) * scale), FORMATS.md §2),
 * [n, k] or [experts, n, k] (w13: gate rows first), written to `out` (exactly that many bytes). Call
 * it from `prepare` or inside a request. NOT_FOUND for an unknown name, INVALID_ARGUMENT for a size. */
WSYNC_ENGINE_API int wsync_engine_dense_bf16(const wsync_engine* e, const char* linear_name, void* out,
                                             uint64_t out_bytes);

/* Another process's read-only way in (a vLLM worker process beside the host's): the host's
 * attach info (a JSON string: its config, quantization and segment; valid until destroy), and
 * wsync_engine_attach, which maps that segment in this process (same user only: the segment is
 * mode 0600) and gives a view on which the param / linear / source / loaded / dense_bf16 calls
 * work as on the host; the serving calls answer FAILED_PRECONDITION. Destroy the view with
 * wsync_engine_destroy. INVALID_ARGUMENT for info that is not a host's, NOT_FOUND for a segment
 * that is gone. */
WSYNC_ENGINE_API const char* wsync_engine_attach_info(wsync_engine* e);
WSYNC_ENGINE_API int wsync_engine_attach(const char* attach_info, wsync_engine** out);

/* With a checkpoint, prepares it as version 0 (the prepare callback's error); then serves
 * RolloutEngine on options->listen and starts registering with the agent (FAILED_PRECONDITION when
 * already started, UNAVAILABLE when the address cannot be bound). */
WSYNC_ENGINE_API int wsync_engine_start(wsync_engine* e);
/* "HOST:PORT" served (after start), else "". */
WSYNC_ENGINE_API const char* wsync_engine_address(const wsync_engine* e);

/* Admits one request (see the file comment), waiting up to timeout_ms while the engine is held;
 * *version = the version to compute with. FAILED_PRECONDITION: no weights yet; UNAVAILABLE: paused
 * with ABORT, unhealthy, shutting down; DEADLINE_EXCEEDED: held for timeout_ms. */
WSYNC_ENGINE_API int wsync_engine_begin_request(wsync_engine* e, int64_t timeout_ms, uint64_t* version);
WSYNC_ENGINE_API void wsync_engine_end_request(wsync_engine* e);
/* Inside a request: UNAVAILABLE once the engine was paused with ABORT (stop computing), else OK. */
WSYNC_ENGINE_API int wsync_engine_request_stopped(const wsync_engine* e);

/* Asks the rollout agent for a version >= min_version (0: the newest the coordinator published):
 * the agent copies it from a peer that holds it, or waits for the next sync, and commits it into
 * this engine (Pause, Flush, write, Continue: the prepare callback runs meanwhile). Returns with
 * *version once the engine serves it; DEADLINE_EXCEEDED after timeout_ms (the message says whether
 * a peer was being copied from or the next sync awaited). Never call it inside a request of this
 * host (the commit would wait for that request to end). For asynchronous RL: call it between
 * batches to move to the newest policy without a trainer sync. */
WSYNC_ENGINE_API int wsync_engine_update_weights(wsync_engine* e, uint64_t min_version, int64_t timeout_ms,
                                                 uint64_t* version);

/* state: 1 SERVING, 2 PAUSED, 3 NO_WEIGHTS, 4 UNHEALTHY (engine.proto HealthReply.State). */
WSYNC_ENGINE_API int wsync_engine_health(const wsync_engine* e, int* state, uint64_t* version);

/* Stops serving (held requests fail), unregisters nothing (the agent notices), unlinks the segment.
 * NULL is a no-op. */
WSYNC_ENGINE_API void wsync_engine_destroy(wsync_engine* e);

#ifdef __cplusplus
}
#endif

#endif /* WSYNC_ENGINE_HOST_H_ */
