// The CPU W4A8 linear op (llama.cpp's route for int4: Q4_0 weights against Q8_0 activations):
// int4 weights, one scale per group of group_size k and output column, symmetric (zero point
// 8) or with a zero point per group and column (AWQ's, asymmetric GPTQ's; Q4_1's route); x quantized
// to int8 on every call per token and per group of the same k; each group's integer dot
// product summed exactly in int32, then scaled and summed over groups in fp32, llama.cpp's
// order (its block's two scales multiplied, then one fma):
//   y[m, n] = fma(fl(S[m, n, G - 1]), d[m, n, G - 1], ... fma(fl(S[m, n, 0]), d[m, n, 0], 0))
//             (+ bias[n]),   d[m, n, g] = fl(s_w[g, n] * s_x[m, g]),
// S the exact sum over group g of q_w * q_x, the groups in order, fl one fp32 rounding and each
// fma one rounding (the bias a last, separate add).  cbatch/ops/reference.py
// (quantized_linear_w4a8, its fma32) computes the same, so the output is the reference's bit
// for bit.  A row's result depends on nothing but that row.  (Until 2026-12-07 the order was
// y = fl(y + fl(fl(S s_w) s_x)): two more instructions a row and half, which in groups of 32
// cost a fifth of the VNNI tile's time.)
//
// The activation quantization, per row of x in fp32 and per group g of k (cbatch/ops/
// reference.py, quantize_per_group, computes the same): a = max |x| over the group,
// q = nearbyint(x * fl(127 / a)) (ties to even; |q| <= 127), s_x = fl(a / 127); a group of
// zeros has q 0 and s_x 0.  The quantized row is 0 past K, to a multiple of 32 k.
//
// The weight's layout (cbatch/layers/quantization/weight.py, pack_w4a8): uint8
// [N16 / 16, Q, 32], Q = 8 ceil(K / 32) (K rounded up to whole runs of 32 k, not to whole
// groups: a last group may be short), byte [b, i, 4 j + t] = u[16 b + j, 4 i + t] in its low
// nibble and u[16 b + 8 + j, 4 i + t] in its high one (j < 8), u = q + 8 in [0, 15] (q in
// [-8, 7]; u 8 past K).  One 32-byte load is 16 columns x 4 k: the low
// nibbles (an and) are columns 0..7 and the high ones (a shift, an and) columns 8..15, each
// column's 4 k in one 4-byte lane, so one broadcast of the row's 4 int8 k serves both halves.
// The weight is the unsigned operand of vpmaddubsw and x the signed one:
// sum (q + 8) x = sum q x + 8 sum x, and the kernel subtracts 8 times the row's sum of its q
// over the group, one number per row and group (no per-column correction): the group's int32
// sums start from it (start_sums: quantize_rows computes -8 sum x), so nothing is subtracted
// after the products.  With zero points the stored nibble u is the weight's own unsigned
// integer (w = s_w (u - z)), and the sums start from -z[g, n] times the row's sum instead:
// S = sum u x - z sum x, exact as before.  With mins (zeros none; llama.cpp's Q4_1 / Q4_K
// route, w = s_w u - m) they start from 0, S = sum u x, and after each group's fma
// y = fma(-m[g, n], c[m, g], y), c = fl(Sx s_x), Sx the row's sum of its q over the group: c is
// computed once per row and group (quantize_rows).  The same in reference.py, bit for bit.
//
// No overflow: vpmaddubsw adds two products u x with u <= 15 and |x| <= 127, so each int16
// lane is at most 2 * 15 * 127 = 3810 in magnitude (it never saturates); the kernel adds 8
// such lanes (8 quads, 32 k) in int16, at most 8 * 3810 = 30480 < 32767, before vpmaddwd with
// ones widens each pair of lanes (one column's 4 k) into int32.  A group's int32 sum is at
// most 15 * 127 * group_size < 2^31 (group_size <= 65536), and z sum x at most
// 15 * 127 * group_size.  So every integer is exact.  group_size must be a multiple of 32 (whole
// runs of 8 quads in every group but the last).
//
// x (fp32 or bf16) is read in place, rows x.stride(0) apart; a bf16 x gets a bf16 output,
// each fp32 result rounded in the tile's epilogue by c10::BFloat16's rounding (to nearest
// even, as Tensor.to(torch.bfloat16)): no fp32 copy of x or of the output.
//
// Paths (tiles of 16 columns): AVX512-VNNI where present (vpdpbusd on 256-bit vectors, up to 8
// rows a tile), else AVX2 (vpmaddubsw, 4 rows a tile); from 8 rows AMX-INT8 tiles where the CPU
// has them and group_size is a multiple of 64; the same integers, the same output bits.
//
// 8-bit weights in groups (W8A8 per group, llama.cpp's Q8_0 x Q8_0 route; an int8 qweight):
// int8 [N16 / 16, Q, 64], byte [b, i, 4 j + t] = q[16 b + j, 4 i + t] and byte [b, i, 32 + 4 j
// + t] = q[16 b + 8 + j, 4 i + t] (j < 8; 0 past K): a quad's 64 bytes are one cache line, the
// first 32 columns 0..7, the last 32 columns 8..15, each column's 4 k in a 4-byte lane.  q is
// the weight's own signed integer (zero point 0; zeros[g, n] subtracted as above where given;
// with mins the stored 0..31 of Q5_1 / Q5_K).  vpmaddubsw wants one unsigned operand, so each
// product q x is formed as |q| sign(x, q) (vpabsb, vpsignb: x negated where q < 0, 0 where q
// is 0; |q| <= 128 read unsigned, |x| <= 127, so neither overflows), and each int16 pair (at
// most 2 * 128 * 127 = 32512) is widened into int32 at once (vpmaddwd with ones): the same
// exact S as above.  group_size a multiple of 16 (Q6_K's sub-blocks), x quantized per group
// alike.  With AVX512-VNNI the VNNI tile runs these weights too: vpdpbusd wants the weight
// unsigned, so each quad's bytes are flipped to u = q + 128 (an xor of the top bit, once for
// the tile's rows) and 128 times the row's sum over the group is counted into where the sums
// start (W4A8Args::shift): S = sum (q + 128) x - 128 sum x, the same exact
// integer, so the output is the AVX2 tile's bit for bit (sums at most 255 * 127 *
// group_size < 2^31).  No AMX tile for 8-bit weights yet.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../ops.h"
#include "amx_tile_ops.h"
#include "avx2.h"
#include "quantized_operands.h"

namespace cbatch {

namespace {

constexpr int64_t kBlock = 16;         // output columns per packed block
constexpr int64_t kChunkRows = 64;     // rows per pass over the weights (they stay in L2)
constexpr int64_t kRunQuads = 8;       // quads summed in int16 before widening to int32
constexpr int64_t kMaxGroup = 65536;   // a group's int32 sum stays below 2^31

struct W4A8Args {
  const int8_t* xq;     // [M, Q * 4] the quantized rows, 0 past K
  const int32_t* xsum;  // [M, G] each row's sum of q per group
  const float* xscale;  // [M, G] s_x
  int64_t M, G, GQ, Q, N;  // GQ: quads per group; Q: quads per row (the last group's fewer)
  const uint8_t* w;     // [N16 / 16, Q, 32]
  const float* wscale;  // [G, N16] s_w
  const int8_t* wzero;  // [G, N16] zero points in [0, 15], or null: 8
  const float* wmin;    // [G, N16] mins (wzero null), or null
  const float* xsum_scaled;  // [M, G] fl(xsum * s_x) (with mins; else null)
  int64_t N16;
  int32_t shift;        // a group's sums less shift xsum (start_sums): the zero point without
                        // wzero or wmin (8 for 4-bit weights, else 0), plus the tile's offset
                        // on every stored weight (the VNNI tile's 8-bit flip: 128, else 0)
  const int32_t* xshift;  // [M, G] -shift xsum: where a group's sums start
  const float* bias;    // [N] fp32 or null
  float* out;           // [M, N] fp32 (an fp32 x), or null
  c10::BFloat16* out_bf16;  // [M, N] (a bf16 x: each fp32 result rounded as torch rounds it)
};

// Per-token, per-group quantization of rows [m0, m1) of x [M, K] (fp32 or bf16, rows
// x_stride apart; bf16 widens to fp32 exactly) into a's buffers, 0 past K; and with mins each
// group's fl(xsum * s_x) into xsum_scaled.
template <typename T>
void quantize_rows(const T* xs, int64_t x_stride, int64_t K, int64_t group_size, int64_t m0,
                   int64_t m1, const W4A8Args& a, int8_t* xq, int32_t* xsum, float* xscale,
                   float* xsum_scaled, int32_t* xshift) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* x = xs + m * x_stride;
    int8_t* q = xq + m * a.Q * 4;
    std::memset(q + K, 0, a.Q * 4 - K);
    for (int64_t g = 0; g < a.G; ++g) {
      const int64_t k0 = g * group_size, k1 = std::min(K, k0 + group_size);
      const float top = quantized_operands::quantize_run(x + k0, k1 - k0, q + k0,
                                                         &xsum[m * a.G + g]);
      xscale[m * a.G + g] = top / 127.f;
      xshift[m * a.G + g] = -a.shift * xsum[m * a.G + g];  // |.| <= 255 * 127 group_size < 2^31
      if (xsum_scaled) {  // |xsum| <= 127 group_size < 2^24: exact in fp32
        xsum_scaled[m * a.G + g] = float(xsum[m * a.G + g]) * xscale[m * a.G + g];
      }
    }
  }
}

#ifdef CBATCH_X86
constexpr int kRows = 4;  // 4 rows x 2 halves = 8 int16 sums, 2 weight vectors, 1 x
constexpr int kVnniRows = 8;  // VNNI: 8 rows, one 512-bit register of 16 int32 sums each

// Where group g's int32 sums of rows m .. m + R - 1 (columns 8 half ..) start: the header's
// shift, counted in before the products instead of subtracted after them (the same exact
// integer S): xshift, less each column's zero point times xsum where there are zero points.
template <int R>
CBATCH_AVX2 CBATCH_INLINE void start_sums(const W4A8Args& a, int64_t m, int64_t block, int64_t g,
                                          __m256i (*s)[2]) {
  const int8_t* z = a.wzero ? a.wzero + g * a.N16 + block * kBlock : nullptr;
  const __m256i z0 = z ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                             reinterpret_cast<const __m128i*>(z))) : __m256i{},
                z1 = z ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                             reinterpret_cast<const __m128i*>(z + 8))) : __m256i{};
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256i start = _mm256_set1_epi32(a.xshift[(m + r) * a.G + g]);
    if (z) {  // |z xsum| <= 15 * 127 group_size < 2^31
      const __m256i xsum = _mm256_set1_epi32(a.xsum[(m + r) * a.G + g]);
      s[r][0] = _mm256_sub_epi32(start, _mm256_mullo_epi32(z0, xsum));
      s[r][1] = _mm256_sub_epi32(start, _mm256_mullo_epi32(z1, xsum));
    } else {
      s[r][0] = s[r][1] = start;
    }
  }
}

// Group g's exact int32 sums S [row][half] (started by start_sums) scaled and added to y, in
// the order the header gives: y = fma(S, fl(s_w * s_x), y); with mins then
// y = fma(-m, xsum_scaled, y).
template <int R>
CBATCH_AVX2 CBATCH_INLINE void add_group(const W4A8Args& a, int64_t m, int64_t block, int64_t g,
                                         const __m256i (*s)[2], __m256 (*y)[2]) {
  const float* sw = a.wscale + g * a.N16 + block * kBlock;
  const __m256 sw0 = _mm256_loadu_ps(sw), sw1 = _mm256_loadu_ps(sw + 8);
  const float* mn = a.wmin ? a.wmin + g * a.N16 + block * kBlock : nullptr;
  const __m256 mn0 = mn ? _mm256_loadu_ps(mn) : __m256{},
               mn1 = mn ? _mm256_loadu_ps(mn + 8) : __m256{};
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 sx = _mm256_set1_ps(a.xscale[(m + r) * a.G + g]);
    y[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(sw0, sx), y[r][0]);
    y[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(sw1, sx), y[r][1]);
    if (mn) {  // w = s_w u - m: less m times the row's quantized x summed over the group
      const __m256 c = _mm256_set1_ps(a.xsum_scaled[(m + r) * a.G + g]);
      y[r][0] = _mm256_fnmadd_ps(mn0, c, y[r][0]);
      y[r][1] = _mm256_fnmadd_ps(mn1, c, y[r][1]);
    }
  }
}

// The tile's rows m .. m + R - 1 of the output (columns of `block` below N), plus the bias.
template <int R>
CBATCH_AVX2 CBATCH_INLINE void store_tile(const W4A8Args& a, int64_t m, int64_t block,
                                          const __m256 (*y)[2]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // columns 8 h .. 8 h + 7
      const int64_t n = block * kBlock + 8 * h, left = a.N - n;
      if (left <= 0) break;
      const __m256i lanes = avx2::first_lanes(left);
      const __m256 yv = a.bias ? _mm256_add_ps(y[r][h], _mm256_maskload_ps(a.bias + n, lanes))
                               : y[r][h];
      quantized_operands::store_row8(yv, lanes, left, a.out, a.out_bf16, (m + r) * a.N + n);
    }
  }
}

// A run's 4 cache lines (8 quads of 32 bytes), prefetched 2 KiB ahead: an 8-row tile takes
// ~300 cycles over 1 KiB, too little to hide DRAM's latency (1 KiB ahead, its 128 linears took
// 5% longer at 8 rows; benchmarks/NOTES.md, "W4A8: int4 weights against int8 activations").
CBATCH_AVX2 CBATCH_INLINE void prefetch_run(const uint8_t* run) {
#pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) {
    _mm_prefetch(reinterpret_cast<const char*>(run) + 2048 + 64 * l, _MM_HINT_T0);
  }
}

// Quad i's 32 bytes as unsigned weights: lo the low nibbles (columns 0..7, 4 k each), hi the
// high ones (columns 8..15).
CBATCH_AVX2 CBATCH_INLINE void unpack(const uint8_t* quad, __m256i& lo, __m256i& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
}

// A row's four int8 k of one quad in every 4-byte lane.
CBATCH_AVX2 CBATCH_INLINE __m256i broadcast_quad(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, sizeof quad);
  return _mm256_set1_epi32(quad);
}

template <int R>
CBATCH_AVX2 void tile_avx2(const W4A8Args& a, int64_t m, int64_t block) {
  const int64_t Q = a.Q;
  const uint8_t* w = a.w + block * Q * 32;
  const int8_t* x = a.xq + m * Q * 4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 y[kRows][2];  // [row][half]: the sum over groups so far
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i s[kRows][2];  // [row][half]: this group's int32 sums
    start_sums<R>(a, m, block, g, s);
    for (int64_t i0 = g * a.GQ; i0 < std::min((g + 1) * a.GQ, Q); i0 += kRunQuads) {
      __m256i h[kRows][2];  // [row][half]: int16 sums of this run of 8 quads
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) h[r][0] = h[r][1] = _mm256_setzero_si256();
      prefetch_run(w + i0 * 32);
      // Unrolled: the loop's own counting and branching cost as much as its multiply-adds
      // (benchmarks/NOTES.md, "W4A8: int4 weights against int8 activations").  The empty asm after
      // each add keeps the adds in order; without it GCC reassociates them into a tree of all
      // 8 quads' products and spills them.
#pragma GCC unroll 8
      for (int64_t i = i0; i < i0 + kRunQuads; ++i) {
        __m256i lo, hi;
        unpack(w + i * 32, lo, hi);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i xv = broadcast_quad(x + r * Q * 4 + 4 * i);
          h[r][0] = _mm256_add_epi16(h[r][0], _mm256_maddubs_epi16(lo, xv));
          h[r][1] = _mm256_add_epi16(h[r][1], _mm256_maddubs_epi16(hi, xv));
          asm("" : "+x"(h[r][0]), "+x"(h[r][1]));  // (see above)
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(h[r][0], ones));
        s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(h[r][1], ones));
      }
    }
    add_group<R>(a, m, block, g, s, y);
  }
  store_tile<R>(a, m, block, y);
}

// 8-bit weights (the header's last paragraph): per quad the block's two 32-byte halves, their
// magnitudes once for the tile's rows, and per row and half |q| sign(x, q) in int16 pairs,
// widened into the group's int32 sums at once.
template <int R>
CBATCH_AVX2 void tile_int8(const W4A8Args& a, int64_t m, int64_t block) {
  const int64_t Q = a.Q;
  const int8_t* w = reinterpret_cast<const int8_t*>(a.w) + block * Q * 64;
  const int8_t* x = a.xq + m * Q * 4;
  __m256 y[kRows][2];  // [row][half]: the sum over groups so far
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i s[kRows][2];  // [row][half]: this group's int32 sums
    start_sums<R>(a, m, block, g, s);
    const int64_t end = std::min((g + 1) * a.GQ, Q);
    for (int64_t i = g * a.GQ; i < end; ++i) {
      const int8_t* quad = w + i * 64;
      _mm_prefetch(reinterpret_cast<const char*>(quad) + 2048, _MM_HINT_T0);
      const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
      const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 32));
      const __m256i u0 = _mm256_abs_epi8(q0), u1 = _mm256_abs_epi8(q1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        quantized_operands::add_quad_s8(q0, q1, u0, u1, broadcast_quad(x + r * Q * 4 + 4 * i),
                                        s[r][0], s[r][1]);
      }
    }
    add_group<R>(a, m, block, g, s, y);
  }
  store_tile<R>(a, m, block, y);
}

// ---- AVX512-VNNI: vpdpbusd multiplies a quad's 4 unsigned weights by the row's 4 int8 k and
// adds them into a column's int32 sum in one instruction, in place of vpmaddubsw, the int16 add
// and the widening vpmaddwd.  On 512-bit vectors: one register holds a quad's 16 columns (0..7
// in the low half, 8..15 in the high one), and a row's 4 k are broadcast to all 16 lanes, so a
// quad costs a row one instruction (on 256-bit vectors GCC's loop issued 177 instructions for 64
// vpdpbusd, 42 of them register moves; the 512-bit loop issues about half as many, for 0-3%:
// the group's epilogue, not the loop, was what cost; benchmarks/NOTES.md, "Prompt GEMMs against
// the measured peak").  The integer sums are
// exact either way, and a group's epilogue is add_group on the two halves, so the output is the
// AVX2 tile's (and the reference's) bit for bit.  A tile takes up to 8 rows: each quad's weights
// are unpacked once for all of them, and at 8 rows the weights stream while the multiplies run
// (two tiles of 4 rows took 10% longer: the first streamed the block, the second ran from L1
// with nothing in flight).  Up to 4 rows, even and odd quads sum into separate registers (so a
// one-row tile has 2 chains, not 1, waiting on vpdpbusd's latency), added at the group's end.
// 8-bit weights (kBits 8) take the same tile: a quad's 64 bytes with their top bits flipped
// (the header's last paragraph) in place of the nibbles, in runs of 4 quads (a group may be
// 16 k); a run is 256 bytes either way.
// (AVX2's target too: the tiles' shared helpers inline into it.)
#define CBATCH_VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// Quad i's weights as vpdpbusd's unsigned operand, columns 0..15 (4 k each) in the 16 lanes:
// 4-bit ones the low nibbles (0..7) and the high ones (8..15), 8-bit ones as q + 128.
template <int kBits>
CBATCH_VNNI CBATCH_INLINE __m512i vnni_quad(const uint8_t* w, int64_t i) {
  if constexpr (kBits == 8) {
    return _mm512_xor_si512(_mm512_loadu_si512(w + i * 64), _mm512_set1_epi8(-128));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * 32));
    const __m512i both =
        _mm512_inserti64x4(_mm512_zextsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  }
}

// GCC 12's own headers warn that their 512-to-256-bit casts and inserts read an undefined
// vector (their _mm512_undefined_* placeholders): a false alarm, silenced for the tile alone.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int kBits, int R>
CBATCH_VNNI void tile_vnni(const W4A8Args& a, int64_t m, int64_t block) {
  constexpr int P = R > kRows ? 1 : 2;  // quad parities: 5-8 rows have 5-8 chains without them
  constexpr int64_t kQuadBytes = kBits == 8 ? 64 : 32, kRun = 256 / kQuadBytes;
  const int64_t Q = a.Q;
  const uint8_t* w = a.w + block * Q * kQuadBytes;
  const int8_t* x = a.xq + m * Q * 4;
  __m256 y[kVnniRows][2];  // [row][half]: the sum over groups so far
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m512i s[P][kVnniRows];  // [quad parity][row]: this group's int32 sums
    __m256i halves[kVnniRows][2];  // [row][half]: add_group's operands
    if (a.wzero) start_sums<R>(a, m, block, g, halves);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {  // (start_sums, without zero points broadcast from memory)
      if (a.wzero) {
        s[0][r] = _mm512_inserti64x4(_mm512_zextsi256_si512(halves[r][0]), halves[r][1], 1);
      } else {
        s[0][r] = _mm512_set1_epi32(a.xshift[(m + r) * a.G + g]);
      }
      if constexpr (P == 2) s[1][r] = _mm512_setzero_si512();
    }
    for (int64_t i0 = g * a.GQ; i0 < std::min((g + 1) * a.GQ, Q); i0 += kRun) {
      prefetch_run(w + i0 * kQuadBytes);
#pragma GCC unroll 8
      for (int j = 0; j < kRun; ++j) {
        const int64_t i = i0 + j;
        const __m512i q = vnni_quad<kBits>(w, i);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t quad;  // the row's 4 int8 k, in all 16 lanes
          std::memcpy(&quad, x + r * Q * 4 + 4 * i, sizeof quad);
          s[j % P][r] = _mm512_dpbusd_epi32(s[j % P][r], q, _mm512_set1_epi32(quad));
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i sum = P == 2 ? _mm512_add_epi32(s[0][r], s[P - 1][r]) : s[0][r];
      halves[r][0] = _mm512_castsi512_si256(sum);
      halves[r][1] = _mm512_extracti64x4_epi64(sum, 1);
    }
    add_group<R>(a, m, block, g, halves, y);
  }
  store_tile<R>(a, m, block, y);
}
#pragma GCC diagnostic pop

// ---- AMX-INT8 (Sapphire Rapids and later): tdpbsud multiplies 16 rows x 64 k of x (signed)
// by 64 k x 16 columns of unsigned weights into 16 x 16 int32 sums.  A block's nibbles are
// unpacked once per pair of blocks and chunk of rows into B tiles' rows (quad i: the low
// nibbles, columns 0..7, then the high ones, 8..15; 64 bytes), x's rows are A tiles (zero
// rows past M), and a group's sums stay in the C tiles over its 64-k steps (group_size a
// multiple of 64).  They are the VNNI tile's exact integers, and add_group and store_tile its
// epilogue on them, so the output is the same bits on every path and however many rows share
// the call.  Templated on the tile instructions: the hardware's, or amx_tile_ops.h's model.
using amx::kInt8FromRows, amx::kInt8StepQuads, amx::kInt8StepRows;

// Block `block`'s nibbles as B tiles' rows: [Q][64] bytes at out.
CBATCH_AMX_INT8 void unpack_block(const W4A8Args& a, int64_t block, uint8_t* out) {
  const uint8_t* w = a.w + block * a.Q * 32;
  for (int64_t i = 0; i < a.Q; ++i) {
    __m256i lo, hi;
    unpack(w + i * 32, lo, hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * 64), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * 64 + 32), hi);
  }
}

// Group g's sums of rows [r0, r0 + R) of the step (sums [32][32] int32, block b's 16 columns
// at 16 b) scaled and added to their sums over groups (ys, the same shape, fp32) by add_group.
template <int R>
CBATCH_AMX_INT8 void add_group_rows(const W4A8Args& a, const int32_t* sums, float* ys,
                                    int64_t m, int64_t r0, int64_t block, int b, int64_t g) {
  __m256i s[kRows][2];
  __m256 y[kRows][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int64_t at = (r0 + r) * 32 + b * kBlock + 8 * h;
      s[r][h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums + at));
      y[r][h] = _mm256_load_ps(ys + at);
    }
  }
  __m256i start[kRows][2];  // the tiles' sums start at 0: the shift is added after them
  start_sums<R>(a, m + r0, block, g, start);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    s[r][0] = _mm256_add_epi32(s[r][0], start[r][0]);
    s[r][1] = _mm256_add_epi32(s[r][1], start[r][1]);
  }
  add_group<R>(a, m + r0, block, g, s, y);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(ys + (r0 + r) * 32 + b * kBlock, y[r][0]);
    _mm256_store_ps(ys + (r0 + r) * 32 + b * kBlock + 8, y[r][1]);
  }
}

// Rows [r0, r0 + R) of the step's sums over groups, block b's columns, stored by store_tile.
template <int R>
CBATCH_AMX_INT8 void store_rows(const W4A8Args& a, const float* ys, int64_t m, int64_t r0,
                                int64_t block, int b) {
  __m256 y[kRows][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    y[r][0] = _mm256_load_ps(ys + (r0 + r) * 32 + b * kBlock);
    y[r][1] = _mm256_load_ps(ys + (r0 + r) * 32 + b * kBlock + 8);
  }
  store_tile<R>(a, m + r0, block, y);
}

// Group g's epilogue (store: the step's output) for the step's first `rows` rows, 4 at a time.
template <bool kStore>
CBATCH_AMX_INT8 void step_rows(const W4A8Args& a, const int32_t* sums, float* ys, int64_t m,
                               int64_t rows, int64_t block, int nb, int64_t g) {
  for (int b = 0; b < nb; ++b) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t n = std::min<int64_t>(kRows, rows - r0);
      if constexpr (kStore) {
        if (n == 4) store_rows<4>(a, ys, m, r0, block + b, b);
        if (n == 3) store_rows<3>(a, ys, m, r0, block + b, b);
        if (n == 2) store_rows<2>(a, ys, m, r0, block + b, b);
        if (n == 1) store_rows<1>(a, ys, m, r0, block + b, b);
      } else {
        if (n == 4) add_group_rows<4>(a, sums, ys, m, r0, block + b, b, g);
        if (n == 3) add_group_rows<3>(a, sums, ys, m, r0, block + b, b, g);
        if (n == 2) add_group_rows<2>(a, sums, ys, m, r0, block + b, b, g);
        if (n == 1) add_group_rows<1>(a, sums, ys, m, r0, block + b, b, g);
      }
    }
  }
}

// Rows [m, m + 32) of x times the NB unpacked blocks (w0, w1), group by group, into the
// output.
template <class Tiles, int NB>
CBATCH_AMX_INT8 void amx_step(const W4A8Args& a, int64_t m, int64_t block, const uint8_t* w0,
                              const uint8_t* w1, int32_t* sums, float* ys) {
  const int64_t rows = std::min(kInt8StepRows, a.M - m);
  std::memset(ys, 0, sizeof(float) * kInt8StepRows * 32);
  for (int64_t g = 0; g < a.G; ++g) {
    amx::zero_sums<Tiles>();
    amx::add_products<Tiles, NB>(a.xq + m * a.Q * 4, a.Q * 4, w0, w1, g * a.GQ,
                                 std::min((g + 1) * a.GQ, a.Q));
    amx::store_sums<Tiles, NB>(sums);
    step_rows<false>(a, sums, ys, m, rows, block, NB, g);
  }
  step_rows<true>(a, sums, ys, m, rows, block, NB, 0);
}

// Blocks block .. block + nb - 1, unpacked, against rows [m0, m1) of x, 32 at a time.
template <class Tiles>
CBATCH_AMX_INT8 void amx_pair(const W4A8Args& a, int64_t block, int nb, int64_t m0,
                              int64_t m1) {
  // the pair's unpacked blocks: a thread's buffer kept between calls (a fresh one was an mmap
  // and its page faults on every call where it passed glibc's threshold, K 8192's 256 KiB)
  static thread_local std::vector<uint8_t> unpacked;
  unpacked.resize(std::max<size_t>(unpacked.size(), 2 * a.Q * 64));
  uint8_t* w0 = unpacked.data();
  uint8_t* w1 = w0 + a.Q * 64;
  alignas(64) int32_t sums[kInt8StepRows * 32];
  alignas(64) float ys[kInt8StepRows * 32];
  unpack_block(a, block, w0);
  if (nb == 2) unpack_block(a, block + 1, w1);
  for (int64_t m = m0; m < m1; m += kInt8StepRows) {
    if (nb == 2) {
      amx_step<Tiles, 2>(a, m, block, w0, w1, sums, ys);
    } else {
      amx_step<Tiles, 1>(a, m, block, w0, w1, sums, ys);
    }
  }
}

template <class Tiles>
void run_amx(const W4A8Args& a) {
  amx::for_pairs<Tiles>(a.M, a.N16 / kBlock, a.Q * 4,
                        [&](int64_t block, int nb, int64_t m0, int64_t m1) {
                          amx_pair<Tiles>(a, block, nb, m0, m1);
                        });
}
#undef CBATCH_VNNI

// The VNNI tile (4- or 8-bit weights), else AVX2's: tile_int8 for 8 bits, tile_avx2 for 4.
template <bool kVnni, int kBits, int R>
void tile(const W4A8Args& a, int64_t m, int64_t block) {
  if constexpr (kVnni) {
    tile_vnni<kBits, R>(a, m, block);
  } else if constexpr (kBits == 8) {
    tile_int8<R>(a, m, block);
  } else {
    tile_avx2<R>(a, m, block);
  }
}

// Rows [m, m + n) of one block of columns in one tile, n below the path's rows a tile.
template <bool kVnni, int kBits, int R = (kVnni ? kVnniRows : kRows) - 1>
void last_tile(const W4A8Args& a, int64_t m, int64_t block, int64_t n) {
  if constexpr (R > 0) {
    if (n == R) return tile<kVnni, kBits, R>(a, m, block);
    last_tile<kVnni, kBits, R - 1>(a, m, block, n);
  }
}

// Rows [m0, m1) of one block of columns: AVX2 kRows at a time, VNNI kVnniRows, then the rest
// in one tile.
template <bool kVnni, int kBits>
void item(const W4A8Args& a, int64_t block, int64_t m0, int64_t m1) {
  constexpr int kTileRows = kVnni ? kVnniRows : kRows;
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows) tile<kVnni, kBits, kTileRows>(a, m, block);
  last_tile<kVnni, kBits>(a, m, block, m1 - m);
}

// Chunks of rows, each over every block of columns, the blocks shared out among threads.
template <bool kVnni, int kBits = 4>
void run(const W4A8Args& a) {
  const int64_t blocks = a.N16 / kBlock;
  for (int64_t m0 = 0; m0 < a.M; m0 += kChunkRows) {
    const int64_t m1 = std::min(a.M, m0 + kChunkRows);
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) item<kVnni, kBits>(a, b, m0, m1);
    });
  }
}
#endif  // CBATCH_X86

}  // namespace

at::Tensor quantized_linear_w4a8_cpu(const at::Tensor& x_in, const at::Tensor& qweight,
                                     const at::Tensor& scales, int64_t group_size,
                                     int64_t out_features,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& zeros,
                                     const std::optional<at::Tensor>& mins) {
  const at::Tensor x = quantized_operands::checked_x(x_in, out_features, bias);
#ifdef CBATCH_X86
  const bool avx2 = cpu_has_avx2();
#else
  const bool avx2 = false;
#endif
  TORCH_CHECK_VALUE(avx2, "cbatch's W4A8 CPU linear runs only on an x86 CPU with AVX2 and FMA");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK_TYPE(qweight.scalar_type() == at::kByte || qweight.scalar_type() == at::kChar,
                   "a W4A8 qweight is uint8 (int4 weights) or int8 (int8 weights), got ",
                   qweight.scalar_type());
  const int bits = qweight.scalar_type() == at::kChar ? 8 : 4;
  const int64_t multiple = bits == 8 ? 16 : 32;  // (the header's 8-bit paragraph)
  TORCH_CHECK_VALUE(group_size >= multiple && group_size % multiple == 0 &&
                        group_size <= kMaxGroup,
                    "W4A8 group_size of ", bits, "-bit weights must be a multiple of ",
                    multiple, " in [", multiple, ", ", kMaxGroup, "], got ", group_size);
  const int64_t N16 = (N + kBlock - 1) / kBlock * kBlock, G = (K + group_size - 1) / group_size;
  const int64_t GQ = group_size / 4, Q = (K + 31) / 32 * kRunQuads;
  const int64_t quad_bytes = bits == 8 ? 4 * kBlock : 2 * kBlock;
  TORCH_CHECK_VALUE(qweight.is_contiguous() && qweight.dim() == 3 &&
                        qweight.size(0) == N16 / kBlock && qweight.size(1) == Q &&
                        qweight.size(2) == quad_bytes,
                    "qweight ", qweight.sizes(), " does not hold ", bits, "-bit W4A8 ", N,
                    " x ", K, " (expected [", N16 / kBlock, ", ", Q, ", ", quad_bytes, "])");
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                        scales.dim() == 2 && scales.size(0) == G && scales.size(1) == N16,
                    "scales must be a dense float32 [", G, ", ", N16, "], got ",
                    scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK_VALUE(!zeros || (zeros->scalar_type() == at::kChar && zeros->is_contiguous() &&
                               zeros->sizes() == scales.sizes()),
                    "zeros must be None or a dense int8 [", G, ", ", N16, "]");
  TORCH_CHECK_VALUE(!mins || !zeros, "mins and zeros exclude each other: a weight with mins "
                    "has no zero point (zeros must be None)");
  TORCH_CHECK_VALUE(!mins || (mins->scalar_type() == at::kFloat && mins->is_contiguous() &&
                              mins->sizes() == scales.sizes()),
                    "mins must be None or a dense float32 [", G, ", ", N16, "]");
  // The output in x's dtype, written by the tiles (a bf16 one rounded there): no fp32 copy.
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef CBATCH_X86
  const std::optional<at::Tensor> bf = quantized_operands::fp32_bias(bias);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto opts = x.options();
  const bool vnni = cpu_has_avx512vnni();
  const bool tiles = bits == 4 && vnni && M >= kInt8FromRows && GQ % kInt8StepQuads == 0 &&
                     Q % kInt8StepQuads == 0 && amx::int8_tiles();
  // 0 past K (quantize_rows), and for the tiles 0 in whole tiles of rows past M
  const int64_t rows = tiles ? (M + kInt8StepRows - 1) / kInt8StepRows * kInt8StepRows : M;
  at::Tensor xq = at::empty({rows, Q * 4}, opts.dtype(at::kChar));
  std::memset(xq.data_ptr<int8_t>() + M * Q * 4, 0, (rows - M) * Q * 4);
  at::Tensor xsum = at::empty({M, G}, opts.dtype(at::kInt));
  at::Tensor xscale = at::empty({M, G}, opts.dtype(at::kFloat));
  at::Tensor xsum_scaled = mins ? at::empty({M, G}, opts.dtype(at::kFloat)) : at::Tensor();
  at::Tensor xshift = at::empty({M, G}, opts.dtype(at::kInt));
  const W4A8Args a{.xq = xq.data_ptr<int8_t>(), .xsum = xsum.data_ptr<int32_t>(),
                   .xscale = xscale.data_ptr<float>(), .M = M, .G = G, .GQ = GQ, .Q = Q,
                   .N = N,
                   .w = static_cast<const uint8_t*>(qweight.data_ptr()), .wscale = scales.data_ptr<float>(),
                   .wzero = zeros ? zeros->data_ptr<int8_t>() : nullptr,
                   .wmin = mins ? mins->data_ptr<float>() : nullptr,
                   .xsum_scaled = mins ? xsum_scaled.data_ptr<float>() : nullptr,
                   .N16 = N16,
                   .shift = (zeros || mins || bits == 8 ? 0 : 8) + (bits == 8 && vnni ? 128 : 0),
                   .xshift = xshift.data_ptr<int32_t>(), .bias = bf ? bf->data_ptr<float>() : nullptr,
                   .out = bf16 ? nullptr : out.data_ptr<float>(),
                   .out_bf16 = bf16 ? out.data_ptr<c10::BFloat16>() : nullptr};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    auto quantize = [&](const auto* xs) {
      quantize_rows(xs, x.stride(0), K, group_size, m0, m1, a, xq.data_ptr<int8_t>(),
                    xsum.data_ptr<int32_t>(), xscale.data_ptr<float>(),
                    mins ? xsum_scaled.data_ptr<float>() : nullptr, xshift.data_ptr<int32_t>());
    };
    bf16 ? quantize(x.data_ptr<c10::BFloat16>()) : quantize(x.data_ptr<float>());
  });
  if (bits == 8 && vnni) {
    count_path(CpuPath::kQuantizedLinearW8A8GroupedVnni);
    run<true, 8>(a);
  } else if (bits == 8) {
    count_path(CpuPath::kQuantizedLinearW8A8GroupedAvx2);
    run<false, 8>(a);
  } else if (tiles) {
    count_path(CpuPath::kQuantizedLinearW4A8Amx);
    amx::on_tiles([&](auto tiles) { run_amx<decltype(tiles)>(a); });
  } else if (vnni) {
    count_path(CpuPath::kQuantizedLinearW4A8Vnni);
    run<true>(a);
  } else {
    count_path(CpuPath::kQuantizedLinearW4A8Avx2);
    run<false>(a);
  }
#endif
  return out;
}

}  // namespace cbatch
