// An engine rank's parameter memory (wsync-ref-engine's and libwsync_engine_host.so's): one POSIX
// shared-memory segment per engine rank, holding every parameter of the rank's EngineLayout in its
// engine form (bf16 plain params, Marlin INT4), which the engine registers with its rollout agent
// (engine.proto ParamMemory{shm_name, offset}) and which the agent writes directly while the
// engine is paused.
//
//   ShmSegment     one segment: shm_open(O_CREAT | O_EXCL | O_RDWR, 0600) (then fchmod 0600, so
//                  the umask cannot change the mode), ftruncate, mmap MAP_SHARED; destruction
//                  munmaps and shm_unlinks it. The name is also kept in a process-wide registry
//                  that UnlinkAllShmSegments() (async-signal-safe: unlink(2) of the precomputed
//                  /dev/shm path) removes on a crash or an exit() that skips destructors.
//   ParamArena     a segment laid out for an EngineLayout: every param at a 64-byte aligned offset
//                  in layout order, zero-filled, exposed as EngineWeights (what Commit()
//                  and EngineModel read and write) and as the registration's EngineParam list.
//                  CreateOnDevice lays the same offsets out in one CUDA allocation (a CUDA engine's
//                  parameters) and registers them by IPC handle; its EngineWeights are device
//                  buffers (EngineBuffer::cuda_device), which only the CUDA kernels and copies touch.
//
// Names: "/wsync-engine-<engine id>-r<rank>-<pid>-<random hex>"; the engine id is reduced to
// [A-Za-z0-9._-] (others become '_') and at most 64 characters.
// Ownership: the segment (and its name) belongs to the process that created it; a reader's
// mapping keeps the memory alive after unlink.
// Errors: kInvalidArgument for a bad name or size; kAlreadyExists when the name is taken (O_EXCL);
// other errno values through ErrnoToStatus naming the segment; kResourceExhausted when the
// registry of live segments (16) is full.
// Thread-safety: ShmSegment and ParamArena are immutable after creation (the bytes follow the
// engine's pause protocol); the registry functions may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cuda_ipc.h"
#include "engine_model/engine_layout.h"
#include "engine_model/engine_weights.h"
#include "wsync/v1/engine.pb.h"

namespace wsync::engine_memory {

inline constexpr size_t kParamAlignment = 64;

class ShmSegment {
 public:
  // Creates a new segment of `size` (> 0) bytes, zero-filled, mode 0600. `name` starts with '/'
  // and holds no other '/'.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(const std::string& name, size_t size);
  ~ShmSegment();  // munmap + shm_unlink
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  ShmSegment(std::string name, void* data, size_t size, int slot)
      : name_(std::move(name)), data_(data), size_(size), slot_(slot) {}
  std::string name_;
  void* data_;
  size_t size_;
  int slot_;  // in the crash-cleanup registry
};

// "/wsync-engine-<id>-r<rank>-<pid>-<16 random hex digits>" (see the file comment).
std::string UniqueShmName(absl::string_view engine_id, int tp_rank);

// Unlinks the segments that earlier processes of this engine rank left behind when they were
// killed (SIGKILL runs no cleanup): every /dev/shm entry named for (engine_id, tp_rank) whose pid no
// longer exists (kill(pid, 0) == ESRCH) and that belongs to this uid. A rollout agent that still
// maps one keeps its mapping. Returns the names removed (for the log); errors of the directory
// listing through ErrnoToStatus. The engine calls it before creating its own segment.
absl::StatusOr<std::vector<std::string>> ReclaimStaleShmSegments(absl::string_view engine_id, int tp_rank,
                                                                 const std::string& dir = "/dev/shm");

// Unlinks every live segment of this process. Async-signal-safe; for fatal-signal handlers and
// atexit. The segments' mappings stay valid; their destructors later find them gone (harmless).
void UnlinkAllShmSegments();
// Installs UnlinkAllShmSegments for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT (then re-raises
// with the default action) and at exit(). For the engine's main(); idempotent.
void InstallShmCrashCleanup();

// Where an engine's parameter memory is to live, as its command line or options say it: "shm" (a
// POSIX shared-memory segment; -1) or "cuda:N" (one CUDA allocation on device N; N). Anything
// else: kInvalidArgument ("param-memory X: want shm or cuda:N").
absl::StatusOr<int> ParseParamMemory(absl::string_view text);

class ParamArena {
 public:
  // Lays out every param of `layout` (ParamForm::kEngine) in one new segment named `shm_name`.
  static absl::StatusOr<std::unique_ptr<ParamArena>> Create(const engine_model::EngineLayout& layout,
                                                            const std::string& shm_name);
  // The same layout in one new zero-filled CUDA allocation on `device` (cuda_ipc.h's errors).
  static absl::StatusOr<std::unique_ptr<ParamArena>> CreateOnDevice(const engine_model::EngineLayout& layout,
                                                                    int device);

  bool on_device() const { return device_ != nullptr; }
  // Host arenas only (on_device() false).
  const ShmSegment& segment() const { return *segment_; }
  // Bytes of the segment or allocation, and "shm /name" or "CUDA device N" for logs.
  size_t size() const;
  std::string where() const;
  // Every param, by SGLang name, pointing into the segment (CheckMatches(layout) holds).
  engine_model::EngineWeights& weights() { return weights_; }
  const engine_model::EngineWeights& weights() const { return weights_; }
  // The registration's params: name, dtype, engine shape, nbytes, {shm_name, offset} or
  // {cuda_ipc_handle, cuda_device, offset}.
  void FillParams(google::protobuf::RepeatedPtrField<v1::EngineParam>* out) const;
  // Byte offset of a param in the segment (by index in weights().buffers()).
  uint64_t offset(size_t index) const { return offsets_[index]; }
  // XXH3-64 of the whole segment or allocation (every param and the zeroed gaps between them): a
  // fingerprint of the engine's weights, e.g. to show that a step left them unchanged. Reads the
  // bytes as they are (a device arena through one host copy); the caller keeps writers away.
  absl::StatusOr<uint64_t> Checksum() const;

 private:
  ParamArena() = default;
  static absl::StatusOr<std::unique_ptr<ParamArena>> Lay(const engine_model::EngineLayout& layout,
                                                         const std::string& shm_name, int device);
  std::unique_ptr<ShmSegment> segment_;
  std::unique_ptr<CudaAllocation> device_;
  std::string ipc_handle_;
  engine_model::EngineWeights weights_;
  std::vector<uint64_t> offsets_;
};

}  // namespace wsync::engine_memory
