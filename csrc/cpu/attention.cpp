// Paged decode and prefill attention on the CPU.  One work item is a tile of up to kTileRows
// consecutive query tokens of one sequence and one head: it walks the sequence's blocks once,
// each K/V block serving every row of the tile while it is in cache, with an online softmax
// per row in fp32 (no buffer grows with the context).  A decode token is a tile of one row.
// at::parallel_for spreads the items over the cores.
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

constexpr int64_t kTileRows = 16;

// Rows [row, row + num_rows) of the query belong to sequence `seq` and sit at positions
// first_pos, first_pos + 1, ...; row r attends to positions [0, first_pos + r].
struct Tile {
  int64_t seq, row, num_rows, first_pos;
};

// Per-thread scratch for one tile.
struct Scratch {
  std::vector<float> q, acc, m, l, scores;
  Scratch(int64_t D, int64_t block_size)
      : q(kTileRows * D), acc(kTileRows * D), m(kTileRows), l(kTileRows), scores(block_size) {}
};

// out rows of `tile` for head h = softmax(q K^T) V over each row's visible positions.
template <typename T>
void attend_tile(const T* query, int64_t query_stride, const T* key_cache, const T* value_cache,
                 const int32_t* table, const CacheView& c, int64_t h, const Tile& tile,
                 float scale, Scratch& sc, T* out) {
  const int64_t D = c.head_dim, row = c.num_heads * D;  // row: one token's [H, D]
  const int64_t R = tile.num_rows;
  for (int64_t r = 0; r < R; ++r) {
    const T* q_row = query + (tile.row + r) * query_stride + h * D;
    for (int64_t d = 0; d < D; ++d) sc.q[r * D + d] = static_cast<float>(q_row[d]) * scale;
    sc.m[r] = -std::numeric_limits<float>::infinity();
    sc.l[r] = 0.f;
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + R * D, 0.f);
  const int64_t num_keys = tile.first_pos + R;  // the last row sees this many positions
  for (int64_t start = 0; start < num_keys; start += c.block_size) {
    const int64_t block = table[start / c.block_size];
    const T* k = key_cache + block * c.block_size * row + h * D;
    const T* v = value_cache + block * c.block_size * row + h * D;
    for (int64_t r = 0; r < R; ++r) {
      // keys of this block that row r may see (causal within the chunk)
      const int64_t n = std::min(c.block_size, tile.first_pos + r + 1 - start);
      if (n <= 0) continue;
      const float* q = sc.q.data() + r * D;
      float* acc = sc.acc.data() + r * D;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        sc.scores[i] = dot(q, k + i * row, D);
        block_max = std::max(block_max, sc.scores[i]);
      }
      const float new_m = std::max(sc.m[r], block_max);
      const float correction = std::exp(sc.m[r] - new_m);  // 0 on the first block (m = -inf)
      float l = sc.l[r] * correction;
      for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
      for (int64_t i = 0; i < n; ++i) {
        const float p = std::exp(sc.scores[i] - new_m);
        l += p;
        for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(v[i * row + d]);
      }
      sc.m[r] = new_m;
      sc.l[r] = l;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv_l = 1.f / sc.l[r];
    T* o = out + ((tile.row + r) * c.num_heads + h) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(sc.acc[r * D + d] * inv_l);
  }
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

// Runs attend_tile() for every (tile, head).
at::Tensor run(const at::Tensor& query, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const at::Tensor& block_tables,
               const std::vector<Tile>& tiles, double scale) {
  const CacheView c = view_of(key_cache);
  const int64_t H = c.num_heads;
  at::Tensor out = at::empty({query.size(0), H, c.head_dim}, query.options());
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "attend", [&] {
    const scalar_t* q_ptr = query.data_ptr<scalar_t>();
    const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(c.head_dim, c.block_size);
      for (int64_t item = begin; item < end; ++item) {
        const Tile& tile = tiles[item / H];
        attend_tile(q_ptr, query.stride(0), k_ptr, v_ptr, tables + tile.seq * max_blocks, c,
                    item % H, tile, static_cast<float>(scale), scratch, out_ptr);
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
  std::vector<Tile> tiles(S);
  for (int64_t s = 0; s < S; ++s) tiles[s] = {s, s, 1, lens[s] - 1};
  return run(query, key_cache, value_cache, block_tables, tiles, scale);
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
  std::vector<Tile> tiles;
  tiles.reserve(T / kTileRows + S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = cu[s + 1] - cu[s];
    TORCH_CHECK_VALUE(n >= 0 && n <= lens[s], "sequence ", s, " has ", n,
                      " new tokens but seq_lens[", s, "] = ", lens[s]);
    for (int64_t i = 0; i < n; i += kTileRows) {  // chunk rows sit at the sequence's end
      tiles.push_back({s, cu[s] + i, std::min(kTileRows, n - i), lens[s] - n + i});
    }
  }
  return run(query, key_cache, value_cache, block_tables, tiles, scale);
}

}  // namespace cbatch
