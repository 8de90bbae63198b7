// Per-thread bodies of the CUDA AWQ and TensorRT-LLM kernels (kernels/cuda/awq_kernels.cu),
// written once as WSYNC_HD functions of a flat item index so that a host test
// (awq_kernel_bodies_test.cc) runs them for every item and compares with the CPU path byte for
// byte: the kernels' index arithmetic is tested on machines without a GPU. The .cu file keeps
// only launch shapes, grid-stride loops and the atomics of the refusal code.
//
// Math and layout: kernels/format/awq_format.h, kernels/format/trtllm_format.h.
// QuantizeAwq runs in three passes: group parameters (one item per (e, n, g): range, refusal,
// scale, zero point into f32 / u8 temporaries; 16-byte loads), qweight words (AwqPackWord; the
// kernel works on 32 x 32-word tiles staged in shared memory so that both the weight reads and the
// qweight writes are coalesced, AwqPackItem is the per-word host form), qzeros words (one item
// per (e, g, j)).
// TensorRT-LLM preprocessing is one item per (column, 32-row block); AwqToMarlin's kernel stages
// tiles in shared memory and emits them through AwqMarlinTileWord; every other kernel is one item
// per output word (or element), a pure gather.
// Thread-safety: pure functions of their arguments; each writes only its own outputs.
#pragma once

#include <cstdint>

#include "kernels/cuda/int4_kernel_bodies.h"
#include "kernels/format/awq_format.h"
#include "kernels/format/int4_format.h"
#include "kernels/format/trtllm_format.h"
#include "kernels/int4_args.h"

namespace wsync::kernels::cuda_body {

namespace fmt = ::wsync::kernels::format;

WSYNC_HD float Value16(uint16_t bits, bool bf16) { return bf16 ? ToF32<true>(bits) : ToF32<false>(bits); }
WSYNC_HD uint16_t Store16(float f, bool bf16) { return bf16 ? FromF32<true>(f) : FromF32<false>(f); }

// The value AWQ's arithmetic computes with: fp16(w) for kFp16, w for kFp32.
WSYNC_HD float AwqInput(uint16_t bits, bool bf16, fmt::AwqArith arith) {
  const float v = Value16(bits, bf16);
  return (arith == fmt::AwqArith::kFp16 && bf16) ? fmt::RoundToF16(v) : v;
}

// Eight consecutive 16-bit values at p (16-byte aligned on the device: one vector load).
WSYNC_HD void Load8(const uint16_t* p, uint16_t v[8]) {
#if defined(__CUDA_ARCH__)
  const uint4 q = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  for (int i = 0; i < 4; ++i)
    v[2 * i] = static_cast<uint16_t>(w[i] & 0xFFFFu), v[2 * i + 1] = static_cast<uint16_t>(w[i] >> 16);
#else
  for (int i = 0; i < 8; ++i) v[i] = p[i];
#endif
}

// Pass 1, item t = (e * N + n) * (K/G) + g. Returns the refusal code (t * 2 + reason) or -1.
// The group is read 8 values at a time (16-byte loads) where it is 16-byte aligned and G % 8 == 0.
WSYNC_HD int64_t AwqParamsItem(int64_t t, const internal::AwqQuantizeArgs& a, float* tmp_scale, uint8_t* tmp_zero) {
  const int64_t ng = a.k / a.group;
  const int64_t row = t / ng, g = t % ng, e = row / a.n, n = row % a.n;
  const uint16_t* x = a.w + row * a.k + g * a.group;
  uint32_t abs_bits = 0;
  float mx = -INFINITY, mn = INFINITY;
  auto take = [&](uint16_t bits) {
    const uint32_t b = fmt::AbsBits16(bits);
    abs_bits = abs_bits > b ? abs_bits : b;
    const float v = Value16(bits, a.is_bf16);
    mx = fmaxf(mx, v);
    mn = fminf(mn, v);
  };
  int64_t i = 0;
  if (a.group % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    for (; i < a.group; i += 8) {
      uint16_t v[8];
      Load8(x + i, v);
      for (int j = 0; j < 8; ++j) take(v[j]);
    }
  }
  for (; i < a.group; ++i) take(x[i]);
  int64_t refused = -1;
  if (abs_bits >= fmt::NonFiniteAbsBits16(a.is_bf16)) {
    refused = t * 2 + static_cast<int>(internal::AwqRefusal::kNonFinite);
    mx = mn = 0.0f;
  } else if (a.arith == fmt::AwqArith::kFp16) {
    mx = fmt::RoundToF16(mx);
    mn = fmt::RoundToF16(mn);
    if (fmt::IsInfF(mx) || fmt::IsInfF(mn) || fmt::IsInfF(fmt::RoundToF16(mx - mn))) {
      refused = t * 2 + static_cast<int>(internal::AwqRefusal::kF16Range);
      mx = mn = 0.0f;
    }
  }
  const fmt::AwqGroup p = fmt::AwqGroupParams(mx, mn, a.arith);
  a.scales[(e * ng + g) * a.n + n] = Store16(p.scale, a.is_bf16);
  tmp_scale[t] = p.scale;
  tmp_zero[t] = static_cast<uint8_t>(p.zero);
  return refused;
}

// The qweight word of column k from the weights of rows 8j + AwqOrder(i), i = 0..7: bits(i) gives
// the weight's bit pattern, p = row * (K/G) + k / G of row 8j (rows follow at stride K/G).
template <typename Bits>
WSYNC_HD uint32_t AwqPackWord(const internal::AwqQuantizeArgs& a, const float* tmp_scale, const uint8_t* tmp_zero,
                              int64_t p, Bits bits) {
  const int64_t ng = a.k / a.group;
  uint32_t word = 0;
  for (int i = 0; i < 8; ++i) {
    const int64_t pi = p + fmt::AwqOrder(i) * ng;
    const fmt::AwqGroup g{tmp_scale[pi], static_cast<float>(tmp_zero[pi])};
    word |= fmt::AwqCode(AwqInput(bits(i), a.is_bf16, a.arith), g, a.arith) << (4 * i);
  }
  return word;
}

// Pass 2 (the host form; the kernel stages 32 x 32-word tiles in shared memory and calls
// AwqPackWord the same way), item t = (e * (N/8) + j) * K + k: qweight word (e, k, j).
WSYNC_HD void AwqPackItem(int64_t t, const internal::AwqQuantizeArgs& a, const float* tmp_scale,
                          const uint8_t* tmp_zero) {
  const int64_t nw = a.n / 8, ng = a.k / a.group;
  const int64_t k = t % a.k, j = (t / a.k) % nw, e = t / (a.k * nw);
  const int64_t row0 = e * a.n + 8 * j;
  a.qweight[(e * a.k + k) * nw + j] = AwqPackWord(a, tmp_scale, tmp_zero, row0 * ng + k / a.group,
                                                  [&](int i) { return a.w[(row0 + fmt::AwqOrder(i)) * a.k + k]; });
}

// Pass 3, item t = (e * (K/G) + g) * (N/8) + j: qzeros word (e, g, j).
WSYNC_HD void AwqZerosItem(int64_t t, const internal::AwqQuantizeArgs& a, const uint8_t* tmp_zero) {
  const int64_t nw = a.n / 8, ng = a.k / a.group;
  const int64_t j = t % nw, g = (t / nw) % ng, e = t / (nw * ng);
  uint32_t word = 0;
  for (int i = 0; i < 8; ++i) {
    word |= static_cast<uint32_t>(tmp_zero[(e * a.n + 8 * j + fmt::AwqOrder(i)) * ng + g]) << (4 * i);
  }
  a.qzeros[t] = word;
}

// Code u of (row k, column n) of one expert's AWQ matrix [R, N/8].
WSYNC_HD uint32_t AwqCodeAt(const uint32_t* awq, int64_t n_total, int64_t k, int64_t n) {
  return fmt::AwqNibble(awq[k * (n_total / 8) + n / 8], n);
}

// AwqToGptq, item t = GPTQ word (e, r8, c) of [E, R/8, N].
WSYNC_HD void AwqToGptqItem(int64_t t, const internal::AwqRepackArgs& a) {
  const int64_t c = t % a.n, r8 = (t / a.n) % (a.rows / 8), e = t / (a.n * (a.rows / 8));
  const uint32_t* awq = a.in + e * a.rows * (a.n / 8);
  uint32_t word = 0;
  for (int r = 0; r < 8; ++r) word |= AwqCodeAt(awq, a.n, 8 * r8 + r, c) << (4 * r);
  a.out[t] = word;
}

// GptqToAwq, item t = AWQ word (e, r, j) of [E, R, N/8].
WSYNC_HD void GptqToAwqItem(int64_t t, const internal::AwqRepackArgs& a) {
  const int64_t nw = a.n / 8;
  const int64_t j = t % nw, r = (t / nw) % a.rows, e = t / (nw * a.rows);
  const uint32_t* gptq = a.in + e * a.rows * nw;  // [R/8, N] words = R * N / 8
  uint32_t word = 0;
  for (int i = 0; i < 8; ++i) word |= fmt::GetNibble(gptq[(r / 8) * a.n + 8 * j + fmt::AwqOrder(i)], r % 8) << (4 * i);
  a.out[t] = word;
}

// The eight Marlin words q + 16j (j = 0..7) of one 16 x 64 tile, q = 0..15, from its AWQ source:
// `src` points at the tile's word (row 0, column word 0), `stride` words per row (the global
// matrix, or the kernel's shared stage). Those eight words read the same eight AWQ words (rows
// WordRow(q) + SlotDk(s), column word 2(q % 4) + SlotDn(s) / 8, for slot s) and differ only in the
// nibble taken (AwqReverse(j)), so one 8x8 nibble transpose emits them all: 8 loads, 8 stores.
WSYNC_HD void AwqMarlinTileGroup(const uint32_t* src, int64_t stride, int q, uint32_t out[8]) {
  const int k0 = fmt::WordRow(q), c = 2 * (q & 3);
  uint32_t m[8];
  for (int s = 0; s < 8; ++s) m[s] = src[(k0 + fmt::SlotDk(s)) * stride + c + fmt::SlotDn(s) / 8];
  fmt::TransposeNibbles8x8(m);  // m[i] = nibble i of every m[s], at nibble s
  for (int j = 0; j < 8; ++j) out[j] = m[fmt::AwqReverse(j)];
}

// AwqToMarlin, item t = (e, tile, q): Marlin words (e, tile, q + 16j) of the [E, K/16, 2N] output.
WSYNC_HD void AwqToMarlinItem(int64_t t, const internal::AwqRepackArgs& a) {
  const int64_t nw = a.n / 8, tiles_n = a.n / fmt::kTileN, tiles = (a.rows / fmt::kTileK) * tiles_n;
  const int q = static_cast<int>(t % 16);
  const int64_t tile = (t / 16) % tiles, e = t / (16 * tiles);
  const uint32_t* src = a.in + e * a.rows * nw + (tile / tiles_n) * fmt::kTileK * nw + (tile % tiles_n) * 8;
  uint32_t out[8];
  AwqMarlinTileGroup(src, nw, q, out);
  uint32_t* dst = a.out + (e * tiles + tile) * fmt::kTileWords + q;
  for (int j = 0; j < 8; ++j) dst[16 * j] = out[j];
}

// Zero points, item t = word (row, w) of [E * R, N/8], in either direction.
WSYNC_HD void AwqZerosToMarlinItem(int64_t t, const internal::AwqRepackArgs& a) {
  const int64_t nw = a.n / 8;
  a.out[t] = fmt::MarlinZeroWord(a.in + (t / nw) * nw, t % nw);
}
WSYNC_HD void MarlinZerosToAwqItem(int64_t t, const internal::AwqRepackArgs& a) {
  const int64_t nw = a.n / 8;
  a.out[t] = fmt::AwqZeroWordFromMarlin(a.in + (t / nw) * nw, t % nw);
}

// TensorRT-LLM by 32-row blocks, item t = (e * (K/32) + b) * N + n (n fastest, so that a warp's
// reads of the code words (e, 4b + r, n) are coalesced): format::TrtllmBlock of the column's block,
// whose four output words are consecutive from TrtllmWordOf(layout, n, 32b, K) in every layout
// (the word index is linear in k'/8 inside a 32-row block). The inverse reads those four and writes
// the four code words.
WSYNC_HD void TrtllmBlockItem(int64_t t, const internal::TrtllmArgs& a) {
  const int64_t blocks = a.k / fmt::kTrtllmRowBlock, words = a.k * a.n / 8;
  const int64_t n = t % a.n, b = (t / a.n) % blocks, e = t / (a.n * blocks);
  uint32_t* codes = a.codes + e * words + 4 * b * a.n + n;
  uint32_t* bytes = a.bytes + e * words + fmt::TrtllmWordOf(a.layout, n, fmt::kTrtllmRowBlock * b, a.k);
  uint32_t in[4], out[4];
  if (!a.inverse) {
    for (int r = 0; r < 4; ++r) in[r] = codes[r * a.n];
    fmt::TrtllmBlock(a.layout, in, out);
    for (int i = 0; i < 4; ++i) bytes[i] = out[i];
  } else {
    for (int i = 0; i < 4; ++i) out[i] = bytes[i];
    fmt::TrtllmBlockInverse(a.layout, out, in);
    for (int r = 0; r < 4; ++r) codes[r * a.n] = in[r];
  }
}

// Scales, item t = input element (e, g, n) of [E, rows, N].
WSYNC_HD void TrtllmScaleItem(int64_t t, const internal::TrtllmScaleArgs& a) {
  const uint16_t in = a.in[t];
  switch (a.mode) {
    case internal::TrtllmScaleMode::kCopy: a.out[t] = in; break;
    case internal::TrtllmScaleMode::kToF16: a.out[t] = FromF32<false>(Value16(in, a.in_bf16)); break;
    case internal::TrtllmScaleMode::kToBf16Interleaved: {
      const int il = a.interleave;
      const int64_t n = t % a.n, g = (t / a.n) % a.rows, e = t / (a.n * a.rows);
      a.out[(e * (a.rows / il) + g / il) * a.n * il + n * il + g % il] = FromF32<true>(Value16(in, a.in_bf16));
      break;
    }
  }
}

// AWQ zeros for TensorRT-LLM, item t = element (e, g, n): dtype((8 - z) * s), one rounding.
WSYNC_HD void TrtllmZeroItem(int64_t t, const internal::TrtllmScaleArgs& a) {
  const int64_t n = t % a.n, row = t / a.n;
  const float z = static_cast<float>(fmt::AwqNibble(a.qzeros[row * (a.n / 8) + n / 8], n));
  a.out[t] = Store16((8.0f - z) * Value16(a.in[t], a.in_bf16), a.in_bf16);
}

}  // namespace wsync::kernels::cuda_body
