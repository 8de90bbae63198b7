// CLI tests of wsync-int4: run the binary (path in WSYNC_INT4_BIN) on small safetensors files and
// check the outputs against the kernels of kernels/int4.h, the pass-through of other tensors, the
// exact round trips, and that refused conversions name the tensor and leave no file behind.
#include <dirent.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "kernels/awq.h"
#include "kernels/format/int4_format.h"
#include "kernels/int4.h"
#include "kernels/trtllm.h"

namespace wsync {
namespace {

using ::testing::HasSubstr;

std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir() + "/wsync_int4_XXXXXX";
  char* d = mkdtemp(tmpl.data());
  EXPECT_NE(d, nullptr);
  return tmpl;
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  while (d != nullptr) {
    dirent* e = readdir(d);
    if (e == nullptr) break;
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
  }
  if (d != nullptr) closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

struct RunResult {
  int code;
  std::string output;
};

RunResult RunTool(const std::string& args, const std::string& dir) {
  const std::string log = dir + "/run.log";
  const std::string cmd = std::string(WSYNC_INT4_BIN) + " " + args + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  RunResult r{WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, ""};
  if (FILE* f = std::fopen(log.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) r.output.append(buf, n);
    std::fclose(f);
  }
  std::remove(log.c_str());
  return r;
}

Tensor RandomBf16(Shape shape, uint32_t seed, DType dt = DType::kBF16) {
  Tensor t = Tensor::Empty(dt, std::move(shape)).value();
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  auto* p = t.data_as<uint16_t>();
  for (size_t i = 0; i < t.nbytes() / 2; ++i) p[i] = dt == DType::kBF16 ? F32ToBF16(dist(rng)) : F32ToF16(dist(rng));
  return t;
}

bool SameBytes(const TensorView& a, const TensorView& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

class Int4ToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    down_ = RandomBf16({128, 256}, 1);
    gate_ = RandomBf16({64, 256}, 2);
    norm_ = RandomBf16({256}, 3);
    experts_ = RandomBf16({2, 64, 128}, 4);
    SafetensorsWriter w;
    ASSERT_TRUE(w.Add("model.layers.0.mlp.down_proj.weight", down_.view()).ok());
    ASSERT_TRUE(w.Add("model.layers.0.mlp.gate.weight", gate_.view()).ok());
    ASSERT_TRUE(w.Add("model.norm.weight", norm_.view()).ok());
    ASSERT_TRUE(w.Add("model.layers.0.mlp.experts.weight", experts_.view()).ok());
    w.SetMetadata("format", "pt");
    ASSERT_TRUE(w.Write(In()).ok());
  }
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(dir_);  // kept for a look when a test failed
  }
  std::string In() const { return dir_ + "/in.safetensors"; }
  std::string P(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
  Tensor down_, gate_, norm_, experts_;
};

TEST_F(Int4ToolTest, QuantizeCompressedTensors) {
  const RunResult r = RunTool(
      "quantize --in " + In() + " --out " + P("q.safetensors") + " --group-size 64 --ignore 're:.*mlp\\.gate$'", dir_);
  ASSERT_EQ(r.code, 0) << r.output;
  auto f = SafetensorsFile::Open(P("q.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  // Ignored and 1-D tensors pass through byte for byte; the metadata is kept.
  ASSERT_NE(f->Find("model.layers.0.mlp.gate.weight"), nullptr);
  EXPECT_TRUE(SameBytes(f->Find("model.layers.0.mlp.gate.weight")->view, gate_.view()));
  EXPECT_TRUE(SameBytes(f->Find("model.norm.weight")->view, norm_.view()));
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->Find("model.layers.0.mlp.down_proj.weight"), nullptr);
  for (auto [prefix, w] : {std::pair<std::string, const Tensor*>{"model.layers.0.mlp.down_proj", &down_},
                           {"model.layers.0.mlp.experts", &experts_}}) {
    auto shapes = kernels::QuantizedShapesFor(w->view(), 64, kernels::PackFormat::kCompressedTensors);
    ASSERT_TRUE(shapes.ok());
    Tensor packed = Tensor::Empty(DType::kI32, shapes->packed).value();
    Tensor scales = Tensor::Empty(DType::kBF16, shapes->scales).value();
    kernels::QuantizeOptions opt;
    opt.group_size = 64;
    ASSERT_TRUE(kernels::QuantizeInt4(w->view(), packed.mutable_view(), scales.mutable_view(), opt).ok());
    const auto* p = f->Find(prefix + ".weight_packed");
    const auto* s = f->Find(prefix + ".weight_scale");
    const auto* shape = f->Find(prefix + ".weight_shape");
    ASSERT_TRUE(p && s && shape) << prefix;
    EXPECT_TRUE(SameBytes(p->view, packed.view())) << prefix;
    EXPECT_TRUE(SameBytes(s->view, scales.view())) << prefix;
    ASSERT_EQ(shape->view.dtype(), DType::kI64);
    ASSERT_EQ(shape->view.numel(), w->view().rank());
    for (int i = 0; i < w->view().rank(); ++i) EXPECT_EQ(shape->view.data_as<int64_t>()[i], w->view().dim(i));
  }
}

TEST_F(Int4ToolTest, QuantizeGptqThenMarlinRoundTrip) {
  ASSERT_EQ(RunTool("quantize --in " + In() + " --out " + P("g.safetensors") +
                        " --group-size 128 --format gptq --variant slime --ignore model.layers.0.mlp.gate",
                    dir_)
                .code,
            0);
  auto g = SafetensorsFile::Open(P("g.safetensors"));
  ASSERT_TRUE(g.ok()) << g.status();
  const auto* qz = g->Find("model.layers.0.mlp.down_proj.qzeros");
  const auto* gi = g->Find("model.layers.0.mlp.down_proj.g_idx");
  ASSERT_TRUE(qz && gi);
  EXPECT_EQ(qz->view.shape(), (Shape{2, 16}));
  for (int i = 0; i < 32; ++i) EXPECT_EQ(qz->view.data_as<uint32_t>()[i], 0x77777777u);
  EXPECT_EQ(gi->view.shape(), (Shape{256}));
  for (int k = 0; k < 256; ++k) EXPECT_EQ(gi->view.data_as<int32_t>()[k], k / 128);
  EXPECT_EQ(g->Find("model.layers.0.mlp.experts.qweight")->view.shape(), (Shape{2, 16, 64}));

  const RunResult r =
      RunTool("marlin-repack --in " + P("g.safetensors") + " --out " + P("m.safetensors") + " --group-size 128", dir_);
  ASSERT_EQ(r.code, 0) << r.output;
  auto m = SafetensorsFile::Open(P("m.safetensors"));
  ASSERT_TRUE(m.ok()) << m.status();
  const auto* mq = m->Find("model.layers.0.mlp.down_proj.qweight");
  ASSERT_NE(mq, nullptr);
  EXPECT_EQ(mq->view.shape(), (Shape{16, 256}));
  Tensor want = Tensor::Empty(DType::kI32, {16, 256}).value();
  ASSERT_TRUE(
      kernels::GptqToMarlin(g->Find("model.layers.0.mlp.down_proj.qweight")->view, nullptr, want.mutable_view(), {})
          .ok());
  EXPECT_TRUE(SameBytes(mq->view, want.view()));
  EXPECT_EQ(m->Find("model.layers.0.mlp.experts.qweight")->view.shape(), (Shape{2, 8, 128}));
  EXPECT_FALSE(SameBytes(m->Find("model.layers.0.mlp.down_proj.scales")->view,
                         g->Find("model.layers.0.mlp.down_proj.scales")->view));
  EXPECT_EQ(m->metadata().at("wsync.layout"), "marlin");

  ASSERT_EQ(
      RunTool("marlin-restore --in " + P("m.safetensors") + " --out " + P("r.safetensors") + " --group-size 128", dir_)
          .code,
      0);
  auto back = SafetensorsFile::Open(P("r.safetensors"));
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->tensors().size(), g->tensors().size());
  for (const auto& e : g->tensors()) {
    ASSERT_NE(back->Find(e.name), nullptr) << e.name;
    EXPECT_TRUE(SameBytes(back->Find(e.name)->view, e.view)) << e.name;
  }
  // Repacking a Marlin file again is refused.
  const RunResult again =
      RunTool("marlin-repack --in " + P("m.safetensors") + " --out " + P("x.safetensors") + " --group-size 128", dir_);
  EXPECT_EQ(again.code, 1);
  EXPECT_THAT(again.output, HasSubstr("already in Marlin layout"));
}

TEST_F(Int4ToolTest, CompressedTensorsInputRepacksAsTheEnginesDo) {
  ASSERT_EQ(
      RunTool("quantize --in " + In() + " --out " + P("q.safetensors") + " --group-size -1 --ignore '.*gate'", dir_)
          .code,
      0);
  ASSERT_EQ(
      RunTool("marlin-repack --in " + P("q.safetensors") + " --out " + P("m.safetensors") + " --group-size -1", dir_)
          .code,
      0);
  auto q = SafetensorsFile::Open(P("q.safetensors"));
  auto m = SafetensorsFile::Open(P("m.safetensors"));
  ASSERT_TRUE(q.ok() && m.ok());
  // §7: gptq_marlin_repack(weight_packed.t()) and marlin_permute_scales(weight_scale.t()).
  const TensorView ct = q->Find("model.layers.0.mlp.down_proj.weight_packed")->view;  // [128, 32]
  std::vector<int32_t> t(ct.numel());
  for (int n = 0; n < 128; ++n)
    for (int j = 0; j < 32; ++j) t[j * 128 + n] = ct.data_as<int32_t>()[n * 32 + j];
  Tensor want = Tensor::Empty(DType::kI32, {16, 256}).value();
  ASSERT_TRUE(kernels::GptqToMarlin(TensorView(DType::kI32, {32, 128}, std::as_bytes(std::span(t))), nullptr,
                                    want.mutable_view(), {})
                  .ok());
  EXPECT_TRUE(SameBytes(m->Find("model.layers.0.mlp.down_proj.weight_packed")->view, want.view()));
  EXPECT_EQ(m->Find("model.layers.0.mlp.down_proj.weight_scale")->view.shape(), (Shape{1, 128}));
  ASSERT_EQ(
      RunTool("marlin-restore --in " + P("m.safetensors") + " --out " + P("r.safetensors") + " --group-size -1", dir_)
          .code,
      0);
  auto r = SafetensorsFile::Open(P("r.safetensors"));
  ASSERT_TRUE(r.ok());
  for (const auto& e : q->tensors()) EXPECT_TRUE(SameBytes(r->Find(e.name)->view, e.view)) << e.name;
}

TEST_F(Int4ToolTest, ActOrderPermFromGIdx) {
  // A GPTQ layer with a shuffled g_idx (desc_act): perm = stable argsort(g_idx).
  const int64_t k = 256, n = 128, g = 64;
  std::mt19937 rng(9);
  std::vector<uint32_t> qw(k / 8 * n);
  for (auto& x : qw) x = rng();
  std::vector<int32_t> gidx(k);
  for (int64_t i = 0; i < k; ++i) gidx[i] = static_cast<int32_t>(i / g);
  std::shuffle(gidx.begin(), gidx.end(), rng);
  Tensor scales = RandomBf16({k / g, n}, 5);
  SafetensorsWriter w;
  ASSERT_TRUE(w.Add("l.qweight", TensorView(DType::kI32, {k / 8, n}, std::as_bytes(std::span(qw)))).ok());
  ASSERT_TRUE(w.Add("l.g_idx", TensorView(DType::kI32, {k}, std::as_bytes(std::span(gidx)))).ok());
  ASSERT_TRUE(w.Add("l.scales", scales.view()).ok());
  ASSERT_TRUE(w.Write(P("a.safetensors")).ok());
  ASSERT_EQ(RunTool("marlin-repack --in " + P("a.safetensors") + " --out " + P("m.safetensors") +
                        " --group-size 64 --perm-from g_idx",
                    dir_)
                .code,
            0);
  std::vector<int32_t> perm(k);
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](int a, int b) { return gidx[a] < gidx[b]; });
  const TensorView pv(DType::kI32, {k}, std::as_bytes(std::span(perm)));
  Tensor want = Tensor::Empty(DType::kI32, {k / 16, 2 * n}).value();
  ASSERT_TRUE(kernels::GptqToMarlin(TensorView(DType::kI32, {k / 8, n}, std::as_bytes(std::span(qw))), &pv,
                                    want.mutable_view(), {})
                  .ok());
  auto m = SafetensorsFile::Open(P("m.safetensors"));
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(SameBytes(m->Find("l.qweight")->view, want.view()));
  ASSERT_EQ(RunTool("marlin-restore --in " + P("m.safetensors") + " --out " + P("r.safetensors") +
                        " --group-size 64 --perm-from g_idx",
                    dir_)
                .code,
            0);
  auto r = SafetensorsFile::Open(P("r.safetensors"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(std::memcmp(r->Find("l.qweight")->view.data(), qw.data(), qw.size() * 4), 0);
  EXPECT_TRUE(SameBytes(r->Find("l.scales")->view, scales.view()));
  // Missing g_idx tensor.
  const RunResult bad = RunTool("marlin-repack --in " + P("a.safetensors") + " --out " + P("x.safetensors") +
                                    " --group-size 64 --perm-from act_perm",
                                dir_);
  EXPECT_EQ(bad.code, 1);
  EXPECT_THAT(bad.output, HasSubstr("tensor \"l.act_perm\": missing"));
}

// Runs `fn` into a fresh tensor of `dt` and `shape` and returns it.
Tensor Make(DType dt, const Shape& shape, const std::function<absl::Status(MutableTensorView)>& fn) {
  Tensor t = Tensor::Empty(dt, shape).value();
  const absl::Status st = fn(t.mutable_view());
  EXPECT_TRUE(st.ok()) << st;
  return t;
}

TEST_F(Int4ToolTest, QuantizeAwqThenAwqMarlinRepack) {
  for (const char* arith : {"fp16", "fp32"}) {
    SCOPED_TRACE(arith);
    const RunResult r = RunTool("quantize --format awq --arith " + std::string(arith) + " --in " + In() + " --out " +
                                    P("awq.safetensors") + " --group-size 64 --ignore 're:.*mlp\\.gate$'",
                                dir_);
    ASSERT_EQ(r.code, 0) << r.output;
    auto f = SafetensorsFile::Open(P("awq.safetensors"));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->metadata().at("wsync.layout"), "awq");
    EXPECT_TRUE(SameBytes(f->Find("model.layers.0.mlp.gate.weight")->view, gate_.view()));
    EXPECT_TRUE(SameBytes(f->Find("model.norm.weight")->view, norm_.view()));
    kernels::AwqQuantizeOptions opt;
    opt.group_size = 64;
    opt.arith = std::string(arith) == "fp16" ? kernels::AwqArith::kFp16 : kernels::AwqArith::kFp32;
    for (auto [prefix, w] : {std::pair<std::string, const Tensor*>{"model.layers.0.mlp.down_proj", &down_},
                             {"model.layers.0.mlp.experts", &experts_}}) {
      auto shapes = kernels::AwqShapesFor(w->view(), 64);
      ASSERT_TRUE(shapes.ok());
      Tensor qw = Tensor::Empty(DType::kI32, shapes->qweight).value();
      Tensor qz = Tensor::Empty(DType::kI32, shapes->qzeros).value();
      Tensor sc = Tensor::Empty(DType::kBF16, shapes->scales).value();
      ASSERT_TRUE(kernels::QuantizeAwq(w->view(), qw.mutable_view(), qz.mutable_view(), sc.mutable_view(), opt).ok());
      EXPECT_TRUE(SameBytes(f->Find(prefix + ".qweight")->view, qw.view())) << prefix;
      EXPECT_TRUE(SameBytes(f->Find(prefix + ".qzeros")->view, qz.view())) << prefix;
      EXPECT_TRUE(SameBytes(f->Find(prefix + ".scales")->view, sc.view())) << prefix;
    }
  }
  // AWQ -> AWQ-Marlin, every tensor against the kernels.
  RunResult r = RunTool("awq-marlin-repack --in " + P("awq.safetensors") + " --out " + P("am.safetensors"), dir_);
  ASSERT_EQ(r.code, 0) << r.output;
  auto a = SafetensorsFile::Open(P("awq.safetensors"));
  auto m = SafetensorsFile::Open(P("am.safetensors"));
  ASSERT_TRUE(a.ok() && m.ok());
  EXPECT_EQ(m->metadata().at("wsync.layout"), "awq-marlin");
  EXPECT_TRUE(SameBytes(m->Find("model.norm.weight")->view, norm_.view()));
  kernels::KernelOptions ko;
  for (const std::string prefix : {"model.layers.0.mlp.down_proj", "model.layers.0.mlp.experts"}) {
    const TensorView qw = a->Find(prefix + ".qweight")->view, qz = a->Find(prefix + ".qzeros")->view;
    const TensorView sc = a->Find(prefix + ".scales")->view;
    const Tensor mq = Make(DType::kI32, *kernels::AwqMarlinShapeFor(qw.shape()),
                           [&](MutableTensorView o) { return kernels::AwqToMarlin(qw, o, ko); });
    const Tensor mz =
        Make(DType::kI32, qz.shape(), [&](MutableTensorView o) { return kernels::AwqZerosToMarlin(qz, o, ko); });
    const Tensor ms = Make(DType::kBF16, sc.shape(), [&](MutableTensorView o) {
      return kernels::PermuteMarlinScales(sc, qw.dim(qw.rank() - 2), 64, o, ko);
    });
    EXPECT_TRUE(SameBytes(m->Find(prefix + ".qweight")->view, mq.view())) << prefix;
    EXPECT_TRUE(SameBytes(m->Find(prefix + ".qzeros")->view, mz.view())) << prefix;
    EXPECT_TRUE(SameBytes(m->Find(prefix + ".scales")->view, ms.view())) << prefix;
  }
  // Refusals: repacking twice, and the GPTQ repack on an AWQ file.
  r = RunTool("awq-marlin-repack --in " + P("am.safetensors") + " --out " + P("o.safetensors"), dir_);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("\"awq-marlin\": awq-marlin-repack does not take that layout"));
  r = RunTool("marlin-repack --in " + P("awq.safetensors") + " --out " + P("o.safetensors") + " --group-size 64", dir_);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("is AWQ-packed"));
  EXPECT_FALSE(std::filesystem::exists(P("o.safetensors")));
}

TEST_F(Int4ToolTest, TrtllmPreprocessFromCompressedTensorsAndAwq) {
  ASSERT_EQ(RunTool("quantize --in " + In() + " --out " + P("ct.safetensors") + " --group-size 64", dir_).code, 0);
  ASSERT_EQ(
      RunTool("quantize --format awq --in " + In() + " --out " + P("awq.safetensors") + " --group-size 64", dir_).code,
      0);
  auto ct = SafetensorsFile::Open(P("ct.safetensors"));
  auto awq = SafetensorsFile::Open(P("awq.safetensors"));
  ASSERT_TRUE(ct.ok() && awq.ok());
  kernels::KernelOptions ko;
  for (const char* arch : {"sm80", "sm90"}) {
    SCOPED_TRACE(arch);
    kernels::TrtllmOptions topt;
    topt.arch = std::string(arch) == "sm90" ? kernels::TrtllmArch::kSm90 : kernels::TrtllmArch::kSm80;
    for (const char* src : {"ct", "awq"}) {
      SCOPED_TRACE(src);
      const bool is_awq = std::string(src) == "awq";
      const RunResult r = RunTool("trtllm-preprocess --arch " + std::string(arch) + " --in " +
                                      P(std::string(src) + ".safetensors") + " --out " + P("t.safetensors"),
                                  dir_);
      ASSERT_EQ(r.code, 0) << r.output;
      auto t = SafetensorsFile::Open(P("t.safetensors"));
      ASSERT_TRUE(t.ok()) << t.status();
      EXPECT_EQ(t->metadata().at("wsync.layout"), "trtllm");
      EXPECT_TRUE(SameBytes(t->Find("model.norm.weight")->view, norm_.view()));
      EXPECT_EQ(t->Find("model.layers.0.mlp.down_proj.weight_packed"), nullptr);
      EXPECT_EQ(t->Find("model.layers.0.mlp.down_proj.weight_shape"), nullptr);
      EXPECT_EQ(t->Find("model.layers.0.mlp.down_proj.qweight"), nullptr);
      const SafetensorsFile& in = is_awq ? *awq : *ct;
      for (const std::string prefix :
           {"model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts"}) {
        // The codes [.., K/8, N] and scales [.., K/G, N] the kernels take, built independently here.
        Tensor codes, scales;
        if (is_awq) {
          const TensorView qw = in.Find(prefix + ".qweight")->view;
          Shape cs = qw.shape();
          cs[cs.size() - 2] /= 8;
          cs.back() *= 8;
          codes = Make(DType::kI32, cs, [&](MutableTensorView o) { return kernels::AwqToGptq(qw, o, ko); });
          scales = Tensor::CopyOf(in.Find(prefix + ".scales")->view).value();
        } else {
          const TensorView wp = in.Find(prefix + ".weight_packed")->view, ws = in.Find(prefix + ".weight_scale")->view;
          Shape cs = wp.shape(), ss = ws.shape();
          std::swap(cs[cs.size() - 1], cs[cs.size() - 2]);
          std::swap(ss[ss.size() - 1], ss[ss.size() - 2]);
          codes = Tensor::Empty(DType::kI32, cs).value();
          scales = Tensor::Empty(DType::kBF16, ss).value();
          const int64_t e = wp.rank() == 3 ? wp.dim(0) : 1;
          for (int64_t x = 0; x < e; ++x) {
            const int64_t n = wp.dim(wp.rank() - 2), kw = wp.dim(wp.rank() - 1), g = ws.dim(ws.rank() - 1);
            for (int64_t i = 0; i < n; ++i) {
              for (int64_t j = 0; j < kw; ++j)
                codes.data_as<uint32_t>()[(x * kw + j) * n + i] = wp.data_as<uint32_t>()[(x * n + i) * kw + j];
              for (int64_t j = 0; j < g; ++j)
                scales.data_as<uint16_t>()[(x * g + j) * n + i] = ws.data_as<uint16_t>()[(x * n + i) * g + j];
            }
          }
        }
        const Tensor w = Make(DType::kI8, *kernels::TrtllmWeightShapeFor(codes.view().shape(), topt),
                              [&](MutableTensorView o) { return kernels::PreprocessTrtllm(codes.view(), o, topt); });
        EXPECT_TRUE(SameBytes(t->Find(prefix + ".weight")->view, w.view())) << prefix;
        EXPECT_TRUE(SameBytes(t->Find(prefix + ".weight_scale")->view, scales.view())) << prefix;  // W4A16: as is
        const SafetensorsEntry* zero = t->Find(prefix + ".weight_zero");
        ASSERT_EQ(zero != nullptr, is_awq) << prefix;
        if (is_awq) {
          const TensorView qz = in.Find(prefix + ".qzeros")->view;
          const Tensor z = Make(DType::kBF16, scales.view().shape(), [&](MutableTensorView o) {
            return kernels::TrtllmZerosFromAwq(qz, scales.view(), o, topt);
          });
          EXPECT_TRUE(SameBytes(zero->view, z.view())) << prefix;
        }
      }
    }
  }
  // W4AFP8 refuses a dense layer (naming it), and AWQ zeros; MoE-only compressed-tensors works.
  RunResult r = RunTool(
      "trtllm-preprocess --arch sm90 --w4afp8 --in " + P("ct.safetensors") + " --out " + P("o.safetensors"), dir_);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("tensor \"model.layers.0.mlp.down_proj.weight\""));
  EXPECT_THAT(r.output, HasSubstr("MoE expert stacks [E, K, N] only"));
  ASSERT_EQ(RunTool("quantize --in " + In() + " --out " + P("moe.safetensors") +
                        " --group-size 64 --ignore 're:.*(down_proj|gate)$'",
                    dir_)
                .code,
            0);
  r = RunTool("trtllm-preprocess --arch sm90 --w4afp8 --in " + P("moe.safetensors") + " --out " + P("f8.safetensors"),
              dir_);
  ASSERT_EQ(r.code, 0) << r.output;
  auto f8 = SafetensorsFile::Open(P("f8.safetensors"));
  ASSERT_TRUE(f8.ok());
  EXPECT_THAT(f8->Find("model.layers.0.mlp.experts.weight")->view.shape(),
              ::testing::ElementsAre(2, 64, 64));  // [E, N, K/2]
  EXPECT_EQ(f8->Find("model.layers.0.mlp.experts.weight_scale")->view.dtype(), DType::kBF16);
  EXPECT_THAT(f8->Find("model.layers.0.mlp.experts.weight_scale")->view.shape(),
              ::testing::ElementsAre(2, 1, 128));  // I = 2
  r = RunTool("trtllm-preprocess --arch sm70 --in " + P("ct.safetensors") + " --out " + P("o.safetensors"), dir_);
  EXPECT_EQ(r.code, 2);
  r = RunTool("trtllm-preprocess --arch sm80 --in " + P("f8.safetensors") + " --out " + P("o.safetensors"), dir_);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("\"trtllm\": trtllm-preprocess does not take that layout"));
  EXPECT_FALSE(std::filesystem::exists(P("o.safetensors")));
}

TEST_F(Int4ToolTest, ErrorsNameTensorAndValuesAndLeaveNoFile) {
  const auto before = ListDir(dir_);
  // K % G: K = 256 is fine for 64, so use a layer with K = 96.
  {
    Tensor w96 = RandomBf16({64, 96}, 6);
    SafetensorsWriter w;
    ASSERT_TRUE(w.Add("bad.weight", w96.view()).ok());
    ASSERT_TRUE(w.Write(P("k96.safetensors")).ok());
    const RunResult r =
        RunTool("quantize --in " + P("k96.safetensors") + " --out " + P("o.safetensors") + " --group-size 64", dir_);
    EXPECT_EQ(r.code, 1);
    EXPECT_THAT(r.output, HasSubstr("tensor \"bad.weight\""));
    EXPECT_THAT(r.output, HasSubstr("K = 96 is not a multiple of the group size 64"));
  }
  {  // N % 64 in repack, from a GPTQ file with N = 96.
    Tensor w = RandomBf16({96, 128}, 7);
    SafetensorsWriter sw;
    ASSERT_TRUE(sw.Add("n96.weight", w.view()).ok());
    ASSERT_TRUE(sw.Write(P("n96.safetensors")).ok());
    ASSERT_EQ(RunTool("quantize --in " + P("n96.safetensors") + " --out " + P("n96q.safetensors") +
                          " --group-size 128 --format gptq",
                      dir_)
                  .code,
              0);
    const RunResult r = RunTool(
        "marlin-repack --in " + P("n96q.safetensors") + " --out " + P("o.safetensors") + " --group-size 128", dir_);
    EXPECT_EQ(r.code, 1);
    EXPECT_THAT(r.output, HasSubstr("tensor \"n96.qweight\""));
    EXPECT_THAT(r.output, HasSubstr("N = 96 is not a multiple of 64"));
  }
  {  // K % 16 in repack: GPTQ qweight with K/8 = 3.
    std::vector<uint32_t> qw(3 * 64);
    Tensor s = RandomBf16({1, 64}, 8);
    SafetensorsWriter sw;
    ASSERT_TRUE(sw.Add("k24.qweight", TensorView(DType::kI32, {3, 64}, std::as_bytes(std::span(qw)))).ok());
    ASSERT_TRUE(sw.Add("k24.scales", s.view()).ok());
    ASSERT_TRUE(sw.Write(P("k24.safetensors")).ok());
    const RunResult r = RunTool(
        "marlin-repack --in " + P("k24.safetensors") + " --out " + P("o.safetensors") + " --group-size -1", dir_);
    EXPECT_EQ(r.code, 1);
    EXPECT_THAT(r.output, HasSubstr("K = 24 is not a multiple of 16"));
  }
  {  // Missing scales.
    std::vector<uint32_t> qw(2 * 64);
    SafetensorsWriter sw;
    ASSERT_TRUE(sw.Add("lonely.qweight", TensorView(DType::kI32, {2, 64}, std::as_bytes(std::span(qw)))).ok());
    ASSERT_TRUE(sw.Write(P("lonely.safetensors")).ok());
    const RunResult r = RunTool(
        "marlin-repack --in " + P("lonely.safetensors") + " --out " + P("o.safetensors") + " --group-size 128", dir_);
    EXPECT_EQ(r.code, 1);
    EXPECT_THAT(r.output, HasSubstr("tensor \"lonely.qweight\": missing scales \"lonely.scales\""));
  }
  {  // Unsupported dtype and group size.
    Tensor f32 = Tensor::Zeros(DType::kF32, {64, 128}).value();
    SafetensorsWriter sw;
    ASSERT_TRUE(sw.Add("f.weight", f32.view()).ok());
    ASSERT_TRUE(sw.Write(P("f32.safetensors")).ok());
    RunResult r =
        RunTool("quantize --in " + P("f32.safetensors") + " --out " + P("o.safetensors") + " --group-size 128", dir_);
    EXPECT_EQ(r.code, 1);
    EXPECT_THAT(r.output, HasSubstr("tensor \"f.weight\""));
    EXPECT_THAT(r.output, HasSubstr("W dtype F32 unsupported"));
    r = RunTool("quantize --in " + In() + " --out " + P("o.safetensors") + " --group-size 48", dir_);
    EXPECT_EQ(r.code, 1);
    EXPECT_THAT(r.output, HasSubstr("--group-size 48 unsupported"));
    r = RunTool("quantize --in " + In() + " --out " + P("o.safetensors") + " --group-size 64 --variant fast", dir_);
    EXPECT_EQ(r.code, 2);
  }
  // No output (and no temporary) file was left behind by any refused run.
  auto after = ListDir(dir_);
  for (const auto& name : after) {
    EXPECT_EQ(name.find("o.safetensors"), std::string::npos) << name;
    EXPECT_EQ(name.find("tmp"), std::string::npos) << name;
  }
  // Only the 6 files written on purpose above: k96, n96, n96q (quantized), k24, lonely, f32.
  EXPECT_EQ(after.size(), before.size() + 6);
}

}  // namespace
}  // namespace wsync
