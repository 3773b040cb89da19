// The CPU linear op on quantized weights (W8A16, W4A16): y = x @ W^T + bias, where
// W[n, k] = scales[g, n] * (q[n, k] - zeros[g, n]) for the group g = k / group_size, dequantized
// in registers from cbatch's packed layout (cbatch/layers/quantization/weight.py), so that a
// decode step streams 1 (int8) or 1/2 (int4) byte per weight instead of bf16's 2.
//
// Layout, blocks of 16 output columns as the dense linear's (gemm.h), padded to N16 columns:
// - bits 8: q int8 [N16 / 16, K, 16], signed; zeros int8 [G, N16] or none (0);
// - bits 4: q uint8 [N16 / 16, ceil(K / 2), 16], byte j of row i holding column j's q[2i] in
//   its low nibble and q[2i + 1] in its high one (0 past K); zeros int8 [G, N16] in [0, 15] or
//   none (8);
// - scales fp32 [G, N16], G = ceil(K / group_size) (group_size even for int4, or K).
//
// The arithmetic: q - z in integers (exact), converted to fp32, and within a group fp32 fmas
// with x (bf16 x widened to fp32) in k order, in two interleaved partial sums (even and odd
// k: two fma chains in flight per row); at the group's end its sum times the group's scale is
// added to the output's (one fma), so the scale costs one multiply per group, not per weight.
// Every product is exact inside its fma, so each output is within gamma_{K+3} sum |x| |W| of
// the exact one (tests/ops/test_quantized_linear.py).  Each output's order of operations is
// fixed by k alone: a row's result depends neither on the other rows nor on the thread count.
// A tile is up to kRows rows times two vectors of columns (AVX-512: two blocks of 16; AVX2:
// one block's two halves of 8); its loop, quantized_tile.h, is one source for both ISAs.  More
// rows than a tile holds (a batch, a prefill) take tile_rows: each chunk of k is dequantized
// once into a buffer that every row tile then reads, in the very order of the one-tile loop.
// int4 on a bf16 x, where the CPU has AVX512-BF16, takes its own loop (bf16q below): each
// weight's q - z as a bf16 (exact) and vdpbf16ps on x's bf16 pairs, half the multiply-add
// instructions of the fp32 loop and no fp32 copy of x; the same bound, and the same
// independence of rows.
//
// Mins (llama.cpp's Q4_K / Q5_K, Q4_1 / Q5_1): W[n, k] = scales[g, n] * q[n, k] - mins[g, n],
// zeros none and no zero point (int4's q as stored, 0..15).  Then sum_k x W over a group is
// s sum_k x q - m sum_k x: the loops above run on q as they are, and at each group's end,
// after the scaled sum, one more fma subtracts m times the row's sum of x over the group
// (group_sums: computed once per row and group before the tiles, not per column).  Each
// output is then within gamma_{K+4} sum |x| (|s q| + |m|) of the exact one.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "../ops.h"
#include "avx2.h"
#include "avx512.h"

namespace cbatch {

bool quantized_linear_supported() {
#ifdef CBATCH_X86
  return cpu_has_avx512() || cpu_has_avx2();
#else
  return false;
#endif
}

namespace {

constexpr int64_t kQBlock = 16;     // output columns per packed block
constexpr int64_t kChunkRows = 64;  // rows per pass over the weights (they stay in L2)
constexpr int64_t kChunkK = 256;    // k dequantized at a time for many rows (even)

struct QArgs {
  const float* x;  // [M, K] fp32, rows ldx apart (null on the bf16 path)
  const c10::BFloat16* xb;  // [M, K] bf16, rows ldx apart (the bf16 path's; else null)
  int64_t ldx, M, K, N, N16;
  int bits;
  int64_t group_size, groups;
  const uint8_t* q;      // packed (int8 or uint8 bytes)
  const float* scales;   // [G, N16]
  const int8_t* zeros;   // [G, N16] or null
  int32_t zero;          // the zero point where zeros is null: int4 8, int8 0; with mins 0
  const float* mins;     // [G, N16] or null
  const float* xsum;     // [M, G] each row's sum of x per group (with mins; else null)
  const float* bias;     // [N] fp32 or null
  float* out;            // [M, N] fp32
};

// Bytes of one block's run of packed rows.
inline int64_t block_bytes(const QArgs& a) {
  return (a.bits == 8 ? a.K : (a.K + 1) / 2) * kQBlock;
}

#ifdef CBATCH_X86
// ---- AVX-512: vectors of 16 columns; a tile's two vectors are two blocks, or the last block
// alone. ------------------------------------------------------------------------------------
namespace avx512q {

using Vec = __m512;
using IVec = __m512i;
constexpr int64_t kLanes = 16;
constexpr int kRows = 4;  // rows per tile: 4 rows x 2 vectors x 2 partial sums = 16 zmm
constexpr int kAccRows = 4;  // tile_rows' rows at a time (accumulate): the same
constexpr int64_t kBlocksPerItem = 2;
constexpr int kPrefetchVectors = 2;  // each vector is its own block's stream

CBATCH_AVX512 CBATCH_INLINE Vec zero() { return _mm512_setzero_ps(); }
CBATCH_AVX512 CBATCH_INLINE Vec set1(float v) { return _mm512_set1_ps(v); }
CBATCH_AVX512 CBATCH_INLINE IVec set1i(int32_t v) { return _mm512_set1_epi32(v); }
CBATCH_AVX512 CBATCH_INLINE Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
CBATCH_AVX512 CBATCH_INLINE Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
CBATCH_AVX512 CBATCH_INLINE Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
// kLanes bytes, sign- or zero-extended to int32 lanes
CBATCH_AVX512 CBATCH_INLINE IVec load_i8(const void* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
CBATCH_AVX512 CBATCH_INLINE IVec load_u8(const void* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
CBATCH_AVX512 CBATCH_INLINE IVec low_nibbles(IVec b) {
  return _mm512_and_si512(b, _mm512_set1_epi32(15));
}
CBATCH_AVX512 CBATCH_INLINE IVec high_nibbles(IVec b) { return _mm512_srli_epi32(b, 4); }
// q - z as fp32 (exact); kSub false: z is 0 (symmetric int8), nothing to subtract
template <bool kSub>
CBATCH_AVX512 CBATCH_INLINE Vec to_float(IVec q, IVec z) {
  return _mm512_cvtepi32_ps(kSub ? _mm512_sub_epi32(q, z) : q);
}
// The first min(n, kLanes) lanes (n >= 1); the others are zero and not read or written.
CBATCH_AVX512 CBATCH_INLINE Vec load_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(avx512::first_lanes(n), p);
}
CBATCH_AVX512 CBATCH_INLINE void store_first(float* p, Vec v, int64_t n) {
  _mm512_mask_storeu_ps(p, avx512::first_lanes(n), v);
}
// The tile's geometry: vector v is block + v.
inline int vectors(int64_t block, int64_t blocks) { return block + 1 < blocks ? 2 : 1; }
inline const uint8_t* vec_weights(const QArgs& a, int64_t block, int v) {
  return a.q + (block + v) * block_bytes(a);
}
inline int64_t vec_column(int64_t block, int v) { return (block + v) * kQBlock; }

#define CBATCH_Q_TARGET CBATCH_AVX512
#include "quantized_tile.h"
#undef CBATCH_Q_TARGET

}  // namespace avx512q

// ---- AVX2: vectors of 8 columns; a tile's two vectors are one block's halves. -------------
namespace avx2q {

using Vec = __m256;
using IVec = __m256i;
constexpr int64_t kLanes = 8;
constexpr int kRows = 2;  // rows per tile: 2 rows x 2 halves x 2 partial sums = 8 ymm
constexpr int kAccRows = 3;  // tile_rows' rows at a time: 12 sums, 2 weight vectors, 1 x
constexpr int64_t kBlocksPerItem = 1;
constexpr int kPrefetchVectors = 1;  // the two halves share each 16-byte row

CBATCH_AVX2 CBATCH_INLINE Vec zero() { return _mm256_setzero_ps(); }
CBATCH_AVX2 CBATCH_INLINE Vec set1(float v) { return _mm256_set1_ps(v); }
CBATCH_AVX2 CBATCH_INLINE IVec set1i(int32_t v) { return _mm256_set1_epi32(v); }
CBATCH_AVX2 CBATCH_INLINE Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
CBATCH_AVX2 CBATCH_INLINE Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
CBATCH_AVX2 CBATCH_INLINE Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
CBATCH_AVX2 CBATCH_INLINE IVec load_i8(const void* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}
CBATCH_AVX2 CBATCH_INLINE IVec load_u8(const void* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}
CBATCH_AVX2 CBATCH_INLINE IVec low_nibbles(IVec b) {
  return _mm256_and_si256(b, _mm256_set1_epi32(15));
}
CBATCH_AVX2 CBATCH_INLINE IVec high_nibbles(IVec b) { return _mm256_srli_epi32(b, 4); }
template <bool kSub>
CBATCH_AVX2 CBATCH_INLINE Vec to_float(IVec q, IVec z) {
  return _mm256_cvtepi32_ps(kSub ? _mm256_sub_epi32(q, z) : q);
}
CBATCH_AVX2 CBATCH_INLINE Vec load_first(const float* p, int64_t n) {
  return _mm256_maskload_ps(p, avx2::first_lanes(n));
}
CBATCH_AVX2 CBATCH_INLINE void store_first(float* p, Vec v, int64_t n) {
  _mm256_maskstore_ps(p, avx2::first_lanes(n), v);
}
// The tile's geometry: vector v is the block's half v (columns 8 v to 8 v + 7 of each row).
inline int vectors(int64_t, int64_t) { return 2; }
inline const uint8_t* vec_weights(const QArgs& a, int64_t block, int v) {
  return a.q + block * block_bytes(a) + kLanes * v;
}
inline int64_t vec_column(int64_t block, int v) { return block * kQBlock + kLanes * v; }

#define CBATCH_Q_TARGET CBATCH_AVX2
#include "quantized_tile.h"
#undef CBATCH_Q_TARGET

}  // namespace avx2q

// ---- AVX512-BF16, int4 weights and a bf16 x: vdpbf16ps. ------------------------------------
// A column's weights at k and k + 1 (one packed byte) become one bf16 pair: the integer
// u - z is in [-15, 15], a bf16 exactly, read from a table of the 31 values by vpermw at
// index u - z + 15 (both halves of a 32-bit lane at once); x's k and k + 1 are one 4-byte
// load, broadcast.  vdpbf16ps adds both products (each exact in fp32) to the lane's fp32 sum,
// one rounding each (denormal inputs and outputs flushed to zero, as the instruction does).
// Per group, pairs in k order alternate between two partial sums (two chains in flight per
// row), added and scaled at the group's end as the fp32 path does; the same order for every
// row whatever M (tile and tile_rows), so a row's result depends on nothing but that row.
// A last odd k (K odd, one group) pairs its weight with the byte's empty high nibble and x's
// k with 0.
namespace bf16q {

constexpr int kRows = 4;  // 4 rows x 2 vectors x 2 partial sums = 16 zmm
constexpr int64_t kPairs = kChunkK / 2;  // pairs of k dequantized at a time for many rows

// bf16 of i - 15 for i in [0, 31) (entry 31 unused), the table vpermw reads.
const uint16_t* integer_table() {
  alignas(64) static const auto table = [] {
    std::array<uint16_t, 32> t{};
    for (int i = 0; i < 31; ++i) t[i] = c10::BFloat16(static_cast<float>(i - 15)).x;
    return t;
  }();
  return table.data();
}

// 16 columns' pair of k at `row` (their packed bytes) as bf16 pairs, k's in each lane's low
// half; zz = (15 - z) in both halves of each lane.
CBATCH_AVX512_DOT CBATCH_INLINE __m512i pairs(const uint8_t* row, __m512i zz, __m512i table) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  // u_lo | u_hi << 16: the low nibble stays, the high one moves up 12 bits to bit 16
  const __m512i u = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)),
                                     _mm512_set1_epi32(0x000F000F));
  return _mm512_permutexvar_epi16(_mm512_add_epi32(u, zz), table);
}

// x's k and k + 1 in every lane (k + 1 < end), or k and 0.
CBATCH_AVX512_DOT CBATCH_INLINE __m512i x_pair(const c10::BFloat16* x, int64_t k, int64_t end) {
  int32_t pair = 0;
  if (k + 1 < end) {
    std::memcpy(&pair, x + k, 4);
  } else {
    std::memcpy(&pair, x + k, 2);
  }
  return _mm512_set1_epi32(pair);
}

CBATCH_AVX512_DOT CBATCH_INLINE __m512 dot(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(w), reinterpret_cast<__m512bh&>(x));
}

// Group g's scales, (15 - z) in both halves and mins (0 without) for the V vectors at col.
template <int V>
CBATCH_AVX512_DOT CBATCH_INLINE void group_scales(const QArgs& a, int64_t g, const int64_t* col,
                                                  __m512* s, __m512i* zz, __m512* mn) {
#pragma GCC unroll 2
  for (int v = 0; v < V; ++v) {
    s[v] = _mm512_loadu_ps(a.scales + g * a.N16 + col[v]);
    mn[v] = a.mins ? _mm512_loadu_ps(a.mins + g * a.N16 + col[v]) : _mm512_setzero_ps();
    const __m512i z = a.zeros ? _mm512_cvtepi8_epi32(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(a.zeros + g * a.N16 +
                                                                     col[v])))
                              : _mm512_set1_epi32(a.zero);
    const __m512i d = _mm512_sub_epi32(_mm512_set1_epi32(15), z);
    zz[v] = _mm512_or_si512(d, _mm512_slli_epi32(d, 16));
  }
}

// The V vectors' (blocks') packed weights and first columns from `block` on.
template <int V>
CBATCH_INLINE void starts(const QArgs& a, int64_t block, const uint8_t** w, int64_t* col) {
  for (int v = 0; v < V; ++v) {
    w[v] = a.q + (block + v) * block_bytes(a), col[v] = (block + v) * kQBlock;
  }
}

// Rows [m, m + M) of the output: out plus the bias, in the lanes before N.
template <int V>
CBATCH_AVX512_DOT CBATCH_INLINE void store_rows(const QArgs& a, int64_t m, int64_t M,
                                                const int64_t* col, const __m512 (*out)[2]) {
  for (int v = 0; v < V; ++v) {
    const int64_t n = a.N - col[v];
    if (n <= 0) continue;
    const __mmask16 lanes = avx512::first_lanes(n);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(lanes, a.bias + col[v])
                               : _mm512_setzero_ps();
    for (int64_t r = 0; r < M; ++r) {
      _mm512_mask_storeu_ps(a.out + (m + r) * a.N + col[v], lanes,
                            _mm512_add_ps(out[r][v], bias));
    }
  }
}

// Two pairs of k (k and k + 2, in [c, end)) of the rows [0, R) of x times the weights wv
// (their bf16 pairs; wv[1] unread past end) into partial sums 0 and 1.
template <int R, int V>
CBATCH_AVX512_DOT CBATCH_INLINE void dot_two(const c10::BFloat16* x, int64_t ldx, int64_t k,
                                             int64_t end, const __m512i (&w0)[2],
                                             const __m512i (&w1)[2], __m512 (&t)[kRows][2][2]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512i xv = x_pair(x + r * ldx, k, end);
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) t[r][v][0] = dot(t[r][v][0], w0[v], xv);
  }
  if (k + 2 >= end) return;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512i xv = x_pair(x + r * ldx, k + 2, end);
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) t[r][v][1] = dot(t[r][v][1], w1[v], xv);
  }
}

// Rows [m, m + R) times the V vectors (blocks) from `block` on, the weights dequantized in
// registers.  Pairs alternate between the partial sums from each group's start.
template <int R, int V>
CBATCH_AVX512_DOT void tile(const QArgs& a, int64_t m, int64_t block) {
  const __m512i table = _mm512_load_si512(integer_table());
  __m512 out[kRows][2], acc[kRows][2][2];  // [row][vector]; [row][vector][pair parity]
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm512_setzero_ps();
  const uint8_t* w[2];
  int64_t col[2];
  starts<V>(a, block, w, col);
  const c10::BFloat16* x = a.xb + m * a.ldx;
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group_size, k1 = std::min(a.K, k0 + a.group_size);
    __m512 s[2], mn[2];
    __m512i zz[2];
    group_scales<V>(a, g, col, s, zz, mn);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 2; ++v) acc[r][v][0] = acc[r][v][1] = _mm512_setzero_ps();
    }
    for (int64_t k = k0; k < k1; k += 4) {  // k0 is even: k's byte holds k and k + 1
      __m512i w0[2], w1[2];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        const uint8_t* row = w[v] + (k / 2) * kQBlock;
        _mm_prefetch(reinterpret_cast<const char*>(row) + 1024, _MM_HINT_T0);
        w0[v] = pairs(row, zz[v], table);
        w1[v] = k + 2 < k1 ? pairs(row + kQBlock, zz[v], table) : w0[v];
      }
      dot_two<R, V>(x, a.ldx, k, k1, w0, w1, acc);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(a.mins ? a.xsum[(m + r) * a.groups + g] : 0.f);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        out[r][v] = _mm512_fmadd_ps(_mm512_add_ps(acc[r][v][0], acc[r][v][1]), s[v], out[r][v]);
        if (a.mins) out[r][v] = _mm512_fnmadd_ps(xs, mn[v], out[r][v]);  // less m sum x
      }
    }
  }
  store_rows<V>(a, m, R, col, out);
}

// Pairs of k [c0, c1) of rows [0, R) of x times the dequantized pairs buf ((k - c0) / 2,
// vector) into the partial sums acc, in tile()'s order (c0 - the group's start is a multiple
// of 4 k: parities stay tile()'s).
template <int R, int V>
CBATCH_AVX512_DOT void accumulate(const c10::BFloat16* x, int64_t ldx, const __m512i (*buf)[2],
                                  int64_t c0, int64_t c1, int64_t end, __m512 (*acc)[2][2]) {
  __m512 t[kRows][2][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) t[r][v][0] = acc[r][v][0], t[r][v][1] = acc[r][v][1];
  }
  for (int64_t k = c0; k < c1; k += 4) {
    const int64_t i = (k - c0) / 2;
    dot_two<R, V>(x, ldx, k, std::min(c1, end), buf[i], buf[k + 2 < c1 ? i + 1 : i], t);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v][0] = t[r][v][0], acc[r][v][1] = t[r][v][1];
  }
}

// Rows [m0, m1) (more than a tile's, at most kChunkRows): each chunk of k's pairs dequantized
// once into buf and read by every row tile, in tile()'s order (so the same bits per row).
template <int V>
CBATCH_AVX512_DOT void tile_rows(const QArgs& a, int64_t m0, int64_t m1, int64_t block) {
  const __m512i table = _mm512_load_si512(integer_table());
  const int64_t M = m1 - m0;
  __m512 out[kChunkRows][2], acc[kChunkRows][2][2];
  __m512i buf[kPairs][2];
  const uint8_t* w[2];
  int64_t col[2];
  starts<V>(a, block, w, col);
  for (int64_t m = 0; m < M; ++m) out[m][0] = out[m][1] = _mm512_setzero_ps();
  const c10::BFloat16* x = a.xb + m0 * a.ldx;
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group_size, k1 = std::min(a.K, k0 + a.group_size);
    __m512 s[2], mn[2];
    __m512i zz[2];
    group_scales<V>(a, g, col, s, zz, mn);
    for (int64_t m = 0; m < M; ++m) {
      for (int v = 0; v < 2; ++v) acc[m][v][0] = acc[m][v][1] = _mm512_setzero_ps();
    }
    for (int64_t c0 = k0; c0 < k1; c0 += kChunkK) {
      const int64_t c1 = std::min(k1, c0 + kChunkK);
      for (int64_t k = c0; k < c1; k += 2) {
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) {
          buf[(k - c0) / 2][v] = pairs(w[v] + (k / 2) * kQBlock, zz[v], table);
        }
      }
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows) {
        accumulate<kRows, V>(x + m * a.ldx, a.ldx, buf, c0, c1, k1, acc + m);
      }
      switch (M - m) {  // < kRows left
        case 3: accumulate<3, V>(x + m * a.ldx, a.ldx, buf, c0, c1, k1, acc + m); break;
        case 2: accumulate<2, V>(x + m * a.ldx, a.ldx, buf, c0, c1, k1, acc + m); break;
        case 1: accumulate<1, V>(x + m * a.ldx, a.ldx, buf, c0, c1, k1, acc + m); break;
        default: break;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m512 xs = _mm512_set1_ps(a.mins ? a.xsum[(m0 + m) * a.groups + g] : 0.f);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        out[m][v] = _mm512_fmadd_ps(_mm512_add_ps(acc[m][v][0], acc[m][v][1]), s[v], out[m][v]);
        if (a.mins) out[m][v] = _mm512_fnmadd_ps(xs, mn[v], out[m][v]);  // less m sum x
      }
    }
  }
  store_rows<V>(a, m0, M, col, out);
}

template <int V>
void rows(const QArgs& a, int64_t block, int64_t m0, int64_t m1) {
  if (m1 - m0 > kRows) return tile_rows<V>(a, m0, m1, block);
  switch (m1 - m0) {
    case 4: return tile<4, V>(a, m0, block);
    case 3: return tile<3, V>(a, m0, block);
    case 2: return tile<2, V>(a, m0, block);
    case 1: return tile<1, V>(a, m0, block);
    default: return;
  }
}

// One work item: two blocks of 16 columns (or the last one alone), as avx512q's.
struct Isa {
  static constexpr int64_t kItemBlocks = 2;
  template <int kBits, bool kSub>
  static void item(const QArgs& a, int64_t block, int64_t blocks, int64_t m0, int64_t m1) {
    static_assert(kBits == 4 && kSub, "the bf16 path runs int4 weights");
    block + 1 < blocks ? rows<2>(a, block, m0, m1) : rows<1>(a, block, m0, m1);
  }
};

}  // namespace bf16q

// Each row's sum of x over each group, fp32 [M, G] (mins' term, once per row and group, not
// per column): eight partial sums of consecutive k, then added pairwise; the same order for
// a row whatever M.  x: [M, K] dense, fp32 or bf16 (widened exactly).
template <typename T>
void group_sums(const T* x, int64_t M, int64_t K, int64_t group_size, int64_t groups,
                float* sums) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < groups; ++g) {
        const T* xs = x + m * K + g * group_size;
        const int64_t n = std::min(K - g * group_size, group_size);
        float p[8] = {};
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) {
          for (int i = 0; i < 8; ++i) p[i] += float(xs[k + i]);
        }
        for (int i = 0; k < n; ++k, ++i) p[i] += float(xs[k]);
        sums[m * groups + g] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
      }
    }
  });
}

// Chunks of rows, each over every column item, the items shared out among threads.
template <typename Isa, int kBits, bool kSub>
void run(const QArgs& a) {
  const int64_t blocks = a.N16 / kQBlock;
  const int64_t items = (blocks + Isa::kItemBlocks - 1) / Isa::kItemBlocks;
  for (int64_t m0 = 0; m0 < a.M; m0 += kChunkRows) {
    const int64_t m1 = std::min(a.M, m0 + kChunkRows);
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        Isa::template item<kBits, kSub>(a, i * Isa::kItemBlocks, blocks, m0, m1);
      }
    });
  }
}
#endif  // CBATCH_X86

}  // namespace

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& qweight,
                                const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                                int64_t bits, int64_t group_size, int64_t out_features,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& mins) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK_VALUE(quantized_linear_supported(),
                    "cbatch's quantized CPU linear runs only on an x86 CPU with AVX2 and FMA, "
                    "or AVX-512");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK_VALUE(N >= 1 && K >= 1, "empty weight: ", N, " x ", K);
  const int64_t N16 = (N + kQBlock - 1) / kQBlock * kQBlock;
  const int64_t rows = bits == 8 ? K : (K + 1) / 2;
  TORCH_CHECK_TYPE(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
                   "a ", bits, "-bit qweight is ", bits == 8 ? "int8" : "uint8", ", got ",
                   qweight.scalar_type());
  TORCH_CHECK_VALUE(qweight.is_contiguous() && qweight.dim() == 3 &&
                        qweight.size(0) == N16 / kQBlock && qweight.size(1) == rows &&
                        qweight.size(2) == kQBlock,
                    "qweight ", qweight.sizes(), " does not hold ", bits, "-bit ", N, " x ", K,
                    " (expected [", N16 / kQBlock, ", ", rows, ", 16])");
  TORCH_CHECK_VALUE(group_size >= 1, "group_size must be >= 1, got ", group_size);
  const int64_t groups = (K + group_size - 1) / group_size;
  TORCH_CHECK_VALUE(bits == 8 || groups == 1 || group_size % 2 == 0,
                    "int4 groups hold pairs of k: group_size must be even, got ", group_size);
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                        scales.dim() == 2 && scales.size(0) == groups && scales.size(1) == N16,
                    "scales must be a dense float32 [", groups, ", ", N16, "], got ",
                    scales.scalar_type(), " ", scales.sizes());
  if (zeros) {
    TORCH_CHECK_VALUE(zeros->scalar_type() == at::kChar && zeros->is_contiguous() &&
                          zeros->dim() == 2 && zeros->size(0) == groups &&
                          zeros->size(1) == N16,
                      "zeros must be a dense int8 [", groups, ", ", N16, "], got ",
                      zeros->scalar_type(), " ", zeros->sizes());
  }
  if (mins) {
    TORCH_CHECK_VALUE(!zeros, "mins and zeros exclude each other: a weight with mins has no "
                      "zero point (zeros must be None)");
    TORCH_CHECK_VALUE(mins->scalar_type() == at::kFloat && mins->is_contiguous() &&
                          mins->dim() == 2 && mins->size(0) == groups && mins->size(1) == N16,
                      "mins must be a dense float32 [", groups, ", ", N16, "], got ",
                      mins->scalar_type(), " ", mins->sizes());
  }
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "bias must be [", N, "], got ",
                      bias->sizes());
  }
#ifdef CBATCH_X86
  // int4 on a bf16 x where the CPU has vdpbf16ps: x read as it is (bf16q)
  const bool bf16_dot = bits == 4 && x.scalar_type() == at::kBFloat16 && cpu_has_avx512bf16();
#else
  const bool bf16_dot = false;
#endif
  const at::Tensor xf = bf16_dot ? x.contiguous() : x.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> bf =
      bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out.to(x.scalar_type());
#ifdef CBATCH_X86
  at::Tensor xsum;  // [M, G] with mins
  if (mins) {
    xsum = at::empty({M, groups}, x.options().dtype(at::kFloat));
    bf16_dot ? group_sums(xf.data_ptr<c10::BFloat16>(), M, K, group_size, groups,
                          xsum.data_ptr<float>())
             : group_sums(xf.data_ptr<float>(), M, K, group_size, groups, xsum.data_ptr<float>());
  }
  const QArgs a{.x = bf16_dot ? nullptr : xf.data_ptr<float>(),
                .xb = bf16_dot ? xf.data_ptr<c10::BFloat16>() : nullptr,
                .ldx = K, .M = M, .K = K, .N = N, .N16 = N16,
                .bits = int(bits), .group_size = group_size, .groups = groups,
                .q = static_cast<const uint8_t*>(qweight.data_ptr()),
                .scales = scales.data_ptr<float>(),
                .zeros = zeros ? zeros->data_ptr<int8_t>() : nullptr,
                .zero = bits == 4 && !mins ? 8 : 0,
                .mins = mins ? mins->data_ptr<float>() : nullptr,
                .xsum = mins ? xsum.data_ptr<float>() : nullptr,
                .bias = bf ? bf->data_ptr<float>() : nullptr, .out = out.data_ptr<float>()};
  const bool avx512 = cpu_has_avx512();
  if (bf16_dot) {
    count_path(CpuPath::kQuantizedLinearW4Avx512Bf16);
    run<bf16q::Isa, 4, true>(a);
    return out.to(x.scalar_type());
  }
  count_path(bits == 8 ? (avx512 ? CpuPath::kQuantizedLinearW8Avx512
                                 : CpuPath::kQuantizedLinearW8Avx2)
                       : (avx512 ? CpuPath::kQuantizedLinearW4Avx512
                                 : CpuPath::kQuantizedLinearW4Avx2));
  // int4 always subtracts its zero point (8 when none is given, 0 with mins); int8 only a
  // given one
  if (avx512) {
    bits == 4 ? run<avx512q::Isa, 4, true>(a)
              : zeros ? run<avx512q::Isa, 8, true>(a) : run<avx512q::Isa, 8, false>(a);
  } else {
    bits == 4 ? run<avx2q::Isa, 4, true>(a)
              : zeros ? run<avx2q::Isa, 8, true>(a) : run<avx2q::Isa, 8, false>(a);
  }
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace cbatch
