#include "trainer_agent/sync/testing/sync_capture.h"

#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/bucket/stream.h"
#include "gtest/gtest.h"

namespace wsync::trainer_agent::testing {
namespace {

bool IsExpertTensor(absl::string_view name) { return absl::StrContains(name, ".mlp.experts."); }

}  // namespace

std::map<std::string, Captured> DecodeStream(const CaptureSink& sink, uint64_t bucket_bytes, uint64_t version,
                                             int stage) {
  std::map<std::string, Captured> out;
  EXPECT_EQ(sink.finishes, 1);
  EXPECT_FALSE(sink.buckets.empty());
  bool seen_expert = false;
  for (size_t i = 0; i < sink.buckets.size(); ++i) {
    const v1::BucketManifest& m = sink.buckets[i].manifest;
    const std::vector<std::byte>& data = sink.buckets[i].data;
    EXPECT_EQ(m.index(), i);
    EXPECT_EQ(m.last(), i + 1 == sink.buckets.size()) << "bucket " << i;
    EXPECT_EQ(m.version(), version);
    EXPECT_EQ(m.pp_stage(), static_cast<uint32_t>(stage));
    absl::Status valid = comm::ValidateManifest(m, data.size());
    EXPECT_TRUE(valid.ok()) << valid;
    if (!valid.ok()) continue;
    if (m.entries_size() > 1) {
      EXPECT_LE(data.size(), bucket_bytes) << "bucket " << i << " holds several tensors beyond the bucket size";
    }
    if (i + 1 < sink.buckets.size()) {
      EXPECT_GT(m.entries_size(), 0) << "bucket " << i << ": only the last bucket may be empty";
    }
    for (const v1::BucketEntry& e : m.entries()) {
      const std::string& name = e.tensor().name();
      if (IsExpertTensor(name)) {
        seen_expert = true;
      } else {
        EXPECT_FALSE(seen_expert) << name << ": a non-expert tensor after an expert tensor (bucket " << i << ")";
      }
      EXPECT_EQ(e.offset() % comm::kEntryAlignment, 0u) << name;
      Captured c;
      c.dtype = *comm::FromProto(e.tensor().dtype());
      for (int64_t d : e.tensor().shape()) c.shape.push_back(d);
      c.bytes.assign(data.begin() + static_cast<long>(e.offset()),
                     data.begin() + static_cast<long>(e.offset() + e.nbytes()));
      EXPECT_TRUE(out.emplace(name, std::move(c)).second) << name << " sent twice by stage " << stage;
    }
  }
  return out;
}

std::string ExpectSentAsExpected(const std::map<std::string, Captured>& got,
                                 const std::vector<model::HfTensor>& expected, int stage) {
  std::string names;
  std::map<std::string, const model::HfTensor*> want;
  for (const model::HfTensor& t : expected) want.emplace(t.name, &t);
  for (const auto& [name, c] : got) {
    absl::StrAppend(&names, name, "\n");
    auto it = want.find(name);
    if (it == want.end()) {
      ADD_FAILURE() << "stage " << stage << " sent " << name << ", which is not a tensor of the model";
      continue;
    }
    const TensorView& w = it->second->view;
    EXPECT_EQ(c.dtype, w.dtype()) << name;
    EXPECT_EQ(c.shape, w.shape()) << name;
    EXPECT_TRUE(c.bytes.size() == w.nbytes() && std::memcmp(c.bytes.data(), w.data(), w.nbytes()) == 0)
        << name << " differs from the checkpoint converted directly";
  }
  return names;
}

}  // namespace wsync::trainer_agent::testing
