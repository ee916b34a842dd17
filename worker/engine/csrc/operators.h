// tokenspool's operators as C++ functions, for operators that call others (decode_layers.cpp) without going back
// through torch's dispatcher. Each is defined, with its shapes, in the file named beside it, and registered there.

#pragma once

#include <ATen/core/Tensor.h>

namespace tokenspool {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);  // fused.cpp
void rope_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin);        // fused.cpp
at::Tensor silu_and_mul(const at::Tensor& gate_up);                             // fused.cpp
void kv_write_(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slots, const at::Tensor& key,
               const at::Tensor& value);  // kv_write.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  double scale);  // paged_decode.cpp
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins);  // int4_linear.cpp
at::Tensor q4_1_rows(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales,
                     const at::Tensor& mins);  // integer_rows.cpp
at::Tensor q8_0_rows(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales);  // integer_rows.cpp

}  // namespace tokenspool
