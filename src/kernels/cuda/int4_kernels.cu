// CUDA INT4 kernels. Math and layout: kernels/format/int4_format.h (FORMATS.md §1-§6); the
// device code calls the same WSYNC_HD helpers as the CPU path, so the two cannot drift. The
// per-thread bodies live in int4_kernel_bodies.h (run on the host by int4_kernel_bodies_test.cc);
// this file keeps launch shapes, shared memory, barriers, shuffles and atomics.
//
// Quantize, grouped (G in {32, 64, 128}): one thread per (row, group). It loads the group with
// G/8 16-byte vector loads kept in registers (W is read once), reduces max |x| on the 16-bit
// patterns, computes the f32 scale of the variant, and writes the G/8 packed words directly:
//   compressed-tensors: threads ordered (row, group), words [N, K/8] stored as uint4 (16 B);
//   GPTQ:               threads ordered (group, row), so word j of consecutive rows is coalesced
//                       in qweight[K/8, N] (the transpose is free: no second pass).
// Quantize, channelwise (G = K): one 256-thread block per row; pass 1 reduces max |x| (block
// reduction), pass 2 re-reads the row (L2/L1 hit) and writes one word per 8 values.
// Division is IEEE (no --use_fast_math; nvcc --fmad=false), rintf rounds half to even.
//
// Repack (§4): one 128-thread block per 16x64 tile. Threads 0..63 stage GPTQ row 2kt, 64..127 row
// 2kt+1 (or, with perm, the nibbles of Marlin rows 16kt..16kt+15 gathered from GPTQ rows
// perm[k]/8) in shared memory, then thread w writes tile word w = MarlinWord(...) coalesced.
// Restore: thread w stages tile word w, then threads (h, c) gather the 8 nibbles of GPTQ word
// (2kt + h, c) through LocateInTile. With perm, they scatter nibbles to GPTQ row perm[k] with
// atomicOr into a zeroed output (each nibble written exactly once, so the result is exact).
// Scale permutation (§5): one thread per scale.

#include <cuda_runtime_api.h>

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/int4_cuda.h"
#include "kernels/cuda/int4_kernel_bodies.h"
#include "kernels/format/int4_format.h"

namespace wsync::kernels::cuda {
namespace {

namespace fmt = ::wsync::kernels::format;
namespace body = ::wsync::kernels::cuda_body;
using internal::Layout;

template <int kG, bool kBf16, Layout kLayout>
__global__ void QuantizeGroupedKernel(const uint16_t* __restrict__ w, int64_t experts, int64_t n, int64_t k,
                                      fmt::Variant variant, uint32_t* __restrict__ packed,
                                      uint16_t* __restrict__ scales, unsigned long long* bad) {
  const int64_t total = experts * n * (k / kG);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = body::QuantizeGroupedItem<kG, kBf16, kLayout>(t, w, n, k, variant, packed, scales);
    if (b >= 0) atomicMin(bad, static_cast<unsigned long long>(b));
  }
}

constexpr int kRowThreads = 256;

template <bool kBf16, Layout kLayout>
__global__ void QuantizeRowKernel(const uint16_t* __restrict__ w, int64_t n, int64_t k, fmt::Variant variant,
                                  uint32_t* __restrict__ packed, uint16_t* __restrict__ scales,
                                  unsigned long long* bad) {
  const int64_t row = blockIdx.x;  // e * n + row_n
  uint32_t m = body::RowAbsMaxPart(w, row, k, threadIdx.x, blockDim.x);
  // Block max: warp shuffles, then one value per warp through shared memory.
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  __shared__ uint32_t warp_max[kRowThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  uint32_t bm = 0;
  for (int i = 0; i < kRowThreads / 32; ++i) bm = max(bm, warp_max[i]);
  const int64_t b =
      body::RowQuantizePart<kBf16, kLayout>(w, row, n, k, variant, bm, threadIdx.x, blockDim.x, packed, scales);
  if (b >= 0) atomicMin(bad, static_cast<unsigned long long>(b));
}

// GPTQ -> Marlin in registers, no shared memory: 32 threads per tile, each reading its column
// pair's four GPTQ words and writing four Marlin words (body::RepackGroupItem); grid-stride.
__global__ void RepackKernel(const uint32_t* __restrict__ in, const int32_t* __restrict__ perm, int64_t k, int64_t n,
                             uint32_t* __restrict__ out, int64_t total) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    body::RepackGroupItem(t, in, perm, k, n, out);
  }
}

// Marlin -> GPTQ without perm: the inverse, also in registers (body::RestoreGroupItem).
__global__ void RestoreKernel(const uint32_t* __restrict__ in, int64_t k, int64_t n, uint32_t* __restrict__ out,
                              int64_t total) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    body::RestoreGroupItem(t, in, k, n, out);
  }
}

// Marlin -> GPTQ with perm (output zeroed first): one block (128 threads) per tile; stage the tile's
// words, barrier, scatter every nibble to its GPTQ row perm[...] with atomicOr.
__global__ void RestorePermKernel(const uint32_t* __restrict__ in, const int32_t* __restrict__ perm, int64_t k,
                                  int64_t n, uint32_t* __restrict__ out) {
  __shared__ uint32_t words[fmt::kTileWords];
  const body::TileIndex ti = body::TileOfBlock(blockIdx.x, k, n);
  body::RestoreStage(in, k, n, ti, threadIdx.x, words);
  __syncthreads();
  body::RestoreScatter(perm, k, n, ti, threadIdx.x, words, out, [](uint32_t* p, uint32_t bits) { atomicOr(p, bits); });
}

__global__ void ScalePermKernel(const uint16_t* __restrict__ in, uint16_t* __restrict__ out, int64_t total,
                                bool channelwise, bool inverse) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    body::ScalePermItem(i, in, out, channelwise, inverse);
  }
}

int64_t Blocks(int64_t items, int threads) {
  const int64_t b = (items + threads - 1) / threads;
  return b < 1 ? 1 : (b > (int64_t{1} << 30) ? (int64_t{1} << 30) : b);
}

absl::Status Finish(cudaStream_t stream) {
  WSYNC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

template <bool kBf16, Layout kLayout>
void LaunchQuantize(const internal::QuantizeArgs& a, cudaStream_t stream, unsigned long long* bad) {
  constexpr int kThreads = 256;
  if (a.group == a.k && a.group != 32 && a.group != 64 && a.group != 128) {
    QuantizeRowKernel<kBf16, kLayout><<<static_cast<unsigned>(a.experts * a.n), kRowThreads, 0, stream>>>(
        a.w, a.n, a.k, a.variant, a.packed, a.scales, bad);
    return;
  }
  const int64_t items = a.experts * a.n * (a.k / a.group);
  const auto grid = static_cast<unsigned>(Blocks(items, kThreads));
  switch (a.group) {
    case 32:
      QuantizeGroupedKernel<32, kBf16, kLayout>
          <<<grid, kThreads, 0, stream>>>(a.w, a.experts, a.n, a.k, a.variant, a.packed, a.scales, bad);
      break;
    case 64:
      QuantizeGroupedKernel<64, kBf16, kLayout>
          <<<grid, kThreads, 0, stream>>>(a.w, a.experts, a.n, a.k, a.variant, a.packed, a.scales, bad);
      break;
    default:
      QuantizeGroupedKernel<128, kBf16, kLayout>
          <<<grid, kThreads, 0, stream>>>(a.w, a.experts, a.n, a.k, a.variant, a.packed, a.scales, bad);
      break;
  }
}

absl::Status CheckPermOnHost(const internal::RepackArgs& a) {
  if (a.perm == nullptr) return absl::OkStatus();
  std::vector<int32_t> host(static_cast<size_t>(a.experts * a.k));
  WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpy(host.data(), a.perm, host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return internal::ValidatePerm(host.data(), a.experts, a.k);
}

}  // namespace

absl::Status Quantize(const internal::QuantizeArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (a.group != 32 && a.group != 64 && a.group != 128 && a.group != a.k) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA QuantizeInt4: group size ", a.group, " has no kernel"));
  }
  // One u64 for the smallest non-finite group index (ULLONG_MAX = none).
  absl::StatusOr<KeptWord> word = ThreadKeptWord();
  if (!word.ok()) return word.status();
  unsigned long long* bad = word->device;
  absl::Status st = [&]() -> absl::Status {
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bad, 0xFF, sizeof(*bad), stream));
    if (a.is_bf16) {
      if (a.layout == Layout::kGptq) {
        LaunchQuantize<true, Layout::kGptq>(a, stream, bad);
      } else {
        LaunchQuantize<true, Layout::kCompressedTensors>(a, stream, bad);
      }
    } else {
      if (a.layout == Layout::kGptq) {
        LaunchQuantize<false, Layout::kGptq>(a, stream, bad);
      } else {
        LaunchQuantize<false, Layout::kCompressedTensors>(a, stream, bad);
      }
    }
    WSYNC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(word->host, bad, sizeof(*bad), cudaMemcpyDeviceToHost, stream));
    if (auto s = Finish(stream); !s.ok()) return s;
    const unsigned long long host = *word->host;
    if (host != ~0ull) return internal::NonFiniteError(a, static_cast<int64_t>(host));
    return absl::OkStatus();
  }();
  return st;
}

absl::Status GptqToMarlin(const internal::RepackArgs& a) {
  if (auto s = CheckPermOnHost(a); !s.ok()) return s;
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t total = a.experts * (a.k / fmt::kTileK) * (a.n / fmt::kTileN) * 32;  // 32 items per tile
  constexpr int kThreads = 256;
  RepackKernel<<<static_cast<unsigned>(Blocks(total, kThreads)), kThreads, 0, stream>>>(a.in, a.perm, a.k, a.n, a.out,
                                                                                        total);
  return Finish(stream);
}

absl::Status MarlinToGptq(const internal::RepackArgs& a) {
  if (auto s = CheckPermOnHost(a); !s.ok()) return s;
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (a.perm != nullptr) {
    WSYNC_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.out, 0, static_cast<size_t>(a.experts * (a.k / 8) * a.n) * sizeof(uint32_t), stream));
  }
  const int64_t tiles = a.experts * (a.k / fmt::kTileK) * (a.n / fmt::kTileN);
  if (a.perm != nullptr) {
    RestorePermKernel<<<static_cast<unsigned>(tiles), fmt::kTileWords, 0, stream>>>(a.in, a.perm, a.k, a.n, a.out);
  } else {
    constexpr int kThreads = 256;
    RestoreKernel<<<static_cast<unsigned>(Blocks(tiles * 32, kThreads)), kThreads, 0, stream>>>(a.in, a.k, a.n, a.out,
                                                                                                tiles * 32);
  }
  return Finish(stream);
}

absl::Status PermuteScales(const internal::ScalePermArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t total = a.experts * a.rows * a.n;
  constexpr int kThreads = 256;
  ScalePermKernel<<<static_cast<unsigned>(Blocks(total, kThreads)), kThreads, 0, stream>>>(a.in, a.out, total,
                                                                                           a.channelwise, a.inverse);
  return Finish(stream);
}

}  // namespace wsync::kernels::cuda
