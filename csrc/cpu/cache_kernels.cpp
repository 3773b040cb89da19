// write_kv_cache on the CPU: one memcpy of a token's [H, D] row per tensor.
#include <ATen/Parallel.h>

#include <cstring>

#include "../checks.h"
#include "../ops.h"
#include "cpu_options.h"

namespace cbatch {

void write_kv_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_write_kv_cache_args(key, value, key_cache, value_cache, slot_mapping);
  const int64_t num_tokens = key.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] >= -1 && slots[t] < num_slots, "slot_mapping[", t, "] = ",
                      slots[t], " is outside [-1, ", num_slots, ")");
  }
  const auto* key_src = static_cast<const char*>(key.data_ptr());
  const auto* value_src = static_cast<const char*>(value.data_ptr());
  auto* key_dst = static_cast<char*>(key_cache.data_ptr());
  auto* value_dst = static_cast<char*>(value_cache.data_ptr());
  const int64_t key_stride = key.stride(0) * key.element_size();
  const int64_t value_stride = value.stride(0) * value.element_size();
  count_path(CpuPath::kWriteKvCacheCpu);
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      std::memcpy(key_dst + slot * row_bytes, key_src + t * key_stride, row_bytes);
      std::memcpy(value_dst + slot * row_bytes, value_src + t * value_stride, row_bytes);
    }
  });
}

}  // namespace cbatch
