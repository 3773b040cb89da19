// The 16-lane fp32 helpers of the CPU kernels' AVX-512 paths (attention_step.h, gemm.h,
// amx_bf16_linear.h, greedy_head.cpp, argmax.cpp), in namespace avx512: avx2.h has their
// 8-lane twins under the same names, so that avx512::exp and avx2::exp do the same job, and
// code written once for both ISAs (attention_step.h) reads Vec, kLanes and the helpers of the
// namespace it is included in.  Each is compiled for AVX-512 whatever the extension's
// baseline; callers reach them only after cpu_has_avx512().
#pragma once

#include "x86.h"

#ifdef CBATCH_X86
namespace cbatch::avx512 {

using Vec = __m512;
constexpr int kLanes = 16;

// The first min(n, 16) lanes: the valid ones of a run that ends n elements on.
CBATCH_INLINE __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// 16 elements as fp32 (bf16: shifted into the top half of an fp32).
CBATCH_AVX512 CBATCH_INLINE __m512 widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}
CBATCH_AVX512 CBATCH_INLINE __m512 load(const float* p) { return _mm512_loadu_ps(p); }
CBATCH_AVX512 CBATCH_INLINE __m512 load(const c10::BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
CBATCH_AVX512 CBATCH_INLINE __m512 load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// The same for the lanes in `m`; the others are zero and not read.
CBATCH_AVX512 CBATCH_INLINE __m512 load(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
CBATCH_AVX512 CBATCH_INLINE __m512 load(const c10::BFloat16* p, __mmask16 m) {
  return widen(_mm256_maskz_loadu_epi16(m, p));
}
CBATCH_AVX512 CBATCH_INLINE void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// The lanes in `m` (bf16: rounded to nearest even by vcvtneps2bf16); the others not written.
CBATCH_AVX512 CBATCH_INLINE void store(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
CBATCH_AVX512_DOT CBATCH_INLINE void store(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

CBATCH_AVX512 CBATCH_INLINE __m512 zero() { return _mm512_setzero_ps(); }
CBATCH_AVX512 CBATCH_INLINE __m512 set1(float x) { return _mm512_set1_ps(x); }
CBATCH_AVX512 CBATCH_INLINE __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
CBATCH_AVX512 CBATCH_INLINE __m512 sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
CBATCH_AVX512 CBATCH_INLINE __m512 max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
// Lane 0 of v.
CBATCH_AVX512 CBATCH_INLINE float first(__m512 v) { return _mm512_cvtss_f32(v); }
CBATCH_AVX512 CBATCH_INLINE __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
CBATCH_AVX512 CBATCH_INLINE __m512 fmadd(__m512 a, __m512 b, __m512 c) {
  return _mm512_fmadd_ps(a, b, c);
}
// v's first min(n, 16) lanes, the others `fill` (or 0).
CBATCH_AVX512 CBATCH_INLINE __m512 keep_first(__m512 v, int64_t n, float fill) {
  return _mm512_mask_mov_ps(_mm512_set1_ps(fill), first_lanes(n), v);
}
CBATCH_AVX512 CBATCH_INLINE __m512 keep_first(__m512 v, int64_t n) {
  return _mm512_maskz_mov_ps(first_lanes(n), v);
}

// The largest and the sum of the 16 lanes.
CBATCH_AVX512 CBATCH_INLINE float reduce_max(__m512 v) { return _mm512_reduce_max_ps(v); }
CBATCH_AVX512 CBATCH_INLINE float reduce_add(__m512 v) { return _mm512_reduce_add_ps(v); }

// The 16 sums of v[0..15] as one vector (lane i = sum of v[i]'s lanes): a transposing tree of
// 15 adds instead of 16 separate horizontal reductions.
CBATCH_AVX512 CBATCH_INLINE __m512 sum_each(const __m512 (&v)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of 4 keys
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // add the four 128-bit lanes: keys 0-3, 4-7, 8-11, 12-15 land in lanes 0, 1, 2, 3
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                 _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                 _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// sum_each's sums computed across vectors: lane i of the result adds lane i of p[0..15] with
// the additions sum_each makes of v[i]'s lanes, in its order: within each 128-bit lane q,
// (4q + 0 with 4q + 2) + (4q + 1 with 4q + 3), then (q 0 + q 1) + (q 2 + q 3).  (The two must
// stay in step: attention_step.h's outer_scores gives dot_scores' bits through it.)
CBATCH_AVX512 CBATCH_INLINE __m512 lanes_sum(const __m512 (&p)[16]) {
  __m512 q[4];
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm512_add_ps(_mm512_add_ps(p[4 * i], p[4 * i + 2]),
                         _mm512_add_ps(p[4 * i + 1], p[4 * i + 3]));
  }
  return _mm512_add_ps(_mm512_add_ps(q[0], q[1]), _mm512_add_ps(q[2], q[3]));
}

// e^x, within 2 ulp (x below -104, -inf included, gives 0), times 2^n by vscalefps.
CBATCH_AVX512 CBATCH_INLINE __m512 exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace cbatch::avx512
#endif
