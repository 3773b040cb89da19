// y = act(x @ W^T + bias) + residual on an x86 CPU with AVX-512 (fp32, bf16) or AVX2 + FMA
// (fp32), for the few-row GEMMs of decode steps, which stream every weight once and so run at
// memory bandwidth.
//
// The weight is packed once (cbatch/layers/cpu_linear.py, pack) into blocks of 16 output
// columns, each block a run of K "rows" of 16 columns: fp32 [N/16, K, 16]; bf16
// [N/16, K/2, 16, 2] (pairs of k side by side, the operand layout of vdpbf16ps).  One work
// item is 32 columns (two blocks, each read front to back); it runs rows of x through them
// eight at a time, with 8 x 32 accumulators in registers.  From 16 rows on, x is first copied
// into groups of 8 rows (the broadcasts then read one stream), and rows go through in chunks
// of 64.  Weights are prefetched ahead of the loads, and passes of rows over an item also
// bring the next item's weights into L2 (prefetch_ahead).  Each output element is one
// thread's sum over k in order, so a row's result does not depend on the other rows nor on
// the thread count.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "avx2.h"
#include "avx512.h"

namespace cbatch {

constexpr int64_t kBlock = 16;  // output columns per packed block

#ifdef CBATCH_X86
namespace {

constexpr int kRows = 8;  // rows of x per register tile

// How far ahead of its loads each block's stream is prefetched.  With 8 rows the loop spends
// 16 multiply-adds per two cache lines, and the out-of-order window then holds too few loads
// to keep DRAM busy: at batch 8 the hardware prefetchers alone stream 31-33 GB/s (bf16) where
// one row reaches 43.  48 lines ahead brings batch 8 to 39-47 GB/s; 32 to 64 lines measured
// alike (benchmarks/NOTES.md, "Software prefetch in the linear kernel").
constexpr int64_t kPrefetchBytes = 3072;

// The tile loads p; kNext: it also brings the same place of the next item (next_item elements
// on) into L2.  Which passes of rows over a column item do that (column_item, Avx2::item):
// - Few rows (below 16; AVX2: 8): the first pass, so the next item is fetched from DRAM a
//   whole item ahead of its loads.  3 KB ahead alone hides DRAM's latency only while the
//   loop waits on memory; where the multiply-adds keep pace with the stream (bf16 at 8 rows
//   on a host giving 50 GB/s) the two added up instead of overlapping.  A step's chain of
//   GEMMs took 4-23% less time at 1-15 rows (benchmarks/NOTES.md, "One item ahead").
// - More rows: the passes after the first, which read the item from L2 while DRAM would
//   otherwise idle: 6-13% less time at 16-64 rows ("Software prefetch in the linear kernel").
// Baseline x86-64 (prefetch is SSE): the AVX-512 and the AVX2 tiles share it.
template <bool kNext, typename T>
inline void prefetch_ahead(const T* p, int64_t next_item) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
  if constexpr (kNext) _mm_prefetch(reinterpret_cast<const char*>(p + next_item), _MM_HINT_T1);
}

CBATCH_AVX512 inline void store16(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
CBATCH_AVX512_DOT inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// GELU, tanh approximation: 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v^3), with
// 1 + tanh(u) = 2 - 2 / (1 + e^(2u)).
CBATCH_AVX512 inline __m512 gelu_tanh16(__m512 v) {
  const __m512 u = _mm512_mul_ps(
      _mm512_set1_ps(0.7978845608028654f),
      _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), v), _mm512_mul_ps(v, v), v));
  const __m512 e = exp16(_mm512_add_ps(u, u));
  const __m512 two = _mm512_set1_ps(2.f);
  const __m512 one_plus_tanh =
      _mm512_sub_ps(two, _mm512_div_ps(two, _mm512_add_ps(e, _mm512_set1_ps(1.f))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v), one_plus_tanh);
}

// The type of x for a weight of type T: T, or int16 for the int8 weight of a bf16 lm_head's
// greedy screen (vpdpwssd multiplies pairs of int16; the weight is widened in registers).
template <typename T>
struct XOf {
  using type = T;
};
template <>
struct XOf<int8_t> {
  using type = int16_t;
};
template <typename T>
using X = typename XOf<T>::type;

// T: the weight (and x, but int8 takes int16 x); O: the output (T, or fp32 for the greedy
// head's screens).
template <typename T, typename O = T>
struct Args {
  const X<T>* x;  // [M, K], rows ldx apart
  int64_t ldx, M, K, N;
  const X<T>* xp;  // null, or x packed by pack_rows
  const T* w;  // packed
  const T* bias;      // [N] or null
  const T* residual;  // [M, N] (rows ldr apart) or null
  int64_t ldr;
  bool gelu;
  O* out;  // [M, N] dense
  bool prefetch_next = false;  // passes of rows prefetch the next item (prefetch_ahead)
  const float* scale = nullptr;  // int8 weights: [N] column scales (out = int32 sum * scale)
};

// Elements of x that one row contributes to one broadcast: fp32 1, bf16 and int8 a pair of k.
template <typename T>
constexpr int64_t kPairs = std::is_same_v<T, float> ? 1 : 2;

// x's rows in groups of kRows, each group [K / pairs][kRows][pairs] (zero rows past M): the
// tile's broadcasts then read one stream instead of kRows rows far apart (for many rows;
// a few rows stay in cache as they are).
template <typename T, typename O>
void pack_rows(const Args<T, O>& a, X<T>* xp) {
  constexpr int64_t P = kPairs<T>;
  const int64_t groups = (a.M + kRows - 1) / kRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      X<T>* dst = xp + g * kRows * a.K;
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t m = g * kRows + r;
        for (int64_t k = 0; k < a.K; k += P) {
          for (int64_t p = 0; p < P; ++p) {
            dst[(k / P) * kRows * P + r * P + p] = m < a.M ? a.x[m * a.ldx + k + p] : X<T>(0);
          }
        }
      }
    }
  });
}

// acc[r][b] for R rows and B blocks of 16 columns: x[r] . W over all K.
// Row r's element k of x is x[r * rs + k * ks].
template <int R, int B, bool kNext>
CBATCH_AVX512 inline void dot_tile(const float* x, int64_t rs, int64_t ks, const float* w,
                                   int64_t K, __m512 (&acc)[kRows][2]) {
  const int64_t block_stride = K * kBlock;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[2];
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) {
      prefetch_ahead<kNext>(w + b * block_stride + k * kBlock, 2 * block_stride);
      wk[b] = _mm512_loadu_ps(w + b * block_stride + k * kBlock);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * rs + k * ks]);
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(xr, wk[b], acc[r][b]);
    }
  }
}

template <int R, int B, bool kNext>
CBATCH_AVX512_DOT inline void dot_tile(const c10::BFloat16* x, int64_t rs, int64_t ks,
                                        const c10::BFloat16* w, int64_t K,
                                        __m512 (&acc)[kRows][2]) {
  const int64_t block_stride = K * kBlock;  // in bf16 elements
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh wk[2];
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) {
      prefetch_ahead<kNext>(w + b * block_stride + k * kBlock, 2 * block_stride);
      wk[b] = (__m512bh)(_mm512_loadu_si512(w + b * block_stride + k * kBlock));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * rs + k * ks, sizeof pair);
      const __m512bh xr = (__m512bh)(_mm512_set1_epi32(pair));
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xr, wk[b]);
    }
  }
}

// acc + the pairwise products of a and b (vpdpwssd), in asm: GCC 12's intrinsic keeps the
// accumulator in zmm0-15, and with 16 sums the tile then moved each one there and back around
// every instruction (half the speed).
CBATCH_AVX512_DOT inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// int16 x and int8 W (pairs of k, as bf16 is packed; the greedy screen of a bf16 lm_head):
// exact int32 sums, kept in acc's bits (the caller's scale keeps them from overflowing).
template <int R, int B, bool kNext>
CBATCH_AVX512_DOT inline void dot_tile(const int16_t* x, int64_t rs, int64_t ks,
                                       const int8_t* w, int64_t K, __m512 (&acc)[kRows][2]) {
  const int64_t block_stride = K * kBlock;  // in int8 elements
  __m512i sum[kRows][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) sum[r][b] = _mm512_castps_si512(acc[r][b]);
  }
  for (int64_t k = 0; k < K; k += 2) {
    __m512i wk[2];
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) {
      prefetch_ahead<kNext>(w + b * block_stride + k * kBlock, 2 * block_stride);
      wk[b] = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * block_stride + k * kBlock)));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * rs + k * ks, sizeof pair);
      const __m512i xr = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) sum[r][b] = dpwssd(sum[r][b], xr, wk[b]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_castsi512_ps(sum[r][b]);
  }
}

// Rows [m, m + R) times the B blocks that start at column n; epilogue; store.
template <typename T, typename O, int R, int B, bool kNext = false>
CBATCH_AVX512_DOT void tile(const Args<T, O>& a, int64_t m, int64_t n) {
  __m512 acc[kRows][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const T* w = a.w + (n / kBlock) * a.K * kBlock;
  if (a.xp) {
    dot_tile<R, B, kNext>(a.xp + m * a.K, kPairs<T>, kRows, w, a.K, acc);
  } else {
    dot_tile<R, B, kNext>(a.x + m * a.ldx, a.ldx, 1, w, a.K, acc);
  }
  for (int b = 0; b < B; ++b) {
    const int64_t col = n + b * kBlock;
    const __mmask16 mask = first_lanes(a.N - col);
    if constexpr (std::is_same_v<T, int8_t>) {  // the screen: int32 sums times column scales
      const __m512 scale = load16(a.scale + col, mask);
      for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_castps_si512(acc[r][b]));
        store16(a.out + (m + r) * a.N + col, _mm512_mul_ps(sum, scale), mask);
      }
    } else {
      const __m512 bias = a.bias ? load16(a.bias + col, mask) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        __m512 v = _mm512_add_ps(acc[r][b], bias);
        if (a.gelu) v = gelu_tanh16(v);
        if (a.residual) v = _mm512_add_ps(load16(a.residual + (m + r) * a.ldr + col, mask), v);
        store16(a.out + (m + r) * a.N + col, v, mask);
      }
    }
  }
}

// Rows [m, m_end) times the B blocks that start at column n, kRows at a time, then the rest.
template <typename T, typename O, int B, bool kNext>
CBATCH_AVX512_DOT void passes(const Args<T, O>& a, int64_t n, int64_t m, int64_t m_end) {
  for (; m + kRows <= m_end; m += kRows) tile<T, O, kRows, B, kNext>(a, m, n);
  switch (m_end - m) {
    case 7: return tile<T, O, 7, B, kNext>(a, m, n);
    case 6: return tile<T, O, 6, B, kNext>(a, m, n);
    case 5: return tile<T, O, 5, B, kNext>(a, m, n);
    case 4: return tile<T, O, 4, B, kNext>(a, m, n);
    case 3: return tile<T, O, 3, B, kNext>(a, m, n);
    case 2: return tile<T, O, 2, B, kNext>(a, m, n);
    case 1: return tile<T, O, 1, B, kNext>(a, m, n);
    default: return;
  }
}

constexpr int64_t kPackFrom = 2 * kRows;  // rows from which x is packed

// Rows [m_begin, m_end) times the B blocks that start at column n.  next: passes bring the
// next item's weights into L2, the first below kPackFrom rows, else the later ones
// (prefetch_ahead).
template <typename T, typename O, int B>
CBATCH_AVX512_DOT void column_item(const Args<T, O>& a, int64_t n, int64_t m_begin,
                                    int64_t m_end, bool next) {
  if (!next) return passes<T, O, B, false>(a, n, m_begin, m_end);
  const int64_t first = std::min(m_end, m_begin + kRows);  // one tile
  if (m_end - m_begin < kPackFrom) {
    passes<T, O, B, true>(a, n, m_begin, first);
    return passes<T, O, B, false>(a, n, first, m_end);
  }
  passes<T, O, B, false>(a, n, m_begin, first);
  passes<T, O, B, true>(a, n, first, m_end);
}
// Rows go through in chunks that stay in each core's L2 while every column item reads them;
// the weights then stream once per chunk (from L3, where a layer's weights fit).
constexpr int64_t kChunkRows = 64;

// The AVX-512 kernel: an item is two blocks (the last may be one).
struct Avx512 {
  static constexpr int64_t kItemBlocks = 2;
  static constexpr int64_t kRowsPerPass = kRows;
  static constexpr int64_t kL2Budget = 512 << 10;  // half of a Zen 4/5 core's L2
  template <typename T, typename O>
  static void item(const Args<T, O>& a, int64_t block, int64_t blocks, int64_t m0, int64_t m1,
                   bool next) {
    if (block + 1 < blocks) {
      column_item<T, O, 2>(a, block * kBlock, m0, m1, next);
    } else {
      column_item<T, O, 1>(a, block * kBlock, m0, m1, next);
    }
  }
};

// x packed (from kPackFrom rows), then chunks of rows, each over every column item (Isa's
// items: Avx512 above, Avx2 below), the items shared out among threads.
template <typename Isa, typename T, typename O>
void run(Args<T, O> a) {
  std::unique_ptr<X<T>[]> xp;  // every element written by pack_rows: no zeroing first
  if (a.M >= kPackFrom) {
    xp.reset(new X<T>[(a.M + kRows - 1) / kRows * kRows * a.K]);
    pack_rows(a, xp.get());
    a.xp = xp.get();
  }
  // The next item is prefetched only while what must stay in L2 meanwhile fills at most half
  // of it: a chunk of rows, the next item and, with more than one pass of rows, the current
  // one (with K = 3072 in fp32 the next item pushed the rows out: 5-7% slower at 64-256 rows).
  const int64_t rows = std::min(a.M, kChunkRows);
  const int64_t items_kept = rows > Isa::kRowsPerPass ? 2 : 1;
  const int64_t bytes = (rows * int64_t(sizeof(X<T>)) +
                         items_kept * Isa::kItemBlocks * kBlock * int64_t(sizeof(T))) * a.K;
  a.prefetch_next = bytes <= Isa::kL2Budget;
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  const int64_t items = (blocks + Isa::kItemBlocks - 1) / Isa::kItemBlocks;
  for (int64_t m0 = 0; m0 < a.M; m0 += kChunkRows) {
    const int64_t m1 = std::min(a.M, m0 + kChunkRows);
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {  // the next item, if this thread runs it
        Isa::item(a, i * Isa::kItemBlocks, blocks, m0, m1, a.prefetch_next && i + 1 < end);
      }
    });
  }
}

// ---- AVX2 + FMA: CPUs without AVX-512, e.g. AMD Zen 2/3, Intel before Ice Lake.  fp32 linear
// layers, and bf16 in / fp32 out for the greedy head's screen (no bf16 linear layers here).
// The same packed layout and loop; a tile is kRows2 rows times one block of 16 columns (two
// 8-lane halves): 8 of the 16 ymm registers hold sums, 2 (bf16: 4) the block's weights.

constexpr int kRows2 = 4;

// gelu_tanh16 on 8 lanes (exp8's clamp leaves it as it is: 1 + tanh(u) is 0 or 2 there).
CBATCH_AVX2 inline __m256 gelu_tanh8(__m256 v) {
  const __m256 u = _mm256_mul_ps(
      _mm256_set1_ps(0.7978845608028654f),
      _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), v), _mm256_mul_ps(v, v), v));
  const __m256 e = exp8(_mm256_add_ps(u, u));
  const __m256 two = _mm256_set1_ps(2.f);
  const __m256 one_plus_tanh =
      _mm256_sub_ps(two, _mm256_div_ps(two, _mm256_add_ps(e, _mm256_set1_ps(1.f))));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), one_plus_tanh);
}

// acc[r][h] (h: the block's two 8-column halves) += x[r] . W over all K, as tile2 sums it.
// Row r's element k of x is x[r * rs + k * ks].  kNext: as prefetch_ahead (the next item is
// the next block).
template <int R, bool kNext>
CBATCH_AVX2 inline void dot_tile2(const float* x, int64_t rs, int64_t ks, const float* w,
                                  int64_t K, __m256 (&acc)[kRows2][2]) {
  const int64_t next_item = K * kBlock;
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kBlock;
    prefetch_ahead<kNext>(wk, next_item);
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * rs + k * ks);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
}

// bf16 x and W (pairs of k, as packed), widened to fp32 in registers: a bf16 value is the top
// half of its fp32, so the low element of a 32-bit pair is `pair << 16` and the high one
// `pair & 0xffff0000`.  The sums are fp32 fmas, two per pair of k, in order: within the
// greedy screen's bound, which holds for sums of the K products in any order (its `tiny`
// term covering products that underflow).
CBATCH_AVX2 inline __m256 low_bf16(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
CBATCH_AVX2 inline __m256 high_bf16(__m256i pairs, __m256i high) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
}

template <int R, bool kNext>
CBATCH_AVX2 inline void dot_tile2(const c10::BFloat16* x, int64_t rs, int64_t ks,
                                  const c10::BFloat16* w, int64_t K,
                                  __m256 (&acc)[kRows2][2]) {
  const int64_t next_item = K * kBlock;  // in bf16 elements
  const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
  for (int64_t k = 0; k < K; k += 2) {
    const c10::BFloat16* wk = w + k * kBlock;  // 16 columns x 2 k: columns 0-7, then 8-15
    prefetch_ahead<kNext>(wk, next_item);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16));
    const __m256 w00 = low_bf16(v0), w01 = high_bf16(v0, high), w10 = low_bf16(v1),
                 w11 = high_bf16(v1, high);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * rs + k * ks, sizeof pair);
      const __m256i p = _mm256_set1_epi32(pair);
      const __m256 x0 = low_bf16(p), x1 = high_bf16(p, high);
      acc[r][0] = _mm256_fmadd_ps(x1, w01, _mm256_fmadd_ps(x0, w00, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(x1, w11, _mm256_fmadd_ps(x0, w10, acc[r][1]));
    }
  }
}

// Rows [m, m + R) times the block that starts at column n; epilogue; store.  fp32 in and out,
// or (the greedy head's screen) bf16 in, fp32 out, with no bias, GELU or residual.
template <typename T, int R, bool kNext>
CBATCH_AVX2 void tile2(const Args<T, float>& a, int64_t m, int64_t n) {
  __m256 acc[kRows2][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const T* w = a.w + (n / kBlock) * a.K * kBlock;
  // Row r's broadcast at k is x[r * rs + k * ks] (packed: groups of kRows rows, k-major).
  constexpr int64_t P = kPairs<T>;
  const T* x = a.xp ? a.xp + (m / kRows) * kRows * a.K + (m % kRows) * P : a.x + m * a.ldx;
  dot_tile2<R, kNext>(x, a.xp ? P : a.ldx, a.xp ? kRows : 1, w, a.K, acc);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // unrolled, so that acc stays in registers
    const int64_t col = n + 8 * h;
    if (col >= a.N) continue;
    const __m256i mask = first_lanes8(a.N - col);
    __m256 bias = _mm256_setzero_ps();
    if constexpr (std::is_same_v<T, float>) {
      if (a.bias) bias = _mm256_maskload_ps(a.bias + col, mask);
    }
    for (int r = 0; r < R; ++r) {
      __m256 v = acc[r][h];
      if constexpr (std::is_same_v<T, float>) {
        v = _mm256_add_ps(v, bias);
        if (a.gelu) v = gelu_tanh8(v);
        if (a.residual) {
          v = _mm256_add_ps(_mm256_maskload_ps(a.residual + (m + r) * a.ldr + col, mask), v);
        }
      }
      _mm256_maskstore_ps(a.out + (m + r) * a.N + col, mask, v);
    }
  }
}

template <typename T, bool kNext>
CBATCH_AVX2 void passes2(const Args<T, float>& a, int64_t n, int64_t m, int64_t m_end) {
  for (; m + kRows2 <= m_end; m += kRows2) tile2<T, kRows2, kNext>(a, m, n);
  switch (m_end - m) {
    case 3: return tile2<T, 3, kNext>(a, m, n);
    case 2: return tile2<T, 2, kNext>(a, m, n);
    case 1: return tile2<T, 1, kNext>(a, m, n);
    default: return;
  }
}

// An item is one block; with next, passes prefetch the next one: the first below two passes
// of rows, else the later ones (as column_item; from two passes the later ones measured 0-20%
// faster at 8-12 rows on a Zen 3, the lm_head most: benchmarks/NOTES.md, "cbatch's kernel on
// AVX2").
struct Avx2 {
  static constexpr int64_t kItemBlocks = 1;
  static constexpr int64_t kRowsPerPass = kRows2;
  static constexpr int64_t kL2Budget = 256 << 10;  // half of a Zen 2/3 core's L2
  template <typename T, typename O>
  static void item(const Args<T, O>& a, int64_t block, int64_t, int64_t m0, int64_t m1,
                   bool next) {
    static_assert(std::is_same_v<O, float>, "the AVX2 kernel writes fp32");
    const int64_t n = block * kBlock;
    if (!next) return passes2<T, false>(a, n, m0, m1);
    const int64_t first = std::min(m1, m0 + kRows2);  // one tile
    if (m1 - m0 < 2 * kRows2) {
      passes2<T, true>(a, n, m0, first);
      return passes2<T, false>(a, n, first, m1);
    }
    passes2<T, false>(a, n, m0, first);
    passes2<T, true>(a, n, first, m1);
  }
};

// ---- Greedy tokens of an lm_head read through a smaller copy of its weight (greedy_head_cpu).
//
// A greedy step needs each row's argmax of x @ W^T, not its logits, and the lm_head is a
// third of the bytes a GPT-2 decode step reads (fp32), a quarter in bf16.  A screen runs the
// kernel above on a smaller copy of W (int8 with AVX512-VNNI and AVX512-BF16: half a bf16
// W's bytes, a quarter of an fp32 one's; elsewhere, for fp32, bf16), then bounds how far each
// screened value can be from the lm_head's own logit:
// - fp32 lm_head, bf16 screen (vdpbf16ps with AVX512-BF16, else the AVX2 tile with bf16
//   widened in registers) on x and W rounded to bf16: its A_j differs from the fp32
//   kernel's logit E_j by at most
//     B = g_K |x| |w_j| + g_2K |x~| |w~_j| + |x - x~| |w_j| + |x~| |w_j - w~_j| + tiny
//   (|.| the 2-norm, ~ the bf16 rounding, g_n = nu / (1 - nu) with u = 2^-24: the two sums
//   of K products in any order, Cauchy-Schwarz for the rest, `tiny` for bf16 products
//   flushed to zero), with each column norm's maximum over W.  A column with A_j < A_t - 2B,
//   t the screen's argmax, has E_j < E_t, so the fp32 kernel's argmax (its first maximum) is
//   among the others.
// - int8 screen (AVX512-VNNI's vpdpwssd) of a bf16 or fp32 lm_head: W ~ s_j q_j per column
//   (q int8, s_j = max_k |w_jk| / 127), x ~ t p per row (p int16, t a power of two so large
//   that no int32 sum of K products overflows), exact int32 sums S_j = p . q_j, and A_j =
//   fl(fl(S_j) s_j) in units of t.  The kernel's fp32 sum E_j is within
//     B = g |x| |w_j| + |x - t p| |w_j| + |t p| |w_j - s_j q_j| + 2.01 u |t p| |s_j q_j| + tiny
//   of t A_j: g = g_K for fp32 (one fma per k), g_2K for bf16 (vdpbf16ps as two roundings per
//   pair of k, as Intel's manual has it, and as measured here; g_2K holds for either order
//   of the two).  fp32: a column with t A_j < t A_t - 2B is dropped, as above.  bf16: the
//   logit is E_j rounded to bf16, which ties far more often; with lb = t A_t - B <= E_t, q
//   the largest bf16 <= lb and p' the largest bf16 < q, a column with t A_j + B <= p' has
//   bf16(E_j) <= p' < q <= bf16(E_t): neither the maximum nor a tie of it.
// For each block of 16 columns that holds one the screen keeps, the logits are computed as
// the kernel computes them (fp32: one fma per k, in order, from zero, then + 0 for the absent
// bias; bf16: one vdpbf16ps per pair of k, in order, from zero, + 0, rounded to bf16), bit for
// bit, and the first maximum wins.  Rows the screen cannot settle cheaply run the kernel on
// the whole row: a NaN or infinity anywhere, sums that could overflow (or, bf16, a bound
// reaching bf16's subnormals), or more than kMaxBlocks blocks to sum (x = 0 ties every
// column).
//
// A bf16 lm_head's int8 screen runs below kPackFrom rows (16).  From there the bf16 lm_head
// is compute-bound, and the screen's multiply-adds are as many as the kernel's: on a Zen 4 host
// (bench_linear, lm_head, cache flushed) it took 1.71 / 2.22 / 2.61 / 2.90 / 3.17 ms at 8 /
// 10 / 12 / 14 / 15 rows against the kernel's 2.45 / 2.73 / 2.94 / 3.31 / 3.16 ms, and 10%
// more than the kernel at 64 rows (benchmarks/NOTES.md, "An int8 screen for the bf16
// lm_head").  An fp32 lm_head's screens (their multiply-adds cost half the kernel's) run at
// every row count.

constexpr int64_t kMaxBlocks = 256;  // ~3 us each (a 16-column block is K cache lines)

// The two ISAs' parts of settle_row: next_kept(approx, n, N, cut, &lanes), the first block of
// 16 columns from column n on holding a screened value >= cut (its first column, N if none;
// lanes: which of its columns, as bits), and exact(x, packed, cols, count, K, out), the
// logits of the 16 columns of each of `count` (at most kGroup) packed blocks, starting at
// columns cols[], as the kernels (tile, tile2) compute them: on AVX-512 kGroup blocks at once,
// so that one sum's chain of K dependent multiply-adds hides the others' latency.  The bf16
// exact exists only on AVX-512 (AVX512-BF16: the one place bf16 lm_heads run the kernel).
constexpr int kGroup = 4;
struct Screen512 {
  CBATCH_AVX512 static int64_t next_kept(const float* approx, int64_t n, int64_t N, float cut,
                                         uint32_t* lanes) {
    const __m512 c = _mm512_set1_ps(cut);
    for (; n < N; n += kBlock) {
      const __mmask16 valid = first_lanes(N - n);
      *lanes = _mm512_mask_cmp_ps_mask(valid, load16(approx + n, valid), c, _CMP_GE_OQ);
      if (*lanes) return n;
    }
    return N;
  }
  // (every group sums kGroup blocks; past `count` it repeats the first, unstored)
  CBATCH_AVX512 static void exact(const float* x, const float* packed, const int64_t* cols,
                                  int count, int64_t K, float (*out)[kBlock]) {
    __m512 acc[kGroup];
    const float* w[kGroup];
    for (int g = 0; g < kGroup; ++g) {
      acc[g] = _mm512_setzero_ps(), w[g] = packed + cols[g < count ? g : 0] * K;
    }
    for (int64_t k = 0; k < K; ++k) {
      const __m512 xk = _mm512_set1_ps(x[k]);
#pragma GCC unroll 4
      for (int g = 0; g < kGroup; ++g) {
        acc[g] = _mm512_fmadd_ps(xk, _mm512_loadu_ps(w[g] + k * kBlock), acc[g]);
      }
    }
    for (int g = 0; g < count; ++g) {
      _mm512_storeu_ps(out[g], _mm512_add_ps(acc[g], _mm512_setzero_ps()));
    }
  }
  CBATCH_AVX512_DOT static void exact(const c10::BFloat16* x, const c10::BFloat16* packed,
                                      const int64_t* cols, int count, int64_t K,
                                      float (*out)[kBlock]) {
    __m512 acc[kGroup];
    const c10::BFloat16* w[kGroup];
    for (int g = 0; g < kGroup; ++g) {
      acc[g] = _mm512_setzero_ps(), w[g] = packed + cols[g < count ? g : 0] * K;
    }
    for (int64_t k = 0; k < K; k += 2) {
      int32_t pair;
      std::memcpy(&pair, x + k, sizeof pair);
      const __m512bh xk = (__m512bh)(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
      for (int g = 0; g < kGroup; ++g) {
        acc[g] = _mm512_dpbf16_ps(acc[g], xk, (__m512bh)(_mm512_loadu_si512(w[g] + k * kBlock)));
      }
    }
    for (int g = 0; g < count; ++g) {  // + 0 and rounded to bf16, as tile and store16 do
      const __m512 v = _mm512_add_ps(acc[g], _mm512_setzero_ps());
      _mm512_storeu_ps(out[g], widen16((__m256i)(_mm512_cvtneps_pbh(v))));
    }
  }
};

struct Screen2 {
  CBATCH_AVX2 static int64_t next_kept(const float* approx, int64_t n, int64_t N, float cut,
                                       uint32_t* lanes) {
    const __m256 c = _mm256_set1_ps(cut);
    for (; n < N; n += kBlock) {
      uint32_t bits = 0;
      for (int h = 0; h < 2; ++h) {
        const __m256i valid = first_lanes8(N - n - 8 * h);
        const __m256 v = _mm256_maskload_ps(approx + n + 8 * h, valid);
        const __m256 ge = _mm256_and_ps(_mm256_cmp_ps(v, c, _CMP_GE_OQ),
                                        _mm256_castsi256_ps(valid));
        bits |= uint32_t(_mm256_movemask_ps(ge)) << (8 * h);
      }
      if ((*lanes = bits)) return n;
    }
    return N;
  }
  CBATCH_AVX2 static void exact(const float* x, const float* packed, const int64_t* cols,
                                int count, int64_t K, float (*out)[kBlock]) {
    for (int g = 0; g < count; ++g) {  // one block at a time
      const float* block = packed + cols[g] * K;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const __m256 xk = _mm256_broadcast_ss(x + k);
        acc0 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(block + k * kBlock), acc0);
        acc1 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(block + k * kBlock + 8), acc1);
      }
      _mm256_storeu_ps(out[g], _mm256_add_ps(acc0, _mm256_setzero_ps()));
      _mm256_storeu_ps(out[g] + 8, _mm256_add_ps(acc1, _mm256_setzero_ps()));
    }
  }
};

// The row's greedy token, or -1 where the kernel must run the whole row.  approx: the
// screen's [N] values; cut: keep the columns whose value is at least this (NaN: settle
// nothing).  S: Screen512 or Screen2; T: fp32 or bf16 (x and the packed weight).
template <typename S, typename T>
int64_t settle_row(const T* x, const T* packed, int64_t K, int64_t N, const float* approx,
                   float cut) {
  if (!std::isfinite(cut)) return -1;
  int64_t cols[kMaxBlocks];  // the kept blocks' first columns, ascending
  uint32_t lanes[kMaxBlocks];
  int count = 0;
  uint32_t keep = 0;
  for (int64_t n = S::next_kept(approx, 0, N, cut, &keep); n < N;
       n = S::next_kept(approx, n + kBlock, N, cut, &keep)) {
    if (count == kMaxBlocks) return -1;
    cols[count] = n, lanes[count++] = keep;
  }
  int64_t best = -1;
  float best_value = -INFINITY;
  for (int i = 0; i < count; i += kGroup) {  // columns in order: the first maximum wins
    const int group = std::min(kGroup, count - i);
    float exact[kGroup][kBlock];
    S::exact(x, packed, cols + i, group, K, exact);
    for (int g = 0; g < group; ++g) {
      for (uint32_t bits = lanes[i + g]; bits; bits &= bits - 1) {
        const int lane = __builtin_ctz(bits);
        if (exact[g][lane] > best_value) best = cols[i + g] + lane, best_value = exact[g][lane];
      }
    }
  }
  return best;
}

// A float at most v: the cut that drops no column the bound keeps (NaN if v is not finite).
float float_below(double v) {
  return std::isfinite(v) ? std::nextafter(static_cast<float>(v), -INFINITY) : NAN;
}

// bf16 values (as doubles): the largest at most v, and the next one below b; for normal
// values (|v| and |b| at least 2^-125, v below bf16's largest).
double bf16_floor(double v) {
  float f = static_cast<float>(v);
  if (f > v) f = std::nextafter(f, -INFINITY);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint32_t top = bits & 0xffff0000u;  // towards zero
  if (f < 0 && top != bits) top += 0x10000u;  // one step further from zero
  std::memcpy(&f, &top, sizeof f);
  return f;
}
double bf16_below(double b) {
  float f = static_cast<float>(b);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits = f > 0 ? bits - 0x10000u : bits + 0x10000u;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Settle every row (settle_row, in parallel), then run the kernel on the rows it could not:
// torch.argmax's answer of their logits (argmax_cpu).
template <typename S, typename T>
void settle_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                 const at::Tensor& approx, const std::vector<float>& cuts, int64_t* out) {
  const int64_t M = x.size(0), K = x.size(1);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      out[m] = settle_row<S>(x.data_ptr<T>() + m * x.stride(0), packed.data_ptr<T>(), K, N,
                             approx.data_ptr<float>() + m * N, cuts[m]);
    }
  });
  std::vector<int64_t> unsettled;
  for (int64_t m = 0; m < M; ++m) {
    if (out[m] < 0) unsettled.push_back(m);
  }
  if (unsettled.empty()) return;
  const int64_t U = static_cast<int64_t>(unsettled.size());
  at::Tensor rows = at::empty({U, K}, x.options());
  for (int64_t i = 0; i < U; ++i) {
    std::memcpy(rows.data_ptr<T>() + i * K, x.data_ptr<T>() + unsettled[i] * x.stride(0),
                K * sizeof(T));
  }
  const at::Tensor picked =
      argmax_cpu(linear_cpu(rows, packed, N, std::nullopt, std::nullopt, "none"));
  for (int64_t i = 0; i < U; ++i) out[unsettled[i]] = picked.data_ptr<int64_t>()[i];
}

}  // namespace
#endif

bool cpu_linear_supported(at::ScalarType dtype) {
#ifdef CBATCH_X86
  static const bool bf16 = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return dtype == at::kFloat ? cpu_has_avx512() || cpu_has_avx2()
                             : dtype == at::kBFloat16 && bf16;
#else
  (void)dtype;
  return false;
#endif
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual, const std::string& activation) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK_VALUE(x.stride(1) == 1, "x's rows must be dense");
  TORCH_CHECK_TYPE(packed.scalar_type() == x.scalar_type(), "x is ", x.scalar_type(),
                   " but the packed weight is ", packed.scalar_type());
  TORCH_CHECK_VALUE(cpu_linear_supported(x.scalar_type()), "cbatch's CPU linear runs ",
                    x.scalar_type(), " only on an x86 CPU with ",
                    x.scalar_type() == at::kBFloat16 ? "AVX-512 and AVX512-BF16"
                                                     : "AVX2 and FMA, or AVX-512");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  TORCH_CHECK_VALUE(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == blocks &&
                        packed.size(1) == K && packed.size(2) == kBlock,
                    "packed weight ", packed.sizes(), " does not hold ", N, " x ", K);
  TORCH_CHECK_VALUE(x.scalar_type() != at::kBFloat16 || K % 2 == 0,
                    "bf16 needs an even number of input features, got ", K);
  TORCH_CHECK_VALUE(activation == "none" || activation == "gelu_tanh",
                    "activation must be 'none' or 'gelu_tanh', got '", activation, "'");
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                          bias->scalar_type() == x.scalar_type(),
                      "bias must be a dense [", N, "] of x's dtype");
  }
  if (residual) {
    TORCH_CHECK_VALUE(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                          residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                      "residual must be [", M, ", ", N, "] with dense rows, of x's dtype");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#ifdef CBATCH_X86
  if (x.scalar_type() == at::kFloat) {
    const Args<float> args{x.data_ptr<float>(), x.stride(0), M, K, N, nullptr,
                           packed.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                           residual ? residual->data_ptr<float>() : nullptr,
                           residual ? residual->stride(0) : 0, activation == "gelu_tanh",
                           out.data_ptr<float>()};
    if (cpu_has_avx512()) {
      run<Avx512>(args);
    } else {
      run<Avx2>(args);
    }
  } else {
    using B16 = c10::BFloat16;
    run<Avx512>(Args<B16>{x.data_ptr<B16>(), x.stride(0), M, K, N, nullptr, packed.data_ptr<B16>(),
                  bias ? bias->data_ptr<B16>() : nullptr,
                  residual ? residual->data_ptr<B16>() : nullptr,
                  residual ? residual->stride(0) : 0, activation == "gelu_tanh",
                  out.data_ptr<B16>()});
  }
#endif
  return out;
}


bool greedy_head_supported(at::ScalarType dtype) {
#ifdef CBATCH_X86
  static const bool vnni = cpu_linear_supported(at::kBFloat16) &&
                           __builtin_cpu_supports("avx512vnni");
  return dtype == at::kFloat ? cpu_linear_supported(at::kFloat) : dtype == at::kBFloat16 && vnni;
#else
  (void)dtype;
  return false;
#endif
}

namespace {
#ifdef CBATCH_X86
using B16 = c10::BFloat16;

// The fp32 lm_head's bf16 screen (CPUs without the int8 one): each row's cut, then the tokens.
void greedy_fp32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& screen,
                 int64_t N, double w_norm, double screen_norm, double error_norm, int64_t* out) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xb = at::empty({M, K}, x.options().dtype(at::kBFloat16));  // x~
  std::vector<double> bound(M);  // B, in double
  const double u = std::ldexp(1.0, -24), gK = K * u / (1 - K * u),
               g2K = 2 * K * u / (1 - 2 * K * u);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x.data_ptr<float>() + m * x.stride(0);
    B16* rounded = xb.data_ptr<B16>() + m * K;
    double nx = 0, nxb = 0, ndx = 0;
    for (int64_t k = 0; k < K; ++k) {
      rounded[k] = B16(row[k]);
      const double v = row[k], vb = static_cast<float>(rounded[k]);
      nx += v * v, nxb += vb * vb, ndx += (v - vb) * (v - vb);
    }
    nx = std::sqrt(nx), nxb = std::sqrt(nxb), ndx = std::sqrt(ndx);
    const double tiny = std::ldexp(1.0, -100) * K * (1 + nxb + screen_norm);
    double b = gK * nx * w_norm + g2K * nxb * screen_norm + ndx * w_norm + nxb * error_norm +
               tiny;
    // no sum can overflow below this (each partial sum is at most |x| |w_j|)
    if (!(nx * w_norm < 1e37 && nxb * screen_norm < 1e37)) b = INFINITY;
    bound[m] = b * (1 + 1e-6);  // the double arithmetic's own rounding
  }
  at::Tensor approx = at::empty({M, N}, x.options());
  const Args<B16, float> args{xb.data_ptr<B16>(), K, M, K, N, nullptr, screen.data_ptr<B16>(),
                              nullptr, nullptr, 0, false, approx.data_ptr<float>()};
  if (cpu_linear_supported(at::kBFloat16)) {  // vdpbf16ps
    run<Avx512>(args);
  } else {  // bf16 widened to fp32 in registers
    run<Avx2>(args);
  }
  const at::Tensor top = argmax_cpu(approx);
  std::vector<float> cuts(M);
  for (int64_t m = 0; m < M; ++m) {
    cuts[m] = float_below(approx.data_ptr<float>()[m * N + top.data_ptr<int64_t>()[m]] -
                          2 * bound[m]);
  }
  if (cpu_has_avx512()) {
    settle_rows<Screen512, float>(x, packed, N, approx, cuts, out);
  } else {
    settle_rows<Screen2, float>(x, packed, N, approx, cuts, out);
  }
}

// An int8 screen (copy and column scales) of a bf16 or fp32 (T) lm_head: each row's cut,
// then the tokens.
template <typename T>
void greedy_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& screen,
                 const at::Tensor& scales, int64_t N, double w_norm, double screen_norm,
                 double error_norm, int64_t* out) {
  const int64_t M = x.size(0), K = x.size(1);
  // |p_k| <= levels: no int32 sum of K products with |q| <= 128 can overflow
  const int64_t levels = std::min<int64_t>(32767, ((int64_t(1) << 31) - 1) / (128 * K));
  TORCH_CHECK_VALUE(levels >= 1, "the int8 screen takes K below 2^24, got ", K);
  at::Tensor p = at::empty({M, K}, x.options().dtype(at::kShort));
  std::vector<double> bound(M), unit(M);  // B and t
  // the kernel's own rounding: fp32 one fma per k, bf16 two roundings per pair (in any order)
  const double u = std::ldexp(1.0, -24), n = std::is_same_v<T, float> ? K : 2 * K,
               gamma = n * u / (1 - n * u);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x.data_ptr<T>() + m * x.stride(0);
      int16_t* q = p.data_ptr<int16_t>() + m * K;
      double top = 0, nx = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double v = static_cast<float>(row[k]);
        top = std::max(top, std::fabs(v)), nx += v * v;  // NaN: top stays, nx is NaN
      }
      nx = std::sqrt(nx);
      // no sum can overflow below this; x = 0 ties every column; NaN or infinity in x
      if (!(nx * w_norm < 1e37 && top > 0 && std::isfinite(top))) {
        std::fill(q, q + K, int16_t(0));
        bound[m] = INFINITY, unit[m] = 1;
        continue;
      }
      int e = 0;
      std::frexp(top / levels, &e);
      const double t = std::ldexp(1.0, e), inv = std::ldexp(1.0, -e);  // t >= top / levels
      double ndx = 0, nq = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double v = static_cast<float>(row[k]);
        const double level = std::nearbyint(v * inv);
        q[k] = static_cast<int16_t>(level);
        ndx += (v - t * level) * (v - t * level), nq += (t * level) * (t * level);
      }
      ndx = std::sqrt(ndx), nq = std::sqrt(nq);
      const double tiny = std::ldexp(1.0, -100) * K * (1 + nx + w_norm);
      const double b = gamma * nx * w_norm + ndx * w_norm + nq * error_norm +
                       2.01 * u * nq * screen_norm + tiny;
      bound[m] = b * (1 + 1e-6), unit[m] = t;
    }
  });
  at::Tensor approx = at::empty({M, N}, x.options().dtype(at::kFloat));
  Args<int8_t, float> args{p.data_ptr<int16_t>(), K, M, K, N, nullptr,
                           screen.data_ptr<int8_t>(), nullptr, nullptr, 0, false,
                           approx.data_ptr<float>()};
  args.scale = scales.data_ptr<float>();
  run<Avx512>(args);
  const at::Tensor top = argmax_cpu(approx);
  std::vector<float> cuts(M);
  for (int64_t m = 0; m < M; ++m) {
    const double t = unit[m];
    const double lb = t * approx.data_ptr<float>()[m * N + top.data_ptr<int64_t>()[m]] - bound[m];
    if constexpr (std::is_same_v<T, float>) {  // the fp32 logit of a dropped column < lb
      cuts[m] = float_below((lb - bound[m]) / t);
    } else {  // bf16: its logit one bf16 step below the top's
      cuts[m] = NAN;  // settle nothing: the bound may reach bf16's subnormals, or is infinite
      if (std::fabs(lb) >= std::ldexp(1.0, -125) && std::fabs(lb) < 1e38) {
        cuts[m] = float_below((bf16_below(bf16_floor(lb)) - bound[m]) / t);
      }
    }
  }
  settle_rows<Screen512, T>(x, packed, N, approx, cuts, out);
}
#endif
}  // namespace

at::Tensor greedy_head_cpu(const at::Tensor& x, const at::Tensor& packed,
                           const at::Tensor& screen, int64_t out_features, double w_norm,
                           double screen_norm, double error_norm,
                           const std::optional<at::Tensor>& scales) {
  const bool int8 = screen.scalar_type() == at::kChar, bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK_TYPE(
      int8 ? (x.scalar_type() == at::kFloat || bf16) && packed.scalar_type() == x.scalar_type() &&
                 scales && scales->scalar_type() == at::kFloat
           : x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat &&
                 screen.scalar_type() == at::kBFloat16 && !scales,
      "greedy_head takes an fp32 x and packed weight with a bf16 screen and no scales, or an "
      "fp32 or bf16 x and packed weight with an int8 screen and fp32 scales; got ",
      x.scalar_type(), ", ", packed.scalar_type(), ", ", screen.scalar_type(),
      scales ? " and scales" : " and no scales");
  // where the kernel runs, whose sums settle_row reproduces (and, int8, vpdpwssd)
  TORCH_CHECK_VALUE(greedy_head_supported(int8 ? at::kBFloat16 : at::kFloat),
                    "greedy_head runs ", int8 ? "an int8" : "a bf16",
                    " screen only on an x86 CPU with ",
                    int8 ? "AVX-512, AVX512-BF16 and AVX512-VNNI" : "AVX2 and FMA, or AVX-512");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with dense rows, got ",
                    x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  for (const at::Tensor* w : {&packed, &screen}) {
    TORCH_CHECK_VALUE(w->is_contiguous() && w->dim() == 3 && w->size(0) == blocks &&
                          w->size(1) == K && w->size(2) == kBlock,
                      "packed weight ", w->sizes(), " does not hold ", N, " x ", K);
  }
  TORCH_CHECK_VALUE(K % 2 == 0 && N > 0, "greedy_head needs an even K and N > 0, got K = ", K,
                    ", N = ", N);
  TORCH_CHECK_VALUE(!(w_norm < 0 || screen_norm < 0 || error_norm < 0),
                    "greedy_head's norms cannot be negative, got ", w_norm, ", ", screen_norm,
                    ", ", error_norm);
  if (scales) {
    TORCH_CHECK_VALUE(scales->is_contiguous() && scales->dim() == 1 && scales->size(0) == N,
                      "scales must be a dense [", N, "], got ", scales->sizes());
  }
  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return tokens;
#ifdef CBATCH_X86
  if (bf16 && M >= kPackFrom) {  // compute-bound: the int8 screen saves nothing (kMaxBlocks)
    return argmax_cpu(linear_cpu(x, packed, N, std::nullopt, std::nullopt, "none"));
  }
  if (bf16) {
    greedy_int8<B16>(x, packed, screen, *scales, N, w_norm, screen_norm, error_norm,
                     tokens.data_ptr<int64_t>());
  } else if (int8) {
    greedy_int8<float>(x, packed, screen, *scales, N, w_norm, screen_norm, error_norm,
                       tokens.data_ptr<int64_t>());
  } else {
    greedy_fp32(x, packed, screen, N, w_norm, screen_norm, error_norm,
                tokens.data_ptr<int64_t>());
  }
#endif
  return tokens;
}

}  // namespace cbatch
