// The operand checks and set-up that the CPU W8A8 and W4A8 linear ops share
// (quantized_linear_w8a8.cpp, quantized_linear_w4a8.cpp): x [M, K] float32 or bfloat16 with
// dense rows, out_features N and K not empty, bias [N] or none; and their bf16 epilogue.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "avx2.h"

namespace cbatch::quantized_operands {

// Checks x, N and the bias; returns x with dense rows (itself when its rows are dense).
inline at::Tensor checked_x(const at::Tensor& x, int64_t out_features,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(out_features >= 1 && x.size(1) >= 1, "empty weight: ", out_features, " x ",
                    x.size(1));
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, "bias must be [",
                      out_features, "], got ", bias->sizes());
  }
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

// The bias as a dense float32 tensor: itself when it is one (no copy on every call).
inline std::optional<at::Tensor> fp32_bias(const std::optional<at::Tensor>& bias) {
  if (!bias) return std::nullopt;
  if (bias->scalar_type() == at::kFloat && bias->is_contiguous()) return bias;
  return bias->to(at::kFloat).contiguous();
}

// count fp32 results of a tile to a bf16 output, each rounded as Tensor.to(torch.bfloat16)
// rounds (to nearest even): the ops' bf16 epilogue.
inline void store_bf16(const float* t, int64_t count, c10::BFloat16* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = c10::BFloat16(t[i]);
}

// The ops' activation rule over one run of x (a W8A8 row, a W4A8 group): a = max |x| (a NaN
// skipped), q[k] = nearbyint(x[k] * fl(127 / a)) (ties to even; |q| <= 127; all 0 when a is
// 0), *sum = the sum of the q; returns a.  x is fp32 or bf16 (widened exactly).  AVX2 for
// whole runs of 8 k (the same products, rounded by vroundps to nearest even, as nearbyint
// rounds in the default mode), the rest one k at a time: the scalar loop of the reference's
// quantize_per_token / quantize_per_group cost a W4A8 call at batch 1 about 10% of its time.
template <typename T>
#ifdef CBATCH_X86
CBATCH_AVX2  // (the ops reach it only after cpu_has_avx2())
#endif
inline float quantize_run(const T* x, int64_t n, int8_t* q, int32_t* sum) {
#ifdef CBATCH_X86
  const int64_t whole = n / 8 * 8;  // k in whole vectors
#else
  const int64_t whole = 0;
#endif
  float a = 0.f;
  int32_t total = 0;
#ifdef CBATCH_X86
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  for (int64_t k = 0; k < whole; k += 8) {
    top = _mm256_max_ps(_mm256_andnot_ps(sign, avx2::load(x + k)), top);  // a NaN: top
  }
  a = avx2::reduce_max(top);
#endif
  for (int64_t k = whole; k < n; ++k) a = std::max(a, std::fabs(float(x[k])));
  const float inv = a > 0.f ? 127.f / a : 0.f;
#ifdef CBATCH_X86
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i acc = _mm256_setzero_si256();
  for (int64_t k = 0; k < whole; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(avx2::load(x + k), vinv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i v = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    acc = _mm256_add_epi32(acc, v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w, w));
  }
  alignas(32) int32_t parts[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(parts), acc);
  for (const int32_t v : parts) total += v;
#endif
  for (int64_t k = whole; k < n; ++k) {
    const float v = std::nearbyint(float(x[k]) * inv);
    q[k] = int8_t(std::clamp(v, -127.f, 127.f));
    total += q[k];
  }
  *sum = total;
  return a;
}

#ifdef CBATCH_X86
// One row's 8 results y, columns [n, n + min(left, 8)) at out[at] or out_bf16[at]: fp32 where
// out is not null (a masked store, `lanes` = avx2::first_lanes(left)), else bf16 (store_bf16).
CBATCH_AVX2 CBATCH_INLINE void store_row8(__m256 y, __m256i lanes, int64_t left, float* out,
                                          c10::BFloat16* out_bf16, int64_t at) {
  if (out) return _mm256_maskstore_ps(out + at, lanes, y);
  alignas(32) float t[8];
  _mm256_store_ps(t, y);
  store_bf16(t, std::min<int64_t>(left, 8), out_bf16 + at);
}

// AVX2's int8 x int8 product (llama.cpp's for Q8_0 x Q8_0), for the 8-bit weights of both
// ops: one row's products with a quad of signed weights, 16 columns x 4 k (q0 columns 0..7,
// q1 columns 8..15, each column's 4 k in a 4-byte lane; u0, u1 their magnitudes, taken once
// for a tile's rows), xv the row's 4 int8 k in every lane, added into the two halves' int32
// sums.  vpmaddubsw wants one unsigned operand, so each product q x is |q| sign(x, q)
// (vpsignb: x negated where q < 0, 0 where q is 0); |q| <= 128 read unsigned and |x| <= 127,
// so a pair of products is at most 2 * 128 * 127 = 32512 and never saturates, and it is
// widened into int32 at once (vpmaddwd with ones): every sum exact.
CBATCH_AVX2 CBATCH_INLINE void add_quad_s8(__m256i q0, __m256i q1, __m256i u0, __m256i u1,
                                           __m256i xv, __m256i& s0, __m256i& s1) {
  const __m256i ones = _mm256_set1_epi16(1);
  s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(xv, q0)),
                                              ones));
  s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(xv, q1)),
                                              ones));
}
#endif

}  // namespace cbatch::quantized_operands
