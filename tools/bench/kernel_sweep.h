// The size sweep shared by the kernel benchmarks (wsync-bench-kernels on the CPU,
// wsync-bench-kernels-gpu on CUDA): nccl-tests style flags, the kernel names, best-of-n timing and
// the exit on a failed kernel call. Benchmark code: errors print and exit.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "common/units.h"

namespace wsync::bench {

struct SweepFlags {
  std::string min_bytes = "16M", max_bytes = "256M";
  int factor = 2, iters = 5, warmup = 1, check = 1;
  std::vector<std::string> kernels;  // empty = all

  bool Wants(const char* kernel) const {
    return kernels.empty() || std::find(kernels.begin(), kernels.end(), kernel) != kernels.end();
  }
};

// -b -e -f -n -w -c -k, with the defaults already in `f`.
inline void AddSweepFlags(CLI::App& app, SweepFlags& f, const char* check_help) {
  app.add_option("-b,--minbytes", f.min_bytes, "smallest input size (bytes, K/M/G suffix)");
  app.add_option("-e,--maxbytes", f.max_bytes, "largest input size");
  app.add_option("-f,--stepfactor", f.factor, "size multiplication factor");
  app.add_option("-n,--iters", f.iters, "timed iterations");
  app.add_option("-w,--warmup_iters", f.warmup, "warmup iterations");
  app.add_option("-c,--check", f.check, check_help);
  app.add_option(
      "-k,--kernel", f.kernels,
      "kernels to run: quantize-ct quantize-gptq repack repack-perm restore restore-perm scale-perm "
      "awq-quantize-fp16 awq-quantize-fp32 awq-marlin trtllm-sm80 fp8-block fp8-channel xxh3 sum64 bucket-mac "
      "delta-plan delta-apply delta-resum delta-checked; with digests (delta sync): quantize-ct-digest "
      "fp8-block-digest "
      "fp8-channel-digest");
}

inline int64_t ParseSize(const std::string& s) {
  auto v = ParseByteSize(s);
  if (!v.ok()) {
    std::fprintf(stderr, "%s\n", v.status().ToString().c_str());
    std::exit(2);
  }
  return static_cast<int64_t>(*v);
}

// Calls `fn(bytes)` for every size of the sweep.
template <typename Fn>
void ForEachSize(const SweepFlags& f, Fn fn) {
  for (int64_t bytes = ParseSize(f.min_bytes); bytes <= ParseSize(f.max_bytes); bytes *= f.factor) {
    fn(bytes);
    if (f.factor <= 1) break;
  }
}

// Best (minimum) time of `iters` calls: on a shared machine the mean mostly measures the
// neighbours; kernel and baseline are treated alike.
template <typename Fn>
double BestSeconds(const Fn& fn, int iters) {
  double best = 1e30;
  for (int i = 0; i < std::max(1, iters); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

inline void Die(const absl::Status& st) {
  if (!st.ok()) {
    std::fprintf(stderr, "kernel failed: %s\n", st.ToString().c_str());
    std::exit(1);
  }
}

}  // namespace wsync::bench
