// Paged decode and prefill attention on the CPU.  One work item is one (query token, head):
// it walks the sequence's blocks once with an online softmax in fp32, so no buffer grows
// with the context.  at::parallel_for spreads the items over the cores.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../checks.h"
#include "../ops.h"

namespace cbatch {
namespace {

struct CacheView {
  int64_t num_blocks, block_size, num_heads, head_dim;
};

// q · k over D elements.  kLanes independent partial sums let the compiler vectorize the
// reduction without reassociating floating point behind our back (about 1.4x on a 2-core EPYC).
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  constexpr int kLanes = 16;
  float partial[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) partial[j] += q[d + j] * static_cast<float>(k[d + j]);
  }
  float sum = 0.f;
  for (; d < D; ++d) sum += q[d] * static_cast<float>(k[d]);
  for (int j = 0; j < kLanes; ++j) sum += partial[j];
  return sum;
}

// out[0:D] = softmax(q · K[0:num_keys]) V[0:num_keys] for one head `h` of one sequence whose
// blocks are `table`.  q is fp32 and already scaled; acc [D] and scores [block_size] are
// scratch owned by the caller.
template <typename T>
void attend(const float* q, const T* key_cache, const T* value_cache, const int32_t* table,
            const CacheView& c, int64_t h, int64_t num_keys, float* acc, float* scores, T* out) {
  const int64_t D = c.head_dim, row = c.num_heads * D;  // row: one token's [H, D]
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  std::fill(acc, acc + D, 0.f);
  for (int64_t start = 0; start < num_keys; start += c.block_size) {
    const int64_t block = table[start / c.block_size];
    const int64_t n = std::min(c.block_size, num_keys - start);
    const T* k = key_cache + block * c.block_size * row + h * D;
    const T* v = value_cache + block * c.block_size * row + h * D;
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      scores[i] = dot(q, k + i * row, D);
      block_max = std::max(block_max, scores[i]);
    }
    const float new_m = std::max(m, block_max);
    const float correction = std::exp(m - new_m);  // 0 on the first block (m = -inf)
    l *= correction;
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
    for (int64_t i = 0; i < n; ++i) {
      const float p = std::exp(scores[i] - new_m);
      l += p;
      for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(v[i * row + d]);
    }
    m = new_m;
  }
  const float inv_l = 1.f / l;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] * inv_l);
}

// Host-side bounds checks: on the CPU the lengths and tables are already in host memory.
void check_bounds(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const CacheView& c) {
  const int64_t S = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(S > 0, "empty batch: seq_lens has no sequences");
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK_VALUE(lens[s] >= 1 && lens[s] <= max_blocks * c.block_size, "seq_lens[", s,
                      "] = ", lens[s], " is outside [1, ", max_blocks * c.block_size,
                      "] (block_tables holds ", max_blocks, " blocks of ", c.block_size, ")");
    const int64_t used = (lens[s] + c.block_size - 1) / c.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t id = tables[s * max_blocks + b];
      TORCH_CHECK_VALUE(id >= 0 && id < c.num_blocks, "block_tables[", s, ", ", b, "] = ", id,
                        " is outside [0, ", c.num_blocks, ")");
    }
  }
}

CacheView view_of(const at::Tensor& key_cache) {
  return {key_cache.size(0), key_cache.size(1), key_cache.size(2), key_cache.size(3)};
}

// Runs attend() for every (row, head) with row r of query belonging to sequence
// seq_of_row[r] and attending to its first num_keys[r] positions.
at::Tensor run(const at::Tensor& query, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const at::Tensor& block_tables,
               const std::vector<int64_t>& seq_of_row, const std::vector<int64_t>& num_keys,
               double scale) {
  const CacheView c = view_of(key_cache);
  const int64_t rows = query.size(0), H = c.num_heads, D = c.head_dim;
  at::Tensor out = at::empty({rows, H, D}, query.options());
  const int64_t max_blocks = block_tables.size(1), q_stride = query.stride(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "attend", [&] {
    const scalar_t* q_ptr = query.data_ptr<scalar_t>();
    const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(D), acc(D), scores(c.block_size);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / H, h = item % H;
        const scalar_t* q_row = q_ptr + r * q_stride + h * D;
        for (int64_t d = 0; d < D; ++d) q[d] = static_cast<float>(q_row[d]) * scale;
        attend(q.data(), k_ptr, v_ptr, tables + seq_of_row[r] * max_blocks, c, h,
               num_keys[r], acc.data(), scores.data(), out_ptr + (r * H + h) * D);
      }
    });
  });
  return out;
}

}  // namespace

at::Tensor paged_decode_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache,
                                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                      double scale) {
  check_attention_args(query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK_VALUE(query.size(0) == seq_lens.size(0), "decode takes one query token per "
                    "sequence: query has ", query.size(0), " rows for ", seq_lens.size(0),
                    " sequences");
  check_bounds(block_tables, seq_lens, view_of(key_cache));
  const int64_t S = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> seq_of_row(S), num_keys(S);
  for (int64_t s = 0; s < S; ++s) {
    seq_of_row[s] = s;
    num_keys[s] = lens[s];
  }
  return run(query, key_cache, value_cache, block_tables, seq_of_row, num_keys, scale);
}

at::Tensor paged_prefill_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache,
                                       const at::Tensor& block_tables,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                       double scale) {
  check_attention_args(query, key_cache, value_cache, block_tables, seq_lens);
  CBATCH_CHECK_DTYPE(cu_seqlens_q, at::kInt);
  CBATCH_CHECK_CONTIGUOUS(cu_seqlens_q);
  CBATCH_CHECK_DEVICE(cu_seqlens_q, query.device());
  const int64_t S = seq_lens.size(0), T = query.size(0);
  TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == S + 1,
                    "cu_seqlens_q must be [S + 1 = ", S + 1, "], got ", cu_seqlens_q.sizes());
  check_bounds(block_tables, seq_lens, view_of(key_cache));
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(cu[0] == 0 && cu[S] == T, "cu_seqlens_q must run from 0 to T = ", T,
                    ", got ", cu[0], " … ", cu[S]);
  std::vector<int64_t> seq_of_row(T), num_keys(T);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = cu[s + 1] - cu[s];
    TORCH_CHECK_VALUE(n >= 0 && n <= lens[s], "sequence ", s, " has ", n,
                      " new tokens but seq_lens[", s, "] = ", lens[s]);
    for (int64_t i = 0; i < n; ++i) {
      seq_of_row[cu[s] + i] = s;
      num_keys[cu[s] + i] = lens[s] - n + i + 1;  // position + 1: causal over the chunk
    }
  }
  return run(query, key_cache, value_cache, block_tables, seq_of_row, num_keys, scale);
}

}  // namespace cbatch
