// Paged decode and prefill attention on the CPU.  One work item is a tile of up to kTileRows
// consecutive query tokens of one sequence and a group of consecutive query heads.  Query head
// h reads KV head h / (H / H_kv) (grouped-query attention).  The item walks the sequence's
// blocks once; a block's rows for the item's KV heads are contiguous in the cache, so the walk
// streams memory, and each K/V block serves every row of the tile and every query head of the
// item that reads it while it is in cache (on x86, a chunk of 16 keys is transposed once for
// all of a prompt tile's rows: attention_step.h).  Every row keeps an online softmax in fp32
// (no buffer grows with the context).  A decode token is a tile of one row.  Items are handed
// out longest first to whichever thread is free.  The step comes in four forms:
// attention_step.h's one body on 16 lanes (AVX-512) and on 8 (AVX2), AVX512-BF16's, and the
// portable one (below, which widens fp16/bf16 blocks to fp32 once per block).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "cpu_options.h"  // step_for reads the options; the path counters
#include "avx2.h"    // the helpers of attention_step.h's AVX2 step
#include "avx512.h"  // and of its AVX-512 one (x86.h: CBATCH_X86, the feature checks)

namespace cbatch {
namespace {

struct CacheView {
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
};

// ---- fp16 / bf16 -> fp32 ------------------------------------------------------------------

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {  // bf16 is the top half of an fp32
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef CBATCH_X86
// The F16C instructions convert 8 halves per instruction; chosen at run time, since the
// extension is compiled for the baseline x86-64 instruction set.
__attribute__((target("avx,f16c"))) void widen_f16c(const c10::Half* src, float* dst,
                                                     int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

// dst[0, n) = src[0, n) in fp32.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#ifdef CBATCH_X86
  if constexpr (std::is_same_v<T, c10::Half>) {
    if (cpu_has_f16c()) return widen_f16c(src, dst, n);
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// q · k over D elements.  kLanes independent partial sums let the compiler vectorize the
// reduction without reassociating floating point behind our back.
inline float dot(const float* q, const float* k, int64_t D) {
  constexpr int kLanes = 16;
  float partial[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) partial[j] += q[d + j] * k[d + j];
  }
  float sum = 0.f;
  for (; d < D; ++d) sum += q[d] * k[d];
  for (int j = 0; j < kLanes; ++j) sum += partial[j];
  return sum;
}

// acc[0, D) += sum over i < n of p[i] * v[i * stride, i * stride + D).  Chunks of kLanes
// columns stay in registers across the n rows (acc is loaded and stored once per call).
inline void accumulate(const float* p, const float* v, int64_t stride, int64_t n, int64_t D,
                       float* acc) {
  constexpr int kLanes = 16;
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    float a[kLanes];
    for (int j = 0; j < kLanes; ++j) a[j] = acc[d + j];
    for (int64_t i = 0; i < n; ++i) {
      for (int j = 0; j < kLanes; ++j) a[j] += p[i] * v[i * stride + d + j];
    }
    for (int j = 0; j < kLanes; ++j) acc[d + j] = a[j];
  }
  for (; d < D; ++d) {
    for (int64_t i = 0; i < n; ++i) acc[d] += p[i] * v[i * stride + d];
  }
}

constexpr int64_t kTileRows = 16;

// One query row's state in the online softmax (attention_step.h's online_softmax_rows): its
// query (scaled, fp32), running max m, running sum l and unnormalized output acc[D].
struct StepRow {
  const float* q;
  float *m, *l, *acc;
};

// Keys per softmax update of the x86 steps: each cache block's keys go through
// online_softmax_row (as they lie) or online_softmax_rows (transposed: transpose_keys)
// kChunkKeys at a time.
constexpr int64_t kChunkKeys = 16;

// Rows [row, row + num_rows) of the query belong to sequence `seq` and sit at positions
// first_pos, first_pos + 1, ...; row r attends to positions [0, first_pos + r].
struct Tile {
  int64_t seq, row, num_rows, first_pos;
};

// One unit of work: a tile and the query heads [head_begin, head_end).
struct Item {
  int64_t tile, head_begin, head_end;
};

// Per-thread scratch, laid out [query head of the item, row of the tile, ...], for the
// call's largest item and tile (a decode call's tiles have one row: 16x less to allocate).
struct Scratch {
  std::vector<float> q, acc, m, l, scores, k, v, kt;
  int64_t transposed_rows = 0;  // row steps on transposed keys (counted once per call)
  Scratch(int64_t max_heads, int64_t max_rows, int64_t D, int64_t block_size)
      : q(max_heads * max_rows * D),
        acc(max_heads * max_rows * D),
        m(max_heads * max_rows),
        l(max_heads * max_rows),
        scores(block_size),
        k(block_size * D),
        v(block_size * D),
        kt(kChunkKeys * D) {}
};

// Adds keys k[i * stride] and values v[i * stride], i < n, to one query row's online softmax
// (running max m, running sum l, unnormalized output acc[D]).
inline void online_softmax_step(const float* q, const float* k, const float* v,
                                int64_t stride, int64_t n, int64_t D, float* scores, float& m,
                                float& l, float* acc) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = dot(q, k + i * stride, D);
    block_max = std::max(block_max, scores[i]);
  }
  const float new_m = std::max(m, block_max);
  const float correction = std::exp(m - new_m);  // 0 on the first block (m = -inf)
  l *= correction;
  for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = std::exp(scores[i] - new_m);
    l += scores[i];
  }
  accumulate(scores, v, stride, n, D, acc);
  m = new_m;
}

}  // namespace

#ifdef CBATCH_X86
// ---- AVX-512 and AVX2: attention_step.h's step on 16 and on 8 lanes ------------------------
namespace avx512 {
namespace {

#define CBATCH_STEP_TARGET CBATCH_AVX512
#include "attention_step.h"
#undef CBATCH_STEP_TARGET

// accumulate for bf16 values, kChunks chunks of 32 columns in the pair layout: a 32-column
// load holds columns 2j and 2j + 1 in the low and high halves of lane j, so a 16-bit shift
// gives the even columns as fp32 and an `and` the odd ones, one instruction per 16 columns
// where widening takes two.  acc keeps each chunk as its 16 even columns, then its 16 odd
// ones (pair_index; the caller's last store puts them back).  Every column adds its keys in
// the same order with the same FMAs as accumulate's: the same bits.
template <int kChunks>
CBATCH_AVX512 CBATCH_INLINE void accumulate_chunks(const float* p, const c10::BFloat16* v,
                                                   int64_t stride, int64_t n, float correction,
                                                   float* acc) {
  __m512 a[kChunks][2];  // [chunk][even / odd columns]
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
#pragma GCC unroll 4
  for (int c = 0; c < kChunks; ++c) {
    for (int h = 0; h < 2; ++h) {
      a[c][h] = _mm512_mul_ps(_mm512_loadu_ps(acc + 32 * c + 16 * h),
                              _mm512_set1_ps(correction));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const __m512 p_i = _mm512_set1_ps(p[i]);
#pragma GCC unroll 4
    for (int c = 0; c < kChunks; ++c) {
      const __m512i w = _mm512_loadu_si512(v + i * stride + 32 * c);
      a[c][0] = _mm512_fmadd_ps(p_i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), a[c][0]);
      a[c][1] = _mm512_fmadd_ps(p_i, _mm512_castsi512_ps(_mm512_and_si512(w, high)), a[c][1]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < kChunks; ++c) {
    _mm512_storeu_ps(acc + 32 * c, a[c][0]);
    _mm512_storeu_ps(acc + 32 * c + 16, a[c][1]);
  }
}

// accumulate_columns for bf16 values in the pair layout: 128 columns at a time, then the last
// D % 128 (D % 16 == 0): whole chunks of 32 in pairs, a last 16 as they are (pair_index).
CBATCH_AVX512 CBATCH_INLINE void accumulate_pairs(const float* p, const c10::BFloat16* v,
                                                  int64_t stride, int64_t n, int64_t D,
                                                  float correction, float* acc) {
  int64_t d = 0;
  for (; d + 128 <= D; d += 128) accumulate_chunks<4>(p, v + d, stride, n, correction, acc + d);
  switch ((D - d) / 32) {
    case 3: accumulate_chunks<3>(p, v + d, stride, n, correction, acc + d); break;
    case 2: accumulate_chunks<2>(p, v + d, stride, n, correction, acc + d); break;
    case 1: accumulate_chunks<1>(p, v + d, stride, n, correction, acc + d); break;
    default: break;
  }
  d += (D - d) / 32 * 32;
  if (d < D) accumulate<1>(p, v + d, stride, n, correction, acc + d);
}

// The same step for bf16 q, K and V on AVX512-BF16: q K^T on vdpbf16ps, 32 columns of the
// query row as it is (bf16, unscaled) and of each key, read in place, at a time (no widening:
// a third of the instructions of the fp32 dot products); the sums scaled after.  The values
// still go through fp32 FMAs.  Decode and prefill run this same step on the same rows, so
// their outputs stay bitwise equal.
CBATCH_AVX512_DOT void online_softmax_step_bf16(const c10::BFloat16* q, const c10::BFloat16* k,
                                                const c10::BFloat16* v, int64_t stride,
                                                int64_t n, int64_t D, float scale, float& m,
                                                float& l, float* acc) {
  const __mmask32 tail = D % 32 ? (1u << (D % 32)) - 1 : ~0u;  // D % 16 == 0: 16 or 32 lanes
  for (int64_t i0 = 0; i0 < n; i0 += 16, k += 16 * stride, v += 16 * stride) {
    const int64_t count = std::min<int64_t>(16, n - i0);
    const c10::BFloat16* keys[16];
    key_rows(k, stride, count, keys);
    __m512 dots[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 lanes = d + 32 <= D ? ~0u : tail;
      const __m512bh qd = (__m512bh)_mm512_maskz_loadu_epi16(lanes, q + d);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        dots[i] = _mm512_dpbf16_ps(dots[i], qd,
                                   (__m512bh)_mm512_maskz_loadu_epi16(lanes, keys[i] + d));
      }
    }
    add_keys<accumulate_pairs>(_mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scale)), count, v,
                               stride, D, m, l, acc);
  }
}

}  // namespace
}  // namespace avx512

namespace avx2 {
namespace {

#define CBATCH_STEP_TARGET CBATCH_AVX2
#include "attention_step.h"
#undef CBATCH_STEP_TARGET

}  // namespace
}  // namespace avx2
#endif

namespace {

// The online-softmax step an attention call runs.
enum class Step { kGeneric, kAvx2, kAvx512, kAvx512Bf16 };

// The widest step this CPU runs for this head dim and dtype, unless set_cpu_options asked for
// "generic" (the portable step, compiled for x86-64-v3 and for the baseline).
Step step_for(int64_t head_dim, at::ScalarType dtype) {
  if (cpu_attention_generic()) return Step::kGeneric;
#ifdef CBATCH_X86
  if (dtype == at::kBFloat16 && cpu_has_avx512bf16() && head_dim % 16 == 0) {
    return Step::kAvx512Bf16;
  }
  if (cpu_has_avx512() && head_dim % 16 == 0) return Step::kAvx512;
  if (cpu_has_avx2() && head_dim % 8 == 0) return Step::kAvx2;
#endif
  (void)head_dim, (void)dtype;
  return Step::kGeneric;
}

// Asks for n rows of D elements, `stride` apart, to be brought into L2.  The blocks of a
// sequence are scattered over the pool, so the hardware prefetcher cannot guess the next one.
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t n, int64_t D) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < D; d += kLine) __builtin_prefetch(p + i * stride + d, 0, 2);
  }
}

// Where column d of a row of D sits in the pair layout: each whole chunk of 32 columns as its
// 16 even columns, then its 16 odd ones; the last D % 32 as they are.
inline int64_t pair_index(int64_t d, int64_t D) {
  if (d >= D / 32 * 32) return d;
  return d / 32 * 32 + d % 2 * 16 + d % 32 / 2;
}

#ifdef CBATCH_X86
// kt[d * kChunkKeys + i] = element d of key i as fp32, for the kChunkKeys keys k[i * stride]
// (those from n on repeat key n - 1: finite lanes, masked out of the scores) and d < D
// (D % 8 == 0): a chunk transposed for online_softmax_rows, 8 x 8 at a time in registers.
// (AVX2 also on an AVX-512 CPU: the transpose is a small part of the step.)
template <typename T>
CBATCH_AVX2 void transpose_keys(const T* k, int64_t stride, int64_t n, int64_t D, float* kt) {
  for (int64_t i0 = 0; i0 < kChunkKeys; i0 += 8) {
    const T* keys[8];
    for (int i = 0; i < 8; ++i) keys[i] = k + std::min<int64_t>(i0 + i, n - 1) * stride;
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8], t[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = avx2::load(keys[i] + d0);
      for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {  // columns c and c + 4 of four rows
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      float* out = kt + d0 * kChunkKeys + i0;
      for (int c = 0; c < 4; ++c) {  // column c of the eight rows, and column c + 4
        _mm256_storeu_ps(out + c * kChunkKeys, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
        _mm256_storeu_ps(out + (c + 4) * kChunkKeys,
                         _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
      }
    }
  }
}

// online_softmax_rows on `step`'s ISA (kAvx2 or kAvx512).
template <int kRows, typename T>
inline void step_rows(Step step, const StepRow* rows, const float* kt, const T* v,
                      int64_t stride, int64_t n, int64_t D) {
  if (step == Step::kAvx512) return avx512::online_softmax_rows<kRows>(rows, kt, v, stride, n, D);
  avx2::online_softmax_rows<kRows>(rows, kt, v, stride, n, D);
}

// online_softmax_row on `step`'s ISA (kAvx2 or kAvx512).
template <typename T>
inline void step_row(Step step, const StepRow& row, const T* k, const T* v, int64_t stride,
                     int64_t n, int64_t D) {
  if (step == Step::kAvx512) return avx512::online_softmax_row(row, k, v, stride, n, D);
  avx2::online_softmax_row(row, k, v, stride, n, D);
}

// rows[0, count) of a chunk, all seeing its n keys: the step's group (12 or 6 rows), then 4,
// 2 and 1 at a time.
template <typename T>
void step_group(Step step, const StepRow* rows, int count, const float* kt, const T* v,
                int64_t stride, int64_t n, int64_t D) {
  if (step == Step::kAvx512) {
    for (; count >= 12; rows += 12, count -= 12) step_rows<12>(step, rows, kt, v, stride, n, D);
  }
  for (; count >= 6; rows += 6, count -= 6) step_rows<6>(step, rows, kt, v, stride, n, D);
  if (count >= 4) step_rows<4>(step, rows, kt, v, stride, n, D), rows += 4, count -= 4;
  if (count >= 2) step_rows<2>(step, rows, kt, v, stride, n, D), rows += 2, count -= 2;
  if (count == 1) step_rows<1>(step, rows, kt, v, stride, n, D);
}

#endif

// out[tile rows, item heads] = softmax(q K^T) V over each row's visible positions.  `group`
// consecutive query heads share each KV head.
template <typename T>
void attend(const T* query, int64_t query_stride, const T* key_cache, const T* value_cache,
            const int32_t* table, const CacheView& c, int64_t group, const Tile& tile,
            const Item& item, float scale, [[maybe_unused]] Step step, Scratch& sc, T* out) {
  const int64_t D = c.head_dim, row = c.num_kv_heads * D;  // row: one token's [H_kv, D]
  const int64_t R = tile.num_rows, G = item.head_end - item.head_begin;
  auto query_row = [&](int64_t g, int64_t r) {  // item head g's query of tile row r
    return query + (tile.row + r) * query_stride + (item.head_begin + g) * D;
  };
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < R; ++r) {
      if (step != Step::kAvx512Bf16) {  // (which reads the query row as it is)
        float* q = sc.q.data() + (g * R + r) * D;
        widen(query_row(g, r), q, D);
        for (int64_t d = 0; d < D; ++d) q[d] *= scale;
      }
      sc.m[g * R + r] = -std::numeric_limits<float>::infinity();
      sc.l[g * R + r] = 0.f;
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + G * R * D, 0.f);
  const int64_t num_keys = tile.first_pos + R;  // the last row sees this many positions
  for (int64_t start = 0; start < num_keys; start += c.block_size) {
    const int64_t block_keys = std::min(c.block_size, num_keys - start);
    const int64_t next_start = start + c.block_size;
    const int64_t next_keys = std::min(c.block_size, num_keys - next_start);
    // the KV heads the item's query heads read, each widened once for all of them
    for (int64_t kv = item.head_begin / group; kv <= (item.head_end - 1) / group; ++kv) {
      const int64_t head_offset = kv * D;
      const int64_t offset = table[start / c.block_size] * c.block_size * row + head_offset;
      if (next_keys > 0) {  // this head's rows of the next block, while we work on this one
        const int64_t next =
            table[next_start / c.block_size] * c.block_size * row + head_offset;
        prefetch_rows(key_cache + next, row, next_keys, D);
        prefetch_rows(value_cache + next, row, next_keys, D);
      }
      const int64_t g_begin = std::max(item.head_begin, kv * group) - item.head_begin;
      const int64_t g_end = std::min(item.head_end, (kv + 1) * group) - item.head_begin;
#ifdef CBATCH_X86
      if (step != Step::kGeneric) {  // K/V read in place
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (step == Step::kAvx512Bf16) {
            for (int64_t g = g_begin; g < g_end; ++g) {
              for (int64_t r = 0; r < R; ++r) {
                const int64_t n = std::min(block_keys, tile.first_pos + r + 1 - start);
                if (n <= 0) continue;
                const int64_t gr = g * R + r;
                avx512::online_softmax_step_bf16(query_row(g, r), key_cache + offset,
                                                 value_cache + offset, row, n, D, scale,
                                                 sc.m[gr], sc.l[gr], sc.acc.data() + gr * D);
              }
            }
            continue;
          }
        }
        // the block's keys kChunkKeys at a time.  A prefill tile's rows that see the whole
        // chunk go `group` at a time through its keys transposed once for all of them (12 sums
        // of scores in flight); a decode token's, and those on the causal diagonal, one at a
        // time through the keys as they lie (a transpose would cost more than one row's dot
        // products).  The same bits either way (attention_step.h).
        const int group = step == Step::kAvx512 ? avx512::kGroupRows : avx2::kGroupRows;
        for (int64_t c0 = 0; c0 < block_keys; c0 += kChunkKeys) {
          const int64_t chunk_keys = std::min(kChunkKeys, block_keys - c0);
          if (tile.first_pos + R <= start + c0) break;  // no row sees this chunk
          const T* keys = key_cache + offset + c0 * row;
          const T* values = value_cache + offset + c0 * row;
          const bool transpose = R > 1;
          if (transpose) transpose_keys(keys, row, chunk_keys, D, sc.kt.data());
          StepRow rows[12];
          int num_rows = 0;
          for (int64_t g = g_begin; g < g_end; ++g) {
            for (int64_t r = 0; r < R; ++r) {
              const int64_t n = std::min(chunk_keys, tile.first_pos + r + 1 - start - c0);
              if (n <= 0) continue;
              const int64_t gr = g * R + r;
              StepRow& one = rows[num_rows];  // (built in place: no copy to wait on)
              one.q = sc.q.data() + gr * D, one.acc = sc.acc.data() + gr * D;
              one.m = &sc.m[gr], one.l = &sc.l[gr];
              if (n < chunk_keys || !transpose) {
                step_row(step, one, keys, values, row, n, D);
              } else if (++num_rows == group) {
                step_group(step, rows, num_rows, sc.kt.data(), values, row, n, D);
                sc.transposed_rows += num_rows;
                num_rows = 0;
              }
            }
          }
          step_group(step, rows, num_rows, sc.kt.data(), values, row, chunk_keys, D);
          sc.transposed_rows += num_rows;
        }
        continue;
      }
#endif
      // this head's keys and values of the block as fp32 rows, `stride` apart
      const float *k, *v;
      int64_t stride;
      if constexpr (std::is_same_v<T, float>) {
        k = key_cache + offset, v = value_cache + offset, stride = row;
      } else {
        for (int64_t i = 0; i < block_keys; ++i) {
          widen(key_cache + offset + i * row, sc.k.data() + i * D, D);
          widen(value_cache + offset + i * row, sc.v.data() + i * D, D);
        }
        k = sc.k.data(), v = sc.v.data(), stride = D;
      }
      for (int64_t g = g_begin; g < g_end; ++g) {
        for (int64_t r = 0; r < R; ++r) {
          // keys of this block that row r may see (causal within the chunk)
          const int64_t n = std::min(block_keys, tile.first_pos + r + 1 - start);
          if (n <= 0) continue;
          const int64_t gr = g * R + r;
          online_softmax_step(sc.q.data() + gr * D, k, v, stride, n, D, sc.scores.data(),
                              sc.m[gr], sc.l[gr], sc.acc.data() + gr * D);
        }
      }
    }
  }
  // the AVX512-BF16 step keeps its sums in the pair layout (avx512::accumulate_pairs)
  const bool pairs = step == Step::kAvx512Bf16;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < R; ++r) {
      const float inv_l = 1.f / sc.l[g * R + r];
      const float* acc = sc.acc.data() + (g * R + r) * D;
      T* o = out + ((tile.row + r) * c.num_kv_heads * group + item.head_begin + g) * D;
      for (int64_t d = 0; d < D; ++d) {
        o[d] = static_cast<T>(acc[pairs ? pair_index(d, D) : d] * inv_l);
      }
    }
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

// Cuts every tile's query heads into groups: as many heads per item as keeps every thread
// busy (about four items per thread), since a bigger group streams longer runs of the cache.
// An item of more than `kv_group` heads holds whole KV groups (each KV block widened once per
// item); so does every item when each tile is one row (decode), which waits on reading the KV
// rows rather than on arithmetic: items of part of a group read their KV head once each (a
// batch-1 decode of 15 heads over 5 read 11 KV heads' rows for 5, 12-13% slower from DRAM),
// while tiles of several rows keep the finer cut, which balances their arithmetic better
// across threads (6-8% at 5-9 rows; benchmarks/NOTES.md, "CPU attention kernels").
std::vector<Item> make_items(const std::vector<Tile>& tiles, int64_t num_heads,
                             int64_t kv_group) {
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t groups = std::clamp<int64_t>((wanted + num_tiles - 1) / num_tiles, 1, num_heads);
  const bool decode = std::all_of(tiles.begin(), tiles.end(),
                                  [](const Tile& t) { return t.num_rows == 1; });
  const int64_t heads = (num_heads + groups - 1) / groups;
  const int64_t heads_per_item = heads > kv_group || decode
                                     ? (heads + kv_group - 1) / kv_group * kv_group : heads;
  std::vector<Item> items;
  items.reserve(num_tiles * groups);
  for (int64_t t = 0; t < num_tiles; ++t) {
    for (int64_t h = 0; h < num_heads; h += heads_per_item) {
      items.push_back({t, h, std::min(num_heads, h + heads_per_item)});
    }
  }
  // Longest first: with a long tail of lengths, the big items must not start last.
  auto cost = [&](const Item& it) {
    const Tile& tile = tiles[it.tile];
    return (tile.first_pos + tile.num_rows) * (it.head_end - it.head_begin);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  return items;
}

// One call's items and what attend() needs for them; threads take the next item until none
// is left.
template <typename T>
struct Job {
  const T *query, *key_cache, *value_cache;
  int64_t query_stride, max_blocks;
  const int32_t* block_tables;
  CacheView cache;
  int64_t group;  // query heads per KV head
  float scale;
  Step step;  // step_for(head_dim)
  const std::vector<Tile>& tiles;
  const std::vector<Item>& items;
  std::atomic<int64_t>& next;
  T* out;
};

template <typename T>
void work(const Job<T>& job, Scratch& scratch) {
  const int64_t num_items = static_cast<int64_t>(job.items.size());
  for (int64_t i = job.next++; i < num_items; i = job.next++) {
    const Tile& tile = job.tiles[job.items[i].tile];
    attend(job.query, job.query_stride, job.key_cache, job.value_cache,
           job.block_tables + tile.seq * job.max_blocks, job.cache, job.group, tile,
           job.items[i], job.scale, job.step, scratch, job.out);
  }
}

// The item loop with everything it calls inlined, compiled twice on x86-64: for x86-64-v3
// (AVX2, FMA, F16C) and for the baseline; the loader picks one for this CPU (the extension
// itself targets the baseline, so the wheel runs anywhere; benchmarks/NOTES.md, "CPU
// attention kernels").
// (GCC 12 added the run-time dispatch on "arch=x86-64-v3"; GCC 11 rejects the attribute.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define CBATCH_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default"), flatten))
#else
#define CBATCH_CPU_CLONES __attribute__((flatten))
#endif
CBATCH_CPU_CLONES void work_f32(const Job<float>& job, Scratch& sc) { work(job, sc); }
CBATCH_CPU_CLONES void work_f16(const Job<c10::Half>& job, Scratch& sc) { work(job, sc); }
CBATCH_CPU_CLONES void work_bf16(const Job<c10::BFloat16>& job, Scratch& sc) { work(job, sc); }

inline void work_any(const Job<float>& job, Scratch& sc) { work_f32(job, sc); }
inline void work_any(const Job<c10::Half>& job, Scratch& sc) { work_f16(job, sc); }
inline void work_any(const Job<c10::BFloat16>& job, Scratch& sc) { work_bf16(job, sc); }

// Runs attend() for every (tile, head group) item.
template <typename T>
void run_items(const at::Tensor& query, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const at::Tensor& block_tables, const CacheView& c,
               const std::vector<Tile>& tiles, const std::vector<Item>& items, float scale,
               Step step, at::Tensor& out) {
  const int64_t group = query.size(1) / c.num_kv_heads;
  const int64_t max_heads = items.front().head_end - items.front().head_begin;
  const int64_t max_rows = std::max_element(tiles.begin(), tiles.end(), [](const Tile& a,
      const Tile& b) { return a.num_rows < b.num_rows; })->num_rows;
  std::atomic<int64_t> next{0}, transposed_rows{0};
  const Job<T> job{query.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                   query.stride(0), block_tables.size(1), block_tables.data_ptr<int32_t>(), c,
                   group, scale, step, tiles, items, next,
                   out.data_ptr<T>()};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch(max_heads, max_rows, c.head_dim, c.block_size);
    work_any(job, scratch);
    transposed_rows += scratch.transposed_rows;
  });
  if (transposed_rows > 0) count_path(CpuPath::kPrefillAttentionTransposedRows, transposed_rows);
}

// The path counter of each step (Step's order), for decode and for prefill.
constexpr CpuPath kDecodePaths[] = {
    CpuPath::kDecodeAttentionGeneric, CpuPath::kDecodeAttentionAvx2,
    CpuPath::kDecodeAttentionAvx512, CpuPath::kDecodeAttentionAvx512Bf16};
constexpr CpuPath kPrefillPaths[] = {
    CpuPath::kPrefillAttentionGeneric, CpuPath::kPrefillAttentionAvx2,
    CpuPath::kPrefillAttentionAvx512, CpuPath::kPrefillAttentionAvx512Bf16};

at::Tensor run(const at::Tensor& query, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const at::Tensor& block_tables,
               const std::vector<Tile>& tiles, double scale, bool decode) {
  const CacheView c = view_of(key_cache);
  at::Tensor out = at::empty({query.size(0), query.size(1), c.head_dim}, query.options());
  // Nothing to compute (no new tokens, no heads, or an empty head): an empty result, not a
  // division by zero tiles (or KV heads) or an empty item list below.
  if (tiles.empty() || out.numel() == 0) return out;
  const std::vector<Item> items =
      make_items(tiles, query.size(1), query.size(1) / c.num_kv_heads);
  const float s = static_cast<float>(scale);
  const Step step = step_for(c.head_dim, query.scalar_type());
  switch (query.scalar_type()) {
    case at::kFloat:
      run_items<float>(query, key_cache, value_cache, block_tables, c, tiles, items, s, step,
                       out);
      break;
    case at::kHalf:
      run_items<c10::Half>(query, key_cache, value_cache, block_tables, c, tiles, items, s,
                           step, out);
      break;
    case at::kBFloat16:
      run_items<c10::BFloat16>(query, key_cache, value_cache, block_tables, c, tiles, items, s,
                               step, out);
      break;
    default:
      TORCH_CHECK_TYPE(false, "the CPU attention kernels take float32, float16 or bfloat16, "
                       "got ", query.scalar_type());
  }
  count_path((decode ? kDecodePaths : kPrefillPaths)[static_cast<int>(step)]);
  return out;
}

}  // namespace

std::string cpu_attention_step(int64_t head_dim, std::optional<at::ScalarType> dtype) {
  TORCH_CHECK_VALUE(head_dim > 0, "cpu_attention_step: head_dim must be positive, got ",
                    head_dim);
  switch (step_for(head_dim, dtype.value_or(at::kFloat))) {
    case Step::kAvx512Bf16:
      return "avx512bf16";
    case Step::kAvx512:
      return "avx512";
    case Step::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

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
  return run(query, key_cache, value_cache, block_tables, tiles, scale, /*decode=*/true);
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
  return run(query, key_cache, value_cache, block_tables, tiles, scale, /*decode=*/false);
}

}  // namespace cbatch
