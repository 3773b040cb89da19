// RMSNorm on the CPU, vLLM's rms_norm and fused_add_rms_norm (csrc/cpu/layernorm.cpp there):
// one pass per row instead of the seven torch ops of the Llama family's formula
// (cbatch/layers/layernorm.py).  Each step rounds where that formula rounds: the row in fp32,
// its sum of squares, mean = sum / n, 1 / sqrt(mean + eps) in fp32, x * that cast to the
// input's dtype, then times the weight in that dtype; the residual add rounded to the dtype
// first.  Only the sum of squares runs in another order than torch's (8 or 16 fp32 lanes, then
// across them), so outputs equal the torch formula's wherever that sum does.  Rows are
// independent of each other: batch-invariant.
#include <ATen/Parallel.h>

#include <cmath>

#include "../ops.h"
#include "cpu_options.h"
#include "elementwise.h"

namespace cbatch {
namespace {

// 1 / sqrt(mean(x^2) + eps) as torch's fp32 ops compute it from the sum (its CPU mean divides
// the sum by n; rsqrt is 1 / sqrt).
inline float inv_rms(float sum_squares, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
}

template <typename T>
void norm_row_generic(T* out, const T* x, const T* w, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += to_float(x[i]) * to_float(x[i]);
  const float r = inv_rms(sum, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = from_float<T>(to_float(w[i]) * to_float(from_float<T>(to_float(x[i]) * r)));
  }
}

// residual += x (rounded to T); x = norm(residual).
template <typename T>
void add_norm_row_generic(T* x, T* residual, const T* w, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    residual[i] = from_float<T>(to_float(x[i]) + to_float(residual[i]));
  }
  norm_row_generic(x, residual, w, n, eps);
}

#ifdef CBATCH_X86
CBATCH_AVX2 inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <typename T>
CBATCH_AVX2 float sum_squares_avx2(const T* x, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = avx2::load(x + i), b = avx2::load(x + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 a = avx2::load(x + i);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
  }
  if (i < n) {
    const __m256 a = avx2::load_tail(x + i, n - i);
    acc1 = _mm256_fmadd_ps(a, a, acc1);
  }
  return sum_lanes(_mm256_add_ps(acc0, acc1));
}

// out = w * T(x * r)
template <typename T>
CBATCH_AVX2 void scale_row_avx2(T* out, const T* x, const T* w, int64_t n, float r) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = avx2::round_to<T>(_mm256_mul_ps(avx2::load(x + i), rv));
    avx2::store(out + i, _mm256_mul_ps(avx2::load(w + i), v));
  }
  if (i < n) {
    const __m256 v = avx2::round_to<T>(_mm256_mul_ps(avx2::load_tail(x + i, n - i), rv));
    avx2::store_tail(out + i, _mm256_mul_ps(avx2::load_tail(w + i, n - i), v), n - i);
  }
}

template <typename T>
CBATCH_AVX2 void norm_row_avx2(T* out, const T* x, const T* w, int64_t n, float eps) {
  scale_row_avx2(out, x, w, n, inv_rms(sum_squares_avx2(x, n), n, eps));
}

template <typename T>
CBATCH_AVX2 void add_norm_row_avx2(T* x, T* residual, const T* w, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 s = avx2::round_to<T>(_mm256_add_ps(avx2::load(x + i), avx2::load(residual + i)));
    avx2::store(residual + i, s);
    acc = _mm256_fmadd_ps(s, s, acc);
  }
  if (i < n) {
    const __m256 s = avx2::round_to<T>(
        _mm256_add_ps(avx2::load_tail(x + i, n - i), avx2::load_tail(residual + i, n - i)));
    avx2::store_tail(residual + i, s, n - i);
    acc = _mm256_fmadd_ps(s, s, acc);
  }
  scale_row_avx2(x, residual, w, n, inv_rms(sum_lanes(acc), n, eps));
}
#endif

void check_norm_args(const at::Tensor& x, const at::Tensor& other, const at::Tensor& weight,
                     const char* op, const char* other_name) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && other.device().is_cpu() && weight.device().is_cpu(),
                    op, "'s tensors must be on the CPU");
  TORCH_CHECK_VALUE(x.sizes() == other.sizes(), op, ": input ", x.sizes(), " and ", other_name,
                    " ", other.sizes(), " must have one shape");
  TORCH_CHECK_TYPE(x.scalar_type() == other.scalar_type() &&
                       x.scalar_type() == weight.scalar_type(),
                   op, ": input, ", other_name, " and weight must have one dtype, got ",
                   x.scalar_type(), ", ", other.scalar_type(), ", ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
                    op, ": weight must be a dense [", x.size(-1), "], got ", weight.sizes());
}

template <typename T, bool kAdd>
CpuPath run(const at::Tensor& a, const at::Tensor& b, const at::Tensor& weight, double epsilon) {
  const Rows ra(a, kAdd ? "input" : "result"), rb(b, kAdd ? "residual" : "input");
  T* pa = a.data_ptr<T>();
  T* pb = b.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  const int64_t n = ra.n;
  const float eps = static_cast<float>(epsilon);
#ifdef CBATCH_X86
  const bool vector = cpu_has_avx2();
#else
  const bool vector = false;
#endif
  at::parallel_for(0, ra.count, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row_a = pa + ra.offset(r);
      T* row_b = pb + rb.offset(r);
#ifdef CBATCH_X86
      if (vector) {
        if constexpr (kAdd) add_norm_row_avx2(row_a, row_b, w, n, eps);
        else norm_row_avx2(row_a, row_b, w, n, eps);
        continue;
      }
#endif
      if constexpr (kAdd) add_norm_row_generic(row_a, row_b, w, n, eps);
      else norm_row_generic(row_a, row_b, w, n, eps);
    }
  });
  if constexpr (kAdd) return vector ? CpuPath::kFusedAddRmsNormAvx2 : CpuPath::kFusedAddRmsNormGeneric;
  return vector ? CpuPath::kRmsNormAvx2 : CpuPath::kRmsNormGeneric;
}

template <bool kAdd>
void dispatch(const at::Tensor& a, const at::Tensor& b, const at::Tensor& weight, double eps) {
  if (a.numel() == 0) return;
  CpuPath path;
  switch (a.scalar_type()) {
    case at::kFloat: path = run<float, kAdd>(a, b, weight, eps); break;
    case at::kBFloat16: path = run<c10::BFloat16, kAdd>(a, b, weight, eps); break;
    case at::kHalf: path = run<c10::Half, kAdd>(a, b, weight, eps); break;
    default:
      TORCH_CHECK_TYPE(false, kAdd ? "fused_add_rms_norm" : "rms_norm",
                       " takes float32, bfloat16 or float16, got ", a.scalar_type());
  }
  count_path(path);
}

}  // namespace

void rms_norm_cpu(at::Tensor& result, const at::Tensor& input, const at::Tensor& weight,
                  double epsilon) {
  check_norm_args(input, result, weight, "rms_norm", "result");
  dispatch<false>(result, input, weight, epsilon);
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                            double epsilon) {
  check_norm_args(input, residual, weight, "fused_add_rms_norm", "residual");
  dispatch<true>(input, residual, weight, epsilon);
}

}  // namespace cbatch
