// The CPU linear op: y = act(x @ W^T + bias) + residual on weights packed once
// (cbatch/ops/cpu.py), through gemm.h's kernel: AVX-512 tiles for fp32 and (with
// AVX512-BF16) bf16, AVX2 + FMA tiles for fp32 and bf16 elsewhere (bf16 widened to fp32 in
// registers).  cpu_linear_supported says where it runs.
#include <ATen/ops/empty.h>

#include "../checks.h"
#include "../ops.h"
#include "amx_bf16_linear.h"
#include "gemm.h"

namespace cbatch {

bool cpu_linear_supported(at::ScalarType dtype) {
#ifdef CBATCH_X86
  // bf16: vdpbf16ps, or the AVX2 tiles on CPUs without AVX-512 (one with AVX-512 but not
  // AVX512-BF16 keeps oneDNN's avx512_core bf16, which was not measured against them)
  return dtype == at::kFloat ? cpu_has_avx512() || cpu_has_avx2()
                             : dtype == at::kBFloat16 &&
                                   (cpu_has_avx512bf16() || (cpu_has_avx2() && !cpu_has_avx512()));
#else
  (void)dtype;
  return false;
#endif
}

namespace {

// From this many rows a bf16 linear may run on AMX tiles (amx_bf16_linear.h; below it the weights'
// bytes, not the multiplies, bound the time, and the AVX-512 tiles read them as fast).
constexpr int64_t kAmxFromRows = 8;

// The linear op; counted: an op call (linear_cpu), not part of another op's (logits_cpu).
template <bool kCounted>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual, const std::string& activation,
                  bool amx = false) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK_VALUE(x.stride(1) == 1, "x's rows must be dense");
  TORCH_CHECK_TYPE(packed.scalar_type() == x.scalar_type(), "x is ", x.scalar_type(),
                   " but the packed weight is ", packed.scalar_type());
  TORCH_CHECK_VALUE(cpu_linear_supported(x.scalar_type()), "cbatch's CPU linear runs ",
                    x.scalar_type(), " only on an x86 CPU with ",
                    x.scalar_type() == at::kBFloat16
                        ? "AVX512-BF16, or AVX2 and FMA without AVX-512"
                        : "AVX2 and FMA, or AVX-512");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  TORCH_CHECK_VALUE(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == blocks &&
                        packed.size(1) == K && packed.size(2) == kBlock,
                    "packed weight ", packed.sizes(), " does not hold ", N, " x ", K);
  TORCH_CHECK_VALUE(x.scalar_type() != at::kBFloat16 || K % 2 == 0,
                    "bf16 needs an even number of input features, got ", K);
  TORCH_CHECK_VALUE(activation == "none" || activation == "gelu_tanh",
                    "activation must be 'none' or 'gelu_tanh', got '", activation, "'");
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                          bias->scalar_type() == x.scalar_type(),
                      "bias must be a dense [", N, "] of x's dtype");
  }
  if (residual) {
    TORCH_CHECK_VALUE(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                          residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                      "residual must be [", M, ", ", N, "] with dense rows, of x's dtype");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#ifdef CBATCH_X86
  // bf16 takes the AVX-512 tiles with vdpbf16ps (AVX512-BF16), else the AVX2 ones
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool avx512 = bf16 ? cpu_has_avx512bf16() : cpu_has_avx512();
  const bool tiles = amx && bf16 && avx512 && M >= kAmxFromRows && K % amx::kTileK == 0 &&
                     amx::available();
  if (kCounted) {
    count_path(tiles    ? CpuPath::kLinearAmx
               : avx512 ? CpuPath::kLinearAvx512
               : bf16   ? CpuPath::kLinearBf16Avx2
                        : CpuPath::kLinearAvx2);
  }
  if (x.scalar_type() == at::kFloat) {
    const Args<float> args{.x = x.data_ptr<float>(), .ldx = x.stride(0), .M = M, .K = K, .N = N,
                           .xp = nullptr, .w = packed.data_ptr<float>(),
                           .bias = bias ? bias->data_ptr<float>() : nullptr,
                           .residual = residual ? residual->data_ptr<float>() : nullptr,
                           .ldr = residual ? residual->stride(0) : 0,
                           .gelu = activation == "gelu_tanh", .out = out.data_ptr<float>()};
    if (avx512) {
      run_gemm<avx512::Gemm>(args);
    } else {
      run_gemm<avx2::Gemm>(args);
    }
  } else {
    using B16 = c10::BFloat16;
    const Args<B16> args{.x = x.data_ptr<B16>(), .ldx = x.stride(0), .M = M, .K = K, .N = N,
                         .xp = nullptr, .w = packed.data_ptr<B16>(),
                         .bias = bias ? bias->data_ptr<B16>() : nullptr,
                         .residual = residual ? residual->data_ptr<B16>() : nullptr,
                         .ldr = residual ? residual->stride(0) : 0,
                         .gelu = activation == "gelu_tanh", .out = out.data_ptr<B16>()};
    if (tiles) {
      amx::run(args);
    } else if (avx512) {
      run_gemm<avx512::Gemm>(args);
    } else {
      run_gemm<avx2::Gemm>(args);
    }
  }
#else
  (void)amx;
#endif
  return out;
}

}  // namespace

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual, const std::string& activation,
                      bool amx) {
  return linear<true>(x, packed, out_features, bias, residual, activation, amx);
}

at::Tensor logits_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      bool amx) {
  return linear<false>(x, packed, out_features, std::nullopt, std::nullopt, "none", amx);
}

}  // namespace cbatch
