// Delta delivery, the sender's side: a BucketSink between a stage source's BucketBuilder and the
// data plane's sink that replaces each entry of each bucket by the tensor's change since the base
// version (kernels/delta.h, proto EntryDelta), and keeps what it sent as the next sync's base.
// Sharded delivery puts one in front of each receiver group's stream (after plan::ShardedSink's
// cut), with a base of its own: its entries are blocks, and a delta is the block's change.
//
// The base (DeltaBase): a host copy of every tensor this sender sent in its last sync, in engine
// form (converted, quantized: exactly the entry bytes), tagged with that sync's version. Memory:
// the bytes the stage source sends, per stage source rank (the stage's share of the model in
// engine form: 1/PP of it; a host with S stage sources holds S such copies). The copy is updated
// as each bucket passes, so the tensors are compared with what the receivers hold without reading
// anything back from them, and no tensor is quantized twice.
//
// Per entry: when the base holds the version the receivers hold (`base_version`) and the tensor
// (same bytes size, an element of 1, 2, 4 or 8 bytes, at most 2 dims, the dtype and shape every
// receiver layout gives it, a block holding all each receiver keeps; at least one receiver
// layout), the entry carries its delta
// (PlanDelta's smallest encoding; an unchanged tensor costs an 8-byte zero count), with, for every
// receiver layout, the Sum64 of the block that engine rank keeps in the base and in the new version
// (the receiver's checks, engine_model::Loader::LoadDelta); otherwise its full bytes (the receivers
// load them as in a full sync). The manifest names base_version when any entry is a delta.
//
// The base's version becomes the sent version only when Finish succeeds and every Send did; a sync
// that fails midway leaves it at 0 (unknown: the next sync sends everything in full), never half
// updated and named. After a failed Send, every Send and Finish returns that error.
//
// Errors: the inner sink's (as is); kResourceExhausted when a buffer cannot be allocated; the
// kernels' kInvalidArgument for an entry whose bytes disagree with its manifest (a builder bug).
// Thread-safety: one thread (the builder's), as every BucketSink; the DeltaBase outlives the sink
// and is used by one sync at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/bucket/builder.h"
#include "engine_model/engine_layout.h"
#include "trainer_agent/quantize/int4_quantizer.h"

namespace wsync::trainer_agent {

// The base is also the stage source's QuantizedBase (quantize/int4_quantizer.h): with every
// quantized tensor's outputs (INT4, AWQ, FP8) it keeps one XXH3-64 per quantization group (FP8:
// block or row; AWQ: 8 rows' group) of the bf16 inputs they came from (8 bytes per group: 1/16 of
// the inputs' bytes at INT4 G 64), so that the next sync quantizes only the groups whose inputs
// changed. A sync's digests are kept only when its DeltaSink finishes, which
// is when the base holds that sync's outputs.
class DeltaBase final : public QuantizedBase {
 public:
  uint64_t version() const { return version_; }
  uint64_t bytes() const { return bytes_ + digest_bytes_; }  // host memory held

  std::optional<Earlier> FindQuantized(const std::string& name, absl::Span<const std::string> outputs,
                                       const std::string& key) const override;
  std::span<uint64_t> NextDigests(const std::string& name, size_t groups, const std::string& key) override;

 private:
  friend class DeltaSink;
  struct Digests {
    std::string key;
    std::vector<uint64_t> groups;
  };
  // The last finished sync's digests (kept), and this sync's: `earlier_` is what this sync reuses
  // (the kept ones, moved out when its DeltaSink starts), `next_` what it computes.
  std::map<std::string, Digests, std::less<>> digests_, earlier_, next_;
  uint64_t digest_bytes_ = 0;
  std::map<std::string, std::vector<uint8_t>, std::less<>> tensors_;
  // Per tensor, the Sum64 of the block each receiver layout keeps of it (in receiver order), for
  // the layouts named by sums_key_: the next delta's base sums, not computed again.
  std::map<std::string, std::vector<uint64_t>, std::less<>> sums_;
  std::string sums_key_;
  uint64_t version_ = 0;
  uint64_t bytes_ = 0;
};

// What a delta sync sent, for timings and metrics.
struct DeltaStats {
  uint64_t entries = 0, delta_entries = 0;
  uint64_t tensor_bytes = 0;              // the entries' whole-tensor bytes (what a full sync sends)
  uint64_t sent_bytes = 0;                // the entries' bytes as sent (deltas and full entries)
  uint64_t items = 0, changed_items = 0;  // of the delta entries
};

class DeltaSink final : public comm::BucketSink {
 public:
  // `receivers`: one layout per distinct engine-rank layout among the receivers (a sum is sent for
  // each); they and `inner` and `base` outlive the sink. `base_version` 0: a full sync (every
  // entry full, the base still recorded).
  DeltaSink(comm::BucketSink& inner, DeltaBase& base, std::vector<const engine_model::EngineLayout*> receivers,
            uint64_t base_version, uint64_t version);
  // The same, owning `inner` (sharded delivery: one DeltaSink per receiver group's stream).
  DeltaSink(std::unique_ptr<comm::BucketSink> inner, DeltaBase& base,
            std::vector<const engine_model::EngineLayout*> receivers, uint64_t base_version, uint64_t version);

  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override;
  Buffer Recycle(uint64_t min_bytes) override;
  absl::Status Finish() override;
  MemorySpace space() const override { return inner_.space(); }

  const DeltaStats& stats() const { return stats_; }

 private:
  absl::Status SendDelta(v1::BucketManifest manifest, Buffer data, uint64_t nbytes);
  // Writes entry `e`'s bytes (as a delta when it can) at out_[cursor], updating e; records the base.
  absl::Status Rewrite(v1::BucketEntry& e, const uint8_t* bytes, uint8_t* out, uint64_t& cursor);

  std::unique_ptr<comm::BucketSink> owned_;  // inner_, when owned
  comm::BucketSink& inner_;
  DeltaBase& base_;
  const std::vector<const engine_model::EngineLayout*> receivers_;
  const uint64_t base_version_, version_;
  const bool delta_;          // the base holds what the receivers hold
  std::vector<Buffer> free_;  // input buffers done with, for the builder
  std::vector<uint8_t> scratch_;
  absl::Status failed_;  // the first Send error: every later Send and Finish returns it
  DeltaStats stats_;
};

}  // namespace wsync::trainer_agent
