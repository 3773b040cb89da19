// The x86 basics every CPU kernel shares: CBATCH_X86 (x86-64 with GCC or clang, where the
// vector paths exist), the target attributes that compile one function for an ISA whatever
// the extension's baseline, the CPU feature checks (which callers make before reaching such a
// function, capped by set_cpu_options), and Cephes' expf constants, which both ISAs' exp use.
#pragma once

#include "cpu_options.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define CBATCH_X86 1
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#define CBATCH_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
// The dot products of the GEMM tiles: vdpbf16ps (bf16) and vpdpwssd (the int8 screen).
#define CBATCH_AVX512_DOT \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni")))
#define CBATCH_AVX2 __attribute__((target("avx2,fma,f16c")))
// A helper that must become part of its caller's loop (a call would spill the registers the
// loop keeps its sums in): inlined whatever the compiler's size heuristics say.
#define CBATCH_INLINE inline __attribute__((always_inline))

namespace cbatch {

// What the CPU reports, read once per process.
struct CpuFeatures {
  bool avx512;      // AVX-512 F, BW, DQ and VL
  bool avx512bf16;  // vdpbf16ps
  bool avx512vnni;  // vpdpwssd
  bool avx2;        // AVX2, FMA and F16C
  bool f16c;        // AVX and F16C
};

inline const CpuFeatures& detected_cpu_features() {
  static const CpuFeatures features = [] {
    __builtin_cpu_init();
    CpuFeatures f;
    f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
    f.avx512vnni = __builtin_cpu_supports("avx512vnni");
    f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    f.f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    return f;
  }();
  return features;
}

// The features the kernels may use: what the CPU has, below the cap of set_cpu_options
// (checked on every call, so that a change of options applies to the next call).
inline bool cpu_has_avx512() {
  return detected_cpu_features().avx512 && !cpu_isa_capped_at_avx2();
}
inline bool cpu_has_avx512bf16() {
  return cpu_has_avx512() && detected_cpu_features().avx512bf16;
}
inline bool cpu_has_avx512vnni() {
  return cpu_has_avx512() && detected_cpu_features().avx512vnni;
}
inline bool cpu_has_avx2() { return detected_cpu_features().avx2; }
inline bool cpu_has_f16c() { return detected_cpu_features().f16c; }

// Cephes' expf: x = n ln2 + r with ln 2 in two parts (kLn2Hi + kLn2Lo), then
// e^r = 1 + r + r^2 P(r) on [-ln2/2, ln2/2], P's coefficients highest first.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

}  // namespace cbatch
#endif
