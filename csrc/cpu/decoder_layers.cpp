// A step's decoder layers of a Llama-family model (Llama, Qwen2, Qwen3) in one call: the ops
// cbatch/models/llama.py calls one by one, called here from C++ in the same order on the same
// tensors, so the hidden states are the Python loop's bit for bit.  What it saves is what
// surrounds each op there: the interpreter, the module calls and torch's dispatcher, about
// 8 ms of a 32-layer batch-1 decode step of ~23 ms (benchmarks/NOTES.md, "One call for a
// step's decoder layers").
//
// The layers come as one flat list of tensors and one of ints, read in order
// (cbatch/models/cpu_layers.py builds them); per layer:
//   tensors: input_layernorm, post_attention_layernorm, q_norm, k_norm (None without qk_norm),
//            then qkv_proj, o_proj, gate_up_proj, down_proj: each linear's parts, each part
//            kLinearTensors slots;
//   ints:    each linear's number of parts, then each part's kLinearInts: kind, out_features,
//            bits, group_size, amx.
// A linear of several parts (a projection whose shards are stored in different forms:
// cbatch/layers/stacked_linear.py) runs each part and puts their outputs side by side.
// A part's slots by kind (None where a kind has fewer):
//   kPacked    (linear_cpu):               packed weight, -, -, bias, -
//   kQuantized (quantized_linear_cpu):     qweight, scales, zeros, bias, mins
//   kW8A8      (quantized_linear_w8a8_cpu): qweight, scales, -, bias, -
//   kW4A8      (quantized_linear_w4a8_cpu): qweight, scales, zeros, bias, mins
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "../ops.h"
#include "cpu_options.h"

namespace cbatch {
namespace {

enum class LinearKind : int64_t { kPacked = 0, kQuantized = 1, kW8A8 = 2, kW4A8 = 3 };
constexpr int64_t kLinearTensors = 5, kLinearInts = 5, kNorms = 4;

using Slots = c10::List<std::optional<at::Tensor>>;

// The tensors and ints, read in order.
struct Cursor {
  const Slots& tensors;
  at::IntArrayRef ints;
  int64_t t = 0, i = 0;

  // the next n tensor slots start here
  int64_t take_tensors(int64_t n) {
    TORCH_CHECK_VALUE(t + n <= static_cast<int64_t>(tensors.size()),
                      "decoder_layers: the layers need more than the ", tensors.size(),
                      " tensors given");
    t += n;
    return t - n;
  }
  int64_t take_ints(int64_t n) {
    TORCH_CHECK_VALUE(i + n <= static_cast<int64_t>(ints.size()),
                      "decoder_layers: the layers need more than the ", ints.size(),
                      " ints given");
    i += n;
    return i - n;
  }
};

at::Tensor required(const Slots& t, int64_t i) {
  std::optional<at::Tensor> v = t.get(i);
  TORCH_CHECK_VALUE(v.has_value(), "decoder_layers: tensor ", i, " is None");
  return *v;
}

// x [T, K] → [T, N] through one part whose slots start at tensors[t0] and ints at ints[i0].
at::Tensor part(const at::Tensor& x, const Slots& t, int64_t t0, at::IntArrayRef ints,
                int64_t i0) {
  const int64_t kind = ints[i0], n = ints[i0 + 1], bits = ints[i0 + 2], group = ints[i0 + 3];
  const std::optional<at::Tensor> bias = t.get(t0 + 3);
  switch (static_cast<LinearKind>(kind)) {
    case LinearKind::kPacked:
      return linear_cpu(x, required(t, t0), n, bias, std::nullopt, "none", ints[i0 + 4] != 0);
    case LinearKind::kQuantized:
      return quantized_linear_cpu(x, required(t, t0), required(t, t0 + 1), t.get(t0 + 2), bits,
                                  group, n, bias, t.get(t0 + 4));
    case LinearKind::kW8A8:
      return quantized_linear_w8a8_cpu(x, required(t, t0), required(t, t0 + 1), n, bias);
    case LinearKind::kW4A8:
      return quantized_linear_w4a8_cpu(x, required(t, t0), required(t, t0 + 1), group, n, bias,
                                       t.get(t0 + 2), t.get(t0 + 4));
  }
  TORCH_CHECK_VALUE(false, "decoder_layers: unknown linear kind ", kind);
}

// x [T, K] → [T, N] through the next linear: its parts, their outputs side by side.
at::Tensor linear(const at::Tensor& x, Cursor& c) {
  const int64_t parts = c.ints[c.take_ints(1)];
  TORCH_CHECK_VALUE(parts >= 1, "decoder_layers: a linear of ", parts, " parts");
  if (parts == 1)
    return part(x, c.tensors, c.take_tensors(kLinearTensors), c.ints, c.take_ints(kLinearInts));
  std::vector<at::Tensor> outs;
  for (int64_t p = 0; p < parts; ++p)
    outs.push_back(part(x, c.tensors, c.take_tensors(kLinearTensors), c.ints,
                        c.take_ints(kLinearInts)));
  return at::cat(outs, 1);
}

}  // namespace

at::Tensor decoder_layers_cpu(const at::Tensor& hidden,
                              const c10::List<std::optional<at::Tensor>>& tensors,
                              at::IntArrayRef ints, at::TensorList kv_caches,
                              const at::Tensor& final_norm, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                              const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                              bool decode) {
  const int64_t L = static_cast<int64_t>(kv_caches.size()) / 2;
  TORCH_CHECK_VALUE(L >= 1 && static_cast<int64_t>(kv_caches.size()) == 2 * L,
                    "decoder_layers: kv_caches must hold a key and a value cache per layer, got ",
                    kv_caches.size(), " tensors");
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.is_contiguous(),
                    "decoder_layers: hidden must be a dense [T, hidden], got ", hidden.sizes());
  const int64_t T = hidden.size(0), H = num_heads, Hkv = num_kv_heads, D = head_dim;
  at::Tensor x = at::empty(hidden.sizes(), hidden.options());
  at::Tensor residual = hidden.clone();  // the caller's embeddings stay as they were
  Cursor c{tensors, ints};
  for (int64_t l = 0; l < L; ++l) {
    const int64_t t0 = c.take_tensors(kNorms);
    if (l == 0) {
      rms_norm_cpu(x, residual, required(tensors, t0), eps);  // no residual yet
    } else {
      fused_add_rms_norm_cpu(x, residual, required(tensors, t0), eps);
    }
    const at::Tensor qkv = linear(x, c);
    at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
    at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
    const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
    if (const std::optional<at::Tensor> q_norm = tensors.get(t0 + 2); q_norm.has_value()) {
      at::Tensor qn = at::empty({T, H, D}, q.options());
      at::Tensor kn = at::empty({T, Hkv, D}, k.options());
      rms_norm_cpu(qn, q, *q_norm, eps);
      rms_norm_cpu(kn, k, required(tensors, t0 + 3), eps);
      q = qn;
      k = kn;
    }
    rotary_embedding_cpu(positions, q, k, D, cos_sin_cache, /*is_neox=*/true);
    at::Tensor key_cache = kv_caches[2 * l], value_cache = kv_caches[2 * l + 1];
    write_kv_cache_cpu(k, v, key_cache, value_cache, slot_mapping);
    const at::Tensor o =
        decode ? paged_decode_attention_cpu(q, key_cache, value_cache, block_tables, seq_lens,
                                            scale)
               : paged_prefill_attention_cpu(q, key_cache, value_cache, block_tables,
                                             cu_seqlens_q, seq_lens, scale);
    x = linear(o.view({T, H * D}), c);
    fused_add_rms_norm_cpu(x, residual, required(tensors, t0 + 1), eps);
    const at::Tensor gate_up = linear(x, c);
    at::Tensor act = at::empty({T, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul_cpu(act, gate_up);
    x = linear(act, c);
  }
  TORCH_CHECK_VALUE(c.t == static_cast<int64_t>(tensors.size()) &&
                        c.i == static_cast<int64_t>(ints.size()),
                    "decoder_layers: ", L, " layers took ", c.t, " tensors and ", c.i,
                    " ints, given ", tensors.size(), " and ", ints.size());
  fused_add_rms_norm_cpu(x, residual, final_norm, eps);
  count_path(CpuPath::kDecoderLayersCpu);
  return x;
}

}  // namespace cbatch
