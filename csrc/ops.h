// Declarations of every kernel entry point; registered in torch_bindings.cpp.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace cbatch {

// What this build used (compiler, libstdc++, CUDA archs, nvcc, torch, OpenMP) as a JSON
// object; registered as torch.ops.cbatch.build_info.  module.cpp.
std::string build_info();

#ifdef CBATCH_WITH_CUDA
// The nvcc that compiled the CUDA kernels, "major.minor.build".  cuda/cache_kernels.cu.
std::string nvcc_version();
#endif

// key, value: [T, H_kv, D]; key_cache, value_cache: [num_blocks, block_size, H_kv, D];
// slot_mapping: int64 [T], -1 = skip.
void write_kv_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping);

#ifdef CBATCH_WITH_CUDA
void write_kv_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping);
#endif

// Shared shape checks for write_kv_cache (the CPU and CUDA entry points both call it).
void check_write_kv_cache_args(const at::Tensor& key, const at::Tensor& value,
                               const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& slot_mapping);

// query: [S or T, H, D] (dense rows, free token stride); caches as above with H_kv heads,
// H a multiple of H_kv (query head h reads KV head h / (H / H_kv));
// block_tables: int32 [S, max_blocks]; seq_lens: int32 [S]; cu_seqlens_q: int32 [S + 1].
// Both return a new [*, H, D] tensor in query's dtype.
at::Tensor paged_decode_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache,
                                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                      double scale);
at::Tensor paged_prefill_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache,
                                       const at::Tensor& block_tables,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                       double scale);

#ifdef CBATCH_WITH_CUDA
at::Tensor paged_decode_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache,
                                       const at::Tensor& block_tables,
                                       const at::Tensor& seq_lens, double scale);
#endif

// CPU linear layers (cpu/linear.cpp; the kernel: cpu/gemm.h).  Whether this CPU runs
// linear_cpu for `dtype` (float32: AVX2 + FMA, or AVX-512; bfloat16: AVX-512 and
// AVX512-BF16, or AVX2 + FMA without AVX-512, widened to fp32 in registers).
bool cpu_linear_supported(at::ScalarType dtype);
// act(x @ W^T + bias) + residual.  x: [M, K] (dense rows); packed: W [N, K] packed into
// [ceil(N / 16), K, 16] (bf16: pairs of k side by side); bias: [N]; residual: [M, N];
// activation: "none" or "gelu_tanh".  amx: a bf16 x of many rows may run on AMX tiles
// (cpu/amx_bf16_linear.h), whose sums run in another order (not for batch-invariant
// engines).  Returns a new dense [M, N].
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual, const std::string& activation,
                      bool amx);

// Linear layers on quantized weights (cpu/quantized_linear.cpp): x @ W^T + bias with
// W[n, k] = scales[g, n] * (q[n, k] - zeros[g, n]), g = k / group_size, dequantized in
// registers.  x: [M, K] float32 or bfloat16; qweight: bits 8: int8 [N16 / 16, K, 16]; bits 4:
// uint8 [N16 / 16, ceil(K / 2), 16], two k per byte (low nibble first); scales: float32
// [G, N16]; zeros: int8 [G, N16] or none (8-bit: 0, 4-bit: 8); bias: [N].  N16: N rounded up
// to 16.  mins: float32 [G, N16] or none; with mins (zeros none) W[n, k] = scales[g, n] *
// q[n, k] - mins[g, n], no zero point (4-bit q as stored, 0..15).  Returns a new [M, N] in
// x's dtype.  Supported wherever AVX2 + FMA or AVX-512 is.
bool quantized_linear_supported();
at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& qweight,
                                const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                                int64_t bits, int64_t group_size, int64_t out_features,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& mins = std::nullopt);
// W8A8 (cpu/quantized_linear_w8a8.cpp): x quantized to int8 per token in the kernel, int8 dot
// products summed exactly in int32, y = acc * s_w[n] * s_x[m] + bias.  qweight: uint8
// [N16 / 16, ceil(K / 4), 64], each column's q + 128 in quads of k; scales: float32 [1, N16];
// K <= 65536.  Supported where quantized_linear is (AVX512-VNNI's vpdpbusd where the CPU has
// it, else AVX2).
at::Tensor quantized_linear_w8a8_cpu(const at::Tensor& x, const at::Tensor& qweight,
                                     const at::Tensor& scales, int64_t out_features,
                                     const std::optional<at::Tensor>& bias);
// W4A8 (cpu/quantized_linear_w4a8.cpp): x quantized to int8 per token and per group of
// group_size k in the kernel, int4 x int8 dot products summed exactly in int32 per group,
// y = sum over groups of S * s_w[g, n] * s_x[m, g] (+ bias) in fp32, in a fixed order.
// qweight: uint8 [N16 / 16, 8 ceil(K / 32), 32], q + 8 as nibbles (columns j and 8 + j of
// a block in one byte) in quads of k; scales: float32 [G, N16]; group_size a multiple of 32;
// zeros: None (symmetric: 8) or int8 [G, N16] in [0, 15], the nibbles then the weight's own
// unsigned integers; mins: None or float32 [G, N16] (zeros None): w = s_w u - m, each group's
// term less fl(m * fl(Sx * s_x)), Sx the row's sum of its q over the group.  An int8 qweight
// [N16 / 16, 8 ceil(K / 32), 64] holds 8-bit weights instead (W8A8 per group, llama.cpp's Q8_0
// route: columns 0..7 then 8..15 of each quad of k, signed, zero point 0; group_size a multiple
// of 16).  Supported on x86 with AVX2 and FMA (AVX512-VNNI's vpdpbusd where present, for int4).
at::Tensor quantized_linear_w4a8_cpu(const at::Tensor& x, const at::Tensor& qweight,
                                     const at::Tensor& scales, int64_t group_size,
                                     int64_t out_features,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& zeros = std::nullopt,
                                     const std::optional<at::Tensor>& mins = std::nullopt);

// Greedy tokens of an lm_head without reading all its weights, as
// argmax_cpu(linear_cpu(x, packed, out_features)) answers, bit for bit: a screen on `screen`
// (a smaller copy of the weight, packed alike) and the kernel's sums of the few columns it
// cannot rule out (cpu/greedy_head.cpp).  x: [M, K] (dense rows); packed: as linear_cpu's.
// - screen = bf16(W) (x fp32); scales: none; w_norm, screen_norm, error_norm: the maxima
//   over columns of |w_j|, |bf16(w_j)| and |w_j - bf16(w_j)| (2-norms, rounded up).
// - screen = q, int8, with W ~ diag(scales) q (fp32 [N] scales; x fp32 or bf16); the norms
//   those of w_j, s_j q_j and w_j - s_j q_j.
// Returns int64 [M].  greedy_head_supported(dtype): where an lm_head of dtype gets screens
// (fp32: bf16 and int8; bf16: int8), wherever linear_cpu runs dtype.
bool greedy_head_supported(at::ScalarType dtype);
at::Tensor greedy_head_cpu(const at::Tensor& x, const at::Tensor& packed,
                           const at::Tensor& screen, int64_t out_features, double w_norm,
                           double screen_norm, double error_norm,
                           const std::optional<at::Tensor>& scales, bool amx);

// GGUF's quantized blocks [B, type_size] (uint8) of type qtype ("Q4_K", ...) unpacked → the
// levels [B, block_size] (uint8; int8 for Q8_0), scales fp32 [B, S] and zero points int8 or
// mins fp32 [B, S], bitwise cbatch/models/gguf's torch unpackers.  cpu/gguf_blocks.cpp.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_unpack_cpu(const at::Tensor& blocks,
                                                               const std::string& qtype);

// A quantized weight's integers into the kernels' layouts (cbatch/layers/quantization/
// weight.py's pack, pack_w4a8, pack_w8a8g, bitwise).  cpu/quantized_pack.cpp.
at::Tensor pack_levels_cpu(const at::Tensor& q, int64_t bits);
at::Tensor pack_w4a8_cpu(const at::Tensor& qweight, int64_t in_features);
at::Tensor pack_w8a8g_cpu(const at::Tensor& qweight, int64_t in_features);

// Row argmax of logits [S, V] (dense rows) → int64 [S], as torch.argmax(dim=-1): the first
// index of the maximum, the first NaN if any.  cpu/argmax.cpp.
at::Tensor argmax_cpu(const at::Tensor& logits);

// One draw per sampled row of logits [S, V] (dense rows) → int64 [R]: rows [R] (int64) pick
// the rows; temperature (> 0), top_p and min_p float32 [R], top_k int64 [R] (0 = off) and
// uniform float64 [R] in [0, 1) (the request's own stream) say how.  cpu/sample.cpp.
at::Tensor sample_cpu(const at::Tensor& logits, const at::Tensor& rows,
                      const at::Tensor& temperature, const at::Tensor& top_k,
                      const at::Tensor& top_p, const at::Tensor& min_p,
                      const at::Tensor& uniform);
// A grammar's token bitmask on logits [S, V] (fp32, in place): -inf where bit t % 32 of word
// t // 32 of bitmask [S, W] (int32) is clear, and past 32 W in rows that forbid any token.
// cpu/sample.cpp.
at::Tensor& apply_bitmask_cpu(at::Tensor& logits, const at::Tensor& bitmask);
// The penalties of rows [P] (int64) of logits [S, V] (fp32, in place), from their requests'
// slots [P] of counts (int32 [slots, V]: output tokens) and prompt (bool [slots, V]):
// repetition (divide positive logits, multiply negative ones, where seen in prompt or output),
// then frequency * count + presence where in the output.  cpu/sample.cpp.
at::Tensor& apply_penalties_cpu(at::Tensor& logits, const at::Tensor& rows,
                                const at::Tensor& slots, const at::Tensor& counts,
                                const at::Tensor& prompt, const at::Tensor& presence,
                                const at::Tensor& frequency, const at::Tensor& repetition);

// The Llama layers' small ops, vLLM's names and semantics, rounded as the torch formulas of
// cbatch/layers round (cpu/layernorm.cpp, cpu/activation.cpp, cpu/pos_encoding.cpp).  Tensors:
// [rows, n] or [T, H, n] with a dense last dim (free row strides); fp32, bf16 or fp16.
// result = norm(input) * weight, RMSNorm over the last dim (result may be input).
void rms_norm_cpu(at::Tensor& result, const at::Tensor& input, const at::Tensor& weight,
                  double epsilon);
// In place: residual += input; input = norm(residual) * weight.
void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                            double epsilon);
// result [.., d] = silu(input[.., :d]) * input[.., d:] (input [.., 2d]).
void silu_and_mul_cpu(at::Tensor& result, const at::Tensor& input);
// In place on query and key ([T, H * head_size] or [T, H, head_size]): rotate-half RoPE at
// positions [T] (int64) from cos_sin_cache [P, head_size] (cos half, then sin half).
void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query,
                          const std::optional<at::Tensor>& key, int64_t head_size,
                          const at::Tensor& cos_sin_cache, bool is_neox);

// A step's decoder layers of a Llama-family model in one call (cpu/decoder_layers.cpp): the
// ops above in cbatch/models/llama.py's order on the same tensors, so bit for bit its loop.
// hidden: the embeddings [T, hidden] (not modified); tensors, ints: kLayerTensors and
// kLayerInts per layer (decoder_layers.cpp); kv_caches: each layer's key and value cache;
// final_norm: the model's last RMSNorm; positions .. cu_seqlens_q: the step batch's
// (cbatch/layers/step_batch.py); decode: the decode kernel (one token per sequence) or the
// prefill one.  Returns the final hidden states [T, hidden], after the last norm.
at::Tensor decoder_layers_cpu(const at::Tensor& hidden,
                              const c10::List<std::optional<at::Tensor>>& tensors,
                              at::IntArrayRef ints, at::TensorList kv_caches,
                              const at::Tensor& final_norm, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                              const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                              bool decode);

// What greedy_head runs inside its own call: linear_cpu's logits (no bias, activation or
// residual) and argmax_cpu, each without counting an op call of its own (cpu_path_counts).
at::Tensor logits_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      bool amx = false);
at::Tensor argmax_rows_cpu(const at::Tensor& logits);

// The CPU kernels' options, read on every call (cpu/cpu_options.cpp): isa "" (what the CPU
// has) or "avx2" (the paths of a CPU without AVX-512); attention "" (the widest step) or
// "generic" (the portable step); amx "" (AMX tiles where the CPU has them), "off", or "model"
// (the AMX paths, int8 and bf16, on a software model of the tiles, for their tests:
// cpu/amx_tile_ops.h).
// Any other value is an error that names it.
void set_cpu_options(const std::string& isa, const std::string& attention,
                     const std::string& amx);
// The ISA features the CPU kernels use now (the CPU's, under the cap), space-separated, from
// "avx512 avx512bf16 avx512vnni amx-int8 avx2"; "" where none.  amx-int8: W8A8 and W4A8 take
// AMX-INT8 tiles from 8 rows (or their model, set_cpu_options).
std::string cpu_isa();
// The step CPU attention runs for this head dim and dtype (default float32) now:
// "avx512bf16" (bf16 on AVX512-BF16), "avx512", "avx2" or "generic" (cpu/attention.cpp, the
// rule its kernels follow).
std::string cpu_attention_step(int64_t head_dim, std::optional<at::ScalarType> dtype);
// Every kernel path as "<op>.<path>" and, in the same order, how many op calls ran it.
std::vector<std::string> cpu_path_names();
std::vector<int64_t> cpu_path_counts();

void check_attention_args(const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens);

}  // namespace cbatch
