// The peak rate of the instructions cbatch's AVX2 GEMMs multiply with, measured rather than
// taken from a table (benchmarks/bench_peak.py compiles this file and runs each loop on every
// thread at once): n iterations of independent chains in registers, no loads, so that the
// only limit is the core's ports.  An empty asm makes each iteration's operands new to the
// compiler (nothing hoisted or merged) and emits nothing.
//
//   fma_loop       vfmadd231ps ymm: 8 fp32 multiply-adds (fp32, bf16 widened, int4 W4A16)
//   int8_loop      vpmaddubsw + vpmaddwd + vpaddd: 32 u8 x s8 multiply-adds into s32 (the
//                  int8-activation kernels' inner product: W8A8, W4A8, W8A8 per group)
//   maddubs_loop   vpmaddubsw (+ vpaddw) alone
#include <immintrin.h>

#define REPEAT12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define REPEAT5(X) X(0) X(1) X(2) X(3) X(4)
#define TOUCH(i) __asm__ volatile("" : "+x"(x##i));

float fma_loop(long n) {
  const __m256 b = _mm256_set1_ps(1.0001f), c = _mm256_set1_ps(0.9999f);
#define DECLARE(i) __m256 a##i = _mm256_set1_ps((float)i);
  REPEAT12(DECLARE)
#undef DECLARE
  for (long k = 0; k < n; ++k) {
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, b, c);
    REPEAT12(STEP)
#undef STEP
  }
  __m256 s = _mm256_setzero_ps();
#define SUM(i) s = _mm256_add_ps(s, a##i);
  REPEAT12(SUM)
#undef SUM
  return _mm256_cvtss_f32(s);
}

int int8_loop(long n) {
  const __m256i w = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
#define DECLARE(i) __m256i a##i = _mm256_set1_epi32(i), x##i = _mm256_set1_epi8(i - 3);
  REPEAT5(DECLARE)
#undef DECLARE
  for (long k = 0; k < n; ++k) {
#define STEP(i) \
  TOUCH(i) a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x##i), ones));
    REPEAT5(STEP)
#undef STEP
  }
  __m256i s = _mm256_setzero_si256();
#define SUM(i) s = _mm256_add_epi32(s, a##i);
  REPEAT5(SUM)
#undef SUM
  return _mm256_extract_epi32(s, 0);
}

int maddubs_loop(long n) {
  const __m256i w = _mm256_set1_epi8(3);
#define DECLARE(i) __m256i a##i = _mm256_set1_epi16(i), x##i = _mm256_set1_epi8(i - 3);
  REPEAT5(DECLARE)
#undef DECLARE
  for (long k = 0; k < n; ++k) {
#define STEP(i) TOUCH(i) a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(w, x##i));
    REPEAT5(STEP)
#undef STEP
  }
  __m256i s = _mm256_setzero_si256();
#define SUM(i) s = _mm256_add_epi16(s, a##i);
  REPEAT5(SUM)
#undef SUM
  return _mm256_extract_epi16(s, 0);
}
