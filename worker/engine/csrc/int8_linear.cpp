// A weight-only int8 matmul for few rows, in GGUF's Q8_0 block shape: the LM head of a decode step.
//
//   int8_linear(x [M, K], codes [N, K] int8, scales [N, K/32] f16) -> [M, N]
//     w[n, k] = scales[n, k / 32] * codes[n, k]; x float32 or bfloat16 (unit last stride), the result in x's
//     dtype; K a multiple of 32.
//
// With one or two rows the LM head is a read of its weights (SmolLM2's: 49152 x 576), and stock torch has no
// kernel for int8 in groups: its per-row int8 kernel lost to the dense bf16 matmul. The loop is group_matmul.h's;
// this file widens a group of 32 codes to its float32 weights.

#include <torch/library.h>

#include "group_matmul.h"

namespace {

using namespace group_matmul;

struct Q8_0 {
  static constexpr int64_t kBytes = kGroup;  // one signed byte a weight

  static void widen(const uint8_t* codes, float scale, Vec* weight) {
#if defined(__AVX512F__)
    for (int i = 0; i < kVectors; ++i) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      weight[i] = mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), broadcast(scale));
    }
#elif defined(__AVX2__)
    for (int i = 0; i < kVectors; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      weight[i] = mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), broadcast(scale));
    }
#else
    for (int i = 0; i < kVectors; ++i) weight[i] = static_cast<float>(static_cast<int8_t>(codes[i])) * scale;
#endif
  }
};

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  check_rows(x);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.dim() == 2, "codes: int8 [N, K]");
  TORCH_CHECK(codes.size(1) == x.size(1), "codes: [N, K], K a multiple of ", kGroup);
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "scales: contiguous float16");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / kGroup, "scales: [N, K/32]");
  const Weights w{reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), scales.data_ptr<at::Half>(), nullptr,
                  K / kGroup};
  return run<Q8_0>(x, w, N);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenspool, m) { m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) { m.impl("int8_linear", &int8_linear); }
