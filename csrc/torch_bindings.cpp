// The one place where cbatch's ops get their schemas and per-device kernels
// (vLLM's csrc/torch_bindings.cpp pattern).  Fake (meta) implementations live in
// cbatch/ops.py.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(cbatch, m) {
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(cbatch, CPU, m) {
  m.impl("write_kv_cache", &cbatch::write_kv_cache_cpu);
}

#ifdef CBATCH_WITH_CUDA
TORCH_LIBRARY_IMPL(cbatch, CUDA, m) {
  m.impl("write_kv_cache", &cbatch::write_kv_cache_cuda);
}
#endif
