// What the CPU kernels' x86 paths share (attention.cpp, linear.cpp, argmax.cpp): CBATCH_X86
// (x86-64 with GCC or clang, where they exist), the AVX-512 check and 16-lane fp32 helpers.
// Each helper is compiled for AVX-512 whatever the extension's baseline; callers reach them
// only after checking the CPU at run time (cpu_has_avx512).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define CBATCH_X86 1
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#define CBATCH_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
// The dot products of linear.cpp's tiles: vdpbf16ps (bf16) and vpdpwssd (the int8 screen).
#define CBATCH_AVX512_DOT \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni")))

namespace cbatch {

// AVX-512 F/BW/DQ/VL, as the CPU reports it, unless $CBATCH_CPU_ISA is "avx2" (read once per
// process): the CPU kernels then take the paths of a CPU without AVX-512, so that those are
// tested and compared on any x86 machine.
inline bool cpu_has_avx512() {
  static const bool yes = [] {
    const char* isa = std::getenv("CBATCH_CPU_ISA");
    if (isa && std::strcmp(isa, "avx2") == 0) return false;
    if (isa && *isa) {
      TORCH_WARN("CBATCH_CPU_ISA=", isa, " ignored: the one value it takes is avx2");
    }
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}

// The first min(n, 16) lanes: the valid ones of a run that ends n elements on.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// 16 elements as fp32 (bf16: shifted into the top half of an fp32).
CBATCH_AVX512 inline __m512 widen16(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}
CBATCH_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
CBATCH_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
CBATCH_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// The same for the lanes in `m`; the others are zero and not read.
CBATCH_AVX512 inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
CBATCH_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return widen16(_mm256_maskz_loadu_epi16(m, p));
}

// Cephes' expf: x = n ln2 + r with ln 2 in two parts (kLn2Hi + kLn2Lo), then
// e^r = 1 + r + r^2 P(r) on [-ln2/2, ln2/2], P's coefficients highest first.  exp16 here and
// linear.cpp's exp8 (AVX2) share them.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// e^x, within 2 ulp (x below -104, -inf included, gives 0), times 2^n by vscalefps.
CBATCH_AVX512 inline __m512 exp16(__m512 x) {
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

}  // namespace cbatch
#endif
