// Test helpers for RunRankSync's tests (the in-process sync/rank_sync_test.cc and the mpirun
// tests/integration/trainer_sync_mpi_test.cc): a BucketSink that keeps every bucket, the decoding
// of a stage's stream with its structural checks, and the bit-for-bit comparison of what a stage
// sent with ExpectedSentTensors (quantize/quant_select.h), the oracle both tests use.
//
// The checks are gtest expectations (EXPECT_*), reported in the calling test.
// Thread-safety: a CaptureSink is used by one BucketBuilder (one thread); the functions are pure
// apart from their expectations.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "comm/bucket/builder.h"
#include "comm/testing/capture_sink.h"
#include "common/tensor.h"
#include "model/hf_tensor.h"

namespace wsync::trainer_agent::testing {

// The compressed-tensors INT4 config both sync tests use: experts, MLPs, o_proj and the MLA
// projections quantized; q/k/v, routers and lm_head kept in bf16. Group size 32 divides every K of
// the test models.
inline constexpr char kInt4Json[] = R"json({
  "quant_method": "compressed-tensors", "format": "pack-quantized",
  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
    "strategy": "group", "group_size": 32, "symmetric": true, "actorder": null, "dynamic": false}}},
  "ignore": ["lm_head", "re:.*self_attn\\.(q|k|v)_proj$", "re:.*mlp\\.gate$"]})json";

// Keeps every bucket (manifest + a copy of its bytes) and counts Finish calls.
using comm::testing::CaptureSink;

// One tensor of a decoded stream.
struct Captured {
  DType dtype;
  Shape shape;
  std::vector<std::byte> bytes;
};

// Decodes stage `stage`'s stream, expecting one Finish, buckets indexed 0.., only the last one
// `last` (and possibly empty), valid manifests of `version` and `stage`, several tensors in a
// bucket only within bucket_bytes, 64-byte aligned entries, no non-expert tensor after an expert
// tensor, and no tensor twice. Returns the tensors by name.
std::map<std::string, Captured> DecodeStream(const CaptureSink& sink, uint64_t bucket_bytes, uint64_t version,
                                             int stage);

// Expects every tensor of `got` to be a tensor of `expected` (ExpectedSentTensors) with the same
// dtype, shape and bytes. Returns the names of `got`, one per line.
std::string ExpectSentAsExpected(const std::map<std::string, Captured>& got,
                                 const std::vector<model::HfTensor>& expected, int stage);

}  // namespace wsync::trainer_agent::testing
