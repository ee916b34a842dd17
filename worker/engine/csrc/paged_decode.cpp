// Single-token (decode) attention that reads the paged K/V cache in place.
//
// Stock torch has no CPU kernel for a paged cache, so the Python path gathers every block table into a
// contiguous copy per layer and runs SDPA over the copy, padded to the group's longest sequence. This operator
// walks each sequence's block table instead: no copy, no padding, no mask, one call per layer for every
// sequence of the step. Exact attention (two passes: scores, then a softmax-weighted sum of values), float32
// accumulation whatever the cache's dtype.
//
// Shapes (names as in worker/engine/kv_cache.py):
//   query        [B, H, D]            any strides with a unit last stride
//   key_pool     [NB, BS, KVH, D]     one layer's pool, D contiguous
//   value_pool   [NB, BS, KVH, D]
//   block_tables [B, MB] int64        blocks of each sequence, right-padded with anything
//   context_lens [B] int64            keys each sequence attends to (<= MB * BS)
//   returns      [B, H, D]            query's dtype
// GQA: query head h reads KV head h / (H / KVH), transformers' repeat_kv grouping.
// bfloat16 queries over a bfloat16 cache with head size 64 or 128 take `attend_bf16` where the CPU has
// AVX512-BF16 (dot products straight from the cache); one stream's float32 queries over a float16 cache take
// `attend_f16` where it has F16C (rows widened in registers); everything else the generic `attend`.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fast_exp.h"
#include "operators.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// One row of D values as float32. bfloat16 is the top half of a float32: widen and shift, 16 or 8 at a time.
inline void load_row(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const at::BFloat16* src, int64_t n, float* dst) {
  const auto* raw = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(raw + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
#endif
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

inline void load_row(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// q . r[i] for the kKeysAtOnce rows r[i] (n floats each, consecutive) into out[i]. With AVX2 the four sums stay
// vectors to the end and are reduced together (three horizontal adds and one add, where four separate reductions
// cost ~20 instructions): the scores of a batch of 32 sequences ran at a tenth of the FMA rate with `dot` per key.
inline void dots(const float* q, const float* r, int64_t n, float* out) {
#if defined(__AVX2__)
  if (n % 8 == 0) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t d = 0; d < n; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + i * n + d), acc[i]);
    }
    // per 128-bit half: [sum of acc[0]'s, acc[1]'s, acc[2]'s, acc[3]'s lanes in that half]
    const __m256 quad = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(quad), _mm256_extractf128_ps(quad, 1)));
    return;
  }
#endif
  for (int i = 0; i < 4; ++i) out[i] = dot(q, r + i * n, n);
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// A row of one KV head is D values at a stride of a whole token (all KV heads), and blocks are scattered: the
// hardware prefetcher does not follow that, so each loop asks for the row this many keys ahead.
constexpr int64_t kPrefetchRows = 8;
constexpr int64_t kKeysAtOnce = 4;  // `dots` and the value pass below spell out four
// The fused forms (one value row a few ns, memory ~100) ask for value rows this many keys ahead.
constexpr int64_t kValuesAhead = 32;

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
}

struct Layout {
  int64_t num_seqs, num_heads, head_dim, num_kv_heads, block_size, group;
  int64_t q_seq, q_head, out_seq, out_head;        // query / output strides
  int64_t kv_block, kv_token, kv_head;             // pool strides
  int64_t table_row;                               // block_tables stride
};

// Where each key's token lies in the pool, block by block, into offsets[0, num_keys): no division per key (a
// 64-bit division by the block size, for every row read and prefetched, took ~40% of the operator's time at 32
// sequences). Forms that read keys in tiles of `tile` get offsets up to a whole number of tiles, the tail
// repeating the first key's (its scores unused); returns that padded count.
inline int64_t fill_token_offsets(const Layout& L, const int64_t* table, int64_t num_keys, int64_t tile,
                                  std::vector<int64_t>& offsets) {
  const int64_t padded = (num_keys + tile - 1) / tile * tile;
  offsets.resize(padded);
  for (int64_t t0 = 0; t0 < num_keys; t0 += L.block_size) {
    const int64_t base = table[t0 / L.block_size] * L.kv_block;
    const int64_t end = std::min(num_keys, t0 + L.block_size);
    for (int64_t t = t0; t < end; ++t) offsets[t] = base + (t - t0) * L.kv_token;
  }
  std::fill(offsets.begin() + num_keys, offsets.end(), offsets[0]);
  return padded;
}

// scores -> exp(score - max_score) in place; returns their sum (the softmax's denominator).
inline float exp_and_sum(float* s, int64_t num_keys, float max_score) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < num_keys; ++t) {
    s[t] = tokenspool::fast_exp(s[t] - max_score);
    sum += s[t];
  }
  return sum;
}

// out's query heads [head0, head0 + count) = acc [count, D] / total [count], in the output's dtype.
template <typename Q>
inline void write_heads(const Layout& L, const float* acc, const float* total, int64_t head0, int64_t count,
                        int64_t D, Q* out) {
  for (int64_t h = 0; h < count; ++h) {
    const float inv = 1.f / total[h];
    Q* dst = out + (head0 + h) * L.out_head;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(acc[h * D + d] * inv);
  }
}

// Attention of query heads [head0, head0 + count) of one sequence, which read KV heads kv0 .. kv0 + num_kv - 1.
// `kDim`: the head size when known at compile time (the common 64 and 128, whose loops then unroll), else 0.
template <typename Q, typename KV, int kDim>
void attend(const Layout& L, const Q* query, const KV* keys, const KV* values, const int64_t* table,
            int64_t num_keys, int64_t head0, int64_t count, float scale, Q* out, std::vector<float>& scratch,
            std::vector<int64_t>& token_offsets) {
  const int64_t D = kDim > 0 ? kDim : L.head_dim;
  const int64_t kv0 = head0 / L.group, num_kv = (head0 + count - 1) / L.group - kv0 + 1;
  scratch.resize(count * (2 * D + 2 + num_keys) + num_kv * kKeysAtOnce * D);
  float* q = scratch.data();           // [count, D] scaled queries
  float* acc = q + count * D;          // [count, D] weighted sums of values
  float* max_score = acc + count * D;  // [count]
  float* total = max_score + count;    // [count] softmax denominators
  float* rows = total + count;         // [num_kv, kKeysAtOnce, D] keys or values
  float* scores = rows + num_kv * kKeysAtOnce * D;  // [count, num_keys]
  for (int64_t h = 0; h < count; ++h) {
    load_row(query + (head0 + h) * L.q_head, D, q + h * D);
    for (int64_t d = 0; d < D; ++d) q[h * D + d] *= scale;
  }
  std::fill(acc, acc + count * D, 0.f);
  std::fill(max_score, max_score + count, -std::numeric_limits<float>::infinity());
  std::fill(total, total + count, 0.f);
  fill_token_offsets(L, table, num_keys, 1, token_offsets);
  const auto offset_of = [&](int64_t t, int64_t kv) { return token_offsets[t] + kv * L.kv_head; };
  // Keys and values are taken kKeysAtOnce at a time: independent dot products, and one pass over `acc` for
  // several values, keep the pipeline busy (one at a time, each waited on the last one's reduction or store).
  // All the item's KV heads of a token are read together: adjacent in the pool, so a block streams in order.
  const auto load_keys = [&](const KV* pool, int64_t t, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      if (t + i + kPrefetchRows < num_keys) {
        for (int64_t k = 0; k < num_kv; ++k) prefetch_row(pool + offset_of(t + i + kPrefetchRows, kv0 + k), D);
      }
      for (int64_t k = 0; k < num_kv; ++k) {
        load_row(pool + offset_of(t + i, kv0 + k), D, rows + (k * kKeysAtOnce + i) * D);
      }
    }
  };
  const auto rows_of = [&](int64_t h) { return rows + ((head0 + h) / L.group - kv0) * kKeysAtOnce * D; };
  for (int64_t t = 0; t < num_keys; t += kKeysAtOnce) {
    const int64_t n = std::min(kKeysAtOnce, num_keys - t);
    load_keys(keys, t, n);
    for (int64_t h = 0; h < count; ++h) {
      float four[kKeysAtOnce];  // past n: products with stale rows of the scratch, unused
      dots(q + h * D, rows_of(h), D, four);
      for (int64_t i = 0; i < n; ++i) {
        scores[h * num_keys + t + i] = four[i];
        max_score[h] = std::max(max_score[h], four[i]);
      }
    }
  }
  for (int64_t h = 0; h < count; ++h) total[h] = exp_and_sum(scores + h * num_keys, num_keys, max_score[h]);
  for (int64_t t = 0; t < num_keys; t += kKeysAtOnce) {
    const int64_t n = std::min(kKeysAtOnce, num_keys - t);
    load_keys(values, t, n);
    for (int64_t h = 0; h < count; ++h) {
      const float* p = scores + h * num_keys + t;
      const float* r = rows_of(h);
      float* a = acc + h * D;
      if (n == kKeysAtOnce) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          a[d] += p[0] * r[d] + p[1] * r[D + d] + p[2] * r[2 * D + d] + p[3] * r[3 * D + d];
        }
      } else {
        for (int64_t i = 0; i < n; ++i) axpy(p[i], r + i * D, a, D);
      }
    }
  }
  write_heads(L, acc, total, head0, count, D, out);
}

#if defined(__AVX512BF16__)
constexpr int64_t kTile = 16;  // keys a score tile takes: one vector of scores

// Sixteen vectors -> one: lane i is the sum of v[i]'s lanes. Pairs, then quads within 128-bit lanes, then across
// them: 45 instructions for 16 sums, where a reduction each costs ~8.
inline __m512 sum16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's part of v[4i], ..., v[4i + 3]
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const auto halves = [](__m512 a, __m512 b) {  // [a's lanes 0+1, a's 2+3, b's 0+1, b's 2+3]
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  const __m512 low = halves(quads[0], quads[1]), high = halves(quads[2], quads[3]);
  return halves(low, high);
}

// 16 bfloat16 values widened to float32 (bfloat16 is a float32's top half).
inline __m512 widen16(const at::BFloat16* src) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// `attend` for bfloat16 queries over a bfloat16 cache, kDim a multiple of 64, with AVX512-BF16. Scores: q . k by
// `vdpbf16ps` straight from the cache (bfloat16 products are exact in float32; the sums are float32, DAZ), 16 keys
// a tile, the 16 dot products reduced together; then the scale. Values: each row widened once in registers and
// added into every query head of its KV head, whose sums stay in registers. The scratch rows of the generic
// loop (a float32 copy of every key and value, written and read again per head) are gone. SmolLM2's shape, 32
// sequences of 64-281 keys, Xeon with AMX, 2 threads: 0.16 against 0.26 ms a call hot, 0.27 against 0.34 with
// the caches flushed; inside the engine's step, where the rows come from memory, 11% less time.
template <int kDim>
void attend_bf16(const Layout& L, const at::BFloat16* query, const at::BFloat16* keys, const at::BFloat16* values,
                 const int64_t* table, int64_t num_keys, int64_t head0, int64_t count, float scale,
                 at::BFloat16* out, std::vector<float>& scratch, std::vector<int64_t>& token_offsets) {
  static_assert(kDim % 64 == 0, "whole 64-value chunks");
  constexpr int kHeadsAtOnce = 4;  // value sums of up to 4 query heads x 64 values in 16 registers
  const int64_t padded = fill_token_offsets(L, table, num_keys, kTile, token_offsets);
  scratch.resize(count * (kDim + 1 + padded));
  float* acc = scratch.data();               // [count, kDim]
  float* total = acc + count * kDim;         // [count]
  float* scores = total + count;             // [count, padded]
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t h = 0; h < count; ++h) {
    const int64_t kv_head = (head0 + h) / L.group;
    const at::BFloat16* q = query + (head0 + h) * L.q_head;
    __m512bh qv[kDim / 32];
    for (int c = 0; c < kDim / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    // The first query head of its KV head in this item asks for the next tile's keys; the others find them.
    const bool fetch = h == 0 || (head0 + h) % L.group == 0;
    __m512 max_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t0 = 0; t0 < padded; t0 += kTile) {
      if (fetch && t0 + kTile < num_keys) {
        const int64_t ahead = std::min(kTile, num_keys - t0 - kTile);
        for (int64_t i = 0; i < ahead; ++i) {
          prefetch_row(keys + token_offsets[t0 + kTile + i] + kv_head * L.kv_head, kDim);
        }
      }
      __m512 dot[kTile];
#pragma GCC unroll 16
      for (int64_t i = 0; i < kTile; ++i) {
        const at::BFloat16* row = keys + token_offsets[t0 + i] + kv_head * L.kv_head;
        dot[i] = _mm512_setzero_ps();
        for (int c = 0; c < kDim / 32; ++c) {
          dot[i] = _mm512_dpbf16_ps(dot[i], qv[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
        }
      }
      const __m512 tile = _mm512_mul_ps(sum16(dot), scale_v);
      _mm512_storeu_ps(scores + h * padded + t0, tile);
      const int64_t valid = std::min(kTile, num_keys - t0);  // a tail tile's other lanes are no keys
      max_v = _mm512_mask_max_ps(max_v, static_cast<__mmask16>((1u << valid) - 1), max_v, tile);
    }
    total[h] = exp_and_sum(scores + h * padded, num_keys, _mm512_reduce_max_ps(max_v));
  }
  // Values: the query heads of one KV head together (up to kHeadsAtOnce), 64 values of the row at a time.
  for (int64_t h0 = 0; h0 < count;) {
    const int64_t kv_head = (head0 + h0) / L.group;
    int64_t n = 1;
    while (n < kHeadsAtOnce && h0 + n < count && (head0 + h0 + n) / L.group == kv_head) ++n;
    for (int64_t c = 0; c < kDim; c += 64) {
      __m512 sums[kHeadsAtOnce][4];
      for (int64_t j = 0; j < n; ++j) {
        for (int v = 0; v < 4; ++v) sums[j][v] = _mm512_setzero_ps();
      }
      for (int64_t t = 0; t < num_keys; ++t) {
        const at::BFloat16* row = values + token_offsets[t] + kv_head * L.kv_head + c;
        if (t + kValuesAhead < num_keys) {
          prefetch_row(values + token_offsets[t + kValuesAhead] + kv_head * L.kv_head + c, 64);
        }
        const __m512 r[4] = {widen16(row), widen16(row + 16), widen16(row + 32), widen16(row + 48)};
        for (int64_t j = 0; j < n; ++j) {
          const __m512 p = _mm512_set1_ps(scores[(h0 + j) * padded + t]);
          for (int v = 0; v < 4; ++v) sums[j][v] = _mm512_fmadd_ps(p, r[v], sums[j][v]);
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc + (h0 + j) * kDim + c + 16 * v, sums[j][v]);
      }
    }
    h0 += n;
  }
  write_heads(L, acc, total, head0, count, kDim, out);
}
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr int64_t kTile8 = 8;  // keys an AVX2 score tile takes: one vector of scores

// Eight vectors -> one: lane i is the sum of v[i]'s lanes (six horizontal adds and a swap of halves, where eight
// separate reductions cost ~40 instructions).
inline __m256 sum8(const __m256* v) {
  // per 128-bit half: [v0's, v1's, v2's, v3's lanes in that half summed], and v4 .. v7's
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// 8 float16 values widened to float32 (F16C).
inline __m256 widen8(const at::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

inline float max8(__m256 v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

// `attend` for a single query head (the one-stream split, heads_per_item 1) of float32 queries over a float16
// cache (a float32 engine's, `config.pick_kv_dtype`), kDim a multiple of 64, with AVX2, F16C and FMA (AMD EPYCs
// without AVX-512). Each row is widened in registers as it is used: the generic loop's float32 scratch copy of
// every row (written, then read again) is gone. Scores: 8 keys a tile, their dot products reduced together.
// Values: 64 of a row at a time, summed in 8 registers. SmolLM2's shape, one sequence, AVX2
// code on an AMD EPYC Zen 4, 2 threads, alternating calls: 192 keys 15 against 31 us hot, 52 against 60 us with
// the caches flushed; 1,024 keys 32 against 101 and 109 against 165 us. Items of several query heads (many
// sequences) keep the generic loop: forms of this one for them ran 5-25% slower once the rows came from memory.
template <int kDim>
void attend_f16(const Layout& L, const float* query, const at::Half* keys, const at::Half* values,
                const int64_t* table, int64_t num_keys, int64_t head0, int64_t count, float scale, float* out,
                std::vector<float>& scratch, std::vector<int64_t>& token_offsets) {
  static_assert(kDim % 64 == 0, "whole 64-value chunks");
  TORCH_CHECK(count == 1, "attend_f16: one query head an item");
  const int64_t padded = fill_token_offsets(L, table, num_keys, kTile8, token_offsets);
  scratch.resize(2 * kDim + padded);
  float* q = scratch.data();    // [kDim] the scaled query
  float* acc = q + kDim;        // [kDim] the weighted sum of values
  float* scores = acc + kDim;   // [padded]
  const int64_t kv_head = head0 / L.group;
  const at::Half* head_keys = keys + kv_head * L.kv_head;
  const at::Half* head_values = values + kv_head * L.kv_head;
  for (int64_t d = 0; d < kDim; ++d) q[d] = query[head0 * L.q_head + d] * scale;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 max_v = none;
  for (int64_t t = 0; t < std::min(num_keys, kTile8); ++t) prefetch_row(head_keys + token_offsets[t], kDim);
  for (int64_t t0 = 0; t0 < padded; t0 += kTile8) {
    for (int64_t t = t0 + kTile8; t < std::min(num_keys, t0 + 2 * kTile8); ++t) {  // the next tile's keys
      prefetch_row(head_keys + token_offsets[t], kDim);
    }
    __m256 dot[kTile8];
    for (int64_t i = 0; i < kTile8; ++i) dot[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < kDim; c += 8) {
      const __m256 qc = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
      for (int64_t i = 0; i < kTile8; ++i) {
        dot[i] = _mm256_fmadd_ps(qc, widen8(head_keys + token_offsets[t0 + i] + c), dot[i]);
      }
    }
    const __m256 tile = sum8(dot);
    _mm256_storeu_ps(scores + t0, tile);
    // lanes past the last key (a tail tile's) are no keys
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(num_keys - t0), lane));
    max_v = _mm256_max_ps(max_v, _mm256_blendv_ps(none, tile, valid));
  }
  const float total = exp_and_sum(scores, num_keys, max8(max_v));
  for (int64_t c = 0; c < kDim; c += 64) {
    __m256 sums[8];
    for (int v = 0; v < 8; ++v) sums[v] = _mm256_setzero_ps();
    for (int64_t t = 0; t < num_keys; ++t) {
      const at::Half* row = head_values + token_offsets[t] + c;
      if (t + kValuesAhead < num_keys) prefetch_row(head_values + token_offsets[t + kValuesAhead] + c, 64);
      const __m256 weight = _mm256_broadcast_ss(scores + t);
      for (int v = 0; v < 8; ++v) sums[v] = _mm256_fmadd_ps(weight, widen8(row + 8 * v), sums[v]);
    }
    for (int v = 0; v < 8; ++v) _mm256_storeu_ps(acc + c + 8 * v, sums[v]);
  }
  write_heads(L, acc, &total, head0, 1, kDim, out);
}
#endif

// The attention of one work item of `heads_per_item` query heads: `attend`, or its AVX512-BF16 or single-head
// F16C form where it applies.
template <typename Q, typename KV>
using AttendFn = void (*)(const Layout&, const Q*, const KV*, const KV*, const int64_t*, int64_t, int64_t, int64_t,
                          float, Q*, std::vector<float>&, std::vector<int64_t>&);

template <typename Q, typename KV>
AttendFn<Q, KV> pick_attend(int64_t head_dim, int64_t heads_per_item) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, at::BFloat16> && std::is_same_v<KV, at::BFloat16>) {
    if (head_dim == 64) return attend_bf16<64>;
    if (head_dim == 128) return attend_bf16<128>;
  }
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if constexpr (std::is_same_v<Q, float> && std::is_same_v<KV, at::Half>) {
    if (heads_per_item == 1 && head_dim == 64) return attend_f16<64>;
    if (heads_per_item == 1 && head_dim == 128) return attend_f16<128>;
  }
#endif
  return head_dim == 64 ? attend<Q, KV, 64> : head_dim == 128 ? attend<Q, KV, 128> : attend<Q, KV, 0>;
}

template <typename Q, typename KV>
void run(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  Layout L{};
  L.num_seqs = query.size(0);
  L.num_heads = query.size(1);
  L.head_dim = query.size(2);
  L.num_kv_heads = key_pool.size(2);
  L.block_size = key_pool.size(1);
  L.group = L.num_heads / L.num_kv_heads;
  L.q_seq = query.stride(0);
  L.q_head = query.stride(1);
  L.out_seq = out.stride(0);
  L.out_head = out.stride(1);
  L.kv_block = key_pool.stride(0);
  L.kv_token = key_pool.stride(1);
  L.kv_head = key_pool.stride(2);
  L.table_row = block_tables.stride(0);
  const Q* q = query.data_ptr<Q>();
  const KV* k = key_pool.data_ptr<KV>();
  const KV* v = value_pool.data_ptr<KV>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  Q* o = out.data_ptr<Q>();
  // Work items are whole sequences (every row read once, each block in order), else with too few sequences to
  // keep the threads busy (sequence, KV head) pairs, else (one stream) single query heads.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = L.num_seqs >= 2 * threads                      ? L.num_heads
                                 : L.num_seqs * L.num_kv_heads >= 2 * threads ? L.group
                                                                               : 1;
  const int64_t items_per_seq = L.num_heads / heads_per_item;
  const AttendFn<Q, KV> attend_one = pick_attend<Q, KV>(L.head_dim, heads_per_item);
  at::parallel_for(0, L.num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<int64_t> token_offsets;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq, head0 = (item % items_per_seq) * heads_per_item;
      attend_one(L, q + seq * L.q_seq, k, v, tables + seq * L.table_row, lens[seq], head0, heads_per_item,
                 static_cast<float>(scale), o + seq * L.out_seq, scratch, token_offsets);
    }
  });
}

// Every key a sequence reads must lie in the pool: a wrong length or block id is an error, not a read of memory
// outside it (a few thousand integer compares a call).
void check_indices(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_blocks,
                   int64_t block_size) {
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t seq = 0; seq < block_tables.size(0); ++seq) {
    TORCH_CHECK(lens[seq] >= 1 && lens[seq] <= width * block_size, "context length ", lens[seq], " of sequence ",
                seq, " outside [1, ", width * block_size, "]");
    const int64_t* table = tables + seq * block_tables.stride(0);
    for (int64_t b = 0; b < (lens[seq] + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id ", table[b], " outside the pool of ",
                  num_blocks);
    }
  }
}

}  // namespace

namespace tokenspool {

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_pool.dim() == 4 && value_pool.dim() == 4, "query [B, H, D], pools 4-d");
  TORCH_CHECK(query.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(query.stride(2) == 1 && key_pool.stride(3) == 1 && value_pool.stride(3) == 1, "unit last stride");
  TORCH_CHECK(key_pool.strides() == value_pool.strides() && key_pool.sizes() == value_pool.sizes(), "K/V pools");
  TORCH_CHECK(query.size(2) == key_pool.size(3) && query.size(1) % key_pool.size(2) == 0, "head shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && context_lens.size(0) == query.size(0), "one row a sequence");
  TORCH_CHECK(block_tables.stride(1) == 1 && context_lens.is_contiguous(), "contiguous indices");
  TORCH_CHECK(key_pool.scalar_type() == value_pool.scalar_type(), "K/V dtypes");
  check_indices(block_tables, context_lens, key_pool.size(0), key_pool.size(1));
  auto out = at::empty(query.sizes(), query.options());
  // The query is in the engine's compute dtype, the cache in it too, or in 16 bits under float32
  // (config.pick_kv_dtype): rows are widened to float32 as they are read either way.
  const auto q_type = query.scalar_type(), kv_type = key_pool.scalar_type();
  if (q_type == at::kFloat && kv_type == at::kFloat) {
    run<float, float>(query, key_pool, value_pool, block_tables, context_lens, scale, out);
  } else if (q_type == at::kFloat && kv_type == at::kHalf) {
    run<float, at::Half>(query, key_pool, value_pool, block_tables, context_lens, scale, out);
  } else if (q_type == at::kFloat && kv_type == at::kBFloat16) {
    run<float, at::BFloat16>(query, key_pool, value_pool, block_tables, context_lens, scale, out);
  } else if (q_type == at::kBFloat16 && kv_type == at::kBFloat16) {
    run<at::BFloat16, at::BFloat16>(query, key_pool, value_pool, block_tables, context_lens, scale, out);
  } else if (q_type == at::kHalf && kv_type == at::kHalf) {
    run<at::Half, at::Half>(query, key_pool, value_pool, block_tables, context_lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: unsupported dtypes ", q_type, " and ", kv_type);
  }
  return out;
}

}  // namespace tokenspool

TORCH_LIBRARY(tokenspool, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) { m.impl("paged_decode_attention", &tokenspool::paged_decode_attention); }
