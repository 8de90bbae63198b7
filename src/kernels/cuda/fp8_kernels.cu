// CUDA FP8 kernels. Math: kernels/format/fp8_format.h (docs/spec/FP8.md); the device code calls
// the same WSYNC_HD helpers as the CPU path (kernels/cpu/fp8_cpu.cc), so the two cannot drift.
//
// Block-wise: one 256-thread block per (expert, block row, column block); pass 1 reduces the
// largest 16-bit magnitude pattern of the tile (shared-memory reduction; exact), thread 0 computes
// the scale (and writes it) and its reciprocal, a tile holding Inf / NaN is reported through the
// refusal word (atomicMin of its index) and left unwritten; pass 2 re-reads the tile (L1 / L2)
// and writes one code per element, consecutive threads on consecutive columns.
// Per channel: the same with one block per row.
// Dequantize: one thread per element. IEEE division and multiplication (no --use_fast_math, no
// contraction: the expressions have no add), rintf rounds half to even.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/fp8_cuda.h"
#include "kernels/format/fp8_format.h"
#include "kernels/format/int4_format.h"

namespace wsync::kernels::cuda {
namespace {

namespace fmt = ::wsync::kernels::format;
constexpr int kThreads = 256;

__device__ float Widen16(uint16_t h, bool bf16) { return bf16 ? fmt::Bf16BitsToF32(h) : fmt::F16BitsToF32(h); }

// The largest magnitude pattern over the block's threads (every thread passes its own).
__device__ uint32_t BlockMax(uint32_t m, uint32_t* shared) {
  shared[threadIdx.x] = m;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] = max(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const uint32_t r = shared[0];
  __syncthreads();
  return r;
}

__global__ void QuantizeBlockKernel(internal::Fp8QuantizeArgs a, int64_t nb, int64_t kb, unsigned long long* bad) {
  __shared__ uint32_t red[kThreads];
  __shared__ float mul;
  const int64_t bj = blockIdx.x, bi = blockIdx.y, e = blockIdx.z;
  const int64_t r0 = bi * a.bn, rows = min(a.n, r0 + a.bn) - r0;
  const int64_t c0 = bj * a.bk, cols = min(a.k, c0 + a.bk) - c0;
  const int64_t items = rows * cols;
  uint32_t m = 0;
  for (int64_t t = threadIdx.x; t < items; t += kThreads)
    m = max(m, fmt::AbsBits16(a.w[(e * a.n + r0 + t / cols) * a.k + c0 + t % cols]));
  m = BlockMax(m, red);
  const int64_t index = (e * nb + bi) * kb + bj;
  if (m >= fmt::NonFiniteAbsBits16(a.is_bf16)) {
    if (threadIdx.x == 0) atomicMin(bad, static_cast<unsigned long long>(index));
    return;
  }
  if (threadIdx.x == 0) {
    const float s = fmt::BlockScale(Widen16(static_cast<uint16_t>(m), a.is_bf16), a.block_variant);
    static_cast<float*>(a.scales)[index] = s;
    mul = fmt::BlockMultiplier(s);
  }
  __syncthreads();
  const float r = mul;
  for (int64_t t = threadIdx.x; t < items; t += kThreads) {
    const int64_t off = (e * a.n + r0 + t / cols) * a.k + c0 + t % cols;
    a.q[off] = fmt::QuantizeBlockElement(Widen16(a.w[off], a.is_bf16), r);
  }
}

__global__ void QuantizeChannelKernel(internal::Fp8QuantizeArgs a, unsigned long long* bad) {
  __shared__ uint32_t red[kThreads];
  const int64_t row = blockIdx.x;
  const uint16_t* x = a.w + row * a.k;
  uint8_t* q = a.q + row * a.k;
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < a.k; i += kThreads) m = max(m, fmt::AbsBits16(x[i]));
  m = BlockMax(m, red);
  if (m >= fmt::NonFiniteAbsBits16(a.is_bf16)) {
    if (threadIdx.x == 0) atomicMin(bad, static_cast<unsigned long long>(row));
    return;
  }
  const float amax = Widen16(static_cast<uint16_t>(m), a.is_bf16);
  if (a.channel_variant == fmt::Fp8ChannelVariant::kSlime) {
    const float s = fmt::ChannelScaleSlime(amax);
    if (threadIdx.x == 0) static_cast<float*>(a.scales)[row] = s;
    for (int64_t i = threadIdx.x; i < a.k; i += kThreads)
      q[i] = fmt::QuantizeChannelElementSlime(Widen16(x[i], a.is_bf16), s);
  } else {
    const float s = fmt::ChannelScaleCompressedTensors(amax, a.is_bf16);
    if (threadIdx.x == 0)
      static_cast<uint16_t*>(a.scales)[row] = a.is_bf16 ? fmt::F32ToBf16Bits(s) : fmt::F32ToF16Bits(s);
    for (int64_t i = threadIdx.x; i < a.k; i += kThreads)
      q[i] = fmt::QuantizeChannelElementCompressedTensors(Widen16(x[i], a.is_bf16), s, a.is_bf16);
  }
}

__global__ void DequantizeKernel(internal::Fp8DequantizeArgs a, int64_t nb, int64_t kb, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / a.k, c = i % a.k, e = row / a.n, r = row % a.n;
    const int64_t si = a.block ? (e * nb + r / a.bn) * kb + c / a.bk : row;
    float s;
    if (a.scale_kind == 0)
      s = static_cast<const float*>(a.scales)[si];
    else
      s = Widen16(static_cast<const uint16_t*>(a.scales)[si], a.scale_kind == 1);
    const float v = fmt::E4m3Value(a.q[i]) * s;
    if (a.out_bf16)
      static_cast<uint16_t*>(a.out)[i] = v != v ? static_cast<uint16_t>(0x7FC0u) : fmt::F32ToBf16Bits(v);
    else
      static_cast<float*>(a.out)[i] = v;
  }
}

absl::Status Finish(cudaStream_t stream) {
  WSYNC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantizeFp8(const internal::Fp8QuantizeArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t nb = (a.n + a.bn - 1) / a.bn, kb = (a.k + a.bk - 1) / a.bk;
  if (a.block && (kb > (int64_t{1} << 31) - 1 || nb > 65535 || a.experts > 65535))
    return absl::InvalidArgumentError(absl::StrCat("CUDA QuantizeFp8Block: a grid of ", kb, " x ", nb, " x ", a.experts,
                                                   " blocks is beyond the launch limits"));
  if (!a.block && a.experts * a.n > (int64_t{1} << 31) - 1)
    return absl::InvalidArgumentError(absl::StrCat("CUDA QuantizeFp8Channel: ", a.experts * a.n, " rows"));
  absl::StatusOr<KeptWord> word = ThreadKeptWord();
  if (!word.ok()) return word.status();
  unsigned long long* bad = word->device;
  WSYNC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bad, 0xFF, sizeof(*bad), stream));
  if (a.block) {
    const dim3 grid(static_cast<unsigned>(kb), static_cast<unsigned>(nb), static_cast<unsigned>(a.experts));
    QuantizeBlockKernel<<<grid, kThreads, 0, stream>>>(a, nb, kb, bad);
  } else {
    QuantizeChannelKernel<<<static_cast<unsigned>(a.experts * a.n), kThreads, 0, stream>>>(a, bad);
  }
  WSYNC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(word->host, bad, sizeof(*bad), cudaMemcpyDeviceToHost, stream));
  if (auto s = Finish(stream); !s.ok()) return s;
  if (*word->host != ~0ull) return internal::Fp8NonFiniteError(a, static_cast<int64_t>(*word->host));
  return absl::OkStatus();
}

absl::Status DequantizeFp8(const internal::Fp8DequantizeArgs& a) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  const int64_t nb = a.block ? (a.n + a.bn - 1) / a.bn : 1, kb = a.block ? (a.k + a.bk - 1) / a.bk : 1;
  const int64_t total = a.experts * a.n * a.k;
  int64_t blocks = (total + kThreads - 1) / kThreads;
  blocks = blocks < 1 ? 1 : (blocks > (int64_t{1} << 20) ? (int64_t{1} << 20) : blocks);
  DequantizeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, nb, kb, total);
  return Finish(stream);
}

}  // namespace wsync::kernels::cuda
