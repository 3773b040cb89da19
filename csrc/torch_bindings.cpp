// The one place where cbatch's ops get their schemas and per-device kernels
// (vLLM's csrc/torch_bindings.cpp pattern).  Their fake (meta) implementations are registered
// in Python, beside the ops' wrappers in cbatch/ops/: backends.py (attention, the KV cache
// write), layer_ops.py (the Llama layers' small ops), sampling.py (argmax, sample, penalties,
// bitmask), cpu.py (the linears and the greedy head) and quantized.py (the quantized linears).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(cbatch, m) {
  m.def("build_info() -> str", &cbatch::build_info);  // no tensors: one kernel for all devices
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, float scale) -> Tensor");
  // CPU only: the linear layers on weights packed by cbatch/ops/cpu.py
  m.def("cpu_linear_supported(ScalarType dtype) -> bool", &cbatch::cpu_linear_supported);
  m.def(
      "linear(Tensor x, Tensor packed, int out_features, Tensor? bias, Tensor? residual, "
      "str activation, bool amx=False) -> Tensor");
  m.def("quantized_linear_supported() -> bool", &cbatch::quantized_linear_supported);
  m.def(
      "quantized_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int bits, "
      "int group_size, int out_features, Tensor? bias, Tensor? mins=None) -> Tensor");
  m.def(
      "quantized_linear_w8a8(Tensor x, Tensor qweight, Tensor scales, int out_features, "
      "Tensor? bias) -> Tensor");
  m.def(
      "quantized_linear_w4a8(Tensor x, Tensor qweight, Tensor scales, int group_size, "
      "int out_features, Tensor? bias, Tensor? zeros=None, Tensor? mins=None) -> Tensor");
  m.def("greedy_head_supported(ScalarType dtype) -> bool", &cbatch::greedy_head_supported);
  m.def(
      "greedy_head(Tensor x, Tensor packed, Tensor screen, int out_features, float w_norm, "
      "float screen_norm, float error_norm, Tensor? scales=None, bool amx=False) -> Tensor");
  m.def("gguf_unpack(Tensor blocks, str qtype) -> (Tensor, Tensor, Tensor)");  // GGUF load
  m.def("pack_levels(Tensor q, int bits) -> Tensor");  // quantized weights' layouts (load)
  m.def("pack_w4a8(Tensor qweight, int in_features) -> Tensor");
  m.def("pack_w8a8g(Tensor qweight, int in_features) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");  // the greedy sampler's row argmax (CPU only)
  m.def(
      "sample(Tensor logits, Tensor rows, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor min_p, Tensor uniform) -> Tensor");  // the sampled rows' draw (CPU only)
  m.def("apply_bitmask(Tensor(a!) logits, Tensor bitmask) -> Tensor(a!)");  // grammars (CPU)
  m.def(
      "apply_penalties(Tensor(a!) logits, Tensor rows, Tensor slots, Tensor counts, "
      "Tensor prompt, Tensor presence, Tensor frequency, Tensor repetition) -> Tensor(a!)");
  // CPU only: the Llama layers' small ops (vLLM's schemas), in place
  m.def("rms_norm(Tensor(a!) result, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
      "float epsilon) -> ()");
  m.def("silu_and_mul(Tensor(a!) result, Tensor input) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  // CPU only: a step's Llama-family decoder layers in one call (cbatch/models/cpu_layers.py)
  m.def(
      "decoder_layers(Tensor hidden, Tensor?[] tensors, int[] ints, Tensor[] kv_caches, "
      "Tensor final_norm, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale, Tensor positions, Tensor cos_sin_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, bool decode) -> Tensor");
  // The CPU kernels' options and what they ran (no tensors: one kernel for all devices)
  m.def("set_cpu_options(str isa, str attention, str amx=\"\") -> ()",
        &cbatch::set_cpu_options);
  m.def("cpu_isa() -> str", &cbatch::cpu_isa);
  m.def("cpu_attention_step(int head_dim, ScalarType? dtype=None) -> str",
        &cbatch::cpu_attention_step);
  m.def("cpu_path_names() -> str[]", &cbatch::cpu_path_names);
  m.def("cpu_path_counts() -> int[]", &cbatch::cpu_path_counts);
}

TORCH_LIBRARY_IMPL(cbatch, CPU, m) {
  m.impl("write_kv_cache", &cbatch::write_kv_cache_cpu);
  m.impl("paged_decode_attention", &cbatch::paged_decode_attention_cpu);
  m.impl("paged_prefill_attention", &cbatch::paged_prefill_attention_cpu);
  m.impl("linear", &cbatch::linear_cpu);
  m.impl("quantized_linear", &cbatch::quantized_linear_cpu);
  m.impl("quantized_linear_w8a8", &cbatch::quantized_linear_w8a8_cpu);
  m.impl("quantized_linear_w4a8", &cbatch::quantized_linear_w4a8_cpu);
  m.impl("greedy_head", &cbatch::greedy_head_cpu);
  m.impl("gguf_unpack", &cbatch::gguf_unpack_cpu);
  m.impl("pack_levels", &cbatch::pack_levels_cpu);
  m.impl("pack_w4a8", &cbatch::pack_w4a8_cpu);
  m.impl("pack_w8a8g", &cbatch::pack_w8a8g_cpu);
  m.impl("argmax", &cbatch::argmax_cpu);
  m.impl("sample", &cbatch::sample_cpu);
  m.impl("apply_penalties", &cbatch::apply_penalties_cpu);
  m.impl("apply_bitmask", &cbatch::apply_bitmask_cpu);
  m.impl("rms_norm", &cbatch::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &cbatch::fused_add_rms_norm_cpu);
  m.impl("silu_and_mul", &cbatch::silu_and_mul_cpu);
  m.impl("rotary_embedding", &cbatch::rotary_embedding_cpu);
  m.impl("decoder_layers", &cbatch::decoder_layers_cpu);
}

#ifdef CBATCH_WITH_CUDA
TORCH_LIBRARY_IMPL(cbatch, CUDA, m) {
  m.impl("write_kv_cache", &cbatch::write_kv_cache_cuda);
  m.impl("paged_decode_attention", &cbatch::paged_decode_attention_cuda);
}
#endif
