// The decoder's small per-layer steps, each one pass in float32 instead of a chain of torch ops.
//
// With one request a decode step is dispatch-bound: ~2,800 torch ops a step (SmolLM2), most of them the few-element
// arithmetic around the matmuls. These replace three chains a layer, each rounded once to the compute dtype:
//   rms_norm(x [T, C], weight [C] f32, eps) -> [T, C]     x * rsqrt(eps + mean(x^2)) * weight (was ~8 ops)
//   rope_(qk [T, Hh, D], cos [T, D], sin [T, D]) -> ()     in place: qk * cos + roll(qk, D/2) * sin, with sin's
//                                                          first half negated (decoder.rope_tables) (was ~10 ops)
//   silu_and_mul(gate_up [T, 2I]) -> [T, I]                silu(gate) * up (was 4 ops)
// x, qk and gate_up: float32, bfloat16 or float16 with a unit last stride (rows may be strided, as slices of a
// fused projection's output are); cos/sin in qk's dtype or float32. The Python forms in decoder.py run where these
// are not built (and on CUDA).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fast_exp.h"
#include "operators.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 8;  // prefill: many rows, split over the threads; decode: a row or a few

// Element conversions written without branches, so that gcc vectorises the loops around them (c10's conversion
// to bfloat16 branches on NaN: a silu_and_mul over 32 SmolLM2 rows took 134 us scalar). Rounding to nearest even;
// a NaN stays a NaN.
inline float widen(float v) { return v; }
inline float widen(at::Half v) { return static_cast<float>(v); }
inline float widen(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T narrow(float v) {
  return static_cast<T>(v);
}
template <>
inline at::BFloat16 narrow<at::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return at::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), at::BFloat16::from_bits());
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const float* weight, float eps, at::Tensor& out) {
  const int64_t rows = x.size(0), C = x.size(1), stride = x.stride(0);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row(C);
    for (int64_t r = begin; r < end; ++r) {
      const T* in = src + r * stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < C; ++c) {
        row[c] = widen(in[c]);
        sum += row[c] * row[c];
      }
      const float scale = 1.f / std::sqrt(eps + sum / static_cast<float>(C));
      T* o = dst + r * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = narrow<T>(row[c] * scale * weight[c]);
    }
  });
}

template <typename T, typename Table>
void rope_rows(at::Tensor& qk, const Table* cos, const Table* sin, int64_t table_stride) {
  const int64_t rows = qk.size(0), heads = qk.size(1), D = qk.size(2), half = D / 2;
  const int64_t row_stride = qk.stride(0), head_stride = qk.stride(1);
  T* base = qk.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> c(D), s(D), x(D);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t d = 0; d < D; ++d) {
        c[d] = widen(cos[r * table_stride + d]);
        s[d] = widen(sin[r * table_stride + d]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* v = base + r * row_stride + h * head_stride;
        for (int64_t d = 0; d < D; ++d) x[d] = widen(v[d]);
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) v[d] = narrow<T>(x[d] * c[d] + x[d + half] * s[d]);
#pragma omp simd
        for (int64_t d = half; d < D; ++d) v[d] = narrow<T>(x[d] * c[d] + x[d - half] * s[d]);
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * stride;
      const T* up = gate + I;
      T* o = dst + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float g = widen(gate[i]);
        o[i] = narrow<T>(g / (1.f + tokenspool::fast_exp(-g)) * widen(up[i]));
      }
    }
  });
}

void check_rows(const at::Tensor& x, int64_t dims, const char* name) {
  TORCH_CHECK(x.dim() == dims && x.device().is_cpu() && x.stride(dims - 1) == 1, name, ": ", dims,
              "-d on the CPU with a unit last stride");
  const auto type = x.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, name,
              ": float32, bfloat16 or float16");
}

}  // namespace

namespace tokenspool {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, 2, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight: contiguous float32 [C]");
  auto out = at::empty(x.sizes(), x.options());
  const float* w = weight.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, w, static_cast<float>(eps), out);
  });
  return out;
}

void rope_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(qk, 3, "qk");
  TORCH_CHECK(qk.size(2) % 2 == 0, "qk: an even head size");
  const auto table = cos.reshape({qk.size(0), qk.size(2)}), signed_sin = sin.reshape({qk.size(0), qk.size(2)});
  TORCH_CHECK(table.is_contiguous() && signed_sin.is_contiguous() && cos.scalar_type() == sin.scalar_type(),
              "cos, sin: contiguous [T, D] of one dtype");
  TORCH_CHECK(cos.scalar_type() == qk.scalar_type() || cos.scalar_type() == at::kFloat,
              "cos, sin: qk's dtype or float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rope_", [&] {
    if (cos.scalar_type() == at::kFloat) {
      rope_rows<scalar_t, float>(qk, table.data_ptr<float>(), signed_sin.data_ptr<float>(), qk.size(2));
    } else {
      rope_rows<scalar_t, scalar_t>(qk, table.data_ptr<scalar_t>(), signed_sin.data_ptr<scalar_t>(), qk.size(2));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, 2, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: [T, 2I]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(gate_up, out);
  });
  return out;
}

}  // namespace tokenspool

TORCH_LIBRARY_FRAGMENT(tokenspool, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) {
  m.impl("rms_norm", &tokenspool::rms_norm);
  m.impl("rope_", &tokenspool::rope_);
  m.impl("silu_and_mul", &tokenspool::silu_and_mul);
}
