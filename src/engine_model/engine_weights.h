// The engine side of a weight sync: the parameter memory an engine rank registered with its
// rollout agent (a POSIX shared-memory segment on CPU hosts; filled by the registration RPC
// later), addressed by SGLang parameter name. Commit() writes the final engine form into it and
// Restore() reads it back (repack.h).
//
// EngineBuffer is a plain description (name, dtype, shape, pointer, size, memory space); the
// memory belongs to the engine and must outlive the EngineWeights that points at it. A buffer with
// cuda_device >= 0 is device memory (an engine's CUDA parameter, mapped by IPC): View() then gives
// a view of device memory, for the CUDA kernels only (Commit and Restore run those params on the
// device, Checksums copies them to the host); nothing may read its bytes on the host. OwnedEngineWeights allocates
// host buffers for every parameter of an EngineLayout in its engine form (tests, the reference
// engine's private memory).
//
// Errors: Add() returns kInvalidArgument for a duplicate name, a size that disagrees with dtype and
// shape, or a null pointer; CheckMatches() returns kInvalidArgument naming every mismatch against
// a layout (missing / extra / wrong dtype or shape / misaligned / overlapping buffers).
// Thread-safety: Add must not run concurrently with anything else; the const methods may be
// called from any thread. Writes to the pointed-to memory follow the engine's pause protocol.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tensor.h"
#include "engine_model/engine_layout.h"

namespace wsync::engine_model {

struct EngineBuffer {
  std::string name;  // SGLang parameter name
  DType dtype = DType::kBF16;
  Shape shape;
  void* data = nullptr;
  size_t nbytes = 0;
  int cuda_device = -1;  // -1: host memory; else the CUDA device that holds `data`
  bool on_device() const { return cuda_device >= 0; }
};

class EngineWeights {
 public:
  EngineWeights() = default;
  EngineWeights(EngineWeights&&) = default;
  EngineWeights& operator=(EngineWeights&&) = default;

  absl::Status Add(EngineBuffer buffer);
  const EngineBuffer* Find(absl::string_view name) const;
  // A view of a registered buffer; kNotFound naming it.
  absl::StatusOr<MutableTensorView> View(absl::string_view name) const;
  const std::vector<EngineBuffer>& buffers() const { return buffers_; }
  size_t size() const { return buffers_.size(); }

  // OK when the buffers are exactly the layout's params in ParamForm::kEngine: same names (no
  // missing, no extra), dtypes and shapes, aligned to the element size (4 for int32 / fp32), and
  // pairwise disjoint.
  absl::Status CheckMatches(const EngineLayout& layout) const;

  // The XXH3-64 of every buffer's bytes, in buffers() order, hashed on up to `threads` threads
  // (0: the hardware's concurrency); device buffers are copied to the host first, one at a time.
  // What `wsyncctl verify` compares across engines and oracles. Fails only on a device copy.
  absl::StatusOr<std::vector<uint64_t>> Checksums(int threads = 0) const;
  // Buffers in device memory.
  size_t device_buffers() const;

 private:
  std::vector<EngineBuffer> buffers_;
  absl::flat_hash_map<std::string, size_t> index_;
};

// Host memory for every param of a layout in its engine form, zero-initialized, 64-byte aligned.
class OwnedEngineWeights {
 public:
  static absl::StatusOr<std::unique_ptr<OwnedEngineWeights>> Allocate(const EngineLayout& layout);
  EngineWeights& weights() { return weights_; }
  const EngineWeights& weights() const { return weights_; }

 private:
  OwnedEngineWeights() = default;
  std::vector<Buffer> memory_;
  EngineWeights weights_;
};

}  // namespace wsync::engine_model
