// Rotary position embeddings on the CPU, vLLM's rotary_embedding (csrc/cpu/pos_encoding.cpp
// there), in place on q and k: each head's halves x1, x2 become x1 cos - x2 sin and
// x2 cos + x1 sin (the rotate-half, "neox" layout of cbatch/layers/rotary_embedding.py), with
// cos and sin read from cos_sin_cache [max_positions, head_size] (cos in the first half, sin in
// the second, in the activations' dtype) at each token's position.  Each product and each sum
// is rounded to the dtype as the torch formula's separate ops round them (no fused
// multiply-add), so the result is the torch formula's bit for bit.  Tokens are independent:
// batch-invariant.
#include <ATen/Parallel.h>

#include <optional>

#include "../ops.h"
#include "cpu_options.h"
#include "elementwise.h"

namespace cbatch {
namespace {

// q or k, [T, H * head_size] or [T, H, head_size], as heads: token t's head h starts at
// t * token_stride + h * head_stride.
struct Heads {
  int64_t tokens, heads, token_stride, head_stride;

  Heads(const at::Tensor& t, int64_t head_size, const char* name) {
    TORCH_CHECK_VALUE((t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1, name,
                      " must be [T, H * head_size] or [T, H, head_size] with a dense last dim, "
                      "got ", t.sizes(), " strides ", t.strides());
    tokens = t.size(0);
    if (t.dim() == 3) {
      TORCH_CHECK_VALUE(t.size(2) == head_size, name, "'s last dim must be head_size (",
                        head_size, "), got ", t.sizes());
      heads = t.size(1);
      head_stride = t.stride(1);
    } else {
      TORCH_CHECK_VALUE(t.size(1) % head_size == 0, name, "'s width must be a multiple of ",
                        "head_size (", head_size, "), got ", t.sizes());
      heads = t.size(1) / head_size;
      head_stride = head_size;
    }
    token_stride = t.stride(0);
  }
};

template <typename T>
void rotate_generic(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
    const float c = to_float(cos[i]), s = to_float(sin[i]);
    // each product stored before the sum: no fused multiply-add
    volatile float x1c = to_float(from_float<T>(x1 * c)), x2s = to_float(from_float<T>(x2 * s));
    volatile float x2c = to_float(from_float<T>(x2 * c)), x1s = to_float(from_float<T>(x1 * s));
    x[i] = from_float<T>(x1c - x2s);
    x[half + i] = from_float<T>(x2c + x1s);
  }
}

#ifdef CBATCH_X86
template <typename T>
CBATCH_AVX2 CBATCH_INLINE void rotate8(T* x1p, T* x2p, __m256 c, __m256 s, int64_t n) {
  using avx2::mul_rounded, avx2::round_to;
  const bool full = n == 8;
  const __m256 x1 = full ? avx2::load(x1p) : avx2::load_tail(x1p, n);
  const __m256 x2 = full ? avx2::load(x2p) : avx2::load_tail(x2p, n);
  const __m256 o1 = _mm256_sub_ps(round_to<T>(mul_rounded(x1, c)), round_to<T>(mul_rounded(x2, s)));
  const __m256 o2 = _mm256_add_ps(round_to<T>(mul_rounded(x2, c)), round_to<T>(mul_rounded(x1, s)));
  if (full) {
    avx2::store(x1p, o1);
    avx2::store(x2p, o2);
  } else {
    avx2::store_tail(x1p, o1, n);
    avx2::store_tail(x2p, o2, n);
  }
}

template <typename T>
CBATCH_AVX2 void rotate_avx2(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    rotate8(x + i, x + half + i, avx2::load(cos + i), avx2::load(sin + i), 8);
  }
  if (i < half) {
    const int64_t n = half - i;
    rotate8(x + i, x + half + i, avx2::load_tail(cos + i, n), avx2::load_tail(sin + i, n), n);
  }
}
#endif

template <typename T>
CpuPath run(const int64_t* positions, at::Tensor& query, const std::optional<at::Tensor>& key,
            int64_t head_size, const at::Tensor& cache) {
  const int64_t half = head_size / 2;
  const Heads q(query, head_size, "query");
  std::optional<Heads> k;
  if (key) k.emplace(*key, head_size, "key");
  TORCH_CHECK_VALUE(!k || k->tokens == q.tokens, "rotary_embedding: query has ", q.tokens,
                    " tokens and key ", k->tokens);
  T* qp = query.data_ptr<T>();
  T* kp = key ? key->data_ptr<T>() : nullptr;
  const T* table = cache.data_ptr<T>();
  const int64_t table_stride = cache.stride(0);
#ifdef CBATCH_X86
  const bool vector = cpu_has_avx2();
#else
  const bool vector = false;
#endif
  const int64_t heads = q.heads + (k ? k->heads : 0);
  at::parallel_for(0, q.tokens, row_grain(heads * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = table + positions[t] * table_stride;
      const T* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = h < q.heads ? qp + t * q.token_stride + h * q.head_stride
                           : kp + t * k->token_stride + (h - q.heads) * k->head_stride;
#ifdef CBATCH_X86
        if (vector) {
          rotate_avx2(x, cos, sin, half);
          continue;
        }
#endif
        rotate_generic(x, cos, sin, half);
      }
    }
  });
  return vector ? CpuPath::kRotaryEmbeddingAvx2 : CpuPath::kRotaryEmbeddingGeneric;
}

}  // namespace

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query,
                          const std::optional<at::Tensor>& key, int64_t head_size,
                          const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK_VALUE(is_neox, "rotary_embedding: only the rotate-half (neox) layout is "
                    "implemented, the one cbatch's models use");
  TORCH_CHECK_VALUE(head_size > 0 && head_size % 2 == 0, "rotary_embedding: head_size must be "
                    "even and positive, got ", head_size);
  TORCH_CHECK_VALUE(positions.device().is_cpu() && query.device().is_cpu() &&
                        cos_sin_cache.device().is_cpu() && (!key || key->device().is_cpu()),
                    "rotary_embedding's tensors must be on the CPU");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong, "positions must be int64, got ",
                   positions.scalar_type());
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.is_contiguous() &&
                        positions.size(0) == query.size(0),
                    "positions must be a dense [T] with T = query.size(0) (", query.size(0),
                    "), got ", positions.sizes());
  TORCH_CHECK_TYPE(cos_sin_cache.scalar_type() == query.scalar_type() &&
                       (!key || key->scalar_type() == query.scalar_type()),
                   "rotary_embedding: query, key and cos_sin_cache must have one dtype");
  TORCH_CHECK_VALUE(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == head_size &&
                        cos_sin_cache.stride(1) == 1,
                    "cos_sin_cache must be [max_positions, head_size (", head_size,
                    ")] with dense rows, got ", cos_sin_cache.sizes());
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK_INDEX(pos[t] >= 0 && pos[t] < cos_sin_cache.size(0), "position ", pos[t],
                      " is outside cos_sin_cache's ", cos_sin_cache.size(0), " positions");
  }
  if (query.numel() == 0) return;
  CpuPath path;
  switch (query.scalar_type()) {
    case at::kFloat: path = run<float>(pos, query, key, head_size, cos_sin_cache); break;
    case at::kBFloat16: path = run<c10::BFloat16>(pos, query, key, head_size, cos_sin_cache); break;
    case at::kHalf: path = run<c10::Half>(pos, query, key, head_size, cos_sin_cache); break;
    default:
      TORCH_CHECK_TYPE(false, "rotary_embedding takes float32, bfloat16 or float16, got ",
                       query.scalar_type());
  }
  count_path(path);
}

}  // namespace cbatch
