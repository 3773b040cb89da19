// write_kv_cache on CUDA: one thread block per token copies its K and V rows into their
// cache slot, 16 bytes per thread per step when the rows allow it.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <string>

#include "../checks.h"
#include "../ops.h"

namespace cbatch {
namespace {

// Copies `row_words` words of type Word per token; slot < 0 writes nothing.
template <typename Word>
__global__ void write_kv_cache_kernel(const Word* __restrict__ key, const Word* __restrict__ value,
                                      Word* __restrict__ key_cache, Word* __restrict__ value_cache,
                                      const int64_t* __restrict__ slot_mapping, int64_t key_stride,
                                      int64_t value_stride, int row_words) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const Word* key_row = key + token * key_stride;
  const Word* value_row = value + token * value_stride;
  Word* key_dst = key_cache + slot * row_words;
  Word* value_dst = value_cache + slot * row_words;
  for (int i = threadIdx.x; i < row_words; i += blockDim.x) {
    key_dst[i] = key_row[i];
    value_dst[i] = value_row[i];
  }
}

template <typename Word>
void launch(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
            at::Tensor& value_cache, const at::Tensor& slot_mapping, cudaStream_t stream) {
  const int64_t word = sizeof(Word) / key.element_size();  // elements per word
  const int row_words = static_cast<int>(key.size(1) * key.size(2) / word);
  const int threads = std::min(256, row_words);
  write_kv_cache_kernel<Word><<<key.size(0), threads, 0, stream>>>(
      static_cast<const Word*>(key.data_ptr()), static_cast<const Word*>(value.data_ptr()),
      static_cast<Word*>(key_cache.data_ptr()), static_cast<Word*>(value_cache.data_ptr()),
      slot_mapping.data_ptr<int64_t>(), key.stride(0) / word, value.stride(0) / word, row_words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned_to(const at::Tensor& t, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0 &&
         (t.stride(0) * t.element_size()) % bytes == 0;
}

}  // namespace

void write_kv_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_write_kv_cache_args(key, value, key_cache, value_cache, slot_mapping);
  if (key.numel() == 0) return;  // no tokens, no heads or an empty head: nothing to copy
  const c10::cuda::CUDAGuard guard(key.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const bool vec16 = row_bytes % 16 == 0 && aligned_to(key, 16) && aligned_to(value, 16) &&
                     aligned_to(key_cache, 16) && aligned_to(value_cache, 16);
  if (vec16) {
    launch<uint4>(key, value, key_cache, value_cache, slot_mapping, stream);
  } else if (key.element_size() == 4) {
    launch<uint32_t>(key, value, key_cache, value_cache, slot_mapping, stream);
  } else {
    TORCH_CHECK_TYPE(key.element_size() == 2, "write_kv_cache: unsupported dtype ",
                     key.scalar_type());
    launch<uint16_t>(key, value, key_cache, value_cache, slot_mapping, stream);
  }
}

std::string nvcc_version() {
  return std::to_string(__CUDACC_VER_MAJOR__) + "." + std::to_string(__CUDACC_VER_MINOR__) +
         "." + std::to_string(__CUDACC_VER_BUILD__);
}

}  // namespace cbatch
