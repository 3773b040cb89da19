// SwiGLU's activation on the CPU, vLLM's silu_and_mul (csrc/cpu/activation.cpp there): for
// input [.., 2d], result [.., d] = silu(input[.., :d]) * input[.., d:], one pass instead of
// torch's silu, its product and their two intermediate tensors.  Rounded as the torch formula
// F.silu(gate) * up rounds (silu in fp32, x / (1 + e^-x), rounded to the dtype, then the
// product rounded); only e^-x differs from torch's (Cephes' polynomial here, avx2.h; SLEEF's
// or libm's there), by an ulp or two of fp32.  Rows are independent: batch-invariant.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "../ops.h"
#include "cpu_options.h"
#include "elementwise.h"

namespace cbatch {
namespace {

template <typename T>
void silu_and_mul_row_generic(T* out, const T* x, int64_t d) {
  for (int64_t i = 0; i < d; ++i) {
    const float g = to_float(x[i]);
    const float silu = to_float(from_float<T>(g / (1.f + std::exp(-g))));
    out[i] = from_float<T>(silu * to_float(x[d + i]));
  }
}

#ifdef CBATCH_X86
// silu(g) * u on 8 lanes, each rounded to T as torch rounds it.  Past e^88 the divisor is
// +inf, as torch's e^-g overflows there (so silu is -0, not a tiny negative).
template <typename T>
CBATCH_AVX2 CBATCH_INLINE __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), g);
  __m256 denom = _mm256_add_ps(_mm256_set1_ps(1.f), avx2::exp(neg));
  const __m256 overflow = _mm256_cmp_ps(neg, _mm256_set1_ps(88.f), _CMP_GT_OQ);
  denom = _mm256_blendv_ps(denom, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                           overflow);
  const __m256 silu = avx2::round_to<T>(_mm256_div_ps(g, denom));
  return _mm256_mul_ps(silu, u);
}

template <typename T>
CBATCH_AVX2 void silu_and_mul_row_avx2(T* out, const T* x, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    avx2::store(out + i, silu_mul<T>(avx2::load(x + i), avx2::load(x + d + i)));
  }
  if (i < d) {
    const __m256 v = silu_mul<T>(avx2::load_tail(x + i, d - i), avx2::load_tail(x + d + i, d - i));
    avx2::store_tail(out + i, v, d - i);
  }
}
#endif

template <typename T>
CpuPath run(at::Tensor& result, const at::Tensor& input) {
  const Rows ro(result, "result"), ri(input, "input");
  T* po = result.data_ptr<T>();
  const T* pi = input.data_ptr<T>();
  const int64_t d = ro.n;
#ifdef CBATCH_X86
  const bool vector = cpu_has_avx2();
#else
  const bool vector = false;
#endif
  at::parallel_for(0, ro.count, row_grain(3 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#ifdef CBATCH_X86
      if (vector) {
        silu_and_mul_row_avx2(po + ro.offset(r), pi + ri.offset(r), d);
        continue;
      }
#endif
      silu_and_mul_row_generic(po + ro.offset(r), pi + ri.offset(r), d);
    }
  });
  return vector ? CpuPath::kSiluAndMulAvx2 : CpuPath::kSiluAndMulGeneric;
}

}  // namespace

void silu_and_mul_cpu(at::Tensor& result, const at::Tensor& input) {
  TORCH_CHECK_VALUE(result.device().is_cpu() && input.device().is_cpu(),
                    "silu_and_mul's tensors must be on the CPU");
  TORCH_CHECK_TYPE(result.scalar_type() == input.scalar_type(),
                   "silu_and_mul: result and input must have one dtype, got ",
                   result.scalar_type(), " and ", input.scalar_type());
  TORCH_CHECK_VALUE(input.dim() == result.dim() && input.dim() >= 1 &&
                        input.size(-1) == 2 * result.size(-1) &&
                        input.sizes().slice(0, input.dim() - 1) ==
                            result.sizes().slice(0, result.dim() - 1),
                    "silu_and_mul: input must be [.., 2d] and result [.., d], got ",
                    input.sizes(), " and ", result.sizes());
  if (result.numel() == 0) return;
  CpuPath path;
  switch (input.scalar_type()) {
    case at::kFloat: path = run<float>(result, input); break;
    case at::kBFloat16: path = run<c10::BFloat16>(result, input); break;
    case at::kHalf: path = run<c10::Half>(result, input); break;
    default:
      TORCH_CHECK_TYPE(false, "silu_and_mul takes float32, bfloat16 or float16, got ",
                       input.scalar_type());
  }
  count_path(path);
}

}  // namespace cbatch
