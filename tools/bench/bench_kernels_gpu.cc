// wsync-bench-kernels-gpu: throughput of the CUDA INT4 kernels against a device-to-device copy of
// the same bytes, and a bit-exact check of every row against the CPU kernels on the same input.
// Built only with CUDA (WSYNC_HAVE_CUDA); without a device it prints why and exits 0, so that the
// device bundle's run script works on CPU-only machines.
//
// For every kernel and size: the time per call (best of -n; each call enqueues on the default
// stream and synchronizes, as the library's CUDA entry points do), the bandwidth on the kernel's
// input bytes, the bandwidth of cudaMemcpy D2D of the same byte count measured in the same run
// (bytes read; a copy also writes as many), their ratio, and #wrong: 32-bit words of the outputs
// that differ from the CPU kernel's outputs on the same host input (-c 1).
//
//   wsync-bench-kernels-gpu [-b 16M] [-e 1G] [-f 4] [-n 10] [-w 2] [-c 1] [-k kernel]...
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/dtype.h"
#include "common/tensor.h"
#include "common/units.h"
#include "kernels/awq.h"
#include "kernels/dispatch.h"
#include "kernels/int4.h"
#include "kernels/trtllm.h"
#include "tools/bench/kernel_sweep.h"

namespace wsync {
namespace {

using bench::Die;

struct Flags : bench::SweepFlags {
  Flags() { max_bytes = "1G", factor = 4, iters = 10, warmup = 2; }
};

void CudaOk(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// One buffer in both memory spaces: `host` holds the input (or the CPU kernel's output), `dev` the
// device copy (or the CUDA kernel's output).
struct Twin {
  std::vector<uint32_t> host;
  void* dev = nullptr;
  explicit Twin(size_t bytes) : host((bytes + 3) / 4) { CudaOk(cudaMalloc(&dev, host.size() * 4), "cudaMalloc"); }
  ~Twin() { cudaFree(dev); }
  Twin(const Twin&) = delete;
  Twin& operator=(const Twin&) = delete;
  size_t bytes() const { return host.size() * 4; }
  std::span<std::byte> span(kernels::Device d) {
    return {d == kernels::Device::kCpu ? reinterpret_cast<std::byte*>(host.data()) : static_cast<std::byte*>(dev),
            bytes()};
  }
  void Upload() { CudaOk(cudaMemcpy(dev, host.data(), bytes(), cudaMemcpyHostToDevice), "upload"); }
  int64_t WrongWords() const {  // device words that differ from the host words
    std::vector<uint32_t> d(host.size());
    CudaOk(cudaMemcpy(d.data(), dev, bytes(), cudaMemcpyDeviceToHost), "download");
    int64_t wrong = 0;
    for (size_t i = 0; i < d.size(); ++i) wrong += d[i] != host[i];
    return wrong;
  }
};

// A benchmark case: inputs (filled on the host, uploaded), outputs, and the call that runs the
// kernel on either memory space with views over the matching pointers.
struct Case {
  const char* name;
  int64_t bytes = 0;  // input bytes the bandwidth counts
  std::vector<std::unique_ptr<Twin>> in, out;
  std::function<absl::Status(kernels::Device, std::vector<std::span<std::byte>>&, std::vector<std::span<std::byte>>&)>
      call;
};

Twin& AddBuffer(std::vector<std::unique_ptr<Twin>>& v, size_t bytes) {
  v.push_back(std::make_unique<Twin>(bytes));
  return *v.back();
}

void FillBf16Weights(Twin& t, uint32_t seed) {  // ~N(0, 0.02) from a 64 Ki pool, some all-zero groups
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<uint16_t> pool(1 << 16);
  for (auto& x : pool) x = F32ToBF16(dist(rng));
  auto* p = reinterpret_cast<uint16_t*>(t.host.data());
  const size_t n = t.bytes() / 2;
  for (size_t i = 0; i < n; ++i) p[i] = pool[(i * 2654435761u) & 0xFFFF];
  for (size_t i = 0; i < std::min<size_t>(n, 256); ++i) p[i] = 0;
}

void FillRandomWords(Twin& t, uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto& w : t.host) w = rng();
}

TensorView In(std::span<std::byte> s, DType dt, Shape shape) { return TensorView(dt, std::move(shape), s); }
MutableTensorView Out(std::span<std::byte> s, DType dt, Shape shape) {
  return MutableTensorView(dt, std::move(shape), s);
}

using Spans = std::vector<std::span<std::byte>>;

// Symmetric quantize (compressed-tensors or GPTQ orientation) of bf16 W[N, 4096], G = 128, qat.
Case Quantize(const char* name, kernels::PackFormat format, int64_t bytes) {
  const int64_t k = 4096, n = std::max<int64_t>(64, bytes / (2 * k) / 64 * 64);
  Case c{name, n * k * 2};
  FillBf16Weights(AddBuffer(c.in, c.bytes), 1);
  AddBuffer(c.out, n * k / 2);
  AddBuffer(c.out, n * k / 128 * 2);
  const bool gptq = format == kernels::PackFormat::kGptq;
  c.call = [=](kernels::Device d, Spans& i, Spans& o) {
    kernels::QuantizeOptions opt;
    opt.device = d;
    opt.format = format;
    return kernels::QuantizeInt4(In(i[0], DType::kBF16, {n, k}),
                                 Out(o[0], DType::kI32, gptq ? Shape{k / 8, n} : Shape{n, k / 8}),
                                 Out(o[1], DType::kBF16, gptq ? Shape{k / 128, n} : Shape{n, k / 128}), opt);
  };
  return c;
}

// GPTQ -> Marlin (restore: Marlin -> GPTQ) of int32 [K/8, 4096], with or without an act-order perm.
Case Repack(const char* name, bool restore, bool with_perm, int64_t bytes) {
  const int64_t n = 4096, k = std::max<int64_t>(16, bytes / (4 * n) * 8 / 16 * 16);
  Case c{name, k / 8 * n * 4};
  FillRandomWords(AddBuffer(c.in, c.bytes), 2);
  Twin& perm = AddBuffer(c.in, k * 4);
  std::iota(perm.host.begin(), perm.host.end(), 0u);
  std::shuffle(perm.host.begin(), perm.host.end(), std::mt19937(3));
  AddBuffer(c.out, c.bytes);
  c.call = [=](kernels::Device d, Spans& i, Spans& o) {
    kernels::KernelOptions opt;
    opt.device = d;
    const TensorView pv = In(i[1], DType::kI32, {k});
    const TensorView* pp = with_perm ? &pv : nullptr;
    return restore ? kernels::MarlinToGptq(In(i[0], DType::kI32, {k / 16, 2 * n}), pp,
                                           Out(o[0], DType::kI32, {k / 8, n}), opt)
                   : kernels::GptqToMarlin(In(i[0], DType::kI32, {k / 8, n}), pp,
                                           Out(o[0], DType::kI32, {k / 16, 2 * n}), opt);
  };
  return c;
}

// Marlin scale permutation of bf16 [rows, 4096] (grouped, G = 128).
Case ScalePerm(int64_t bytes) {
  const int64_t n = 4096, rows = std::max<int64_t>(1, bytes / (2 * n));
  Case c{"scale-perm", rows * n * 2};
  FillRandomWords(AddBuffer(c.in, c.bytes), 4);
  AddBuffer(c.out, c.bytes);
  c.call = [=](kernels::Device d, Spans& i, Spans& o) {
    kernels::KernelOptions opt;
    opt.device = d;
    return kernels::PermuteMarlinScales(In(i[0], DType::kBF16, {rows, n}), rows * 128, 128,
                                        Out(o[0], DType::kBF16, {rows, n}), opt);
  };
  return c;
}

// AWQ quantize of bf16 W[N, 4096], G = 128: qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N].
Case AwqQuantize(const char* name, kernels::AwqArith arith, int64_t bytes) {
  const int64_t k = 4096, n = std::max<int64_t>(128, bytes / (2 * k) / 128 * 128);
  Case c{name, n * k * 2};
  FillBf16Weights(AddBuffer(c.in, c.bytes), 5);
  AddBuffer(c.out, n * k / 2);
  AddBuffer(c.out, n * k / 128 / 2);
  AddBuffer(c.out, n * k / 128 * 2);
  c.call = [=](kernels::Device d, Spans& i, Spans& o) {
    kernels::AwqQuantizeOptions opt;
    opt.device = d;
    opt.arith = arith;
    return kernels::QuantizeAwq(In(i[0], DType::kBF16, {n, k}), Out(o[0], DType::kI32, {k, n / 8}),
                                Out(o[1], DType::kI32, {k / 128, n / 8}), Out(o[2], DType::kBF16, {k / 128, n}), opt);
  };
  return c;
}

// AWQ qweight [K, 512] -> Marlin, and TensorRT-LLM sm80 preprocessing of codes [K/8, 4096].
Case Layout(const char* name, bool trtllm, int64_t bytes) {
  const int64_t n = 4096, k = std::max<int64_t>(64, bytes / (n / 2) / 64 * 64);
  Case c{name, k * n / 2};
  FillRandomWords(AddBuffer(c.in, c.bytes), 6);
  AddBuffer(c.out, c.bytes);
  c.call = [=](kernels::Device d, Spans& i, Spans& o) {
    kernels::TrtllmOptions opt;
    opt.device = d;
    return trtllm
               ? kernels::PreprocessTrtllm(In(i[0], DType::kI32, {1, k / 8, n}), Out(o[0], DType::kI8, {1, k, n / 2}),
                                           opt)
               : kernels::AwqToMarlin(In(i[0], DType::kI32, {k, n / 8}), Out(o[0], DType::kI32, {k / 16, 2 * n}), opt);
  };
  return c;
}

void RunCase(Case c, const Flags& f) {
  for (auto& t : c.in) t->Upload();
  Spans din, dout, hin, hout;
  for (auto& t : c.in) din.push_back(t->span(kernels::Device::kCuda)), hin.push_back(t->span(kernels::Device::kCpu));
  for (auto& t : c.out) dout.push_back(t->span(kernels::Device::kCuda)), hout.push_back(t->span(kernels::Device::kCpu));
  auto run = [&] { Die(c.call(kernels::Device::kCuda, din, dout)); };
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = bench::BestSeconds(run, f.iters);
  void* copy = nullptr;
  CudaOk(cudaMalloc(&copy, c.bytes), "cudaMalloc");
  auto memcpy_d2d = [&] {
    CudaOk(cudaMemcpy(copy, c.in[0]->dev, c.bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    CudaOk(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  };
  for (int i = 0; i < f.warmup; ++i) memcpy_d2d();
  const double tm = bench::BestSeconds(memcpy_d2d, f.iters);
  cudaFree(copy);
  long long wrong = -1;
  if (f.check) {
    Die(c.call(kernels::Device::kCpu, hin, hout));
    wrong = 0;
    for (auto& t : c.out) wrong += t->WrongWords();
  }
  const double gbs = c.bytes / t / 1e9, mgbs = c.bytes / tm / 1e9;
  std::printf("%-16s %12lld %12.1f %9.1f %9.1f %7.3f %8lld\n", c.name, static_cast<long long>(c.bytes), t * 1e6, gbs,
              mgbs, gbs / mgbs, wrong);
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{"wsync-bench-kernels-gpu: CUDA INT4 kernel throughput vs a device-to-device copy, checked against CPU"};
  bench::AddSweepFlags(app, f, "compare every output with the CPU kernel's (1) or not (0)");
  CLI11_PARSE(app, argc, argv);
  if (!kernels::GpuAvailable()) {
    std::printf("# wsync-bench-kernels-gpu: no CUDA device on this machine; nothing to measure\n");
    return 0;
  }
  auto want = [&](const char* k) { return f.Wants(k); };
  cudaDeviceProp prop{};
  CudaOk(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::printf("# wsync-bench-kernels-gpu  device=%s sm_%d%d  SMs=%d  runtime=%d driver=%d  iters=%d warmup=%d\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, runtime, driver, f.iters, f.warmup);
  std::printf(
      "# shapes as wsync-bench-kernels; size = input bytes; time = best of -n (launch + synchronize); d2d = "
      "cudaMemcpy D2D of the input bytes; #wrong = output words != CPU kernel\n");
  std::printf("#%-15s %12s %12s %9s %9s %7s %8s\n", "kernel", "size(B)", "time(us)", "GB/s", "d2d", "ratio", "#wrong");
  bench::ForEachSize(f, [&](int64_t bytes) {
    if (want("quantize-ct")) RunCase(Quantize("quantize-ct", kernels::PackFormat::kCompressedTensors, bytes), f);
    if (want("quantize-gptq")) RunCase(Quantize("quantize-gptq", kernels::PackFormat::kGptq, bytes), f);
    if (want("repack")) RunCase(Repack("repack", false, false, bytes), f);
    if (want("repack-perm")) RunCase(Repack("repack-perm", false, true, bytes), f);
    if (want("restore")) RunCase(Repack("restore", true, false, bytes), f);
    if (want("restore-perm")) RunCase(Repack("restore-perm", true, true, bytes), f);
    if (want("scale-perm")) RunCase(ScalePerm(bytes), f);
    if (want("awq-quantize-fp16")) RunCase(AwqQuantize("awq-quant-fp16", kernels::AwqArith::kFp16, bytes), f);
    if (want("awq-quantize-fp32")) RunCase(AwqQuantize("awq-quant-fp32", kernels::AwqArith::kFp32, bytes), f);
    if (want("awq-marlin")) RunCase(Layout("awq-marlin", false, bytes), f);
    if (want("trtllm-sm80")) RunCase(Layout("trtllm-sm80", true, bytes), f);
  });
  return 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) { return wsync::Main(argc, argv); }
