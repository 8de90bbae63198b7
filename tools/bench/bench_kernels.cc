// wsync-bench-kernels: throughput of the CPU INT4 and FP8 kernels against memcpy of the same bytes,
// nccl-tests style. For every kernel and input size it reports the time per call, the bandwidth
// on the kernel's input bytes, the memcpy bandwidth of the same byte count with the same thread
// count measured in the same run (both as the best of -n iterations), their ratio, and #wrong from a checked iteration
// (quantize: words differing from a scalar recomputation of the first rows; repack: words differing after restore;
// scale perm: inverse round trip).
//
//   wsync-bench-kernels [-b 16M] [-e 256M] [-f 2] [-n 5] [-w 1] [-c 1] [-t threads] [-k kernel]
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
#include "comm/bucket/bucket_mac.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/tensor.h"
#include "common/units.h"
#include "kernels/awq.h"
#include "kernels/checksum.h"
#include "kernels/cpu/int4_cpu.h"
#include "kernels/delta.h"
#include "kernels/format/awq_format.h"
#include "kernels/format/fp8_format.h"
#include "kernels/format/int4_format.h"
#include "kernels/format/sum64.h"
#include "kernels/fp8.h"
#include "kernels/int4.h"
#include "kernels/trtllm.h"
#include "tools/bench/kernel_sweep.h"

namespace wsync {
namespace {

namespace fmt = kernels::format;

using bench::Die;

struct Flags : bench::SweepFlags {
  int threads = 0;
};

double Seconds(const std::function<void()>& fn, int iters) { return bench::BestSeconds(fn, iters); }

// memcpy split over `threads` threads, as the kernels split their work.
void ParallelMemcpy(std::byte* dst, const std::byte* src, size_t n, int threads) {
  if (threads <= 1) {
    std::memcpy(dst, src, n);
    return;
  }
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    const size_t b = n * i / threads, e = n * (i + 1) / threads;
    pool.emplace_back([=] { std::memcpy(dst + b, src + b, e - b); });
  }
  for (auto& t : pool) t.join();
}

Buffer MustAlloc(size_t n) {
  auto b = Buffer::Allocate(n);
  if (!b.ok()) {
    std::fprintf(stderr, "allocation of %zu bytes failed: %s\n", n, b.status().ToString().c_str());
    std::exit(1);
  }
  std::memset(b->data(), 0, n);  // touch every page before timing
  return std::move(b).value();
}

struct Row {
  const char* kernel;
  int threads;
  int64_t bytes;
  double seconds;
  double memcpy_seconds;
  int64_t wrong;
};

void Print(const Row& r) {
  const double gbs = r.bytes / r.seconds / 1e9, mgbs = r.bytes / r.memcpy_seconds / 1e9;
  std::printf("%-16s %4d %12lld %12.1f %9.2f %9.2f %7.2f %8lld\n", r.kernel, r.threads, static_cast<long long>(r.bytes),
              r.seconds * 1e6, gbs, mgbs, gbs / mgbs, static_cast<long long>(r.wrong));
}

// `count` bf16 weights ~ N(0, 0.02), drawn from a pool of 64 Ki values (filling GiBs with one
// normal draw each would dominate the benchmark's set-up).
Buffer RandomBf16Weights(int64_t count, uint32_t seed) {
  Buffer w = MustAlloc(static_cast<size_t>(count * 2));
  auto* wp = reinterpret_cast<uint16_t*>(w.data());
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<uint16_t> pool(1 << 16);
  for (auto& x : pool) x = F32ToBF16(dist(rng));
  for (int64_t i = 0; i < count; ++i) wp[i] = pool[(i * 2654435761u) & 0xFFFF];
  return w;
}

// Quantize: W bf16 [N, 4096], G = 128, qat; `format` selects the output orientation.
// `digest`: with a QuantizeReuse that has nothing to reuse (a delta sync's first, or one where every
// group changed): the cost of the digests on top of the quantization.
Row BenchQuantize(const char* name, kernels::PackFormat format, int64_t bytes, int threads, const Flags& f,
                  bool digest = false) {
  const int64_t k = 4096, n = std::max<int64_t>(64, bytes / (2 * k) / 64 * 64);
  bytes = n * k * 2;
  Buffer w = RandomBf16Weights(n * k, 1);
  auto* wp = reinterpret_cast<uint16_t*>(w.data());
  Buffer packed = MustAlloc(static_cast<size_t>(n * k / 2));
  Buffer scales = MustAlloc(static_cast<size_t>(n * k / 128 * 2));
  Buffer copy = MustAlloc(static_cast<size_t>(bytes));
  const TensorView wv(DType::kBF16, {n, k}, w.span());
  const bool gptq = format == kernels::PackFormat::kGptq;
  const MutableTensorView pv(DType::kI32, gptq ? Shape{k / 8, n} : Shape{n, k / 8}, packed.span());
  const MutableTensorView sv(DType::kBF16, gptq ? Shape{k / 128, n} : Shape{n, k / 128}, scales.span());
  kernels::QuantizeOptions opt;
  opt.num_threads = threads;
  opt.format = format;
  std::vector<uint64_t> digests(digest ? static_cast<size_t>(n * k / 128) : 0);
  auto run = [&] {
    kernels::QuantizeReuse reuse{.next_digests = digests};
    Die(digest ? kernels::QuantizeInt4(wv, pv, sv, opt, reuse) : kernels::QuantizeInt4(wv, pv, sv, opt));
  };
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = Seconds(run, f.iters);
  for (int i = 0; i < f.warmup; ++i) ParallelMemcpy(copy.data(), w.data(), bytes, threads);
  const double tm = Seconds([&] { ParallelMemcpy(copy.data(), w.data(), bytes, threads); }, f.iters);
  int64_t wrong = 0;
  if (f.check) {  // scalar recomputation of the first 64 rows
    const auto* pw = reinterpret_cast<const uint32_t*>(packed.data());
    for (int64_t r = 0; r < 64; ++r) {
      for (int64_t g = 0; g < k / 128; ++g) {
        float amax = 0;
        for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(BF16ToF32(wp[r * k + g * 128 + i])));
        const float s = fmt::GroupScale(amax, fmt::Variant::kQat);
        for (int j = 0; j < 16; ++j) {
          uint32_t word = 0;
          for (int i = 0; i < 8; ++i)
            word |= fmt::QuantizeNibble(BF16ToF32(wp[r * k + g * 128 + 8 * j + i]), s) << (4 * i);
          const int64_t jj = g * 16 + j;
          wrong += (gptq ? pw[jj * n + r] : pw[r * (k / 8) + jj]) != word;
        }
      }
    }
  }
  return Row{name, threads, bytes, t, tm, wrong};
}

// Repack (and restore): GPTQ qweight int32 [K/8, 4096] of `bytes` bytes.
Row BenchRepack(const char* name, bool restore, bool with_perm, int64_t bytes, int threads, const Flags& f) {
  const int64_t n = 4096, k = std::max<int64_t>(16, bytes / (4 * n) * 8 / 16 * 16);
  bytes = k / 8 * n * 4;
  Buffer q = MustAlloc(static_cast<size_t>(bytes)), m = MustAlloc(static_cast<size_t>(bytes));
  Buffer back = MustAlloc(static_cast<size_t>(bytes)), copy = MustAlloc(static_cast<size_t>(bytes));
  auto* qp = reinterpret_cast<uint32_t*>(q.data());
  std::mt19937 rng(2);
  for (int64_t i = 0; i < bytes / 4; ++i) qp[i] = rng();
  std::vector<int32_t> perm(static_cast<size_t>(k));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const TensorView pv(DType::kI32, {k}, std::as_bytes(std::span(perm)));
  const TensorView* pp = with_perm ? &pv : nullptr;
  const TensorView gv(DType::kI32, {k / 8, n}, q.span());
  const MutableTensorView mv(DType::kI32, {k / 16, 2 * n}, m.span());
  const MutableTensorView bv(DType::kI32, {k / 8, n}, back.span());
  kernels::KernelOptions opt;
  opt.num_threads = threads;
  Die(kernels::GptqToMarlin(gv, pp, mv, opt));
  auto run = [&] { Die(restore ? kernels::MarlinToGptq(mv, pp, bv, opt) : kernels::GptqToMarlin(gv, pp, mv, opt)); };
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = Seconds(run, f.iters);
  for (int i = 0; i < f.warmup; ++i) ParallelMemcpy(copy.data(), q.data(), bytes, threads);
  const double tm = Seconds([&] { ParallelMemcpy(copy.data(), q.data(), bytes, threads); }, f.iters);
  int64_t wrong = 0;
  if (f.check) {
    if (!restore) Die(kernels::MarlinToGptq(mv, pp, bv, opt));
    const auto* bp = reinterpret_cast<const uint32_t*>(back.data());
    for (int64_t i = 0; i < bytes / 4; ++i) wrong += bp[i] != qp[i];
  }
  return Row{name, threads, bytes, t, tm, wrong};
}

// Scale permutation of bf16 [rows, 4096] (grouped).
Row BenchScales(int64_t bytes, int threads, const Flags& f) {
  const int64_t n = 4096, rows = std::max<int64_t>(1, bytes / (2 * n));
  bytes = rows * n * 2;
  Buffer s = MustAlloc(static_cast<size_t>(bytes)), o = MustAlloc(static_cast<size_t>(bytes));
  Buffer back = MustAlloc(static_cast<size_t>(bytes)), copy = MustAlloc(static_cast<size_t>(bytes));
  std::mt19937 rng(3);
  auto* sp = reinterpret_cast<uint16_t*>(s.data());
  for (int64_t i = 0; i < bytes / 2; ++i) sp[i] = static_cast<uint16_t>(rng());
  const TensorView sv(DType::kBF16, {rows, n}, s.span());
  const MutableTensorView ov(DType::kBF16, {rows, n}, o.span());
  kernels::KernelOptions opt;
  opt.num_threads = threads;
  const int64_t size_k = rows * 128;
  auto run = [&] { Die(kernels::PermuteMarlinScales(sv, size_k, 128, ov, opt)); };
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = Seconds(run, f.iters);
  const double tm = Seconds([&] { ParallelMemcpy(copy.data(), s.data(), bytes, threads); }, f.iters);
  int64_t wrong = 0;
  if (f.check) {
    Die(kernels::UnpermuteMarlinScales(ov, size_k, 128, MutableTensorView(DType::kBF16, {rows, n}, back.span()), opt));
    wrong = std::memcmp(back.data(), s.data(), bytes) != 0;
  }
  return Row{"scale-perm", threads, bytes, t, tm, wrong};
}

// A bucket's integrity and authentication on one thread, as BucketSender / BucketReceiver run them
// (once per bucket, sequentially): XXH3-64 (common/checksum.h), the GMAC tag (bucket_mac.h), or
// Sum64 on the host (kernels/checksum.h; the device buckets' checksum, here on the CPU).
// #wrong: XXH3 differs from the incremental hash over two halves; the tag does not verify; Sum64
// differs from its terms added in reverse order.
enum class BucketHash { kXxh3, kMac, kSum64 };
Row BenchBucketHash(const char* name, BucketHash kind, int64_t bytes, const Flags& f) {
  const bool mac = kind == BucketHash::kMac;
  Buffer d = MustAlloc(static_cast<size_t>(bytes)), copy = MustAlloc(static_cast<size_t>(bytes));
  std::mt19937_64 rng(5);
  for (int64_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(d.data() + i, &v, 8);
  }
  const std::span<const std::byte> data{d.data(), static_cast<size_t>(bytes)};
  const std::string manifest(512, 'm');
  auto m = comm::BucketMac::ForStream(std::string(comm::kBucketMacKeyBytes, 'k'), "bench/pp0");
  Die(m.status());
  comm::BucketTag tag{};
  uint64_t sum = 0;
  auto run = [&] {
    if (mac) {
      auto t = m->Tag(0, manifest, data);
      Die(t.status());
      tag = *t;
    } else if (kind == BucketHash::kSum64) {
      sum = kernels::Sum64Host(data);
    } else {
      sum = Xxh3_64(data);
    }
  };
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = Seconds(run, f.iters);
  const double tm = Seconds([&] { ParallelMemcpy(copy.data(), d.data(), bytes, 1); }, f.iters);
  int64_t wrong = 0;
  if (f.check) {
    run();
    if (mac) {
      auto ok = m->Verify(0, manifest, data, tag);
      wrong = !ok.ok() || !*ok;
    } else if (kind == BucketHash::kSum64) {
      const auto* p = reinterpret_cast<const unsigned char*>(data.data());
      uint64_t s = 0;
      for (uint64_t i = (data.size() + 7) / 8; i-- > 0;)
        s += kernels::format::Sum64Term(kernels::format::Sum64WordAt(p, data.size(), i), i);
      wrong = kernels::format::Sum64Final(s, data.size()) != sum;
    } else {
      Xxh3Stream stream;
      stream.Update(data.first(data.size() / 2));
      stream.Update(data.subspan(data.size() / 2));
      wrong = stream.Digest() != sum;
    }
  }
  return Row{name, 1, bytes, t, tm, wrong};
}

// A delta sync's per-tensor work on one thread (kernels/delta.h), for a bf16 tensor whose items
// changed with probability `fraction`:
//   kPlan     PlanDelta + WriteDelta (the sender's two passes over base and new: 4x the size read);
//   kApply    ApplyDelta of that payload onto a copy of the base (the receiver, unchecked);
//   kResum    kApply plus the Sum64 of the whole result (a receiver checking it by reading it all);
//   kChecked  ApplyDeltaChecked: the result's Sum64 from the base's over the changed words, then
//             the writes (the receiver, as engine_model::Loader::LoadDelta runs it), alternately
//             base -> new and new -> base so every run has work.
// size = the tensor's bytes. #wrong: the applied base is not the new one.
enum class DeltaWork { kPlan, kApply, kResum, kChecked };
Row BenchDelta(const char* name, DeltaWork work, double fraction, int64_t bytes, const Flags& f) {
  const size_t n = static_cast<size_t>(bytes);
  std::vector<uint8_t> base(n), next(n), payload, target(n), copy(n);
  std::mt19937_64 rng(9);
  for (auto& b : base) b = static_cast<uint8_t>(rng());
  next = base;
  std::bernoulli_distribution changed(fraction);
  for (size_t i = 0; i + 2 <= n; i += 2)
    if (changed(rng)) next[i] ^= 1;
  auto plan = kernels::PlanDelta(base, next, 2);
  Die(plan.status());
  payload.resize(plan->payload_bytes);
  Die(kernels::WriteDelta(*plan, base, next, payload));
  // The reverse payload (new -> base) for kChecked's alternate runs, and the sums of both versions.
  auto back_plan = kernels::PlanDelta(next, base, 2);
  Die(back_plan.status());
  std::vector<uint8_t> back(back_plan->payload_bytes);
  Die(kernels::WriteDelta(*back_plan, next, base, back));
  const uint64_t base_sum = kernels::Sum64Host(std::as_bytes(std::span(base)));
  const uint64_t next_sum = kernels::Sum64Host(std::as_bytes(std::span(next)));
  const kernels::DeltaBlock whole{1, n / 2, 0, 1, 0, n / 2};
  bool forward = true;
  auto run = [&] {
    switch (work) {
      case DeltaWork::kPlan: {
        auto p = kernels::PlanDelta(base, next, 2);
        Die(p.status());
        Die(kernels::WriteDelta(*p, base, next, payload));
        break;
      }
      case DeltaWork::kApply: Die(kernels::ApplyDelta("bench", plan->encoding, 2, payload, target)); break;
      case DeltaWork::kResum:
        Die(kernels::ApplyDelta("bench", plan->encoding, 2, payload, target));
        if (kernels::Sum64Host(std::as_bytes(std::span(target))) != next_sum)
          Die(absl::DataLossError("delta-resum: the result is not the new version"));
        break;
      case DeltaWork::kChecked:
        Die(forward ? kernels::ApplyDeltaChecked("bench", plan->encoding, 2, payload, whole, {target.data(), n / 2, 1},
                                                 base_sum, next_sum)
                    : kernels::ApplyDeltaChecked("bench", back_plan->encoding, 2, back, whole,
                                                 {target.data(), n / 2, 1}, next_sum, base_sum));
        forward = !forward;
        break;
    }
  };
  target = base;
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = Seconds(run, f.iters);
  const double tm = Seconds(
      [&] {
        ParallelMemcpy(reinterpret_cast<std::byte*>(copy.data()), reinterpret_cast<const std::byte*>(base.data()),
                       bytes, 1);
      },
      f.iters);
  int64_t wrong = 0;
  if (f.check) {
    target = base;
    if (work == DeltaWork::kChecked) {
      Die(kernels::ApplyDeltaChecked("bench", plan->encoding, 2, payload, whole, {target.data(), n / 2, 1}, base_sum,
                                     next_sum));
    } else {
      Die(kernels::ApplyDelta("bench", plan->encoding, 2, payload, target));
    }
    wrong += target != next;
  }
  return Row{name, 1, bytes, t, tm, wrong};
}

// AWQ quantize: W bf16 [N, 4096], G = 128, fp16 (AutoAWQ) or fp32 arithmetic -> qweight [K, N/8].
Row BenchAwqQuantize(const char* name, kernels::AwqArith arith, int64_t bytes, int threads, const Flags& f) {
  const int64_t k = 4096, n = std::max<int64_t>(128, bytes / (2 * k) / 128 * 128);
  bytes = n * k * 2;
  Buffer w = RandomBf16Weights(n * k, 4);
  auto* wp = reinterpret_cast<uint16_t*>(w.data());
  Buffer qw = MustAlloc(static_cast<size_t>(n * k / 2)), qz = MustAlloc(static_cast<size_t>(n * k / 128 / 2));
  Buffer sc = MustAlloc(static_cast<size_t>(n * k / 128 * 2)), copy = MustAlloc(static_cast<size_t>(bytes));
  const TensorView wv(DType::kBF16, {n, k}, w.span());
  const MutableTensorView qv(DType::kI32, {k, n / 8}, qw.span()), zv(DType::kI32, {k / 128, n / 8}, qz.span());
  const MutableTensorView sv(DType::kBF16, {k / 128, n}, sc.span());
  kernels::AwqQuantizeOptions opt;
  opt.num_threads = threads;
  opt.arith = arith;
  auto run = [&] { Die(kernels::QuantizeAwq(wv, qv, zv, sv, opt)); };
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = Seconds(run, f.iters);
  for (int i = 0; i < f.warmup; ++i) ParallelMemcpy(copy.data(), w.data(), bytes, threads);
  const double tm = Seconds([&] { ParallelMemcpy(copy.data(), w.data(), bytes, threads); }, f.iters);
  int64_t wrong = 0;
  if (f.check) {  // scalar recomputation of the codes of the first 8 rows (word column 0) through format/
    const auto* q = reinterpret_cast<const uint32_t*>(qw.data());
    const auto fa = arith == kernels::AwqArith::kFp16 ? fmt::AwqArith::kFp16 : fmt::AwqArith::kFp32;
    for (int64_t g = 0; g < k / 128; ++g) {
      fmt::AwqGroup p[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t row = fmt::AwqOrder(i);
        float mx = -1e30f, mn = 1e30f;
        for (int j = 0; j < 128; ++j) {
          const float v = BF16ToF32(wp[row * k + g * 128 + j]);
          mx = std::max(mx, v), mn = std::min(mn, v);
        }
        if (fa == fmt::AwqArith::kFp16) mx = fmt::RoundToF16(mx), mn = fmt::RoundToF16(mn);
        p[i] = fmt::AwqGroupParams(mx, mn, fa);
      }
      for (int j = 0; j < 128; ++j) {
        uint32_t word = 0;
        for (int i = 0; i < 8; ++i) {
          float v = BF16ToF32(wp[fmt::AwqOrder(i) * k + g * 128 + j]);
          if (fa == fmt::AwqArith::kFp16) v = fmt::RoundToF16(v);
          word |= fmt::AwqCode(v, p[i], fa) << (4 * i);
        }
        wrong += q[(g * 128 + j) * (n / 8)] != word;
      }
    }
  }
  return Row{name, threads, bytes, t, tm, wrong};
}

// AWQ -> Marlin (qweight int32 [K, 4096/8]) and TensorRT-LLM preprocessing (codes [K/8, 4096],
// sm80 W4A16 MoE layout); #wrong from the exact inverse (TRT) or GptqToMarlin of AwqToGptq (AWQ).
Row BenchLayout(const char* name, bool trtllm, int64_t bytes, int threads, const Flags& f) {
  const int64_t n = 4096, k = std::max<int64_t>(64, bytes / (n / 2) / 64 * 64);
  bytes = k * n / 2;
  Buffer in = MustAlloc(static_cast<size_t>(bytes)), out = MustAlloc(static_cast<size_t>(bytes));
  Buffer back = MustAlloc(static_cast<size_t>(bytes)), copy = MustAlloc(static_cast<size_t>(bytes));
  auto* ip = reinterpret_cast<uint32_t*>(in.data());
  std::mt19937 rng(5);
  for (int64_t i = 0; i < bytes / 4; ++i) ip[i] = rng();
  kernels::TrtllmOptions opt;
  opt.num_threads = threads;
  const TensorView awq(DType::kI32, {k, n / 8}, in.span()), codes(DType::kI32, {1, k / 8, n}, in.span());
  const MutableTensorView marlin(DType::kI32, {k / 16, 2 * n}, out.span());
  const MutableTensorView trt(DType::kI8, {1, k, n / 2}, out.span());
  auto run = [&] { Die(trtllm ? kernels::PreprocessTrtllm(codes, trt, opt) : kernels::AwqToMarlin(awq, marlin, opt)); };
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = Seconds(run, f.iters);
  for (int i = 0; i < f.warmup; ++i) ParallelMemcpy(copy.data(), in.data(), bytes, threads);
  const double tm = Seconds([&] { ParallelMemcpy(copy.data(), in.data(), bytes, threads); }, f.iters);
  int64_t wrong = 0;
  if (f.check) {
    const auto* bp = reinterpret_cast<const uint32_t*>(back.data());
    const auto* op = reinterpret_cast<const uint32_t*>(out.data());
    if (trtllm) {
      Die(kernels::UnpreprocessTrtllm(TensorView(DType::kI8, {1, k, n / 2}, out.span()),
                                      MutableTensorView(DType::kI32, {1, k / 8, n}, back.span()), opt));
      for (int64_t i = 0; i < bytes / 4; ++i) wrong += bp[i] != ip[i];
    } else {
      Die(kernels::AwqToGptq(awq, MutableTensorView(DType::kI32, {k / 8, n}, back.span()), opt));
      Die(kernels::GptqToMarlin(TensorView(DType::kI32, {k / 8, n}, back.span()), nullptr,
                                MutableTensorView(DType::kI32, {k / 16, 2 * n}, copy.span()), opt));
      const auto* cp = reinterpret_cast<const uint32_t*>(copy.data());
      for (int64_t i = 0; i < bytes / 4; ++i) wrong += cp[i] != op[i];
    }
  }
  return Row{name, threads, bytes, t, tm, wrong};
}

// FP8: W bf16 [N, 4096] -> E4M3 codes, block-wise (128 x 128, slime) or per channel (slime). #wrong:
// codes of the first 64 rows differing from a scalar recomputation through the format helpers.
Row BenchFp8(const char* name, bool block, int64_t bytes, int threads, const Flags& f, bool digest = false) {
  const int64_t k = 4096, n = std::max<int64_t>(128, bytes / (2 * k) / 128 * 128);
  bytes = n * k * 2;
  Buffer w = RandomBf16Weights(n * k, 3);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data());
  Buffer q = MustAlloc(static_cast<size_t>(n * k));
  Buffer scales = MustAlloc(static_cast<size_t>(block ? (n / 128) * (k / 128) * 4 : n * 4));
  Buffer copy = MustAlloc(static_cast<size_t>(bytes));
  const TensorView wv(DType::kBF16, {n, k}, w.span());
  const MutableTensorView qv(DType::kF8E4M3, {n, k}, q.span());
  const MutableTensorView sv(DType::kF32, block ? Shape{n / 128, k / 128} : Shape{n, 1}, scales.span());
  kernels::Fp8BlockOptions bo;
  bo.num_threads = threads;
  kernels::Fp8ChannelOptions co;
  co.num_threads = threads;
  std::vector<uint64_t> digests(digest ? static_cast<size_t>(sv.nbytes() / 4) : 0);  // as BenchQuantize's
  auto run = [&] {
    kernels::QuantizeReuse reuse{.next_digests = digests};
    if (digest)
      Die(block ? kernels::QuantizeFp8Block(wv, qv, sv, bo, reuse)
                : kernels::QuantizeFp8Channel(wv, qv, sv, co, reuse));
    else
      Die(block ? kernels::QuantizeFp8Block(wv, qv, sv, bo) : kernels::QuantizeFp8Channel(wv, qv, sv, co));
  };
  for (int i = 0; i < f.warmup; ++i) run();
  const double t = Seconds(run, f.iters);
  for (int i = 0; i < f.warmup; ++i) ParallelMemcpy(copy.data(), w.data(), bytes, threads);
  const double tm = Seconds([&] { ParallelMemcpy(copy.data(), w.data(), bytes, threads); }, f.iters);
  int64_t wrong = 0;
  if (f.check) {
    const auto* qp = reinterpret_cast<const uint8_t*>(q.data());
    const auto* sp = reinterpret_cast<const float*>(scales.data());
    for (int64_t r = 0; r < 64; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const float x = BF16ToF32(wp[r * k + c]);
        const uint8_t want =
            block ? fmt::QuantizeBlockElement(x, fmt::BlockMultiplier(sp[(r / 128) * (k / 128) + c / 128]))
                  : fmt::QuantizeChannelElementSlime(x, sp[r]);
        wrong += qp[r * k + c] != want;
      }
    }
  }
  return Row{name, threads, bytes, t, tm, wrong};
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{"wsync-bench-kernels: CPU INT4 kernel throughput vs memcpy"};
  bench::AddSweepFlags(app, f, "check results (1) or not (0)");
  app.add_option("-t,--threads", f.threads, "threads for the 'all' rows (0 = hardware_concurrency)");
  CLI11_PARSE(app, argc, argv);
  const int all = f.threads > 0 ? f.threads : std::max(1u, std::thread::hardware_concurrency());
  auto want = [&](const char* k) { return f.Wants(k); };
  std::printf("# wsync-bench-kernels  simd=%s  hardware threads=%u  iters=%d warmup=%d\n",
              kernels::cpu::SimdTargetName(), std::thread::hardware_concurrency(), f.iters, f.warmup);
  std::printf(
      "# quantize: bf16 W[N, 4096] G=128 qat; repack: int32 GPTQ [K/8, 4096]; awq-quant: bf16 W[N, 4096] G=128;"
      " awq-marlin: AWQ qweight [K, 512]; trtllm-sm80: codes [K/8, 4096]; fp8-block / fp8-channel: bf16 W[N, 4096]"
      " -> E4M3 (128 x 128 blocks / rows, slime); -dig: with a digest per group, block or row (delta sync,"
      " nothing to reuse); xxh3, sum64, bucket-mac: one bucket's "
      "checksum /"
      " GMAC tag; delta-plan / delta-apply: a bf16 tensor with 1%% of its items changed, encoded / applied"
      " (-resum: then summed whole; -checked: in place, its sum updated over the changed words; also at 0.1%%);"
      " size = input bytes; time = best of -n\n");
  std::printf("#%-15s %4s %12s %12s %9s %9s %7s %8s\n", "kernel", "thr", "size(B)", "time(us)", "GB/s", "memcpy",
              "ratio", "#wrong");
  std::vector<int> thread_counts = {1};
  if (all > 1) thread_counts.push_back(all);
  bench::ForEachSize(f, [&](int64_t bytes) {
    for (int t : thread_counts) {
      if (want("quantize-ct"))
        Print(BenchQuantize("quantize-ct", kernels::PackFormat::kCompressedTensors, bytes, t, f));
      if (want("quantize-ct-digest"))
        Print(BenchQuantize("quantize-ct-dig", kernels::PackFormat::kCompressedTensors, bytes, t, f, true));
      if (want("quantize-gptq")) Print(BenchQuantize("quantize-gptq", kernels::PackFormat::kGptq, bytes, t, f));
      if (want("repack")) Print(BenchRepack("repack", false, false, bytes, t, f));
      if (want("repack-perm")) Print(BenchRepack("repack-perm", false, true, bytes, t, f));
      if (want("restore")) Print(BenchRepack("restore", true, false, bytes, t, f));
      if (want("restore-perm")) Print(BenchRepack("restore-perm", true, true, bytes, t, f));
      if (want("scale-perm")) Print(BenchScales(bytes, t, f));
      if (want("awq-quantize-fp16")) Print(BenchAwqQuantize("awq-quant-fp16", kernels::AwqArith::kFp16, bytes, t, f));
      if (want("awq-quantize-fp32")) Print(BenchAwqQuantize("awq-quant-fp32", kernels::AwqArith::kFp32, bytes, t, f));
      if (want("awq-marlin")) Print(BenchLayout("awq-marlin", false, bytes, t, f));
      if (want("trtllm-sm80")) Print(BenchLayout("trtllm-sm80", true, bytes, t, f));
      if (want("fp8-block")) Print(BenchFp8("fp8-block", true, bytes, t, f));
      if (want("fp8-block-digest")) Print(BenchFp8("fp8-block-dig", true, bytes, t, f, true));
      if (want("fp8-channel")) Print(BenchFp8("fp8-channel", false, bytes, t, f));
      if (want("fp8-channel-digest")) Print(BenchFp8("fp8-channel-dig", false, bytes, t, f, true));
      if (t == 1 && want("xxh3")) Print(BenchBucketHash("xxh3", BucketHash::kXxh3, bytes, f));
      if (t == 1 && want("sum64")) Print(BenchBucketHash("sum64", BucketHash::kSum64, bytes, f));
      if (t == 1 && want("bucket-mac")) Print(BenchBucketHash("bucket-mac", BucketHash::kMac, bytes, f));
      if (t == 1 && want("delta-plan")) Print(BenchDelta("delta-plan-1%", DeltaWork::kPlan, 0.01, bytes, f));
      if (t == 1 && want("delta-apply")) Print(BenchDelta("delta-apply-1%", DeltaWork::kApply, 0.01, bytes, f));
      if (t == 1 && want("delta-resum")) {
        Print(BenchDelta("delta-resum-1%", DeltaWork::kResum, 0.01, bytes, f));
        Print(BenchDelta("delta-resum-0.1%", DeltaWork::kResum, 0.001, bytes, f));
      }
      if (t == 1 && want("delta-checked")) {
        Print(BenchDelta("delta-checked-1%", DeltaWork::kChecked, 0.01, bytes, f));
        Print(BenchDelta("delta-checked-0.1%", DeltaWork::kChecked, 0.001, bytes, f));
      }
    }
  });
  return 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) { return wsync::Main(argc, argv); }
