/* wsync_trainer_client: a training process shares its parameters with its local wsync trainer
 * agent (the agent runs with `--source shm:NAME`, one per Megatron rank, beside the trainer).
 *
 * A plain C API (libwsync_trainer_client.so / .a) that depends on libc only, so that Python can
 * load it with ctypes next to PyTorch. Typical use on Megatron rank R:
 *
 *   wsync_client* c;
 *   wsync_client_open("job42", R, 60000, &c);                        // the agent's socket
 *   for each local parameter (GPTModel.named_parameters(), local names and shapes):
 *     wsync_client_add_tensor(c, "decoder.layers.0.self_attn.linear_qkv.weight", "BF16", shape, 2);
 *   wsync_client_register(c, config_json, parallel_json, 60000);     // the agent validates
 *   void* w = wsync_client_tensor(c, "decoder.layers.0.self_attn.linear_qkv.weight", &nbytes);
 *   loop over training steps:
 *     wsync_client_begin_update(c, 60000);   // waits while a sync is reading the weights
 *     ... write the new weights into the tensors (in place) ...
 *     wsync_client_end_update(c);
 *     wsync_client_request_sync(c, step, 1, 600000, &info);          // every rank may ask
 *   wsync_client_close(c);
 *
 * Memory: wsync_client_register creates ONE POSIX shared-memory segment (mode 0600) holding every
 * host tensor (64-byte aligned), maps it read-write in this process, and the agent maps it
 * read-only; the segment's name is unlinked as soon as the agent has opened it, so nothing is
 * left in /dev/shm if either side dies. The tensors start zeroed. Pointers returned by
 * wsync_client_tensor stay valid until wsync_client_close.
 * On GPU hosts a tensor may instead stay in device memory: wsync_client_add_cuda_tensor takes a
 * CUDA IPC handle (cudaIpcGetMemHandle of the allocation) and an offset into it; the agent opens
 * the handle and reads the tensor from the device at each sync.
 *
 * Consistency: the agent reads the weights only while holding a shared lock on the segment;
 * wsync_client_begin_update takes the exclusive lock (waiting for a running sync to finish
 * reading), wsync_client_end_update releases it. Locks are flock(2) locks: they vanish with the
 * process. Do not write the tensors outside begin/end.
 *
 * Syncs: wsync_client_request_sync(version) declares that this rank's weights, as last written
 * (begin/end update), are `version`, and asks the coordinator (through the agent) to publish it
 * (> the last published one; 0 = the next number). Every rank requests the same version after
 * its update: the requests coalesce into one sync (info->coalesced tells the later ones), and the
 * sync reads each rank only once that rank has declared the version, so no rank is read half
 * way through its step. A rank whose weights change after the declaration fails the sync (it is
 * never published torn). With `wait` the call returns when the sync has ended, WSYNC_OK only if
 * it succeeded; syncs of an shm: source must be requested this way (a sync triggered elsewhere,
 * e.g. wsyncctl, fails unless every rank declared its version).
 *
 * Errors: every function returns WSYNC_OK (0) or an error code below (absl::StatusCode values);
 * wsync_last_error() then describes the calling thread's last failure in words. A failed call
 * changes nothing. Thread-safety: calls on one client are serialized internally; the tensor
 * memory is the caller's to synchronize (begin/end update).
 */
#ifndef WSYNC_TRAINER_CLIENT_H_
#define WSYNC_TRAINER_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WSYNC_CLIENT_ABI_VERSION 1

#if defined(__GNUC__)
#define WSYNC_CLIENT_API __attribute__((visibility("default")))
#else
#define WSYNC_CLIENT_API
#endif

enum {
  WSYNC_OK = 0,
  WSYNC_CANCELLED = 1,
  WSYNC_UNKNOWN = 2,
  WSYNC_INVALID_ARGUMENT = 3,
  WSYNC_DEADLINE_EXCEEDED = 4,
  WSYNC_NOT_FOUND = 5,
  WSYNC_ALREADY_EXISTS = 6,
  WSYNC_PERMISSION_DENIED = 7,
  WSYNC_RESOURCE_EXHAUSTED = 8,
  WSYNC_FAILED_PRECONDITION = 9,
  WSYNC_ABORTED = 10,
  WSYNC_OUT_OF_RANGE = 11,
  WSYNC_UNIMPLEMENTED = 12,
  WSYNC_INTERNAL = 13,
  WSYNC_UNAVAILABLE = 14,
  WSYNC_DATA_LOSS = 15
};

typedef struct wsync_client wsync_client;

typedef struct {
  uint64_t sync_id;
  uint64_t version; /* the version the sync publishes */
  int coalesced;    /* 1: another rank had already requested this version */
} wsync_sync_info;

/* The calling thread's last error message ("" if none). Valid until its next wsync_* call. */
WSYNC_CLIENT_API const char* wsync_last_error(void);
WSYNC_CLIENT_API int wsync_client_abi_version(void);

/* Connects to the agent serving `source_name` for Megatron global rank `global_rank`, retrying
 * until `timeout_ms` (the agent may start later). UNAVAILABLE when nothing answers in time;
 * INVALID_ARGUMENT for a bad name ([A-Za-z0-9._-]{1,64}) or rank. */
WSYNC_CLIENT_API int wsync_client_open(const char* source_name, int global_rank, int64_t timeout_ms,
                                       wsync_client** out);

/* Declares a host tensor (before register). dtype: safetensors name ("BF16", "F32", ...).
 * INVALID_ARGUMENT for a bad dtype / shape, ALREADY_EXISTS for a repeated name,
 * FAILED_PRECONDITION after register. */
WSYNC_CLIENT_API int wsync_client_add_tensor(wsync_client* c, const char* name, const char* dtype, const int64_t* shape,
                                             int ndim);

/* Declares a device tensor: `handle` is a cudaIpcMemHandle_t (handle_bytes == 64) of an
 * allocation on CUDA device `device`, the tensor at byte `offset` in it. The agent needs a CUDA
 * build and a visible GPU (else registration fails with UNIMPLEMENTED / FAILED_PRECONDITION). */
WSYNC_CLIENT_API int wsync_client_add_cuda_tensor(wsync_client* c, const char* name, const char* dtype,
                                                  const int64_t* shape, int ndim, const void* handle,
                                                  size_t handle_bytes, int device, uint64_t offset);

/* Creates the shared segment, registers every declared tensor with the agent and waits for its
 * verdict: the agent checks the config / parallel layout against its own and every tensor
 * against the rank's Megatron parameter plan (missing, unknown, mis-shaped parameters are named).
 * On failure nothing stays allocated and the declarations are kept (fix and retry). */
WSYNC_CLIENT_API int wsync_client_register(wsync_client* c, const char* config_json, const char* parallel_json,
                                           int64_t timeout_ms);

/* The host tensor's memory (NULL for an unknown name, a device tensor, or before register). */
WSYNC_CLIENT_API void* wsync_client_tensor(wsync_client* c, const char* name, uint64_t* nbytes);

/* The update lock (see the file comment). begin: DEADLINE_EXCEEDED when a sync kept reading
 * for timeout_ms; FAILED_PRECONDITION before register or when already held. */
WSYNC_CLIENT_API int wsync_client_begin_update(wsync_client* c, int64_t timeout_ms);
WSYNC_CLIENT_API int wsync_client_end_update(wsync_client* c);

/* Declares the weights as `version` and asks for its sync (see the file comment). `info` may be
 * NULL. FAILED_PRECONDITION while this client holds the update lock. */
WSYNC_CLIENT_API int wsync_client_request_sync(wsync_client* c, uint64_t version, int wait, int64_t timeout_ms,
                                               wsync_sync_info* info);

/* Disconnects (the agent stops syncing this rank until a new client registers), unmaps and
 * frees. NULL is a no-op. */
WSYNC_CLIENT_API void wsync_client_close(wsync_client* c);

#ifdef __cplusplus
}
#endif

#endif /* WSYNC_TRAINER_CLIENT_H_ */
