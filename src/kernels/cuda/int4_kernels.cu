// CUDA INT4 kernels. Math and layout: kernels/format/int4_format.h (FORMATS.md §1-§6); the
// device code calls the same WSYNC_HD helpers as the CPU path, so the two cannot drift.
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

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <vector>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/int4_cuda.h"
#include "kernels/format/int4_format.h"

namespace wsync::kernels::cuda {
namespace {

namespace fmt = ::wsync::kernels::format;
using internal::Layout;

// f32 value of a bf16 or fp16 bit pattern (both exact).
template <bool kBf16>
__device__ __forceinline__ float ToF32(uint32_t bits16) {
  if constexpr (kBf16) {
    return __uint_as_float(bits16 << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
  }
}

// Round-to-nearest-even narrowing of the f32 scale to the weight dtype.
template <bool kBf16>
__device__ __forceinline__ uint16_t FromF32(float f) {
  if constexpr (kBf16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  } else {
    return __half_as_ushort(__float2half_rn(f));
  }
}

// Max of the 15-bit magnitudes of the two 16-bit values in a 32-bit word.
__device__ __forceinline__ uint32_t AbsMax2(uint32_t x, uint32_t m) {
  return max(m, max(fmt::AbsBits16(x & 0xFFFFu), fmt::AbsBits16(x >> 16)));
}

// Packed word of 8 values held in one uint4 (8 x 16 bit, element 0 in the low half of .x).
template <bool kBf16>
__device__ __forceinline__ uint32_t PackVec(uint4 v, float scale) {
  const uint32_t h[4] = {v.x, v.y, v.z, v.w};
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    word |= fmt::QuantizeNibble(ToF32<kBf16>(h[i] & 0xFFFFu), scale) << (8 * i);
    word |= fmt::QuantizeNibble(ToF32<kBf16>(h[i] >> 16), scale) << (8 * i + 4);
  }
  return word;
}

template <int kG, bool kBf16, Layout kLayout>
__global__ void QuantizeGroupedKernel(const uint16_t* __restrict__ w, int64_t experts, int64_t n, int64_t k,
                                      fmt::Variant variant, uint32_t* __restrict__ packed,
                                      uint16_t* __restrict__ scales, unsigned long long* bad) {
  constexpr int kVecs = kG / 8;
  const int64_t ng = k / kG, kw = k / 8;
  const int64_t total = experts * n * ng;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t e, row_n, g;
    if constexpr (kLayout == Layout::kGptq) {
      e = t / (ng * n);
      g = (t / n) % ng;
      row_n = t % n;
    } else {
      e = t / (ng * n);
      row_n = (t / ng) % n;
      g = t % ng;
    }
    const int64_t row = e * n + row_n;
    const uint4* src = reinterpret_cast<const uint4*>(w + row * k + g * kG);
    uint4 v[kVecs];
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      v[i] = src[i];
      m = AbsMax2(v[i].x, m);
      m = AbsMax2(v[i].y, m);
      m = AbsMax2(v[i].z, m);
      m = AbsMax2(v[i].w, m);
    }
    if (m >= fmt::NonFiniteAbsBits16(kBf16)) atomicMin(bad, static_cast<unsigned long long>(row * ng + g));
    const float scale = fmt::GroupScale(ToF32<kBf16>(m), variant);
    if constexpr (kLayout == Layout::kGptq) {
      scales[(e * ng + g) * n + row_n] = FromF32<kBf16>(scale);
      uint32_t* out = packed + (e * kw + g * kVecs) * n + row_n;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) out[i * n] = PackVec<kBf16>(v[i], scale);
    } else {
      scales[row * ng + g] = FromF32<kBf16>(scale);
      uint4* out = reinterpret_cast<uint4*>(packed + row * kw + g * kVecs);
#pragma unroll
      for (int i = 0; i < kVecs / 4; ++i) {
        out[i] = make_uint4(PackVec<kBf16>(v[4 * i], scale), PackVec<kBf16>(v[4 * i + 1], scale),
                            PackVec<kBf16>(v[4 * i + 2], scale), PackVec<kBf16>(v[4 * i + 3], scale));
      }
    }
  }
}

constexpr int kRowThreads = 256;

template <bool kBf16, Layout kLayout>
__global__ void QuantizeRowKernel(const uint16_t* __restrict__ w, int64_t n, int64_t k, fmt::Variant variant,
                                  uint32_t* __restrict__ packed, uint16_t* __restrict__ scales,
                                  unsigned long long* bad) {
  const int64_t row = blockIdx.x;  // e * n + row_n
  const int64_t e = row / n, row_n = row % n, kw = k / 8;
  const uint4* src = reinterpret_cast<const uint4*>(w + row * k);
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < kw; i += blockDim.x) {
    const uint4 v = src[i];
    m = AbsMax2(v.x, m);
    m = AbsMax2(v.y, m);
    m = AbsMax2(v.z, m);
    m = AbsMax2(v.w, m);
  }
  // Block max: warp shuffles, then one value per warp through shared memory.
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  __shared__ uint32_t warp_max[kRowThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  uint32_t bm = 0;
  for (int i = 0; i < kRowThreads / 32; ++i) bm = max(bm, warp_max[i]);
  const float scale = fmt::GroupScale(ToF32<kBf16>(bm), variant);
  if (threadIdx.x == 0) {
    scales[row] = FromF32<kBf16>(scale);  // [E, N, 1] and [E, 1, N] coincide
    if (bm >= fmt::NonFiniteAbsBits16(kBf16)) atomicMin(bad, static_cast<unsigned long long>(row));
  }
  for (int64_t i = threadIdx.x; i < kw; i += blockDim.x) {
    const uint32_t word = PackVec<kBf16>(src[i], scale);
    if constexpr (kLayout == Layout::kGptq) {
      packed[(e * kw + i) * n + row_n] = word;
    } else {
      packed[row * kw + i] = word;
    }
  }
}

// One block (128 threads) per tile (e, kt, nt).
__global__ void RepackKernel(const uint32_t* __restrict__ in, const int32_t* __restrict__ perm, int64_t k, int64_t n,
                             uint32_t* __restrict__ out) {
  const int64_t ntiles = n / fmt::kTileN, ktiles = k / fmt::kTileK, kw = k / 8;
  const int64_t tile = blockIdx.x;
  const int64_t e = tile / (ktiles * ntiles), kt = (tile / ntiles) % ktiles, nt = tile % ntiles;
  __shared__ uint32_t rows[2][fmt::kTileN];
  const int h = threadIdx.x >> 6, c = threadIdx.x & 63;
  const uint32_t* q = in + e * kw * n;
  const int64_t col = nt * fmt::kTileN + c;
  if (perm == nullptr) {
    rows[h][c] = q[(2 * kt + h) * n + col];
  } else {
    const int32_t* p = perm + e * k + kt * fmt::kTileK + 8 * h;
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) word |= fmt::GetNibble(q[(p[j] >> 3) * n + col], p[j] & 7) << (4 * j);
    rows[h][c] = word;
  }
  __syncthreads();
  const int wi = threadIdx.x, r = fmt::WordRow(wi), cc = fmt::WordCol(wi);
  out[e * ktiles * 2 * n + fmt::TileOffset(kt, nt, n) + wi] =
      fmt::MarlinWord(rows[0][cc], rows[1][cc], rows[0][cc + 8], rows[1][cc + 8], r / 2);
}

__global__ void RestoreKernel(const uint32_t* __restrict__ in, const int32_t* __restrict__ perm, int64_t k, int64_t n,
                              uint32_t* __restrict__ out) {
  const int64_t ntiles = n / fmt::kTileN, ktiles = k / fmt::kTileK, kw = k / 8;
  const int64_t tile = blockIdx.x;
  const int64_t e = tile / (ktiles * ntiles), kt = (tile / ntiles) % ktiles, nt = tile % ntiles;
  __shared__ uint32_t words[fmt::kTileWords];
  words[threadIdx.x] = in[e * ktiles * 2 * n + fmt::TileOffset(kt, nt, n) + threadIdx.x];
  __syncthreads();
  const int h = threadIdx.x >> 6, c = threadIdx.x & 63;
  const int64_t col = nt * fmt::kTileN + c;
  uint32_t* o = out + e * kw * n;
  if (perm == nullptr) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const fmt::TileSlot s = fmt::LocateInTile(8 * h + j, c);
      word |= fmt::GetNibble(words[s.word], s.slot) << (4 * j);
    }
    o[(2 * kt + h) * n + col] = word;
  } else {
    const int32_t* p = perm + e * k + kt * fmt::kTileK + 8 * h;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const fmt::TileSlot s = fmt::LocateInTile(8 * h + j, c);
      const uint32_t nib = fmt::GetNibble(words[s.word], s.slot);
      atomicOr(&o[(p[j] >> 3) * n + col], nib << (4 * (p[j] & 7)));
    }
  }
}

__global__ void ScalePermKernel(const uint16_t* __restrict__ in, uint16_t* __restrict__ out, int64_t total, int64_t n,
                                bool channelwise, bool inverse) {
  const int width = channelwise ? fmt::kScalePermChannelWidth : fmt::kScalePermGroupedWidth;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int p = static_cast<int>(i % width);
    const int64_t src = i - p + (channelwise ? fmt::ScalePermChannel(p) : fmt::ScalePermGrouped(p));
    if (inverse) {
      out[src] = in[i];
    } else {
      out[i] = in[src];
    }
  }
  (void)n;
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
      QuantizeGroupedKernel<32, kBf16, kLayout><<<grid, kThreads, 0, stream>>>(a.w, a.experts, a.n, a.k, a.variant,
                                                                              a.packed, a.scales, bad);
      break;
    case 64:
      QuantizeGroupedKernel<64, kBf16, kLayout><<<grid, kThreads, 0, stream>>>(a.w, a.experts, a.n, a.k, a.variant,
                                                                              a.packed, a.scales, bad);
      break;
    default:
      QuantizeGroupedKernel<128, kBf16, kLayout><<<grid, kThreads, 0, stream>>>(a.w, a.experts, a.n, a.k,
                                                                               a.variant, a.packed, a.scales, bad);
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
  unsigned long long* bad = nullptr;
  WSYNC_CUDA_RETURN_IF_ERROR(cudaMalloc(&bad, sizeof(*bad)));
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
    if (auto s = Finish(stream); !s.ok()) return s;
    unsigned long long host = 0;
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpy(&host, bad, sizeof(host), cudaMemcpyDeviceToHost));
    if (host != ~0ull) return internal::NonFiniteError(a, static_cast<int64_t>(host));
    return absl::OkStatus();
  }();
  cudaFree(bad);
  return st;
}

absl::Status GptqToMarlin(const internal::RepackArgs& a) {
  if (auto s = CheckPermOnHost(a); !s.ok()) return s;
  auto stream = static_cast<cudaStream_t>(a.stream);
  const auto tiles = static_cast<unsigned>(a.experts * (a.k / fmt::kTileK) * (a.n / fmt::kTileN));
  RepackKernel<<<tiles, fmt::kTileWords, 0, stream>>>(a.in, a.perm, a.k, a.n, a.out);
  return Finish(stream);
}

absl::Status MarlinToGptq(const internal::RepackArgs& a) {
  if (auto s = CheckPermOnHost(a); !s.ok()) return s;
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (a.perm != nullptr) {
    WSYNC_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.out, 0, static_cast<size_t>(a.experts * (a.k / 8) * a.n) * sizeof(uint32_t), stream));
  }
  const auto tiles = static_cast<unsigned>(a.experts * (a.k / fmt::kTileK) * (a.n / fmt::kTileN));
  RestoreKernel<<<tiles, fmt::kTileWords, 0, stream>>>(a.in, a.perm, a.k, a.n, a.out);
  return Finish(stream);
}

absl::Status PermuteScales(const internal::ScalePermArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t total = a.experts * a.rows * a.n;
  constexpr int kThreads = 256;
  ScalePermKernel<<<static_cast<unsigned>(Blocks(total, kThreads)), kThreads, 0, stream>>>(a.in, a.out, total, a.n,
                                                                                          a.channelwise, a.inverse);
  return Finish(stream);
}

}  // namespace wsync::kernels::cuda
