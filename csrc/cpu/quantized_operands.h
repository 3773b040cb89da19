// The operand checks and set-up that the CPU W8A8 and W4A8 linear ops share
// (quantized_linear_w8a8.cpp, quantized_linear_w4a8.cpp): x [M, K] float32 or bfloat16 with
// dense rows, out_features N and K not empty, bias [N] or none; and their bf16 epilogue.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <optional>

#include "avx2.h"

namespace cbatch::quantized_operands {

// Checks x, N and the bias; returns x with dense rows (itself when its rows are dense).
inline at::Tensor checked_x(const at::Tensor& x, int64_t out_features,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(out_features >= 1 && x.size(1) >= 1, "empty weight: ", out_features, " x ",
                    x.size(1));
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, "bias must be [",
                      out_features, "], got ", bias->sizes());
  }
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

// The bias as a dense float32 tensor: itself when it is one (no copy on every call).
inline std::optional<at::Tensor> fp32_bias(const std::optional<at::Tensor>& bias) {
  if (!bias) return std::nullopt;
  if (bias->scalar_type() == at::kFloat && bias->is_contiguous()) return bias;
  return bias->to(at::kFloat).contiguous();
}

// count fp32 results of a tile to a bf16 output, each rounded as Tensor.to(torch.bfloat16)
// rounds (to nearest even): the ops' bf16 epilogue.
inline void store_bf16(const float* t, int64_t count, c10::BFloat16* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = c10::BFloat16(t[i]);
}

#ifdef CBATCH_X86
// One row's 8 results y, columns [n, n + min(left, 8)) at out[at] or out_bf16[at]: fp32 where
// out is not null (a masked store, `lanes` = avx2::first_lanes(left)), else bf16 (store_bf16).
CBATCH_AVX2 CBATCH_INLINE void store_row8(__m256 y, __m256i lanes, int64_t left, float* out,
                                          c10::BFloat16* out_bf16, int64_t at) {
  if (out) return _mm256_maskstore_ps(out + at, lanes, y);
  alignas(32) float t[8];
  _mm256_store_ps(t, y);
  store_bf16(t, std::min<int64_t>(left, 8), out_bf16 + at);
}
#endif

}  // namespace cbatch::quantized_operands
