// Weight-only matmuls for few rows over weights in GGUF's blocks: groups of 32 input columns, each with a float16
// scale (and, in Q4_1, a float16 minimum). The decode step's shape: one or a few rows of x against a weight
// matrix that streams from memory, so the time is the weight read and the code's job is to keep up with it.
//
//   group_matmul<Format>(x [M, K] float32, weights, out [M, N]): out[m, n] = sum_k w[n, k] x[m, k]
//
// Each group's codes are read once and widened to float32 weights in registers (`Format::widen`: the format's
// only part), then multiplied into every row of the pass (up to kMaxRows), float32 accumulation: Q8_0's operator
// (int8_linear.cpp) checks its tensors and calls this. int4_linear.cpp multiplies integers instead, with this
// file's weights, passes, widening of scales and checks.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace group_matmul {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;          // rows per pass over the weights (more rows: more passes)
constexpr int64_t kColumnsPerTask = 16;  // output columns per parallel work item, at the least
// How far ahead of the group being multiplied its column's codes are fetched into the cache: the weights stream
// from memory, and without the hint a pass over a step's int4 projections waited on them (12.2-12.6 against 9.4-9.8
// ms, AMD EPYC Zen 3, 2 threads).
constexpr int64_t kPrefetchBytes = 2048;

#if defined(__AVX2__)
// The sum of an AVX2 vector's 8 lanes (int4_linear's vectors are AVX2's on AVX-512 CPUs too).
inline float total(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}
#endif

// Vec: float32 lanes; a group of 32 weights is kVectors of them.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float total(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#else
using Vec = float;
constexpr int kLanes = 1;
inline Vec zero() { return 0.f; }
inline Vec broadcast(float v) { return v; }
inline Vec load(const float* p) { return *p; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec mul(Vec a, Vec b) { return a * b; }
inline Vec add(Vec a, Vec b) { return a + b; }
inline float total(Vec v) { return v; }
#endif
constexpr int kVectors = kGroup / kLanes;

// n float16 values as float32 (F16C's conversion where the CPU has it; the tail under a mask with AVX-512).
inline void widen_halves(const c10::Half* src, int64_t n, float* dst) {
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
  const uint8_t* codes;     // [N, G * bytes a group]
  const c10::Half* scales;  // [N, G]
  const c10::Half* mins;    // [N, G] (Q4_1), or null: formats without a minimum
  int64_t groups;           // G = K / 32
};

// The loops over the rows are spelled out (UNROLLED): left as loops, gcc kept the accumulators in memory, a store
// and a load on every multiply-add.
#define UNROLLED _Pragma("GCC unroll 16")

// Group g's weights (`codes`: its bytes) times rows x[0 .. kRows) (xg: the group's first column, row stride K),
// vector v summed into acc[r][(first + v) % kAccs].
template <typename Format, int kRows, int kAccs>
inline void accumulate(const uint8_t* codes, float scale, const float* xg, int64_t K, int first,
                       Vec (&acc)[kRows][kAccs]) {
  Vec weight[kVectors];
  Format::widen(codes, scale, weight);
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int v = 0; v < kVectors; ++v) {
      acc[r][(first + v) % kAccs] = fmadd(weight[v], load(xg + r * K + v * kLanes), acc[r][(first + v) % kAccs]);
    }
  }
}

// Output column n of rows x[0 .. kRows) (row stride K) into out (row stride N). A row's vectors sum in kAccs
// accumulators in turn: independent chains of multiply-adds, so that an add's latency does not serialise the loop
// (one row gets four chains, over two groups where a group is two vectors (AVX-512): with two it waited on the
// adds' latency; more rows interleave, two chains a row, which keeps them in registers: SmolLM2's Q8_0 head at
// two rows ran 14% slower with four). `scale`: the column's G scales, widened.
template <typename Format, int kRows, typename Out>
void column(const Weights& w, const float* x, int64_t N, int64_t n, const float* scale, Out* out) {
  constexpr int kAccs = kRows == 1 ? 4 : 2;
  constexpr int kStep = kAccs > kVectors ? kAccs / kVectors : 1;  // groups a step
  const int64_t K = w.groups * kGroup;
  Vec acc[kRows][kAccs];
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int a = 0; a < kAccs; ++a) acc[r][a] = zero();
  }
  const uint8_t* codes = w.codes + n * w.groups * Format::kBytes;
  int64_t g = 0;
  for (; g + kStep <= w.groups; g += kStep) {
    __builtin_prefetch(codes + g * Format::kBytes + kPrefetchBytes);
    UNROLLED for (int s = 0; s < kStep; ++s) {
      accumulate<Format>(codes + (g + s) * Format::kBytes, scale[g + s], x + (g + s) * kGroup, K, s * kVectors, acc);
    }
  }
  for (; g < w.groups; ++g) accumulate<Format>(codes + g * Format::kBytes, scale[g], x + g * kGroup, K, 0, acc);
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int a = 1; a < kAccs; ++a) acc[r][0] = add(acc[r][0], acc[r][a]);
    out[r * N + n] = static_cast<Out>(total(acc[r][0]));
  }
}

// Columns in blocks of kColumnsPerTask, each block's scales widened in one call (per column, the calls and their
// tails cost as much as a third of a column's groups).
template <typename Format, int kRows, typename Out>
void pass(const Weights& w, const float* x, int64_t N, Out* out) {
  at::parallel_for(0, N, kColumnsPerTask, [&](int64_t begin, int64_t end) {
    const int64_t G = w.groups;
    std::vector<float> scale(kColumnsPerTask * G);
    for (int64_t n0 = begin; n0 < end; n0 += kColumnsPerTask) {
      const int64_t n1 = std::min(end, n0 + kColumnsPerTask);
      widen_halves(w.scales + n0 * G, (n1 - n0) * G, scale.data());
      for (int64_t n = n0; n < n1; ++n) column<Format, kRows>(w, x, N, n, scale.data() + (n - n0) * G, out);
    }
  });
}

// M rows in passes of up to kMaxRows: run(std::integral_constant<int, rows>{}, first row) for each pass, the rows
// a compile-time count.
template <typename Run>
void in_passes(int64_t M, Run&& run) {
  for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
    switch (std::min(kMaxRows, M - r0)) {
      case 1: run(std::integral_constant<int, 1>{}, r0); break;
      case 2: run(std::integral_constant<int, 2>{}, r0); break;
      case 3: run(std::integral_constant<int, 3>{}, r0); break;
      case 4: run(std::integral_constant<int, 4>{}, r0); break;
      case 5: run(std::integral_constant<int, 5>{}, r0); break;
      case 6: run(std::integral_constant<int, 6>{}, r0); break;
      case 7: run(std::integral_constant<int, 7>{}, r0); break;
      default: run(std::integral_constant<int, 8>{}, r0); break;
    }
  }
}

// x [M, K] float32, contiguous; out [M, N].
template <typename Format, typename Out>
void group_matmul(const float* x, int64_t M, const Weights& w, int64_t N, Out* out) {
  const int64_t K = w.groups * kGroup;
  in_passes(M, [&](auto rows, int64_t r0) { pass<Format, decltype(rows)::value>(w, x + r0 * K, N, out + r0 * N); });
}

// A group of 32 activations rounded to integer codes for an integer dot product (int4_linear.cpp: 16 bits,
// integer_rows.cpp: 8): v[j] ~ step * codes[j], step = max |v| / levels, so each value moves by at most half a step.
// A NaN or infinity is coded 0 and left in `total` (the group's float32 sum), through which it reaches the result.
struct RoundedGroup {
  float step;        // max |v| / levels
  float total;       // sum of v
  int32_t code_sum;  // sum of codes: step * code_sum is the rounded values' sum
};

template <typename Code>
RoundedGroup round_group(const float* v, float levels, Code* codes) {
  float largest = 0.f, total = 0.f;
  for (int64_t j = 0; j < kGroup; ++j) {
    largest = std::max(largest, std::abs(v[j]));
    total += v[j];
  }
  const float inverse = largest > 0.f && std::isfinite(largest) ? levels / largest : 0.f;
  int32_t code_sum = 0;
  for (int64_t j = 0; j < kGroup; ++j) {
    const float scaled = v[j] * inverse;
    codes[j] = static_cast<Code>(std::isfinite(scaled) ? std::nearbyint(scaled) : 0.f);
    code_sum += codes[j];
  }
  return {largest / levels, total, code_sum};
}

// x [M, K]: float32 or bfloat16 (unit last stride) on the CPU, K a multiple of 32 (the operators' common checks).
inline void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x: [M, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(x.size(1) % kGroup == 0, "x: [M, K], K a multiple of ", kGroup);
}

// x (check_rows) against N output columns -> [M, N] in x's dtype: `matmul(x float32 [M, K], M, out)` fills out
// (float32 or bfloat16, a generic lambda) from x made float32 and contiguous.
template <typename Matmul>
at::Tensor in_rows(const at::Tensor& x, int64_t N, Matmul&& matmul) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();  // no copy for a contiguous float32 x
  auto out = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    matmul(x32.data_ptr<float>(), x.size(0), out.data_ptr<float>());
  } else {
    matmul(x32.data_ptr<float>(), x.size(0), out.data_ptr<at::BFloat16>());
  }
  return out;
}

// x (check_rows) against N output columns of w in Format -> [M, N] in x's dtype.
template <typename Format>
at::Tensor run(const at::Tensor& x, const Weights& w, int64_t N) {
  return in_rows(x, N, [&](const float* x32, int64_t M, auto* out) { group_matmul<Format>(x32, M, w, N, out); });
}

}  // namespace group_matmul
