// The engine's parameter memory as its rollout agent sees it: the POSIX shared-memory segments an
// engine rank registered (RegisterEngineRequest.params[i].memory), mapped read-write into the
// agent, and the EngineWeights (engine_model/engine_weights.h) that address every parameter in them.
//
// MapEngineMemory(params) opens every distinct segment once (shm_open O_RDWR, mmap MAP_SHARED of
// the whole segment) after checking that it is a regular segment owned by this process's effective
// user with mode exactly 0600 (an engine that shares its weights wider is refused: another user
// could read or change them). Every param must lie inside its segment, have nbytes equal to its
// dtype and shape, and the names must be unique. Nothing is written by mapping.
//
// CUDA engines register device parameters by CUDA IPC handle (ParamMemory.cuda_ipc_handle +
// cuda_device + offset into that allocation): the agent opens each distinct handle once
// (common/cuda_ipc.h), checks that every param lies inside its allocation (cudaMemGetAddressRange),
// and the EngineWeights address the device memory itself (EngineBuffer::cuda_device): Commit
// repacks on the device straight into it, with no host copy of the engine's memory.
//
// Ownership: EngineMemory owns the mappings (munmap on destruction) and the file descriptors are
// closed right after mmap. The segments themselves belong to the engine: the agent never unlinks
// them, and a mapping keeps a segment's memory alive after the engine unlinked it.
// Errors: kInvalidArgument (bad name, shape, size, offset, duplicate), kUnimplemented (a CUDA IPC
// handle in a build without CUDA), kFailedPrecondition (a handle that cannot be opened: no GPU),
// kPermissionDenied (mode or owner), kNotFound (no such segment), other errno codes via
// ErrnoToStatus; every message names the param or segment and the values.
// Thread-safety: immutable after MapEngineMemory; the mapped bytes follow the engine's pause
// protocol (the agent writes them only while the engine is paused).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/cuda_ipc.h"
#include "common/tensor.h"
#include "engine_model/engine_weights.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "wsync/v1/engine.pb.h"

namespace wsync::engine_memory {

class EngineMemory {
 public:
  ~EngineMemory();
  EngineMemory(const EngineMemory&) = delete;
  EngineMemory& operator=(const EngineMemory&) = delete;

  const engine_model::EngineWeights& weights() const { return weights_; }
  engine_model::EngineWeights& weights() { return weights_; }
  // Total bytes of all registered params.
  uint64_t param_bytes() const { return param_bytes_; }
  // Names of the mapped segments, in first-use order.
  std::vector<std::string> segments() const;
  // Parameters that live on a CUDA device.
  size_t device_params() const { return weights_.device_buffers(); }

 private:
  friend absl::StatusOr<std::unique_ptr<EngineMemory>> MapEngineMemory(
      const google::protobuf::RepeatedPtrField<v1::EngineParam>& params);
  struct Mapping {
    std::string name;
    void* addr = nullptr;
    size_t size = 0;
  };
  EngineMemory() = default;

  std::vector<Mapping> mappings_;
  std::vector<std::unique_ptr<CudaIpcMapping>> handles_;
  engine_model::EngineWeights weights_;
  uint64_t param_bytes_ = 0;
};

// See the file comment.
absl::StatusOr<std::unique_ptr<EngineMemory>> MapEngineMemory(
    const google::protobuf::RepeatedPtrField<v1::EngineParam>& params);

}  // namespace wsync::engine_memory
