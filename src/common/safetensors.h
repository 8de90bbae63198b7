// safetensors files: a validating, zero-copy reader (mmap) and an atomic writer.
//
// Format (huggingface/safetensors): 8 bytes little-endian u64 N, then N bytes of UTF-8 JSON
// (padded with spaces), then the data section. The JSON object maps tensor names to
// {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]} (offsets relative to the data
// section) plus an optional "__metadata__" object of string -> string.
//
// The reader trusts nothing: header length within the file (and <= 100 MB, as upstream), JSON
// well-formed, no duplicate keys, known dtype, integer non-negative shapes, offsets inside the data
// section, tensors non-overlapping, and numel(shape) * itemsize == end - begin. Every violation
// is kInvalidArgument naming the file and the tensor; nothing is read outside the file.
// Unreadable files are kNotFound / kPermissionDenied (from errno).
//
// The writer lays tensors out contiguously with no gaps (as upstream, so that upstream readers
// accept our files), largest item size first so every tensor starts aligned to its item size,
// and replaces the target atomically: it writes a temporary file in the same directory and renames
// it; on any failure nothing is left behind and an existing target is untouched.
//
// Thread-safety: a SafetensorsFile is immutable after Open and may be read from any thread.
// Views returned by it stay valid while the SafetensorsFile (or a move of it) is alive. Replacing
// the file on disk (rename over it) does not affect an open mapping, so a source can be re-opened
// for the next sync while the previous mapping is still in use.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tensor.h"

namespace wsync {

inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// One tensor entry of a validated header, offsets relative to the data section.
struct SafetensorsRecord {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// A validated header: records sorted by (begin, name), and the metadata.
struct SafetensorsLayout {
  uint64_t header_bytes = 0;  // N
  uint64_t data_offset = 0;   // 8 + N: where the data section starts in the file
  std::vector<SafetensorsRecord> records;
  std::map<std::string, std::string> metadata;
};

// Validates the whole file image `file` (header length, JSON, every entry against the data
// section that follows). `file_name` only appears in error messages. Never reads outside `file`.
absl::StatusOr<SafetensorsLayout> ParseSafetensors(std::span<const std::byte> file, absl::string_view file_name);

struct SafetensorsEntry {
  std::string name;
  TensorView view;  // points into the mapping
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates it (see above).
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;

  const std::string& path() const { return path_; }
  // Every tensor, in data-offset order.
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  // nullptr if absent.
  const SafetensorsEntry* Find(absl::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Size of the whole file in bytes.
  size_t file_size() const;

 private:
  struct Mapping;
  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

class SafetensorsWriter {
 public:
  // Adds a tensor. The view's memory must stay alive until Write returns. InvalidArgument for an
  // empty or duplicate name, the reserved name "__metadata__", or a view whose byte size does not
  // match its dtype and shape.
  absl::Status Add(std::string name, TensorView view);
  void SetMetadata(std::string key, std::string value);
  size_t size() const { return entries_.size(); }

  // Writes the file atomically (temporary file in the same directory + rename). Errors from the
  // file system come back as Status (kNotFound, kPermissionDenied, kResourceExhausted, ...).
  absl::Status Write(const std::string& path) const;

 private:
  std::vector<SafetensorsEntry> entries_;
  std::set<std::string, std::less<>> names_;  // duplicate check in O(log n): recordings hold 100k+ tensors
  std::map<std::string, std::string> metadata_;
};

}  // namespace wsync
