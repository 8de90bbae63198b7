// CUDA AWQ and TensorRT-LLM INT4 kernels. Math and layout: kernels/format/awq_format.h and
// kernels/format/trtllm_format.h; the per-thread bodies are in awq_kernel_bodies.h (run on the host
// by awq_kernel_bodies_test.cc), so the device code is the same arithmetic as the CPU path: the
// fp16 rounding of AutoAWQ's arithmetic is the exact (x + C) - C formula, IEEE division (nvcc
// --fmad=false, no --use_fast_math), rintf rounds half to even.
// QuantizeAwq runs three kernels (parameters, qweight words by shared-memory tiles, qzeros words)
// with f32/u8 temporaries for the group parameters, and reports the smallest refused group through
// one u64 atomicMin; AwqToMarlin stages tiles in shared memory; the others are grid-stride loops.

#include <cuda_runtime_api.h>

#include "kernels/cuda/awq_cuda.h"
#include "kernels/cuda/awq_kernel_bodies.h"
#include "kernels/cuda/cuda_status.h"

namespace wsync::kernels::cuda {
namespace {

namespace body = ::wsync::kernels::cuda_body;
namespace fmt = ::wsync::kernels::format;

constexpr int kThreads = 256;

#define WSYNC_GRID_STRIDE(t, total)                                                          \
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < (total); \
       t += static_cast<int64_t>(gridDim.x) * blockDim.x)

__global__ void AwqParamsKernel(internal::AwqQuantizeArgs a, float* tmp_scale, uint8_t* tmp_zero, int64_t total,
                                unsigned long long* bad) {
  WSYNC_GRID_STRIDE(t, total) {
    const int64_t r = body::AwqParamsItem(t, a, tmp_scale, tmp_zero);
    if (r >= 0) atomicMin(bad, static_cast<unsigned long long>(r));
  }
}
// Pass 2 by tiles of 32 columns k x 32 words j (256 weight rows): the rows' 32 weights are read
// row by row (coalesced) into shared memory, thread (k, j) packs its word from there
// (body::AwqPackWord), the 32 x 32 words go back through shared memory so that each warp writes
// whole qweight rows (coalesced). Partial tiles at the K and N/8 edges are masked.
constexpr int kPackTile = 32, kPackThreads = 256;
__global__ void AwqPackKernel(internal::AwqQuantizeArgs a, const float* tmp_scale, const uint8_t* tmp_zero) {
  __shared__ uint16_t w_s[8 * kPackTile][kPackTile];
  __shared__ uint32_t o_s[kPackTile][kPackTile + 1];
  const int64_t nw = a.n / 8, ng = a.k / a.group;
  const int64_t tiles_j = (nw + kPackTile - 1) / kPackTile, tiles_k = (a.k + kPackTile - 1) / kPackTile;
  const int64_t blk = blockIdx.x, tj = blk % tiles_j, tk = (blk / tiles_j) % tiles_k, e = blk / (tiles_j * tiles_k);
  const int64_t k0 = tk * kPackTile, j0 = tj * kPackTile, row0 = e * a.n + 8 * j0;
  const int kn = static_cast<int>(a.k - k0 < kPackTile ? a.k - k0 : kPackTile);
  const int jn = static_cast<int>(nw - j0 < kPackTile ? nw - j0 : kPackTile);
  for (int i = threadIdx.x; i < 8 * jn * kPackTile; i += blockDim.x) {
    const int r = i / kPackTile, c = i % kPackTile;
    if (c < kn) w_s[r][c] = a.w[(row0 + r) * a.k + k0 + c];
  }
  __syncthreads();
  const int c = threadIdx.x % kPackTile;
  for (int j = threadIdx.x / kPackTile; j < jn; j += kPackThreads / kPackTile) {
    if (c < kn) {
      o_s[c][j] = body::AwqPackWord(a, tmp_scale, tmp_zero, (row0 + 8 * j) * ng + (k0 + c) / a.group,
                                    [&](int i) { return w_s[8 * j + fmt::AwqOrder(i)][c]; });
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kn * kPackTile; i += blockDim.x) {
    const int r = i / kPackTile, jj = i % kPackTile;
    if (jj < jn) a.qweight[(e * a.k + k0 + r) * nw + j0 + jj] = o_s[r][jj];
  }
}
__global__ void AwqZerosKernel(internal::AwqQuantizeArgs a, const uint8_t* tmp_zero, int64_t total) {
  WSYNC_GRID_STRIDE(t, total) { body::AwqZerosItem(t, a, tmp_zero); }
}

template <void (*kItem)(int64_t, const internal::AwqRepackArgs&)>
__global__ void AwqRepackKernel(internal::AwqRepackArgs a, int64_t total) {
  WSYNC_GRID_STRIDE(t, total) { kItem(t, a); }
}
__global__ void TrtllmKernel(internal::TrtllmArgs a, int64_t total) {
  WSYNC_GRID_STRIDE(t, total) { body::TrtllmBlockItem(t, a); }
}

// AwqToMarlin: one block (kMarlinThreads) per `tiles` consecutive Marlin tiles of one 16-row
// stripe (same e, kt): their AWQ source, 16 rows x 8 * tiles words, is read row by row (coalesced)
// into shared memory; then thread (tile, q) emits that tile's words q + 16j through
// body::AwqMarlinTileGroup. The blocks are in output tile order.
constexpr int kMarlinTilesPerBlock = 8, kMarlinThreads = 16 * kMarlinTilesPerBlock;
__global__ void AwqToMarlinKernel(internal::AwqRepackArgs a, int tiles) {
  __shared__ uint32_t stage[fmt::kTileK * 8 * kMarlinTilesPerBlock];
  const int64_t nw = a.n / 8, groups_n = a.n / fmt::kTileN / tiles, stripes = a.rows / fmt::kTileK;
  const int64_t blk = blockIdx.x, g = blk % groups_n, stripe = (blk / groups_n) % stripes,
                e = blk / (groups_n * stripes);
  const int row_words = 8 * tiles;
  const uint32_t* src = a.in + e * a.rows * nw + stripe * fmt::kTileK * nw + g * row_words;
  for (int i = threadIdx.x; i < fmt::kTileK * row_words; i += blockDim.x) {
    stage[i] = src[(i / row_words) * nw + i % row_words];
  }
  __syncthreads();
  const int tile = threadIdx.x / 16, q = threadIdx.x % 16;
  if (tile >= tiles) return;
  uint32_t out[8];
  body::AwqMarlinTileGroup(stage + 8 * tile, row_words, q, out);
  uint32_t* dst = a.out + (blk * tiles + tile) * fmt::kTileWords + q;
  for (int j = 0; j < 8; ++j) dst[16 * j] = out[j];
}

__global__ void TrtllmScaleKernel(internal::TrtllmScaleArgs a, int64_t total, bool zeros) {
  WSYNC_GRID_STRIDE(t, total) {
    if (zeros) {
      body::TrtllmZeroItem(t, a);
    } else {
      body::TrtllmScaleItem(t, a);
    }
  }
}

#undef WSYNC_GRID_STRIDE

unsigned Blocks(int64_t items) {
  const int64_t b = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > (int64_t{1} << 30) ? (int64_t{1} << 30) : b));
}

absl::Status Finish(cudaStream_t stream) {
  WSYNC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

template <void (*kItem)(int64_t, const internal::AwqRepackArgs&)>
absl::Status LaunchRepack(const internal::AwqRepackArgs& a, int64_t total) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  AwqRepackKernel<kItem><<<Blocks(total), kThreads, 0, stream>>>(a, total);
  return Finish(stream);
}

}  // namespace

absl::Status QuantizeAwq(const internal::AwqQuantizeArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t groups = a.experts * a.n * (a.k / a.group);
  // One allocation: the refusal code, then f32 scales and u8 zero points per group.
  const size_t bytes = sizeof(unsigned long long) + static_cast<size_t>(groups) * (sizeof(float) + 1);
  void* tmp = nullptr;
  WSYNC_CUDA_RETURN_IF_ERROR(cudaMalloc(&tmp, bytes));
  auto* bad = static_cast<unsigned long long*>(tmp);
  auto* tmp_scale = reinterpret_cast<float*>(bad + 1);
  auto* tmp_zero = reinterpret_cast<uint8_t*>(tmp_scale + groups);
  absl::Status st = [&]() -> absl::Status {
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bad, 0xFF, sizeof(*bad), stream));
    AwqParamsKernel<<<Blocks(groups), kThreads, 0, stream>>>(a, tmp_scale, tmp_zero, groups, bad);
    const int64_t pack_blocks =
        a.experts * ((a.k + kPackTile - 1) / kPackTile) * ((a.n / 8 + kPackTile - 1) / kPackTile);
    if (pack_blocks >= (int64_t{1} << 31))
      return absl::InvalidArgumentError("QuantizeAwq: too many tiles for one launch");
    AwqPackKernel<<<static_cast<unsigned>(pack_blocks), kPackThreads, 0, stream>>>(a, tmp_scale, tmp_zero);
    const int64_t zwords = a.experts * (a.k / a.group) * (a.n / 8);
    AwqZerosKernel<<<Blocks(zwords), kThreads, 0, stream>>>(a, tmp_zero, zwords);
    if (auto s = Finish(stream); !s.ok()) return s;
    unsigned long long host = 0;
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpy(&host, bad, sizeof(host), cudaMemcpyDeviceToHost));
    if (host != ~0ull) return internal::AwqRefusedError(a, static_cast<int64_t>(host));
    return absl::OkStatus();
  }();
  cudaFree(tmp);
  return st;
}

absl::Status AwqToGptq(const internal::AwqRepackArgs& a) {
  return LaunchRepack<body::AwqToGptqItem>(a, a.experts * a.rows * a.n / 8);
}
absl::Status GptqToAwq(const internal::AwqRepackArgs& a) {
  return LaunchRepack<body::GptqToAwqItem>(a, a.experts * a.rows * a.n / 8);
}
absl::Status AwqToMarlin(const internal::AwqRepackArgs& a) {
  const int64_t tiles_n = a.n / fmt::kTileN;
  int tiles = kMarlinTilesPerBlock;
  while (tiles_n % tiles != 0) tiles /= 2;
  const int64_t blocks = a.experts * (a.rows / fmt::kTileK) * (tiles_n / tiles);
  if (blocks <= 0) return absl::OkStatus();
  if (blocks >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError("AwqToMarlin: the weight has more than 2^31 Marlin tile groups");
  }
  auto stream = static_cast<cudaStream_t>(a.stream);
  AwqToMarlinKernel<<<static_cast<unsigned>(blocks), kMarlinThreads, 0, stream>>>(a, tiles);
  return Finish(stream);
}
absl::Status AwqZerosToMarlin(const internal::AwqRepackArgs& a) {
  return LaunchRepack<body::AwqZerosToMarlinItem>(a, a.experts * a.rows * a.n / 8);
}
absl::Status MarlinZerosToAwq(const internal::AwqRepackArgs& a) {
  return LaunchRepack<body::MarlinZerosToAwqItem>(a, a.experts * a.rows * a.n / 8);
}

absl::Status Trtllm(const internal::TrtllmArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t total = a.experts * (a.k / fmt::kTrtllmRowBlock) * a.n;  // (column, 32-row block) items
  TrtllmKernel<<<Blocks(total), kThreads, 0, stream>>>(a, total);
  return Finish(stream);
}

absl::Status TrtllmScales(const internal::TrtllmScaleArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t total = a.experts * a.rows * a.n;
  TrtllmScaleKernel<<<Blocks(total), kThreads, 0, stream>>>(a, total, false);
  return Finish(stream);
}

absl::Status TrtllmZeros(const internal::TrtllmScaleArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t total = a.experts * a.rows * a.n;
  TrtllmScaleKernel<<<Blocks(total), kThreads, 0, stream>>>(a, total, true);
  return Finish(stream);
}

}  // namespace wsync::kernels::cuda
