#include "engine_model/repack.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"
#include "common/parallel_for.h"
#include "common/status.h"
#include "engine_model/block_copy.h"
#include "kernels/awq.h"
#include "kernels/format/awq_format.h"
#include "kernels/format/fp8_format.h"
#include "kernels/int4.h"
#include "kernels/transpose.h"
#include "kernels/trtllm.h"

namespace wsync::engine_model {
namespace {

using internal::Transpose;

constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;

kernels::KernelOptions KernelOpts(const RepackOptions& o) {
  kernels::KernelOptions k;
  k.num_threads = o.num_threads;
  return k;
}

TensorView Const(const MutableTensorView& v) { return v; }

MutableTensorView Reshaped(const MutableTensorView& v, Shape s) {
  return MutableTensorView(v.dtype(), std::move(s), v.bytes());
}
TensorView Reshaped(const TensorView& v, Shape s) { return TensorView(v.dtype(), std::move(s), v.bytes()); }

// The Marlin scale permutation with the perm chosen by the layout (§4; FORMATS §5). The
// permutation acts on runs of 64 (grouped) or 32 (single) consecutive elements of each row and
// N % 64 == 0, so it is a function of the flattened array: the kernel is called on a reshaped view
// whose (size_k, group_size) select the wanted perm, which also covers SGLang's w13 quirk
// (size_k = 4I' while the tensor holds H/G rows).
absl::Status PermuteScalesAs(const TensorView& in, const MutableTensorView& out, bool grouped, bool inverse,
                             const kernels::KernelOptions& ko) {
  const int64_t numel = in.numel();
  if (numel % 64 != 0 || numel <= 0 || out.numel() != numel)
    return absl::InternalError(
        absl::StrCat("scale permutation of ", in.DebugString(), " -> ", TensorView(out).DebugString()));
  auto run = [&](const TensorView& i, const MutableTensorView& o, int64_t size_k, int g) {
    return inverse ? kernels::UnpermuteMarlinScales(i, size_k, g, o, ko)
                   : kernels::PermuteMarlinScales(i, size_k, g, o, ko);
  };
  if (!grouped) return run(Reshaped(in, {1, numel}), Reshaped(out, {1, numel}), 1, kernels::kChannelwise);
  // [rows, 64] with group size 1 and size_k = rows selects the grouped perm when rows >= 2. A single
  // grouped run of 64 scales cannot occur: it needs E_loc = 1, H = G and 2I' = 64, which the layout
  // refuses (I' % G, H % 64).
  const int64_t rows = numel / 64;
  if (rows < 2) return absl::InternalError(absl::StrCat("grouped scale permutation of ", numel, " scales"));
  return run(Reshaped(in, {rows, 64}), Reshaped(out, {rows, 64}), rows, 1);
}

void ParallelCopy(const std::byte* src, std::byte* dst, size_t n, int threads) {
  ParallelFor(static_cast<int64_t>(n), threads, kMinBytesPerThread,
              [&](int64_t b, int64_t e) { std::memcpy(dst + b, src + b, static_cast<size_t>(e - b)); });
}

// A dense compressed-tensors INT4 param, whose loaded form is transposed to reach GPTQ orientation.
// AWQ params are K-major already: their loaded form is the kernels' input as is.
bool IsDenseInt4(const EngineParam& p) {
  return p.kind != ParamKind::kPlain && !p.marlin.awq && !p.marlin.trtllm && p.marlin.experts == 0;
}

kernels::TrtllmOptions TrtllmOpts(const EngineParam& p, const kernels::KernelOptions& ko) {
  kernels::TrtllmOptions t;
  static_cast<kernels::KernelOptions&>(t) = ko;
  t.arch = p.marlin.trtllm_sm90 ? kernels::TrtllmArch::kSm90 : kernels::TrtllmArch::kSm80;
  return t;
}

// TensorRT-LLM params (TRTLLM_INT4.md): codes I32 [(E,) K/8, N] <-> the preprocessed int8 bytes
// [(E,) K, N/2]; W4A16 scales are the GPTQ-orientation scales unchanged (§3.1), so TrtllmScales is
// the identity and its own inverse.
absl::Status RunTrtllm(const EngineParam& p, const TensorView& in, const MutableTensorView& out, bool inverse,
                       const kernels::KernelOptions& ko) {
  const kernels::TrtllmOptions t = TrtllmOpts(p, ko);
  if (p.kind == ParamKind::kPacked)
    return inverse ? kernels::UnpreprocessTrtllm(in, out, t) : kernels::PreprocessTrtllm(in, out, t);
  return kernels::TrtllmScales(in, p.marlin.size_k, p.marlin.group_size, out, t);
}

// Largest scratch a dense INT4 param needs (its loaded-form bytes).
int64_t ScratchBytes(const EngineLayout& layout) {
  int64_t m = 0;
  for (const EngineParam& p : layout.params())
    if (IsDenseInt4(p)) m = std::max(m, NumBytes(p.dtype, p.loaded_shape).value_or(0));
  return m;
}

// Largest loaded form of an INT4 param (a kernel's input or output in GPTQ orientation).
int64_t MaxInt4Bytes(const EngineLayout& layout) {
  int64_t m = 0;
  for (const EngineParam& p : layout.params())
    if (p.kind != ParamKind::kPlain) m = std::max(m, NumBytes(p.dtype, p.loaded_shape).value_or(0));
  return m;
}

// The device side of a param whose engine buffer is CUDA memory: the kernel's GPTQ-orientation
// input (Commit) or output (Restore) goes through `buffer` (at least MaxInt4Bytes) on `device`.
// `staging`: the staging is that device's memory too (a device staging): nothing crosses the link.
struct DeviceSide {
  int device = -1;
  CudaAllocation* buffer = nullptr;
  bool staging = false;
};

// [rows, cols] -> [cols, rows] of `item`-byte elements on `device` (enqueued).
absl::Status TransposeOnDevice(int device, const void* src, int64_t rows, int64_t cols, void* dst, size_t item) {
  return kernels::TransposeBlock(MemorySpace::Cuda(device), {src, cols, 0, 0, rows, cols, dst, rows, 0, 0, item});
}

// The loaded form in GPTQ orientation, which the kernels read and write: the param itself for MoE
// ([E, K/8, N] / [E, rows, N] already), else its transpose ([N, K/8] -> [K/8, N], the
// permute_param_layout_; [N, rows] -> [rows, N]) in `scratch`.
Shape GptqOrientation(const EngineParam& p) {
  return IsDenseInt4(p) ? Shape{p.loaded_shape[1], p.loaded_shape[0]} : p.loaded_shape;
}

// AWQ-Marlin qweight [(E,) K/16, 2N] -> AWQ qweight [(E,) K, N/8] (AWQ.md §3.1 inverted): MarlinToGptq
// into a temporary of the same memory (host, or the device of `ko`), then GptqToAwq.
absl::Status MarlinToAwq(const TensorView& marlin, const MutableTensorView& awq, const kernels::KernelOptions& ko,
                         int device) {
  ASSIGN_OR_RETURN(const Shape gshape, kernels::GptqShapeFor(marlin.shape()));
  ASSIGN_OR_RETURN(const int64_t bytes, NumBytes(DType::kI32, gshape));
  Buffer host;
  std::unique_ptr<CudaAllocation> dev_tmp;
  std::byte* tmp = nullptr;
  if (ko.device == kernels::Device::kCuda) {
    ASSIGN_OR_RETURN(dev_tmp, AllocateCuda(static_cast<size_t>(std::max<int64_t>(bytes, 1)), device));
    tmp = static_cast<std::byte*>(dev_tmp->data());
  } else {
    ASSIGN_OR_RETURN(host, Buffer::Allocate(static_cast<size_t>(std::max<int64_t>(bytes, 1))));
    tmp = host.data();
  }
  const MutableTensorView gptq(DType::kI32, gshape, {tmp, static_cast<size_t>(bytes)});
  RETURN_IF_ERROR(kernels::MarlinToGptq(marlin, nullptr, gptq, ko));
  return kernels::GptqToAwq(gptq, awq, ko);
}

// Loaded (GPTQ orientation, or AWQ as loaded) -> engine form of an INT4 param, or back (inverse).
// `device`: the CUDA device of `in` and `out` when ko.device is kCuda.
absl::Status RunKernel(const EngineParam& p, const TensorView& in, const MutableTensorView& out, bool inverse,
                       const kernels::KernelOptions& ko, int device) {
  // The CUDA kernels run on the thread's current device: make it this param's.
  if (ko.device == kernels::Device::kCuda && device >= 0) RETURN_IF_ERROR(MakeDeviceCurrent(device));
  if (p.marlin.trtllm) return RunTrtllm(p, in, out, inverse, ko);
  if (p.kind == ParamKind::kPacked && p.marlin.awq)
    return inverse ? MarlinToAwq(in, out, ko, device) : kernels::AwqToMarlin(in, out, ko);
  if (p.kind == ParamKind::kPacked)
    return inverse ? kernels::MarlinToGptq(in, nullptr, out, ko) : kernels::GptqToMarlin(in, nullptr, out, ko);
  if (p.kind == ParamKind::kZeros)
    return inverse ? kernels::MarlinZerosToAwq(in, out, ko) : kernels::AwqZerosToMarlin(in, out, ko);
  return PermuteScalesAs(in, out, p.marlin.grouped_scale_perm, inverse, ko);
}

// Loaded form -> engine form of one param. `scratch` holds at least ScratchBytes(layout) (host
// staging). With `dev`, the engine buffer is device memory: plain params are copied to it, INT4
// params are prepared on the host (the transpose), uploaded and repacked on the device straight
// into it; from a device staging everything stays on the device (the transpose into the device
// buffer, the kernels reading the staging itself).
absl::Status CommitParam(const EngineParam& p, const TensorView& loaded, const MutableTensorView& engine,
                         std::span<std::byte> scratch, const RepackOptions& o, const DeviceSide* dev) {
  if (p.kind == ParamKind::kPlain) {
    if (dev != nullptr && dev->staging) return CopyOnDevice(engine.data(), loaded.data(), loaded.nbytes(), dev->device);
    if (dev != nullptr) return CopyHostToDevice(engine.data(), loaded.data(), loaded.nbytes(), dev->device);
    ParallelCopy(loaded.bytes().data(), engine.bytes().data(), loaded.nbytes(), o.num_threads);
    return absl::OkStatus();
  }
  TensorView in = loaded;
  if (dev != nullptr && dev->staging) {
    if (IsDenseInt4(p)) {
      RETURN_IF_ERROR(TransposeOnDevice(dev->device, loaded.data(), p.loaded_shape[0], p.loaded_shape[1],
                                        dev->buffer->data(), ItemSize(p.dtype)));
      in = TensorView(p.dtype, GptqOrientation(p),
                      {static_cast<const std::byte*>(dev->buffer->data()), loaded.nbytes()});
    }
    kernels::KernelOptions ko = KernelOpts(o);
    ko.device = kernels::Device::kCuda;
    return RunKernel(p, in, engine, /*inverse=*/false, ko, dev->device);
  }
  if (IsDenseInt4(p)) {
    const int64_t n = p.loaded_shape[0], cols = p.loaded_shape[1];
    Transpose(loaded.bytes().data(), n, cols, scratch.data(), ItemSize(p.dtype), o.num_threads);
    in = TensorView(p.dtype, GptqOrientation(p), scratch.first(loaded.nbytes()));
  }
  kernels::KernelOptions ko = KernelOpts(o);
  if (dev != nullptr) {
    RETURN_IF_ERROR(CopyHostToDevice(dev->buffer->data(), in.data(), in.nbytes(), dev->device));
    in = TensorView(p.dtype, in.shape(), {static_cast<const std::byte*>(dev->buffer->data()), in.nbytes()});
    ko.device = kernels::Device::kCuda;
  }
  return RunKernel(p, in, engine, /*inverse=*/false, ko, dev != nullptr ? dev->device : -1);
}

// Engine form -> loaded form of one param (the inverse of CommitParam; same `dev` contract).
absl::Status RestoreParam(const EngineParam& p, const TensorView& engine, const MutableTensorView& loaded,
                          std::span<std::byte> scratch, const RepackOptions& o, const DeviceSide* dev) {
  if (p.kind == ParamKind::kPlain) {
    if (dev != nullptr && dev->staging) return CopyOnDevice(loaded.data(), engine.data(), engine.nbytes(), dev->device);
    if (dev != nullptr) return CopyDeviceToHost(loaded.data(), engine.data(), engine.nbytes(), dev->device);
    ParallelCopy(engine.bytes().data(), loaded.bytes().data(), engine.nbytes(), o.num_threads);
    return absl::OkStatus();
  }
  const bool dense = IsDenseInt4(p);
  if (dev != nullptr && dev->staging) {
    kernels::KernelOptions ko = KernelOpts(o);
    ko.device = kernels::Device::kCuda;
    const Shape gshape = GptqOrientation(p);
    const MutableTensorView out =
        dense ? MutableTensorView(p.dtype, gshape, {static_cast<std::byte*>(dev->buffer->data()), loaded.nbytes()})
              : loaded;
    RETURN_IF_ERROR(RunKernel(p, engine, out, /*inverse=*/true, ko, dev->device));
    if (!dense) return absl::OkStatus();
    return TransposeOnDevice(dev->device, out.data(), gshape[0], gshape[1], loaded.data(), ItemSize(p.dtype));
  }
  const MutableTensorView host(p.dtype, GptqOrientation(p), dense ? scratch.first(loaded.nbytes()) : loaded.bytes());
  MutableTensorView out = host;
  kernels::KernelOptions ko = KernelOpts(o);
  if (dev != nullptr) {
    out = MutableTensorView(p.dtype, host.shape(), {static_cast<std::byte*>(dev->buffer->data()), host.nbytes()});
    ko.device = kernels::Device::kCuda;
  }
  RETURN_IF_ERROR(RunKernel(p, engine, out, /*inverse=*/true, ko, dev != nullptr ? dev->device : -1));
  if (dev != nullptr) RETURN_IF_ERROR(CopyDeviceToHost(host.data(), out.data(), host.nbytes(), dev->device));
  if (dense)
    Transpose(host.bytes().data(), host.dim(0), host.dim(1), loaded.bytes().data(), ItemSize(p.dtype), o.num_threads);
  return absl::OkStatus();
}

// One device buffer of MaxInt4Bytes per CUDA device the engine's buffers live on, allocated before
// anything is written (kResourceExhausted / kFailedPrecondition naming `what`).
class DeviceBuffers {
 public:
  absl::Status Allocate(const EngineLayout& layout, const EngineWeights& engine, absl::string_view what) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(MaxInt4Bytes(layout), 1));
    for (const EngineBuffer& b : engine.buffers()) {
      if (!b.on_device() || Find(b.cuda_device) != nullptr) continue;
      auto a = AllocateCuda(bytes, b.cuda_device);
      if (!a.ok()) return Annotate(a.status(), absl::StrCat(what, " refused: device scratch"));
      buffers_.push_back(std::move(*a));
    }
    return absl::OkStatus();
  }
  // The device side of `b`, or nullptr for host memory; `staging`: the staging's space.
  std::optional<DeviceSide> For(const EngineBuffer& b, const MemorySpace& staging) const {
    if (!b.on_device()) return std::nullopt;
    return DeviceSide{b.cuda_device, Find(b.cuda_device), !staging.host()};
  }

 private:
  CudaAllocation* Find(int device) const {
    for (const auto& a : buffers_)
      if (a->device() == device) return a.get();
    return nullptr;
  }
  std::vector<std::unique_ptr<CudaAllocation>> buffers_;
};

// Staging and engine memory must not overlap (each side is checked on its own elsewhere).
absl::Status CheckDisjoint(const Staging& staging, const EngineWeights& engine) {
  struct Range {
    uintptr_t begin, end;
    bool engine;
    const std::string* name;
  };
  std::vector<Range> r;
  const auto& params = staging.layout().params();
  for (size_t i = 0; i < params.size(); ++i) {
    const MutableTensorView v = staging.param(static_cast<int>(i));
    if (v.nbytes() > 0)
      r.push_back({reinterpret_cast<uintptr_t>(v.data()), reinterpret_cast<uintptr_t>(v.data()) + v.nbytes(), false,
                   &params[i].name});
  }
  for (const EngineBuffer& b : engine.buffers())
    if (b.nbytes > 0)
      r.push_back({reinterpret_cast<uintptr_t>(b.data), reinterpret_cast<uintptr_t>(b.data) + b.nbytes, true, &b.name});
  std::sort(r.begin(), r.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  uintptr_t end = 0;
  const Range* last = nullptr;
  for (const Range& x : r) {
    if (last != nullptr && x.begin < end && x.engine != last->engine)
      return absl::InvalidArgumentError(absl::StrCat("engine buffer ", x.engine ? *x.name : *last->name,
                                                     " overlaps staging buffer ", x.engine ? *last->name : *x.name));
    if (x.end > end) {
      end = x.end;
      last = &x;
    }
  }
  return absl::OkStatus();
}

absl::Status Validate(const Staging& staging, const EngineWeights& engine, absl::string_view what) {
  RETURN_IF_ERROR(Annotate(engine.CheckMatches(staging.layout()), absl::StrCat(what, " refused")));
  // A device staging feeds the kernels of its own device only: every engine buffer must be there.
  if (const MemorySpace& sp = staging.space(); !sp.host()) {
    for (const EngineBuffer& b : engine.buffers()) {
      if (b.cuda_device != sp.cuda_device())
        return absl::InvalidArgumentError(
            absl::StrCat(what, " refused: the staging is in ", sp.Name(), ", but engine buffer ", b.name, " is in ",
                         b.on_device() ? MemorySpace::Cuda(b.cuda_device).Name() : "host memory",
                         " (a device staging serves an engine whose parameters are all on its GPU)"));
    }
  }
  return Annotate(CheckDisjoint(staging, engine), absl::StrCat(what, " refused"));
}

// A device staging: the loads enqueued on its device are waited for (their errors surface here,
// before anything is written) and the device is made this thread's, for the kernels.
absl::Status SettleStaging(const Staging& staging, absl::string_view what) {
  if (staging.space().host()) return absl::OkStatus();
  return Annotate(staging.Synchronize(),
                  absl::StrCat(what, " refused: the loads into the staging in ", staging.space().Name()));
}

absl::StatusOr<Buffer> AllocateScratch(int64_t bytes, absl::string_view what) {
  auto b = Buffer::Allocate(static_cast<size_t>(std::max<int64_t>(bytes, 0)));
  if (!b.ok()) return Annotate(b.status(), absl::StrCat(what, " refused: scratch"));
  return b;
}

}  // namespace

absl::Status Commit(const Staging& staging, EngineWeights& engine, const RepackOptions& options) {
  const EngineLayout& layout = staging.layout();
  RETURN_IF_ERROR(Annotate(staging.CheckComplete(), "commit refused"));
  RETURN_IF_ERROR(Validate(staging, engine, "commit"));
  int64_t max_loaded = 0;
  for (const EngineParam& p : layout.params())
    max_loaded = std::max(max_loaded, NumBytes(p.dtype, p.loaded_shape).value_or(0));
  const MemorySpace& space = staging.space();
  RETURN_IF_ERROR(SettleStaging(staging, "commit"));
  ASSIGN_OR_RETURN(Buffer scratch, AllocateScratch(space.host() ? ScratchBytes(layout) : 0, "commit"));
  DeviceBuffers device;
  RETURN_IF_ERROR(device.Allocate(layout, engine, "commit"));
  // verify: the read-back lands in `check` (the staging's space); a device staging's bytes are
  // compared on the host, through `got_host` and `want_host`.
  Buffer check, check_scratch, got_host, want_host;
  if (options.verify) {
    if (space.host()) {
      ASSIGN_OR_RETURN(check, AllocateScratch(max_loaded, "commit"));
      ASSIGN_OR_RETURN(check_scratch, AllocateScratch(ScratchBytes(layout), "commit"));
    } else {
      auto c = space.Allocate(static_cast<size_t>(std::max<int64_t>(max_loaded, 1)));
      if (!c.ok()) return Annotate(c.status(), "commit refused: verify buffer");
      check = std::move(*c);
      ASSIGN_OR_RETURN(got_host, AllocateScratch(max_loaded, "commit"));
      ASSIGN_OR_RETURN(want_host, AllocateScratch(max_loaded, "commit"));
    }
  }
  // Nothing has been written so far; from here on only kernel bugs (or a failing device) can fail.
  const auto& params = layout.params();
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = params[i];
    const EngineBuffer& b = *engine.Find(p.name);  // CheckMatches: every param has its buffer
    ASSIGN_OR_RETURN(const MutableTensorView dst, engine.View(p.name));
    const std::optional<DeviceSide> dev = device.For(b, space);
    const absl::Status st =
        CommitParam(p, Const(staging.param(static_cast<int>(i))), dst, scratch.span(), options, dev ? &*dev : nullptr);
    if (!st.ok())
      return absl::InternalError(
          absl::StrCat("commit of ", p.name, " failed after validation (engine partially written): ", st.message()));
  }
  // The device copies are enqueued: the engine may read its memory once they are done.
  if (absl::Status st = space.Synchronize(); !st.ok())
    return absl::InternalError(absl::StrCat("commit from the staging in ", space.Name(),
                                            " failed after validation (engine partially written): ", st.message()));
  if (!options.verify) return absl::OkStatus();
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = params[i];
    const MutableTensorView want = staging.param(static_cast<int>(i));
    ASSIGN_OR_RETURN(const MutableTensorView src, engine.View(p.name));
    const std::optional<DeviceSide> dev = device.For(*engine.Find(p.name), space);
    const MutableTensorView got(p.dtype, p.loaded_shape, check.span().first(want.nbytes()));
    RETURN_IF_ERROR(RestoreParam(p, Const(src), got, check_scratch.span(), options, dev ? &*dev : nullptr));
    const void* got_bytes = got.data();
    const void* want_bytes = want.data();
    if (!space.host()) {
      RETURN_IF_ERROR(space.CopyToHost(got_host.data(), got.data(), got.nbytes()));
      RETURN_IF_ERROR(space.CopyToHost(want_host.data(), want.data(), want.nbytes()));
      got_bytes = got_host.data();
      want_bytes = want_host.data();
    }
    if (std::memcmp(got_bytes, want_bytes, want.nbytes()) != 0)
      return absl::InternalError(absl::StrCat("commit verify: engine ", p.name, " read back",
                                              p.kind == ParamKind::kPlain ? "" : " from Marlin",
                                              " differs from staging"));
  }
  return absl::OkStatus();
}

absl::Status Restore(const EngineWeights& engine, Staging& staging, const RepackOptions& options) {
  const EngineLayout& layout = staging.layout();
  RETURN_IF_ERROR(Validate(staging, engine, "restore"));
  RETURN_IF_ERROR(SettleStaging(staging, "restore"));
  staging.ForgetSums();  // its bytes are rewritten from the engine's
  ASSIGN_OR_RETURN(Buffer scratch, AllocateScratch(staging.space().host() ? ScratchBytes(layout) : 0, "restore"));
  DeviceBuffers device;
  RETURN_IF_ERROR(device.Allocate(layout, engine, "restore"));
  const auto& params = layout.params();
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = params[i];
    ASSIGN_OR_RETURN(const MutableTensorView src, engine.View(p.name));
    const std::optional<DeviceSide> dev = device.For(*engine.Find(p.name), staging.space());
    const absl::Status st =
        RestoreParam(p, Const(src), staging.param(static_cast<int>(i)), scratch.span(), options, dev ? &*dev : nullptr);
    if (!st.ok()) {
      staging.ResetCoverage();
      return absl::InternalError(absl::StrCat("restore of ", p.name, " failed after validation: ", st.message()));
    }
  }
  if (absl::Status st = staging.Synchronize(); !st.ok()) {
    staging.ResetCoverage();
    return absl::InternalError(
        absl::StrCat("restore into the staging in ", staging.space().Name(), ": ", st.message()));
  }
  staging.MarkAllRestored();
  return absl::OkStatus();
}

// --- dense dequantization ------------------------------------------------------------------------

absl::Status RestoreParamToLoaded(const EngineLayout& layout, absl::string_view name, const EngineWeights& engine,
                                  const MutableTensorView& loaded, const RepackOptions& options) {
  const int pi = layout.FindParam(name);
  if (pi < 0) return absl::NotFoundError(absl::StrCat("no engine param '", name, "' in the layout"));
  const EngineParam& p = layout.params()[static_cast<size_t>(pi)];
  const EngineBuffer* b = engine.Find(name);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("engine memory holds no '", name, "'"));
  if (b->on_device())
    return absl::FailedPreconditionError(absl::StrCat(name, ": in device memory (restore it with Restore)"));
  if (loaded.dtype() != p.dtype || loaded.shape() != p.loaded_shape)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the loaded form is ", SafetensorsName(p.dtype), " ", ShapeToString(p.loaded_shape),
                     ", the view ", SafetensorsName(loaded.dtype()), " ", ShapeToString(loaded.shape())));
  ASSIGN_OR_RETURN(MutableTensorView view, engine.View(name));
  Buffer scratch;
  if (IsDenseInt4(p)) {
    ASSIGN_OR_RETURN(scratch, AllocateScratch(static_cast<int64_t>(loaded.nbytes()), name));
  }
  return RestoreParam(p, view, loaded, scratch.span(), options, nullptr);
}

namespace {

float ScaleAt(const std::byte* s, int64_t i, DType dt) {
  uint16_t b;
  std::memcpy(&b, s + 2 * i, 2);
  return dt == DType::kBF16 ? BF16ToF32(b) : F16ToF32(b);
}

float Nibble(const std::byte* words, int64_t w, int slot) {
  uint32_t x;
  std::memcpy(&x, words + 4 * w, 4);
  return static_cast<float>(static_cast<int>((x >> (4 * slot)) & 0xFu) - 8);
}

void Store(std::byte* out, int64_t i, float v, DType dt) {
  if (dt == DType::kF32) {
    std::memcpy(out + 4 * i, &v, 4);
  } else {
    const uint16_t b = F32ToBF16(v);
    std::memcpy(out + 2 * i, &b, 2);
  }
}

float PlainAt(const std::byte* p, int64_t i, DType dt) {
  if (dt == DType::kF32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  return ScaleAt(p, i, dt);
}

absl::Status CheckView(const TensorView& v, const EngineParam& p, ParamForm form) {
  const Shape& want = p.shape(form);
  const DType dt = p.dtype_in(form);
  if (v.dtype() != dt || v.shape() != want || static_cast<int64_t>(v.nbytes()) != NumBytes(dt, want).value_or(-1))
    return absl::InvalidArgumentError(absl::StrCat("DequantizeToDense: ", p.name, " is ", v.DebugString(), " (",
                                                   v.nbytes(), " bytes), want ", SafetensorsName(dt),
                                                   ShapeToString(want)));
  return absl::OkStatus();
}

}  // namespace

namespace {

// AWQ (AWQ.md §1-3): W[e][r][c] = (u - z) * s from qweight [(E,) k, n/8], qzeros [(E,) rows, n/8]
// and scales [(E,) rows, n]; the engine form is first restored to them (Marlin -> AWQ, Marlin zero
// points -> AWQ, scales un-permuted).
absl::StatusOr<Tensor> DequantizeAwq(const EngineLinear& linear, const EngineParam& pk, const EngineParam& ps,
                                     const EngineLayout& layout, const TensorView& weight, const TensorView& scale,
                                     const TensorView& zeros, ParamForm form, const DenseOptions& options, Tensor out) {
  if (linear.zeros < 0) return absl::InternalError(absl::StrCat(linear.name, ": an AWQ linear without zero points"));
  const EngineParam& pz = layout.params()[static_cast<size_t>(linear.zeros)];
  RETURN_IF_ERROR(CheckView(zeros, pz, form));
  const int64_t E = std::max<int64_t>(linear.experts, 1), n = linear.n, k = linear.k, rows = pk.marlin.scale_rows;
  const int64_t G = linear.group_size > 0 ? linear.group_size : k;
  Tensor qt, zt, st;
  TensorView q = weight, z = zeros, sc = scale;
  if (form == ParamForm::kEngine) {
    kernels::KernelOptions ko;
    ko.num_threads = options.num_threads;
    Tensor wa, za, sa;  // aligned copies for the kernels' checks
    if (!weight.IsAligned(4)) {
      ASSIGN_OR_RETURN(wa, Tensor::CopyOf(weight));
    }
    if (!zeros.IsAligned(4)) {
      ASSIGN_OR_RETURN(za, Tensor::CopyOf(zeros));
    }
    if (!scale.IsAligned(2)) {
      ASSIGN_OR_RETURN(sa, Tensor::CopyOf(scale));
    }
    ASSIGN_OR_RETURN(qt, Tensor::Empty(DType::kI32, pk.loaded_shape));
    ASSIGN_OR_RETURN(zt, Tensor::Empty(DType::kI32, pz.loaded_shape));
    ASSIGN_OR_RETURN(st, Tensor::Empty(ps.dtype, ps.loaded_shape));
    RETURN_IF_ERROR(MarlinToAwq(weight.IsAligned(4) ? weight : wa.view(), qt.mutable_view(), ko, -1));
    RETURN_IF_ERROR(kernels::MarlinZerosToAwq(zeros.IsAligned(4) ? zeros : za.view(), zt.mutable_view(), ko));
    RETURN_IF_ERROR(PermuteScalesAs(scale.IsAligned(2) ? scale : sa.view(), st.mutable_view(),
                                    pk.marlin.grouped_scale_perm, true, ko));
    q = qt.view();
    z = zt.view();
    sc = st.view();
  }
  const std::byte* qb = q.bytes().data();
  const std::byte* zb = z.bytes().data();
  const std::byte* sb = sc.bytes().data();
  std::byte* o = reinterpret_cast<std::byte*>(out.data_as<uint8_t>());
  const DType sdt = ps.dtype, odt = options.out_dtype;
  auto word = [](const std::byte* p, int64_t i) {
    uint32_t x;
    std::memcpy(&x, p + 4 * i, 4);
    return x;
  };
  ParallelFor(E * n, options.num_threads, 64, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t ex = row / n, r = row % n;
      for (int64_t c = 0; c < k; ++c) {
        const int64_t g = c / G;
        const uint32_t u = kernels::format::AwqNibble(word(qb, (ex * k + c) * (n / 8) + r / 8), r);
        const uint32_t zp = kernels::format::AwqNibble(word(zb, (ex * rows + g) * (n / 8) + r / 8), r);
        Store(
            o, row * k + c,
            static_cast<float>(static_cast<int>(u) - static_cast<int>(zp)) * ScaleAt(sb, (ex * rows + g) * n + r, sdt),
            odt);
      }
    }
  });
  return out;
}

}  // namespace

absl::StatusOr<Tensor> DequantizeToDense(const EngineLinear& linear, const EngineLayout& layout,
                                         const TensorView& weight, const TensorView& scale, const TensorView& zeros,
                                         ParamForm form, const DenseOptions& options) {
  if (options.out_dtype != DType::kF32 && options.out_dtype != DType::kBF16)
    return absl::InvalidArgumentError("DequantizeToDense: out_dtype must be F32 or BF16");
  const int64_t E = std::max<int64_t>(linear.experts, 1), n = linear.n, k = linear.k;
  Shape out_shape = linear.experts > 0 ? Shape{linear.experts, n, k} : Shape{n, k};
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(options.out_dtype, out_shape));
  std::byte* o = reinterpret_cast<std::byte*>(out.data_as<uint8_t>());
  const DType odt = options.out_dtype;
  if (!linear.quantized) {
    const EngineParam& p = layout.params()[static_cast<size_t>(linear.weight)];
    RETURN_IF_ERROR(CheckView(weight, p, form));
    const std::byte* w = weight.bytes().data();
    ParallelFor(E * n, options.num_threads, 256, [&](int64_t b, int64_t e) {
      for (int64_t i = b * k; i < e * k; ++i) Store(o, i, PlainAt(w, i, p.dtype), odt);
    });
    return out;
  }
  if (linear.fp8) {
    // FP8 (docs/spec/FP8.md §1): float(code) x its block's or row's F32 scale; the same in both forms.
    const EngineParam& pw = layout.params()[static_cast<size_t>(linear.weight)];
    const EngineParam& ps = layout.params()[static_cast<size_t>(linear.scale)];
    RETURN_IF_ERROR(CheckView(weight, pw, form));
    RETURN_IF_ERROR(CheckView(scale, ps, form));
    const Shape& ss = ps.loaded_shape;
    const int64_t srows = ss[ss.size() - 2], scols = ss.back();
    const bool block = layout.int4_format() == Int4Format::kFp8Block;  // else per channel: [n, 1]
    const int64_t bn = block ? layout.quantization()->block_n : 1, bk = block ? layout.quantization()->block_k : k;
    const auto* q = reinterpret_cast<const uint8_t*>(weight.bytes().data());
    const std::byte* s = scale.bytes().data();
    ParallelFor(E * n, options.num_threads, 64, [&](int64_t b, int64_t e) {
      for (int64_t er = b; er < e; ++er) {
        const int64_t ex = er / n, r = er % n;
        for (int64_t c = 0; c < k; ++c) {
          const float sc = PlainAt(s, (ex * srows + (block ? r / bn : r)) * scols + (block ? c / bk : 0), ps.dtype);
          Store(o, er * k + c, kernels::format::E4m3Value(q[er * k + c]) * sc, odt);
        }
      }
    });
    return out;
  }
  const EngineParam& pk = layout.params()[static_cast<size_t>(linear.packed)];
  const EngineParam& ps = layout.params()[static_cast<size_t>(linear.scale)];
  RETURN_IF_ERROR(CheckView(weight, pk, form));
  RETURN_IF_ERROR(CheckView(scale, ps, form));
  const int64_t rows = pk.marlin.scale_rows;
  const int64_t G = linear.group_size > 0 ? linear.group_size : k;
  const DType sdt = ps.dtype;
  if (pk.marlin.awq) return DequantizeAwq(linear, pk, ps, layout, weight, scale, zeros, form, options, std::move(out));
  if (form == ParamForm::kLoaded && linear.experts == 0 && !pk.marlin.trtllm) {
    // compressed-tensors: packed [n, k/8], scale [n, rows].
    const std::byte* w = weight.bytes().data();
    const std::byte* s = scale.bytes().data();
    ParallelFor(n, options.num_threads, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t c = 0; c < k; ++c)
          Store(o, r * k + c,
                Nibble(w, r * (k / 8) + c / 8, static_cast<int>(c % 8)) * ScaleAt(s, r * rows + c / G, sdt), odt);
    });
    return out;
  }
  // GPTQ orientation per expert: packed [E, k/8, n], scale [E, rows, n]; engine form goes through it.
  Tensor gptq_t, scale_t;
  const std::byte* w = weight.bytes().data();
  const std::byte* s = scale.bytes().data();
  if (form == ParamForm::kEngine) {
    const Shape gshape = linear.experts > 0 ? Shape{linear.experts, k / 8, n} : Shape{k / 8, n};
    const Shape sshape = linear.experts > 0 ? Shape{linear.experts, rows, n} : Shape{rows, n};
    ASSIGN_OR_RETURN(gptq_t, Tensor::Empty(DType::kI32, gshape));
    ASSIGN_OR_RETURN(scale_t, Tensor::Empty(sdt, sshape));
    // Engine buffers may be unaligned for the kernels' checks only if the caller built odd views;
    // copy to aligned memory first in that case.
    Tensor w_copy, s_copy;
    TensorView wv = weight, sv = scale;
    if (!weight.IsAligned(4)) {
      ASSIGN_OR_RETURN(w_copy, Tensor::CopyOf(weight));
      wv = w_copy.view();
    }
    if (!scale.IsAligned(2)) {
      ASSIGN_OR_RETURN(s_copy, Tensor::CopyOf(scale));
      sv = s_copy.view();
    }
    kernels::KernelOptions ko;
    ko.num_threads = options.num_threads;
    if (pk.marlin.trtllm) {
      RETURN_IF_ERROR(RunTrtllm(pk, wv, gptq_t.mutable_view(), /*inverse=*/true, ko));
      RETURN_IF_ERROR(RunTrtllm(ps, sv, scale_t.mutable_view(), /*inverse=*/true, ko));
    } else {
      RETURN_IF_ERROR(kernels::MarlinToGptq(wv, nullptr, gptq_t.mutable_view(), ko));
      RETURN_IF_ERROR(PermuteScalesAs(sv, scale_t.mutable_view(), pk.marlin.grouped_scale_perm, true, ko));
    }
    w = gptq_t.view().bytes().data();
    s = scale_t.view().bytes().data();
  }
  // TensorRT-LLM's w3_w1 holds up_proj first; the dense weight has gate_proj rows first.
  const int64_t half = pk.marlin.up_first ? n / 2 : 0;
  ParallelFor(E * n, options.num_threads, 64, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t ex = row / n, r = (row % n + half) % n;
      const int64_t wbase = ex * (k / 8) * n, sbase = ex * rows * n;
      for (int64_t c = 0; c < k; ++c)
        Store(o, row * k + c,
              Nibble(w, wbase + (c / 8) * n + r, static_cast<int>(c % 8)) * ScaleAt(s, sbase + (c / G) * n + r, sdt),
              odt);
    }
  });
  return out;
}

namespace {

// `v` (memory of `space`) as a host view: itself, or its bytes copied into `copy` (the caller's).
absl::StatusOr<TensorView> OnHost(const TensorView& v, const MemorySpace& space, Tensor& copy) {
  if (space.host()) return v;
  ASSIGN_OR_RETURN(copy, Tensor::Empty(v.dtype(), v.shape()));
  RETURN_IF_ERROR(space.CopyToHost(copy.mutable_view().data(), v.data(), v.nbytes()));
  return copy.view();
}

// DequantizeToDense of linear `linear_name` whose params `param_at(index)` gives with their space.
absl::StatusOr<Tensor> DequantizeLinear(
    const EngineLayout& layout, absl::string_view linear_name, ParamForm form, const DenseOptions& options,
    const std::function<absl::StatusOr<std::pair<TensorView, MemorySpace>>(int index)>& param_at) {
  const int li = layout.FindLinear(linear_name);
  if (li < 0) return absl::NotFoundError(absl::StrCat("DequantizeToDense: no linear named ", linear_name));
  const EngineLinear& lin = layout.linears()[static_cast<size_t>(li)];
  Tensor copies[3];
  TensorView views[3];
  const bool int4 = lin.quantized && !lin.fp8;
  const int index[3] = {int4 ? lin.packed : lin.weight, lin.quantized ? lin.scale : -1, lin.zeros};
  for (int i = 0; i < 3; ++i) {
    if (index[i] < 0) continue;
    ASSIGN_OR_RETURN(const auto at, param_at(index[i]));
    ASSIGN_OR_RETURN(views[i], OnHost(at.first, at.second, copies[i]));
  }
  return DequantizeToDense(lin, layout, views[0], views[1], views[2], form, options);
}

}  // namespace

absl::StatusOr<Tensor> DequantizeToDense(const EngineLayout& layout, absl::string_view linear_name,
                                         const EngineWeights& engine, const DenseOptions& options) {
  return DequantizeLinear(layout, linear_name, ParamForm::kEngine, options,
                          [&](int index) -> absl::StatusOr<std::pair<TensorView, MemorySpace>> {
                            const std::string& name = layout.params()[static_cast<size_t>(index)].name;
                            ASSIGN_OR_RETURN(const MutableTensorView v, engine.View(name));
                            return std::pair<TensorView, MemorySpace>(
                                v, MemorySpace::Cuda(engine.Find(name)->cuda_device));
                          });
}

absl::StatusOr<Tensor> DequantizeToDense(absl::string_view linear_name, const Staging& staging,
                                         const DenseOptions& options) {
  return DequantizeLinear(staging.layout(), linear_name, ParamForm::kLoaded, options,
                          [&](int index) -> absl::StatusOr<std::pair<TensorView, MemorySpace>> {
                            return std::pair<TensorView, MemorySpace>(staging.param(index), staging.space());
                          });
}

}  // namespace wsync::engine_model
