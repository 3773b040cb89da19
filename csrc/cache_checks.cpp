#include "checks.h"
#include "ops.h"

namespace cbatch {

void check_write_kv_cache_args(const at::Tensor& key, const at::Tensor& value,
                               const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& slot_mapping) {
  CBATCH_CHECK_DIM(key, 3);
  CBATCH_CHECK_DIM(key_cache, 4);
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), "value shape ", value.sizes(),
                    " must equal key shape ", key.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache shape ",
                    value_cache.sizes(), " must equal key_cache shape ", key_cache.sizes());
  TORCH_CHECK_VALUE(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
                    "key_cache heads/head_dim ", key_cache.sizes(), " do not match key ",
                    key.sizes());
  CBATCH_CHECK_DTYPE(value, key.scalar_type());
  CBATCH_CHECK_DTYPE(key_cache, key.scalar_type());
  CBATCH_CHECK_DTYPE(value_cache, key.scalar_type());
  CBATCH_CHECK_DTYPE(slot_mapping, at::kLong);
  CBATCH_CHECK_DIM(slot_mapping, 1);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), "slot_mapping has ",
                    slot_mapping.size(0), " entries for ", key.size(0), " tokens");
  CBATCH_CHECK_CONTIGUOUS(key_cache);
  CBATCH_CHECK_CONTIGUOUS(value_cache);
  CBATCH_CHECK_CONTIGUOUS(slot_mapping);
  // Each token's [H, D] row must be dense (a view of a fused qkv projection is fine).
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK_VALUE(t->stride(2) == 1 && t->stride(1) == t->size(2),
                      "key/value must have dense [H, D] rows per token, got strides ",
                      t->strides());
  }
  CBATCH_CHECK_DEVICE(value, key.device());
  CBATCH_CHECK_DEVICE(key_cache, key.device());
  CBATCH_CHECK_DEVICE(value_cache, key.device());
  CBATCH_CHECK_DEVICE(slot_mapping, key.device());
}

}  // namespace cbatch
