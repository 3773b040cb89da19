// Shape/dtype checks shared by the attention kernels' entry points (CPU and CUDA).
#include "checks.h"
#include "ops.h"

namespace cbatch {

void check_attention_args(const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens) {
  CBATCH_CHECK_DIM(query, 3);
  CBATCH_CHECK_DIM(key_cache, 4);
  CBATCH_CHECK_DIM(block_tables, 2);
  CBATCH_CHECK_DIM(seq_lens, 1);
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache shape ",
                    value_cache.sizes(), " must equal key_cache shape ", key_cache.sizes());
  // Grouped-query attention: each of the cache's H_kv heads serves H / H_kv query heads.
  TORCH_CHECK_VALUE(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0 &&
                        query.size(2) == key_cache.size(3),
                    "query ", query.sizes(), " does not match the cache's heads/head_dim ",
                    key_cache.sizes(), " (query heads must be a multiple of the cache's heads)");
  TORCH_CHECK_VALUE(block_tables.size(0) == seq_lens.size(0), "block_tables has ",
                    block_tables.size(0), " rows for ", seq_lens.size(0), " sequences");
  const auto dtype = query.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "query must be float32, float16 or bfloat16, got ", dtype);
  CBATCH_CHECK_DTYPE(key_cache, dtype);
  CBATCH_CHECK_DTYPE(value_cache, dtype);
  CBATCH_CHECK_DTYPE(block_tables, at::kInt);
  CBATCH_CHECK_DTYPE(seq_lens, at::kInt);
  CBATCH_CHECK_CONTIGUOUS(key_cache);
  CBATCH_CHECK_CONTIGUOUS(value_cache);
  CBATCH_CHECK_CONTIGUOUS(block_tables);
  CBATCH_CHECK_CONTIGUOUS(seq_lens);
  TORCH_CHECK_VALUE(query.stride(2) == 1 && query.stride(1) == query.size(2),
                    "query must have dense [H, D] rows per token, got strides ", query.strides());
  for (const at::Tensor* t : {&key_cache, &value_cache, &block_tables, &seq_lens}) {
    CBATCH_CHECK_DEVICE(*t, query.device());
  }
}

}  // namespace cbatch
