// Weights in GGUF's blocks against many rows (prefill chunks, decode batches) on CPUs without fast bf16: each
// row's groups of 32 activations rounded to integers, the weights' codes in tiles, so that one AVX2 integer
// multiply-add does the work of 2-4 FMAs.
//
//   q4_1_rows(x [M, K] f32, tiles [N/8, G, 8, 8, 4] u8, scales, mins [N/8, G, 8] f32) -> [M, N] f32
//     tiles[b, g, i, c, k] = q[8 b + c, 32 g + 4 i + k] (the code of column 8 b + c's weight at input 32 g + 4 i + k,
//     0..15), w[n, 32 g + j] = scales[n / 8, g, n % 8] * q[n, 32 g + j] + mins[n / 8, g, n % 8]; G = K / 32.
//   q8_0_rows(x [M, K] f32, tiles [N/8, G, 16, 8, 2] i8, scales [N/8, G, 8] f32) -> [M, N] f32
//     tiles[b, g, i, c, k] = q[8 b + c, 32 g + 2 i + k] (-127..127), w[n, 32 g + j] = scales[n / 8, g, n % 8] *
//     q[n, 32 g + j].
//
// With w = d q (+ m) in a group of 32, the group's share of out[r, n] is d (q . x) (+ m sum(x)). Each row's group is
// rounded to integers, x ~ step a with step = max |x| / levels, so q . x = step (q . a) with q . a an exact integer
// (a value moves by at most half a step):
// - Q4_1 (the layers): 8-bit a (levels 127, llama.cpp's Q8_1 rounding of activations, 1/254 of the group's
//   largest). vpmaddubsw multiplies the 32 codes of a vector (8 columns x 4 inputs) by 4 activations broadcast to
//   every column and adds them in pairs into 16-bit sums, which hold a whole group (8 x 2 x 15 x 127 = 30,480 <
//   2^15); one vpmaddwd widens them to the 8 columns' int32 dots. m sum(x) sums the rounded values too, so the
//   result is w . x' exactly for the rounded x' (to float32 rounding).
// - Q8_0 (the LM head): 16-bit a (levels 32767, int4_linear.cpp's rounding: 2^-16 of the group's largest); a
//   vector's 16 codes (8 columns x 2 inputs, one a byte) are widened to 16 bits as they are loaded, once for the
//   tile's rows, and vpmaddwd multiplies them by 2 activations and adds the pairs into the int32 dots (codes kept
//   as int16 read twice the bytes and ran no faster: 51.8 ms a 32-row step either way, Xeon, AVX2 kernels). Signed
//   8-bit codes on both sides would need vpmaddubsw's unsigned operand made with two sign operations, the same
//   count of instructions, for a coarser rounding.
// The dots are converted and scaled once a group. A NaN or infinity among a group's activations reaches its row's
// results: through the group's sum (Q4_1), through a NaN step (Q8_0). Few rows (decode) keep the float32 weights
// of group_matmul.h's operators, which read fewer bytes; these are the matmuls the rest of a float32 step's
// quantised layers run instead of float16 weights (fbgemm's float32 FMAs).

#include <torch/library.h>

#include <cstring>

#include "group_matmul.h"
#include "operators.h"

namespace {

using namespace group_matmul;

constexpr int64_t kColumns = 8;  // output columns a tile holds: an AVX2 vector's int32 lanes
constexpr int kTileRows = 2, kTileBlocks = 2;  // rows x blocks of 8 columns a register tile (measured best of
                                               // 2x2, 4x2, 3x2, 2x4, 6x1 on AMD EPYC Zen 3, Q4_1;
                                               // Q8_0 on a Xeon: 2x2, 4x2, 3x3 within 8%, 6x2, 4x3 slower)

// VNNI (AVX-VNNI, or AVX512-VNNI on 256-bit vectors) does a multiply-add's products, pair sums and accumulation in
// one instruction, into int32 lanes: a step's 120 projections 29.6 against 35.4 ms at 32 rows, 12.4 against 13.2 at
// 8, the head 10.4-11.5 against 12.4-12.6 ms at 32 (Xeon model 167, 2 threads, weights in cache).
#if defined(__AVXVNNI__)
#define INTEGER_ROWS_VNNI 1
inline __m256i dot_u8_s8(__m256i sums, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(sums, u, s); }
inline __m256i dot_s16(__m256i sums, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(sums, a, b); }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INTEGER_ROWS_VNNI 1
inline __m256i dot_u8_s8(__m256i sums, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(sums, u, s); }
inline __m256i dot_s16(__m256i sums, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(sums, a, b); }
#endif

// A format: its activations' codes (`Code`, `kLevels`), a vector's inputs per column (`kInputs`: 4 bytes of
// activations broadcast a vector), its weights' codes (`Weight`, `load`: a vector's worth as the multiply-add takes
// them) and its integer multiply-add (`dot`: into lanes that `widen` makes int32).
struct Q4_1 {
  using Code = int8_t;
  using Weight = uint8_t;
  static constexpr float kLevels = 127.f;
  static constexpr int64_t kInputs = 4;
  static constexpr bool kMins = true;
#if defined(__AVX2__)
  static __m256i load(const Weight* codes) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)); }
#if defined(INTEGER_ROWS_VNNI)
  static __m256i dot(__m256i sums, __m256i codes, __m256i a) { return dot_u8_s8(sums, codes, a); }
  static __m256i widen(__m256i sums) { return sums; }
#else
  static __m256i dot(__m256i sums, __m256i codes, __m256i a) {
    return _mm256_add_epi16(sums, _mm256_maddubs_epi16(codes, a));
  }
  static __m256i widen(__m256i sums) { return _mm256_madd_epi16(sums, _mm256_set1_epi16(1)); }
#endif
#endif
};

struct Q8_0 {
  using Code = int16_t;
  using Weight = int8_t;
  static constexpr float kLevels = 32767.f;
  static constexpr int64_t kInputs = 2;
  static constexpr bool kMins = false;
#if defined(__AVX2__)
  static __m256i load(const Weight* codes) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  }
  static __m256i dot(__m256i sums, __m256i codes, __m256i a) {
#if defined(INTEGER_ROWS_VNNI)
    return dot_s16(sums, codes, a);
#else
    return _mm256_add_epi32(sums, _mm256_madd_epi16(codes, a));
#endif
  }
  static __m256i widen(__m256i sums) { return sums; }
#endif
};

// x's rows in groups of 32 as integers: x[r, 32 g + j] ~ step[r, g] * codes[r, 32 g + j].
template <typename Format>
struct Rows {
  std::vector<typename Format::Code> codes;  // [M, K]
  std::vector<float> step;                   // [M, G]: NaN where the group holds a NaN or infinity (Q8_0)
  std::vector<float> sums;                   // [M, G]: step * sum(codes) (Q4_1)
};

template <typename Format>
Rows<Format> round_rows(const float* x, int64_t M, int64_t G) {
  Rows<Format> rows{std::vector<typename Format::Code>(M * G * kGroup), std::vector<float>(M * G),
                    std::vector<float>(Format::kMins ? M * G : 0)};
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RoundedGroup group = round_group(x + i * kGroup, Format::kLevels, rows.codes.data() + i * kGroup);
      const bool finite = std::isfinite(group.total);
      if constexpr (Format::kMins) {
        // The rounded values' sum, not x's: Q4_1's weights are d (q - 7.5) about their middle, so the group's
        // share is exactly w . (step a) only with step sum(a); with x's own sum the rounding error met d q
        // instead, twice the error (SmolLM2: 93% of greedy choices kept, against 99%). A non-finite sum stays x's.
        rows.step[i] = group.step;
        rows.sums[i] = finite ? group.step * static_cast<float>(group.code_sum) : group.total;
      } else {
        rows.step[i] = finite ? group.step : std::numeric_limits<float>::quiet_NaN();
      }
    }
  });
  return rows;
}

template <typename Format>
struct Tiles {
  const typename Format::Weight* codes;  // [NB, G, 32 / kInputs, 8, kInputs]
  const float* scales;                   // [NB, G, 8]
  const float* mins;                     // [NB, G, 8] (Q4_1)
  int64_t groups;
};

// Rows r0 .. r0 + kRows against column blocks b0 .. b0 + kBlocks into out (row stride N).
template <typename Format, int kRows, int kBlocks>
void tile(const Tiles<Format>& w, const Rows<Format>& x, int64_t r0, int64_t b0, int64_t N, float* out) {
  constexpr int64_t kSteps = kGroup / Format::kInputs;  // vectors a group
  constexpr int64_t kVector = kColumns * Format::kInputs;  // codes a vector
  const int64_t G = w.groups, K = G * kGroup;
#if defined(__AVX2__)
  __m256 acc[kRows][kBlocks];
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) {
    __m256i dots[kRows][kBlocks];
    UNROLLED for (int r = 0; r < kRows; ++r) {
      UNROLLED for (int b = 0; b < kBlocks; ++b) dots[r][b] = _mm256_setzero_si256();
    }
    // Left rolled: unrolled, gcc computed every product first and kept them on the stack.
#pragma GCC unroll 1
    for (int64_t i = 0; i < kSteps; ++i) {
      __m256i codes[kBlocks];
      UNROLLED for (int b = 0; b < kBlocks; ++b) {
        codes[b] = Format::load(w.codes + (((b0 + b) * G + g) * kSteps + i) * kVector);
      }
      UNROLLED for (int r = 0; r < kRows; ++r) {
        int32_t four;  // 4 bytes of activations: kInputs codes
        std::memcpy(&four, x.codes.data() + (r0 + r) * K + g * kGroup + Format::kInputs * i, sizeof(four));
        const __m256i a = _mm256_set1_epi32(four);
        UNROLLED for (int b = 0; b < kBlocks; ++b) dots[r][b] = Format::dot(dots[r][b], codes[b], a);
      }
    }
    UNROLLED for (int r = 0; r < kRows; ++r) {
      const __m256 step = _mm256_set1_ps(x.step[(r0 + r) * G + g]);
      UNROLLED for (int b = 0; b < kBlocks; ++b) {
        const int64_t at = ((b0 + b) * G + g) * kColumns;
        const __m256 dot = _mm256_cvtepi32_ps(Format::widen(dots[r][b]));
        acc[r][b] = _mm256_fmadd_ps(dot, _mm256_mul_ps(_mm256_loadu_ps(w.scales + at), step), acc[r][b]);
        if constexpr (Format::kMins) {
          acc[r][b] = _mm256_fmadd_ps(_mm256_loadu_ps(w.mins + at), _mm256_set1_ps(x.sums[(r0 + r) * G + g]),
                                      acc[r][b]);
        }
      }
    }
  }
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int b = 0; b < kBlocks; ++b) _mm256_storeu_ps(out + (r0 + r) * N + (b0 + b) * kColumns, acc[r][b]);
  }
#else
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kBlocks; ++b) {
      for (int64_t c = 0; c < kColumns; ++c) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          int32_t dot = 0;
          for (int64_t j = 0; j < kGroup; ++j) {
            const int64_t i = j / Format::kInputs, k = j % Format::kInputs;
            dot += w.codes[(((b0 + b) * G + g) * kSteps + i) * kVector + c * Format::kInputs + k] *
                   x.codes[(r0 + r) * K + g * kGroup + j];
          }
          const int64_t at = ((b0 + b) * G + g) * kColumns + c;
          acc += static_cast<float>(dot) * w.scales[at] * x.step[(r0 + r) * G + g];
          if constexpr (Format::kMins) acc += w.mins[at] * x.sums[(r0 + r) * G + g];
        }
        out[(r0 + r) * N + (b0 + b) * kColumns + c] = acc;
      }
    }
  }
#endif
}

// Every row against blocks b0 .. b0 + kBlocks: the blocks' tiles stay in the cache while the rows stream past.
template <typename Format, int kBlocks>
void blocks(const Tiles<Format>& w, const Rows<Format>& x, int64_t M, int64_t b0, int64_t N, float* out) {
  int64_t r0 = 0;
  for (; r0 + kTileRows <= M; r0 += kTileRows) tile<Format, kTileRows, kBlocks>(w, x, r0, b0, N, out);
  for (; r0 < M; ++r0) tile<Format, 1, kBlocks>(w, x, r0, b0, N, out);
}

// Checks x and the tiles' shapes ([N/8, G, 32 / kInputs, 8, kInputs] of `dtype`, the per-block float32 tensors
// [N/8, G, 8]), then x's rows against every column.
template <typename Format>
at::Tensor rows_matmul(const at::Tensor& x, const at::Tensor& tiles, at::ScalarType dtype,
                       std::initializer_list<const at::Tensor*> per_block) {
  check_rows(x);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: float32 (a float32 layer's rows)");
  const int64_t M = x.size(0), G = x.size(1) / kGroup;
  TORCH_CHECK(tiles.scalar_type() == dtype && tiles.is_contiguous() && tiles.dim() == 5 && tiles.size(1) == G &&
                  tiles.size(2) == kGroup / Format::kInputs && tiles.size(3) == kColumns &&
                  tiles.size(4) == Format::kInputs,
              "tiles: contiguous ", dtype, " [N/8, K/32, ", kGroup / Format::kInputs, ", 8, ", Format::kInputs,
              "] for x [M, K]");
  const int64_t NB = tiles.size(0), N = NB * kColumns;
  for (const at::Tensor* t : per_block) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == NB &&
                    t->size(1) == G && t->size(2) == kColumns,
                "scales (and mins): contiguous float32 [N/8, K/32, 8]");
  }
  const at::Tensor x32 = x.contiguous();
  const Rows<Format> rows = round_rows<Format>(x32.data_ptr<float>(), M, G);
  const at::Tensor* const* t = per_block.begin();
  const Tiles<Format> w{reinterpret_cast<const typename Format::Weight*>(tiles.data_ptr()), t[0]->data_ptr<float>(),
                        per_block.size() > 1 ? t[1]->data_ptr<float>() : nullptr, G};
  auto out = at::empty({M, N}, x.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (NB + kTileBlocks - 1) / kTileBlocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if ((b + 1) * kTileBlocks <= NB) {
        blocks<Format, kTileBlocks>(w, rows, M, b * kTileBlocks, N, o);
      } else {
        for (int64_t one = b * kTileBlocks; one < NB; ++one) blocks<Format, 1>(w, rows, M, one, N, o);
      }
    }
  });
  return out;
}

}  // namespace

namespace tokenspool {

at::Tensor q4_1_rows(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, const at::Tensor& mins) {
  return rows_matmul<Q4_1>(x, tiles, at::kByte, {&scales, &mins});
}

at::Tensor q8_0_rows(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales) {
  return rows_matmul<Q8_0>(x, tiles, at::kChar, {&scales});
}

}  // namespace tokenspool

TORCH_LIBRARY_FRAGMENT(tokenspool, m) {
  m.def("q4_1_rows(Tensor x, Tensor tiles, Tensor scales, Tensor mins) -> Tensor");
  m.def("q8_0_rows(Tensor x, Tensor tiles, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) {
  m.impl("q4_1_rows", &tokenspool::q4_1_rows);
  m.impl("q8_0_rows", &tokenspool::q8_0_rows);
}
