#!/usr/bin/env python3
"""Golden data for wsync's INT4 weight converters: AWQ (+ AWQ->Marlin) and TensorRT-LLM mixed GEMM.

An independent, pure-Python (stdlib only) second formulation of the transforms specified in
docs/spec/AWQ.md, docs/spec/TRTLLM_INT4.md and docs/spec/FORMATS.md §4-§5. Every transform
is written the way the upstream code does it, step by step (AutoAWQ's packing loop, vLLM's
awq_marlin_repack kernel and awq_to_marlin_zero_points, TensorRT-LLM's cutlass_preprocessors.cpp
steps), never with the closed forms the C++ uses, so the two can check each other.

Run (from the repository root):

    python3 tools/golden/int4_golden.py --out tests/data/golden

It first runs a self-test (the specs' worked examples and cross-checks between formulations),
then writes awq_golden.safetensors and trtllm_golden.safetensors. Output is deterministic: all
randomness comes from random.Random(SEED).random() (the only part of the random module that
Python guarantees across versions); the seed is stored in each file's metadata.
"""
import argparse
import json
import math
import os
import random
import struct
import sys
from fractions import Fraction

SEED = 20250607
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)                             # AutoAWQ order_map / AWQ_ORDER
REV = tuple(sorted(range(8), key=lambda i: ORDER[i]))       # argsort(ORDER) = AWQ_REVERSE_ORDER

# ------------------------------------------------------------------ float emulation
def fl32(x):
    """Round a double to IEEE binary32 (RNE; overflow -> inf)."""
    if not math.isfinite(x):
        return x
    try:
        return struct.unpack('<f', struct.pack('<f', x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)

def fp16(x):
    """Round a double to IEEE binary16 (RNE; overflow -> inf). struct '<e' is correctly rounded."""
    if not math.isfinite(x):
        return x
    try:
        return struct.unpack('<e', struct.pack('<e', x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)

def bf16_bits(x):
    """bfloat16 bits of x: x -> float32, then RNE on the float32 bits (torch / __float2bfloat16)."""
    b = struct.unpack('<I', struct.pack('<f', x))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF

def bf16(x):
    return struct.unpack('<f', struct.pack('<I', bf16_bits(x) << 16))[0]

def to_dtype(x, dtype):
    return bf16(x) if dtype == 'BF16' else fp16(x)

def rne(x):
    """torch.round: round half to even; +-inf stay."""
    return x if not math.isfinite(x) else float(round(x))

def clamp(x, lo, hi):
    return min(max(x, lo), hi)

FP16_1E5 = fp16(1e-5)         # clamp(min=1e-5) on a half tensor compares with 168 * 2^-24
F32_INV15 = fl32(1.0 / 15)    # 0x3D888889: PyTorch's x / 15 on CUDA is x * fl32(1/15) (AWQ.md §1, P1)
F32_1E5 = fl32(1e-5)

def rand_gauss(rng):
    """Approximately N(0, 1) (Irwin-Hall, 12 uniforms): no libm, so identical on every platform."""
    return sum(rng.random() for _ in range(12)) - 6.0

def rand_int(rng, n):
    return int(rng.random() * n)

def transpose(m):
    return [list(r) for r in zip(*m)]

# ------------------------------------------------------------------ AWQ quantization (AWQ.md §1)
def pseudo_quantize_tensor_fp16(w, G):
    """AutoAWQ pseudo_quantize_tensor (zero_point, w_bit 4) after layer.half(): fp16 arithmetic.
    w: [N][K] values of the input dtype. Returns u [N][K], z [N][K/G], s [N][K/G] (fp16 values)."""
    K = len(w[0])
    G = K if G == -1 else G
    U, Z, S = [], [], []
    for row in w:
        wh = [fp16(v) for v in row]                            # .half(): bf16 -> fp16 RNE
        u_row, z_row, s_row = [], [], []
        for g in range(K // G):
            grp = wh[g * G:(g + 1) * G]
            max_val, min_val = max(grp), min(grp)
            diff = fp16(max_val - min_val)
            diffc = diff if diff >= FP16_1E5 else FP16_1E5     # .clamp(min=1e-5)
            s = fp16(fl32(diffc * F32_INV15))                  # / 15 == * fl32(1/15), float then half
            z = clamp(-rne(fp16(min_val / s)), 0.0, 15.0)      # (-round(min / s)).clamp(0, 15)
            for v in grp:                                      # clamp(round(w / s) + z, 0, 15)
                u_row.append(int(clamp(fp16(rne(fp16(v / s)) + z), 0.0, 15.0)))
            z_row.append(int(z))
            s_row.append(s)
        U.append(u_row); Z.append(z_row); S.append(s_row)
    return U, Z, S

def pseudo_quantize_tensor_fp32(w, G):
    """The same formula with every op rounded to float32 (wsync's float32 variant)."""
    K = len(w[0])
    G = K if G == -1 else G
    U, Z, S = [], [], []
    for row in w:
        u_row, z_row, s_row = [], [], []
        for g in range(K // G):
            grp = [float(v) for v in row[g * G:(g + 1) * G]]   # exact (bf16/fp16 -> f32)
            max_val, min_val = max(grp), min(grp)
            diff = fl32(max_val - min_val)
            s = fl32(max(diff, F32_1E5) / 15.0)
            z = clamp(-rne(fl32(min_val / s)), 0.0, 15.0)
            for v in grp:
                u_row.append(int(clamp(fl32(rne(fl32(v / s)) + z), 0.0, 15.0)))
            z_row.append(int(z))
            s_row.append(s)
        U.append(u_row); Z.append(z_row); S.append(s_row)
    return U, Z, S

def from_linear_intweight_fp16(U, Z, S, G):
    """WQLinear_GEMM.from_linear's re-derivation round((w_fake + z*s) / s) in fp16, with
    w_fake = (q - z) * s (AWQ.md §1 note). A diagnostic only: it should reproduce the stored codes."""
    K = len(U[0]); G = K if G == -1 else G
    out = []
    for n in range(len(U)):
        row = []
        for k in range(K):
            z, s = float(Z[n][k // G]), S[n][k // G]
            w_fake = fp16(fp16(U[n][k] - z) * s)
            row.append(int(rne(fp16(fp16(w_fake + fp16(z * s)) / s))))
        out.append(row)
    return out

# ------------------------------------------------------------------ AWQ packing (AWQ.md §2)
def awq_gemm_pack(intweight):
    """AutoAWQ WQLinear_GEMM.from_linear: intweight [R][C] (K-major) -> int32 [R][C/8];
    qweight[:, col] |= intweight[:, col*8 + order_map[i]] << 4i."""
    R, C = len(intweight), len(intweight[0])
    packed = [[0] * (C // 8) for _ in range(R)]
    for col in range(C // 8):
        for i in range(8):
            for r in range(R):
                packed[r][col] |= int(intweight[r][col * 8 + ORDER[i]]) << (4 * i)
    return packed

def pack_cols(q):
    """vLLM quant_utils.pack_cols: column c -> word c/8, nibble c%8."""
    out = [[0] * (len(q[0]) // 8) for _ in q]
    for r, row in enumerate(q):
        for c, v in enumerate(row):
            out[r][c // 8] |= (v & 0xF) << (4 * (c % 8))
    return out

def unpack_cols(p):
    """vLLM quant_utils.unpack_cols: nibble i of word w -> column 8w + i."""
    return [[(word >> (4 * i)) & 0xF for word in row for i in range(8)] for row in p]

def permute_chunks(flat, perm):
    """numpy x.reshape(-1, len(perm))[:, perm].ravel(): out[j] = in[perm[j]] per chunk."""
    L = len(perm)
    return [flat[b + perm[j]] for b in range(0, len(flat), L) for j in range(L)]

def reshape(flat, cols):
    return [flat[i:i + cols] for i in range(0, len(flat), cols)]

def awq_pack_vllm(q):
    """vLLM quant_utils.awq_pack (self-test only): interleave every 8 columns with ORDER, pack_cols."""
    return pack_cols(reshape(permute_chunks([v for r in q for v in r], ORDER), len(q[0])))

def unpack_awq_reverse_order(p):
    """AutoAWQ packing_utils.unpack_awq + reverse_awq_order (the inverse of awq_gemm_pack)."""
    iw = [[(word >> s) & 0xF for word in row for s in range(0, 32, 4)] for row in p]
    return [[r[8 * (c // 8) + REV[c % 8]] for c in range(len(r))] for r in iw]

# ------------------------------------------------------------------ AWQ -> Marlin (AWQ.md §3)
def awq_marlin_repack(qweight, size_k, size_n):
    """vLLM csrc/quantization/gptq_marlin/awq_marlin_repack.cu (num_bits 4), AWQ.md §3.1:
    per 16x64 tile a shared stage, lane th of warp < 4 gathers its 8 nibbles."""
    tile_k, tile_n, pack_factor = 16, 64, 8
    n_tiles = size_n // tile_n
    sh_stride = tile_n // pack_factor                                  # tile_n_ints = 8
    out = [0] * ((size_k // 16) * (size_n * 16 // pack_factor))
    undo_pack = (0, 4, 1, 5, 2, 6, 3, 7)
    pack_idx = (0, 2, 4, 6, 1, 3, 5, 7)
    tc_offsets = (0, 1, 8, 9)
    for k_tile_id in range(size_k // tile_k):
        for n_tile_id in range(n_tiles):
            # fetch_to_shared: 16 rows x 8 words of qweight
            sh = [qweight[k_tile_id * tile_k + k][n_tile_id * sh_stride + c]
                  for k in range(tile_k) for c in range(sh_stride)]
            out_offset = (k_tile_id * n_tiles + n_tile_id) * (tile_k * tile_n // pack_factor)
            for warp_id in range(4):                                   # repack_tile
                for th_id in range(32):
                    tc_col, tc_row = th_id // 4, (th_id % 4) * 2
                    cur_n = warp_id * 16 + tc_col
                    cur_n_packed, cur_n_pos = cur_n // pack_factor, cur_n % pack_factor
                    pos = undo_pack[cur_n_pos]
                    vals = [0] * 8
                    for i in range(4):
                        cur_elem = tc_row + tc_offsets[i]
                        src0 = sh[cur_n_packed + sh_stride * cur_elem]
                        src1 = sh[cur_n_packed + (8 // pack_factor) + sh_stride * cur_elem]
                        vals[i] = (src0 >> (pos * 4)) & 0xF
                        vals[4 + i] = (src1 >> (pos * 4)) & 0xF
                    res = 0
                    for i in range(8):
                        res |= vals[pack_idx[i]] << (i * 4)
                    out[out_offset + th_id * 4 + warp_id] = res
    return reshape(out, size_n * 2)

def get_weight_perm_4bit():
    """vLLM marlin_utils_test.get_weight_perm(4) (FORMATS.md §4.4; self-test only)."""
    perm = []
    for i in range(32):
        col = i // 4
        perm1 = [16 * row + col + 8 * block for block in (0, 1)
                 for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)]
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    return permute_chunks(perm, ORDER)

def marlin_weights(q, size_k, size_n):
    """vLLM marlin_utils_test.marlin_weights(q_w[K][N], perm=get_weight_perm(4)) (self-test only)."""
    rows = []
    for kt in range(size_k // 16):   # reshape [K/16,16,N/16,16] -> permute(0,2,1,3) -> [K/16, 16N]
        rows.append([q[16 * kt + r][16 * nb + c] for nb in range(size_n // 16)
                     for r in range(16) for c in range(16)])
    perm = get_weight_perm_4bit()
    return pack_cols([permute_chunks(r, perm) for r in rows])

def get_scale_perms():
    """vLLM marlin_utils.get_scale_perms (FORMATS.md §5)."""
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    scale_perm_single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return scale_perm, scale_perm_single

def marlin_permute_scales(s, size_k, size_n, group_size):
    """vLLM marlin_utils.marlin_permute_scales (AWQ.md §3.2, FORMATS.md §5)."""
    scale_perm, scale_perm_single = get_scale_perms()
    flat = [v for r in s for v in r]
    if group_size < size_k and group_size != -1:
        flat = permute_chunks(flat, scale_perm)
    else:
        flat = permute_chunks(flat, scale_perm_single)
    return reshape(flat, size_n)

def marlin_zero_points(zp, size_k, size_n):
    """vLLM marlin_utils.marlin_zero_points (4 bit): scale_perm, ORDER interleave, pack_cols."""
    scale_perm, _ = get_scale_perms()
    flat = permute_chunks([v for r in zp for v in r], scale_perm)
    flat = permute_chunks(flat, ORDER)
    return pack_cols(reshape(flat, size_n))

def awq_to_marlin_zero_points(q_zp_packed, size_k, size_n):
    """vLLM marlin_utils.awq_to_marlin_zero_points (AWQ.md §3.3)."""
    q_zp = unpack_cols(q_zp_packed)
    undo_interleave = sorted(range(8), key=lambda i: ORDER[i])     # numpy.argsort(ORDER)
    q_zp = reshape(permute_chunks([v for r in q_zp for v in r], undo_interleave), size_n)
    return marlin_zero_points(q_zp, size_k, size_n)

# ------------------------------------------------------------------ TensorRT-LLM (TRTLLM_INT4.md)
PERM_W4_A16 = (0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
               4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31)
PERM_W4_AFP8 = (0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23,
                8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)
# LayoutDetailsB<TypeA, uint4b_t, Arch> (§2): rows_per_column_tile, columns_interleaved
LAYOUT = {'W4_A16': (64, 4), 'W4_AFP8': (128, 2)}

def words_of(buf):
    return list(struct.unpack('<%dI' % (len(buf) // 4), bytes(buf)))

def bytes_of(words):
    return bytearray(struct.pack('<%dI' % len(words), *words))

def pack_int8_tensor_to_packed_int4(q):
    """torch.ops.trtllm.pack_int8_tensor_to_packed_int4: q [E][R][C] -> bytes packed along C (§1)."""
    return bytearray((row[2 * j] & 0xF) | ((row[2 * j + 1] & 0xF) << 4)
                     for m in q for row in m for j in range(len(row) // 2))

def permute_B_rows_for_mixed_gemm(src, shape, perm):
    """§1 step 1 (cutlass_preprocessors.cpp): rows permuted inside groups of 32, in 32-bit words."""
    num_experts, num_rows, num_cols = shape
    B_ROWS_PER_MMA = 8 * (16 // 4)
    num_vec_cols = num_cols // 8
    assert num_rows % B_ROWS_PER_MMA == 0 and num_cols % 8 == 0 and len(perm) == B_ROWS_PER_MMA
    inp = words_of(src); out = [0] * len(inp)
    for expert in range(num_experts):
        matrix_offset = expert * num_rows * num_vec_cols
        for base_row in range(0, num_rows, B_ROWS_PER_MMA):
            for tile_row in range(B_ROWS_PER_MMA):
                for write_col in range(num_vec_cols):
                    read_row = base_row + perm[tile_row]
                    out[matrix_offset + (base_row + tile_row) * num_vec_cols + write_col] = \
                        inp[matrix_offset + read_row * num_vec_cols + write_col]
    return bytes_of(out)

def subbyte_transpose(src, shape):
    """§1 step 2: subbyte_transpose_impl<W4_*>: 64x64-element cache tiles, pairwise nibble swaps."""
    num_experts, num_rows, num_cols = shape
    col_bytes, col_bytes_trans = num_cols // 2, num_rows // 2
    M_TILE_L1, ELTS_PER_BYTE = 64, 2
    N_TILE_L1 = M_TILE_L1 // ELTS_PER_BYTE
    assert col_bytes_trans % 32 == 0 and col_bytes % 32 == 0           # VECTOR_WIDTH = 32
    out = bytearray(len(src))
    for expert in range(num_experts):
        matrix_offset = expert * num_rows * col_bytes
        for row_tile_start in range(0, num_rows, M_TILE_L1):
            for col_tile_start_byte in range(0, col_bytes, N_TILE_L1):
                cache_buf = [[src[matrix_offset + (row_tile_start + ii) * col_bytes
                                  + col_tile_start_byte + jj] for jj in range(N_TILE_L1)]
                             for ii in range(M_TILE_L1)]
                for ii in range(M_TILE_L1):
                    for jj in range(ii + 1, M_TILE_L1):
                        ii_byte, ii_bit_offset = ii // ELTS_PER_BYTE, ii % ELTS_PER_BYTE
                        jj_byte, jj_bit_offset = jj // ELTS_PER_BYTE, jj % ELTS_PER_BYTE
                        src_elt = 0xF & (cache_buf[ii][jj_byte] >> (4 * jj_bit_offset))
                        tgt_elt = 0xF & (cache_buf[jj][ii_byte] >> (4 * ii_bit_offset))
                        cache_buf[ii][jj_byte] &= 0xF0 >> (4 * jj_bit_offset)
                        cache_buf[jj][ii_byte] &= 0xF0 >> (4 * ii_bit_offset)
                        cache_buf[ii][jj_byte] |= tgt_elt << (4 * jj_bit_offset)
                        cache_buf[jj][ii_byte] |= src_elt << (4 * ii_bit_offset)
                row_tile_start_trans = col_tile_start_byte * ELTS_PER_BYTE
                col_tile_start_byte_trans = row_tile_start // ELTS_PER_BYTE
                for ii in range(M_TILE_L1):
                    base = matrix_offset + (row_tile_start_trans + ii) * col_bytes_trans \
                        + col_tile_start_byte_trans
                    out[base:base + N_TILE_L1] = bytes(cache_buf[ii])
    return out

def interleave_column_major_tensor(src, shape, rows_per_tile, interleave):
    """§1 step 3: words of the column-major [N][K/8] data regrouped by tiles of I columns."""
    num_experts, num_rows, num_cols = shape
    assert num_rows % 8 == 0 and num_rows % rows_per_tile == 0
    num_vec_rows, vec_rows_per_tile = num_rows // 8, rows_per_tile // 8
    inp = words_of(src); out = [0] * len(inp)
    for expert in range(num_experts):
        matrix_offset = expert * num_vec_rows * num_cols
        for read_col in range(num_cols):
            write_col = read_col // interleave
            for base_vec_row in range(0, num_vec_rows, vec_rows_per_tile):
                for vec_read_row in range(base_vec_row, min(num_vec_rows, base_vec_row + vec_rows_per_tile)):
                    vec_write_row = interleave * base_vec_row \
                        + vec_rows_per_tile * (read_col % interleave) + vec_read_row % vec_rows_per_tile
                    out[matrix_offset + write_col * num_vec_rows * interleave + vec_write_row] = \
                        inp[matrix_offset + read_col * num_vec_rows + vec_read_row]
    return bytes_of(out)

def add_bias_and_interleave_int4s_inplace(buf):
    """§1 step 4: +8 on every (sign-extended) nibble, then the register interleave per 32-bit word."""
    for ii in range(len(buf)):
        lo, hi = buf[ii] & 0xF, buf[ii] >> 4
        first = (lo - 16 if lo >= 8 else lo) + 8            # int8_t(b << 4) >> 4, + 8
        second = (hi - 16 if hi >= 8 else hi) + 8           # int8_t(b) >> 4, + 8
        assert 0 <= first <= 15 and 0 <= second <= 15, "Illegal result for int4 transform"
        buf[ii] = first | (second << 4)
    assert len(buf) % 4 == 0
    regs = words_of(buf)
    for ii, cur in enumerate(regs):
        res = 0
        for dest_idx in range(8):
            src_idx = 2 * dest_idx if dest_idx < 4 else 2 * (dest_idx - 4) + 1
            res |= ((cur >> (4 * src_idx)) & 0xF) << (4 * dest_idx)
        regs[ii] = res
    buf[:] = bytes_of(regs)

def preprocess_weights_for_mixed_gemm(q, rank, quant_type, arch):
    """§1/§2, T1: q [E][K][N] signed int4 values (E = 1 with rank 2 for a dense weight).
    force_interleave is set for expert stacks (rank 3): MoE has no Hopper W4A16 kernels."""
    shape = (len(q), len(q[0]), len(q[0][0]))
    force_interleave = rank == 3
    if force_interleave and arch >= 90:
        arch = 80
    if arch >= 120:
        arch = 80
    rows_per_tile, columns_interleaved = LAYOUT[quant_type]
    uses_imma_ldsm = True                       # OpMultiplyAddDequantizeInterleavedBToA for uint4b_t
    buf = pack_int8_tensor_to_packed_int4(q)
    if uses_imma_ldsm:
        buf = permute_B_rows_for_mixed_gemm(buf, shape, PERM_W4_A16 if quant_type == 'W4_A16' else PERM_W4_AFP8)
    buf = subbyte_transpose(buf, shape)         # layoutB == COLUMN_MAJOR
    if columns_interleaved > 1 and arch != 90:
        buf = interleave_column_major_tensor(buf, shape, rows_per_tile, columns_interleaved)
    add_bias_and_interleave_int4s_inplace(buf)
    return buf

def w4afp8_sm90_weight(q):
    """§3.2 sm90 W4AFP8 (T7): unpack -> transpose -> pack; signed nibbles, no perm / bias. [E][N][K/2]."""
    return pack_int8_tensor_to_packed_int4([transpose(m) for m in q])

def scale_interleave_factor(K, G):
    """§3.2 (T4 get_weight_scale_interleave_factor): 4 / 2 / 1 for K % 4G / 2G / else."""
    return 4 if K % (4 * G) == 0 else 2 if K % (2 * G) == 0 else 1

def interleave_scales(s, K, G):
    """§3.2 (T5 interleave_scales): [E][K/G][N] -> [E][K/G/I][N*I], out[e][a][n*I+i] = s[e][a*I+i][n]."""
    I = scale_interleave_factor(K, G)
    return [[[m[a * I + i][n] for n in range(len(m[0])) for i in range(I)]
             for a in range(len(m) // I)] for m in s]

# ------------------------------------------------------------------ safetensors writer
class SafetensorsWriter:
    SIZES = {'I32': 4, 'BF16': 2, 'F16': 2, 'I8': 1}

    def __init__(self):
        self.tensors = []

    def add(self, name, dtype, shape, values):
        """values: nested lists (floats already representable in dtype, ints as bit patterns) or bytes."""
        flat = bytes(values) if isinstance(values, (bytes, bytearray)) else list(flatten(values))
        assert len(flat) == math.prod(shape), (name, len(flat), shape)
        if dtype == 'I32':
            data = struct.pack('<%dI' % len(flat), *[v & 0xFFFFFFFF for v in flat])
        elif dtype == 'I8':
            data = bytes(flat)
        elif dtype == 'F16':
            assert all(fp16(v) == v for v in flat), name
            data = struct.pack('<%de' % len(flat), *flat)
        else:
            assert all(bf16(v) == v for v in flat), name
            data = struct.pack('<%dH' % len(flat), *[bf16_bits(v) for v in flat])
        self.tensors.append((name, dtype, list(shape), data))

    def write(self, path, metadata):
        # Largest item size first so that every tensor is aligned to its item size.
        order = sorted(self.tensors, key=lambda t: -self.SIZES[t[1]])
        header, off = {'__metadata__': metadata}, 0
        for name, dtype, shape, data in order:
            header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [off, off + len(data)]}
            off += len(data)
        h = json.dumps(header, separators=(',', ':')).encode()
        h += b' ' * (-len(h) % 8)
        with open(path, 'wb') as f:
            f.write(struct.pack('<Q', len(h)) + h + b''.join(t[3] for t in order))

def flatten(x):
    if isinstance(x, list):
        for v in x:
            yield from flatten(v)
    else:
        yield x

# ------------------------------------------------------------------ file 1: AWQ golden
def awq_case_weights(rng, name):
    """Returns (dtype, E or None, N, K, G, w [E][N][K], edge list)."""
    def grp_fill(w, row, g, G, fn):
        for k in range(g * G, (g + 1) * G):
            w[row][k] = fn(k - g * G)
    if name == 'a_bf16_g128':
        N, K, G, dt = 128, 256, 128, 'BF16'
        w = [[bf16(rand_gauss(rng) * 0.02) for _ in range(K)] for _ in range(N)]
        ties = [0.0, 15.0, 0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5, 10.5, 11.5, 12.5, 13.5, 14.5,
                1.0, 2.0, 7.0, 14.0]
        huge = lambda j: 19968.0 if j == 0 else -19968.0 if j == 1 else \
            bf16(clamp(rand_gauss(rng) * 6000.0, -19968.0, 19968.0))
        edges = [(0, 0, 'zero', lambda j: 0.0),
                 (1, 1, 'all_positive (min > 0: z = 0, top codes clip at 15)',
                  lambda j: bf16(0.01 + 0.05 * rng.random())),
                 (2, 0, 'all_negative (max < 0: z clamps to 15)', lambda j: bf16(-0.01 - 0.05 * rng.random())),
                 (3, 1, 'constant_positive 0.3 (diff clamps to 1e-5, w/s = inf in fp16)', lambda j: bf16(0.3)),
                 (4, 0, 'constant_negative -0.0123', lambda j: bf16(-0.0123)),
                 (5, 1, 'huge (+-19968, max - min = 39936)', huge),
                 (6, 0, 'tiny (gauss * 1e-6: fp16 subnormals, diff clamps)', lambda j: bf16(rand_gauss(rng) * 1e-6)),
                 (7, 1, 'ties (min 0, max 15, s = 1: halves round to even)', lambda j: ties[j % len(ties)]),
                 (8, 0, 'zero_point_tie (min -7.5, max 7.5, s = 1: z = 8, 7.5 clips at 15)',
                  lambda j: [-7.5, 7.5, -6.5, 6.5, -0.5, 0.5, 2.5, -2.5][j % 8])]
    elif name == 'b_f16_g64':
        N, K, G, dt = 64, 128, 64, 'F16'
        w = [[fp16(rand_gauss(rng) * 0.05) for _ in range(K)] for _ in range(N)]
        ties = [0.0, 15.0, 0.5, 2.5, 3.5, 14.5, 5.5, 8.5, 9.5, 11.5, 12.5, 4.0]
        edges = [(0, 1, 'all_positive', lambda j: fp16(0.02 + 0.08 * rng.random())),
                 (1, 0, 'all_negative', lambda j: fp16(-0.02 - 0.08 * rng.random())),
                 (2, 1, 'ties (min 0, max 15, s = 1)', lambda j: ties[j % len(ties)]),
                 (3, 0, 'zero', lambda j: 0.0),
                 (4, 1, 'subnormal (gauss * 3e-6)', lambda j: fp16(rand_gauss(rng) * 3e-6)),
                 (5, 0, 'huge (+-30000)', lambda j: 30000.0 if j == 0 else -30000.0 if j == 1 else
                  fp16(clamp(rand_gauss(rng) * 9000.0, -30000.0, 30000.0)))]
    elif name == 'c_moe_bf16_g32':
        N, K, G, dt = 64, 128, 32, 'BF16'
        w3 = [[[bf16(rand_gauss(rng) * (0.02 if e == 0 else 0.1)) for _ in range(K)] for _ in range(N)]
              for e in range(2)]
        return dt, 2, N, K, G, w3, []
    else:  # d_f16_channelwise
        N, K, G, dt = 64, 128, -1, 'F16'
        w = [[fp16(rand_gauss(rng) * 0.05) for _ in range(K)] for _ in range(N)]
        edges = [(0, 0, 'all_positive', lambda j: fp16(0.02 + 0.08 * rng.random()))]
    Gf = K if G == -1 else G
    for row, g, _, fn in edges:
        grp_fill(w, row, g, Gf, fn)
    return dt, None, N, K, G, [w], [{'row': r, 'group': g, 'case': d} for r, g, d, _ in edges]

def build_awq(rng, out_path):
    cases = ['a_bf16_g128', 'b_f16_g64', 'c_moe_bf16_g32', 'd_f16_channelwise']
    wr, meta, notes = SafetensorsWriter(), {}, []
    for c in cases:
        dt, E, N, K, G, w, edges = awq_case_weights(rng, c)
        Gf = K if G == -1 else G
        lead = [E] if E else []
        wr.add(c + '.w', dt, lead + [N, K], w if E else w[0])
        res = {}
        for arith, quant in (('fp16', pseudo_quantize_tensor_fp16), ('fp32', pseudo_quantize_tensor_fp32)):
            qw, qz, sc, mq, mz, ms = [], [], [], [], [], []
            for we in w:                                            # experts are independent (§4)
                U, Z, S = quant(we, G)
                if arith == 'fp16':
                    rederived = from_linear_intweight_fp16(U, Z, S, G)
                    bad = sum(a != b for r1, r2 in zip(U, rederived) for a, b in zip(r1, r2))
                    notes.append('%s: from_linear re-derivation differs from q in %d codes' % (c, bad))
                qweight = awq_gemm_pack(transpose(U))               # intweight.t(): [K][N]
                qzeros = awq_gemm_pack(transpose(Z))                # zeros.t(): [K/G][N]
                scales = [[to_dtype(v, dt) for v in r] for r in transpose(S)]
                qw.append(qweight); qz.append(qzeros); sc.append(scales)
                if arith == 'fp16':                                 # AWQ.md §3 (per expert, §4)
                    mq.append(awq_marlin_repack(qweight, K, N))
                    mz.append(awq_to_marlin_zero_points(qzeros, K // Gf, N))
                    ms.append(marlin_permute_scales(scales, K, N, G))
            pick = (lambda x: x) if E else (lambda x: x[0])
            wr.add('%s.%s.qweight' % (c, arith), 'I32', lead + [K, N // 8], pick(qw))
            wr.add('%s.%s.qzeros' % (c, arith), 'I32', lead + [K // Gf, N // 8], pick(qz))
            wr.add('%s.%s.scales' % (c, arith), dt, lead + [K // Gf, N], pick(sc))
            if arith == 'fp16':
                wr.add(c + '.fp16.marlin_qweight', 'I32', lead + [K // 16, 2 * N], pick(mq))
                wr.add(c + '.fp16.marlin_qzeros', 'I32', lead + [K // Gf, N // 8], pick(mz))
                wr.add(c + '.fp16.marlin_scales', dt, lead + [K // Gf, N], pick(ms))
            res[arith] = qw
        a16, a32 = list(flatten(res['fp16'])), list(flatten(res['fp32']))
        notes.append('%s: %d of %d qweight words differ between fp16 and fp32 arithmetic'
                     % (c, sum(x != y for x, y in zip(a16, a32)), len(a16)))
        meta[c + '.group_size'] = str(G)
        meta[c + '.edge_rows'] = json.dumps(edges)
    meta.update({'cases': json.dumps(cases), 'seed': str(SEED), 'generator': 'tools/golden/int4_golden.py',
                 'spec': 'docs/spec/AWQ.md §1-§4, FORMATS.md §4-§5'})
    wr.write(out_path, meta)
    return notes

# ------------------------------------------------------------------ file 2: TRT-LLM golden
def rand_scale(rng, dt, i):
    """Positive scales; every 16th one in [2^-23, 2^-17] (fp16 subnormal: the fp16 conversion rounds)."""
    v = 2.0 ** -(17 + 6 * rng.random()) if i % 16 == 5 else 0.002 + 0.03 * rng.random()
    return to_dtype(v, dt)

def build_trtllm(rng, out_path):
    cases = [  # name, kind, scale dtype, E, N, K, G, variants
        ('t_ct_dense_bf16', 'ct', 'BF16', None, 128, 256, 128, ['sm80', 'sm90']),
        ('t_ct_moe_bf16', 'ct', 'BF16', 2, 128, 256, 64, ['sm80', 'sm90', 'sm80_w4afp8', 'sm90_w4afp8']),
        ('t_awq_dense_f16', 'awq', 'F16', None, 64, 128, 64, ['sm80', 'sm90']),
        ('t_awq_moe_bf16', 'awq', 'BF16', 2, 128, 256, 128, ['sm80', 'sm90', 'sm80_w4afp8'])]
    wr, meta = SafetensorsWriter(), {}
    for c, kind, dt, E, N, K, G, variants in cases:
        Ex, lead, rank = E or 1, [E] if E else [], 3 if E else 2
        pick = (lambda x: x) if E else (lambda x: x[0])
        q, s_kn, zero_kn = [], [], []                    # per expert: q[K][N] signed, s/zero [K/G][N]
        if kind == 'ct':                                 # compressed-tensors pack-quantized (FORMATS.md §2)
            packed, scale = [], []
            for _ in range(Ex):
                u = [[rand_int(rng, 16) for _ in range(K)] for _ in range(N)]
                packed.append([[sum(u[n][8 * j + i] << (4 * i) for i in range(8)) for j in range(K // 8)]
                               for n in range(N)])
                scale.append([[rand_scale(rng, dt, n * 7 + g) for g in range(K // G)] for n in range(N)])
            wr.add(c + '.weight_packed', 'I32', lead + [N, K // 8], pick(packed))
            wr.add(c + '.weight_scale', dt, lead + [N, K // G], pick(scale))
            for p, sc in zip(packed, scale):             # unpack_from_int32 (u - 8), then [N][K] -> [K][N]
                q.append(transpose([[((w >> (4 * i)) & 0xF) - 8 for w in row for i in range(8)] for row in p]))
                s_kn.append(transpose(sc))
        else:                                            # AutoAWQ GEMM checkpoint (AWQ.md §2)
            qweight, qzeros, scales = [], [], []
            for _ in range(Ex):
                u = [[rand_int(rng, 16) for _ in range(N)] for _ in range(K)]
                z = [[rand_int(rng, 16) for _ in range(N)] for _ in range(K // G)]
                qweight.append(awq_gemm_pack(u)); qzeros.append(awq_gemm_pack(z))
                scales.append([[rand_scale(rng, dt, g * 3 + n) for n in range(N)] for g in range(K // G)])
            wr.add(c + '.qweight', 'I32', lead + [K, N // 8], pick(qweight))
            wr.add(c + '.qzeros', 'I32', lead + [K // G, N // 8], pick(qzeros))
            wr.add(c + '.scales', dt, lead + [K // G, N], pick(scales))
            for qwt, qzt, sc in zip(qweight, qzeros, scales):   # §3.1: q = u - 8, zero = (8 - z) * s
                q.append([[v - 8 for v in row] for row in unpack_awq_reverse_order(qwt)])
                z = unpack_awq_reverse_order(qzt)
                s_kn.append(sc)
                zero = []
                for zr, sr in zip(z, sc):
                    prods = [float(8 - zz) * ss for zz, ss in zip(zr, sr)]
                    assert all(fl32(p) == p for p in prods)      # exact: one rounding to the dtype
                    zero.append([to_dtype(p, dt) for p in prods])
                zero_kn.append(zero)
        for v in variants:
            if v == 'sm90_w4afp8':
                assert kind == 'ct' and E
                wr.add(c + '.%s.weight' % v, 'I8', [E, N, K // 2], w4afp8_sm90_weight(q))
                I = scale_interleave_factor(K, G)
                wr.add(c + '.%s.weight_scale' % v, 'BF16', [E, K // G // I, N * I],
                       interleave_scales([[[bf16(x) for x in r] for r in m] for m in s_kn], K, G))
                continue
            quant_type, arch = {'sm80': ('W4_A16', 80), 'sm90': ('W4_A16', 90),
                                'sm80_w4afp8': ('W4_AFP8', 89)}[v]
            wr.add(c + '.%s.weight' % v, 'I8', lead + [K, N // 2],
                   preprocess_weights_for_mixed_gemm(q, rank, quant_type, arch))
            if quant_type == 'W4_A16':
                wr.add(c + '.%s.weight_scale' % v, dt, lead + [K // G, N], pick(s_kn))
                if kind == 'awq':
                    wr.add(c + '.%s.weight_zero' % v, dt, lead + [K // G, N], pick(zero_kn))
            else:
                wr.add(c + '.%s.weight_scale' % v, 'F16', lead + [K // G, N],
                       pick([[[fp16(x) for x in r] for r in m] for m in s_kn]))
        meta[c + '.group_size'] = str(G)
        meta[c + '.kind'] = kind
        meta[c + '.variants'] = json.dumps(variants)
        meta[c + '.dims'] = json.dumps({'E': E, 'N': N, 'K': K, 'G': G})
    meta.update({'cases': json.dumps([c[0] for c in cases]), 'seed': str(SEED),
                 'generator': 'tools/golden/int4_golden.py', 'spec': 'docs/spec/TRTLLM_INT4.md §1-§4'})
    wr.write(out_path, meta)

# ------------------------------------------------------------------ self-test
def fp16_reference(x):
    """fp16 RNE from exact rationals (a cross-check of struct '<e')."""
    f, e = abs(Fraction(x)), -14                           # -14: the subnormal exponent floor
    while Fraction(2) ** (e + 1) <= f:
        e += 1
    ulp = Fraction(2) ** (e - 10)
    m, r = divmod(f, ulp)
    m += r > ulp / 2 or (r == ulp / 2 and m % 2 == 1)
    return math.copysign(float(m * ulp) if m * ulp <= 65504 else math.inf, x)

def self_test(rng):
    results = []
    def check(name, cond):
        if not cond:
            raise AssertionError('self-test failed: ' + name)
        results.append(name)
    # float helpers
    samples = [rng.uniform(-70000, 70000) * 2.0 ** -rand_int(rng, 40) for _ in range(3000)]
    samples += [(2 * rand_int(rng, 2048) + 1) * 2.0 ** (-25 + rand_int(rng, 30)) for _ in range(2000)]  # ties
    check('fp16 (struct) == exact-rational RNE on 5000 values incl. ties, subnormals, overflow',
          all(fp16(x) == fp16_reference(x)
              for x in samples + [65519.99, 65520.0, -65520.0, 2.0 ** -25, 3 * 2.0 ** -26]))
    check('fp16(65520) = inf, fp16(65519.99) = 65504', fp16(65520.0) == math.inf and fp16(65519.99) == 65504.0)
    check('fl32(1/15) = 0x3D888889', struct.pack('<f', F32_INV15) == struct.pack('<I', 0x3D888889))
    check('fp16(1e-5) = 168 * 2^-24', FP16_1E5 == 168 * 2.0 ** -24)
    check('bf16 RNE: 0x3F808000 -> 0x3F80, 0x3F818000 -> 0x3F82, 0x3F808001 -> 0x3F81',
          [bf16_bits(struct.unpack('<f', struct.pack('<I', b))[0]) for b in (0x3F808000, 0x3F818000, 0x3F808001)]
          == [0x3F80, 0x3F82, 0x3F81])
    check('round half to even', [rne(x) for x in (0.5, 1.5, 2.5, -2.5, 14.5, math.inf)] == [0, 2, 2, -2, 14, math.inf])
    # AWQ quantization: the ties group (s = 1.0 exactly in both arithmetics)
    U, Z, S = pseudo_quantize_tensor_fp16([[0.0, 15.0, 2.5, 3.5, 0.5, 14.5, 1.5, 7.0]], -1)
    check('fp16 ties: s = 1, z = 0, codes 0 15 2 4 0 14 2 7',
          S == [[1.0]] and Z == [[0]] and U == [[0, 15, 2, 4, 0, 14, 2, 7]])
    U2, Z2, S2 = pseudo_quantize_tensor_fp32([[0.0, 15.0, 2.5, 3.5, 0.5, 14.5, 1.5, 7.0]], -1)
    check('fp32 ties agree', (U2, Z2, S2) == (U, Z, S))
    U, Z, S = pseudo_quantize_tensor_fp16([[0.3] * 8, [-0.3] * 8], -1)
    check('constant groups: w/s overflows fp16 -> (u, z) = (15, 0) and (0, 15)',
          U == [[15] * 8, [0] * 8] and Z == [[0], [15]])
    # AWQ packing (AWQ.md §2)
    check('awq pack example 0..7 -> 0x75316420', awq_gemm_pack([list(range(8))]) == [[0x75316420]])
    qr = [[rand_int(rng, 16) for _ in range(64)] for _ in range(48)]
    check('AutoAWQ packing loop == vLLM awq_pack (random 48x64)', awq_gemm_pack(qr) == awq_pack_vllm(qr))
    check('unpack_awq + reverse_awq_order inverts the packing', unpack_awq_reverse_order(awq_gemm_pack(qr)) == qr)
    # AWQ -> Marlin (AWQ.md §3)
    K, N = 48, 192
    qr = [[rand_int(rng, 16) for _ in range(N)] for _ in range(K)]
    check('awq_marlin_repack(awq_pack(q)) == marlin_weights(q, get_weight_perm(4)) (vLLM test identity)',
          awq_marlin_repack(awq_gemm_pack(qr), K, N) == marlin_weights(qr, K, N))
    w0k = awq_marlin_repack(awq_gemm_pack([[k] * 64 for k in range(16)]), 16, 64)[0][0]        # tag = k
    w0n = awq_marlin_repack(awq_gemm_pack([[n % 16 for n in range(64)]] * 16), 16, 64)[0][0]   # tag = n
    check('marlin word 0 = u[0,0] u[8,0] u[0,8] u[8,8] u[1,0] u[9,0] u[1,8] u[9,8] (FORMATS.md §4.2)',
          [(w0k >> 4 * j) & 0xF for j in range(8)] == [0, 8, 0, 8, 1, 9, 1, 9]
          and [(w0n >> 4 * j) & 0xF for j in range(8)] == [0, 0, 8, 8, 0, 0, 8, 8])
    zq = awq_gemm_pack([[c % 16 for c in range(64)]])
    check('awq_to_marlin_zero_points example -> 0x88880000', awq_to_marlin_zero_points(zq, 1, 64)[0][0] == 0x88880000)
    check('marlin_permute_scales grouped: out[8i+j] = in[i+8j]',
          marlin_permute_scales([list(range(64))], 256, 64, 128)[0][:10] == [0, 8, 16, 24, 32, 40, 48, 56, 1, 9])
    # TensorRT-LLM (TRTLLM_INT4.md §1)
    buf = bytearray(struct.pack('<I', 0x76543210))
    add_bias_and_interleave_int4s_inplace(buf)
    check('add_bias_and_interleave 0x76543210 -> 0xFDB9ECA8', words_of(buf) == [0xFDB9ECA8])
    qr = [[[rand_int(rng, 16) - 8 for _ in range(128)] for _ in range(192)] for _ in range(2)]
    check('subbyte_transpose == plain nibble transpose (2 x 192 x 128)',
          subbyte_transpose(pack_int8_tensor_to_packed_int4(qr), (2, 192, 128))
          == pack_int8_tensor_to_packed_int4([transpose(m) for m in qr]))
    # §1.1 worked example: tag values by (k, n) so that each nibble identifies its source
    K, N = 128, 64
    for tag_name, tag in (('k % 16', lambda k, n: k % 16), ('n % 16', lambda k, n: n % 16),
                          ('k // 16 + 4 * (n % 2)', lambda k, n: k // 16 + 4 * (n % 2))):
        q = [[[tag(k, n) - 8 for n in range(N)] for k in range(K)]]
        ws = words_of(preprocess_weights_for_mixed_gemm(q, 2, 'W4_A16', 80))
        def expect(word_col, kp0):
            rows = [32 * ((kp0 + j) // 32) + PERM_W4_A16[(kp0 + j) % 32] for j in range(8)]
            vals = [tag(r, word_col) for r in rows]
            return sum(vals[(0, 2, 4, 6, 1, 3, 5, 7)[j]] << (4 * j) for j in range(8))
        check('TRT sm80 W4A16 §1.1 example (tag %s): words 0, 1, 8, 16, 24, 32' % tag_name,
              [ws[i] for i in (0, 1, 8, 16, 24, 32)] == [expect(0, 0), expect(0, 8), expect(1, 0), expect(2, 0),
                                                         expect(3, 0), expect(0, 64)])
    return results

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--out', default='tests/data/golden', help='output directory')
    ap.add_argument('--self-test-only', action='store_true')
    args = ap.parse_args()
    for r in self_test(random.Random(SEED + 1)):                    # its own stream: files do not depend on it
        print('self-test ok:', r)
    if args.self_test_only:
        return 0
    os.makedirs(args.out, exist_ok=True)
    notes = build_awq(random.Random(SEED), os.path.join(args.out, 'awq_golden.safetensors'))
    build_trtllm(random.Random(SEED), os.path.join(args.out, 'trtllm_golden.safetensors'))
    for n in notes:
        print('note:', n)
    for f in ('awq_golden.safetensors', 'trtllm_golden.safetensors'):
        size = os.path.getsize(os.path.join(args.out, f))
        print('wrote %s (%d bytes)' % (os.path.join(args.out, f), size))
        assert size < 600 * 1024
    return 0

if __name__ == '__main__':
    sys.exit(main())
