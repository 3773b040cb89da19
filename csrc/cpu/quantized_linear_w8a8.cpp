// The CPU W8A8 linear op: int8 weights per output channel (symmetric), x quantized to int8 per
// token on every call, integer dot products summed exactly in int32, then
//   y[m, n] = fl(fl(fl(acc[m, n]) * s_w[n]) * s_x[m]) (+ bias[n], fused into the last multiply)
// as vLLM's int8 GEMM epilogue scales (the weight's scale first, then the token's).
//
// The activation quantization, per row of x in fp32 (cbatch/ops/reference.py,
// quantize_per_token, computes the same): a = max |x|, q = nearbyint(x * fl(127 / a)) (the
// default rounding: ties to even; |q| <= 127), s_x = fl(a / 127); a row of zeros has q 0 and
// s_x 0.
//
// The weight's layout (cbatch/layers/quantization/weight.py, pack_w8a8): uint8
// [N16 / 16, ceil(K / 4), 64], byte [b, i, 4 j + t] = q[16 b + j, 4 i + t] + 128 (128 past K):
// each 4-byte lane is one column's four k, the operand of vpdpbusd (u8 x s8 quads) as it is,
// and of AVX2's vpmaddubsw with the top bit flipped back (the AVX2 tile below).  For vpdpbusd
// the weight is the unsigned operand and x the signed one, so sum (q + 128) x = sum q x + 128
// sum x: one correction per row, 128 times the row's sum of its q, none per column.  Every
// product and sum is an integer below 255 * 127 * 4 * ceil(K / 4) < 2^31 (K <= 65536), so the
// sums are exact whatever the order or path, and the output is the reference's bit for bit
// but for the fused bias add (within one fp32 rounding of it:
// tests/ops/test_quantized_linear_w8a8.py).  A row's result depends on nothing but that row.
//
// x (fp32 or bf16) is read in place, rows x.stride(0) apart; a bf16 x gets a bf16 output,
// each fp32 result rounded in the tile's epilogue as Tensor.to(torch.bfloat16) rounds: no fp32
// copy of x or of the output.
//
// Paths: AMX-INT8 tiles (tdpbsud) from 8 rows where the CPU has them; AVX512-VNNI (vpdpbusd,
// 4 rows x 4 blocks of 16 columns per tile) where it has that, else AVX2 (vpmaddubsw on signed
// weights, 4 rows x 16 columns per tile).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../ops.h"
#include "amx_tile_ops.h"
#include "avx2.h"
#include "avx512.h"
#include "quantized_operands.h"

namespace cbatch {

namespace {

constexpr int64_t kBlock = 16;      // output columns per packed block
constexpr int64_t kChunkRows = 64;  // rows per pass over the weights (they stay in L2)
constexpr int64_t kMaxK = 65536;    // sums of 255 * 127 * K stay below 2^31

struct W8A8Args {
  const int8_t* xq;      // [M, K4 * 4] the quantized rows, 0 past K
  const int32_t* xsum;   // [M] each row's sum of q (VNNI's and AMX's unsigned weights' shift)
  const float* xscale;   // [M] s_x
  int64_t M, K4, N;      // K4: quads of k
  const uint8_t* w;      // [N16 / 16, K4, 64]
  const float* wscale;   // [N16] s_w
  const float* bias;     // [N] fp32 or null
  float* out;            // [M, N] fp32 (an fp32 x), or null
  c10::BFloat16* out_bf16;  // [M, N] (a bf16 x: each fp32 result rounded as torch rounds it)
};

// Per-token quantization of rows [m0, m1) of x [M, K] (fp32 or bf16, rows x_stride apart; bf16
// widens to fp32 exactly) into a's buffers, 0 past K.
template <typename T>
void quantize_rows(const T* xs, int64_t x_stride, int64_t K, int64_t m0, int64_t m1,
                   int8_t* xq, int32_t* xsum, float* xscale, int64_t K4) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* x = xs + m * x_stride;
    int8_t* q = xq + m * K4 * 4;
    std::memset(q + K, 0, K4 * 4 - K);
    xscale[m] = quantized_operands::quantize_run(x, K, q, &xsum[m]) / 127.f;
  }
}

#ifdef CBATCH_X86
// Quads of k per pass where several tiles of rows share an item's weights (both paths): 1 KiB
// of each block, which the first tile streams from memory and the others then read from L1,
// so that their multiplies run while the stream goes on.  One pass over all of K ran the first
// tile's loads, then the others' multiplies, the two times added: SmolLM2-360M's 128 linears
// at 8 rows took 14.5-14.9 ms on VNNI, in these passes 11.8-12.5 (1 row: 10.5-11.6;
// benchmarks/NOTES.md, "W8A8: int8 weights against int8 activations").  A tile's sums
// wait between passes in its caller's array; the integers are exact, so the bits do not move.
constexpr int64_t kPassQuads = 16;

// ---- AVX2: llama.cpp's int8 x int8 product (quantized_operands::add_quad_s8).  A quad's 64
// bytes are columns 0..7 then 8..15 (the layout's byte 4 j + t), flipped back to the signed q
// (an xor of the top bit) and their magnitudes taken, once for the tile's rows; each row then
// multiplies them on vpmaddubsw into two vectors of 8 columns' int32 sums, which are sum q x
// itself: no 128 sum x to subtract.  (Until 2026-12-08 the AVX2 tile widened both operands to
// 16 bits for vpmaddwd, 16 multiply-adds an instruction where a vpmaddubsw and vpmaddwd pair
// does 32, in tiles of 2 rows, from an int16 copy of x: on Zen 3 its prompt rows ran at 63-69%
// of the pair's peak against this tile's 66-71%, its batch-8 decode step 41-42 ms against
// 34-37 (benchmarks/NOTES.md, "W8A8: int8 weights against int8 activations").)
constexpr int kAvx2Rows = 4;  // 4 rows x 2 halves = 8 sums, 4 weight vectors, 1 x

// Rows m .. m + R - 1 of `block` over quads [i0, i1) of k, added to their sums so far
// (`sums`; none before quad 0); the pass that ends at the last quad finishes them.
template <int R>
CBATCH_AVX2 void tile_avx2(const W8A8Args& a, int64_t m, int64_t block, int64_t i0, int64_t i1,
                           __m256i (&sums)[kAvx2Rows][2]) {
  __m256i acc[kAvx2Rows][2];  // [row][half]
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) acc[r][h] = i0 == 0 ? _mm256_setzero_si256() : sums[r][h];
  }
  const uint8_t* w = a.w + block * a.K4 * 64;
  const int8_t* x = a.xq + m * a.K4 * 4;
  const __m256i flip = _mm256_set1_epi8(-128);
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* quad = w + i * 64;
    _mm_prefetch(reinterpret_cast<const char*>(quad) + 1024, _MM_HINT_T0);
    const __m256i q0 = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad)), flip);
    const __m256i q1 = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 32)), flip);
    const __m256i u0 = _mm256_abs_epi8(q0), u1 = _mm256_abs_epi8(q1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t xq;  // the row's four k as int8, in every lane
      std::memcpy(&xq, x + r * a.K4 * 4 + 4 * i, sizeof xq);
      quantized_operands::add_quad_s8(q0, q1, u0, u1, _mm256_set1_epi32(xq), acc[r][0],
                                      acc[r][1]);
    }
  }
  if (i1 < a.K4) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[r][0] = acc[r][0], sums[r][1] = acc[r][1];
    return;
  }
  const int64_t col = block * kBlock;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 sx = _mm256_set1_ps(a.xscale[m + r]);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // columns 8 h .. 8 h + 7
      const int64_t n = col + 8 * h, left = a.N - n;
      if (left <= 0) break;
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_loadu_ps(a.wscale + n));
      const __m256i lanes = avx2::first_lanes(left);
      const __m256 y = a.bias ? _mm256_fmadd_ps(t, sx, _mm256_maskload_ps(a.bias + n, lanes))
                              : _mm256_mul_ps(t, sx);
      quantized_operands::store_row8(y, lanes, left, a.out, a.out_bf16, (m + r) * a.N + n);
    }
  }
}

// One block (end = block + 1) of rows [m0, m1) (at most kChunkRows), in passes of kPassQuads
// where 2-4 tiles of rows share it (2-row tiles on Zen 4, 8 rows: the body 27.4-28.3 ms in one
// pass, 22.5-23.6 in passes); more tiles keep one pass, as the small tile's sums, stored and
// reloaded every pass, then cost more than the passes gain (64 rows: +14%).
void item_avx2(const W8A8Args& a, int64_t block, int64_t /*end*/, int64_t m0, int64_t m1) {
  const int64_t rows = m1 - m0;
  const int64_t pass = rows > kAvx2Rows && rows <= 4 * kAvx2Rows ? kPassQuads : a.K4;
  __m256i sums[kChunkRows / kAvx2Rows + 1][kAvx2Rows][2];
  for (int64_t i0 = 0; i0 < a.K4; i0 += pass) {
    const int64_t i1 = std::min(a.K4, i0 + pass);
    int64_t m = m0, t = 0;
    for (; m + kAvx2Rows <= m1; m += kAvx2Rows) {
      tile_avx2<kAvx2Rows>(a, m, block, i0, i1, sums[t++]);
    }
    switch (m1 - m) {
      case 3: tile_avx2<3>(a, m, block, i0, i1, sums[t]); break;
      case 2: tile_avx2<2>(a, m, block, i0, i1, sums[t]); break;
      case 1: tile_avx2<1>(a, m, block, i0, i1, sums[t]); break;
      default: break;
    }
  }
}

// ---- AVX512-VNNI: a block of 16 columns is one vector of int32 sums. ----------------------
#define CBATCH_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
constexpr int kVnniRows = 4;    // 4 rows x 4 blocks = 16 sums, 4 weight vectors, 1 x
constexpr int kVnniBlocks = 4;  // blocks per column item

// Row m's int32 sums of columns n .. n + 15 (those below N) finished and stored:
// y = fl(fl(fl(acc - 128 xsum) * s_w) * s_x) (+ bias, fused into the last multiply).
CBATCH_VNNI CBATCH_INLINE void finish(const W8A8Args& a, __m512i acc, int64_t m, int64_t n) {
  const __mmask16 lanes = avx512::first_lanes(a.N - n);
  const __m512i shift = _mm512_set1_epi32(128 * a.xsum[m]);
  const __m512 sx = _mm512_set1_ps(a.xscale[m]);
  const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, shift)),
                                 _mm512_loadu_ps(a.wscale + n));
  const __m512 y = a.bias ? _mm512_fmadd_ps(t, sx, _mm512_maskz_loadu_ps(lanes, a.bias + n))
                          : _mm512_mul_ps(t, sx);
  if (a.out) {
    _mm512_mask_storeu_ps(a.out + m * a.N + n, lanes, y);
  } else {
    alignas(64) float t[16];
    _mm512_store_ps(t, y);
    quantized_operands::store_bf16(t, std::min<int64_t>(a.N - n, 16), a.out_bf16 + m * a.N + n);
  }
}

// Rows m .. m + R - 1 times blocks block .. block + V - 1 over quads [i0, i1) of k, added to
// their sums so far (`sums`; none before quad 0); the pass that ends at the last quad finishes
// them into the output, the others leave them in `sums`.
template <int R, int V>
CBATCH_VNNI void tile_vnni(const W8A8Args& a, int64_t m, int64_t block, int64_t i0, int64_t i1,
                           __m512i (&sums)[kVnniRows][kVnniBlocks]) {
  __m512i acc[kVnniRows][kVnniBlocks];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = i0 == 0 ? _mm512_setzero_si512() : sums[r][v];
  }
  const uint8_t* w = a.w + block * a.K4 * 64;
  const int8_t* x = a.xq + m * a.K4 * 4;
  for (int64_t i = i0; i < i1; ++i) {
    __m512i wv[kVnniBlocks];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const uint8_t* p = w + (v * a.K4 + i) * 64;
      wv[v] = _mm512_loadu_si512(p);
      _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t quad;  // the row's four k as int8
      std::memcpy(&quad, x + r * a.K4 * 4 + 4 * i, sizeof quad);
      const __m512i xv = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], wv[v], xv);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      if (i1 == a.K4) {
        finish(a, acc[r][v], m + r, (block + v) * kBlock);
      } else {
        sums[r][v] = acc[r][v];
      }
    }
  }
}

// Rows [m0, m1) (at most kChunkRows) of blocks [block, block + V): tiles of kVnniRows rows,
// then the last rows one by one, in one pass over K where one tile holds them all.
template <int V>
void rows_vnni(const W8A8Args& a, int64_t block, int64_t m0, int64_t m1) {
  const int64_t pass = m1 - m0 > kVnniRows ? kPassQuads : a.K4;
  __m512i sums[kChunkRows / kVnniRows + kVnniRows - 1][kVnniRows][kVnniBlocks];
  for (int64_t i0 = 0; i0 < a.K4; i0 += pass) {
    const int64_t i1 = std::min(a.K4, i0 + pass);
    int64_t m = m0, t = 0;
    for (; m + kVnniRows <= m1; m += kVnniRows) {
      tile_vnni<kVnniRows, V>(a, m, block, i0, i1, sums[t++]);
    }
    for (; m < m1; ++m) tile_vnni<1, V>(a, m, block, i0, i1, sums[t++]);
  }
}

// Blocks [block, end) (at most kVnniBlocks) of rows [m0, m1).
void item_vnni(const W8A8Args& a, int64_t block, int64_t end, int64_t m0, int64_t m1) {
  switch (end - block) {
    case 4: return rows_vnni<4>(a, block, m0, m1);
    case 3: return rows_vnni<3>(a, block, m0, m1);
    case 2: return rows_vnni<2>(a, block, m0, m1);
    default: return rows_vnni<1>(a, block, m0, m1);
  }
}

// ---- AMX-INT8 (Sapphire Rapids and later): tdpbsud multiplies 16 rows x 64 k of x (signed)
// by 64 k x 16 columns of W (unsigned) into 16 x 16 int32 sums, where vpdpbusd does 16 x 4.
// A block of the packed layout, [K4][64], is a stack of AMX B tiles as it is (16 quads of k,
// 64 bytes apart); x's rows are A tiles, zero rows past M.  The sums are the same exact
// integers and `finish` the VNNI tiles' epilogue, so a row's output is the same bits whichever
// path ran and however many rows share the call (batch-invariant engines take it too).
// Templated on the tile instructions: the hardware's, or amx_tile_ops.h's model of them.
using amx::kInt8FromRows, amx::kInt8StepQuads, amx::kInt8StepRows;

// Rows [m, m + 32) of x times the NB column blocks from `block`: sums [32][32] int32.
template <class Tiles, int NB>
CBATCH_AMX_INT8 void amx_sums(const W8A8Args& a, int64_t m, int64_t block, int32_t* sums) {
  const uint8_t* w0 = a.w + block * a.K4 * 64;
  amx::zero_sums<Tiles>();
  amx::add_products<Tiles, NB>(a.xq + m * a.K4 * 4, a.K4 * 4, w0, w0 + a.K4 * 64, 0, a.K4);
  amx::store_sums<Tiles, NB>(sums);
}

// Column blocks block .. block + nb - 1 against rows [m0, m1) of x, 32 at a time.
template <class Tiles>
CBATCH_AMX_INT8 void amx_pair(const W8A8Args& a, int64_t block, int nb, int64_t m0,
                              int64_t m1) {
  alignas(64) int32_t sums[kInt8StepRows * 32];
  for (int64_t m = m0; m < m1; m += kInt8StepRows) {
    if (nb == 2) {
      amx_sums<Tiles, 2>(a, m, block, sums);
    } else {
      amx_sums<Tiles, 1>(a, m, block, sums);
    }
    for (int64_t r = 0; r < std::min(kInt8StepRows, a.M - m); ++r) {
      for (int b = 0; b < nb; ++b) {
        finish(a, _mm512_load_si512(sums + r * 32 + b * kBlock), m + r, (block + b) * kBlock);
      }
    }
  }
}

template <class Tiles>
void run_amx(const W8A8Args& a) {
  amx::for_pairs<Tiles>(a.M, (a.N + kBlock - 1) / kBlock, a.K4 * 4,
                        [&](int64_t block, int nb, int64_t m0, int64_t m1) {
                          amx_pair<Tiles>(a, block, nb, m0, m1);
                        });
}
#undef CBATCH_VNNI

// Chunks of rows, each over every block of columns: each thread an even, contiguous share of
// the blocks, in items of up to item_blocks (a share of whole items left one thread an item
// more than the other: 8 against 7 for SmolLM2's o_proj and down_proj).
template <typename Item>
void run(const W8A8Args& a, int64_t item_blocks, Item item) {
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  for (int64_t m0 = 0; m0 < a.M; m0 += kChunkRows) {
    const int64_t m1 = std::min(a.M, m0 + kChunkRows);
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; b += item_blocks) {
        item(a, b, std::min(end, b + item_blocks), m0, m1);
      }
    });
  }
}
#endif  // CBATCH_X86

}  // namespace

at::Tensor quantized_linear_w8a8_cpu(const at::Tensor& x_in, const at::Tensor& qweight,
                                     const at::Tensor& scales, int64_t out_features,
                                     const std::optional<at::Tensor>& bias) {
  const at::Tensor x = quantized_operands::checked_x(x_in, out_features, bias);
  TORCH_CHECK_VALUE(quantized_linear_supported(),
                    "cbatch's W8A8 CPU linear runs only on an x86 CPU with AVX2 and FMA, "
                    "or AVX-512");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK_VALUE(K <= kMaxK, "W8A8 sums int32: K must be <= ", kMaxK, ", got ", K);
  const int64_t N16 = (N + kBlock - 1) / kBlock * kBlock, K4 = (K + 3) / 4;
  TORCH_CHECK_TYPE(qweight.scalar_type() == at::kByte, "a W8A8 qweight is uint8, got ",
                   qweight.scalar_type());
  TORCH_CHECK_VALUE(qweight.is_contiguous() && qweight.dim() == 3 &&
                        qweight.size(0) == N16 / kBlock && qweight.size(1) == K4 &&
                        qweight.size(2) == 4 * kBlock,
                    "qweight ", qweight.sizes(), " does not hold W8A8 ", N, " x ", K,
                    " (expected [", N16 / kBlock, ", ", K4, ", 64])");
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                        scales.dim() == 2 && scales.size(0) == 1 && scales.size(1) == N16,
                    "scales must be a dense float32 [1, ", N16, "], got ",
                    scales.scalar_type(), " ", scales.sizes());
  // The output in x's dtype, written by the tiles (a bf16 one rounded there): no fp32 copy.
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef CBATCH_X86
  const std::optional<at::Tensor> bf = quantized_operands::fp32_bias(bias);
  const bool vnni = cpu_has_avx512vnni(), bf16 = x.scalar_type() == at::kBFloat16;
  const bool tiles =
      vnni && M >= kInt8FromRows && K4 % kInt8StepQuads == 0 && amx::int8_tiles();
  const auto opts = x.options();
  // 0 past K (quantize_rows), and for the tiles 0 in whole tiles of rows past M
  const int64_t rows = tiles ? (M + kInt8StepRows - 1) / kInt8StepRows * kInt8StepRows : M;
  at::Tensor xq = at::empty({rows, K4 * 4}, opts.dtype(at::kChar));
  std::memset(xq.data_ptr<int8_t>() + M * K4 * 4, 0, (rows - M) * K4 * 4);
  at::Tensor xsum = at::empty({M}, opts.dtype(at::kInt));
  at::Tensor xscale = at::empty({M}, opts.dtype(at::kFloat));
  const W8A8Args a{.xq = xq.data_ptr<int8_t>(),
                   .xsum = xsum.data_ptr<int32_t>(), .xscale = xscale.data_ptr<float>(),
                   .M = M, .K4 = K4, .N = N, .w = qweight.data_ptr<uint8_t>(),
                   .wscale = scales.data_ptr<float>(),
                   .bias = bf ? bf->data_ptr<float>() : nullptr,
                   .out = bf16 ? nullptr : out.data_ptr<float>(),
                   .out_bf16 = bf16 ? out.data_ptr<c10::BFloat16>() : nullptr};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    auto quantize = [&](const auto* xs) {
      quantize_rows(xs, x.stride(0), K, m0, m1, xq.data_ptr<int8_t>(), xsum.data_ptr<int32_t>(),
                    xscale.data_ptr<float>(), K4);
    };
    bf16 ? quantize(x.data_ptr<c10::BFloat16>()) : quantize(x.data_ptr<float>());
  });
  count_path(tiles  ? CpuPath::kQuantizedLinearW8A8Amx
             : vnni ? CpuPath::kQuantizedLinearW8A8Vnni
                    : CpuPath::kQuantizedLinearW8A8Avx2);
  if (tiles) {
    amx::on_tiles([&](auto tiles) { run_amx<decltype(tiles)>(a); });
  } else if (vnni) {
    run(a, kVnniBlocks, item_vnni);
  } else {
    run(a, 1, item_avx2);
  }
#endif
  return out;
}

}  // namespace cbatch
