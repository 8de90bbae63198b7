#include "common/safetensors.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace wsync {
namespace {

std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir() + "/wsync_st_XXXXXX";
  char* d = mkdtemp(tmpl.data());
  EXPECT_NE(d, nullptr);
  return tmpl;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string LE64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file image: 8-byte length (the header's, unless overridden), header, data.
std::string Image(const std::string& header, size_t data_bytes, int64_t len_override = -1) {
  const uint64_t len = len_override >= 0 ? static_cast<uint64_t>(len_override) : header.size();
  return LE64(len) + header + std::string(data_bytes, '\x5a');
}

std::span<const std::byte> Span(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = MakeTempDir(); }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }
  std::string dir_;
};

TEST_F(SafetensorsTest, RoundTripEveryDTypeAndRank) {
  std::mt19937 rng(1234);  // seed recorded
  struct Case {
    std::string name;
    DType dtype;
    Shape shape;
  };
  std::vector<Case> cases;
  for (DType t : kAllDTypes) {
    const std::string n(SafetensorsName(t));
    cases.push_back({n + ".scalar", t, {}});
    cases.push_back({n + ".vec", t, {7}});
    cases.push_back({n + ".cube", t, {3, 5, 2}});
    cases.push_back({n + ".empty", t, {4, 0}});
  }
  std::vector<Tensor> owned;
  SafetensorsWriter w;
  for (const auto& c : cases) {
    auto t = Tensor::Empty(c.dtype, c.shape);
    ASSERT_TRUE(t.ok());
    auto* p = t->data_as<uint8_t>();
    for (size_t i = 0; i < t->nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
    ASSERT_TRUE(w.Add(c.name, t->view()).ok());
    owned.push_back(std::move(*t));
  }
  w.SetMetadata("format", "pt");
  w.SetMetadata("wsync.version", "7");
  const std::string path = dir_ + "/all.safetensors";
  ASSERT_TRUE(w.Write(path).ok());

  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tensors().size(), cases.size());
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("wsync.version"), "7");
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto* e = f->Find(cases[i].name);
    ASSERT_NE(e, nullptr) << cases[i].name;
    EXPECT_EQ(e->view.dtype(), cases[i].dtype);
    EXPECT_EQ(e->view.shape(), cases[i].shape);
    ASSERT_EQ(e->view.nbytes(), owned[i].nbytes());
    if (e->view.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(e->view.data(), owned[i].view().data(), e->view.nbytes()), 0);
      EXPECT_TRUE(e->view.IsAligned(ItemSize(cases[i].dtype))) << cases[i].name;  // zero-copy typed access
    }
  }
  EXPECT_EQ(f->Find("nope"), nullptr);
  // Data-offset order.
  const std::byte* prev = nullptr;
  for (const auto& e : f->tensors()) {
    if (e.view.nbytes() == 0) continue;
    if (prev) {
      EXPECT_GT(e.view.bytes().data(), prev);
    }
    prev = e.view.bytes().data();
  }
}

TEST_F(SafetensorsTest, ReadsUpstreamStyleFileAndViewsOutliveReplacement) {
  // Written the way huggingface/safetensors does it: header padded with spaces to 8 bytes.
  std::string header = R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string img = LE64(header.size()) + header;
  const float vals[2] = {1.5f, -2.0f};
  img.append(reinterpret_cast<const char*>(vals), 8);
  const std::string path = dir_ + "/up.safetensors";
  WriteBytes(path, img);
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const auto* b = f->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->view.data_as<float>()[1], -2.0f);
  // Replace the file on disk (as a trainer writing the next step would): the mapping stays valid.
  SafetensorsWriter w;
  float other[1] = {3.0f};
  ASSERT_TRUE(w.Add("c", TensorView(DType::kF32, {1}, std::as_bytes(std::span(other)))).ok());
  ASSERT_TRUE(w.Write(path).ok());
  EXPECT_EQ(b->view.data_as<float>()[0], 1.5f);
  auto g = SafetensorsFile::Open(path);
  ASSERT_TRUE(g.ok());
  EXPECT_NE(g->Find("c"), nullptr);
}

TEST_F(SafetensorsTest, WriterRefusesBadInputAndLeavesNothingBehind) {
  SafetensorsWriter w;
  int32_t v[2] = {1, 2};
  auto bytes = std::as_bytes(std::span(v));
  EXPECT_TRUE(w.Add("x", TensorView(DType::kI32, {2}, bytes)).ok());
  EXPECT_EQ(w.Add("x", TensorView(DType::kI32, {2}, bytes)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Add("", TensorView(DType::kI32, {2}, bytes)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Add("__metadata__", TensorView(DType::kI32, {2}, bytes)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Add("y", TensorView(DType::kI32, {3}, bytes)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.size(), 1u);
  // A directory that does not exist: error, no file.
  auto s = w.Write(dir_ + "/missing/dir/out.safetensors");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  // An existing target is replaced only on success; no temporary files remain.
  const std::string path = dir_ + "/out.safetensors";
  ASSERT_TRUE(w.Write(path).ok());
  SafetensorsWriter bad_utf8;
  ASSERT_TRUE(bad_utf8.Add("\xff\xfe", TensorView(DType::kI32, {2}, bytes)).ok());
  EXPECT_EQ(bad_utf8.Write(path).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(SafetensorsFile::Open(path).ok());
  int entries = 0;
  for (auto* d = opendir(dir_.c_str()); d;) {
    auto* e = readdir(d);
    if (!e) {
      closedir(d);
      break;
    }
    if (e->d_name[0] != '.' || std::string(e->d_name).find(".tmp.") != std::string::npos) ++entries;
  }
  EXPECT_EQ(entries, 1);  // out.safetensors only
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  auto f = SafetensorsFile::Open(dir_ + "/absent.safetensors");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("absent.safetensors"), std::string_view::npos);
  EXPECT_EQ(SafetensorsFile::Open(dir_).status().code(), absl::StatusCode::kInvalidArgument);  // a directory
}

struct Malformed {
  const char* label;
  std::string image;
  const char* must_mention;  // tensor name or detail that the message must contain
};

std::vector<Malformed> MalformedCorpus() {
  const std::string ok_entry = R"("w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]})";
  std::string big_len = LE64(uint64_t{1} << 62) + "{}";
  std::string utf8 = std::string("{\"w\xc3\x28\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}");
  return {
      {"empty file", "", "shorter than"},
      {"truncated length", std::string("\x10\x00\x00", 3), "shorter than"},
      {"length past EOF", Image("{" + ok_entry + "}", 8, 4096), "past the end"},
      {"huge length", big_len, "past the end"},
      {"zero length", Image("", 8), "too short"},
      {"truncated header", Image(R"({"w":{"dtype":"BF16","sha)", 8), "well-formed"},
      {"bad json", Image(R"({"w":{"dtype":"BF16",,}})", 8), "well-formed"},
      {"trailing garbage", Image("{" + ok_entry + "} xx", 8), "well-formed"},
      {"not an object", Image("[1,2]", 0), "'{'"},
      {"invalid utf-8", Image(utf8, 1), "well-formed"},
      {"unknown dtype", Image(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8), "F64"},
      {"dtype not string", Image(R"({"w":{"dtype":3,"shape":[1],"data_offsets":[0,8]}})", 8), "\"w\""},
      {"negative shape", Image(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", 0), "negative"},
      {"float shape", Image(R"({"w":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", 2), "integer"},
      {"shape not array", Image(R"({"w":{"dtype":"U8","shape":2,"data_offsets":[0,2]}})", 2), "shape"},
      {"shape overflow", Image(R"({"w":{"dtype":"I64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "overflow"},
      {"offsets past data", Image(R"({"w":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})", 8), "past the data"},
      {"truncated data", Image("{" + ok_entry + "}", 5), "past the data"},
      {"offsets reversed", Image(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", 8), "end before"},
      {"offsets negative", Image(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[-2,0]}})", 8), "data_offsets"},
      {"offsets wrong arity", Image(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2,4]}})", 8), "[begin, end]"},
      {"size mismatch", Image(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", 8), "needs 6 bytes"},
      {"overlap",
       Image(
           R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
           8),
       "overlap"},
      {"contained overlap",
       Image(
           R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[1],"data_offsets":[3,4]},"c":{"dtype":"U8","shape":[1],"data_offsets":[7,8]}})",
           8),
       "overlap"},
      {"duplicate names", Image("{" + ok_entry + "," + ok_entry + "}", 8), "duplicate key \"w\""},
      {"duplicate field", Image(R"({"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1),
       "duplicate"},
      {"missing field", Image(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", 1), "needs"},
      {"unexpected field", Image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", 1),
       "unexpected field"},
      {"entry not object", Image(R"({"w":[1]})", 0), "not an object"},
      {"empty name", Image(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1), "empty name"},
      {"metadata not object", Image(R"({"__metadata__":[1]})", 0), "__metadata__"},
      {"metadata value not string", Image(R"({"__metadata__":{"k":1}})", 0), "\"k\""},
  };
}

TEST_F(SafetensorsTest, MalformedCorpusIsRejectedWithClearErrors) {
  const auto corpus = MalformedCorpus();
  ASSERT_GE(corpus.size(), 15u);
  for (size_t i = 0; i < corpus.size(); ++i) {
    const auto& m = corpus[i];
    const std::string path = dir_ + "/bad" + std::to_string(i) + ".safetensors";
    WriteBytes(path, m.image);
    auto f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << m.label;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << m.label << ": " << f.status();
    EXPECT_NE(f.status().message().find(path), std::string_view::npos) << m.label << ": " << f.status();
    EXPECT_NE(f.status().message().find(m.must_mention), std::string_view::npos) << m.label << ": " << f.status();
    // The in-memory parser gives the same verdict on the same bytes.
    EXPECT_FALSE(ParseSafetensors(Span(m.image), "mem").ok()) << m.label;
  }
}

TEST_F(SafetensorsTest, ZeroSizedTensorsMayShareOffsets) {
  const std::string img = Image(
      R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[2,2]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"c":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]}})",
      4);
  auto layout = ParseSafetensors(Span(img), "mem");
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->records.size(), 3u);
  EXPECT_EQ(layout->records[0].name, "b");
}

}  // namespace
}  // namespace wsync
