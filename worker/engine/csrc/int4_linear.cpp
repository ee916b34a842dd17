// A weight-only 4-bit matmul for few rows, in GGUF's Q4_1 block shape: the decoder's projections in a decode step.
//
//   int4_linear(x [M, K], codes [N, K/2] uint8, scales [N, K/32] f16, mins [N, K/32] f16) -> [M, N]
//     w[n, 32 g + j] = scales[n, g] * q[n, g, j] + mins[n, g], q in [0, 15]; a group's 32 codes in 16 bytes, byte
//     j holding q[j] in its low and q[j + 16] in its high nibble (Q4_1's order); x float32 or bfloat16 (unit last
//     stride), the result in x's dtype; K a multiple of 32.
//
// The activations stay float32 (no quantisation of x: no loss beyond the weights' own 4 bits, and the file's
// float16 scales and minimums are used as they are). torch's own int4 kernel takes bf16 activations and, without
// AVX-512, runs several times slower than its weights' read. The loop is group_matmul.h's; this file widens a
// group's 16 bytes to its 32 float32 weights: nibbles split by a mask and a shift, widened to int32, converted,
// then scale * q + min in one multiply-add.

#include <torch/library.h>

#include "group_matmul.h"

namespace {

using namespace group_matmul;

struct Q4_1 {
  static constexpr int64_t kBytes = kGroup / 2;  // two codes a byte

  static void widen(const uint8_t* codes, float scale, float minimum, Vec* weight) {
#if defined(__AVX512F__) || defined(__AVX2__)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const Vec d = broadcast(scale), m = broadcast(minimum);
#endif
#if defined(__AVX512F__)
    weight[0] = fmadd(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), d, m);    // q[0 .. 16)
    weight[1] = fmadd(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), d, m);   // q[16 .. 32)
#elif defined(__AVX2__)
    weight[0] = fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), d, m);
    weight[1] = fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), d, m);
    weight[2] = fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), d, m);
    weight[3] = fmadd(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), d, m);
#else
    for (int j = 0; j < kGroup / 2; ++j) {
      weight[j] = static_cast<float>(codes[j] & 0x0F) * scale + minimum;
      weight[j + kGroup / 2] = static_cast<float>(codes[j] >> 4) * scale + minimum;
    }
#endif
  }
};

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
  return run<Q4_1>(x, w, N);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenspool, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) { m.impl("int4_linear", &int4_linear); }
