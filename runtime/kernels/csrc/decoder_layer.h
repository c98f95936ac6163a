// The whole-layer op of both ISA builds: decoder_layer runs one pre-norm decoder layer of a
// short step through this build's own ops, which it reaches through g_ops (filled by
// registration.h's impl_ops). Plain C++ like common.h: no intrinsics.
#pragma once

#include "common.h"

namespace qp {

// the ISA's entry points of def_ops' ops (rope_ is common.h's own)
struct OpImpls {
  at::Tensor (*w8a32_mm)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const c10::optional<at::Tensor>&, int64_t);
  at::Tensor (*w4a8_mm)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const c10::optional<at::Tensor>&, int64_t, bool);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*quantize_a8)(const at::Tensor&, int64_t);
  at::Tensor (*fp16_mm)(const at::Tensor&, const at::Tensor&);
  at::Tensor (*bf16_mm)(const at::Tensor&, const at::Tensor&);
  at::Tensor (*paged_attention)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                int64_t);
  at::Tensor (*add_rms_norm_)(at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&,
                              double);
  at::Tensor (*silu_mul)(const at::Tensor&);
  at::Tensor (*gelu_tanh_mul)(const at::Tensor&);
  at::Tensor (*w8a8_mm)(const at::Tensor&, const at::Tensor&, const at::Tensor&);
};

// --- decoder_layer: one whole pre-norm decoder layer of a short step ------------------------
// What runtime/engine/model_runner.py does per layer for a decode step (or a prefill chunk the
// paged kernel takes), in one call instead of about twenty torch ops and Python between them:
//   x = add_rms_norm_(h, delta, gain_in)             h += delta (the last layer's MLP output)
//   q, k, v = split(x @ Wqkv^T + bias)                the stacked q/k/v W4A8 (or fp16) layer
//   q, k = rms_norm per head (q_norm, k_norm)         where given (Gemma 3, Qwen3)
//   rope_(q, k); k, v -> their paged slots            (rounded to bf16 for a bf16 cache)
//   o = paged_attention(q, ..., window) @ Wo^T        window 0: full attention
//   o = rms_norm(o) (attn_out_norm)                   where given (Gemma 2/3's sandwich norm)
//   x = add_rms_norm_(h, o, gain_mlp)                 h += o
//   d = down(act(gate) * up)                          act: "silu" or "gelu_pytorch_tanh"
//   returns rms_norm(d) (mlp_out_norm) or d           the new delta, [T, hidden]
// Each step is the op of the same name (same arithmetic, same results bit for bit: tested); a
// norm here is add_rms_norm_ without delta, with the gain the runner passes ((1 + w) for
// Gemma). weights (Tensor?[], 23): gain_in, gain_mlp, qkv bias, q_norm, k_norm, attn_out_norm,
// mlp_out_norm (gains, or None where the layer has no such part), then for each of qkv, o,
// gate_up, down: packed, scales, mz or None, perm or None (w4a8_mm's operands and the
// act-order column order; an FP16 folder's layers: the blocked fp16 weight, then three None:
// fp16_mm). group_sizes: the four layers'; eps (6): the norms', in the order of their gains
// (an absent norm's is ignored).
constexpr int64_t kLayerWeights = 23;
constexpr int64_t kLayerNorms = 7;  // gains (and the qkv bias) before the linears' operands

namespace {

OpImpls g_ops{};  // this build's entry points (impl_ops fills them; one copy per library)

// linear i of the layer: W4A8 (packed, scales, mz, perm), or an fp16 layer (its blocked fp16
// weight [out / 16, in, 16] in packed's place, the other three None: fp16_mm, whose output has
// no padding because the runner passes only layers of whole 16-row blocks)
inline at::Tensor layer_linear(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w,
                               int64_t i, int64_t group_size, bool vnni) {
  const int64_t base = kLayerNorms + 4 * i;
  const c10::optional<at::Tensor> packed = w.get(base), scales = w.get(base + 1);
  const c10::optional<at::Tensor> mz = w.get(base + 2), perm = w.get(base + 3);
  TORCH_CHECK(packed.has_value(), "decoder_layer: linear ", i, " needs its weights");
  if (packed->scalar_type() == at::kHalf) {
    TORCH_CHECK(!scales.has_value() && !mz.has_value() && !perm.has_value(),
                "decoder_layer: the fp16 linear ", i, " takes no scales, mz or perm");
    return g_ops.fp16_mm(x.contiguous(), *packed);
  }
  TORCH_CHECK(scales.has_value(), "decoder_layer: linear ", i,
              " needs packed weights and scales");
  const at::Tensor xin = perm.has_value() ? x.index_select(1, *perm) : x.contiguous();
  return g_ops.w4a8_mm(xin, *packed, *scales, mz, group_size, vnni);
}

// RMSNorm of each row of x [rows, D] with weights[i]'s gain, or x itself where weights[i] is
// None: add_rms_norm_ without delta (x is not written)
inline at::Tensor optional_norm(at::Tensor x, const c10::List<c10::optional<at::Tensor>>& w,
                                int64_t i, double eps) {
  const c10::optional<at::Tensor> gain = w.get(i);
  return gain.has_value() ? g_ops.add_rms_norm_(x, c10::nullopt, *gain, eps) : x;
}

// rows of src [T, KV, D] fp32 -> pool [blocks, block_size, KV, D] (fp32 or bf16) at slots [T]
inline void write_slots(const at::Tensor& src, at::Tensor& pool, const at::Tensor& slots) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.size(2) == src.size(1) &&
                  pool.size(3) == src.size(2),
              "k_pool / v_pool must be contiguous [blocks, block_size, KV, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == src.size(0),
              "slots must be contiguous int64 [T]");
  const int64_t T = src.size(0), row = src.size(1) * src.size(2);
  const int64_t n_slots = pool.size(0) * pool.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* sp = src.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < n_slots, "slot ", sl[t], " outside the pool");
  if (pool.scalar_type() == at::kFloat) {
    float* pp = pool.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(pp + sl[t] * row, sp + t * row, row * sizeof(float));
  } else {
    TORCH_CHECK(pool.scalar_type() == at::kBFloat16, "the KV pools must be fp32 or bf16");
    uint16_t* pp = reinterpret_cast<uint16_t*>(pool.data_ptr<at::BFloat16>());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < row; ++i) pp[sl[t] * row + i] = float_to_bf16(sp[t * row + i]);
  }
}

// the gated MLP's activation op by its transformers name
inline at::Tensor gated_act(const at::Tensor& gu, c10::string_view activation) {
  if (activation == "silu") return g_ops.silu_mul(gu);
  if (activation == "gelu_pytorch_tanh") return g_ops.gelu_tanh_mul(gu);
  TORCH_CHECK(false, "decoder_layer: activation '", std::string(activation),
              "' is not silu or gelu_pytorch_tanh");
}

// qkv [T, (H + 2 KV) D] -> q [T, H, D], k and v [T, KV, D] (contiguous copies of its parts)
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> split_qkv(const at::Tensor& qkv,
                                                                 int64_t KV, int64_t D) {
  const int64_t T = qkv.size(0), N = qkv.size(1), H = N / D - 2 * KV;
  TORCH_CHECK(N % D == 0 && H >= KV, "qkv has ", N, " outputs: not (H + 2 * ", KV, ") * ", D);
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  at::Tensor k = at::empty({T, KV, D}, qkv.options());
  at::Tensor v = at::empty({T, KV, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {  // the row's q | k | v parts
    std::memcpy(q.data_ptr<float>() + t * H * D, src + t * N, H * D * sizeof(float));
    std::memcpy(k.data_ptr<float>() + t * KV * D, src + t * N + H * D, KV * D * sizeof(float));
    std::memcpy(v.data_ptr<float>() + t * KV * D, src + t * N + (H + KV) * D,
                KV * D * sizeof(float));
  }
  return {q, k, v};
}

at::Tensor decoder_layer(at::Tensor& h, const c10::optional<at::Tensor>& delta,
                         const c10::List<c10::optional<at::Tensor>>& w,
                         at::IntArrayRef group_sizes, bool vnni, at::ArrayRef<double> eps,
                         double scale, int64_t window, c10::string_view activation,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                         at::Tensor& v_pool, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& ctx_lens,
                         const at::Tensor& q_lens) {
  TORCH_CHECK(static_cast<int64_t>(w.size()) == kLayerWeights && group_sizes.size() == 4 &&
                  eps.size() == 6,
              "decoder_layer takes 23 weights, 4 group sizes and 6 eps");
  TORCH_CHECK(w.get(0).has_value() && w.get(1).has_value(), "decoder_layer needs both gains");
  TORCH_CHECK(k_pool.dim() == 4, "k_pool must be [blocks, block_size, KV, D]");
  const int64_t T = h.size(0), KV = k_pool.size(2), D = k_pool.size(3);
  at::Tensor x = g_ops.add_rms_norm_(h, delta, *w.get(0), eps[0]);
  at::Tensor qkv = layer_linear(x, w, 0, group_sizes[0], vnni);  // [T, (H + 2 KV) D]
  if (w.get(2).has_value()) qkv.add_(*w.get(2));
  auto [q, k, v] = split_qkv(qkv, KV, D);
  const int64_t H = q.size(1);
  q = optional_norm(q.view({T * H, D}), w, 3, eps[2]).view({T, H, D});
  k = optional_norm(k.view({T * KV, D}), w, 4, eps[3]).view({T, KV, D});
  rope_(q, k, cos, sin);
  write_slots(k, k_pool, slots);
  write_slots(v, v_pool, slots);
  const at::Tensor o = g_ops.paged_attention(q, k_pool, v_pool, block_tables, ctx_lens, q_lens,
                                             scale, window);
  const at::Tensor attn = optional_norm(
      layer_linear(o.view({T, H * D}), w, 1, group_sizes[1], vnni), w, 5, eps[4]);
  x = g_ops.add_rms_norm_(h, attn, *w.get(1), eps[1]);
  const at::Tensor gu = layer_linear(x, w, 2, group_sizes[2], vnni);
  return optional_norm(layer_linear(gated_act(gu, activation), w, 3, group_sizes[3], vnni), w, 6,
                       eps[5]);
}

}  // namespace

}  // namespace qp
