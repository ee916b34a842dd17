// exp(x) in float32 as plain arithmetic that gcc vectorises: std::exp is a scalar libm call in a loop unless
// -ffast-math, which would flush denormals for the whole process. Cephes' expf: x = n ln2 + r with |r| <= ln2/2,
// e^r by a degree-7 polynomial, 2^n by writing n into the exponent bits. Within 2 ulp of std::exp where the
// result is a normal float; 0 below exp(-87.3) (where std::exp goes denormal), and capped at exp(88) above.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tokenspool {

inline float fast_exp(float x) {
  constexpr float kLowest = -87.33654f, kHighest = 88.f;
  const float clamped = std::min(std::max(x, kLowest), kHighest);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);  // round(x / ln2)
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 in two parts: r exact enough
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < kLowest ? 0.f : p * scale;
}

}  // namespace tokenspool
