// What the Llama layers' small CPU ops share (layernorm.cpp, activation.cpp,
// pos_encoding.cpp): a tensor seen as rows of its last dimension, scalar conversions that round
// as torch's elementwise ops round (compute in fp32, round to nearest even into the tensor's
// dtype), and 8-lane AVX2 stores of bf16 and fp16 (avx2.h has the loads and fp32's store) and
// loads and stores with a tail of any length.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../checks.h"
#include "avx2.h"

namespace cbatch {

// A [A, B, n] (or [A, n]) tensor whose last dim is dense, as A * B rows of n elements: row r
// starts at (r / B) * stride_a + (r % B) * stride_b.  Covers a [T, H, D] view of a fused qkv
// projection (token stride the projection's width) as well as dense tensors.
struct Rows {
  int64_t count, n, b, stride_a, stride_b;

  explicit Rows(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.dim() == 2 || t.dim() == 3, name, " must be [rows, n] or [T, H, n], got ",
                      t.sizes());
    TORCH_CHECK_VALUE(t.stride(-1) == 1 || t.size(-1) <= 1, name,
                      " must have a dense last dim, got strides ", t.strides());
    n = t.size(-1);
    b = t.dim() == 3 ? t.size(1) : 1;
    count = t.size(0) * b;
    stride_a = t.stride(0);
    stride_b = t.dim() == 3 ? t.stride(1) : 0;
  }
  int64_t offset(int64_t r) const { return (r / b) * stride_a + (r % b) * stride_b; }
};

// Rows per at::parallel_for chunk: about 16K elements, so that a decode step's few rows run on
// the calling thread (a parallel region costs more than the row).
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }
template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }  // c10: round to nearest even

#ifdef CBATCH_X86
namespace avx2 {

// fp32 -> bf16 as c10::BFloat16 rounds: to nearest even, any NaN as 0x7fc0.
CBATCH_AVX2 CBATCH_INLINE void store(c10::BFloat16* p, __m256 v) {
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  u = _mm256_srli_epi32(u, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
CBATCH_AVX2 CBATCH_INLINE void store(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The first n (< 8) elements, the other lanes 0; and their store.
template <typename T>
CBATCH_AVX2 CBATCH_INLINE __m256 load_tail(const T* p, int64_t n) {
  T buf[8] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load(buf);
}
template <typename T>
CBATCH_AVX2 CBATCH_INLINE void store_tail(T* p, __m256 v, int64_t n) {
  T buf[8];
  store(buf, v);
  std::memcpy(p, buf, n * sizeof(T));
}

// v rounded to T and back, as a torch op in T rounds its fp32 result.
template <typename T>
CBATCH_AVX2 CBATCH_INLINE __m256 round_to(__m256 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    u = _mm256_and_si256(u, _mm256_set1_epi32(int32_t(0xffff0000u)));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                            nan);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}

// A product that the compiler may not fuse with a following add into an FMA (-ffp-contract
// would otherwise change a rounding that the torch formula does).
CBATCH_AVX2 CBATCH_INLINE __m256 mul_rounded(__m256 a, __m256 b) {
  __m256 p = _mm256_mul_ps(a, b);
  asm("" : "+x"(p));
  return p;
}

}  // namespace avx2
#endif

}  // namespace cbatch
