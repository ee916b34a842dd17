// A weight-only int8 matmul for few rows, in GGUF's Q8_0 block shape: the LM head of a decode step.
//
//   int8_linear(x [M, K], codes [N, K] int8, scales [N, K/32] f16) -> [M, N]
//     w[n, k] = scales[n, k / 32] * codes[n, k]; x float32 or bfloat16 (unit last stride), the result in x's
//     dtype; K a multiple of 32.
//
// With one or two rows the LM head is a read of its weights (SmolLM2's: 49152 x 576), and stock torch has no
// kernel for int8 in groups: its per-row int8 kernel lost to the dense bf16 matmul. This one reads each group of
// 32 codes once, widens it to float32 in registers and multiplies it into every row (up to 8 per pass), float32
// accumulation: sum_k w x = sum_g scale_g * (q_g . x_g).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;       // rows per pass over the weights (more rows: more passes)
constexpr int64_t kRowsPerTask = 16;  // output columns per parallel work item, at the least

// One group of 32 codes widened to float32: `dot(x)` gives q . x for 32 float32 values of a row of x.
// `Acc`: a float32 accumulator, vector lanes summed across at the end (`total`).
#if defined(__AVX512F__)
struct Group {
  __m512 q[2];
  explicit Group(const int8_t* codes) {
    for (int i = 0; i < 2; ++i) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      q[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    }
  }
  __m512 dot(const float* x) const {
    return _mm512_fmadd_ps(q[1], _mm512_loadu_ps(x + 16), _mm512_mul_ps(q[0], _mm512_loadu_ps(x)));
  }
};
using Acc = __m512;
inline Acc zero() { return _mm512_setzero_ps(); }
inline Acc scaled_add(Acc part, float scale, Acc acc) { return _mm512_fmadd_ps(part, _mm512_set1_ps(scale), acc); }
inline Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
inline float total(Acc acc) { return _mm512_reduce_add_ps(acc); }
#elif defined(__AVX2__)
struct Group {
  __m256 q[4];
  explicit Group(const int8_t* codes) {
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
  }
  __m256 dot(const float* x) const {
    const __m256 a = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(x)));
    return _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), a));
  }
};
using Acc = __m256;
inline Acc zero() { return _mm256_setzero_ps(); }
inline Acc scaled_add(Acc part, float scale, Acc acc) { return _mm256_fmadd_ps(part, _mm256_set1_ps(scale), acc); }
inline Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
inline float total(Acc acc) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}
#else
struct Group {
  const int8_t* codes;
  explicit Group(const int8_t* c) : codes(c) {}
  float dot(const float* x) const {
    float sum = 0.f;
    for (int j = 0; j < kGroup; ++j) sum += static_cast<float>(codes[j]) * x[j];
    return sum;
  }
};
using Acc = float;
inline Acc zero() { return 0.f; }
inline Acc scaled_add(Acc part, float scale, Acc acc) { return acc + part * scale; }
inline Acc add(Acc a, Acc b) { return a + b; }
inline float total(Acc acc) { return acc; }
#endif

// n float16 values as float32 (F16C's conversion where the CPU has it; the tail under a mask with AVX-512).
inline void widen_halves(const at::Half* src, int64_t n, float* dst) {
  const auto* raw = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw + i))));
  }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, raw + i)));
    return;
  }
#endif
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(raw + i))));
  }
#endif
#if defined(__F16C__)
  for (; i < n; ++i) dst[i] = _cvtsh_ss(raw[i]);
#else
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
#endif
}

struct Weights {
  const int8_t* codes;     // [N, K]
  const at::Half* scales;  // [N, G]
  int64_t groups;
};

// The loops over the rows are spelled out (UNROLLED): left as loops, gcc kept the accumulators in memory, a store
// and a load on every multiply-add.
#define UNROLLED _Pragma("GCC unroll 16")

// Output column n of rows x[0 .. kRows) (float32, row stride K) into out (row stride N). Even and odd groups sum
// in separate accumulators: independent chains of multiply-adds, so that an add's latency does not serialise the
// loop.
template <int kRows, typename Out>
void column(const Weights& w, const float* x, int64_t N, int64_t n, float* scale, Out* out) {
  const int64_t K = w.groups * kGroup;
  widen_halves(w.scales + n * w.groups, w.groups, scale);
  Acc acc[kRows][2];
  UNROLLED for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = zero();
  const int8_t* q = w.codes + n * K;
  for (int64_t g = 0; g < w.groups; g += 2) {
    const Group even(q + g * kGroup);
    UNROLLED for (int r = 0; r < kRows; ++r) acc[r][0] = scaled_add(even.dot(x + r * K + g * kGroup), scale[g], acc[r][0]);
    if (g + 1 < w.groups) {
      const Group odd(q + (g + 1) * kGroup);
      UNROLLED for (int r = 0; r < kRows; ++r) {
        acc[r][1] = scaled_add(odd.dot(x + r * K + (g + 1) * kGroup), scale[g + 1], acc[r][1]);
      }
    }
  }
  UNROLLED for (int r = 0; r < kRows; ++r) out[r * N + n] = static_cast<Out>(total(add(acc[r][0], acc[r][1])));
}

template <int kRows, typename Out>
void rows(const Weights& w, const float* x, int64_t N, Out* out) {
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(w.groups);
    for (int64_t n = begin; n < end; ++n) column<kRows>(w, x, N, n, scale.data(), out);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x: [M, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.dim() == 2, "codes: int8 [N, K]");
  TORCH_CHECK(x.size(1) % kGroup == 0 && codes.size(1) == x.size(1), "codes: [N, K], K a multiple of ", kGroup);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "scales: contiguous float16");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / kGroup, "scales: [N, K/32]");
  const Weights w{codes.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), K / kGroup};
  const at::Tensor x32 = x.to(at::kFloat).contiguous();  // no copy for a contiguous float32 x
  auto out = at::empty({M, N}, x.options());
  const auto pass = [&](auto* o) {
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      const float* xr = x32.data_ptr<float>() + r0 * K;
      auto* orow = o + r0 * N;
      switch (std::min(kMaxRows, M - r0)) {
        case 1: rows<1>(w, xr, N, orow); break;
        case 2: rows<2>(w, xr, N, orow); break;
        case 3: rows<3>(w, xr, N, orow); break;
        case 4: rows<4>(w, xr, N, orow); break;
        case 5: rows<5>(w, xr, N, orow); break;
        case 6: rows<6>(w, xr, N, orow); break;
        case 7: rows<7>(w, xr, N, orow); break;
        default: rows<8>(w, xr, N, orow); break;
      }
    }
  };
  if (x.scalar_type() == at::kFloat) {
    pass(out.data_ptr<float>());
  } else {
    pass(out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenspool, m) { m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) { m.impl("int8_linear", &int8_linear); }
