// The AVX-512 counterparts of avx2_loops.c (the same method: independent register-only
// chains, an empty asm making each iteration's operands new), for the instructions cbatch's
// kernels multiply with on a CPU with AVX-512 (benchmarks/bench_peak.py compiles this file
// only where the CPU has AVX512-VNNI and AVX512-BF16):
//
//   fma512_loop   vfmadd231ps zmm: 16 fp32 multiply-adds (fp32, W8A16 / W4A16 on fp32 x,
//                 the prefill attention)
//   vnni_loop     vpdpbusd ymm: 32 u8 x s8 multiply-adds into s32 (W8A8, W4A8, W8A8 per
//                 group: their VNNI tiles run 256-bit vectors but W8A8's, which runs 512-bit
//                 ones; on Zen 4 both widths give the same multiply-adds a cycle)
//   bf16_loop     vdpbf16ps zmm: 32 bf16 x bf16 multiply-adds into fp32 (bf16 linears)
#include <immintrin.h>

#define REPEAT12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define TOUCH(i) __asm__ volatile("" : "+v"(x##i));

float fma512_loop(long n) {
  const __m512 b = _mm512_set1_ps(1.0001f), c = _mm512_set1_ps(0.9999f);
#define DECLARE(i) __m512 a##i = _mm512_set1_ps((float)i);
  REPEAT12(DECLARE)
#undef DECLARE
  for (long k = 0; k < n; ++k) {
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, b, c);
    REPEAT12(STEP)
#undef STEP
  }
  __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, a##i);
  REPEAT12(SUM)
#undef SUM
  return _mm512_reduce_add_ps(s);
}

int vnni_loop(long n) {
  const __m256i w = _mm256_set1_epi8(3);
#define DECLARE(i) __m256i a##i = _mm256_set1_epi32(i), x##i = _mm256_set1_epi8(i - 3);
  REPEAT12(DECLARE)
#undef DECLARE
  for (long k = 0; k < n; ++k) {
#define STEP(i) TOUCH(i) a##i = _mm256_dpbusd_epi32(a##i, w, x##i);
    REPEAT12(STEP)
#undef STEP
  }
  __m256i s = _mm256_setzero_si256();
#define SUM(i) s = _mm256_add_epi32(s, a##i);
  REPEAT12(SUM)
#undef SUM
  return _mm256_extract_epi32(s, 0);
}

float bf16_loop(long n) {
  const __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
#define DECLARE(i) __m512 a##i = _mm512_set1_ps((float)i); \
  __m512bh x##i = (__m512bh)_mm512_set1_epi16(0x3f80 + i);
  REPEAT12(DECLARE)
#undef DECLARE
  for (long k = 0; k < n; ++k) {
#define STEP(i) TOUCH(i) a##i = _mm512_dpbf16_ps(a##i, w, x##i);
    REPEAT12(STEP)
#undef STEP
  }
  __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, a##i);
  REPEAT12(SUM)
#undef SUM
  return _mm512_reduce_add_ps(s);
}
