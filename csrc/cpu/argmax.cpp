// Row argmax of [S, V] logits on the CPU: the greedy sampler's one reduction over the
// vocabulary.  torch's CPU argmax walks the row one element at a time; this one keeps 16
// running maxima and their indices in registers on CPUs with AVX-512, and falls back to a
// plain loop elsewhere (benchmarks/NOTES.md, "The lm_head's greedy screen").  Same answer as
// torch.argmax: the first
// index of the maximum, and the first NaN if a row has one.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "../checks.h"
#include "../ops.h"
#include "avx512.h"
#include "cpu_options.h"

namespace cbatch {
namespace {

template <typename T>
int64_t argmax_row_portable(const T* row, int64_t n) {
  int64_t best = 0;
  float best_value = static_cast<float>(row[0]);
  if (std::isnan(best_value)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) return i;
    if (v > best_value) best = i, best_value = v;
  }
  return best;
}

#ifdef CBATCH_X86
template <typename T>
CBATCH_AVX512 int64_t argmax_row_avx512(const T* row, int64_t n) {
  using avx512::first_lanes, avx512::load;
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_index = _mm512_setzero_si512();
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16, index = _mm512_add_epi32(index, step)) {
    const __mmask16 valid = first_lanes(n - i);
    const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                        valid, load(row + i, valid));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: first wins
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
  }
  if (nan) return argmax_row_portable(row, n);  // the first NaN, as torch
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  // an all -inf row: every lane holds index 0 or a later -inf, and torch answers 0
  return _mm512_mask_reduce_min_epi32(at_top, best_index);
}
#endif

// fp32 and bf16 rows take the AVX-512 loop where the CPU has it (avx512.h loads those two
// with a mask; its indices are 32-bit); fp16 rows, and every row elsewhere, the plain one.
template <typename T>
bool runs_avx512(int64_t n) {
#ifdef CBATCH_X86
  if constexpr (!std::is_same_v<T, c10::Half>) {
    return cpu_has_avx512() && n < (int64_t{1} << 31);
  }
#endif
  (void)n;
  return false;
}

// Which loop ran.
template <typename T>
CpuPath run(const at::Tensor& logits, at::Tensor& out) {
  const int64_t V = logits.size(1), stride = logits.stride(0);
  const T* data = logits.data_ptr<T>();
  int64_t* result = out.data_ptr<int64_t>();
  const bool avx512 = runs_avx512<T>(V);
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
#ifdef CBATCH_X86
      if constexpr (!std::is_same_v<T, c10::Half>) {
        if (avx512) {
          result[s] = argmax_row_avx512(data + s * stride, V);
          continue;
        }
      }
#endif
      result[s] = argmax_row_portable(data + s * stride, V);
    }
  });
  return avx512 ? CpuPath::kArgmaxAvx512 : CpuPath::kArgmaxGeneric;
}

// The argmax op; counted: an op call (argmax_cpu), not part of another op's (argmax_rows_cpu).
template <bool kCounted>
at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.stride(1) == 1,
                    "logits must be [S, V] with dense rows, got ", logits.sizes(), " strides ",
                    logits.strides());
  TORCH_CHECK_VALUE(logits.size(1) > 0, "argmax of an empty row");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.size(0) == 0) return out;
  CpuPath path;
  switch (logits.scalar_type()) {
    case at::kFloat: path = run<float>(logits, out); break;
    case at::kBFloat16: path = run<c10::BFloat16>(logits, out); break;
    case at::kHalf: path = run<c10::Half>(logits, out); break;
    default:
      TORCH_CHECK_TYPE(false, "argmax takes float32, bfloat16 or float16 logits, got ",
                       logits.scalar_type());
  }
  if (kCounted) count_path(path);
  return out;
}

}  // namespace

at::Tensor argmax_cpu(const at::Tensor& logits) { return argmax<true>(logits); }

at::Tensor argmax_rows_cpu(const at::Tensor& logits) { return argmax<false>(logits); }

}  // namespace cbatch
