// Plain C++ shared by both ISA builds of quantpipe's CPU kernels (cpu_ops.cpp for AVX-512,
// cpu_ops_avx2.cpp for AVX2): tiling, argument checks, and the scalar parts of the ops. No
// intrinsics here, so this code compiles for whichever target the including file selects.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "thread_pool.h"

namespace qp {

constexpr int64_t kRows = 16;  // output rows per weight block (every blocked layout)
constexpr int64_t kA8Block = 32;  // activations quantized to int8 per block of 32 columns

// Blocks of 16 output rows are split over the threads (thread_pool.h: torch's thread count)
// when each thread gets at least kMinMacsPerThread multiply-adds: every matmul of a decode step
// of a small model (a 576 x 576 layer, one row) is split over 2 threads. The pool's hand-off
// costs a cache-line transfer while its workers spin between a step's ops, and a worker that is
// not there in time takes nothing, so the bound only keeps each chunk well above that cost.
constexpr int64_t kMinMacsPerThread = int64_t{1} << 16;

// int8 dot products do 4x the multiply-adds per instruction of the fp32 FMA kernels: a chunk
// needs more of them for the same time
constexpr int64_t kMinA8MacsPerThread = int64_t{1} << 17;

// Calls tile(block, m0, MT) for every block of 16 output rows and every tile of MT <= MaxTile
// activation rows (MT a compile-time constant: the accumulators stay in registers).
template <int MaxTile, typename Tile>
void for_each_tile(int64_t M, int64_t NB, int64_t K, const Tile& tile,
                   int64_t min_macs = kMinMacsPerThread) {
  static_assert(MaxTile >= 1 && MaxTile <= 8, "tiles of 1..8 rows");
  const int64_t macs_per_block = std::max<int64_t>(1, kRows * K * M);
  const int64_t grain = std::max<int64_t>(1, min_macs / macs_per_block);
  qp::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t m0 = 0; m0 < M; m0 += MaxTile) {
        switch (std::min<int64_t>(MaxTile, M - m0)) {
          case 1: tile(b, m0, std::integral_constant<int, 1>{}); break;
          case 2: if constexpr (MaxTile >= 2) tile(b, m0, std::integral_constant<int, 2>{}); break;
          case 3: if constexpr (MaxTile >= 3) tile(b, m0, std::integral_constant<int, 3>{}); break;
          case 4: if constexpr (MaxTile >= 4) tile(b, m0, std::integral_constant<int, 4>{}); break;
          case 5: if constexpr (MaxTile >= 5) tile(b, m0, std::integral_constant<int, 5>{}); break;
          case 6: if constexpr (MaxTile >= 6) tile(b, m0, std::integral_constant<int, 6>{}); break;
          case 7: if constexpr (MaxTile >= 7) tile(b, m0, std::integral_constant<int, 7>{}); break;
          default: if constexpr (MaxTile >= 8) tile(b, m0, std::integral_constant<int, 8>{});
        }
      }
    }
  });
}

// scales [NB, G, 16] of dtype `dt` and zf fp32 like it, for K columns in groups of group_size
inline void check_group_tensors(const at::Tensor& scales, const c10::optional<at::Tensor>& zf,
                                int64_t NB, int64_t K, int64_t group_size, at::ScalarType dt,
                                int64_t multiple) {
  TORCH_CHECK(group_size > 0 && group_size % multiple == 0 && K % group_size == 0,
              "group_size must be a positive multiple of ", multiple, " dividing K = ", K);
  const int64_t G = K / group_size;
  TORCH_CHECK(scales.scalar_type() == dt && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({NB, G, kRows}),
              "scales must be contiguous ", c10::toString(dt), " [N/16, G, 16]");
  if (zf.has_value()) {
    TORCH_CHECK(zf->scalar_type() == at::kFloat && zf->is_contiguous() &&
                    zf->sizes() == scales.sizes(),
                "zf must be contiguous fp32 [N/16, G, 16]");
  }
}

// The W4A8 layout (runtime/kernels/cpu.py:pack_w4a8): packed uint8 [N/16, K/8, 64]; byte
// 4r + e of chunk (b, c) holds q[16b + r][8c + e] (low nibble) and q[16b + r][8c + 4 + e]
// (high nibble), r < 16, e < 4: the low nibbles of a chunk are 16 rows x 4 columns, as an int8
// dot-product instruction (vpdpbusd, or pmaddubsw + pmaddwd) reads them, rows 0..7 in its
// first 32 bytes. scales fp16 (the checkpoint's, exact) and mz fp32 [N/16, G, 16],
// w = q * scale + mz (mz = -z * scale); mz absent: every zero point is 8 (a symmetric layer),
// mz = -8 * scale computed in the kernel.
inline void check_w4a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mz, int64_t group_size) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 64,
              "packed must be contiguous uint8 [N/16, K/8, 64]");
  const int64_t K = packed.size(1) * 8;
  check_group_tensors(scales, mz, packed.size(0), K, group_size, at::kHalf, kA8Block);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(1) == K, "packed holds K = ", K, ", x has ", x.size(1));
}

// --- w4a8_mm / quantize_a8: activation quantization (W4A8) ------------------------------
// Per row and block of 32 columns: d = amax / 127, xq = round_half_even(x * (127 / amax)) in
// [-127, 127] (0 where amax == 0), and per group qsum = sum over its blocks of d * sum(xq): the
// zero-point term uses the same quantized activations as the dot products, so its rounding
// error is the dot products' (the term cancels most of their error). fp32 arithmetic; each ISA
// gives its quantize_row(x, K, group_size, xq, dx, qsum) for one row, and both builds give
// identical xq, dx and qsum.
struct A8Acts {
  std::vector<int8_t> xq;  // [M, K]
  std::vector<float> dx;  // [M, K / 32]
  std::vector<float> qsum;  // [M, G]
};

template <typename QuantizeRow>
A8Acts quantize_acts(const float* x, int64_t M, int64_t K, int64_t group_size,
                     const QuantizeRow& quantize_row) {
  A8Acts a;
  const int64_t nb = K / kA8Block, G = K / group_size;
  a.xq.resize(M * K);
  a.dx.resize(M * nb);
  a.qsum.resize(M * G);
  qp::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, group_size, a.xq.data() + m * K, a.dx.data() + m * nb,
                   a.qsum.data() + m * G);
  });
  return a;
}

// quantize_a8: (xq int8 [M, K], dx fp32 [M, K / 32], qsum fp32 [M, K / group_size]) as
// w4a8_mm computes them
template <typename QuantizeRow>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_quantize_a8(const at::Tensor& x,
                                                               int64_t group_size,
                                                               const QuantizeRow& quantize_row) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(group_size > 0 && group_size % kA8Block == 0 && K % group_size == 0,
              "group_size must be a positive multiple of 32 dividing K = ", K);
  A8Acts a = quantize_acts(x.data_ptr<float>(), M, K, group_size, quantize_row);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, K / kA8Block}, x.options());
  at::Tensor qsum = at::empty({M, K / group_size}, x.options());
  std::memcpy(xq.data_ptr<int8_t>(), a.xq.data(), a.xq.size());
  std::memcpy(dx.data_ptr<float>(), a.dx.data(), a.dx.size() * sizeof(float));
  std::memcpy(qsum.data_ptr<float>(), a.qsum.data(), a.qsum.size() * sizeof(float));
  return {xq, dx, qsum};
}

// w4a8_mm: y fp32 [M, N] = x fp32 [M, K] @ W^T with int8 activations,
//   y[m, n] = sum_g scale[n, g] * sum_{blocks b of g} dx[m, b] * (sum_k q[n, k] * xq[m, k])
//             + mz[n, g] * qsum[m, g]
// (integer dots exact, scaling and sums fp32). tile(mt, a, m0, K, G, group_size, w, sc, mz,
// out, ldo) computes one block of 16 output rows for mt activation rows from m0: w the block's
// chunks [K/8, 64], sc / mz its [G, 16], out row m at out + m * ldo.
template <int MaxTile, typename QuantizeRow, typename Tile>
at::Tensor run_w4a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mz, int64_t group_size,
                          const QuantizeRow& quantize_row, const Tile& tile) {
  check_w4a8(x, packed, scales, mz, group_size);
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * kRows;
  const int64_t G = K / group_size;
  const A8Acts a = quantize_acts(x.data_ptr<float>(), M, K, group_size, quantize_row);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* scp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const float* mzp = mz.has_value() ? mz->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t wblock = K / 8 * 64, sblock = G * kRows;
  for_each_tile<MaxTile>(M, NB, K, [&](int64_t b, int64_t m0, auto mt) {
    tile(mt, a, m0, K, G, group_size, wp + b * wblock, scp + b * sblock,
         mzp != nullptr ? mzp + b * sblock : nullptr, yp + m0 * N + b * kRows, N);
  }, kMinA8MacsPerThread);
  return y;
}

// --- w8a8_mm: the int8 output head with int8 activations ---------------------------------
// Weights q8 int8 [N/16, K/4, 64]: byte 4r + e of chunk (b, c) holds q[16b + r][4c + e] (16 rows
// x 4 columns, as an int8 dot-product instruction reads them; rows 0..7 in the first 32 bytes),
// q in [-127, 127]; scales fp16 [N/16, K/32, 16]: w = q * scale, per row and block of 32
// columns, symmetric (llama.cpp's Q8_0). The activations are quantized as for w4a8_mm (per
// row and block of 32 columns: xq, dx), and
//   y[m, n] = sum over blocks b of scale[n, b] * dx[m, b] * (sum_{k in b} q[n, k] * xq[m, k])
// (integer dots exact, scaling and sums fp32): llama.cpp's Q8_0 x Q8_0 dot product. Where the
// ISA's instruction multiplies unsigned by signed bytes, it takes q + 128 (q xor 0x80) and
// subtracts 128 * sum(xq) of the block, given as xsum [M, K / 32]. tile(mt, a, xsum, m0, K, w,
// sc, out, ldo) computes one block of 16 output rows for mt activation rows from m0: w the
// block's chunks [K/4, 64], sc its [K/32, 16], out row m at out + m * ldo.
template <int MaxTile, typename QuantizeRow, typename Tile>
at::Tensor run_w8a8_mm(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales,
                          const QuantizeRow& quantize_row, const Tile& tile) {
  TORCH_CHECK(q8.dim() == 3 && q8.scalar_type() == at::kChar && q8.is_contiguous() &&
                  q8.size(2) == 64,
              "q8 must be contiguous int8 [N/16, K/4, 64]");
  const int64_t K = q8.size(1) * 4, NB = q8.size(0), N = NB * kRows, nb = K / kA8Block;
  check_group_tensors(scales, c10::nullopt, NB, K, kA8Block, at::kHalf, kA8Block);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.size(1) == K,
              "x must be contiguous fp32 [M, K] with K = ", K);
  const int64_t M = x.size(0);
  const A8Acts a = quantize_acts(x.data_ptr<float>(), M, K, kA8Block, quantize_row);
  std::vector<int32_t> xsum(M * nb);  // sum of xq per row and block of 32
  for (int64_t i = 0; i < M * nb; ++i) {
    int32_t sum = 0;
    for (int64_t k = 0; k < kA8Block; ++k) sum += a.xq[i * kA8Block + k];
    xsum[i] = sum;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* wp = q8.data_ptr<int8_t>();
  const uint16_t* scp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  for_each_tile<MaxTile>(M, NB, K, [&](int64_t b, int64_t m0, auto mt) {
    tile(mt, a, xsum.data(), m0, K, wp + b * K * kRows, scp + b * nb * kRows,
         yp + m0 * N + b * kRows, N);
  }, kMinA8MacsPerThread);
  return y;
}

// --- w8a32_mm: W8A16 ---------------------------------------------------------------------------
// Weights q8 int8 [N/16, K, 16] = q - 128 (16 output rows side by side per k), scales fp16 and
// zf fp32 [N/16, G, 16]: w = (q - 128) * scale + zf, zf = (128 - z) * scale. int8 -> fp32 is
// exact and the activations stay fp32 (fp32 FMAs): exact products, fp32 sums.
// group_sums(x, n_groups, group_size, sumx): sumx[i] = the fp32 sum of group i of x (for zf);
// tile(mt, x, K, sumx, G, w, sc, zf, group_size, out, ldo): one block of 16 output rows.
template <int MaxTile, typename GroupSums, typename Tile>
at::Tensor run_w8a32_mm(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& zf, int64_t group_size,
                       const GroupSums& group_sums, const Tile& tile) {
  TORCH_CHECK(q8.dim() == 3 && q8.scalar_type() == at::kChar && q8.is_contiguous() &&
                  q8.size(2) == kRows,
              "q8 must be contiguous int8 [N/16, K, 16]");
  check_group_tensors(scales, zf, q8.size(0), q8.size(1), group_size, at::kHalf, 16);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.size(1) == q8.size(1),
              "x must be contiguous fp32 [M, K] with K = ", q8.size(1));
  const int64_t M = x.size(0), K = x.size(1), NB = q8.size(0), N = NB * kRows;
  const int64_t G = K / group_size;
  const float* xp = x.data_ptr<float>();
  std::vector<float> sumx;  // fp32 [M, G], for zero points
  const float* zfp = nullptr;
  if (zf.has_value()) {
    zfp = zf->data_ptr<float>();
    sumx.resize(M * G);
    group_sums(xp, M * G, group_size, sumx.data());
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* wp = q8.data_ptr<int8_t>();
  const uint16_t* scp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t sblock = G * kRows;
  for_each_tile<MaxTile>(M, NB, K, [&](int64_t b, int64_t m0, auto mt) {
    tile(mt, xp + m0 * K, K, zfp ? sumx.data() + m0 * G : nullptr, G, wp + b * K * kRows,
         scp + b * sblock, zfp ? zfp + b * sblock : nullptr, group_size,
         yp + m0 * N + b * kRows, N);
  });
  return y;
}

// --- fp16_mm / bf16_mm: the output head ---------------------------------------------------
// fp16_mm: weights wb fp16 [N/16, K, 16] (16 output rows side by side per k); x fp32 [M, K].
// y[m, 16b + r] = sum_k x[m, k] * float(wb[b, k, r]): fp16 -> fp32 is exact, products and sums
// are fp32 FMAs. tile(mt, x, K, w, out, ldo): one block of 16 output rows for mt rows.
template <int MaxTile, typename Tile>
at::Tensor run_fp16_mm(const at::Tensor& x, const at::Tensor& wb, const Tile& tile) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(wb.dim() == 3 && wb.is_contiguous() && wb.scalar_type() == at::kHalf &&
                  wb.size(2) == kRows && wb.size(1) == x.size(1),
              "wb must be contiguous fp16 [N/16, K, 16] with K = x.size(1) = ", x.size(1));
  const int64_t M = x.size(0), K = x.size(1), NB = wb.size(0), N = NB * kRows;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wb.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  for_each_tile<MaxTile>(M, NB, K, [&](int64_t b, int64_t m0, auto mt) {
    tile(mt, xp + m0 * K, K, wp + b * K * kRows, yp + m0 * N + b * kRows, N);
  });
  return y;
}

// bf16_mm: weights wb bf16 [N/16, K/2, 16, 2] (for each k pair, the 16 rows' (w[k], w[k+1])
// side by side); x rounded to bf16 once (RNE), by round_x(x, xb, n) into XT (bf16 bits, or
// bf16 values held as fp32); fp32 sums. tile(mt, xb, K, w, out, ldo) as for fp16_mm.
template <int MaxTile, typename XT, typename RoundX, typename Tile>
at::Tensor run_bf16_mm(const at::Tensor& x, const at::Tensor& wb, const RoundX& round_x,
                       const Tile& tile) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.size(1) % 2 == 0,
              "x must be contiguous fp32 [M, K] with K even");
  TORCH_CHECK(wb.dim() == 4 && wb.is_contiguous() && wb.scalar_type() == at::kBFloat16 &&
                  wb.size(2) == kRows && wb.size(3) == 2 && wb.size(1) * 2 == x.size(1),
              "wb must be contiguous bf16 [N/16, K/2, 16, 2] with K = x.size(1) = ", x.size(1));
  const int64_t M = x.size(0), K = x.size(1), NB = wb.size(0), N = NB * kRows;
  std::vector<XT> xb(M * K);
  round_x(x.data_ptr<float>(), xb.data(), M * K);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wb.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  for_each_tile<MaxTile>(M, NB, K, [&](int64_t b, int64_t m0, auto mt) {
    tile(mt, xb.data() + m0 * K, K, wp + b * K * kRows, yp + m0 * N + b * kRows, N);
  });
  return y;
}

// Validates paged_attention's arguments; returns the first query row of each sequence [B + 1].
inline std::vector<int64_t> check_paged(const at::Tensor& q, const at::Tensor& k_pool,
                                        const at::Tensor& v_pool, const at::Tensor& block_tables,
                                        const at::Tensor& ctx_lens, const at::Tensor& q_lens) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat,
              "q must be contiguous fp32 [T, H, D]");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.scalar_type() == v_pool.scalar_type() &&
                  (k_pool.scalar_type() == at::kFloat ||
                   k_pool.scalar_type() == at::kBFloat16) &&
                  k_pool.size(3) == q.size(2),
              "k_pool / v_pool must be contiguous fp32 or bf16 [blocks, block_size, KV, D]");
  const int64_t T = q.size(0), H = q.size(1);
  const int64_t NBLK = k_pool.size(0), BS = k_pool.size(1), KV = k_pool.size(2);
  TORCH_CHECK(H % KV == 0 && H / KV <= 64, "query heads ", H,
              " must be a multiple of KV heads ", KV, ", at most 64 per KV head");
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [B, max_blocks]");
  for (const at::Tensor* t : {&ctx_lens, &q_lens})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong &&
                    t->is_contiguous(),
                "ctx_lens and q_lens must be contiguous int64 [B]");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t* qlens = q_lens.data_ptr<int64_t>();
  std::vector<int64_t> q_off(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qlens[b] >= 1 && qlens[b] <= lens[b] && lens[b] <= max_blocks * BS,
                "sequence ", b, ": need 1 <= q_len (", qlens[b], ") <= ctx_len (", lens[b],
                ") <= max_blocks * block_size (", max_blocks * BS, ")");
    for (int64_t j = 0; j < (lens[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(bt[b * max_blocks + j] >= 0 && bt[b * max_blocks + j] < NBLK,
                  "block_tables[", b, ", ", j, "] outside the pool");
    q_off[b + 1] = q_off[b] + qlens[b];
  }
  TORCH_CHECK(q_off[B] == T, "q has ", T, " rows but q_lens sum to ", q_off[B]);
  return q_off;
}

constexpr int64_t kPrefetchBlocks = 1;  // how far ahead the K/V walks ask for rows (2 and 4:
                                        // no faster on the Zen 4 host, docs/runtime.md)

// Row pointers of keys (or values) of one KV head, walking the block table (no division per
// key): slot = table[j / BS] * BS + j % BS, row = pool + (slot * KV + kvh) * D
template <typename T>
struct PagedRows {
  const T* pool;
  const int64_t* table;
  int64_t BS, KV, kvh, D;
  const T* row(int64_t blk, int64_t off) const {
    return pool + ((table[blk] * BS + off) * KV + kvh) * D;
  }
  // Asks for this head's row `off` of block blk (of `blocks` in the table) to be brought into
  // the caches, kPrefetchBlocks blocks ahead of its use (the walks below ask for the first
  // blocks whole with prefetch_first). The blocks lie anywhere in a pool far larger than the
  // caches, so the hardware prefetcher cannot see the next one coming: without this a decode
  // step waits on memory at every block. (inline asm: GCC 12 emitted no instruction for
  // __builtin_prefetch in these loops at -O1 and above.)
  void prefetch(int64_t blk, int64_t off, int64_t blocks) const {
    if (blk >= blocks) return;
    const char* r = reinterpret_cast<const char*>(row(blk, off));
    for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(T)); i += 64)
      asm volatile("prefetcht0 %0" : : "m"(r[i]));
  }
  // rows first .. of the first kPrefetchBlocks blocks a walk from key `first` to n reads
  void prefetch_first(int64_t first, int64_t n) const {
    const int64_t blocks = (n + BS - 1) / BS, last = first / BS + kPrefetchBlocks;
    for (int64_t j = first; j < std::min(n, last * BS); ++j) prefetch(j / BS, j % BS, blocks);
  }
};

// Runs attend(q_rows, G, keys, values, first, n, scale, p, out_rows) for every (sequence, KV
// head, query) of a paged_attention call, over torch's threads; fp32 or bf16 pools. The query
// at position p sees keys first .. p (n = p + 1 of them from key 0): first = 0, or with a
// sliding window (window > 0) p - window + 1 where that is larger (keys at or beyond `window`
// positions back are hidden, transformers' sliding-window rule). A sequence with
// kTiledMinQ or more queries, where D is a multiple of 2 * `lanes` and at most kTiledMaxDim, runs
// attend_long(q_seq, q_len, ctx_len, k_pool, v_pool, table, BS, KV, H, D, window, scale,
// out_seq) instead (simd.h: the same attention in tiles of queries).
constexpr int64_t kTiledMinQ = 16;
constexpr int64_t kTiledMaxDim = 256;

template <typename Attend, typename AttendLong>
at::Tensor run_paged(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& block_tables, const at::Tensor& ctx_lens,
                     const at::Tensor& q_lens, double scale, int64_t window,
                     const Attend& attend, const AttendLong& attend_long, int64_t lanes) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window), got ", window);
  const float sc = static_cast<float>(scale);
  const std::vector<int64_t> q_off = check_paged(q, k_pool, v_pool, block_tables, ctx_lens,
                                                 q_lens);
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t BS = k_pool.size(1), KV = k_pool.size(2), G = H / KV;
  const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t* qlens = q_lens.data_ptr<int64_t>();
  at::Tensor out = at::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto tiled = [&](int64_t b) {
    return qlens[b] >= kTiledMinQ && D % (2 * lanes) == 0 && D <= kTiledMaxDim;
  };
  // threads only for enough work (query-key products): short contexts stay on one thread
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b)
    if (!tiled(b)) work += qlens[b] * (window > 0 ? std::min(lens[b], window) : lens[b]) * H * D;
  const int64_t grain = work < kMinMacsPerThread ? B * KV : 1;
  auto run = [&](const auto* kp, const auto* vp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    for (int64_t b = 0; b < B; ++b)
      if (tiled(b))
        attend_long(qp + q_off[b] * H * D, qlens[b], lens[b], kp, vp, bt + b * max_blocks, BS,
                    KV, H, D, window, sc, op + q_off[b] * H * D);
    qp::parallel_for(0, B * KV, grain, [&](int64_t i0, int64_t i1) {
      std::vector<float> p;  // [G, n] scores, then softmax numerators
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / KV, kvh = i % KV;
        if (tiled(b)) continue;
        const PagedRows<T> keys{kp, bt + b * max_blocks, BS, KV, kvh, D};
        const PagedRows<T> values{vp, bt + b * max_blocks, BS, KV, kvh, D};
        for (int64_t t = 0; t < qlens[b]; ++t) {
          const int64_t n = lens[b] - qlens[b] + 1 + t;  // keys 0 .. this query's position
          const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
          const int64_t row = q_off[b] + t;
          p.resize(G * (n - first));
          // the G query heads of this KV head, in and out
          attend(qp + (row * H + kvh * G) * D, G, keys, values, first, n, sc, p.data(),
                 op + (row * H + kvh * G) * D);
        }
      }
    });
  };
  if (k_pool.scalar_type() == at::kFloat) {
    run(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  } else {
    run(reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>()));
  }
  return out;
}

// out_g += sum_j w_g[j] v_j over first <= j < n, key by key (w_g[j] = p[g * cnt + j - first] *
// inv[g], the softmax weights; cnt = n - first), each value row brought in a block ahead:
// axpy(alpha, v_j, out_g, D) per key and head. The ISA file's weighted_values does the same
// sums (same FMAs in the same order) with the heads' outputs held in registers.
template <typename T, typename Axpy>
inline void axpy_values(const float* p, const float* inv, int64_t G, const PagedRows<T>& values,
                        int64_t first, int64_t n, float* out, const Axpy& axpy) {
  const int64_t D = values.D, BS = values.BS, cnt = n - first, blocks = (n + BS - 1) / BS;
  for (int64_t blk = first / BS; blk * BS < n; ++blk) {  // block by block
    for (int64_t j = std::max(first, blk * BS); j < std::min(n, (blk + 1) * BS); ++j) {
      values.prefetch(blk + kPrefetchBlocks, j - blk * BS, blocks);
      const T* vr = values.row(blk, j - blk * BS);
      for (int64_t g = 0; g < G; ++g) axpy(p[g * cnt + j - first] * inv[g], vr, out + g * D, D);
    }
  }
}

// out_g = softmax(scale * q_g . k_j over first <= j < n) . v_j for the G query heads of one KV
// head (out zeroed by the caller); p: [G, n - first] scratch. The ISA's kernels: scores(q, G,
// keys, first, n, scale, p) for D a multiple of Lanes, else dot(q_g, k_j, D) per key;
// softmax_numerators(p_g, cnt) (p_g <- exp(p_g - max), returns the sum); weigh(p, inv, G,
// values, first, n, out) (axpy_values' sums). Called from a target-specific function of the
// ISA file, so that the kernels inline into its loops.
template <int64_t Lanes, typename T, typename Scores, typename Dot, typename Softmax,
          typename Weigh>
inline void attend_heads(const float* q, int64_t G, const PagedRows<T>& keys,
                         const PagedRows<T>& values, int64_t first, int64_t n, float scale,
                         float* p, float* out, const Scores& scores, const Dot& dot,
                         const Softmax& softmax_numerators, const Weigh& weigh) {
  const int64_t D = keys.D, BS = keys.BS, cnt = n - first;
  if (D % Lanes == 0) {
    scores(q, G, keys, first, n, scale, p);
  } else {
    for (int64_t j = first; j < n; ++j) {  // each key row is read once for the G heads
      const T* kr = keys.row(j / BS, j % BS);
      for (int64_t g = 0; g < G; ++g) p[g * cnt + j - first] = dot(q + g * D, kr, D) * scale;
    }
  }
  // the first block of values on its way while the softmax runs
  values.prefetch_first(first, n);
  float inv[64];
  for (int64_t g = 0; g < G; ++g) inv[g] = 1.0f / softmax_numerators(p + g * cnt, cnt);
  weigh(p, inv, G, values, first, n, out);
}

// add_rms_norm_'s checks; returns out (empty like h)
inline at::Tensor check_add_rms_norm(const at::Tensor& h, const c10::optional<at::Tensor>& delta,
                                     const at::Tensor& weight) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat,
              "h must be contiguous fp32 [T, D]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == h.size(1),
              "weight must be contiguous fp32 [", h.size(1), "]");
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->is_contiguous() &&
                    delta->scalar_type() == at::kFloat,
                "delta must be contiguous fp32 like h");
  }
  return at::empty_like(h);
}

// add_rms_norm_: if delta is given, h += delta (in place, the residual stream); then
// out = weight * h / sqrt(mean(h^2) + eps), as LlamaRMSNorm computes it in fp32.
// sum_squares(row, D) is the ISA's fp32 sum of row[i]^2.
template <typename SumSquares>
at::Tensor run_add_rms_norm(at::Tensor& h, const c10::optional<at::Tensor>& delta,
                            const at::Tensor& weight, double eps, const SumSquares& sum_squares) {
  at::Tensor out = check_add_rms_norm(h, delta, weight);
  const int64_t T = h.size(0), D = h.size(1);
  float* hp = h.data_ptr<float>();
  const float* dp = delta.has_value() ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* row = hp + t * D;
    if (dp != nullptr)
      for (int64_t i = 0; i < D; ++i) row[i] += dp[t * D + i];
    const float inv = 1.0f / std::sqrt(sum_squares(row, D) / static_cast<float>(D) +
                                       static_cast<float>(eps));
    for (int64_t i = 0; i < D; ++i) op[t * D + i] = wp[i] * (row[i] * inv);
  }
  return out;
}

// --- rope_ ---------------------------------------------------------------------------------
// x [T, heads, D] in place: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) with
// x1, x2 the two halves of the last dimension (the Hugging Face Llama convention); cos, sin
// [T, D] as the model's rotary module returns them. Plain loops: the compiler vectorises them
// for the including file's target.
inline void rope_one(at::Tensor& x, const float* cp, const float* sp) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "q and k must be contiguous fp32 [T, heads, D]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  float* xp = x.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cp + t * D;
    const float* s = sp + t * D;
    for (int64_t h = 0; h < H; ++h) {
      float* v = xp + (t * H + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

inline void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "cos and sin must be contiguous fp32 [T, D]");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == cos.size(0) &&
                  k.size(0) == cos.size(0) && q.size(2) == cos.size(1) &&
                  k.size(2) == cos.size(1) && cos.size(1) % 2 == 0,
              "q [T, H, D], k [T, KV, D] and cos/sin [T, D] must agree (D even)");
  rope_one(q, cos.data_ptr<float>(), sin.data_ptr<float>());
  rope_one(k, cos.data_ptr<float>(), sin.data_ptr<float>());
}

// silu_mul's and gelu_tanh_mul's checks and row loop: row(gate_up_row, I, out_row) per row of
// gu [T, 2I]
template <typename Row>
at::Tensor run_gated_act(const at::Tensor& gu, const Row& row) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.scalar_type() == at::kFloat &&
                  gu.size(1) % 2 == 0,
              "gu must be contiguous fp32 [T, 2I] (gate then up)");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) row(gp + t * 2 * I, I, op + t * I);
  return out;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// fp32 -> bf16 bits, round to nearest even (finite inputs; as vcvtneps2bf16 and torch do)
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace qp
