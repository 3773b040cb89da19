// The 16-lane fp32 helpers of the CPU kernels' AVX-512 paths (attention.cpp, gemm.h,
// greedy_head.cpp, argmax.cpp), in namespace avx512: avx2.h has their 8-lane twins under the
// same names, so that avx512::exp and avx2::exp do the same job.  Each is compiled for
// AVX-512 whatever the extension's baseline; callers reach them only after cpu_has_avx512().
#pragma once

#include "x86.h"

#ifdef CBATCH_X86
namespace cbatch::avx512 {

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
