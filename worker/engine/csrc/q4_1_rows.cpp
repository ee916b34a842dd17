// Q4_1 weights against many rows (prefill chunks, decode batches) on CPUs without fast bf16: activations rounded
// to 8-bit integers per group of 32, the codes one a byte in tiles, so that AVX2's vpmaddubsw multiplies 32 pairs
// of 8-bit integers where an FMA multiplies 8 floats.
//
//   q4_1_rows(x [M, K] f32, tiles [N/8, G, 8, 8, 4] u8, scales, mins [N/8, G, 8] f32) -> [M, N] f32
//     tiles[b, g, i, c, k] = q[8 b + c, 32 g + 4 i + k] (the code of column 8 b + c's weight at input 32 g + 4 i + k,
//     0..15), w[n, 32 g + j] = scales[n / 8, g, n % 8] * q[n, 32 g + j] + mins[n / 8, g, n % 8]; G = K / 32.
//
// With w = d q + m in a group of 32, the group's share of out[r, n] is d (q . x) + m sum(x). Each row's group is
// rounded to 8-bit integers (x ~ step a, step = max |x| / 127, a in -127..127: a value moves by at most 1/254 of
// its group's largest, the rounding llama.cpp's Q8_1 activations make), so q . x = step (q . a) with q . a an exact
// integer: vpmaddubsw multiplies the 32 codes of a vector (8 columns x 4 inputs) by 4 activations broadcast to
// every column and adds them in pairs into 16-bit sums, which hold a whole group (8 x 2 x 15 x 127 = 30,480 <
// 2^15); one vpmaddwd widens them to the 8 columns' int32 dots, converted and scaled once a group. m sum(x) sums the
// rounded values too, so the result is w . x' exactly for the rounded x' (to float32 rounding); a NaN or infinity
// among the activations still reaches it, through the group's sum. Few rows (decode) keep the
// 16-bit activations of int4_linear.cpp, which reads half the bytes and loses nothing measurable; this operator is
// the matmul the rest of a float32 step's int4 layers run instead of float16 weights (fbgemm's float32 FMAs).

#include <torch/library.h>

#include <cstring>

#include "group_matmul.h"
#include "operators.h"

namespace {

using namespace group_matmul;

constexpr int64_t kColumns = 8;  // output columns a tile holds: an AVX2 vector's int32 lanes
constexpr int64_t kSteps = 8;    // vectors of 4 inputs a group
constexpr int kTileRows = 2, kTileBlocks = 2;  // rows x blocks of 8 columns a register tile (measured best of
                                               // 2x2, 4x2, 3x2, 2x4, 6x1 on AMD EPYC Zen 3)
constexpr float kLevels = 127.f;

// x's rows in groups of 32 as 8-bit integers: x[r, 32 g + j] ~ step[r, g] * codes[r, 32 g + j].
struct Rows8 {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> step;    // [M, G]
  std::vector<float> sums;    // [M, G]: step * sum(codes)
};

Rows8 round_rows(const float* x, int64_t M, int64_t G) {
  Rows8 rows{std::vector<int8_t>(M * G * kGroup), std::vector<float>(M * G), std::vector<float>(M * G)};
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // The rounded values' sum, not x's: Q4_1's weights are d (q - 7.5) about their middle, so the group's share
      // is exactly w . (step a) only with step sum(a); with x's own sum the rounding error met d q instead, twice
      // the error (SmolLM2: 93% of greedy choices kept, against 99%). A non-finite sum stays x's.
      const RoundedGroup group = round_group(x + i * kGroup, kLevels, rows.codes.data() + i * kGroup);
      rows.step[i] = group.step;
      rows.sums[i] = std::isfinite(group.total) ? group.step * static_cast<float>(group.code_sum) : group.total;
    }
  });
  return rows;
}

struct Tiles {
  const uint8_t* codes;  // [NB, G, 8, 8, 4]
  const float* scales;   // [NB, G, 8]
  const float* mins;     // [NB, G, 8]
  int64_t groups;
};

// Rows r0 .. r0 + kRows against column blocks b0 .. b0 + kBlocks into out (row stride N).
template <int kRows, int kBlocks>
void tile(const Tiles& w, const Rows8& x, int64_t r0, int64_t b0, int64_t N, float* out) {
  const int64_t G = w.groups, K = G * kGroup;
#if defined(__AVX2__)
  __m256 acc[kRows][kBlocks];
  UNROLLED for (int r = 0; r < kRows; ++r) {
    UNROLLED for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
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
        codes[b] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w.codes + (((b0 + b) * G + g) * kSteps + i) * kColumns * 4));
      }
      UNROLLED for (int r = 0; r < kRows; ++r) {
        int32_t four;
        std::memcpy(&four, x.codes.data() + (r0 + r) * K + g * kGroup + 4 * i, sizeof(four));
        const __m256i a = _mm256_set1_epi32(four);
        UNROLLED for (int b = 0; b < kBlocks; ++b) {
          dots[r][b] = _mm256_add_epi16(dots[r][b], _mm256_maddubs_epi16(codes[b], a));
        }
      }
    }
    UNROLLED for (int r = 0; r < kRows; ++r) {
      const __m256 step = _mm256_set1_ps(x.step[(r0 + r) * G + g]);
      const __m256 sum = _mm256_set1_ps(x.sums[(r0 + r) * G + g]);
      UNROLLED for (int b = 0; b < kBlocks; ++b) {
        const int64_t at = ((b0 + b) * G + g) * kColumns;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(dots[r][b], ones));
        acc[r][b] = _mm256_fmadd_ps(dot, _mm256_mul_ps(_mm256_loadu_ps(w.scales + at), step), acc[r][b]);
        acc[r][b] = _mm256_fmadd_ps(_mm256_loadu_ps(w.mins + at), sum, acc[r][b]);
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
            const int64_t i = j / 4, k = j % 4;
            dot += w.codes[((((b0 + b) * G + g) * kSteps + i) * kColumns + c) * 4 + k] *
                   x.codes[(r0 + r) * K + g * kGroup + j];
          }
          const int64_t at = ((b0 + b) * G + g) * kColumns + c;
          acc += static_cast<float>(dot) * w.scales[at] * x.step[(r0 + r) * G + g] +
                 w.mins[at] * x.sums[(r0 + r) * G + g];
        }
        out[(r0 + r) * N + (b0 + b) * kColumns + c] = acc;
      }
    }
  }
#endif
}

// Every row against blocks b0 .. b0 + kBlocks: the blocks' tiles stay in the cache while the rows stream past.
template <int kBlocks>
void blocks(const Tiles& w, const Rows8& x, int64_t M, int64_t b0, int64_t N, float* out) {
  int64_t r0 = 0;
  for (; r0 + kTileRows <= M; r0 += kTileRows) tile<kTileRows, kBlocks>(w, x, r0, b0, N, out);
  for (; r0 < M; ++r0) tile<1, kBlocks>(w, x, r0, b0, N, out);
}

}  // namespace

namespace tokenspool {

at::Tensor q4_1_rows(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, const at::Tensor& mins) {
  check_rows(x);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: float32 (a float32 layer's rows)");
  const int64_t M = x.size(0), G = x.size(1) / kGroup;
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.dim() == 5 &&
                  tiles.size(1) == G && tiles.size(2) == kSteps && tiles.size(3) == kColumns && tiles.size(4) == 4,
              "tiles: contiguous uint8 [N/8, K/32, 8, 8, 4] for x [M, K]");
  const int64_t NB = tiles.size(0), N = NB * kColumns;
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == NB &&
                    t->size(1) == G && t->size(2) == kColumns,
                "scales, mins: contiguous float32 [N/8, K/32, 8]");
  }
  const at::Tensor x32 = x.contiguous();
  const Rows8 rows = round_rows(x32.data_ptr<float>(), M, G);
  const Tiles w{tiles.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), G};
  auto out = at::empty({M, N}, x.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (NB + kTileBlocks - 1) / kTileBlocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if ((t + 1) * kTileBlocks <= NB) {
        blocks<kTileBlocks>(w, rows, M, t * kTileBlocks, N, o);
      } else {
        for (int64_t b = t * kTileBlocks; b < NB; ++b) blocks<1>(w, rows, M, b, N, o);
      }
    }
  });
  return out;
}

}  // namespace tokenspool

TORCH_LIBRARY_FRAGMENT(tokenspool, m) {
  m.def("q4_1_rows(Tensor x, Tensor tiles, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) { m.impl("q4_1_rows", &tokenspool::q4_1_rows); }
