// The wire protocol between wsync_trainer_client (linked into a training process) and the `shm:`
// weight source of its local trainer agent (trainer_agent/source/shm_source.h).
//
// Transport: a Unix stream socket at SocketPath(RuntimeDir(), NAME, rank), created by the agent
// in a directory of mode 0700; the agent accepts only peers of its own uid (SO_PEERCRED).
// Every message is a frame: a 16-byte header {magic "WSYC", protocol version, type, payload
// length} (little-endian u32s), then the payload. The client sends a request, the agent answers
// with one kReply frame. Payloads are a flat encoding (Writer / Reader below): u8/u32/u64/i64
// little-endian, strings as u32 length + bytes. A malformed frame closes the connection.
//
// This file depends on the C++ standard library only: the client library must load into a Python
// process (ctypes) without dragging absl / protobuf / gRPC symbols along. Status codes are
// absl::StatusCode values (the C header repeats them as WSYNC_*).
//
// Thread-safety: free functions are reentrant; a Reader / Writer belongs to one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace wsync::trainer_client {

inline constexpr uint32_t kMagic = 0x43595357;  // "WSYC" little-endian
inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr uint32_t kMaxPayload = 64u << 20;
inline constexpr size_t kCudaIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

// The first kSegmentHeaderBytes of the shared segment; host tensors follow (64-byte aligned).
// `generation` is odd while the trainer writes (begin_update .. end_update) and grows by 2 per
// update; a sync request carries the generation its version was declared at, and the agent
// reads only weights of that very generation.
inline constexpr uint32_t kSegmentMagic = 0x47455357;  // "WSEG"
inline constexpr uint64_t kSegmentHeaderBytes = 64;
struct SegmentHeader {
  uint32_t magic;
  uint32_t reserved;
  uint64_t generation;  // accessed with __atomic builtins by both processes
};

enum class MsgType : uint32_t { kRegister = 1, kRequestSync = 2, kReply = 100 };

// Where a tensor's bytes live.
enum class Location : uint32_t { kHostShm = 0, kCudaIpc = 1 };

struct TensorDecl {
  std::string name;   // Megatron local name (GPTModel.named_parameters())
  std::string dtype;  // safetensors name: BF16, F16, F32, ...
  std::vector<int64_t> shape;
  Location location = Location::kHostShm;
  uint64_t offset = 0;  // kHostShm: into the segment (64-byte aligned, after the header); kCudaIpc: into the allocation
  uint64_t nbytes = 0;
  std::string cuda_ipc_handle;  // kCudaIpc: kCudaIpcHandleBytes bytes (cudaIpcGetMemHandle)
  int32_t device = -1;          // kCudaIpc: the trainer's CUDA device ordinal
};

struct RegisterRequest {
  std::string source_name;
  int32_t rank = 0;
  uint32_t client_pid = 0;
  std::string config_json;    // the model's HF config.json text
  std::string parallel_json;  // Megatron parallel.json text (trainer_agent/convert/source_parallel.h)
  std::string segment;        // POSIX shm name ("/wsync...."), mode 0600; "" when no host tensor
  uint64_t segment_bytes = 0;
  std::vector<TensorDecl> tensors;
};

struct RequestSyncRequest {
  uint64_t version = 0;     // the version to publish (> the last published); 0: next
  uint64_t generation = 0;  // SegmentHeader::generation of the weights declared as `version`
  bool wait = false;        // reply when the sync has ended (else once it is started)
  int64_t timeout_ms = 0;   // bound on the wait (the agent also applies its own)
};

struct Reply {
  int32_t code = 0;  // absl::StatusCode
  std::string message;
  uint64_t sync_id = 0;  // kRequestSync
  uint64_t version = 0;
  bool coalesced = false;  // joined a sync of the same version that another rank requested
};

std::string Encode(const RegisterRequest& r);
std::string Encode(const RequestSyncRequest& r);
std::string Encode(const Reply& r);
// false (with *error naming the field) for a truncated payload, trailing bytes or bad values.
bool Decode(const std::string& payload, RegisterRequest* r, std::string* error);
bool Decode(const std::string& payload, RequestSyncRequest* r, std::string* error);
bool Decode(const std::string& payload, Reply* r, std::string* error);

// Blocking frame I/O on a connected socket, bounded by `deadline_ms` (CLOCK_MONOTONIC
// milliseconds, see NowMs(); < 0: no bound). Return 0 or an errno value (ETIMEDOUT, EPROTO for
// a bad header, ECONNRESET / EPIPE when the peer went away); *error says what in words.
int SendFrame(int fd, MsgType type, const std::string& payload, int64_t deadline_ms, std::string* error);
int RecvFrame(int fd, MsgType* type, std::string* payload, int64_t deadline_ms, std::string* error);
int64_t NowMs();

// [A-Za-z0-9._-]{1,64}, not starting with '.'.
bool ValidSourceName(const std::string& name);
// $WSYNC_RUNTIME_DIR, else $XDG_RUNTIME_DIR/wsync, else /tmp/wsync-<uid>.
std::string RuntimeDir();
// RUNTIME_DIR/NAME.r{rank:05d}.sock
std::string SocketPath(const std::string& runtime_dir, const std::string& name, int rank);

// Byte size of a tensor of `dtype` (safetensors name) and `shape`; false for an unknown dtype,
// a negative dimension or an overflow.
bool TensorBytes(const std::string& dtype, const std::vector<int64_t>& shape, uint64_t* nbytes);

}  // namespace wsync::trainer_client
