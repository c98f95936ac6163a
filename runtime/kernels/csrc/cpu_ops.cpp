// quantpipe's CPU kernels for AVX-512 BF16 + VNNI machines (built by runtime/kernels/cpu_ext.py;
// cpu_ops_avx2.cpp is the AVX2 build of the same ops, csrc/common.h their shared plain C++,
// csrc/simd.h their shared SIMD kernels over this file's 16-lane vector ops, struct Simd,
// csrc/decoder_layer.h the whole-layer op and csrc/registration.h the ops' schemas).
//
//   w4a8_mm        W4A8 GEMM/GEMV, int8 activations per 32 columns, vpdpbusd (the 4-bit default);
//                  from 32 rows on AMX CPUs it runs w4a8_mm_amx
//   w4a8_mm_amx    the same weights expanded to bf16 on the AMX tile unit (amx_supported())
//   quantize_a8    w4a8_mm's activation quantizer (exposed for tests)
//   w4a16_mm       W4A16 GEMM/GEMV, bf16 activations (QUANTPIPE_CPU_INT4_ACT=bf16)
//   w8a32_mm       W8A32 GEMM/GEMV, exact int8 weights x fp32 activations (8-bit linears)
//   w8a8_mm        int8 weights x int8 activations, vpdpbusd (the int8 output head)
//   fp16_mm        exact fp16 weights x fp32 activations (the output head)
//   bf16_mm        bf16 weights x bf16 activations (the output head, half the FMAs of fp16_mm)
//   paged_attention  short query chunks over their paged K/V blocks (decode, small prefills),
//                  optionally within a sliding window
//   add_rms_norm_  h += delta (optional), then RMSNorm(h) (Llama/Qwen2/Mistral norms)
//   rope_          rotary embedding (rotate-half convention) applied in place to q and k
//   silu_mul       silu(gate) * up of a fused gate/up projection
//   gelu_tanh_mul  gelu_pytorch_tanh(gate) * up (Gemma's MLP)
//   decoder_layer  a whole decoder layer of a short step (decoder_layer.h)

// --- w4a16_mm ------------------------------------------------------------------------------
//
// Why our own: torch's int4pack CPU kernel is compute-bound on the AVX-512 machines we measured
// (docs/runtime.md) and works in blocks of 4 activation rows, so an 8-row decode
// step costs twice a 4-row one. This kernel expands each 32-byte chunk of packed weights once,
// with two table lookups, and feeds it to `vdpbf16ps` for every activation row of the tile.
//
// Layout (built by runtime/kernels/cpu.py:repack_w4a16; unpack_w4a16 inverts it, tested exactly):
//   packed  uint8 [N/16, K/4, 32]: block b holds output rows 16b..16b+15; chunk c holds
//           k = 4c..4c+3; byte j = 2r + e holds q[16b + r][4c + e] in its low nibble and
//           q[16b + r][4c + 2 + e] in its high nibble (r in 0..15, e in 0..1).
//   scales  fp16  [N/16, G, 16]  (the checkpoint's fp16 scales, exact)
//   zf      fp32  [N/16, G, 16]  zero point (8 - z) * scale; absent (undefined) when every z == 8
// so that w[n][k] = (q - 8) * scale + zf. Sixteen output rows are the 16 fp32 lanes of a zmm
// register; a bf16 pair (x[k], x[k+1]) is broadcast to every lane, so no horizontal sums.
//
// Numerics: (q - 8) is exact in bf16; x is rounded to bf16 (RNE) once; products and the
// per-group sums are fp32 (vdpbf16ps), scaled per group in fp32.

#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <memory>

#include "common.h"
#include "registration.h"

// the functions with vector code, here and in simd.h (the rest of the file is plain x86-64:
// it runs before the CPU check)
#define QP_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma,f16c")))
#include "simd.h"

namespace {

using qp::A8Acts;
using qp::kA8Block;
using qp::kRows;
constexpr int kMaxTile = 8;  // activation rows that share one expanded weight chunk

QP_TARGET inline __m512bh as_bh(__m512i v) {
  __m512bh r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}

QP_TARGET inline __m512i bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// bf16 bit patterns of q - 8 for q in 0..15 (vpermw uses the low 5 bits of each index)
QP_TARGET inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>((i & 15) - 8);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    t[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers have short mantissas
  }
  return _mm512_load_si512(t);
}

// One block of 16 output rows for MT activation rows.
//   x     bf16 bits [MT rows, stride K]     sumx  fp32 [MT rows, stride G] (only if zf)
//   w     the block's chunks [K/4, 32]      sc / zf  the block's [G, 16]
//   out   fp32, row m at out + m * ldo
// vdpbf16ps has a latency of several cycles: with few rows, one accumulator per row would
// serialise the chunks, so each row gets 2 * P independent chains (P chunks in flight).
template <int MT>
QP_TARGET void block_tile(const uint16_t* x, int64_t K, const float* sumx, int64_t G,
                          const uint8_t* w, const uint16_t* sc, const float* zf,
                          int64_t group_size, float* out, int64_t ldo) {
  constexpr int P = MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);  // chunks in flight per row
  const __m512i table = nibble_table();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const int64_t chunks = group_size / 4;  // a multiple of P: group_size is 32, 64, 128 or 256
  __m512 total[MT];
  for (int m = 0; m < MT; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MT][2 * P];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < 2 * P; ++a) acc[m][a] = _mm512_setzero_ps();
    const uint8_t* wg = w + g * chunks * 32;
    const uint16_t* xg = x + g * group_size;
    for (int64_t c0 = 0; c0 < chunks; c0 += P) {
      for (int p = 0; p < P; ++p) {
        const int64_t c = c0 + p;
        const __m512i w16 = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 32)));
        const __m512bh lo = as_bh(_mm512_permutexvar_epi16(_mm512_and_si512(w16, low4), table));
        const __m512bh hi = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(w16, 4), table));
        for (int m = 0; m < MT; ++m) {
          const uint16_t* xk = xg + m * K + 4 * c;
          acc[m][2 * p] = _mm512_dpbf16_ps(acc[m][2 * p], lo, as_bh(bcast_pair(xk)));
          acc[m][2 * p + 1] = _mm512_dpbf16_ps(acc[m][2 * p + 1], hi, as_bh(bcast_pair(xk + 2)));
        }
      }
    }
    const __m512 s =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * kRows)));
    for (int m = 0; m < MT; ++m) {
      __m512 sum = acc[m][0];
      for (int a = 1; a < 2 * P; ++a) sum = _mm512_add_ps(sum, acc[m][a]);
      total[m] = _mm512_fmadd_ps(sum, s, total[m]);
    }
    if (zf != nullptr) {
      const __m512 z = _mm512_loadu_ps(zf + g * kRows);
      for (int m = 0; m < MT; ++m)
        total[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(sumx[m * G + g]), total[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo, total[m]);
}


// x fp32 [n] -> bf16 bits [n], round to nearest even (vcvtneps2bf16)
QP_TARGET void to_bf16(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256i v =
        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, x + i)));
    _mm256_mask_storeu_epi16(out + i, tail, v);
  }
}

// sumx[i] = sum of the bf16 values x[i * group_size : (i + 1) * group_size], i < n_groups
QP_TARGET void group_sums(const uint16_t* x, int64_t n_groups, int64_t group_size, float* sumx) {
  for (int64_t i = 0; i < n_groups; ++i) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < group_size; k += 16) {  // bf16 -> fp32 is a 16-bit left shift
      const __m256i h =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * group_size + k));
      acc = _mm512_add_ps(
          acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    sumx[i] = _mm512_reduce_add_ps(acc);
  }
}

// Checked by every op (hundreds of calls per decoded token): the CPU is probed once.
bool cpu_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return supported;
}

void check_cpu() {
  TORCH_CHECK(cpu_supported(), "quantpipe AVX-512 kernels need AVX-512 BF16 and VNNI");
}

void check_scales(const at::Tensor& scales, const c10::optional<at::Tensor>& zf, int64_t NB,
                  int64_t K, int64_t group_size) {
  check_cpu();
  qp::check_group_tensors(scales, zf, NB, K, group_size, at::kHalf, 16);
}

void check_weights(const at::Tensor& packed, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& zf, int64_t group_size) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 32,
              "packed must be contiguous uint8 [N/16, K/4, 32]");
  check_scales(scales, zf, packed.size(0), packed.size(1) * 4, group_size);
}

// y fp32 [M, N] = x [M, K] (fp32 or bf16; used as bf16) @ W^T, W from the packed layout.
at::Tensor w4a16_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& zf, int64_t group_size) {
  check_weights(packed, scales, zf, group_size);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be contiguous fp32 or bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * kRows;
  TORCH_CHECK(packed.size(1) * 4 == K, "packed holds K = ", packed.size(1) * 4, ", x has ", K);
  const int64_t G = K / group_size;
  at::Tensor x_bf16 = x;
  if (x.scalar_type() == at::kFloat) {
    x_bf16 = at::empty({M, K}, x.options().dtype(at::kBFloat16));
    to_bf16(x.data_ptr<float>(), reinterpret_cast<uint16_t*>(x_bf16.data_ptr<at::BFloat16>()),
            M * K);
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x_bf16.data_ptr<at::BFloat16>());
  std::vector<float> sumx;  // fp32 [M, G]: sums of the bf16 activations of each group
  const float* zfp = nullptr;
  if (zf.has_value()) {
    zfp = zf->data_ptr<float>();
    sumx.resize(M * G);
    group_sums(xp, M * G, group_size, sumx.data());
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* scp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t wblock = K / 4 * 32, sblock = G * kRows;
  qp::for_each_tile<kMaxTile>(M, NB, K, [&](int64_t b, int64_t m0, auto mt) {
    block_tile<decltype(mt)::value>(xp + m0 * K, K, zfp ? sumx.data() + m0 * G : nullptr, G,
                                    wp + b * wblock, scp + b * sblock,
                                    zfp ? zfp + b * sblock : nullptr, group_size,
                                    yp + m0 * N + b * kRows, N);
  });
  return y;
}

// --- the vector ops of simd.h's shared kernels: 16 fp32 lanes ---------------------------------

// bf16 bits [16] -> fp32 (a 16-bit left shift)
QP_TARGET inline __m512 bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

struct Simd {
  static constexpr int L = 16;
  static constexpr bool kMasks = true;
  using F = __m512;
  using I = __m512i;
  QP_SIMD_OPS(_mm512, si512)
  QP_TARGET static F load(const uint16_t* p) { return bf16x16(p); }
  // bf16 dot products (simd.h's attention tiles over a bf16 KV cache): lane i of acc plus the
  // products of the bf16 pairs in 32-bit lane i of a and b (vdpbf16ps, fp32 sums)
  static constexpr bool kBf16Dot = true;
  QP_TARGET static F dot_bf16(F acc, I a, I b) { return _mm512_dpbf16_ps(acc, as_bh(a), as_bh(b)); }
  QP_TARGET static I load_words(const uint32_t* p) { return _mm512_loadu_si512(p); }
  QP_TARGET static I bcast_word(const uint32_t* p) { return _mm512_set1_epi32(*p); }
  // the 16-bit words of a and b interleaved within each 128-bit lane: lo's 32-bit lane i holds
  // (a, b) of element (i / 4) * 8 + i % 4, hi's of element (i / 4) * 8 + 4 + i % 4
  QP_TARGET static void pair_words(I a, I b, I& lo, I& hi) {
    lo = _mm512_unpacklo_epi16(a, b);
    hi = _mm512_unpackhi_epi16(a, b);
  }
  // the inverse order for fp32 lanes: elements 0 .. 15 and 16 .. 31 of (lo, hi) as pair_words
  // arranged them
  QP_TARGET static void unpair(F lo, F hi, F& first, F& second) {
    const I a = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const I b = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    first = _mm512_permutex2var_ps(lo, a, hi);
    second = _mm512_permutex2var_ps(lo, b, hi);
  }
  // lo then hi (2 L fp32) rounded to bf16 (nearest even) and stored in that order
  QP_TARGET static void store_bf16(uint16_t* out, F lo, F hi) {
    const __m512bh b = _mm512_cvtne2ps_pbh(hi, lo);
    std::memcpy(out, &b, sizeof(b));
  }
  QP_TARGET static F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  QP_TARGET static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  QP_TARGET static F abs(F v) { return _mm512_abs_ps(v); }
  QP_TARGET static F round(F v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  QP_TARGET static F pow2_scale(F p, F n) { return _mm512_scalef_ps(p, n); }
  QP_TARGET static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
  QP_TARGET static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  QP_TARGET static int32_t reduce_add_i(I v) { return _mm512_reduce_add_epi32(v); }
  QP_TARGET static __mmask16 mask(int64_t cnt) { return static_cast<__mmask16>((1u << cnt) - 1); }
  QP_TARGET static F load_masked(int64_t cnt, const float* p) {
    return _mm512_maskz_loadu_ps(mask(cnt), p);
  }
  QP_TARGET static void store_masked(int64_t cnt, float* p, F v) {
    _mm512_mask_storeu_ps(p, mask(cnt), v);
  }
  QP_TARGET static F zero_masked(int64_t cnt, F v) { return _mm512_maskz_mov_ps(mask(cnt), v); }
  QP_TARGET static void store_first(float* p, F v, int64_t cnt) { store_masked(cnt, p, v); }
  QP_TARGET static void store_xq(int8_t* xq, const I (&q)[2]) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtsepi32_epi8(q[0]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtsepi32_epi8(q[1]));
  }
  // r[i] = the sum of the 16 lanes of v[i], i < 16: a transpose-and-add tree (45 ops for 16
  // sums instead of 16 separate horizontal reductions)
  QP_TARGET static F sum_lanes(const F (&v)[16]) {
    F b[4];  // b[i], 128-bit lane L: the sums of lane L of v[4i .. 4i + 3]
    for (int i = 0; i < 4; ++i) {
      F a[2];
      for (int h = 0; h < 2; ++h) {  // [x0+x2, y0+y2, x1+x3, y1+y3] per lane
        const F x = v[4 * i + 2 * h], y = v[4 * i + 2 * h + 1];
        a[h] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
      }
      b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[0], a[1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(a[0], a[1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const F d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const F d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88),
                         _mm512_shuffle_f32x4(d01, d23, 0xDD));
  }
  // FMA latency: with few rows per tile, each row gets several independent chains
  static constexpr int int8_chains(int mt) { return mt >= 4 ? 1 : (mt >= 2 ? 2 : 4); }
  static constexpr int fp16_chains(int mt) { return int8_chains(mt); }
  static void check() { check_cpu(); }
};

// --- w4a8_mm: W4A8 --------------------------------------------------------------------------
// The activations quantized to int8 per row and block of 32 columns, the 4-bit weights
// multiplied with them by vpdpbusd (unsigned q x signed xq, four products per 32-bit lane):
// common.h describes the layout (16 rows x 4 columns per half chunk), the quantizer and the
// formula; both builds give identical xq, dx and qsum.

// The exact integer dot of one 32-column block, all 16 rows (simd.h's w4a8_tile). vpdpbusd has a
// latency of several cycles: with few rows each row gets A independent chains.
struct DotVnni512 {
  template <int MT>
  QP_TARGET static void run(const uint8_t* w, const int8_t* const* xb, __m512i (&iacc)[MT]) {
    constexpr int A = MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i acc[MT][A];
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < A; ++i) acc[m][i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {  // 4 chunks of 8 columns
      const __m512i raw = _mm512_loadu_si512(w + c * 64);
      const __m512i lo = _mm512_and_si512(raw, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MT; ++m) {
        acc[m][(2 * c) % A] =
            _mm512_dpbusd_epi32(acc[m][(2 * c) % A], lo, Simd::bcast4(xb[m] + 8 * c));
        acc[m][(2 * c + 1) % A] =
            _mm512_dpbusd_epi32(acc[m][(2 * c + 1) % A], hi, Simd::bcast4(xb[m] + 8 * c + 4));
      }
    }
    for (int m = 0; m < MT; ++m) {
      iacc[m] = acc[m][0];
      for (int i = 1; i < A; ++i) iacc[m] = _mm512_add_epi32(iacc[m], acc[m][i]);
    }
  }
};

template <int MT>
QP_TARGET __attribute__((flatten)) void w4a8_tile(const A8Acts& a, int64_t m0, int64_t K,
                                                int64_t G, int64_t group_size, const uint8_t* w,
                                                const uint16_t* sc, const float* mz, float* out,
                                                int64_t ldo) {
  qp::simd::w4a8_tile<Simd, DotVnni512, MT>(a, m0, K, G, group_size, w, sc, mz, out, ldo);
}

// --- w4a8_mm on AMX: the weights in bf16 on the tile unit (prefill-sized row counts) -------
// From kAmxMinRows activation rows on a CPU with AMX, w4a8_mm runs this kernel instead of
// the VNNI tiles. An int8 AMX version of the W4A8 arithmetic was measured first: the per-block
// activation scales make it store every 32-column block's int32 tile and fold it into fp32
// with vector code, which then takes most of the time (1.5-2x the VNNI tiles, half of oneDNN's
// bf16 GEMM). This kernel instead expands the weights of two blocks of 16 output rows to bf16
// once, w = bf16(q * scale + mz) (the VNNI tile's fp32 weight, rounded once to nearest even),
// and multiplies them with the activations rounded to bf16 by tdpbf16ps, accumulating all of K
// in fp32 tiles: nothing per block beyond the tile instructions, the expansion shared by every
// 32 activation rows. Numerics: W4A16 with bf16 activations (every weight and activation
// within 2^-9 relative of its fp32 value, fp32 sums), as vLLM's and oneDNN's bf16 GEMMs on the
// dequantized model: finer than the int8 activations of the VNNI tiles, not their bits, so a
// row's result depends on whether its step had 32 rows (llama.cpp's and vLLM's CPU paths
// switch kernels by batch size too). Measured against both: bench/amx_mm.py.
constexpr int64_t kAmxRows = 16;  // activation rows per A tile
constexpr int64_t kAmxMinRows = 32;  // from here the tile kernel is faster (bench/amx_mm.py)
// chunks of weight-block pairs per thread: with one chunk per thread, a worker that comes late
// (asleep, or its core taken by torch's OpenMP threads, which spin after each aten op) leaves
// the caller to run the whole op alone
constexpr int64_t kAmxChunksPerThread = 8;
constexpr int64_t kAmxPassRows = 512;  // a multiple of 32

struct alignas(64) AmxConfig {  // the LDTILECFG operand, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether the CPU has AMX-TILE and AMX-BF16 and Linux lets this process use the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; without it a tile instruction
// faults); probed once.
bool amx_supported() {
  static const bool supported = [] {
    if (!cpu_supported()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if (((d >> 24) & 1u) == 0 || ((d >> 22) & 1u) == 0) return false;  // AMX-TILE, AMX-BF16
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return supported;
}

// w4a8_mm's choice: AMX where supported, unless QUANTPIPE_CPU_AMX=0 (read at every call of
// 32 rows or more: a process may switch, as the tests do); any value but 0, 1 or unset is an
// error, not a silent choice
bool amx_auto() {
  const char* env = std::getenv("QUANTPIPE_CPU_AMX");
  const std::string value = env != nullptr ? env : "";
  TORCH_CHECK(value.empty() || value == "0" || value == "1", "QUANTPIPE_CPU_AMX='", value,
              "': use 0 (the VNNI tiles at every row count) or 1 / unset (AMX from 32 rows "
              "where the CPU has it)");
  return value != "0" && amx_supported();
}

#define QP_AMX_TARGET                                                                       \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,fma,f16c,amx-tile," \
                        "amx-bf16")))

// One 32-column block of 16 weight rows (256 bytes of the W4A8 layout) -> the bf16 B tile of
// tdpbf16ps: 16 rows of k pairs, row i = (w[n][2i], w[n][2i + 1]) for n = 0..15. s2 / mz2: the
// group's scale and mz of rows 0..7 and 8..15, each repeated for the pair.
QP_AMX_TARGET inline void amx_bf16_b_tile(const uint8_t* w, const __m512 (&s2)[2],
                                          const __m512 (&mz2)[2], uint16_t* b) {
  // 16-bit word 2n + h of a chunk: bytes 4n + 2h, 4n + 2h + 1 = columns (2h, 2h + 1) of row n
  const __m512i pick0 = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i pick1 = _mm512_add_epi16(pick0, _mm512_set1_epi16(1));
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = _mm512_loadu_si512(w + c * 64);
    for (int h = 0; h < 2; ++h) {
      // 32 bytes: (row n, pair element t) at 2n + t, both nibbles
      const __m256i bytes =
          _mm512_castsi512_si256(_mm512_permutexvar_epi16(h ? pick1 : pick0, raw));
      for (int half = 0; half < 2; ++half) {  // half 0: columns 8c + 2h.., half 1: 8c + 4 + 2h..
        __m512 f[2];
        for (int part = 0; part < 2; ++part) {  // rows 0..7, rows 8..15
          __m512i v = _mm512_cvtepu8_epi32(part ? _mm256_extracti128_si256(bytes, 1)
                                                : _mm256_castsi256_si128(bytes));
          v = half ? _mm512_srli_epi32(v, 4) : v;
          f[part] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), s2[part],
                                    mz2[part]);
        }
        const int row = 4 * c + 2 * half + h;
        _mm512_store_si512(b + row * 32,
                           reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0])));
      }
    }
  }
}

// The group's scale (fp16 -> fp32) and mz of 16 rows, as two vectors of rows 0..7 and 8..15
// with every value twice (the k pair)
QP_AMX_TARGET inline void amx_pair_scales(const uint16_t* sc, const float* mz, __m512 (&s2)[2],
                                          __m512 (&mz2)[2]) {
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
  const __m512 z = mz != nullptr ? _mm512_loadu_ps(mz) : _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  s2[0] = _mm512_permutexvar_ps(lo, s);
  s2[1] = _mm512_permutexvar_ps(hi, s);
  mz2[0] = _mm512_permutexvar_ps(lo, z);
  mz2[1] = _mm512_permutexvar_ps(hi, z);
}

QP_AMX_TARGET void amx_bf16_load_config() {
  AmxConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kAmxRows, cfg.colsb[t] = 64;
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes: without this barrier the row
  // and column stores above are dropped as dead (and tileloadd faults)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Weight blocks b0, b1 (wb: their bf16 B tiles [2][K / 32][16 x 32]) for every activation row
// (xb: bf16 [padded M, K]); tiles 0-3 accumulate 2 x 16 rows x 2 blocks over all of K.
QP_AMX_TARGET void amx_bf16_pair(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* wb,
                                 int nj, float* out, int64_t ldo) {
  constexpr int64_t kTileB = kAmxRows * 32;  // bf16 per B tile
  const int64_t nb = K / kA8Block, stride = K * 2;
  alignas(64) float part[kAmxRows * kRows];
  for (int64_t m0 = 0; m0 < M; m0 += 2 * kAmxRows) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t blk = 0; blk < nb; ++blk) {
      _tile_loadd(4, xb + m0 * K + blk * kA8Block, stride);
      _tile_loadd(5, xb + (m0 + kAmxRows) * K + blk * kA8Block, stride);
      _tile_loadd(6, wb + blk * kTileB, 64);
      _tile_loadd(7, wb + (nb + blk) * kTileB, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    // tiles are stored whole: straight into y where all 16 rows are real, else via `part`
#define QP_STORE_TILE(T, I, J)                                                              \
    if ((J) < nj) {                                                                         \
      const int64_t r0 = m0 + (I) * kAmxRows;                                               \
      if (r0 + kAmxRows <= M) {                                                             \
        _tile_stored(T, out + r0 * ldo + (J) * kRows, ldo * 4);                             \
      } else if (r0 < M) {                                                                  \
        _tile_stored(T, part, 64);                                                          \
        for (int64_t r = 0; r < M - r0; ++r)                                                \
          std::memcpy(out + (r0 + r) * ldo + (J) * kRows, part + r * kRows, 64);            \
      }                                                                                     \
    }
    QP_STORE_TILE(0, 0, 0)
    QP_STORE_TILE(1, 0, 1)
    QP_STORE_TILE(2, 1, 0)
    QP_STORE_TILE(3, 1, 1)
#undef QP_STORE_TILE
  }
}

// Pairs p0..p1 of weight blocks: expand each pair to bf16 B tiles, then multiply every row
QP_AMX_TARGET void amx_bf16_units(int64_t p0, int64_t p1, const uint16_t* xb, int64_t M,
                                  int64_t K, int64_t G, int64_t group_size, int64_t NB,
                                  const uint8_t* wp, const uint16_t* scp, const float* mzp,
                                  float* yp) {
  constexpr int64_t kTileB = kAmxRows * 32;
  const int64_t per_group = group_size / kA8Block, nb = K / kA8Block, N = NB * kRows;
  const int64_t wblock = K / 8 * 64, sblock = G * kRows;
  // every B tile is written before it is read (the lone block's partner zeroed below)
  std::unique_ptr<uint16_t[]> wb_store(new uint16_t[2 * nb * kTileB + 32]);
  uint16_t* wb = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(wb_store.get()) + 63) & ~uintptr_t{63});
  amx_bf16_load_config();
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t b = 2 * p;
    const int nj = b + 1 < NB ? 2 : 1;
    for (int j = 0; j < nj; ++j) {
      const int64_t bj = b + j;
      for (int64_t g = 0; g < G; ++g) {
        __m512 s2[2], mz2[2];
        amx_pair_scales(scp + bj * sblock + g * kRows,
                        mzp != nullptr ? mzp + bj * sblock + g * kRows : nullptr, s2, mz2);
        for (int64_t q = 0; q < per_group; ++q) {
          const int64_t blk = g * per_group + q;
          amx_bf16_b_tile(wp + bj * wblock + blk * 4 * 64, s2, mz2,
                          wb + (j * nb + blk) * kTileB);
        }
      }
    }
    if (nj == 1) std::memset(wb + nb * kTileB, 0, nb * kTileB * 2);
    amx_bf16_pair(xb, M, K, wb, nj, yp + b * kRows, N);
  }
  _tile_release();
}

// y fp32 [M, N] = x @ W^T with W the W4A8 layout expanded to bf16 and x rounded to bf16 (any row
// count; an error without AMX)
at::Tensor w4a8_mm_amx(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& mz,
                            int64_t group_size) {
  check_cpu();
  TORCH_CHECK(amx_supported(), "this CPU (or kernel) does not let quantpipe use AMX");
  qp::check_w4a8(x, packed, scales, mz, group_size);
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * kRows;
  const int64_t G = K / group_size;
  const int64_t padded = (M + 2 * kAmxRows - 1) / (2 * kAmxRows) * (2 * kAmxRows);
  // bf16 activations; only the padding rows below M are zeroed (the rest is written next)
  std::unique_ptr<uint16_t[]> xb_store(new uint16_t[padded * K]);
  uint16_t* xb = xb_store.get();
  std::memset(xb + M * K, 0, (padded - M) * K * sizeof(uint16_t));
  const float* xp = x.data_ptr<float>();
  qp::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) to_bf16(xp + m * K, xb + m * K, K);
  });
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* scp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const float* mzp = mz.has_value() ? mz->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // in passes of at most kAmxPassRows rows: each weight pair re-reads the pass's activations,
  // which then stay in L2, for one more expansion of the weights per pass (SmolLM2's gate/up
  // at 1,266 rows: 3.9 ms in one pass, 3.2 in passes of 256)
  for (int64_t r0 = 0; r0 < M; r0 += kAmxPassRows) {
    const int64_t rows = std::min(kAmxPassRows, M - r0);
    qp::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      amx_bf16_units(p0, p1, xb + r0 * K, rows, K, G, group_size, NB, wp, scp, mzp,
                     yp + r0 * N);
    }, kAmxChunksPerThread);
  }
  return y;
}

// y fp32 [M, N] = x fp32 [M, K] @ W^T with int8 activations. `vnni` is the AVX2 build's
// choice of instruction; here it must be true (AVX-512 VNNI is part of this build's baseline).
at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mz, int64_t group_size, bool vnni) {
  check_cpu();
  TORCH_CHECK(vnni, "the AVX-512 build always uses VNNI; pass vnni=True");
  if (x.dim() == 2 && x.size(0) >= kAmxMinRows && amx_auto())
    return w4a8_mm_amx(x, packed, scales, mz, group_size);
  return qp::run_w4a8_mm<kMaxTile>(x, packed, scales, mz, group_size,
                                      &qp::simd::quantize_row<Simd>,
                                      [](auto mt, const auto&... args) {
                                        w4a8_tile<decltype(mt)::value>(args...);
                                      });
}

// --- w8a8_mm: the int8 head, int8 activations (common.h gives the layout and formula) ------

// The exact integer dot of one 32-column block, all 16 rows: vpdpbusd multiplies unsigned bytes
// (q + 128, as q xor 0x80) by the signed activations; the chains start at -128 * sum(xq), so
// they end at sum(q * xq).
struct DotI8Vnni512 {
  template <int MT>
  QP_TARGET static void run(const int8_t* w, const int8_t* const* xb, const int32_t* xs,
                            __m512i (&iacc)[MT]) {
    constexpr int A = MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i acc[MT][A];
    for (int m = 0; m < MT; ++m) {
      acc[m][0] = _mm512_set1_epi32(-128 * xs[m]);
      for (int i = 1; i < A; ++i) acc[m][i] = _mm512_setzero_si512();
    }
    for (int c = 0; c < 8; ++c) {  // 8 chunks of 4 columns
      const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(w + c * 64), flip);
      for (int m = 0; m < MT; ++m)
        acc[m][c % A] = _mm512_dpbusd_epi32(acc[m][c % A], u, Simd::bcast4(xb[m] + 4 * c));
    }
    for (int m = 0; m < MT; ++m) {
      iacc[m] = acc[m][0];
      for (int i = 1; i < A; ++i) iacc[m] = _mm512_add_epi32(iacc[m], acc[m][i]);
    }
  }
};

template <int MT>
QP_TARGET __attribute__((flatten)) void w8a8_tile(const A8Acts& a, const int32_t* xsum,
                                                  int64_t m0, int64_t K, const int8_t* w,
                                                  const uint16_t* sc, float* out, int64_t ldo) {
  qp::simd::w8a8_tile<Simd, DotI8Vnni512, MT>(a, xsum, m0, K, w, sc, out, ldo);
}

at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& q8, const at::Tensor& scales) {
  check_cpu();
  return qp::run_w8a8_mm<kMaxTile>(x, q8, scales, &qp::simd::quantize_row<Simd>,
                                      [](auto mt, const auto&... args) {
                                        w8a8_tile<decltype(mt)::value>(args...);
                                      });
}

// --- bf16_mm: the output head in bf16 -------------------------------------------------------
// common.h gives the layout: each k pair of the 16 rows is one vdpbf16ps operand. Half the
// instructions of fp16_mm per row, so it is the faster head from a few rows up.

template <int MT>
QP_TARGET void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* w, float* out,
                         int64_t ldo) {
  constexpr int P = MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);
  __m512 acc[MT][P];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < P; ++p) acc[m][p] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  int64_t j = 0;
  for (; j + P <= pairs; j += P) {
    for (int p = 0; p < P; ++p) {
      const __m512bh wv = as_bh(_mm512_loadu_si512(w + (j + p) * 2 * kRows));
      for (int m = 0; m < MT; ++m)
        acc[m][p] = _mm512_dpbf16_ps(acc[m][p], wv, as_bh(bcast_pair(x + m * K + 2 * (j + p))));
    }
  }
  for (; j < pairs; ++j) {
    const __m512bh wv = as_bh(_mm512_loadu_si512(w + j * 2 * kRows));
    for (int m = 0; m < MT; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, as_bh(bcast_pair(x + m * K + 2 * j)));
  }
  qp::simd::store_row_sums<Simd, MT, P>(acc, out, ldo);
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& wb) {
  check_cpu();
  return qp::run_bf16_mm<kMaxTile, uint16_t>(x, wb, &to_bf16, [](auto mt, const auto&... args) {
    bf16_tile<decltype(mt)::value>(args...);
  });
}

bool int4_supported() { return cpu_supported(); }

}  // namespace

TORCH_LIBRARY(quantpipe_cpu, m) {
  qp::def_ops(m);
  m.def("w4a16_mm(Tensor x, Tensor packed, Tensor scales, Tensor? zf, int group_size) -> Tensor");
  m.def("supported() -> bool", &int4_supported);
  m.def("amx_supported() -> bool", &amx_supported);
  m.def("w4a8_mm_amx(Tensor x, Tensor packed, Tensor scales, Tensor? mz, int group_size) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(quantpipe_cpu, CPU, m) {
  m.impl("w4a16_mm", &w4a16_mm);
  m.impl("w4a8_mm_amx", &w4a8_mm_amx);
  using namespace qp::simd;
  qp::impl_ops(m, {&w8a32_mm<Simd, kMaxTile>, &w4a8_mm, &quantize_a8<Simd>,  // OpImpls' order
                   &fp16_mm<Simd, kMaxTile>, &bf16_mm, &paged_attention<Simd>,
                   &add_rms_norm_<Simd>, &silu_mul<Simd>, &gelu_tanh_mul<Simd>,
                   &w8a8_mm});
}
