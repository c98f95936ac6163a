// Op registration of both ISA builds (cpu_ops.cpp, cpu_ops_avx2.cpp): one schema per op
// (def_ops) and this build's entry points bound to them (impl_ops). runtime/kernels/cpu_ext.py
// lists the ops by these names.
#pragma once

#include <torch/library.h>

#include "decoder_layer.h"

namespace qp {

// --- registration: the ops both builds define, one schema each (runtime/kernels/cpu.py calls
// them by these names in either namespace) ---------------------------------------------------
inline void def_ops(torch::Library& m) {
  m.def("w8a32_mm(Tensor x, Tensor q8, Tensor scales, Tensor? zf, int group_size) -> Tensor");
  m.def("w4a8_mm(Tensor x, Tensor packed, Tensor scales, Tensor? mz, int group_size, "
        "bool vnni) -> Tensor");
  m.def("quantize_a8(Tensor x, int group_size) -> (Tensor, Tensor, Tensor)");
  m.def("w8a8_mm(Tensor x, Tensor q8, Tensor scales) -> Tensor");
  m.def("fp16_mm(Tensor x, Tensor wb) -> Tensor");
  m.def("bf16_mm(Tensor x, Tensor wb) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor ctx_lens, Tensor q_lens, float scale, int window=0) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gu) -> Tensor");
  m.def("decoder_layer(Tensor(a!) h, Tensor? delta, Tensor?[] weights, int[] group_sizes, "
        "bool vnni, float[] eps, float scale, int window, str activation, Tensor cos, "
        "Tensor sin, Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor slots, Tensor block_tables, "
        "Tensor ctx_lens, Tensor q_lens) -> Tensor");
}

inline void impl_ops(torch::Library& m, const OpImpls& ops) {
  g_ops = ops;
  m.impl("decoder_layer", &decoder_layer);
  m.impl("w8a32_mm", ops.w8a32_mm);
  m.impl("w4a8_mm", ops.w4a8_mm);
  m.impl("quantize_a8", ops.quantize_a8);
  m.impl("fp16_mm", ops.fp16_mm);
  m.impl("bf16_mm", ops.bf16_mm);
  m.impl("paged_attention", ops.paged_attention);
  m.impl("add_rms_norm_", ops.add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", ops.silu_mul);
  m.impl("gelu_tanh_mul", ops.gelu_tanh_mul);
  m.impl("w8a8_mm", ops.w8a8_mm);
}

}  // namespace qp
