// quantpipe's CPU kernels for AVX2 + FMA + F16C machines (built by runtime/kernels/cpu_ext.py
// with -mavx2 -mfma -mf16c; loaded only on a CPU that has those). The same ops as the AVX-512
// build (cpu_ops.cpp) in the op namespace quantpipe_cpu_avx2, except int4_mm (W4A16 needs
// vdpbf16ps): the 4-bit linears run as int4_a8_mm.
//
//   int4_a8_mm     W4A8 GEMM/GEMV: int8 activations per block of 32, int8 dot products
//                  (pmaddubsw + pmaddwd, or AVX-VNNI vpdpbusd where the CPU has it)
//   quantize_a8    the activation quantizer int4_a8_mm uses (exposed for tests)
//   int8_mm        W8A16 GEMM/GEMV, exact int8 weights x fp32 activations
//   fp16_mm        exact fp16 weights x fp32 activations (the output head)
//   bf16_mm        bf16 weights x bf16-rounded activations (the output head)
//   paged_attention, add_rms_norm_, rope_   as in cpu_ops.cpp
//
// Every weight layout is the AVX-512 build's (16 output rows per block); an AVX2 register holds
// 8 fp32 lanes, so each block is computed as two halves of 8 rows.

#include <torch/library.h>

#include <immintrin.h>

#include <cmath>

#include "common.h"

namespace {

using qp::A8Acts;
using qp::kA8Block;
using qp::kRows;
constexpr int64_t kHalf = 8;  // output rows per AVX2 register
constexpr int kMaxTile = 4;  // activation rows per tile: 16 ymm registers hold 4 rows' state

// --- activation quantization (W4A8; common.h gives the formula) -----------------------------

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// one row: x fp32 [K] -> xq int8 [K], dx fp32 [K / 32], qsum fp32 [K / group_size]
void quantize_row(const float* x, int64_t K, int64_t group_size, int8_t* xq, float* dx,
                  float* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int64_t per_group = group_size / kA8Block;
  for (int64_t blk = 0; blk < K / kA8Block; ++blk) {
    const float* xb = x + blk * kA8Block;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float a = hmax8(amax);
    const float d = a / 127.0f;
    const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    __m256i q[4];  // int32, rounded to nearest even (MXCSR default)
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                          _mm256_add_epi32(q[2], q[3]));
    // int32 -> int16 -> int8 with saturation (values are in [-127, 127]); packs interleave the
    // 128-bit lanes, the final permute restores column order
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + blk * kA8Block), b);
    dx[blk] = d;
    const float part = d * static_cast<float>(hsum8i(isum));
    if (blk % per_group == 0) qsum[blk / per_group] = part;
    else qsum[blk / per_group] += part;
  }
}

// --- int4_a8_mm (common.h gives the formula) ----------------------------------------------------
// The integer dot of one block is exact (|q * xq| <= 15 * 127; pmaddubsw's int16 pair sums
// stay below 2^15 even summed over the block's four chunks); scaling and sums are fp32.

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// integer dot of one 32-column block for MT rows, 8 output rows (half h of the block)
template <int MT, bool VNNI>
struct BlockDot;

template <int MT>
struct BlockDot<MT, false> {
  static inline void run(const uint8_t* wb, const int8_t* const* xb, __m256i (&iacc)[MT]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i s16[MT];
    for (int m = 0; m < MT; ++m) s16[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 4 chunks of 8 columns
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MT; ++m) {
        s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(lo, bcast4(xb[m] + 8 * c)));
        s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(hi, bcast4(xb[m] + 8 * c + 4)));
      }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MT; ++m) iacc[m] = _mm256_madd_epi16(s16[m], ones);
  }
};

template <int MT>
struct BlockDot<MT, true> {
  __attribute__((target("avxvnni"))) static inline void run(const uint8_t* wb,
                                                            const int8_t* const* xb,
                                                            __m256i (&iacc)[MT]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MT; ++m) {  // two chains per row: vpdpbusd's latency
        acc[m][0] = _mm256_dpbusd_avx_epi32(acc[m][0], lo, bcast4(xb[m] + 8 * c));
        acc[m][1] = _mm256_dpbusd_avx_epi32(acc[m][1], hi, bcast4(xb[m] + 8 * c + 4));
      }
    }
    for (int m = 0; m < MT; ++m) iacc[m] = _mm256_add_epi32(acc[m][0], acc[m][1]);
  }
};

// One block of 16 output rows (as two halves of 8) for MT activation rows.
//   w  the block's chunks [K/8, 64]; sc / mz the block's [G, 16]; out row m at out + m * ldo
template <int MT, bool VNNI>
inline void a8_tile_body(const A8Acts& a, int64_t m0, int64_t K, int64_t G, int64_t group_size,
             const uint8_t* w, const float* sc, const float* mz, float* out, int64_t ldo) {
  const int64_t nb = K / kA8Block, per_group = group_size / kA8Block;
  for (int64_t h = 0; h < 2; ++h) {
    __m256 total[MT];
    for (int m = 0; m < MT; ++m) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 s = _mm256_loadu_ps(sc + g * kRows + h * kHalf);
      for (int64_t blk = g * per_group; blk < (g + 1) * per_group; ++blk) {
        const int8_t* xb[MT];
        for (int m = 0; m < MT; ++m) xb[m] = a.xq.data() + (m0 + m) * K + blk * kA8Block;
        __m256i iacc[MT];
        BlockDot<MT, VNNI>::run(w + blk * 4 * 64 + h * 32, xb, iacc);
        for (int m = 0; m < MT; ++m) {
          const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(a.dx[(m0 + m) * nb + blk]));
          total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m]), sd, total[m]);
        }
      }
      const __m256 z = _mm256_loadu_ps(mz + g * kRows + h * kHalf);
      for (int m = 0; m < MT; ++m)
        total[m] = _mm256_fmadd_ps(z, _mm256_set1_ps(a.qsum[(m0 + m) * G + g]), total[m]);
    }
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo + h * kHalf, total[m]);
  }
}

// The two instruction sets as separate functions, everything inlined into each (flatten), so
// that the AVX-VNNI instructions appear only in a8_tile_vnni, which runs only where the CPU
// has them.
#define QP_A8_ARGS                                                                          \
  const A8Acts &a, int64_t m0, int64_t K, int64_t G, int64_t group_size, const uint8_t *w, \
      const float *sc, const float *mz, float *out, int64_t ldo
template <int MT>
__attribute__((flatten)) void a8_tile(QP_A8_ARGS) {
  a8_tile_body<MT, false>(a, m0, K, G, group_size, w, sc, mz, out, ldo);
}
template <int MT>
__attribute__((flatten, target("avxvnni"))) void a8_tile_vnni(QP_A8_ARGS) {
  a8_tile_body<MT, true>(a, m0, K, G, group_size, w, sc, mz, out, ldo);
}
#undef QP_A8_ARGS

bool has_avxvnni() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avxvnni");
  }();
  return yes;
}

// y fp32 [M, N] = x fp32 [M, K] @ W^T with int8 activations; vnni: use AVX-VNNI (checked)
at::Tensor int4_a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& mz, int64_t group_size, bool vnni) {
  TORCH_CHECK(!vnni || has_avxvnni(), "vnni=True but the CPU lacks AVX-VNNI (avx_vnni)");
  return qp::run_int4_a8_mm<kMaxTile>(x, packed, scales, mz, group_size, &quantize_row,
                                      [vnni](auto mt, const auto&... args) {
                                        if (vnni) a8_tile_vnni<decltype(mt)::value>(args...);
                                        else a8_tile<decltype(mt)::value>(args...);
                                      });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_a8(const at::Tensor& x,
                                                           int64_t group_size) {
  return qp::run_quantize_a8(x, group_size, &quantize_row);
}

// --- int8_mm: W8A16 (common.h gives the layout and numerics) ---------------------------------

// sumx[i] = sum of the fp32 values x[i * group_size : (i + 1) * group_size]
void group_sums_f32(const float* x, int64_t n_groups, int64_t group_size, float* sumx) {
  for (int64_t i = 0; i < n_groups; ++i) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < group_size; k += 8)
      acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i * group_size + k));
    sumx[i] = hsum8(acc);
  }
}

template <int MT>
void int8_tile(const float* x, int64_t K, const float* sumx, int64_t G, const int8_t* w,
               const uint16_t* sc, const float* zf, int64_t group_size, float* out,
               int64_t ldo) {
  constexpr int P = MT >= 2 ? 1 : 2;  // FMA chains in flight per row and half
  for (int64_t h = 0; h < 2; ++h) {
    __m256 total[MT];
    for (int m = 0; m < MT; ++m) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[MT][P];
      for (int m = 0; m < MT; ++m)
        for (int p = 0; p < P; ++p) acc[m][p] = _mm256_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += P) {
        for (int p = 0; p < P; ++p) {
          const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(w + (k + p) * kRows + h * kHalf))));
          for (int m = 0; m < MT; ++m)
            acc[m][p] = _mm256_fmadd_ps(wv, _mm256_set1_ps(x[m * K + k + p]), acc[m][p]);
        }
      }
      const __m256 s = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * kRows + h * kHalf)));
      for (int m = 0; m < MT; ++m) {
        __m256 sum = acc[m][0];
        for (int p = 1; p < P; ++p) sum = _mm256_add_ps(sum, acc[m][p]);
        total[m] = _mm256_fmadd_ps(sum, s, total[m]);
      }
      if (zf != nullptr) {
        const __m256 z = _mm256_loadu_ps(zf + g * kRows + h * kHalf);
        for (int m = 0; m < MT; ++m)
          total[m] = _mm256_fmadd_ps(z, _mm256_set1_ps(sumx[m * G + g]), total[m]);
      }
    }
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo + h * kHalf, total[m]);
  }
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& zf, int64_t group_size) {
  return qp::run_int8_mm<kMaxTile>(x, q8, scales, zf, group_size, &group_sums_f32,
                                   [](auto mt, const auto&... args) {
                                     int8_tile<decltype(mt)::value>(args...);
                                   });
}

// --- fp16_mm / bf16_mm: the output head (the AVX-512 build's layouts) ------------------------
// fp16: wb fp16 [N/16, K, 16], exact fp16 -> fp32 (vcvtph2ps), fp32 activations and sums.
// bf16: wb bf16 [N/16, K/2, 16, 2]; each 32-bit lane holds (w[k], w[k + 1]) of one row, so
// w[k] is the lane shifted left by 16 and w[k + 1] the lane's high half; x rounded to bf16.

template <int MT>
void fp16_tile(const float* x, int64_t K, const uint16_t* w, float* out, int64_t ldo) {
  for (int64_t h = 0; h < 2; ++h) {
    __m256 acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      for (int p = 0; p < 2; ++p) {
        const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(w + (k + p) * kRows + h * kHalf)));
        for (int m = 0; m < MT; ++m)
          acc[m][p] = _mm256_fmadd_ps(wv, _mm256_set1_ps(x[m * K + k + p]), acc[m][p]);
      }
    }
    for (; k < K; ++k) {
      const __m256 wv = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kRows + h * kHalf)));
      for (int m = 0; m < MT; ++m)
        acc[m][0] = _mm256_fmadd_ps(wv, _mm256_set1_ps(x[m * K + k]), acc[m][0]);
    }
    for (int m = 0; m < MT; ++m)
      _mm256_storeu_ps(out + m * ldo + h * kHalf, _mm256_add_ps(acc[m][0], acc[m][1]));
  }
}

template <int MT>
void bf16_tile(const float* x, int64_t K, const uint16_t* w, float* out, int64_t ldo) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t h = 0; h < 2; ++h) {
    __m256 acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < K / 2; ++j) {
      const __m256i pair = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w + (j * kRows + h * kHalf) * 2));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
      for (int m = 0; m < MT; ++m) {
        acc[m][0] = _mm256_fmadd_ps(w0, _mm256_set1_ps(x[m * K + 2 * j]), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w1, _mm256_set1_ps(x[m * K + 2 * j + 1]), acc[m][1]);
      }
    }
    for (int m = 0; m < MT; ++m)
      _mm256_storeu_ps(out + m * ldo + h * kHalf, _mm256_add_ps(acc[m][0], acc[m][1]));
  }
}

at::Tensor fp16_mm(const at::Tensor& x, const at::Tensor& wb) {
  return qp::run_fp16_mm<kMaxTile>(x, wb, [](auto mt, const auto&... args) {
    fp16_tile<decltype(mt)::value>(args...);
  });
}

// x rounded to bf16, held as fp32
void round_bf16(const float* x, float* xb, int64_t n) {
  for (int64_t i = 0; i < n; ++i) xb[i] = qp::bf16_to_float(qp::float_to_bf16(x[i]));
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& wb) {
  return qp::run_bf16_mm<kMaxTile, float>(x, wb, &round_bf16, [](auto mt, const auto&... args) {
    bf16_tile<decltype(mt)::value>(args...);
  });
}

// --- paged_attention (cpu_ops.cpp describes the arguments) -----------------------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16 -> fp32 is a 16-bit left shift
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline float scalar(float v) { return v; }
inline float scalar(uint16_t h) { return qp::bf16_to_float(h); }

template <typename T>
float dot(const float* a, const T* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  float s = hsum8(acc);
  for (; i < D; ++i) s += a[i] * scalar(b[i]);
  return s;
}

template <typename T>
void axpy(float alpha, const T* x, float* y, int64_t D) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < D; ++i) y[i] += alpha * scalar(x[i]);
}

// exp(x) for 8 lanes, -87 <= x <= 88 (clamped below): x = n ln2 + r, |r| <= ln2 / 2, e^r by
// its degree-6 Taylor polynomial (relative error < 2e-7), times 2^n built in the exponent bits
// (n >= -126)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // e^-87 ~ 1.6e-38: still a normal fp32
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 split in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// p[0..n) <- exp(p - max(p)); returns the sum
float softmax_numerators(float* p, int64_t n) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), m));
    _mm256_storeu_ps(p + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float s = hsum8(acc);
  for (; j < n; ++j) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, exp8(_mm256_set1_ps(p[j] - mx)));
    p[j] = tmp[0];
    s += tmp[0];
  }
  return s;
}

// r[i] = the sum of the 8 lanes of v[i], i < 8 (a transpose-and-add tree)
inline __m256 sum_lanes8(const __m256 (&v)[8]) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 a = _mm256_hadd_ps(s01, s23), b = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// p[g * n + j] = scale * q_g . k_j for keys j < n, D a multiple of 8: 8 keys at a time
template <typename T>
void scores8(const float* q, int64_t G, const qp::PagedRows<T>& keys, int64_t n, float scale,
             float* p) {
  const int64_t D = keys.D;
  const T* rows[8];
  int64_t blk = 0, off = 0;  // position of key j0 in the block table
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t cnt = std::min<int64_t>(8, n - j0);
    for (int64_t jj = 0; jj < cnt; ++jj) {
      rows[jj] = keys.row(blk, off);
      if (++off == keys.BS) off = 0, ++blk;
    }
    for (int64_t g = 0; g < G; ++g) {
      __m256 part[8];
      for (int64_t jj = 0; jj < 8; ++jj) {
        __m256 acc = _mm256_setzero_ps();
        if (jj < cnt)
          for (int64_t d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), load8(rows[jj] + d), acc);
        part[jj] = acc;
      }
      alignas(32) float sums[8];
      _mm256_store_ps(sums, _mm256_mul_ps(sum_lanes8(part), _mm256_set1_ps(scale)));
      for (int64_t jj = 0; jj < cnt; ++jj) p[g * n + j0 + jj] = sums[jj];
    }
  }
}

template <typename T>
void attend(const float* q, int64_t G, const qp::PagedRows<T>& keys,
            const qp::PagedRows<T>& values, int64_t n, float scale, float* p, float* out) {
  qp::attend_heads<8>(
      q, G, keys, values, n, scale, p, out, [](const auto&... a) { scores8(a...); },
      [](const auto&... a) { return dot(a...); }, &softmax_numerators,
      [](const auto&... a) { axpy(a...); });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool,
                           const at::Tensor& v_pool, const at::Tensor& block_tables,
                           const at::Tensor& ctx_lens, const at::Tensor& q_lens, double scale) {
  return qp::run_paged(q, k_pool, v_pool, block_tables, ctx_lens, q_lens, scale,
                       [](const auto&... a) { attend(a...); });
}

// --- silu_mul: silu(gate) * up from the fused [T, 2I] projection (cpu_ops.cpp) --------------

void silu_mul_row(const float* gu, int64_t I, float* out) {
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 g = _mm256_loadu_ps(gu + i);
    // exp8 builds 2^n in the exponent bits: e^-g clamped to [e^-87, e^88]
    const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                        _mm256_set1_ps(88.0f)));
    const __m256 sg = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(sg, _mm256_loadu_ps(gu + I + i)));
  }
  for (; i < I; ++i) out[i] = gu[i] / (1.0f + std::exp(-gu[i])) * gu[I + i];
}

at::Tensor silu_mul(const at::Tensor& gu) { return qp::run_silu_mul(gu, &silu_mul_row); }

// --- add_rms_norm_: h += delta (optional), out = weight * h / sqrt(mean(h^2) + eps) -----------

float sum_squares(const float* h, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    const __m256 v = _mm256_loadu_ps(h + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum8(acc);
  for (; i < D; ++i) s += h[i] * h[i];
  return s;
}

at::Tensor add_rms_norm_(at::Tensor& h, const c10::optional<at::Tensor>& delta,
                         const at::Tensor& weight, double eps) {
  return qp::run_add_rms_norm(h, delta, weight, eps, &sum_squares);
}

bool supported() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return yes;
}

bool avxvnni_supported() { return has_avxvnni(); }

}  // namespace

TORCH_LIBRARY(quantpipe_cpu_avx2, m) {
  qp::def_ops(m);
  m.def("supported() -> bool", &supported);
  m.def("vnni_supported() -> bool", &avxvnni_supported);
}

TORCH_LIBRARY_IMPL(quantpipe_cpu_avx2, CPU, m) {
  qp::impl_ops(m, {&int8_mm, &int4_a8_mm, &quantize_a8, &fp16_mm, &bf16_mm,  // OpImpls' order
                   &paged_attention, &add_rms_norm_, &silu_mul});
}
