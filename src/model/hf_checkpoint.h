// A HuggingFace checkpoint's tensors by name: the *.safetensors files of a model directory
// (mmap'ed, zero copy; sharded checkpoints model-0000i-of-0000n.safetensors included), or
// tensors built in memory (tests, the model generator). Read-only once built.
//
// Errors: Open: kNotFound for a missing directory or one without *.safetensors files, the
// SafetensorsFile errors for a malformed file, kInvalidArgument for a tensor name present in
// two files. Get: kNotFound naming the tensor. Add: kInvalidArgument for a duplicate name.
// Thread-safety: const methods may be called concurrently; Add is not thread-safe.
// Views returned by Get stay valid while the HfCheckpoint (or a move of it) is alive.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/safetensors.h"
#include "common/tensor.h"

namespace wsync::model {

class HfCheckpoint {
 public:
  HfCheckpoint() = default;
  HfCheckpoint(HfCheckpoint&&) noexcept = default;
  HfCheckpoint& operator=(HfCheckpoint&&) noexcept = default;

  // Every *.safetensors file directly in `dir`, in name order.
  static absl::StatusOr<HfCheckpoint> Open(const std::string& dir);

  // Takes ownership of `tensor` under `name`.
  absl::Status Add(std::string name, Tensor tensor);

  absl::StatusOr<TensorView> Get(absl::string_view name) const;
  bool Contains(absl::string_view name) const { return index_.find(name) != index_.end(); }
  // All names, sorted.
  std::vector<std::string> Names() const;
  size_t size() const { return index_.size(); }
  // Total bytes of all tensors.
  uint64_t TotalBytes() const;

 private:
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::vector<std::unique_ptr<Tensor>> owned_;
  std::map<std::string, TensorView, std::less<>> index_;
};

}  // namespace wsync::model
