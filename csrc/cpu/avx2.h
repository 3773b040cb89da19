// The 8-lane fp32 helpers of the CPU kernels' AVX2 paths (attention_step.h, gemm.h,
// greedy_head.cpp, quantized_operands.h, elementwise.h), in namespace avx2: the twins of
// avx512.h's, under the same names (Vec and kLanes too).  Each is compiled for AVX2 + FMA +
// F16C (x86-64-v3) whatever the extension's baseline; callers reach them only after
// cpu_has_avx2().
#pragma once

#include "x86.h"

#ifdef CBATCH_X86
namespace cbatch::avx2 {

using Vec = __m256;
constexpr int kLanes = 8;

// Lanes [0, n) of 8, as a mask of all-ones lanes (n may be <= 0 or >= 8).
CBATCH_AVX2 CBATCH_INLINE __m256i first_lanes(int64_t n) {
  const int32_t c = int32_t(n < 0 ? 0 : n > 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 elements as fp32 (bf16: shifted into the top half of an fp32).
CBATCH_AVX2 CBATCH_INLINE __m256 load(const float* p) { return _mm256_loadu_ps(p); }
CBATCH_AVX2 CBATCH_INLINE __m256 load(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
CBATCH_AVX2 CBATCH_INLINE __m256 load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
CBATCH_AVX2 CBATCH_INLINE void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

CBATCH_AVX2 CBATCH_INLINE __m256 zero() { return _mm256_setzero_ps(); }
CBATCH_AVX2 CBATCH_INLINE __m256 set1(float x) { return _mm256_set1_ps(x); }
CBATCH_AVX2 CBATCH_INLINE __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
CBATCH_AVX2 CBATCH_INLINE __m256 sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
CBATCH_AVX2 CBATCH_INLINE __m256 max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
// Lane 0 of v.
CBATCH_AVX2 CBATCH_INLINE float first(__m256 v) { return _mm256_cvtss_f32(v); }
CBATCH_AVX2 CBATCH_INLINE __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
CBATCH_AVX2 CBATCH_INLINE __m256 fmadd(__m256 a, __m256 b, __m256 c) {
  return _mm256_fmadd_ps(a, b, c);
}
// v's first n lanes (n clamped to [0, 8]), the others `fill` (or 0).
CBATCH_AVX2 CBATCH_INLINE __m256 keep_first(__m256 v, int64_t n, float fill) {
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(first_lanes(n)));
}
CBATCH_AVX2 CBATCH_INLINE __m256 keep_first(__m256 v, int64_t n) {
  return _mm256_and_ps(_mm256_castsi256_ps(first_lanes(n)), v);
}

// The largest and the sum of the 8 lanes (avx512's _mm512_reduce_max_ps / _add_ps).
CBATCH_AVX2 CBATCH_INLINE float reduce_max(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

CBATCH_AVX2 CBATCH_INLINE float reduce_add(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The 8 sums of v[0..7] as one vector (lane i = sum of v[i]'s lanes).
CBATCH_AVX2 CBATCH_INLINE __m256 sum_each(const __m256 (&v)[8]) {
  // hadd of pairs, then of pairs of pairs: lane j of each 128-bit half holds key j's (or
  // j + 4's) partial sum over that half's lanes; the halves are then added
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// sum_each's sums computed across vectors: lane i of the result adds lane i of p[0..7] with
// the additions sum_each makes of v[i]'s lanes, in its order (the two must stay in step:
// attention_step.h's outer_scores gives dot_scores' bits through it).
CBATCH_AVX2 CBATCH_INLINE __m256 lanes_sum(const __m256 (&p)[8]) {
  const __m256 low = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
  const __m256 high = _mm256_add_ps(_mm256_add_ps(p[4], p[5]), _mm256_add_ps(p[6], p[7]));
  return _mm256_add_ps(low, high);
}

// e^x as avx512::exp computes it, on 8 lanes; x is clamped to [-87, 88] so that 2^n stays a
// normal float (e^-87 is 1.6e-38, e^88 1.7e38; a caller that needs an exact 0 for -inf masks
// it).
CBATCH_AVX2 CBATCH_INLINE __m256 exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

}  // namespace cbatch::avx2
#endif
