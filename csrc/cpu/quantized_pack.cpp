// A quantized weight's integers into the layouts of cbatch's quantized kernels, at load: one
// pass each, where the torch formulations (cbatch/layers/quantization/weight.py, which
// documents every layout and stays the reference) permute bytes through several tensors; on a
// GGUF file those passes were the largest share of the load left after unpacking the blocks
// (benchmarks/NOTES.md, "Loading a model: cold start and memory after load").  Bitwise the
// torch functions' output (tests/layers/test_quantized_pack.py); each call counted
// (quantized_pack.cpu).
//
//   pack_levels:  q [N, K] (int8 for 8 bits; uint8 0..15 for 4) → qweight [N16 / 16, K, 16]
//                 int8, or [N16 / 16, ceil(K / 2), 16] uint8 (k = 2i low nibble, 2i + 1 high)
//   pack_w4a8:    that 4-bit qweight → uint8 [N16 / 16, 8 ceil(K / 32), 32]
//   pack_w8a8g:   that 8-bit qweight → int8 [N16 / 16, 8 ceil(K / 32), 64]
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <atomic>
#include <vector>

#include "../ops.h"
#include "cpu_options.h"

namespace cbatch {
namespace {

constexpr int64_t kBlock = 16;  // output columns per packed block

void check_cpu_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous(), what,
                    " must be a contiguous CPU tensor");
}

}  // namespace

at::Tensor pack_levels_cpu(const at::Tensor& q, int64_t bits) {
  check_cpu_contiguous(q, "q");
  TORCH_CHECK_VALUE(q.dim() == 2, "q must be [N, K], got ", q.sizes());
  TORCH_CHECK_VALUE((bits == 8 && q.scalar_type() == at::kChar) ||
                        (bits == 4 && q.scalar_type() == at::kByte),
                    "pack_levels takes int8 q for 8 bits or uint8 for 4, got ",
                    q.scalar_type(), " for ", bits);
  const int64_t N = q.size(0), K = q.size(1), blocks = (N + kBlock - 1) / kBlock;
  const int64_t rows = bits == 8 ? K : (K + 1) / 2;
  at::Tensor out = at::empty({blocks, rows, kBlock}, q.options());
  const uint8_t* in = static_cast<const uint8_t*>(q.data_ptr());
  uint8_t* o = static_cast<uint8_t*>(out.data_ptr());
  std::atomic<bool> out_of_range{false};
  const std::vector<uint8_t> zero_row(K, 0);  // the rows past N
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    uint8_t top = 0;  // every 4-bit level or'ed: above 15 if one is
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* row[kBlock];
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t n = b * kBlock + j;
        row[j] = n < N ? in + n * K : zero_row.data();
      }
      uint8_t* block = o + b * rows * kBlock;  // written in order, 16 bytes at a time
      if (bits == 8) {
        for (int64_t k = 0; k < K; ++k) {
          for (int64_t j = 0; j < kBlock; ++j) block[k * kBlock + j] = row[j][k];
        }
        continue;
      }
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < kBlock; ++j) {
          const uint8_t lo = row[j][2 * i], hi = 2 * i + 1 < K ? row[j][2 * i + 1] : 0;
          top |= lo | hi;
          block[i * kBlock + j] = lo | (hi << 4);
        }
      }
    }
    if (top > 15) out_of_range = true;
  });
  TORCH_CHECK_VALUE(!out_of_range, "4-bit q must be in [0, 15]");
  count_path(CpuPath::kQuantizedPackCpu);
  return out;
}

at::Tensor pack_w4a8_cpu(const at::Tensor& qweight, int64_t in_features) {
  check_cpu_contiguous(qweight, "qweight");
  const int64_t K = in_features, pairs = (K + 1) / 2;
  TORCH_CHECK_VALUE(qweight.scalar_type() == at::kByte && qweight.dim() == 3 &&
                        qweight.size(1) == pairs && qweight.size(2) == kBlock,
                    "pack_w4a8 takes a 4-bit qweight uint8 [blocks, ", pairs, ", 16], got ",
                    qweight.scalar_type(), " ", qweight.sizes());
  const int64_t blocks = qweight.size(0), quads = (K + 31) / 32 * 8;
  at::Tensor out = at::empty({blocks, quads, 2 * kBlock}, qweight.options());
  const uint8_t* in = qweight.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* src = in + b * pairs * kBlock;
      uint8_t* dst = o + b * quads * 2 * kBlock;
      for (int64_t i = 0; i < quads; ++i) {
        for (int64_t t = 0; t < 4; ++t) {
          const int64_t k = 4 * i + t;
          const uint8_t* pair = src + (k / 2) * kBlock;
          const int shift = 4 * (k % 2);
          for (int64_t j = 0; j < 8; ++j) {
            const uint8_t lo = k < K ? (pair[j] >> shift) & 15 : 8;
            const uint8_t hi = k < K ? (pair[8 + j] >> shift) & 15 : 8;
            dst[i * 2 * kBlock + 4 * j + t] = lo | (hi << 4);
          }
        }
      }
    }
  });
  count_path(CpuPath::kQuantizedPackCpu);
  return out;
}

at::Tensor pack_w8a8g_cpu(const at::Tensor& qweight, int64_t in_features) {
  check_cpu_contiguous(qweight, "qweight");
  const int64_t K = in_features;
  TORCH_CHECK_VALUE(qweight.scalar_type() == at::kChar && qweight.dim() == 3 &&
                        qweight.size(1) == K && qweight.size(2) == kBlock,
                    "pack_w8a8g takes an 8-bit qweight int8 [blocks, ", K, ", 16], got ",
                    qweight.scalar_type(), " ", qweight.sizes());
  const int64_t blocks = qweight.size(0), quads = (K + 31) / 32 * 8;
  at::Tensor out = at::empty({blocks, quads, 4 * kBlock}, qweight.options());
  const int8_t* in = qweight.data_ptr<int8_t>();
  int8_t* o = out.data_ptr<int8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* src = in + b * K * kBlock;
      int8_t* dst = o + b * quads * 4 * kBlock;
      for (int64_t i = 0; i < quads; ++i) {
        for (int64_t t = 0; t < 4; ++t) {
          const int64_t k = 4 * i + t;
          for (int64_t c = 0; c < kBlock; ++c) {  // column c: half c / 8, lane c % 8
            dst[i * 4 * kBlock + 32 * (c / 8) + 4 * (c % 8) + t] = k < K ? src[k * kBlock + c] : 0;
          }
        }
      }
    }
  });
  count_path(CpuPath::kQuantizedPackCpu);
  return out;
}

}  // namespace cbatch
