// quantpipe's CPU kernels for AVX2 + FMA + F16C machines (built by runtime/kernels/cpu_ext.py
// with -mavx2 -mfma -mf16c; loaded only on a CPU that has those). The same ops as the AVX-512
// build (cpu_ops.cpp) in the op namespace quantpipe_cpu_avx2, except w4a16_mm (W4A16 needs
// vdpbf16ps): the 4-bit linears run as w4a8_mm.
//
//   w4a8_mm        W4A8 GEMM/GEMV: int8 activations per block of 32, int8 dot products
//                  (pmaddubsw + pmaddwd, or AVX-VNNI vpdpbusd where the CPU has it)
//   quantize_a8    the activation quantizer w4a8_mm uses (exposed for tests)
//   w8a32_mm       W8A32 GEMM/GEMV, exact int8 weights x fp32 activations
//   w8a8_mm        int8 weights x int8 activations (pmaddubsw; the int8 output head)
//   fp16_mm        exact fp16 weights x fp32 activations (the output head)
//   bf16_mm        bf16 weights x bf16-rounded activations (the output head)
//   paged_attention, add_rms_norm_, rope_, silu_mul, gelu_tanh_mul, decoder_layer
//                  as in cpu_ops.cpp
//
// Every weight layout is the AVX-512 build's (16 output rows per block); an AVX2 register holds
// 8 fp32 lanes, so each block is computed as two halves of 8 rows. The kernels both builds share
// are csrc/simd.h's, over this file's 8-lane vector ops (struct Simd); the int8 dot products
// (pmaddubsw or AVX-VNNI) and the bf16 head are this file's own.

#include <torch/library.h>

#include <immintrin.h>

#include <cmath>

#include "common.h"
#include "registration.h"

// the whole file is compiled for AVX2 + FMA + F16C (cpu_ext.py's flags): simd.h's functions need
// no target attribute
#define QP_TARGET
#include "simd.h"

namespace {

using qp::A8Acts;
using qp::kA8Block;
using qp::kRows;
constexpr int64_t kHalf = 8;  // output rows per AVX2 register
constexpr int kMaxTile = 4;  // activation rows per tile: 16 ymm registers hold 4 rows' state

// --- the vector ops of simd.h's shared kernels: 8 fp32 lanes ----------------------------------

struct Simd {
  static constexpr int L = 8;
  static constexpr bool kMasks = false;  // AVX2 has no masked fp32 loads and stores
  static constexpr bool kBf16Dot = false;  // no bf16 dot products: attention tiles stay fp32
  using F = __m256;
  using I = __m256i;
  QP_SIMD_OPS(_mm256, si256)
  static F load(const uint16_t* p) {  // bf16 -> fp32 is a 16-bit left shift
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static F load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F abs(F v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
  static F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n built in the exponent bits (n >= -126: exp_lanes clamps its argument)
  static F pow2_scale(F p, F n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static float reduce_add(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static int32_t reduce_add_i(I v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }
  static void store_first(float* p, F v, int64_t cnt) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int64_t i = 0; i < cnt; ++i) p[i] = lanes[i];
  }
  // int32 -> int16 -> int8 with saturation (values are in [-127, 127]); packs interleave the
  // 128-bit lanes, the final permute restores column order
  static void store_xq(int8_t* xq, const I (&q)[4]) {
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq), b);
  }
  // r[i] = the sum of the 8 lanes of v[i], i < 8 (a transpose-and-add tree)
  static F sum_lanes(const F (&v)[8]) {
    const F s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const F s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const F a = _mm256_hadd_ps(s01, s23), b = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  // FMA chains per row and half block (16 ymm registers hold 4 rows' state)
  static constexpr int int8_chains(int mt) { return mt >= 2 ? 1 : 2; }
  static constexpr int fp16_chains(int) { return 2; }
  static void check() {}  // this library is loaded only on CPUs with AVX2, FMA and F16C
};

// --- w4a8_mm (common.h gives the formula) ----------------------------------------------------
// The integer dot of one block is exact (|q * xq| <= 15 * 127; pmaddubsw's int16 pair sums
// stay below 2^15 even summed over the block's four chunks); scaling and sums are fp32.

// integer dot of one 32-column block for MT rows, 8 output rows (half h of the block)
struct DotMaddubs {
  template <int MT>
  static inline void run(const uint8_t* wb, const int8_t* const* xb, __m256i (&iacc)[MT]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i s16[MT];
    for (int m = 0; m < MT; ++m) s16[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 4 chunks of 8 columns
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MT; ++m) {
        s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(lo, Simd::bcast4(xb[m] + 8 * c)));
        s16[m] = _mm256_add_epi16(s16[m],
                                  _mm256_maddubs_epi16(hi, Simd::bcast4(xb[m] + 8 * c + 4)));
      }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MT; ++m) iacc[m] = _mm256_madd_epi16(s16[m], ones);
  }
};

struct DotAvxVnni {
  template <int MT>
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
        acc[m][0] = _mm256_dpbusd_avx_epi32(acc[m][0], lo, Simd::bcast4(xb[m] + 8 * c));
        acc[m][1] = _mm256_dpbusd_avx_epi32(acc[m][1], hi, Simd::bcast4(xb[m] + 8 * c + 4));
      }
    }
    for (int m = 0; m < MT; ++m) iacc[m] = _mm256_add_epi32(acc[m][0], acc[m][1]);
  }
};

// The two instruction sets as separate functions, everything inlined into each (flatten), so
// that the AVX-VNNI instructions appear only in w4a8_tile_vnni, which runs only where the CPU
// has them.
#define QP_A8_ARGS                                                                          \
  const A8Acts &a, int64_t m0, int64_t K, int64_t G, int64_t group_size, const uint8_t *w, \
      const uint16_t *sc, const float *mz, float *out, int64_t ldo
template <int MT>
__attribute__((flatten)) void w4a8_tile(QP_A8_ARGS) {
  qp::simd::w4a8_tile<Simd, DotMaddubs, MT>(a, m0, K, G, group_size, w, sc, mz, out, ldo);
}
template <int MT>
__attribute__((flatten, target("avxvnni"))) void w4a8_tile_vnni(QP_A8_ARGS) {
  qp::simd::w4a8_tile<Simd, DotAvxVnni, MT>(a, m0, K, G, group_size, w, sc, mz, out, ldo);
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
at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mz, int64_t group_size, bool vnni) {
  TORCH_CHECK(!vnni || has_avxvnni(), "vnni=True but the CPU lacks AVX-VNNI (avx_vnni)");
  return qp::run_w4a8_mm<kMaxTile>(x, packed, scales, mz, group_size,
                                      &qp::simd::quantize_row<Simd>,
                                      [vnni](auto mt, const auto&... args) {
                                        if (vnni) w4a8_tile_vnni<decltype(mt)::value>(args...);
                                        else w4a8_tile<decltype(mt)::value>(args...);
                                      });
}

// --- w8a8_mm: the int8 head, int8 activations (common.h gives the layout and formula) ------

// The exact integer dot of one 32-column block, 8 output rows: pmaddubsw multiplies |q| (as
// unsigned bytes) by xq with q's sign, so each int16 pair sum is at most 2 * 128 * 127 < 2^15
// (no saturation); pmaddwd widens to int32 per chunk. xs is not needed here.
struct DotI8Maddubs {
  template <int MT>
  static inline void run(const int8_t* w, const int8_t* const* xb, const int32_t*,
                         __m256i (&iacc)[MT]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MT; ++m) iacc[m] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {  // 8 chunks of 4 columns
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64));
      const __m256i aq = _mm256_sign_epi8(q, q);  // |q| (-128 -> 128 as unsigned)
      for (int m = 0; m < MT; ++m) {
        const __m256i sx = _mm256_sign_epi8(Simd::bcast4(xb[m] + 4 * c), q);
        iacc[m] = _mm256_add_epi32(iacc[m],
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), ones));
      }
    }
  }
};

template <int MT>
__attribute__((flatten)) void w8a8_tile(const A8Acts& a, const int32_t* xsum, int64_t m0,
                                        int64_t K, const int8_t* w, const uint16_t* sc,
                                        float* out, int64_t ldo) {
  qp::simd::w8a8_tile<Simd, DotI8Maddubs, MT>(a, xsum, m0, K, w, sc, out, ldo);
}

at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales) {
  return qp::run_w8a8_mm<kMaxTile>(x, q8, scales, &qp::simd::quantize_row<Simd>,
                                      [](auto mt, const auto&... args) {
                                        w8a8_tile<decltype(mt)::value>(args...);
                                      });
}

// --- bf16_mm: the output head (the AVX-512 build's layout) ------------------------------------
// wb bf16 [N/16, K/2, 16, 2]; each 32-bit lane holds (w[k], w[k + 1]) of one row, so w[k] is the
// lane shifted left by 16 and w[k + 1] the lane's high half; x rounded to bf16 (held as fp32).

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

// x rounded to bf16, held as fp32
void round_bf16(const float* x, float* xb, int64_t n) {
  for (int64_t i = 0; i < n; ++i) xb[i] = qp::bf16_to_float(qp::float_to_bf16(x[i]));
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& wb) {
  return qp::run_bf16_mm<kMaxTile, float>(x, wb, &round_bf16, [](auto mt, const auto&... args) {
    bf16_tile<decltype(mt)::value>(args...);
  });
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
  using namespace qp::simd;
  qp::impl_ops(m, {&w8a32_mm<Simd, kMaxTile>, &w4a8_mm, &quantize_a8<Simd>,  // OpImpls' order
                   &fp16_mm<Simd, kMaxTile>, &bf16_mm, &paged_attention<Simd>,
                   &add_rms_norm_<Simd>, &silu_mul<Simd>, &gelu_tanh_mul<Simd>,
                   &w8a8_mm});
}
