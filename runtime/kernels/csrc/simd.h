// The SIMD kernels both ISA builds share, written once over a vector-ops type V that each build
// defines (struct Simd in cpu_ops.cpp: 16 fp32 lanes, AVX-512; in cpu_ops_avx2.cpp: 8 lanes,
// AVX2), and compiled once per build. Every weight layout has blocks of 16 output rows
// (common.h); a build with V::L = 8 computes each block as two halves of 8 rows.
//
// What V gives (static members; F a vector of V::L fp32, I of V::L int32):
//   L, F, I          lanes and register types
//   the ops of QP_SIMD_OPS below (same names as the intrinsics, width prefix dropped)
//   abs, round (nearest even), pow2_scale(p, n) = p * 2^n (n integral, >= -126)
//   reduce_add, reduce_max, reduce_add_i    horizontal fp32 sum / max, int32 sum
//   load(const uint16_t*)   L bf16 values as fp32
//   load_i8(const int8_t*)  L int8 as fp32;  load_f16(const uint16_t*)  L fp16 as fp32
//   sum_lanes(F (&v)[L])    r[i] = the sum of the lanes of v[i]
//   store_first(p, v, cnt)  the first cnt lanes of v to p[0..cnt)
//   store_xq(xq, q)         the 32 int32 of q[32 / L] (in [-127, 127]) as int8
//   kMasks                  masked tails (load_masked(cnt, p), store_masked, zero_masked)
//   kBf16Dot                bf16 dot products: dot_bf16(acc, a, b) (lane i += the products of
//                           the bf16 pairs in 32-bit lane i of a and b), load_words, bcast_word,
//                           store_bf16(out, lo, hi) (2 L fp32 -> bf16, nearest even),
//                           pair_words(a, b, lo, hi) (two rows' words interleaved) and unpair
//                           (fp32 lanes of such pairs back in order)
//   int8_chains(MT), fp16_chains(MT)   FMA chains per row and 16-row block in those tiles
// The functions carry QP_TARGET, which the including file defines (its ISA's target attribute,
// or nothing where the whole file is compiled for its ISA), so that V's inline ops inline here.
#pragma once

#include <cmath>
#include <type_traits>
#include <vector>

#include "common.h"

#ifndef QP_TARGET
#error "define QP_TARGET (the build's target attribute, or empty) before including simd.h"
#endif

// The vector ops whose intrinsics differ between the builds only by their width prefix P
// (_mm512 / _mm256) and the integer register's suffix S (si512 / si256): written once here,
// expanded inside each build's struct Simd.
#define QP_SIMD_OPS(P, S)                                                                    \
  QP_TARGET static F zero() { return P##_setzero_ps(); }                                    \
  QP_TARGET static F set1(float v) { return P##_set1_ps(v); }                               \
  QP_TARGET static F load(const float* p) { return P##_loadu_ps(p); }                       \
  QP_TARGET static void store(float* p, F v) { P##_storeu_ps(p, v); }                       \
  QP_TARGET static F add(F a, F b) { return P##_add_ps(a, b); }                             \
  QP_TARGET static F sub(F a, F b) { return P##_sub_ps(a, b); }                             \
  QP_TARGET static F mul(F a, F b) { return P##_mul_ps(a, b); }                             \
  QP_TARGET static F div(F a, F b) { return P##_div_ps(a, b); }                             \
  QP_TARGET static F max(F a, F b) { return P##_max_ps(a, b); }                             \
  QP_TARGET static F min(F a, F b) { return P##_min_ps(a, b); }                             \
  QP_TARGET static F fmadd(F a, F b, F c) { return P##_fmadd_ps(a, b, c); }                 \
  QP_TARGET static F fnmadd(F a, F b, F c) { return P##_fnmadd_ps(a, b, c); }               \
  QP_TARGET static F to_float(I v) { return P##_cvtepi32_ps(v); }                           \
  QP_TARGET static I to_int(F v) { return P##_cvtps_epi32(v); }                             \
  QP_TARGET static I zero_i() { return P##_setzero_##S(); }                                 \
  QP_TARGET static I add_i(I a, I b) { return P##_add_epi32(a, b); }                        \
  QP_TARGET static I set1_i(int32_t v) { return P##_set1_epi32(v); }                        \
  QP_TARGET static I bcast4(const int8_t* p) {                                              \
    int32_t v;                                                                              \
    std::memcpy(&v, p, sizeof(v));                                                          \
    return P##_set1_epi32(v);                                                               \
  }

namespace qp {
namespace simd {

// Stores the sum of each row's P accumulators (L output rows) at out + m * ldo.
template <class V, int MT, int P>
QP_TARGET inline void store_row_sums(const typename V::F (&acc)[MT][P], float* out,
                                     int64_t ldo) {
  for (int m = 0; m < MT; ++m) {
    typename V::F sum = acc[m][0];
    for (int p = 1; p < P; ++p) sum = V::add(sum, acc[m][p]);
    V::store(out + m * ldo, sum);
  }
}

// Halves of a 16-row block computed in one pass over the block's weights, for tiles of MT rows
// on a build of H halves (V::L = 8: H = 2). A one-row tile takes both: each chunk's 64 bytes
// (one cache line) are read once while they stream from memory, instead of once per half
// (measured on Zen 4, the AVX2 build's int8 head at one row: see docs/runtime.md). Tiles of more
// rows keep one half per pass: their per-row state for both halves would not fit in 16 ymm
// registers.
template <int MT, int H>
constexpr int halves_per_pass() {
  return MT == 1 ? H : 1;
}

// --- w4a8_mm: W4A8 (common.h gives the layout, the quantizer and the formula) ----------------

// one row: x fp32 [K] -> xq int8 [K], dx fp32 [K / 32], qsum fp32 [K / group_size]
template <class V>
QP_TARGET void quantize_row(const float* x, int64_t K, int64_t group_size, int8_t* xq,
                            float* dx, float* qsum) {
  constexpr int NV = kA8Block / V::L;  // vectors per block of 32
  const int64_t per_group = group_size / kA8Block;
  for (int64_t blk = 0; blk < K / kA8Block; ++blk) {
    typename V::F v[NV];
    for (int i = 0; i < NV; ++i) v[i] = V::load(x + blk * kA8Block + i * V::L);
    typename V::F amax = V::abs(v[0]);
    for (int i = 1; i < NV; ++i) amax = V::max(amax, V::abs(v[i]));
    const float a = V::reduce_max(amax);
    const float d = a / 127.0f;
    const typename V::F inv = V::set1(a > 0.0f ? 127.0f / a : 0.0f);
    typename V::I q[NV];  // int32, rounded to nearest even (MXCSR default), in [-127, 127]
    for (int i = 0; i < NV; ++i) q[i] = V::to_int(V::mul(v[i], inv));
    typename V::I isum = q[0];
    for (int i = 1; i < NV; ++i) isum = V::add_i(isum, q[i]);
    V::store_xq(xq + blk * kA8Block, q);
    dx[blk] = d;
    const float part = d * static_cast<float>(V::reduce_add_i(isum));
    if (blk % per_group == 0) qsum[blk / per_group] = part;
    else qsum[blk / per_group] += part;
  }
}

// One block of 16 output rows for MT activation rows (the tile's first row at m0), in halves of
// V::L rows. Dot::run<MT>(w, xb, iacc) is the ISA's exact integer dot of one block of 32 columns
// (the half's chunk bytes at w, chunk stride 64; row m's 32 int8 at xb[m]) into iacc[m].
//   w  the block's chunks [K/8, 64]; sc (fp16 bits) / mz (fp32) the block's [G, 16] (mz null:
//   -8 * sc); out row m at out + m * ldo
template <class V, class Dot, int MT>
QP_TARGET inline void w4a8_tile(const A8Acts& a, int64_t m0, int64_t K, int64_t G,
                              int64_t group_size, const uint8_t* w, const uint16_t* sc,
                              const float* mz, float* out, int64_t ldo) {
  const int64_t nb = K / kA8Block, per_group = group_size / kA8Block;
  constexpr int H = kRows / V::L, HP = halves_per_pass<MT, H>();
  for (int64_t h0 = 0; h0 < H; h0 += HP) {
    typename V::F total[MT][HP];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < HP; ++j) total[m][j] = V::zero();
    for (int64_t g = 0; g < G; ++g) {
      typename V::F s[HP];
      for (int j = 0; j < HP; ++j)
        s[j] = V::load_f16(sc + g * kRows + (h0 + j) * V::L);  // exact in fp32
      for (int64_t blk = g * per_group; blk < (g + 1) * per_group; ++blk) {
        const int8_t* xb[MT];
        for (int m = 0; m < MT; ++m) xb[m] = a.xq.data() + (m0 + m) * K + blk * kA8Block;
        for (int j = 0; j < HP; ++j) {
          typename V::I iacc[MT];
          Dot::template run<MT>(w + blk * 4 * 64 + (h0 + j) * 4 * V::L, xb, iacc);
          for (int m = 0; m < MT; ++m) {
            const typename V::F sd = V::mul(s[j], V::set1(a.dx[(m0 + m) * nb + blk]));
            total[m][j] = V::fmadd(V::to_float(iacc[m]), sd, total[m][j]);
          }
        }
      }
      // symmetric layers have no mz tensor: their zero point is 8, so mz = -8 * scale (exact)
      for (int j = 0; j < HP; ++j) {
        const typename V::F z = mz != nullptr ? V::load(mz + g * kRows + (h0 + j) * V::L)
                                              : V::mul(s[j], V::set1(-8.0f));
        for (int m = 0; m < MT; ++m)
          total[m][j] = V::fmadd(z, V::set1(a.qsum[(m0 + m) * G + g]), total[m][j]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < HP; ++j) V::store(out + m * ldo + (h0 + j) * V::L, total[m][j]);
  }
}

// --- w8a8_mm: the int8 head with int8 activations (common.h gives the layout and formula) --

// One block of 16 output rows for MT activation rows (the tile's first row at m0), in halves of
// V::L rows. Dot::run<MT>(w, xb, xs, iacc) is the ISA's exact integer dot of one block of 32
// columns (the half's bytes at w, chunk stride 64, 8 chunks; row m's 32 int8 at xb[m], their
// sum xs[m]) into iacc[m].
template <class V, class Dot, int MT>
QP_TARGET inline void w8a8_tile(const A8Acts& a, const int32_t* xsum, int64_t m0, int64_t K,
                                const int8_t* w, const uint16_t* sc, float* out, int64_t ldo) {
  const int64_t nb = K / kA8Block;
  constexpr int H = kRows / V::L, HP = halves_per_pass<MT, H>();
  for (int64_t h0 = 0; h0 < H; h0 += HP) {
    typename V::F total[MT][HP];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < HP; ++j) total[m][j] = V::zero();
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int8_t* xb[MT];
      int32_t xs[MT];
      for (int m = 0; m < MT; ++m) {
        xb[m] = a.xq.data() + (m0 + m) * K + blk * kA8Block;
        xs[m] = xsum[(m0 + m) * nb + blk];
      }
      for (int j = 0; j < HP; ++j) {
        const int64_t h = h0 + j;
        typename V::I iacc[MT];
        Dot::template run<MT>(w + blk * 8 * 64 + h * 4 * V::L, xb, xs, iacc);
        const typename V::F s = V::load_f16(sc + blk * kRows + h * V::L);  // exact in fp32
        for (int m = 0; m < MT; ++m) {
          // |iacc| <= 32 * 127 * 127 < 2^24: exact in fp32
          const typename V::F sd = V::mul(s, V::set1(a.dx[(m0 + m) * nb + blk]));
          total[m][j] = V::fmadd(V::to_float(iacc[m]), sd, total[m][j]);
        }
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < HP; ++j) V::store(out + m * ldo + (h0 + j) * V::L, total[m][j]);
  }
}

// --- w8a32_mm: W8A32 (common.h gives the layout and numerics) ----------------------------------

// sumx[i] = sum of the fp32 values x[i * group_size : (i + 1) * group_size]
template <class V>
QP_TARGET void group_sums_f32(const float* x, int64_t n_groups, int64_t group_size,
                              float* sumx) {
  for (int64_t i = 0; i < n_groups; ++i) {
    typename V::F acc = V::zero();
    for (int64_t k = 0; k < group_size; k += V::L)
      acc = V::add(acc, V::load(x + i * group_size + k));
    sumx[i] = V::reduce_add(acc);
  }
}

template <class V, int MT>
QP_TARGET void int8_tile(const float* x, int64_t K, const float* sumx, int64_t G,
                         const int8_t* w, const uint16_t* sc, const float* zf,
                         int64_t group_size, float* out, int64_t ldo) {
  constexpr int P = V::int8_chains(MT);  // FMA chains in flight per row; group_size % P == 0
  using F = typename V::F;
  for (int64_t h = 0; h < kRows / V::L; ++h) {
    F total[MT][1];
    for (int m = 0; m < MT; ++m) total[m][0] = V::zero();
    for (int64_t g = 0; g < G; ++g) {
      F acc[MT][P];
      for (int m = 0; m < MT; ++m)
        for (int p = 0; p < P; ++p) acc[m][p] = V::zero();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += P) {
        for (int p = 0; p < P; ++p) {
          const F wv = V::load_i8(w + (k + p) * kRows + h * V::L);
          for (int m = 0; m < MT; ++m)
            acc[m][p] = V::fmadd(wv, V::set1(x[m * K + k + p]), acc[m][p]);
        }
      }
      const F s = V::load_f16(sc + g * kRows + h * V::L);
      for (int m = 0; m < MT; ++m) {
        F sum = acc[m][0];
        for (int p = 1; p < P; ++p) sum = V::add(sum, acc[m][p]);
        total[m][0] = V::fmadd(sum, s, total[m][0]);
      }
      if (zf != nullptr) {
        const F z = V::load(zf + g * kRows + h * V::L);
        for (int m = 0; m < MT; ++m)
          total[m][0] = V::fmadd(z, V::set1(sumx[m * G + g]), total[m][0]);
      }
    }
    store_row_sums<V, MT, 1>(total, out + h * V::L, ldo);
  }
}

// --- fp16_mm: the output head (common.h gives the layout and numerics) -----------------------
// torch's fp16 matmul on these CPUs costs M times its GEMV; this one converts each weight once
// per tile of rows.

template <class V, int MT>
QP_TARGET void fp16_tile(const float* x, int64_t K, const uint16_t* w, float* out, int64_t ldo) {
  constexpr int P = V::fp16_chains(MT);  // FMA chains in flight per row
  using F = typename V::F;
  for (int64_t h = 0; h < kRows / V::L; ++h) {
    F acc[MT][P];
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < P; ++p) acc[m][p] = V::zero();
    int64_t k = 0;
    for (; k + P <= K; k += P) {
      for (int p = 0; p < P; ++p) {
        const F wv = V::load_f16(w + (k + p) * kRows + h * V::L);
        for (int m = 0; m < MT; ++m)
          acc[m][p] = V::fmadd(wv, V::set1(x[m * K + k + p]), acc[m][p]);
      }
    }
    for (; k < K; ++k) {
      const F wv = V::load_f16(w + k * kRows + h * V::L);
      for (int m = 0; m < MT; ++m) acc[m][0] = V::fmadd(wv, V::set1(x[m * K + k]), acc[m][0]);
    }
    store_row_sums<V, MT, P>(acc, out + h * V::L, ldo);
  }
}

// --- paged_attention ---------------------------------------------------------------------------
// Short query chunks (decode tokens, small prefill chunks) over paged K/V, read straight from the
// blocks. q [T, H, D]: the chunks of the B sequences one after another, q_lens[b] rows each;
// k_pool / v_pool [num_blocks, block_size, KV, D] fp32 or bf16 (read as fp32: a bf16 KV cache
// holds half the bytes); block_tables [B, max_blocks] int64; ctx_lens [B] int64 (tokens in the
// context after this step, the chunk's included). Query i of sequence b sits at position
// ctx_lens[b] - q_lens[b] + i and sees keys 0 .. that position (causal); with window w > 0 only
// the last w of them (a sliding-window layer: keys w or more positions back hidden). Query head
// h reads KV head h / (H / KV) (HF's repeat_kv order). softmax(q k^T * scale) v in fp32; on a
// bf16 cache where the build has bf16 dot products, with the queries and weights rounded to bf16
// (attend_b16 below). Work is O(q_len * min(ctx, w)) per sequence: chunks of kTiledMinQ or more
// queries go to the tiles (attend_long).

inline float scalar(float v) { return v; }
inline float scalar(uint16_t h) { return bf16_to_float(h); }

template <class V, typename T>
QP_TARGET float dot(const float* a, const T* b, int64_t D) {
  typename V::F acc = V::zero();
  int64_t i = 0;
  for (; i + V::L <= D; i += V::L) acc = V::fmadd(V::load(a + i), V::load(b + i), acc);
  float s = V::reduce_add(acc);
  for (; i < D; ++i) s += a[i] * scalar(b[i]);
  return s;
}

template <class V, typename T>
QP_TARGET void axpy(float alpha, const T* x, float* y, int64_t D) {
  const typename V::F a = V::set1(alpha);
  int64_t i = 0;
  for (; i + V::L <= D; i += V::L) V::store(y + i, V::fmadd(a, V::load(x + i), V::load(y + i)));
  for (; i < D; ++i) y[i] += alpha * scalar(x[i]);
}

// exp(x) per lane, x <= 88: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error < 2e-7, under fp32's unit roundoff beyond a few ulps), times 2^n
template <class V>
QP_TARGET inline typename V::F exp_lanes(typename V::F x) {
  using F = typename V::F;
  x = V::max(x, V::set1(-87.0f));  // e^-87 ~ 1.6e-38: still a normal fp32 (n >= -126)
  const F n = V::round(V::mul(x, V::set1(1.44269504f)));
  F r = V::fnmadd(n, V::set1(0.693359375f), x);  // ln2 split in two parts
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  F p = V::set1(1.0f / 720.0f);
  p = V::fmadd(p, r, V::set1(1.0f / 120.0f));
  p = V::fmadd(p, r, V::set1(1.0f / 24.0f));
  p = V::fmadd(p, r, V::set1(1.0f / 6.0f));
  p = V::fmadd(p, r, V::set1(0.5f));
  p = V::fmadd(p, r, V::set1(1.0f));
  p = V::fmadd(p, r, V::set1(1.0f));
  return V::pow2_scale(p, n);
}

// p[0..n) <- exp(p - max(p)); returns the sum. The tail after the last full vector: one masked
// vector where the ISA has masks (its lanes join the vector sum), else lane by lane.
template <class V>
QP_TARGET float softmax_numerators(float* p, int64_t n) {
  using F = typename V::F;
  float mx = -INFINITY;
  {
    F mv = V::set1(-INFINITY);
    int64_t j = 0;
    for (; j + V::L <= n; j += V::L) mv = V::max(mv, V::load(p + j));
    mx = V::reduce_max(mv);
    for (; j < n; ++j) mx = std::max(mx, p[j]);
  }
  const F m = V::set1(mx);
  F acc = V::zero();
  int64_t j = 0;
  for (; j + V::L <= n; j += V::L) {
    const F e = exp_lanes<V>(V::sub(V::load(p + j), m));
    V::store(p + j, e);
    acc = V::add(acc, e);
  }
  if constexpr (V::kMasks) {
    if (j < n) {
      const F e = exp_lanes<V>(V::sub(V::load_masked(n - j, p + j), m));
      V::store_masked(n - j, p + j, e);
      acc = V::add(acc, V::zero_masked(n - j, e));
    }
    return V::reduce_add(acc);
  } else {
    float s = V::reduce_add(acc);
    for (; j < n; ++j) {
      alignas(64) float e[V::L];
      V::store(e, exp_lanes<V>(V::set1(p[j] - mx)));
      p[j] = e[0];
      s += e[0];
    }
    return s;
  }
}

// p[g * (n - first) + j - first] = scale * q_g . k_j for the G query heads of one KV head and
// keys first <= j < n, D a multiple of L: L keys at a time, their partial sums reduced together
// by V::sum_lanes. Q float: q [G, D] fp32, each key row widened to fp32. Q uint32_t (a bf16 cache
// where V::kBf16Dot, D a multiple of 2 L): q [G, D / 2] words of two bf16, the key rows read as
// words, fp32 sums of the bf16 products (vdpbf16ps).
template <class V, typename T, typename Q>
QP_TARGET void scores(const Q* q, int64_t G, const PagedRows<T>& keys, int64_t first,
                      int64_t n, float scale, float* p) {
  constexpr bool kWords = std::is_same_v<Q, uint32_t>;
  const int64_t D = keys.D, W = kWords ? D / 2 : D, stride = n - first;
  const T* rows[V::L];
  int64_t blk = first / keys.BS, off = first % keys.BS;  // position of key j0 in the table
  const int64_t blocks = (n + keys.BS - 1) / keys.BS;
  keys.prefetch_first(first, n);
  for (int64_t j0 = first; j0 < n; j0 += V::L) {
    const int64_t cnt = std::min<int64_t>(V::L, n - j0);
    for (int64_t jj = 0; jj < cnt; ++jj) {
      keys.prefetch(blk + kPrefetchBlocks, off, blocks);  // the same row, blocks ahead
      rows[jj] = keys.row(blk, off);
      if (++off == keys.BS) off = 0, ++blk;
    }
    for (int64_t jj = cnt; jj < V::L; ++jj) rows[jj] = rows[0];  // past n: sums not stored
    for (int64_t g = 0; g < G; ++g) {
      // the L keys' sums side by side (L independent chains), each over d in order
      typename V::F part[V::L];
      for (int jj = 0; jj < V::L; ++jj) part[jj] = V::zero();
      for (int64_t d = 0; d < W; d += V::L) {
        if constexpr (kWords) {
          const typename V::I qd = V::load_words(q + g * W + d);
          for (int jj = 0; jj < V::L; ++jj)
            part[jj] = V::dot_bf16(
                part[jj], qd, V::load_words(reinterpret_cast<const uint32_t*>(rows[jj]) + d));
        } else {
          const typename V::F qd = V::load(q + g * W + d);
          for (int jj = 0; jj < V::L; ++jj)
            part[jj] = V::fmadd(qd, V::load(rows[jj] + d), part[jj]);
        }
      }
      V::store_first(p + g * stride + j0 - first, V::mul(V::sum_lanes(part), V::set1(scale)),
                     cnt);
    }
  }
}

// common.h's axpy_values with the outputs of up to kAcc / NV heads (D = NV * L) held in
// registers while the keys go by: each value row is loaded once per such group of heads and
// the outputs are loaded and stored once, not once per key (the same FMAs in the same order:
// the same sums, bit for bit).
template <class V, int NV, typename T>
QP_TARGET void weighted_values_nv(const float* p, const float* inv, int64_t G,
                                  const PagedRows<T>& values, int64_t first, int64_t n,
                                  float* out) {
  constexpr int kAcc = V::L == 16 ? 16 : 8;  // accumulators: half the vector registers
  constexpr int GT = NV >= kAcc ? 1 : kAcc / NV;
  using F = typename V::F;
  const int64_t D = values.D, BS = values.BS, cnt = n - first, blocks = (n + BS - 1) / BS;
  for (int64_t g0 = 0; g0 < G; g0 += GT) {
    const int64_t gt = std::min<int64_t>(GT, G - g0);
    F acc[GT][NV];
    for (int g = 0; g < GT; ++g)
      for (int v = 0; v < NV; ++v)
        acc[g][v] = g < gt ? V::load(out + (g0 + g) * D + v * V::L) : V::zero();
    for (int64_t blk = first / BS; blk * BS < n; ++blk) {
      for (int64_t j = std::max(first, blk * BS); j < std::min(n, (blk + 1) * BS); ++j) {
        if (g0 == 0) values.prefetch(blk + kPrefetchBlocks, j - blk * BS, blocks);
        const T* vr = values.row(blk, j - blk * BS);
        for (int g = 0; g < GT; ++g) {
          if (g >= gt) break;
          const F w = V::set1(p[(g0 + g) * cnt + j - first] * inv[g0 + g]);
          for (int v = 0; v < NV; ++v) acc[g][v] = V::fmadd(w, V::load(vr + v * V::L), acc[g][v]);
        }
      }
    }
    for (int g = 0; g < gt; ++g)
      for (int v = 0; v < NV; ++v) V::store(out + (g0 + g) * D + v * V::L, acc[g][v]);
  }
}

// the register-held sums where D is 4, 8 or 16 vectors; else common.h's axpy_values
template <class V, typename T>
QP_TARGET void weighted_values(const float* p, const float* inv, int64_t G,
                               const PagedRows<T>& values, int64_t first, int64_t n, float* out) {
  switch (values.D == 4 * V::L ? 4 : values.D == 8 * V::L ? 8 : values.D == 16 * V::L ? 16 : 0) {
    case 4: return weighted_values_nv<V, 4>(p, inv, G, values, first, n, out);
    case 8: return weighted_values_nv<V, 8>(p, inv, G, values, first, n, out);
    case 16: return weighted_values_nv<V, 16>(p, inv, G, values, first, n, out);
    default:
      axpy_values(p, inv, G, values, first, n, out,
                  [](const auto&... a) { axpy<V>(a...); });
  }
}

// --- paged_attention, long chunks: flash-style tiles over copies of the keys -----------------
// A chunk of kTiledMinQ or more queries (a prompt's prefill) would read every key and value row
// once per query on the per-query path above (O(q_len * ctx) row reads, one dot product per
// key). Here one sequence's keys and values of each KV head are first copied into scratch,
// keys transposed (npad = ctx rounded up to KB keys, zero-padded; attend_tile gives the
// layouts); then each tile of R consecutive queries of one query head walks its visible keys
// KB = 2 L at a time:
//   scores s[r][j] = scale * q_r . k_j          outer products: per d one load of KB keys'
//                                               d-th components for all R queries
//   keys not visible (after the query, or at or beyond `window` back) -> weight 0
//   running softmax per query: m = max so far, l = sum of e^(s - m), outputs and l rescaled
//   by e^(m_old - m_new) when the maximum grows (flash attention's online softmax)
//   o[r] += sum_j e^(s[r][j] - m) v_j           R x (2 L) outputs in registers per pass
// and writes o[r] / l[r]. fp32 FMAs, or bf16 dot products over a bf16 cache where the build has
// them (attend_tile); the sums run in another order than the per-query path's (tests compare
// both with a float64 reference).
static_assert(kTiledMaxDim % 16 == 0, "the tiles' output scratch holds kTiledMaxDim floats");

template <class V>
constexpr int tiled_rows() {
  return V::L == 16 ? 8 : 6;  // R x 2 score and output accumulators fit the registers
}

// acc[r][c] += a_c x the bf16 pair (32-bit word) i of row r, for the R rows and 2 vectors
template <class V, int R>
QP_TARGET inline void add_pair_products(typename V::F (&acc)[R][2], typename V::I a0,
                                        typename V::I a1, const uint32_t* const (&rows)[R],
                                        int64_t i) {
  for (int r = 0; r < R; ++r) {
    const auto w = V::bcast_word(rows[r] + i);
    acc[r][0] = V::dot_bf16(acc[r][0], a0, w);
    acc[r][1] = V::dot_bf16(acc[r][1], a1, w);
  }
}

// One tile: queries q + r * ldq (r < rows; rows <= R) at positions pos0 + r, over the copies of
// their KV head's keys and values; out + r * ldq. B16 false: fp32 copies kt [D, npad] (keys
// transposed) and vals [npad, D], fp32 FMAs. B16 true (a bf16 KV cache on a build with bf16 dot
// products): bf16 copies as 32-bit words of two bf16, kt [D / 2, npad] (word (p, j) = key j's
// dimensions 2p, 2p + 1) and vals [npad / 2, D] (word (i, d) = dimension d of keys 2i, 2i + 1);
// the queries and the softmax weights rounded to bf16 too (as SDPA runs on a bf16 cache), every
// product summed in fp32 by vdpbf16ps: half the instructions of the fp32 FMAs.
template <class V, bool B16>
QP_TARGET __attribute__((flatten)) void attend_tile(const float* q, int64_t ldq, int64_t rows,
                                                    int64_t pos0, int64_t window,
                                                    const void* kt_, const void* vals_,
                                                    int64_t npad, int64_t D, float scale,
                                                    float* out) {
  using F = typename V::F;
  constexpr int R = tiled_rows<V>(), L = V::L, KB = 2 * L, CW = 2;
  const float* qr[R];
  for (int r = 0; r < R; ++r) qr[r] = q + std::min<int64_t>(r, rows - 1) * ldq;
  alignas(64) float s[R][KB];
  alignas(64) float o[R][kTiledMaxDim];
  // B16: the queries, then each block's softmax weights, as bf16 (pairs = 32-bit words)
  alignas(64) uint16_t qb[B16 ? R : 1][B16 ? kTiledMaxDim : 1];
  alignas(64) uint16_t pb[B16 ? R : 1][B16 ? KB : 1];
  const uint32_t* qw[R];  // the rows of qb and pb as words (pairs of bf16)
  const uint32_t* pw[R];
  for (int r = 0; r < R; ++r) {
    qw[r] = reinterpret_cast<const uint32_t*>(qb[B16 ? r : 0]);
    pw[r] = reinterpret_cast<const uint32_t*>(pb[B16 ? r : 0]);
  }
  if constexpr (B16)
    for (int r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; d += KB)
        V::store_bf16(qb[r] + d, V::load(qr[r] + d), V::load(qr[r] + d + L));
  float m[R], l[R], alpha[R];
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    for (int64_t d = 0; d < D; d += L) V::store(o[r] + d, V::zero());
  }
  const int64_t last = pos0 + rows - 1;  // the last key any query of the tile sees
  const int64_t from = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  for (int64_t j0 = from / KB * KB; j0 <= last; j0 += KB) {
    // the dot products in pieces of kDotPiece components, the pieces' sums added in s: one
    // chain of D FMAs per score would lose ~sqrt(D / kDotPiece) times more to rounding
    constexpr int64_t kDotPiece = 32;
    for (int64_t d0 = 0; d0 < D; d0 += kDotPiece) {
      F acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V::zero();
      if constexpr (B16) {
        const uint32_t* kt = static_cast<const uint32_t*>(kt_);
        for (int64_t p = d0 / 2; p < std::min(D, d0 + kDotPiece) / 2; ++p)
          add_pair_products<V, R>(acc, V::load_words(kt + p * npad + j0),
                                  V::load_words(kt + p * npad + j0 + L), qw, p);
      } else {
        const float* kt = static_cast<const float*>(kt_);
        for (int64_t d = d0; d < std::min(D, d0 + kDotPiece); ++d) {
          const F k0 = V::load(kt + d * npad + j0), k1 = V::load(kt + d * npad + j0 + L);
          for (int r = 0; r < R; ++r) {
            const F qd = V::set1(qr[r][d]);
            acc[r][0] = V::fmadd(qd, k0, acc[r][0]);
            acc[r][1] = V::fmadd(qd, k1, acc[r][1]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        V::store(s[r], d0 == 0 ? acc[r][0] : V::add(V::load(s[r]), acc[r][0]));
        V::store(s[r] + L, d0 == 0 ? acc[r][1] : V::add(V::load(s[r] + L), acc[r][1]));
      }
    }
    const F sc = V::set1(scale);
    for (int r = 0; r < R; ++r) {
      V::store(s[r], V::mul(V::load(s[r]), sc));
      V::store(s[r] + L, V::mul(V::load(s[r] + L), sc));
    }
    // a block that some query sees only in part: hide the keys it must not see
    const bool edge = j0 + KB - 1 > pos0 || (window > 0 && j0 <= last - window);
    if (edge)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < KB; ++j) {
          const int64_t key = j0 + j, pos = pos0 + r;
          if (key > pos || (window > 0 && key <= pos - window)) s[r][j] = -INFINITY;
        }
    for (int r = 0; r < R; ++r) {
      const float mx = V::reduce_max(V::max(V::load(s[r]), V::load(s[r] + L)));
      if (mx == -INFINITY) {  // nothing of this block is visible to query r
        alpha[r] = 1.0f;
        V::store(s[r], V::zero());
        V::store(s[r] + L, V::zero());
      } else {
        const float mn = std::max(m[r], mx);
        // 0 while m[r] is -inf (nothing accumulated yet); 1 (no exp) where the maximum stays
        alpha[r] = mx <= m[r] ? 1.0f : std::exp(m[r] - mn);
        const F mv = V::set1(mn);
        const F e0 = exp_lanes<V>(V::sub(V::load(s[r]), mv));
        const F e1 = exp_lanes<V>(V::sub(V::load(s[r] + L), mv));
        if (edge) {  // exp_lanes clamps at e^-87: a hidden key weighs exactly 0
          alignas(64) float e[KB];
          V::store(e, e0);
          V::store(e + L, e1);
          for (int j = 0; j < KB; ++j)
            if (s[r][j] == -INFINITY) e[j] = 0.0f;
          std::memcpy(s[r], e, sizeof(e));
        } else {
          V::store(s[r], e0);
          V::store(s[r] + L, e1);
        }
        l[r] = l[r] * alpha[r] + V::reduce_add(V::add(V::load(s[r]), V::load(s[r] + L)));
        m[r] = mn;
      }
      if constexpr (B16) V::store_bf16(pb[r], V::load(s[r]), V::load(s[r] + L));
    }
    bool rescale = false;
    for (int r = 0; r < R; ++r) rescale = rescale || alpha[r] != 1.0f;
    for (int64_t dc = 0; dc < D; dc += CW * L) {
      F oa[R][CW];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < CW; ++c) {
          oa[r][c] = V::load(o[r] + dc + c * L);
          if (rescale) oa[r][c] = V::mul(oa[r][c], V::set1(alpha[r]));
        }
      if constexpr (B16) {
        const uint32_t* vals = static_cast<const uint32_t*>(vals_);
        for (int jp = 0; jp < KB / 2; ++jp) {
          const uint32_t* vr = vals + (j0 / 2 + jp) * D + dc;
          add_pair_products<V, R>(oa, V::load_words(vr), V::load_words(vr + L), pw, jp);
        }
      } else {
        const float* vals = static_cast<const float*>(vals_);
        for (int j = 0; j < KB; ++j) {
          const float* vr = vals + (j0 + j) * D + dc;
          const F v0 = V::load(vr), v1 = V::load(vr + L);
          for (int r = 0; r < R; ++r) {
            const F w = V::set1(s[r][j]);
            oa[r][0] = V::fmadd(w, v0, oa[r][0]);
            oa[r][1] = V::fmadd(w, v1, oa[r][1]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < CW; ++c) V::store(o[r] + dc + c * L, oa[r][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const F inv = V::set1(1.0f / l[r]);  // l >= 1: each query sees at least its own key
    for (int64_t d = 0; d < D; d += L) V::store(out + r * ldq + d, V::mul(V::load(o[r] + d), inv));
  }
}

// Keys j0 .. j1 - 1 of KV head kvh into attend_long's copies (attend_tile's layouts): fp32, kd
// [D, npad] transposed and vd [npad, D]; or (B16, bf16 pools) bf16 pairs, kd [D / 2, npad] and
// vd [npad / 2, D] words. (A function of its own: the lambdas that call it are not compiled for
// the ISA.)
template <class V, bool B16, typename T>
QP_TARGET void copy_keys_values(const T* k_pool, const T* v_pool, const int64_t* table,
                                int64_t BS, int64_t KV, int64_t kvh, int64_t D, int64_t j0,
                                int64_t j1, int64_t npad, void* kd_, void* vd_) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t slot = table[j / BS] * BS + j % BS;
    const T* kr = k_pool + (slot * KV + kvh) * D;
    const T* vr = v_pool + (slot * KV + kvh) * D;
    if constexpr (B16) {
      uint32_t* kd = static_cast<uint32_t*>(kd_);
      uint16_t* vd = static_cast<uint16_t*>(vd_);
      for (int64_t p = 0; p < D / 2; ++p) std::memcpy(kd + p * npad + j, kr + 2 * p, 4);
      for (int64_t d = 0; d < D; ++d) vd[((j / 2) * D + d) * 2 + j % 2] = vr[d];
    } else {
      float* kd = static_cast<float*>(kd_);
      float* vd = static_cast<float*>(vd_);
      for (int64_t d = 0; d < D; ++d) kd[d * npad + j] = scalar(kr[d]);
      for (int64_t d = 0; d < D; d += V::L) V::store(vd + j * D + d, V::load(vr + d));
    }
  }
}

// One sequence's chunk of q_len queries (q / out: its rows [q_len, H, D]) over its n context
// keys in the paged pool (table: its block table), through attend_tile: the copies of each KV
// head's keys and values, then the tiles of every query head, over the kernels' threads.
template <class V, typename T>
QP_TARGET void attend_long(const float* q, int64_t q_len, int64_t n, const T* k_pool,
                           const T* v_pool, const int64_t* table, int64_t BS, int64_t KV,
                           int64_t H, int64_t D, int64_t window, float scale, float* out) {
  constexpr bool B16 = V::kBf16Dot && std::is_same_v<T, uint16_t>;
  constexpr int R = tiled_rows<V>(), KB = 2 * V::L;
  const int64_t npad = (n + KB - 1) / KB * KB, G = H / KV;
  // fp32 copies, or bf16 ones (half the floats' bytes: 2 bf16 per float slot)
  const int64_t per_head = B16 ? D * npad / 2 : D * npad;
  std::vector<float> kt(KV * per_head, 0.0f), vals(KV * per_head, 0.0f);
  constexpr int64_t kCopyKeys = 64;  // keys per piece of the copy (the pieces spread over threads)
  const int64_t pieces = (n + kCopyKeys - 1) / kCopyKeys;
  qp::parallel_for(0, KV * pieces, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t kvh = i / pieces, j0 = (i % pieces) * kCopyKeys;
      copy_keys_values<V, B16>(k_pool, v_pool, table, BS, KV, kvh, D, j0,
                               std::min(n, j0 + kCopyKeys), npad, kt.data() + kvh * per_head,
                               vals.data() + kvh * per_head);
    }
  });
  const int64_t tiles = (q_len + R - 1) / R, pos_first = n - q_len;
  // tiles late in the chunk see more keys: many small chunks, claimed as threads get free
  qp::parallel_for(0, H * tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / tiles, t0 = (i % tiles) * R, kvh = h / G;
      attend_tile<V, B16>(q + (t0 * H + h) * D, H * D, std::min<int64_t>(R, q_len - t0),
                          pos_first + t0, window, kt.data() + kvh * per_head,
                          vals.data() + kvh * per_head, npad, D, scale,
                          out + (t0 * H + h) * D);
    }
  }, 16);
}

// --- paged_attention's per-query path over a bf16 cache with bf16 dot products -------------
// Where V::kBf16Dot, a bf16 cache and D a multiple of 2 L (up to kTiledMaxDim): the arithmetic of
// the tiles' B16 case on the per-query path. The G queries and the softmax weights rounded to
// bf16 (as SDPA computes on a bf16 cache), every product summed in fp32 by vdpbf16ps from the
// cache's words as they lie: no widening of each key and value row to fp32, half the dot
// instructions. Values go by in pairs of keys (j, j + 1), their words interleaved (pair_words)
// so one dot product adds w_j v_j[d] + w_j+1 v_j+1[d]; the outputs' lanes put back in order at
// the end (unpair). An odd last key pairs with itself at weight 0.

// out_g += sum_j w_g[j] v_j, w [G, ldw] words: pairs of bf16 weights (w_g[j], w_g[j + 1]) from
// key `first` on (zero past n); NV = D / L outputs per head, kAcc / NV heads held in registers
template <class V, int NV>
QP_TARGET void weighted_values_b16(const uint32_t* w, int64_t ldw, int64_t G,
                                   const PagedRows<uint16_t>& values, int64_t first, int64_t n,
                                   float* out) {
  static_assert(NV % 2 == 0, "rows of whole 2 L-bf16 vectors");
  constexpr int kAcc = 16, GT = NV >= kAcc ? 1 : kAcc / NV, L = V::L;
  using F = typename V::F;
  using I = typename V::I;
  const int64_t D = values.D, BS = values.BS, blocks = (n + BS - 1) / BS;
  for (int64_t g0 = 0; g0 < G; g0 += GT) {
    const int64_t gt = std::min<int64_t>(GT, G - g0);
    F acc[GT][NV];
    for (int g = 0; g < GT; ++g)
      for (int v = 0; v < NV; ++v) acc[g][v] = V::zero();
    int64_t blk = first / BS, off = first % BS;  // the next key's place in the table
    for (int64_t j = first, i = 0; j < n; j += 2, ++i) {
      const uint32_t* rows[2];
      for (int k = 0; k < 2; ++k) {
        if (j + k == n) {  // odd count: the last key again, at weight 0
          rows[1] = rows[0];
          break;
        }
        if (g0 == 0) values.prefetch(blk + kPrefetchBlocks, off, blocks);
        rows[k] = reinterpret_cast<const uint32_t*>(values.row(blk, off));
        if (++off == BS) off = 0, ++blk;
      }
      I wg[GT];  // each head's pair of weights, broadcast once for the whole row
      for (int g = 0; g < GT; ++g)
        wg[g] = V::bcast_word(w + (g0 + std::min<int64_t>(g, gt - 1)) * ldw + i);
      for (int c = 0; c < NV / 2; ++c) {
        I lo, hi;
        V::pair_words(V::load_words(rows[0] + c * L), V::load_words(rows[1] + c * L), lo, hi);
        for (int g = 0; g < GT; ++g) {
          if (g >= gt) break;
          acc[g][2 * c] = V::dot_bf16(acc[g][2 * c], lo, wg[g]);
          acc[g][2 * c + 1] = V::dot_bf16(acc[g][2 * c + 1], hi, wg[g]);
        }
      }
    }
    for (int g = 0; g < gt; ++g)
      for (int c = 0; c < NV / 2; ++c) {
        F a, b;
        V::unpair(acc[g][2 * c], acc[g][2 * c + 1], a, b);
        float* o = out + (g0 + g) * D + c * 2 * L;
        V::store(o, V::add(V::load(o), a));
        V::store(o + L, V::add(V::load(o + L), b));
      }
  }
}

template <class V>
QP_TARGET void attend_b16(const float* q, int64_t G, const PagedRows<uint16_t>& keys,
                          const PagedRows<uint16_t>& values, int64_t first, int64_t n,
                          float scale, float* p, float* out) {
  constexpr int L = V::L;
  const int64_t D = keys.D, cnt = n - first;
  const int64_t ldp = (cnt + 2 * L - 1) / (2 * L) * (2 * L);  // bf16 weights per head, padded
  thread_local std::vector<uint16_t> qb, pb;
  qb.resize(G * D);
  pb.resize(G * ldp);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; d += 2 * L)
      V::store_bf16(qb.data() + g * D + d, V::load(q + g * D + d), V::load(q + g * D + d + L));
  scores<V>(reinterpret_cast<const uint32_t*>(qb.data()), G, keys, first, n, scale, p);
  values.prefetch_first(first, n);  // the first block of values on its way
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p + g * cnt;
    const typename V::F inv = V::set1(1.0f / softmax_numerators<V>(pg, cnt));
    // the weights in bf16, zero past cnt (written out, not in a lambda: a lambda's body would
    // not carry the ISA's target attribute)
    for (int64_t j = 0; j < ldp; j += 2 * L) {
      const int64_t k0 = std::clamp<int64_t>(cnt - j, 0, L);
      const int64_t k1 = std::clamp<int64_t>(cnt - j - L, 0, L);
      V::store_bf16(pb.data() + g * ldp + j,
                    V::mul(V::load_masked(k0, pg + std::min(j, cnt)), inv),
                    V::mul(V::load_masked(k1, pg + std::min(j + L, cnt)), inv));
    }
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(pb.data());
  switch (D / L) {
    case 2: return weighted_values_b16<V, 2>(w, ldp / 2, G, values, first, n, out);
    case 4: return weighted_values_b16<V, 4>(w, ldp / 2, G, values, first, n, out);
    case 6: return weighted_values_b16<V, 6>(w, ldp / 2, G, values, first, n, out);
    case 8: return weighted_values_b16<V, 8>(w, ldp / 2, G, values, first, n, out);
    case 10: return weighted_values_b16<V, 10>(w, ldp / 2, G, values, first, n, out);
    case 12: return weighted_values_b16<V, 12>(w, ldp / 2, G, values, first, n, out);
    case 14: return weighted_values_b16<V, 14>(w, ldp / 2, G, values, first, n, out);
    default: return weighted_values_b16<V, 16>(w, ldp / 2, G, values, first, n, out);
  }
}

// paged_attention's per-KV-head work (common.h's attend_heads; attend_b16 where it applies), one
// target-specific function with everything inlined, so that the vector helpers inline into its
// loops.
template <class V, typename T>
QP_TARGET __attribute__((flatten)) void attend(const float* q, int64_t G,
                                               const PagedRows<T>& keys,
                                               const PagedRows<T>& values, int64_t first,
                                               int64_t n, float scale, float* p, float* out) {
  if constexpr (V::kBf16Dot && std::is_same_v<T, uint16_t>) {
    if (keys.D % (2 * V::L) == 0 && keys.D <= kTiledMaxDim)
      return attend_b16<V>(q, G, keys, values, first, n, scale, p, out);
  }
  attend_heads<V::L>(q, G, keys, values, first, n, scale, p, out,
                     [](const auto&... a) { scores<V>(a...); },
                     [](const auto&... a) { return dot<V>(a...); }, &softmax_numerators<V>,
                     [](const auto&... a) { weighted_values<V>(a...); });
}

// --- silu_mul: the gated MLP's activation ------------------------------------------------------
// gu fp32 [T, 2I] (gate | up, one fused projection) -> out [T, I] = silu(gate) * up, silu(g) =
// g / (1 + e^-g) in fp32 (exp_lanes's relative error < 2e-7; e^-g clamped to [e^-87, e^88]).
template <class V>
QP_TARGET void silu_mul_row(const float* gu, int64_t I, float* out) {
  using F = typename V::F;
  int64_t i = 0;
  for (; i + V::L <= I; i += V::L) {
    const F g = V::load(gu + i);
    const F e = exp_lanes<V>(V::min(V::sub(V::zero(), g), V::set1(88.0f)));
    const F sg = V::div(g, V::add(V::set1(1.0f), e));
    V::store(out + i, V::mul(sg, V::load(gu + I + i)));
  }
  for (; i < I; ++i) out[i] = gu[i] / (1.0f + std::exp(-gu[i])) * gu[I + i];
}

// --- gelu_tanh_mul: Gemma's gated MLP activation (gelu_pytorch_tanh) --------------------------
// gu fp32 [T, 2I] -> out [T, I] = gelu(gate) * up, gelu(g) = g / 2 * (1 + tanh(u)) with
// u = sqrt(2 / pi) * (g + 0.044715 g^3), computed as g / (1 + e^(-2u)) (the same function:
// (1 + tanh(u)) / 2 = sigmoid(2u)), which has no cancellation for negative g; fp32, e^(-2u)
// clamped to [e^-87, e^88] as in silu_mul.
template <class V>
QP_TARGET void gelu_tanh_mul_row(const float* gu, int64_t I, float* out) {
  using F = typename V::F;
  constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kA = 0.044715f;
  int64_t i = 0;
  for (; i + V::L <= I; i += V::L) {
    const F g = V::load(gu + i);
    const F u = V::mul(V::set1(kC), V::fmadd(V::mul(V::set1(kA), g), V::mul(g, g), g));
    const F e = exp_lanes<V>(V::min(V::mul(V::set1(-2.0f), u), V::set1(88.0f)));
    V::store(out + i, V::mul(V::div(g, V::add(V::set1(1.0f), e)), V::load(gu + I + i)));
  }
  for (; i < I; ++i) {
    const float g = gu[i], u = kC * (kA * g * (g * g) + g);
    out[i] = g / (1.0f + std::exp(std::min(-2.0f * u, 88.0f))) * gu[I + i];
  }
}

// --- add_rms_norm_ (common.h gives the formula) ---------------------------------------------

template <class V>
QP_TARGET float sum_squares(const float* h, int64_t D) {
  typename V::F acc = V::zero();
  int64_t i = 0;
  for (; i + V::L <= D; i += V::L) {
    const typename V::F v = V::load(h + i);
    acc = V::fmadd(v, v, acc);
  }
  float s = V::reduce_add(acc);
  for (; i < D; ++i) s += h[i] * h[i];
  return s;
}

// --- the ops both builds define the same way (V::check() first: the build's CPU check) --------

template <class V, int MaxTile>
at::Tensor w8a32_mm(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& zf, int64_t group_size) {
  V::check();
  return run_w8a32_mm<MaxTile>(x, q8, scales, zf, group_size, &group_sums_f32<V>,
                              [](auto mt, const auto&... args) {
                                int8_tile<V, decltype(mt)::value>(args...);
                              });
}

template <class V, int MaxTile>
at::Tensor fp16_mm(const at::Tensor& x, const at::Tensor& wb) {
  V::check();
  return run_fp16_mm<MaxTile>(x, wb, [](auto mt, const auto&... args) {
    fp16_tile<V, decltype(mt)::value>(args...);
  });
}

template <class V>
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_a8(const at::Tensor& x,
                                                           int64_t group_size) {
  V::check();
  return run_quantize_a8(x, group_size, &quantize_row<V>);
}

template <class V>
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool,
                           const at::Tensor& v_pool, const at::Tensor& block_tables,
                           const at::Tensor& ctx_lens, const at::Tensor& q_lens, double scale,
                           int64_t window) {
  V::check();
  return run_paged(q, k_pool, v_pool, block_tables, ctx_lens, q_lens, scale, window,
                   [](const auto&... a) { attend<V>(a...); },
                   [](const auto&... a) { attend_long<V>(a...); }, V::L);
}

template <class V>
at::Tensor silu_mul(const at::Tensor& gu) {
  V::check();
  return run_gated_act(gu, &silu_mul_row<V>);
}

template <class V>
at::Tensor gelu_tanh_mul(const at::Tensor& gu) {
  V::check();
  return run_gated_act(gu, &gelu_tanh_mul_row<V>);
}

template <class V>
at::Tensor add_rms_norm_(at::Tensor& h, const c10::optional<at::Tensor>& delta,
                         const at::Tensor& weight, double eps) {
  V::check();
  return run_add_rms_norm(h, delta, weight, eps, &sum_squares<V>);
}

}  // namespace simd
}  // namespace qp
