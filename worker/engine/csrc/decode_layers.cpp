// A decode step's decoder layers in one call: decoder.py's layer loop (Decoder._layer on the operators) for a step
// of single-token queries read in place by paged_decode_attention, every projection on its weight-only kernel.
//
// With one request a CPU decode step is dispatch-bound: Python makes ~15 calls a layer, 30 layers a step, and while
// it does the second thread waits at the next kernel. Here the loop and its calls are C++: the same operators and
// kernels in the same order with the same casts, so the result is the Python loop's bit for bit
// (tests/engine/test_decode_layers.py).
//
//   decode_layers(hidden [T, C], cos, sin [T, 1, D], weights, norms, key_pool, value_pool [L, NB, BS, KVH, D],
//                 slots [T], block_tables [T, MB], context_lens [T], format, max_rows, num_heads, scale, eps) -> [T, C]
//   weights: per layer the projections qkv [(H + 2 KVH) D, C], o [C, H D], gate_up [2 I, C] and down [C, I], each
//     as (codes, scales, mins, bias, tiles, tile scales, tile mins), a zero-element tensor where a projection has
//     none; `format` is linear.py's name of their layout: "int4" (torch's _weight_int4pack_mm_for_cpu, scales its
//     scales_and_zeros), "int8" (torch's _weight_int8pack_mm) or "q4_1" (int4_linear.cpp up to `max_rows` rows,
//     integer_rows.cpp on the tiles beyond: linear.py's tile_q4_1, which a step of more rows needs).
//   norms: per layer (input, post-attention), float32 [C].
// hidden is in the compute dtype, the K/V pools in it or in 16 bits under float32; the layers' new K/V are written
// into the pools at `slots`, rounded to the pools' dtype.

#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/add.h>
#include <torch/library.h>

#include <cstdint>
#include <string_view>
#include <vector>

#include "operators.h"

namespace {

constexpr int64_t kGroup = 32;        // input columns a scale covers (linear.py's GROUP_SIZE)
constexpr int64_t kPerProjection = 7;  // codes, scales, mins, bias, tiles, tile scales, tile mins
constexpr int64_t kPerLayer = 4 * kPerProjection;

enum class Format { kInt4, kInt8, kQ4_1 };

Format parse(std::string_view name) {
  if (name == "int4") return Format::kInt4;
  if (name == "int8") return Format::kInt8;
  TORCH_CHECK(name == "q4_1", "decode_layers: format int4, int8 or q4_1, got ", name);
  return Format::kQ4_1;
}

// x @ W.T (+ bias) on the projection's kernel (p: its seven tensors). torch's kernels take bf16 rows and return
// bf16; the result goes back to x's dtype where `cast_back` or a bias asks for it (PackedLinear.forward).
at::Tensor project(const at::Tensor& x, const at::Tensor* p, Format format, int64_t max_rows, bool cast_back) {
  at::Tensor out;
  if (format == Format::kQ4_1 && x.size(0) > max_rows) {
    TORCH_CHECK(p[4].numel() > 0, "decode_layers: more than max_rows rows need the projections' tiles");
    out = tokenspool::q4_1_rows(x, p[4], p[5], p[6]);
  } else if (format == Format::kQ4_1) {
    out = tokenspool::int4_linear(x, p[0], p[1], p[2]);
  } else if (format == Format::kInt4) {
    out = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), p[0], kGroup, p[1]);
  } else {
    out = at::_weight_int8pack_mm(x.to(at::kBFloat16), p[0], p[1]);
  }
  const at::Tensor& bias = p[3];
  if (out.scalar_type() != x.scalar_type() && (cast_back || bias.numel() > 0)) out = out.to(x.scalar_type());
  return bias.numel() > 0 ? at::add(out, bias) : out;
}

// What every layer of the step shares.
struct Step {
  const at::Tensor &cos, &sin, &key_pool, &value_pool, &slots, &block_tables, &context_lens;
  Format format;
  int64_t max_rows, num_heads;
  double scale, eps;
};

// Decoder._layer: hidden [T, C] -> [T, C]; w: the layer's 28 weight tensors, norms: its two.
at::Tensor layer(const at::Tensor& hidden, int64_t index, const at::Tensor* w, const at::Tensor* norms,
                 const Step& s) {
  const int64_t T = hidden.size(0), kv_heads = s.key_pool.size(3), D = s.key_pool.size(4);
  const int64_t qk_heads = s.num_heads + kv_heads;
  const at::Tensor qkv = project(tokenspool::rms_norm(hidden, norms[0], s.eps), w, s.format, s.max_rows, true);
  const at::Tensor qk = qkv.slice(1, 0, qk_heads * D).view({T, qk_heads, D});
  tokenspool::rope_(qk, s.cos, s.sin);
  const at::Tensor value = qkv.slice(1, qk_heads * D).view({T, kv_heads, D});
  const at::Tensor keys = s.key_pool.select(0, index), values = s.value_pool.select(0, index);  // [NB, BS, KVH, D]
  const auto kv_type = keys.scalar_type();  // the compute dtype, or 16 bits under float32 (KVCache.write's cast)
  tokenspool::kv_write_(keys.view({-1, kv_heads, D}), values.view({-1, kv_heads, D}), s.slots,
                        qk.slice(1, s.num_heads).to(kv_type), value.to(kv_type));
  const at::Tensor attn = tokenspool::paged_decode_attention(qk.slice(1, 0, s.num_heads), keys, values,
                                                             s.block_tables, s.context_lens, s.scale);
  const at::Tensor mid = at::add(hidden, project(attn.view({T, -1}), w + kPerProjection, s.format, s.max_rows,
                                                 false));
  const at::Tensor gate_up = project(tokenspool::rms_norm(mid, norms[1], s.eps), w + 2 * kPerProjection, s.format,
                                     s.max_rows, true);
  return at::add(mid, project(tokenspool::silu_and_mul(gate_up), w + 3 * kPerProjection, s.format, s.max_rows,
                              false));
}

at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& norms,
                         at::Tensor key_pool, at::Tensor value_pool, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, std::string_view format,
                         int64_t max_rows, int64_t num_heads, double scale, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && key_pool.dim() == 5 && value_pool.dim() == 5, "hidden [T, C], pools 5-d");
  const int64_t num_layers = key_pool.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kPerLayer, "weights: 28 tensors a layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == num_layers * 2, "norms: 2 a layer");
  const Step step{cos, sin, key_pool, value_pool, slots, block_tables, context_lens, parse(format), max_rows,
                  num_heads, scale, eps};
  at::Tensor out = hidden;
  for (int64_t index = 0; index < num_layers; ++index) {
    out = layer(out, index, weights.data() + index * kPerLayer, norms.data() + index * 2, step);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenspool, m) {
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor[] norms, "
        "Tensor(a!) key_pool, Tensor(b!) value_pool, Tensor slots, Tensor block_tables, Tensor context_lens, "
        "str format, int max_rows, int num_heads, float scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) { m.impl("decode_layers", &decode_layers); }
