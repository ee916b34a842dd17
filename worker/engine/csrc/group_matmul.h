// Weight-only matmuls for few rows over weights in GGUF's blocks: groups of 32 input columns, each with a float16
// scale (and, in Q4_1, a float16 minimum). The decode step's shape: one or a few rows of x against a weight
// matrix that streams from memory, so the time is the weight read and the code's job is to keep up with it.
//
//   group_matmul<Format>(x [M, K] float32, weights, out [M, N]): out[m, n] = sum_k w[n, k] x[m, k]
//
// Each group's codes are read once and widened to float32 weights in registers (`Format::widen`: the format's
// only part), then multiplied into every row of the pass (up to kMaxRows), float32 accumulation. The formats'
// operators (int8_linear.cpp, int4_linear.cpp) check their tensors and call this.

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
#include <cstdint>
#include <vector>

namespace group_matmul {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;          // rows per pass over the weights (more rows: more passes)
constexpr int64_t kColumnsPerTask = 16;  // output columns per parallel work item, at the least

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
inline float total(Vec v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}
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
  const uint8_t* codes;     // [N, G * Format::kBytes]
  const c10::Half* scales;  // [N, G]
  const c10::Half* mins;    // [N, G], or null: formats without a minimum
  int64_t groups;           // G = K / 32
};

// The loops over the rows are spelled out (UNROLLED): left as loops, gcc kept the accumulators in memory, a store
// and a load on every multiply-add.
#define UNROLLED _Pragma("GCC unroll 16")

// Group g's weights (`codes`: its bytes) times rows x[0 .. kRows) (xg: the group's first column, row stride K),
// vector v summed into acc[r][(first + v) % kAccs].
template <typename Format, int kRows, int kAccs>
inline void accumulate(const uint8_t* codes, float scale, float minimum, const float* xg, int64_t K, int first,
                       Vec (&acc)[kRows][kAccs]) {
  Vec weight[kVectors];
  Format::widen(codes, scale, minimum, weight);
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
// two rows ran 14% slower with four). `scale`,
// `minimum`: the column's G scales and minimums, widened (minimum: unused by formats without one).
template <typename Format, int kRows, typename Out>
void column(const Weights& w, const float* x, int64_t N, int64_t n, const float* scale, const float* minimum,
            Out* out) {
  constexpr int kAccs = kRows == 1 ? 4 : 2;
  constexpr int kStep = kAccs > kVectors ? kAccs / kVectors : 1;  // groups a step
  const int64_t K = w.groups * kGroup;
  const auto min_of = [&](int64_t g) { return w.mins != nullptr ? minimum[g] : 0.f; };
  Vec acc[kRows][kAccs];
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int a = 0; a < kAccs; ++a) acc[r][a] = zero();
  }
  const uint8_t* codes = w.codes + n * w.groups * Format::kBytes;
  int64_t g = 0;
  for (; g + kStep <= w.groups; g += kStep) {
    UNROLLED for (int s = 0; s < kStep; ++s) {
      accumulate<Format>(codes + (g + s) * Format::kBytes, scale[g + s], min_of(g + s), x + (g + s) * kGroup, K,
                         s * kVectors, acc);
    }
  }
  for (; g < w.groups; ++g) accumulate<Format>(codes + g * Format::kBytes, scale[g], min_of(g), x + g * kGroup, K, 0, acc);
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int a = 1; a < kAccs; ++a) acc[r][0] = add(acc[r][0], acc[r][a]);
    out[r * N + n] = static_cast<Out>(total(acc[r][0]));
  }
}

// Columns in blocks of kColumnsPerTask, each block's scales and minimums widened in one call (per column, the
// calls and their tails cost as much as a third of a column's groups).
template <typename Format, int kRows, typename Out>
void pass(const Weights& w, const float* x, int64_t N, Out* out) {
  at::parallel_for(0, N, kColumnsPerTask, [&](int64_t begin, int64_t end) {
    const int64_t G = w.groups;
    std::vector<float> scale(kColumnsPerTask * G), minimum(w.mins != nullptr ? kColumnsPerTask * G : 0);
    for (int64_t n0 = begin; n0 < end; n0 += kColumnsPerTask) {
      const int64_t n1 = std::min(end, n0 + kColumnsPerTask);
      widen_halves(w.scales + n0 * G, (n1 - n0) * G, scale.data());
      if (w.mins != nullptr) widen_halves(w.mins + n0 * G, (n1 - n0) * G, minimum.data());
      for (int64_t n = n0; n < n1; ++n) {
        column<Format, kRows>(w, x, N, n, scale.data() + (n - n0) * G, minimum.data() + (n - n0) * G, out);
      }
    }
  });
}

// x [M, K] float32, contiguous; out [M, N]: M rows in passes of up to kMaxRows.
template <typename Format, typename Out>
void group_matmul(const float* x, int64_t M, const Weights& w, int64_t N, Out* out) {
  const int64_t K = w.groups * kGroup;
  for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
    const float* xr = x + r0 * K;
    Out* orow = out + r0 * N;
    switch (std::min(kMaxRows, M - r0)) {
      case 1: pass<Format, 1>(w, xr, N, orow); break;
      case 2: pass<Format, 2>(w, xr, N, orow); break;
      case 3: pass<Format, 3>(w, xr, N, orow); break;
      case 4: pass<Format, 4>(w, xr, N, orow); break;
      case 5: pass<Format, 5>(w, xr, N, orow); break;
      case 6: pass<Format, 6>(w, xr, N, orow); break;
      case 7: pass<Format, 7>(w, xr, N, orow); break;
      default: pass<Format, 8>(w, xr, N, orow); break;
    }
  }
}

// x [M, K]: float32 or bfloat16 (unit last stride) on the CPU, K a multiple of 32 (the operators' common checks).
inline void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x: [M, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(x.size(1) % kGroup == 0, "x: [M, K], K a multiple of ", kGroup);
}

// x (check_rows) against N output columns of w -> [M, N] in x's dtype.
template <typename Format>
at::Tensor run(const at::Tensor& x, const Weights& w, int64_t N) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();  // no copy for a contiguous float32 x
  auto out = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    group_matmul<Format>(x32.data_ptr<float>(), x.size(0), w, N, out.data_ptr<float>());
  } else {
    group_matmul<Format>(x32.data_ptr<float>(), x.size(0), w, N, out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace group_matmul
