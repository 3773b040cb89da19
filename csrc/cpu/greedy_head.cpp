// The greedy head op: the greedy tokens of an lm_head, argmax(linear(x)) bit for bit, read
// through a smaller copy of its weight (a screen) and the kernel's exact sums of the few
// columns the screen cannot rule out.  greedy_head_supported says where it runs.
//
// A greedy step needs each row's argmax of x @ W^T, not its logits, and the lm_head is a
// third of the bytes a GPT-2 decode step reads (fp32), a quarter in bf16.  A screen runs the
// GEMM kernel (gemm.h) on a smaller copy of W (int8: half a bf16 W's bytes, a quarter of an
// fp32 one's; or, for fp32, bf16), then bounds how far each screened value can be from the
// lm_head's own logit:
// - fp32 lm_head, bf16 screen (vdpbf16ps with AVX512-BF16, else the AVX2 tile with bf16
//   widened in registers) on x and W rounded to bf16: its A_j differs from the fp32
//   kernel's logit E_j by at most
//     B = g_K |x| |w_j| + g_2K |x~| |w~_j| + |x - x~| |w_j| + |x~| |w_j - w~_j| + tiny
//   (|.| the 2-norm, ~ the bf16 rounding, g_n = nu / (1 - nu) with u = 2^-24: the two sums
//   of K products in any order, Cauchy-Schwarz for the rest, `tiny` for bf16 products
//   flushed to zero), with each column norm's maximum over W.  A column with A_j < A_t - 2B,
//   t the screen's argmax, has E_j < E_t, so the fp32 kernel's argmax (its first maximum) is
//   among the others.
// - int8 screen (AVX512-VNNI's vpdpwssd, else AVX2's vpmaddwd on W widened to int16) of a
//   bf16 or fp32 lm_head: W ~ s_j q_j per column (q int8, s_j = max_k |w_jk| / 127), x ~ t p
//   per row (p int16, t a power of two so large that no int32 sum of K products overflows),
//   exact int32 sums S_j = p . q_j, and A_j = fl(fl(S_j) s_j) in units of t.  Exact: |p_k| <=
//   L = min(32767, floor((2^31 - 1) / (128 K))) and |q_jk| <= 127, so each product, each
//   pair's sum (vpdpwssd's and vpmaddwd's, in int32) and each partial sum of S_j, in any
//   order, is at most 128 K L <= 2^31 - 1 in magnitude: no int32 sum wraps (K below 2^24,
//   where L >= 1), and both ISAs' S_j are the same integer.  The kernel's fp32 sum E_j is
//   within
//     B = g |x| |w_j| + |x - t p| |w_j| + |t p| |w_j - s_j q_j| + 2.01 u |t p| |s_j q_j| + tiny
//   of t A_j: g = g_K for fp32 (one fma per k), g_2K for bf16 (vdpbf16ps as two roundings per
//   pair of k, as Intel's manual has it, and as measured here; g_2K holds for either order
//   of the two; without AVX512-BF16 the AVX2 tile rounds once per k, one fma per k as fp32,
//   and g_K <= g_2K).  fp32: a column with t A_j < t A_t - 2B is dropped, as above.  bf16: the
//   logit is E_j rounded to bf16, which ties far more often; with lb = t A_t - B <= E_t, q
//   the largest bf16 <= lb and p' the largest bf16 < q, a column with t A_j + B <= p' has
//   bf16(E_j) <= p' < q <= bf16(E_t): neither the maximum nor a tie of it.
// For each block of 16 columns that holds one the screen keeps, the logits are computed as
// the kernel computes them (fp32: one fma per k, in order, from zero, then + 0 for the absent
// bias; bf16: one vdpbf16ps per pair of k, in order, from zero, + 0, rounded to bf16, or on
// AVX2 one fma per k as fp32, + 0, rounded to bf16 to nearest even), bit for bit, and the
// first maximum wins.  Rows the screen cannot settle cheaply run the kernel on
// the whole row: a NaN or infinity anywhere, sums that could overflow (or, bf16, a bound
// reaching bf16's subnormals), or more than kMaxBlocks blocks to sum (x = 0 ties every
// column).
//
// A bf16 lm_head's int8 screen runs below kPackFrom rows (16).  From there the bf16 lm_head
// is compute-bound, and the screen's multiply-adds are as many as the kernel's, so the kernel
// alone is as fast or faster (benchmarks/NOTES.md, "The lm_head's greedy screen", on AVX-512
// and on AVX2, where the kernel also widens bf16).
// An fp32 lm_head's screens (their multiply-adds cost half the kernel's) run at every row
// count.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "gemm.h"

namespace cbatch {

#ifdef CBATCH_X86

// Blocks a row may keep before the kernel runs the whole row instead (a 16-column block is
// K cache lines to read).
constexpr int64_t kMaxBlocks = 256;

// The two ISAs' parts of settle_row: next_kept(approx, n, N, cut, &lanes), the first block of
// 16 columns from column n on holding a screened value >= cut (its first column, N if none;
// lanes: which of its columns, as bits), and exact(x, packed, cols, count, K, out), the
// logits of the 16 columns of each of `count` (at most kGroup) packed blocks, starting at
// columns cols[], as the kernels (avx512::tile, avx2::tile) compute them: on AVX-512 kGroup
// blocks at once, so that one sum's chain of K dependent multiply-adds hides the others'
// latency.  bf16's exact is the one of the ISA whose tile runs a bf16 linear: AVX-512's with
// AVX512-BF16, else AVX2's.
constexpr int kGroup = 4;
namespace avx512 {
namespace {

struct Screen {
  CBATCH_AVX512 static int64_t next_kept(const float* approx, int64_t n, int64_t N, float cut,
                                         uint32_t* lanes) {
    const __m512 c = _mm512_set1_ps(cut);
    for (; n < N; n += kBlock) {
      const __mmask16 valid = first_lanes(N - n);
      *lanes = _mm512_mask_cmp_ps_mask(valid, load(approx + n, valid), c, _CMP_GE_OQ);
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
      _mm512_storeu_ps(out[g], widen((__m256i)(_mm512_cvtneps_pbh(v))));
    }
  }
};


}  // namespace
}  // namespace avx512

namespace avx2 {
namespace {

struct Screen {
  CBATCH_AVX2 static int64_t next_kept(const float* approx, int64_t n, int64_t N, float cut,
                                       uint32_t* lanes) {
    const __m256 c = _mm256_set1_ps(cut);
    for (; n < N; n += kBlock) {
      uint32_t bits = 0;
      for (int h = 0; h < 2; ++h) {
        const __m256i valid = first_lanes(N - n - 8 * h);
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
  // (a bf16 lm_head on a CPU without AVX512-BF16: the AVX2 tile's fmas, k then k + 1 of each
  // pair, from zero, + 0, rounded to bf16 as its store rounds, to_bf16)
  CBATCH_AVX2 static void exact(const c10::BFloat16* x, const c10::BFloat16* packed,
                                const int64_t* cols, int count, int64_t K,
                                float (*out)[kBlock]) {
    const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
    for (int g = 0; g < count; ++g) {  // one block at a time
      const c10::BFloat16* block = packed + cols[g] * K;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 2) {
        const __m256i* wk = reinterpret_cast<const __m256i*>(block + k * kBlock);
        const __m256i v0 = _mm256_loadu_si256(wk), v1 = _mm256_loadu_si256(wk + 1);
        int32_t pair;
        std::memcpy(&pair, x + k, sizeof pair);
        const __m256i p = _mm256_set1_epi32(pair);
        const __m256 x0 = low_bf16(p), x1 = high_bf16(p, high);
        acc0 = _mm256_fmadd_ps(x1, high_bf16(v0, high), _mm256_fmadd_ps(x0, low_bf16(v0), acc0));
        acc1 = _mm256_fmadd_ps(x1, high_bf16(v1, high), _mm256_fmadd_ps(x0, low_bf16(v1), acc1));
      }
      const __m256 sums[2] = {acc0, acc1};
      for (int h = 0; h < 2; ++h) {  // + 0, to bf16 and back to fp32 (exact)
        const __m128i b = to_bf16(_mm256_add_ps(sums[h], _mm256_setzero_ps()));
        _mm256_storeu_ps(out[g] + 8 * h,
                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
      }
    }
  }
};

// The row's greedy token, or -1 where the kernel must run the whole row.  approx: the

}  // namespace
}  // namespace avx2

namespace {
// screen's [N] values; cut: keep the columns whose value is at least this (NaN: settle
// nothing).  S: avx512::Screen or avx2::Screen; T: fp32 or bf16 (x and the packed weight).
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
// torch.argmax's answer of their logits (argmax_rows_cpu).
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
  count_path(CpuPath::kGreedyHeadUnsettledRows, U);
  at::Tensor rows = at::empty({U, K}, x.options());
  for (int64_t i = 0; i < U; ++i) {
    std::memcpy(rows.data_ptr<T>() + i * K, x.data_ptr<T>() + unsettled[i] * x.stride(0),
                K * sizeof(T));
  }
  const at::Tensor picked = argmax_rows_cpu(logits_cpu(rows, packed, N));
  for (int64_t i = 0; i < U; ++i) out[unsettled[i]] = picked.data_ptr<int64_t>()[i];
}

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
  const Args<B16, float> args{.x = xb.data_ptr<B16>(), .ldx = K, .M = M, .K = K, .N = N,
                              .xp = nullptr, .w = screen.data_ptr<B16>(), .bias = nullptr,
                              .residual = nullptr, .ldr = 0, .gelu = false,
                              .out = approx.data_ptr<float>()};
  if (cpu_has_avx512bf16()) {  // vdpbf16ps
    count_path(CpuPath::kGreedyHeadBf16Avx512);
    run_gemm<avx512::Gemm>(args);
  } else {  // bf16 widened to fp32 in registers
    count_path(CpuPath::kGreedyHeadBf16Avx2);
    run_gemm<avx2::Gemm>(args);
  }
  const at::Tensor top = argmax_rows_cpu(approx);
  std::vector<float> cuts(M);
  for (int64_t m = 0; m < M; ++m) {
    cuts[m] = float_below(approx.data_ptr<float>()[m * N + top.data_ptr<int64_t>()[m]] -
                          2 * bound[m]);
  }
  if (cpu_has_avx512()) {
    settle_rows<avx512::Screen, float>(x, packed, N, approx, cuts, out);
  } else {
    settle_rows<avx2::Screen, float>(x, packed, N, approx, cuts, out);
  }
}

// Whether the int8 screen's tile is AVX-512's (vpdpwssd; its target holds AVX512-BF16 too), not
// AVX2's (vpmaddwd): the sums are the same integers either way.
bool int8_vnni() { return cpu_has_avx512bf16() && cpu_has_avx512vnni(); }

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
  const Args<int8_t, float> args{.x = p.data_ptr<int16_t>(), .ldx = K, .M = M, .K = K, .N = N,
                                 .xp = nullptr, .w = screen.data_ptr<int8_t>(), .bias = nullptr,
                                 .residual = nullptr, .ldr = 0, .gelu = false,
                                 .out = approx.data_ptr<float>(),
                                 .scale = scales.data_ptr<float>()};
  if (int8_vnni()) {
    count_path(CpuPath::kGreedyHeadInt8Avx512Vnni);
    run_gemm<avx512::Gemm>(args);
  } else {
    count_path(CpuPath::kGreedyHeadInt8Avx2);
    run_gemm<avx2::Gemm>(args);
  }
  const at::Tensor top = argmax_rows_cpu(approx);
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
  // the kernel's sums as linear_cpu runs them: fp32's are the same on both ISAs; bf16 takes
  // vdpbf16ps with AVX512-BF16, else AVX2's fmas
  if (std::is_same_v<T, float> ? cpu_has_avx512() : cpu_has_avx512bf16()) {
    settle_rows<avx512::Screen, T>(x, packed, N, approx, cuts, out);
  } else {
    settle_rows<avx2::Screen, T>(x, packed, N, approx, cuts, out);
  }
}

}  // namespace
#endif  // CBATCH_X86

bool greedy_head_supported(at::ScalarType dtype) {
#ifdef CBATCH_X86
  // wherever linear_cpu runs the lm_head, whose sums settle_row reproduces; the int8 tile is
  // vpdpwssd's where the CPU has it, else vpmaddwd's
  return (dtype == at::kFloat || dtype == at::kBFloat16) && cpu_linear_supported(dtype);
#else
  (void)dtype;
  return false;
#endif
}

at::Tensor greedy_head_cpu(const at::Tensor& x, const at::Tensor& packed,
                           const at::Tensor& screen, int64_t out_features, double w_norm,
                           double screen_norm, double error_norm,
                           const std::optional<at::Tensor>& scales, bool amx) {
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
  TORCH_CHECK_VALUE(greedy_head_supported(x.scalar_type()), "greedy_head runs ",
                    x.scalar_type(), " only where cbatch's CPU linear runs it (an x86 CPU with ",
                    bf16 ? "AVX512-BF16, or AVX2 and FMA without AVX-512"
                         : "AVX2 and FMA, or AVX-512",
                    ")");
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
    count_path(CpuPath::kGreedyHeadKernel);  // (on AMX tiles where amx allows them)
    return argmax_rows_cpu(logits_cpu(x, packed, N, amx));
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
