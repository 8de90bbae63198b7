// Commit and Restore into engine buffers in CUDA device memory (EngineBuffer::cuda_device): the
// device path's bytes equal the host path's, byte for byte, for every param of dense and MoE
// models, bf16 and INT4 (G = 128, 32, channelwise; Marlin, AWQ-Marlin and TensorRT-LLM sm80 / sm90
// layouts), engine TP 1 and 2 (EP 2 for MoE); verify on,
// Checksums and DequantizeToDense read device memory, Restore(device) == staging. A device
// staging (Staging in the GPU's memory, loaded from device copies of the sent tensors: the
// loader's copies and transposes on the device, weight_shape values read back) commits the same
// bytes without crossing the link, and restores the same staging. The GPU cases skip themselves
// without a device; the refusal cases run everywhere: a Commit whose device scratch cannot be had
// (no GPU, or no CUDA build) is refused before the first byte is written, and so is a device
// staging.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/cuda_ipc.h"
#include "common/memory_space.h"
#include "common/status.h"
#include "engine_model/repack.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dispatch.h"
#include "model/testing/hf_model.h"
#include "model/testing/test_models.h"

namespace wsync::engine_model {
namespace {

using ::testing::HasSubstr;

// INT4 on every linear SGLang quantizes (the embeddings, lm_head and MoE router stay bf16).
const std::vector<std::string> kIgnore = {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"};
// DeepSeek with q_lora_rank: SGLang's fused q_a / kv_a projection cannot load INT4 either.
const std::vector<std::string> kDeepseekIgnore = {"lm_head",        "re:.*embed_tokens.*",      "re:.*mlp\\.gate$",
                                                  "re:.*q_a_proj$", "re:.*kv_a_proj_with_mqa$", "re:.*kv_b_proj$"};

// Every param of a layout in one device allocation, 256-byte aligned, like an engine's arena.
struct DeviceWeights {
  std::unique_ptr<CudaAllocation> memory;
  EngineWeights weights;
};

absl::StatusOr<DeviceWeights> AllocateOnDevice(const EngineLayout& layout, int device) {
  std::vector<uint64_t> offsets;
  uint64_t size = 0;
  for (const EngineParam& p : layout.params()) {
    ASSIGN_OR_RETURN(const int64_t bytes, NumBytes(p.dtype_in(ParamForm::kEngine), p.engine_shape));
    offsets.push_back(size);
    size += (static_cast<uint64_t>(bytes) + 255) / 256 * 256;
  }
  DeviceWeights d;
  ASSIGN_OR_RETURN(d.memory, AllocateCuda(size, device));
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const EngineParam& p = layout.params()[i];
    const DType dt = p.dtype_in(ParamForm::kEngine);
    EngineBuffer b{p.name,
                   dt,
                   p.engine_shape,
                   static_cast<std::byte*>(d.memory->data()) + offsets[i],
                   static_cast<size_t>(*NumBytes(dt, p.engine_shape)),
                   device};
    RETURN_IF_ERROR(d.weights.Add(std::move(b)));
  }
  return d;
}

struct Case {
  std::string label;
  const char* config;
  int group;  // 0: bf16
  std::vector<std::pair<int, int>> tp_ep;
  uint64_t seed;
  std::vector<std::string> ignore = kIgnore;
  std::string format = "ct";  // "ct", "awq" (ignore: modules_to_not_convert), "trtllm-sm80", "trtllm-sm90"
};

QuantizationConfig QuantFor(const Case& tc) {
  if (tc.format == "awq") return *ParseQuantizationConfig(model::testing::AwqQuantJson(tc.group, tc.ignore), tc.label);
  std::string json = model::testing::QuantJson(tc.group, tc.ignore);
  if (tc.format != "ct") json.insert(1, absl::StrCat(R"("engine_layout": ")", tc.format, R"(", )"));
  return *ParseQuantizationConfig(json, tc.label);
}

std::vector<Case> Cases() {
  return {
      {"qwen3_bf16", model::testing::kQwen3Json, 0, {{1, 1}, {2, 1}}, 9101},
      {"qwen3_int4_g128", model::testing::kQwen3Json, 128, {{1, 1}, {2, 1}}, 9102},
      {"llama_int4_channelwise", model::testing::kLlamaJson, -1, {{2, 1}}, 9103},
      {"qwen3_moe_int4_g32", model::testing::kQwen3MoeJson, 32, {{1, 1}, {2, 2}}, 9104},
      {"deepseek_int4_g128", model::testing::kDeepseekJson, 128, {{2, 2}}, 9105, kDeepseekIgnore},
      // AWQ-Marlin and TensorRT-LLM layouts (docs/engine-formats.md): their CUDA kernels on the device.
      {"qwen3_moe_awq_g32", model::testing::kQwen3MoeJson, 32, {{1, 1}, {2, 2}}, 9106, {}, "awq"},
      {"llama_trtllm_sm80_g64", model::testing::kLlamaJson, 64, {{1, 1}, {2, 1}}, 9107, kIgnore, "trtllm-sm80"},
      {"qwen3_moe_trtllm_sm90_g32", model::testing::kQwen3MoeJson, 32, {{1, 1}, {2, 2}}, 9108, kIgnore, "trtllm-sm90"},
  };
}

// A case's model config, quantization (none for bf16) and random HF checkpoint.
struct CaseModel {
  ModelConfig config;
  std::optional<QuantizationConfig> quant;
  model::testing::HfModel model;
  const QuantizationConfig* q() const { return quant ? &*quant : nullptr; }
};
absl::StatusOr<CaseModel> ModelFor(const Case& tc) {
  CaseModel cm;
  ASSIGN_OR_RETURN(cm.config, ParseModelConfig(tc.config, tc.label));
  if (tc.group != 0) cm.quant = QuantFor(tc);
  ASSIGN_OR_RETURN(cm.model, model::testing::MakeHfModel(cm.config, cm.q(), tc.seed));
  return cm;
}

class RepackDevice : public ::testing::TestWithParam<Case> {};

TEST_P(RepackDevice, CommitOnTheDeviceEqualsTheHostBytes) {
  if (!kernels::GpuAvailable()) GTEST_SKIP() << "no CUDA device";
  const Case& tc = GetParam();
  SCOPED_TRACE(absl::StrCat(tc.label, " seed ", tc.seed));
  auto cm = ModelFor(tc);
  ASSERT_TRUE(cm.ok()) << cm.status();
  const ModelConfig& c = cm->config;
  const std::optional<QuantizationConfig>& q = cm->quant;
  const model::testing::HfModel* m = &cm->model;
  for (const auto& [T, EP] : tc.tp_ep) {
    for (int r = 0; r < T; ++r) {
      SCOPED_TRACE(absl::StrCat("T ", T, " EP ", EP, " rank ", r));
      auto layout = EngineLayout::Create(c, q ? &*q : nullptr, {T, r, EP});
      ASSERT_TRUE(layout.ok()) << layout.status();
      auto staging = Staging::Create(*layout);
      ASSERT_TRUE(staging.ok());
      Loader loader(staging->get());
      for (const std::string& name : m->order) ASSERT_TRUE(loader.Load(name, m->sent.at(name).view()).ok()) << name;
      if (r % 2 == 1) {  // odd ranks upload from page-locked staging, as the rollout agent does
        const absl::Status pin = (*staging)->PinForDevice();
        ASSERT_TRUE(pin.ok()) << pin;
      }
      auto host = OwnedEngineWeights::Allocate(*layout);
      ASSERT_TRUE(host.ok());
      ASSERT_TRUE(Commit(**staging, (*host)->weights()).ok());
      auto dev = AllocateOnDevice(*layout, 0);
      ASSERT_TRUE(dev.ok()) << dev.status();
      ASSERT_EQ(dev->weights.device_buffers(), layout->params().size());
      const absl::Status st = Commit(**staging, dev->weights, {.num_threads = 2, .verify = true});
      ASSERT_TRUE(st.ok()) << st;

      // Every buffer, byte for byte (names the first param that differs).
      for (const EngineBuffer& b : dev->weights.buffers()) {
        std::vector<std::byte> got(b.nbytes);
        ASSERT_TRUE(CopyDeviceToHost(got.data(), b.data, b.nbytes, 0).ok());
        ASSERT_EQ(std::memcmp(got.data(), (*host)->weights().Find(b.name)->data, b.nbytes), 0) << b.name;
      }
      auto want = (*host)->weights().Checksums();
      auto got = dev->weights.Checksums();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, *want);
      for (const EngineLinear& lin : layout->linears()) {
        auto a = DequantizeToDense(*layout, lin.name, (*host)->weights());
        auto b = DequantizeToDense(*layout, lin.name, dev->weights);
        ASSERT_TRUE(a.ok() && b.ok()) << lin.name;
        ASSERT_EQ(std::memcmp(a->view().data(), b->view().data(), a->nbytes()), 0) << lin.name;
      }
      // Restore from device memory gives back what was received.
      auto restored = Staging::Create(*layout);
      ASSERT_TRUE(restored.ok());
      ASSERT_TRUE(Restore(dev->weights, **restored).ok());
      for (size_t i = 0; i < layout->params().size(); ++i) {
        const TensorView a = (*staging)->param(static_cast<int>(i)), b = (*restored)->param(static_cast<int>(i));
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << layout->params()[i].name;
      }
    }
  }
}

// The staging's bytes, on the host (a device staging's copied down).
std::vector<std::byte> StagingBytes(const Staging& st, int i) {
  const TensorView v = st.param(i);
  std::vector<std::byte> out(v.nbytes());
  EXPECT_TRUE(st.space().CopyToHost(out.data(), v.data(), v.nbytes()).ok());
  return out;
}

TEST_P(RepackDevice, ADeviceStagingLoadsAndCommitsOnTheDeviceToTheHostBytes) {
  if (!kernels::GpuAvailable()) GTEST_SKIP() << "no CUDA device";
  const Case& tc = GetParam();
  SCOPED_TRACE(absl::StrCat(tc.label, " seed ", tc.seed));
  auto cm = ModelFor(tc);
  ASSERT_TRUE(cm.ok()) << cm.status();
  const ModelConfig& c = cm->config;
  const std::optional<QuantizationConfig>& q = cm->quant;
  const model::testing::HfModel* m = &cm->model;
  const MemorySpace gpu = MemorySpace::Cuda(0);
  // Every sent tensor in device memory, as an NCCL bucket would hold it; odd sizes at odd offsets.
  absl::flat_hash_map<std::string, Buffer> on_device;
  for (const std::string& name : m->order) {
    const TensorView v = m->sent.at(name).view();
    auto b = gpu.Allocate(std::max<size_t>(v.nbytes(), 1));
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE(gpu.Copy(b->data(), v.data(), v.nbytes()).ok());
    on_device.emplace(name, std::move(*b));
  }
  for (const auto& [T, EP] : tc.tp_ep) {
    for (int r = 0; r < T; ++r) {
      SCOPED_TRACE(absl::StrCat("T ", T, " EP ", EP, " rank ", r));
      auto layout = EngineLayout::Create(c, q ? &*q : nullptr, {T, r, EP});
      ASSERT_TRUE(layout.ok()) << layout.status();
      auto host_staging = Staging::Create(*layout);
      auto dev_staging = Staging::Create(*layout, gpu);
      ASSERT_TRUE(host_staging.ok() && dev_staging.ok()) << dev_staging.status();
      Loader host_loader(host_staging->get()), dev_loader(dev_staging->get());
      for (const std::string& name : m->order) {
        const TensorView v = m->sent.at(name).view();
        ASSERT_TRUE(host_loader.Load(name, v).ok()) << name;
        const TensorView dv(v.dtype(), v.shape(), {on_device.at(name).data(), v.nbytes()});
        const absl::Status st = dev_loader.Load(name, dv);
        ASSERT_TRUE(st.ok()) << name << ": " << st;
      }
      ASSERT_TRUE(dev_loader.CheckComplete().ok());
      ASSERT_TRUE((*dev_staging)->Synchronize().ok());
      for (size_t i = 0; i < layout->params().size(); ++i) {
        const TensorView a = (*host_staging)->param(static_cast<int>(i));
        ASSERT_EQ(std::memcmp(StagingBytes(**dev_staging, static_cast<int>(i)).data(), a.data(), a.nbytes()), 0)
            << "loaded " << layout->params()[i].name;
      }
      for (const EngineLinear& lin : layout->linears()) {
        auto a = DequantizeToDense(lin.name, **host_staging);
        auto b = DequantizeToDense(lin.name, **dev_staging);
        ASSERT_TRUE(a.ok() && b.ok()) << lin.name;
        ASSERT_EQ(std::memcmp(a->view().data(), b->view().data(), a->nbytes()), 0) << lin.name;
      }
      auto host = OwnedEngineWeights::Allocate(*layout);
      ASSERT_TRUE(host.ok());
      ASSERT_TRUE(Commit(**host_staging, (*host)->weights()).ok());
      // A device staging serves device engine memory only: refused before writing.
      const auto untouched = *(*host)->weights().Checksums();
      const absl::Status mixed = Commit(**dev_staging, (*host)->weights());
      EXPECT_EQ(mixed.code(), absl::StatusCode::kInvalidArgument) << mixed;
      EXPECT_THAT(mixed.message(), HasSubstr("a device staging serves"));
      EXPECT_EQ(*(*host)->weights().Checksums(), untouched);

      auto dev = AllocateOnDevice(*layout, 0);
      ASSERT_TRUE(dev.ok()) << dev.status();
      const absl::Status st = Commit(**dev_staging, dev->weights, {.num_threads = 2, .verify = true});
      ASSERT_TRUE(st.ok()) << st;
      for (const EngineBuffer& b : dev->weights.buffers()) {
        std::vector<std::byte> got(b.nbytes);
        ASSERT_TRUE(CopyDeviceToHost(got.data(), b.data, b.nbytes, 0).ok());
        ASSERT_EQ(std::memcmp(got.data(), (*host)->weights().Find(b.name)->data, b.nbytes), 0) << b.name;
      }
      // Restore from device memory into a second device staging gives back what was received.
      auto restored = Staging::Create(*layout, gpu);
      ASSERT_TRUE(restored.ok());
      ASSERT_TRUE(Restore(dev->weights, **restored).ok());
      EXPECT_TRUE((*restored)->CheckComplete().ok());
      for (size_t i = 0; i < layout->params().size(); ++i) {
        const TensorView a = (*host_staging)->param(static_cast<int>(i));
        ASSERT_EQ(std::memcmp(StagingBytes(**restored, static_cast<int>(i)).data(), a.data(), a.nbytes()), 0)
            << "restored " << layout->params()[i].name;
      }
    }
  }
}

// A weight_shape in device memory is read back and checked like one in host memory; a wrong one
// is refused and leaves its piece missing.
TEST(RepackDeviceStaging, AWrongWeightShapeInDeviceMemoryIsRefused) {
  if (!kernels::GpuAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig c = *ParseModelConfig(model::testing::kQwen3Json, "shape");
  const QuantizationConfig q = *ParseQuantizationConfig(model::testing::QuantJson(128, kIgnore), "shape");
  const EngineLayout layout = *EngineLayout::Create(c, &q, {1, 0, 1});
  auto m = *model::testing::MakeHfModel(c, &q, 9109);
  const MemorySpace gpu = MemorySpace::Cuda(0);
  auto staging = *Staging::Create(layout, gpu);
  Loader loader(staging.get());
  const std::string name = "model.layers.0.self_attn.q_proj.weight_shape";
  ASSERT_TRUE(m.sent.contains(name));
  const TensorView v = m.sent.at(name).view();
  std::vector<std::byte> bad(v.bytes().begin(), v.bytes().end());
  bad[0] = std::byte(static_cast<uint8_t>(bad[0]) + 1);
  auto b = *gpu.Allocate(v.nbytes());
  ASSERT_TRUE(gpu.Copy(b.data(), bad.data(), v.nbytes()).ok());
  const absl::Status st = loader.Load(name, TensorView(v.dtype(), v.shape(), {b.data(), v.nbytes()}));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("holds ["));
  ASSERT_TRUE(gpu.Copy(b.data(), v.data(), v.nbytes()).ok());
  EXPECT_TRUE(loader.Load(name, TensorView(v.dtype(), v.shape(), {b.data(), v.nbytes()})).ok());
}

INSTANTIATE_TEST_SUITE_P(Models, RepackDevice, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.label; });

// A device buffer that names device 0 but holds host memory: on a machine without a GPU (or a
// build without CUDA) the device scratch cannot be allocated, so Commit is refused before any
// param is written (the host bytes behind the pretend device buffer are untouched too).
TEST(RepackDeviceRefusal, NoUsableDeviceRefusesBeforeWriting) {
  if (kernels::GpuAvailable()) GTEST_SKIP() << "a CUDA device is present: the refusal needs a machine without one";
  const ModelConfig c = *ParseModelConfig(model::testing::kQwen3Json, "refusal");
  const QuantizationConfig q = *ParseQuantizationConfig(model::testing::QuantJson(128, kIgnore), "refusal");
  const EngineLayout layout = *EngineLayout::Create(c, &q, {1, 0, 1});
  auto staging = *Staging::Create(layout);
  auto m = *model::testing::MakeHfModel(c, &q, 9106);
  Loader loader(staging.get());
  for (const std::string& name : m.order) ASSERT_TRUE(loader.Load(name, m.sent.at(name).view()).ok());
  auto host = *OwnedEngineWeights::Allocate(layout);
  EngineWeights mixed;
  for (const EngineBuffer& b : host->weights().buffers()) {
    EngineBuffer x = b;
    if (&b == &host->weights().buffers().back()) x.cuda_device = 0;
    ASSERT_TRUE(mixed.Add(std::move(x)).ok());
  }
  const auto before = *host->weights().Checksums();
  const absl::Status st = Commit(*staging, mixed);
  EXPECT_TRUE(st.code() == absl::StatusCode::kFailedPrecondition || st.code() == absl::StatusCode::kUnimplemented)
      << st;
  EXPECT_THAT(st.message(), HasSubstr("commit refused: device scratch"));
  EXPECT_EQ(*host->weights().Checksums(), before);
  const absl::Status rs = Restore(mixed, *staging);
  EXPECT_THAT(rs.message(), HasSubstr("restore refused: device scratch"));
  // Pinning the staging needs a device too; a failed pin leaves nothing pinned.
  EXPECT_FALSE(staging->PinForDevice().ok());
  EXPECT_FALSE(staging->pinned());
  // And so does a device staging.
  auto dev_staging = Staging::Create(layout, MemorySpace::Cuda(0));
  EXPECT_TRUE(dev_staging.status().code() == absl::StatusCode::kFailedPrecondition ||
              dev_staging.status().code() == absl::StatusCode::kUnimplemented)
      << dev_staging.status();
  EXPECT_THAT(dev_staging.status().message(), HasSubstr("in cuda:0"));
}

}  // namespace
}  // namespace wsync::engine_model
