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
// The arithmetic is the fp32 reference's: q - z in integers (exact), converted, times the
// scale (one rounding: the fp32 weight of dequantize(), bit for bit), then fp32 fmas with x
// (bf16 x widened to fp32), each output summed in k order in two interleaved partial sums
// (even and odd k) that keep two fma chains in flight per row.  So a row's result depends
// neither on the other rows nor on the thread count.  A tile is up to kRows rows times two
// vectors of columns (AVX-512: two blocks of 16; AVX2: one block's two halves of 8).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>

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

struct QArgs {
  const float* x;  // [M, K] fp32, rows ldx apart
  int64_t ldx, M, K, N, N16;
  int bits;
  int64_t group_size, groups;
  const uint8_t* q;      // packed (int8 or uint8 bytes)
  const float* scales;   // [G, N16]
  const int8_t* zeros;   // [G, N16] or null
  const float* bias;     // [N] fp32 or null
  float* out;            // [M, N] fp32
};

// Bytes of one block's run of packed rows.
inline int64_t block_bytes(const QArgs& a) {
  return (a.bits == 8 ? a.K : (a.K + 1) / 2) * kQBlock;
}

#ifdef CBATCH_X86
// ---- AVX-512: vectors of 16 columns; a tile's two vectors are two blocks (V = 2) or the
// last block alone (V = 1). ----------------------------------------------------------------
namespace avx512q {

constexpr int kRows = 4;  // rows per tile: 4 rows x 2 vectors x 2 partial sums = 16 zmm

CBATCH_AVX512 CBATCH_INLINE __m512 dequant(__m512i q, __m512i z, __m512 s) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, z)), s);
}

template <int R, int V, int kBits>
CBATCH_AVX512 void tile(const QArgs& a, int64_t m, int64_t block) {
  __m512 acc[kRows][2][2];  // [row][vector][even / odd k]
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 2; ++v) acc[r][v][0] = acc[r][v][1] = _mm512_setzero_ps();
  }
  const int64_t bb = block_bytes(a);
  const uint8_t* w[2] = {a.q + block * bb, a.q + (block + V - 1) * bb};
  const float* x = a.x + m * a.ldx;
  const int32_t default_zero = kBits == 4 ? 8 : 0;
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group_size, k1 = std::min(a.K, k0 + a.group_size);
    __m512 s[2];
    __m512i z[2];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      const int64_t col = (block + v) * kQBlock;
      s[v] = _mm512_loadu_ps(a.scales + g * a.N16 + col);
      z[v] = a.zeros ? _mm512_cvtepi8_epi32(_mm_loadu_si128(
                           reinterpret_cast<const __m128i*>(a.zeros + g * a.N16 + col)))
                     : _mm512_set1_epi32(default_zero);
    }
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {  // a pair of k: int8, two rows of 16; int4, one
      __m512 w0[2], w1[2];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        if constexpr (kBits == 8) {
          const int8_t* p = reinterpret_cast<const int8_t*>(w[v]) + k * kQBlock;
          _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
          w0[v] = dequant(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                              reinterpret_cast<const __m128i*>(p))), z[v], s[v]);
          w1[v] = dequant(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                              reinterpret_cast<const __m128i*>(p + kQBlock))), z[v], s[v]);
        } else {
          const uint8_t* p = w[v] + (k / 2) * kQBlock;
          _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
          const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(p)));
          w0[v] = dequant(_mm512_and_si512(b, _mm512_set1_epi32(15)), z[v], s[v]);
          w1[v] = dequant(_mm512_srli_epi32(b, 4), z[v], s[v]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r * a.ldx + k]);
        const __m512 x1 = _mm512_set1_ps(x[r * a.ldx + k + 1]);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) {
          acc[r][v][0] = _mm512_fmadd_ps(x0, w0[v], acc[r][v][0]);
          acc[r][v][1] = _mm512_fmadd_ps(x1, w1[v], acc[r][v][1]);
        }
      }
    }
    if (k < k1) {  // an odd group's (or K's) last k
      __m512 w0[2];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        __m512i qk;
        if constexpr (kBits == 8) {
          qk = _mm512_cvtepi8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(w[v] + k * kQBlock)));
        } else {
          qk = _mm512_cvtepu8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(w[v] + (k / 2) * kQBlock)));
          qk = (k % 2) ? _mm512_srli_epi32(qk, 4) : _mm512_and_si512(qk, _mm512_set1_epi32(15));
        }
        w0[v] = dequant(qk, z[v], s[v]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r * a.ldx + k]);
        for (int v = 0; v < V; ++v) acc[r][v][0] = _mm512_fmadd_ps(x0, w0[v], acc[r][v][0]);
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = (block + v) * kQBlock;
    const __mmask16 mask = avx512::first_lanes(a.N - col);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 y = _mm512_add_ps(_mm512_add_ps(acc[r][v][0], acc[r][v][1]), bias);
      _mm512_mask_storeu_ps(a.out + (m + r) * a.N + col, mask, y);
    }
  }
}

template <int V, int kBits>
void rows(const QArgs& a, int64_t block, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows) tile<kRows, V, kBits>(a, m, block);
  switch (m1 - m) {
    case 3: return tile<3, V, kBits>(a, m, block);
    case 2: return tile<2, V, kBits>(a, m, block);
    case 1: return tile<1, V, kBits>(a, m, block);
    default: return;
  }
}

struct Isa {
  static constexpr int64_t kItemBlocks = 2;
  template <int kBits>
  static void item(const QArgs& a, int64_t block, int64_t blocks, int64_t m0, int64_t m1) {
    if (block + 1 < blocks) {
      rows<2, kBits>(a, block, m0, m1);
    } else {
      rows<1, kBits>(a, block, m0, m1);
    }
  }
};

}  // namespace avx512q

// ---- AVX2: vectors of 8 columns; a tile's two vectors are one block's halves. -------------
namespace avx2q {

constexpr int kRows = 2;  // rows per tile: 2 rows x 2 halves x 2 partial sums = 8 ymm

CBATCH_AVX2 CBATCH_INLINE __m256 dequant(__m256i q, __m256i z, __m256 s) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, z)), s);
}
CBATCH_AVX2 CBATCH_INLINE __m128i load8(const void* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

template <int R, int kBits>
CBATCH_AVX2 void tile(const QArgs& a, int64_t m, int64_t block) {
  __m256 acc[kRows][2][2];  // [row][half][even / odd k]
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) acc[r][h][0] = acc[r][h][1] = _mm256_setzero_ps();
  }
  const uint8_t* w = a.q + block * block_bytes(a);
  const float* x = a.x + m * a.ldx;
  const int32_t default_zero = kBits == 4 ? 8 : 0;
  const __m256i fifteen = _mm256_set1_epi32(15);
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group_size, k1 = std::min(a.K, k0 + a.group_size);
    const int64_t col = block * kQBlock;
    __m256 s[2];
    __m256i z[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      s[h] = _mm256_loadu_ps(a.scales + g * a.N16 + col + 8 * h);
      z[h] = a.zeros ? _mm256_cvtepi8_epi32(load8(a.zeros + g * a.N16 + col + 8 * h))
                     : _mm256_set1_epi32(default_zero);
    }
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {
      __m256 w0[2], w1[2];
      if constexpr (kBits == 8) {
        const int8_t* p = reinterpret_cast<const int8_t*>(w) + k * kQBlock;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          w0[h] = dequant(_mm256_cvtepi8_epi32(load8(p + 8 * h)), z[h], s[h]);
          w1[h] = dequant(_mm256_cvtepi8_epi32(load8(p + kQBlock + 8 * h)), z[h], s[h]);
        }
      } else {
        const uint8_t* p = w + (k / 2) * kQBlock;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i b = _mm256_cvtepu8_epi32(load8(p + 8 * h));
          w0[h] = dequant(_mm256_and_si256(b, fifteen), z[h], s[h]);
          w1[h] = dequant(_mm256_srli_epi32(b, 4), z[h], s[h]);
        }
      }
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256 x0 = _mm256_broadcast_ss(x + r * a.ldx + k);
        const __m256 x1 = _mm256_broadcast_ss(x + r * a.ldx + k + 1);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          acc[r][h][0] = _mm256_fmadd_ps(x0, w0[h], acc[r][h][0]);
          acc[r][h][1] = _mm256_fmadd_ps(x1, w1[h], acc[r][h][1]);
        }
      }
    }
    if (k < k1) {  // an odd group's (or K's) last k
      __m256 w0[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256i qk;
        if constexpr (kBits == 8) {
          qk = _mm256_cvtepi8_epi32(load8(w + k * kQBlock + 8 * h));
        } else {
          qk = _mm256_cvtepu8_epi32(load8(w + (k / 2) * kQBlock + 8 * h));
          qk = (k % 2) ? _mm256_srli_epi32(qk, 4) : _mm256_and_si256(qk, fifteen);
        }
        w0[h] = dequant(qk, z[h], s[h]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 x0 = _mm256_broadcast_ss(x + r * a.ldx + k);
        for (int h = 0; h < 2; ++h) acc[r][h][0] = _mm256_fmadd_ps(x0, w0[h], acc[r][h][0]);
      }
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const int64_t col = block * kQBlock + 8 * h;
    if (col >= a.N) continue;
    const __m256i mask = avx2::first_lanes(a.N - col);
    const __m256 bias = a.bias ? _mm256_maskload_ps(a.bias + col, mask) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256 y = _mm256_add_ps(_mm256_add_ps(acc[r][h][0], acc[r][h][1]), bias);
      _mm256_maskstore_ps(a.out + (m + r) * a.N + col, mask, y);
    }
  }
}

struct Isa {
  static constexpr int64_t kItemBlocks = 1;
  template <int kBits>
  static void item(const QArgs& a, int64_t block, int64_t, int64_t m0, int64_t m1) {
    int64_t m = m0;
    for (; m + kRows <= m1; m += kRows) tile<kRows, kBits>(a, m, block);
    if (m < m1) tile<1, kBits>(a, m, block);
  }
};

}  // namespace avx2q

// Chunks of rows, each over every column item, the items shared out among threads.
template <typename Isa, int kBits>
void run(const QArgs& a) {
  const int64_t blocks = a.N16 / kQBlock;
  const int64_t items = (blocks + Isa::kItemBlocks - 1) / Isa::kItemBlocks;
  for (int64_t m0 = 0; m0 < a.M; m0 += kChunkRows) {
    const int64_t m1 = std::min(a.M, m0 + kChunkRows);
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        Isa::template item<kBits>(a, i * Isa::kItemBlocks, blocks, m0, m1);
      }
    });
  }
}
#endif  // CBATCH_X86

}  // namespace

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& qweight,
                                const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                                int64_t bits, int64_t group_size, int64_t out_features,
                                const std::optional<at::Tensor>& bias) {
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
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "bias must be [", N, "], got ",
                      bias->sizes());
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> bf =
      bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out.to(x.scalar_type());
#ifdef CBATCH_X86
  const QArgs a{xf.data_ptr<float>(), K, M, K, N, N16, int(bits), group_size, groups,
                static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                zeros ? zeros->data_ptr<int8_t>() : nullptr, bf ? bf->data_ptr<float>() : nullptr,
                out.data_ptr<float>()};
  const bool avx512 = cpu_has_avx512();
  count_path(bits == 8 ? (avx512 ? CpuPath::kQuantizedLinearW8Avx512
                                 : CpuPath::kQuantizedLinearW8Avx2)
                       : (avx512 ? CpuPath::kQuantizedLinearW4Avx512
                                 : CpuPath::kQuantizedLinearW4Avx2));
  if (avx512) {
    bits == 8 ? run<avx512q::Isa, 8>(a) : run<avx512q::Isa, 4>(a);
  } else {
    bits == 8 ? run<avx2q::Isa, 8>(a) : run<avx2q::Isa, 4>(a);
  }
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace cbatch
