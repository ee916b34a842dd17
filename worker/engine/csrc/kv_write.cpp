// Storing a step's new keys and values in the paged cache: one call a layer instead of two index_copy_.
//
//   kv_write_(key_cache [S, KVH, D], value_cache [S, KVH, D], slots [T] int64, key [T, KVH, D], value [T, KVH, D])
//       -> ()   in place: key_cache[slots[t]] = key[t], value_cache[slots[t]] = value[t]
//
// The caches are one layer's pools viewed as slots (kv_cache.py), contiguous; key and value are views into the
// fused QKV projection's output, so their rows are strided but each row's [KVH, D] is contiguous: a row is one
// memcpy. One dtype throughout (the cache's; kv_cache.py converts otherwise). A copy, so bit for bit what
// index_copy_ stores. Slots outside the cache are an error, not a write beyond it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "operators.h"

namespace {

constexpr int64_t kRowsPerTask = 256;  // a decode step writes a row or a few: one thread; a long prefill splits

void check_layout(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slots,
                  const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.device().is_cpu(),
              "key_cache, value_cache: contiguous [S, KVH, D] on the CPU, alike");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == key_cache.size(1) &&
                  key.size(2) == key_cache.size(2),
              "key, value: [T, KVH, D] with the caches' heads");
  const auto type = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == type && key.scalar_type() == type && value.scalar_type() == type,
              "key, value and the caches: one dtype");
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK(rows->device().is_cpu() && rows->stride(2) == 1 && rows->stride(1) == rows->size(2),
                "key, value: each row's [KVH, D] contiguous");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == key.size(0),
              "slots: [T] int64, contiguous");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < key_cache.size(0), "slot ", slot[t], " outside the cache of ",
                key_cache.size(0));
  }
}

}  // namespace

namespace tokenspool {

void kv_write_(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slots, const at::Tensor& key,
               const at::Tensor& value) {
  check_layout(key_cache, value_cache, slots, key, value);
  const int64_t item = key.element_size(), row_bytes = key.size(1) * key.size(2) * item;
  const int64_t key_stride = key.stride(0) * item, value_stride = value.stride(0) * item;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const char* new_keys = static_cast<const char*>(key.data_ptr());
  const char* new_values = static_cast<const char*>(value.data_ptr());
  char* keys = static_cast<char*>(key_cache.data_ptr());
  char* values = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, slots.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(keys + slot[t] * row_bytes, new_keys + t * key_stride, row_bytes);
      std::memcpy(values + slot[t] * row_bytes, new_values + t * value_stride, row_bytes);
    }
  });
}

}  // namespace tokenspool

TORCH_LIBRARY_FRAGMENT(tokenspool, m) {
  m.def("kv_write_(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(tokenspool, CPU, m) { m.impl("kv_write_", &tokenspool::kv_write_); }
