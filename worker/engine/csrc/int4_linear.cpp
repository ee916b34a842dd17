// A weight-only 4-bit matmul for few rows, in GGUF's Q4_1 block shape: the decoder's projections in a decode step.
//
//   int4_linear(x [M, K], codes [N, K/2] uint8, scales [N, K/32] f16, mins [N, K/32] f16) -> [M, N]
//     w[n, 32 g + j] = scales[n, g] * q[n, g, j] + mins[n, g], q in [0, 15]; a group's 32 codes in 16 bytes, byte
//     j holding q[j] in its low and q[j + 16] in its high nibble (Q4_1's order); x float32 or bfloat16 (unit last
//     stride), the result in x's dtype; K a multiple of 32.
//
// With w = d q + m in a group of 32, the group's share of out[r, n] is d (q . x) + m sum(x). The activations are
// rounded once per call to 16-bit integers per group of 32 (`round_rows`: x ~ step i, step = max |x| / 32767, so
// each value moves by at most 2^-16 of its group's largest, where bf16 moves each value by up to 2^-9 of itself),
// which makes q . x an integer dot product, exact in int32: AVX2's vpmaddwd multiplies 16 pairs of 16-bit integers
// and adds them in pairs. Each group's sum is converted once and scaled by d * step; m sum(x) uses the float32
// activations' own sums. The weights are the file's exactly (its float16 scales and minimums), and the
// accumulation is float32. One row costs ~10 instructions a group (a group's 16 bytes widen in 3, a load among
// them): widening the codes to float32 weights instead (this operator's first form) took ~29, and its AVX2 loop
// ran at a third of the memory's rate (AMD EPYC Zen 3). torch's int4 kernel takes bf16 activations and, without
// AVX-512, is slower still.

#include <torch/library.h>

#include <cmath>

#include "group_matmul.h"
#include "operators.h"

namespace {

using namespace group_matmul;

constexpr float kLevels = 32767.f;  // the 16-bit code of a group's largest |x|
constexpr int64_t kPad = 8;          // float32 lanes of an AVX2 vector

// Group counts are padded to a whole number of vectors where per-group values are read in vectors.
inline int64_t padded(int64_t groups) { return (groups + kPad - 1) / kPad * kPad; }

// x's rows in groups of 32 as 16-bit integers: x[r, 32 g + j] ~ step[r, g] * codes[r, g, j], and each
// group's float32 sum; `step` and `sums` are zero beyond the G groups of a row.
struct Rows16 {
  std::vector<int16_t> codes;  // [M, G, 32]
  std::vector<float> step;     // [M, padded(G)]
  std::vector<float> sums;     // [M, padded(G)]
};

// Non-finite values reach the result through the sums (and the steps), as they would through a float product.
Rows16 round_rows(const float* x, int64_t M, int64_t G) {
  const int64_t Gp = padded(G);
  Rows16 rows{std::vector<int16_t>(M * G * kGroup), std::vector<float>(M * Gp), std::vector<float>(M * Gp)};
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = (r * G + g) * kGroup;
      const RoundedGroup group = round_group(x + at, kLevels, rows.codes.data() + at);
      rows.step[r * Gp + g] = group.step;
      rows.sums[r * Gp + g] = group.total;
    }
  }
  return rows;
}

// q . x of group g (`bytes`: its 16 bytes) against each row's codes (`x`: row 0's group, row stride `stride`),
// into dots[r].
template <int kRows>
inline void group_dots(const uint8_t* bytes, const int16_t* x, int64_t stride, int32_t (&dots)[kRows]) {
  UNROLLED for (int r = 0; r < kRows; ++r) {
    int32_t dot = 0;
    for (int64_t j = 0; j < kGroup / 2; ++j) {
      dot += (bytes[j] & 0x0F) * x[r * stride + j] + (bytes[j] >> 4) * x[r * stride + j + kGroup / 2];
    }
    dots[r] = dot;
  }
}

#if defined(__AVX2__)
// A group's 16 bytes -> its 32 codes as 16-bit integers, `a` codes 0-15 (the low nibbles), `b` codes 16-31 (the
// high): each byte widened to 16 bits holds both, so a mask and a shift split them, three instructions in all
// (splitting the nibbles in 8 bits first and unpacking them took six: 120 projections at one row, one thread, hot,
// 7.1-8.0 -> 6.5-6.9 ms, AMD EPYC Zen 3).
inline void widen_codes(const uint8_t* bytes, __m256i& a, __m256i& b) {
  const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  a = _mm256_and_si256(words, _mm256_set1_epi16(0x0F));
  b = _mm256_srli_epi16(words, 4);
}

// The group's q . x of a row as 8 int32 partial sums.
inline __m256i row_dot(__m256i a, __m256i b, const int16_t* x) {
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kGroup / 2));
  return _mm256_add_epi32(_mm256_madd_epi16(a, xa), _mm256_madd_epi16(b, xb));
}
#endif

// Output column n (its groups' bytes: `bytes`; its scales and minimums: `d`, `m`, readable to padded(G), the
// padding finite) of rows r0 .. r0 + kRows into out (row stride N). `scaled`: scratch for kRows * padded(G).
// Each group's dot product is scaled by d * step in the loop; sum_g m * sum(x) is added in vectors at the end,
// where the padding's zero sums drop it. One row sums its groups in two chains (an add's latency would serialise
// one); more rows interleave.
template <int kRows, typename Out>
void column(const uint8_t* bytes, const float* d, const float* m, const Rows16& rows, int64_t r0, int64_t G,
            float* scaled, int64_t N, int64_t n, Out* out) {
  const int64_t Gp = padded(G), stride = G * kGroup;
  const int16_t* x = rows.codes.data() + r0 * stride;
  const float* step = rows.step.data() + r0 * Gp;
  const float* sums = rows.sums.data() + r0 * Gp;
#if defined(__AVX2__)
  UNROLLED for (int r = 0; r < kRows; ++r) {
    for (int64_t g = 0; g < Gp; g += kPad) {
      _mm256_storeu_ps(scaled + r * Gp + g, _mm256_mul_ps(_mm256_loadu_ps(d + g), _mm256_loadu_ps(step + r * Gp + g)));
    }
  }
  constexpr int kAccs = kRows == 1 ? 2 : 1;
  __m256 acc[kRows][kAccs];
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int a = 0; a < kAccs; ++a) acc[r][a] = _mm256_setzero_ps();
  }
  const auto group = [&](int64_t g, int a) {
    __m256i wa, wb;
    __builtin_prefetch(bytes + g * kGroup / 2 + kPrefetchBytes);
    widen_codes(bytes + g * kGroup / 2, wa, wb);
    UNROLLED for (int r = 0; r < kRows; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(row_dot(wa, wb, x + r * stride + g * kGroup));
      acc[r][a] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(scaled + r * Gp + g), acc[r][a]);
    }
  };
  int64_t g = 0;
  for (; g + kAccs <= G; g += kAccs) {
    UNROLLED for (int a = 0; a < kAccs; ++a) group(g + a, a);
  }
  for (; g < G; ++g) group(g, 0);
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int a = 1; a < kAccs; ++a) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);
    for (int64_t i = 0; i < Gp; i += kPad) {
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(m + i), _mm256_loadu_ps(sums + r * Gp + i), acc[r][0]);
    }
    out[(r0 + r) * N + n] = static_cast<Out>(total(acc[r][0]));
  }
#else
  (void)scaled;
  float acc[kRows] = {};
  for (int64_t g = 0; g < G; ++g) {
    int32_t dots[kRows];
    group_dots<kRows>(bytes + g * kGroup / 2, x + g * kGroup, stride, dots);
    for (int r = 0; r < kRows; ++r) {
      acc[r] += static_cast<float>(dots[r]) * d[g] * step[r * Gp + g] + m[g] * sums[r * Gp + g];
    }
  }
  for (int r = 0; r < kRows; ++r) out[(r0 + r) * N + n] = static_cast<Out>(acc[r]);
#endif
}

// Rows r0 .. r0 + kRows against every column, in blocks of kColumnsPerTask whose scales and minimums are widened
// in one call each (with kPad floats of slack: the last column's are read to padded(G)).
template <int kRows, typename Out>
void pass(const Weights& w, const Rows16& rows, int64_t r0, int64_t N, Out* out) {
  at::parallel_for(0, N, kColumnsPerTask, [&](int64_t begin, int64_t end) {
    const int64_t G = w.groups;
    std::vector<float> scale(kColumnsPerTask * G + kPad), minimum(kColumnsPerTask * G + kPad);
    std::vector<float> scaled(kRows * padded(G));
    for (int64_t n0 = begin; n0 < end; n0 += kColumnsPerTask) {
      const int64_t n1 = std::min(end, n0 + kColumnsPerTask);
      widen_halves(w.scales + n0 * G, (n1 - n0) * G, scale.data());
      widen_halves(w.mins + n0 * G, (n1 - n0) * G, minimum.data());
      for (int64_t n = n0; n < n1; ++n) {
        column<kRows>(w.codes + n * G * kGroup / 2, scale.data() + (n - n0) * G, minimum.data() + (n - n0) * G,
                      rows, r0, G, scaled.data(), N, n, out);
      }
    }
  });
}

// x [M, K] float32, contiguous; out [M, N].
template <typename Out>
void int4_matmul(const float* x, int64_t M, const Weights& w, int64_t N, Out* out) {
  const Rows16 rows = round_rows(x, M, w.groups);
  in_passes(M, [&](auto count, int64_t r0) { pass<decltype(count)::value>(w, rows, r0, N, out); });
}

}  // namespace

namespace tokenspool {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins) {
  check_rows(x);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "codes: uint8 [N, K/2]");
  TORCH_CHECK(codes.size(1) * 2 == x.size(1), "codes: [N, K/2] for x [M, K]");
  const int64_t K = x.size(1), N = codes.size(0);
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous(), "scales, mins: contiguous float16");
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == K / kGroup, "scales, mins: [N, K/32]");
  }
  const Weights w{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), K / kGroup};
  return in_rows(x, N, [&](const float* x32, int64_t M, auto* out) { int4_matmul(x32, M, w, N, out); });
}

}  // namespace tokenspool

TORCH_LIBRARY_FRAGMENT(tokenspool, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) { m.impl("int4_linear", &tokenspool::int4_linear); }
