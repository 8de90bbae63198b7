// The generated protobuf/gRPC code builds, links and round-trips a bucket manifest.
#include <gtest/gtest.h>

#include "wsync/v1/store.grpc.pb.h"
#include "wsync/v1/tensor.pb.h"

namespace {

TEST(WireTest, BucketManifestRoundTrips) {
  wsync::v1::BucketManifest m;
  m.set_version(3);
  m.set_index(1);
  m.set_nbytes(1024);
  m.set_xxh3_64(0x1234567890abcdefull);
  auto* e = m.add_entries();
  e->mutable_tensor()->set_name("model.layers.0.mlp.experts.3.down_proj.weight_packed");
  e->mutable_tensor()->set_dtype(wsync::v1::DTYPE_I32);
  e->mutable_tensor()->add_shape(512);
  e->mutable_tensor()->add_shape(32);
  e->set_nbytes(512 * 32 * 4);
  e->set_total_nbytes(512 * 32 * 4);
  m.add_targets(0);
  const std::string wire = m.SerializeAsString();
  wsync::v1::BucketManifest back;
  ASSERT_TRUE(back.ParseFromString(wire));
  EXPECT_EQ(back.entries(0).tensor().name(), e->tensor().name());
  EXPECT_EQ(back.entries(0).tensor().shape(1), 32);
  EXPECT_EQ(back.xxh3_64(), 0x1234567890abcdefull);
  EXPECT_FALSE(back.ParseFromString(std::string("\xff\xff\xff", 3)));  // garbage is refused
  // The service descriptor is generated with its four methods.
  EXPECT_EQ(wsync::v1::Store::service_full_name(), std::string("wsync.v1.Store"));
}

}  // namespace
