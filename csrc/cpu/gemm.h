// The packed GEMM of the CPU linear op (linear.cpp) and of the greedy head's screens
// (greedy_head.cpp), for any number of rows: out = x @ W^T + bias, then GELU (tanh) if asked,
// plus a residual (the linear op), or the int8 screen's int32 sums times its column scales.  A
// decode step's few rows stream every weight once, at memory bandwidth; many rows are packed
// and go through in chunks that stay in L2 (below).  Tiles for AVX-512 (namespace avx512:
// fp32, bf16 with AVX512-BF16, int8 with AVX512-VNNI) and for AVX2 + FMA (namespace avx2:
// fp32, bf16 widened to fp32 in registers, out in bf16 or, for the screens, fp32, and int8 for
// the screens), and the row and column loop they share (run_gemm); the bf16 GEMM of many rows
// on AMX tiles is amx_bf16_linear.h's.
//
// The weight is packed once (cbatch/ops/cpu.py, pack) into blocks of 16 output
// columns, each block a run of K "rows" of 16 columns: fp32 [N/16, K, 16]; bf16 and int8
// [N/16, K/2, 16, 2] (pairs of k side by side, the operand layout of vdpbf16ps).  One work
// item is some blocks of columns (AVX-512: two, AVX2: one), each read front to back; it runs
// rows of x through them a tile at a time, the tile's sums in registers.  From kPackFrom rows
// on, x is first copied into groups of kPackedRows rows (the broadcasts then read one stream),
// and rows go through in chunks of kChunkRows.  Weights are prefetched ahead of the loads, and
// passes of rows over an item also bring the next item's weights into L2 (prefetch_ahead).
// Each output element is one thread's sum over k in order, so a row's result does not depend
// on the other rows nor on the thread count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#include "avx2.h"
#include "avx512.h"

namespace cbatch {

constexpr int64_t kBlock = 16;  // output columns per packed block

#ifdef CBATCH_X86
// Everything below sits in unnamed namespaces: each file that includes this header gets its
// own copy of the functions it uses, called directly (not through the PLT, as a function
// another library could replace would be) and optimised as local functions.
namespace {

constexpr int kPackedRows = 8;  // rows of x per packed group (the AVX-512 tile's rows)
constexpr int64_t kPackFrom = 2 * kPackedRows;  // rows from which x is packed
// Rows go through in chunks that stay in each core's L2 while every column item reads them;
// the weights then stream once per chunk (from L3, where a layer's weights fit).
constexpr int64_t kChunkRows = 64;

// How far ahead of its loads each block's stream is prefetched.  With a full tile of rows the
// loop spends few multiply-adds per cache line, and the out-of-order window then holds too few
// loads to keep DRAM busy on the hardware prefetchers alone (benchmarks/NOTES.md, "Software
// prefetch in the linear kernel").
constexpr int64_t kPrefetchBytes = 3072;

// The tile loads p; kNext: it also brings the same place of the next item (next_item elements
// on) into L2.  Which passes of rows over a column item do that (avx512::column_item,
// avx2::Gemm::item):
// - Few rows (one pass of tiles): the first pass, so the next item is fetched from DRAM a
//   whole item ahead of its loads.  kPrefetchBytes ahead alone hides DRAM's latency only
//   while the loop waits on memory; where the multiply-adds keep pace with the stream the two
//   add up instead of overlapping (benchmarks/NOTES.md, "Software prefetch in the linear kernel").
// - More rows: the passes after the first, which read the item from L2 while DRAM would
//   otherwise idle ("Software prefetch in the linear kernel").
// Baseline x86-64 (prefetch is SSE): the AVX-512 and the AVX2 tiles share it.
template <bool kNext, typename T>
CBATCH_INLINE void prefetch_ahead(const T* p, int64_t next_item) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
  if constexpr (kNext) _mm_prefetch(reinterpret_cast<const char*>(p + next_item), _MM_HINT_T1);
}

// The type of x for a weight of type T: T, or int16 for the int8 weight of an lm_head's
// greedy screen (vpdpwssd and vpmaddwd multiply pairs of int16; the weight is widened in
// registers).
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

// x's rows in groups of kPackedRows, each group [K / pairs][kPackedRows][pairs] (zero rows
// past M): the tile's broadcasts then read one stream instead of rows far apart (for many
// rows; a few rows stay in cache as they are).
template <typename T, typename O>
void pack_rows(const Args<T, O>& a, X<T>* xp) {
  constexpr int64_t P = kPairs<T>;
  const int64_t groups = (a.M + kPackedRows - 1) / kPackedRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      X<T>* dst = xp + g * kPackedRows * a.K;
      for (int64_t r = 0; r < kPackedRows; ++r) {
        const int64_t m = g * kPackedRows + r;
        for (int64_t k = 0; k < a.K; k += P) {
          for (int64_t p = 0; p < P; ++p) {
            dst[(k / P) * kPackedRows * P + r * P + p] =
                m < a.M ? a.x[m * a.ldx + k + p] : X<T>(0);
          }
        }
      }
    }
  });
}

}  // namespace

// ---- AVX-512: a tile is up to 8 rows times two blocks of 16 columns (16 zmm sums). ---------
namespace avx512 {
namespace {

constexpr int kRows = kPackedRows;  // rows of x per register tile

// GELU, tanh approximation: 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v^3), with
// 1 + tanh(u) = 2 - 2 / (1 + e^(2u)).
CBATCH_AVX512 CBATCH_INLINE __m512 gelu_tanh(__m512 v) {
  const __m512 u = _mm512_mul_ps(
      _mm512_set1_ps(0.7978845608028654f),
      _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), v), _mm512_mul_ps(v, v), v));
  const __m512 e = exp(_mm512_add_ps(u, u));
  const __m512 two = _mm512_set1_ps(2.f);
  const __m512 one_plus_tanh =
      _mm512_sub_ps(two, _mm512_div_ps(two, _mm512_add_ps(e, _mm512_set1_ps(1.f))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v), one_plus_tanh);
}

// acc[r][b] for R rows and B blocks of 16 columns: x[r] . W over all K.
// Row r's element k of x is x[r * rs + k * ks].
template <int R, int B, bool kNext>
CBATCH_AVX512 CBATCH_INLINE void dot_tile(const float* x, int64_t rs, int64_t ks,
                                          const float* w, int64_t K, __m512 (&acc)[kRows][2]) {
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
CBATCH_AVX512_DOT CBATCH_INLINE void dot_tile(const c10::BFloat16* x, int64_t rs, int64_t ks,
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
CBATCH_AVX512_DOT CBATCH_INLINE __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// int16 x and int8 W (pairs of k, as bf16 is packed; the greedy screen of an lm_head):
// exact int32 sums, kept in acc's bits (the caller's scale keeps them from overflowing).
template <int R, int B, bool kNext>
CBATCH_AVX512_DOT CBATCH_INLINE void dot_tile(const int16_t* x, int64_t rs, int64_t ks,
                                              const int8_t* w, int64_t K,
                                              __m512 (&acc)[kRows][2]) {
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
      const __m512 scale = load(a.scale + col, mask);
      for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_castps_si512(acc[r][b]));
        store(a.out + (m + r) * a.N + col, _mm512_mul_ps(sum, scale), mask);
      }
    } else {
      const __m512 bias = a.bias ? load(a.bias + col, mask) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        __m512 v = _mm512_add_ps(acc[r][b], bias);
        if (a.gelu) v = gelu_tanh(v);
        if (a.residual) v = _mm512_add_ps(load(a.residual + (m + r) * a.ldr + col, mask), v);
        store(a.out + (m + r) * a.N + col, v, mask);
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

// An item is two blocks (the last may be one).
struct Gemm {
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

}  // namespace
}  // namespace avx512

// ---- AVX2 + FMA: CPUs without AVX-512, e.g. AMD Zen 2/3, Intel before Ice Lake.  fp32 and
// bf16 linear layers (bf16 widened to fp32 in registers, the sums fp32), and bf16 in / fp32
// out and int16 x int8 W for the greedy head's screens.  The same packed layout and loop; a
// tile is kRows rows times one block of 16 columns (two 8-lane halves): 8 of the 16 ymm
// registers hold sums, 2 (bf16: 4) the block's weights.
namespace avx2 {
namespace {

constexpr int kRows = 4;  // rows of x per register tile

// avx512::gelu_tanh on 8 lanes (exp's clamp leaves it as it is: 1 + tanh(u) is 0 or 2 there).
CBATCH_AVX2 inline __m256 gelu_tanh(__m256 v) {
  const __m256 u = _mm256_mul_ps(
      _mm256_set1_ps(0.7978845608028654f),
      _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), v), _mm256_mul_ps(v, v), v));
  const __m256 e = exp(_mm256_add_ps(u, u));
  const __m256 two = _mm256_set1_ps(2.f);
  const __m256 one_plus_tanh =
      _mm256_sub_ps(two, _mm256_div_ps(two, _mm256_add_ps(e, _mm256_set1_ps(1.f))));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), one_plus_tanh);
}

// acc[r][h] (h: the block's two 8-column halves) += x[r] . W over all K, as tile sums it.
// Row r's element k of x is x[r * rs + k * ks].  kNext: as prefetch_ahead (the next item is
// the next block).
template <int R, bool kNext>
CBATCH_AVX2 CBATCH_INLINE void dot_tile(const float* x, int64_t rs, int64_t ks, const float* w,
                                        int64_t K, __m256 (&acc)[kRows][2]) {
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
// `pair & 0xffff0000`.  Each sum is fp32 fmas from zero, k = 0, 1, 2, ... in order, one
// rounding per k (a bf16 linear's logits, which an exact screen reproduces bit for bit; the
// fp32 screen's bound holds for sums of the K products in any order, its `tiny` term covering
// products that underflow).
CBATCH_AVX2 CBATCH_INLINE __m256 low_bf16(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
CBATCH_AVX2 CBATCH_INLINE __m256 high_bf16(__m256i pairs, __m256i high) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
}

template <int R, bool kNext>
CBATCH_AVX2 CBATCH_INLINE void dot_tile(const c10::BFloat16* x, int64_t rs, int64_t ks,
                                        const c10::BFloat16* w, int64_t K,
                                        __m256 (&acc)[kRows][2]) {
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

// int16 x and int8 W (pairs of k, as packed; the greedy screen of an lm_head), avx512's
// vpdpwssd tile on AVX2: W's int8 pairs widened to int16 (vpmovsxbw), vpmaddwd's exact int32
// sum of each pair's two products, added into int32 sums kept in acc's bits.  No sum wraps
// where the caller's scale keeps every partial sum within int32 (greedy_head.cpp), so the
// sums are avx512's bit for bit.
template <int R, bool kNext>
CBATCH_AVX2 CBATCH_INLINE void dot_tile(const int16_t* x, int64_t rs, int64_t ks,
                                        const int8_t* w, int64_t K, __m256 (&acc)[kRows][2]) {
  const int64_t next_item = K * kBlock;  // in int8 elements
  __m256i sum[kRows][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    sum[r][0] = _mm256_castps_si256(acc[r][0]), sum[r][1] = _mm256_castps_si256(acc[r][1]);
  }
  for (int64_t k = 0; k < K; k += 2) {
    const int8_t* wk = w + k * kBlock;  // 16 columns x 2 k: columns 0-7, then 8-15
    prefetch_ahead<kNext>(wk, next_item);
    const __m128i* half = reinterpret_cast<const __m128i*>(wk);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(half)),
                  w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(half + 1));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * rs + k * ks, sizeof pair);
      const __m256i p = _mm256_set1_epi32(pair);
      sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(p, w0));
      sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(p, w1));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_castsi256_ps(sum[r][0]), acc[r][1] = _mm256_castsi256_ps(sum[r][1]);
  }
}

// The first n of 8 elements (n in [1, 8]) as fp32, the others 0; mask is first_lanes(n).
CBATCH_AVX2 CBATCH_INLINE __m256 load_first(const float* p, int64_t, __m256i mask) {
  return _mm256_maskload_ps(p, mask);
}
CBATCH_AVX2 CBATCH_INLINE __m256 load_first(const c10::BFloat16* p, int64_t n, __m256i) {
  if (n >= 8) return load(p);
  c10::BFloat16 part[8] = {};
  std::memcpy(part, p, n * sizeof *p);
  return load(part);
}

// fp32 to bf16 as torch casts it: rounded to nearest even, a NaN to the quiet NaN 0x7fc0
// (vcvtneps2bf16 rounds alike, but flushes subnormals to zero and keeps a NaN's sign and top
// payload bits); 8 lanes in the low 16 bits of each 32-bit one.
CBATCH_AVX2 CBATCH_INLINE __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0),
                         _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // each lane is below 2^16: packus keeps it; lanes 0-3 and 4-7 land in 64-bit parts 0 and 2
  return _mm256_castsi256_si128(
      _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), _MM_SHUFFLE(3, 1, 2, 0)));
}

// The first n of v's 8 lanes (n in [1, 8]) to p, rounded to p's type; mask is first_lanes(n).
CBATCH_AVX2 CBATCH_INLINE void store_first(float* p, __m256 v, int64_t, __m256i mask) {
  _mm256_maskstore_ps(p, mask, v);
}
CBATCH_AVX2 CBATCH_INLINE void store_first(c10::BFloat16* p, __m256 v, int64_t n, __m256i) {
  const __m128i h = to_bf16(v);
  if (n >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  c10::BFloat16 part[8];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(part), h);
  std::memcpy(p, part, n * sizeof *p);
}

// Rows [m, m + R) times the block that starts at column n; epilogue; store.  T in, O out:
// fp32 in and out; bf16 in and out (the linear layers); bf16 in, fp32 out, and int16 x and
// int8 W, the int32 sums times the column scales, fp32 out (the greedy head's screens, with no
// bias, GELU or residual).  The epilogue is avx512::tile's: the fp32 sum + the bias (0 where
// there is none), then GELU, then + the residual, in fp32, rounded to O once at the store.
template <typename T, typename O, int R, bool kNext>
CBATCH_AVX2 CBATCH_INLINE void tile(const Args<T, O>& a, int64_t m, int64_t n) {
  __m256 acc[kRows][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const T* w = a.w + (n / kBlock) * a.K * kBlock;
  // Row r's broadcast at k is x[r * rs + k * ks] (packed: groups of kPackedRows rows,
  // k-major).
  constexpr int64_t P = kPairs<T>;
  const X<T>* x = a.xp ? a.xp + (m / kPackedRows) * kPackedRows * a.K + (m % kPackedRows) * P
                       : a.x + m * a.ldx;
  dot_tile<R, kNext>(x, a.xp ? P : a.ldx, a.xp ? kPackedRows : 1, w, a.K, acc);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // unrolled, so that acc stays in registers
    const int64_t col = n + 8 * h;
    if (col >= a.N) continue;
    const int64_t lanes = a.N - col;
    const __m256i mask = first_lanes(lanes);
    if constexpr (std::is_same_v<T, int8_t>) {  // the screen: int32 sums times column scales
      const __m256 scale = _mm256_maskload_ps(a.scale + col, mask);
      for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_castps_si256(acc[r][h]));
        store_first(a.out + (m + r) * a.N + col, _mm256_mul_ps(sum, scale), lanes, mask);
      }
    } else {
      const __m256 bias = a.bias ? load_first(a.bias + col, lanes, mask) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        __m256 v = _mm256_add_ps(acc[r][h], bias);
        if (a.gelu) v = gelu_tanh(v);
        if (a.residual) {
          v = _mm256_add_ps(load_first(a.residual + (m + r) * a.ldr + col, lanes, mask), v);
        }
        store_first(a.out + (m + r) * a.N + col, v, lanes, mask);
      }
    }
  }
}

// Rows [m, m_end) times the block that starts at column n, kRows at a time, then the rest.
template <typename T, typename O, bool kNext>
CBATCH_AVX2 void passes(const Args<T, O>& a, int64_t n, int64_t m, int64_t m_end) {
  for (; m + kRows <= m_end; m += kRows) tile<T, O, kRows, kNext>(a, m, n);
  switch (m_end - m) {
    case 3: return tile<T, O, 3, kNext>(a, m, n);
    case 2: return tile<T, O, 2, kNext>(a, m, n);
    case 1: return tile<T, O, 1, kNext>(a, m, n);
    default: return;
  }
}

// An item is one block; with next, passes prefetch the next one: the first below two passes
// of rows, else the later ones (as avx512::column_item; benchmarks/NOTES.md, "cbatch's kernel
// on AVX2").
struct Gemm {
  static constexpr int64_t kItemBlocks = 1;
  static constexpr int64_t kRowsPerPass = kRows;
  static constexpr int64_t kL2Budget = 256 << 10;  // half of a Zen 2/3 core's L2
  template <typename T, typename O>
  static void item(const Args<T, O>& a, int64_t block, int64_t, int64_t m0, int64_t m1,
                   bool next) {
    static_assert(std::is_same_v<O, T> || std::is_same_v<O, float>,
                  "the AVX2 kernel writes its input's type or fp32");
    const int64_t n = block * kBlock;
    if (!next) return passes<T, O, false>(a, n, m0, m1);
    const int64_t first = std::min(m1, m0 + kRows);  // one tile
    if (m1 - m0 < 2 * kRows) {
      passes<T, O, true>(a, n, m0, first);
      return passes<T, O, false>(a, n, first, m1);
    }
    passes<T, O, false>(a, n, m0, first);
    passes<T, O, true>(a, n, first, m1);
  }
};

}  // namespace
}  // namespace avx2

namespace {

// x packed (from kPackFrom rows), then chunks of rows, each over every column item (Isa:
// avx512::Gemm or avx2::Gemm), the items shared out among threads.
template <typename Isa, typename T, typename O>
void run_gemm(Args<T, O> a) {
  std::unique_ptr<X<T>[]> xp;  // every element written by pack_rows: no zeroing first
  if (a.M >= kPackFrom) {
    xp.reset(new X<T>[(a.M + kPackedRows - 1) / kPackedRows * kPackedRows * a.K]);
    pack_rows(a, xp.get());
    a.xp = xp.get();
  }
  // The next item is prefetched only while what must stay in L2 meanwhile fills at most half
  // of it: a chunk of rows, the next item and, with more than one pass of rows, the current
  // one (with a long K the next item pushed the rows out, and the kernel ran slower).
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

}  // namespace
#endif  // CBATCH_X86

}  // namespace cbatch
