// One random draw per row of [S, V] logits on the CPU, without sorting the vocabulary: the
// sampled rows' temperature, min-p, top-k and top-p, and the draw, in a few passes over a row
// (benchmarks/NOTES.md, "Sampling at the speed of greedy").
//
// Per row, with T its temperature and m the row's largest logit:
//   1. w_i = exp((l_i - m) / T): the unnormalised probabilities, the largest exactly 1;
//   2. min-p keeps w_i >= min_p (the most likely token has w = 1);
//   3. top-k keeps w_i >= the k-th largest w among those kept, found the same way as 4's
//      (ties at the k-th value all stay, as vLLM's top-k keeps them);
//   4. top-p keeps the smallest set of the most likely tokens whose mass reaches top_p of the
//      mass kept so far: its least likely member is the largest w whose mass at or above it
//      reaches that, found by bisection on w's bits (vectorised passes over the row), no sort;
//   5. the draw: the first token in vocabulary order whose running mass (in double, over the
//      kept tokens) passes u times their total, u in [0, 1) the row's uniform.
// The caller derives u from the request's seed and position, so a request's tokens do not
// depend on its batch-mates.  cbatch/core/sampler.py's torch path is the reference: it sorts,
// and draws by the same rule from the same u.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "avx2.h"
#include "avx512.h"
#include "cpu_options.h"

namespace cbatch {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
float row_max_portable(const T* row, int64_t n) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    m = v > m ? v : m;  // NaN never wins
  }
  return m;
}

// w[i] = exp((row[i] - m) / t), exactly 0 for a banned (-inf) logit.  The division (not a
// multiplication by 1/t) keeps a temperature as small as 1e-45 exact: the largest logit gives
// 0 / t = 0, the rest -inf.
template <typename T>
void weights_portable(const T* row, int64_t n, float m, float t, float* w) {
  for (int64_t i = 0; i < n; ++i) w[i] = std::exp((static_cast<float>(row[i]) - m) / t);
}

// How much of w lies at or above t: the mass and the count of w[i] >= t (t > 0, so banned
// tokens, w = 0, never count).
struct Above {
  double mass;
  int64_t count;
};

Above above_portable(const float* w, int64_t n, float t) {
  double mass = 0.0;
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] >= t) mass += w[i], ++count;
  }
  return {mass, count};
}

#ifdef CBATCH_X86
template <typename T>
CBATCH_AVX512 float row_max_avx512(const T* row, int64_t n) {
  __m512 m = _mm512_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, avx512::load(row + i));  // NaN: skipped
  return std::max(_mm512_reduce_max_ps(m), row_max_portable(row + i, n - i));
}

template <typename T>
CBATCH_AVX512 void weights_avx512(const T* row, int64_t n, float m, float t, float* w) {
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(t);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 l = avx512::load(row + i);
    const __mmask16 banned = _mm512_cmp_ps_mask(l, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
    const __m512 x = _mm512_div_ps(_mm512_sub_ps(l, vm), vt);
    _mm512_storeu_ps(w + i, _mm512_maskz_mov_ps(~banned, avx512::exp(x)));
  }
  weights_portable(row + i, n - i, m, t, w + i);
}

template <typename T>
CBATCH_AVX2 void weights_avx2(const T* row, int64_t n, float m, float t, float* w) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(t);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 l = avx2::load(row + i);
    const __m256 kept = _mm256_cmp_ps(l, _mm256_set1_ps(kNegInf), _CMP_NEQ_OQ);
    const __m256 x = _mm256_div_ps(_mm256_sub_ps(l, vm), vt);
    _mm256_storeu_ps(w + i, _mm256_and_ps(kept, avx2::exp(x)));  // banned (-inf): exactly 0
  }
  weights_portable(row + i, n - i, m, t, w + i);
}

CBATCH_AVX512 Above above_avx512(const float* w, int64_t n, float t) {
  const __m512 vt = _mm512_set1_ps(t);
  __m512 mass = _mm512_setzero_ps();
  int64_t count = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(w + i);
    const __mmask16 at_least = _mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ);
    mass = _mm512_mask_add_ps(mass, at_least, mass, v);
    count += __builtin_popcount(at_least);
  }
  const Above tail = above_portable(w + i, n - i, t);
  return {_mm512_reduce_add_ps(mass) + tail.mass, count + tail.count};
}

// AVX2: the largest logit and the mass at or above t, 8 lanes at a time (a row of Llama 3's
// 128256 logits took 7.7 ms in the scalar loops, over up to 60 bisection passes: the double
// sum's add latency on every element; benchmarks/NOTES.md, "Sampling at the speed of
// greedy").  The mass sums in fp32 lanes, as AVX-512's does.
template <typename T>
CBATCH_AVX2 float row_max_avx2(const T* row, int64_t n) {
  __m256 m = _mm256_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(avx2::load(row + i), m);  // a NaN keeps m
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = row_max_portable(row + i, n - i);
  for (const float v : lanes) best = v > best ? v : best;
  return best;
}

CBATCH_AVX2 Above above_avx2(const float* w, int64_t n, float t) {
  const __m256 vt = _mm256_set1_ps(t);
  __m256 mass0 = _mm256_setzero_ps(), mass1 = _mm256_setzero_ps();  // two chains of adds
  int64_t count = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(w + i), v1 = _mm256_loadu_ps(w + i + 8);
    const __m256 k0 = _mm256_cmp_ps(v0, vt, _CMP_GE_OQ), k1 = _mm256_cmp_ps(v1, vt, _CMP_GE_OQ);
    mass0 = _mm256_add_ps(mass0, _mm256_and_ps(k0, v0));
    mass1 = _mm256_add_ps(mass1, _mm256_and_ps(k1, v1));
    count += __builtin_popcount(_mm256_movemask_ps(k0)) +
             __builtin_popcount(_mm256_movemask_ps(k1));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(mass0, mass1));
  const Above tail = above_portable(w + i, n - i, t);
  double mass = tail.mass;
  for (const float v : lanes) mass += v;
  return {mass, count + tail.count};
}
#endif

// The kernel's loops for one CPU: what the CPU has, picked once per call.
struct Isa {
  bool avx512, avx2;

  template <typename T>
  float max(const T* row, int64_t n) const {
#ifdef CBATCH_X86
    if constexpr (!std::is_same_v<T, c10::Half>) {  // (avx512.h has no masked fp16 load)
      if (avx512) return row_max_avx512(row, n);
    }
    if (avx2) return row_max_avx2(row, n);
#endif
    return row_max_portable(row, n);
  }

  template <typename T>
  void weights(const T* row, int64_t n, float m, float t, float* w) const {
#ifdef CBATCH_X86
    if (avx512) return weights_avx512(row, n, m, t, w);
    if (avx2) return weights_avx2(row, n, m, t, w);
#endif
    weights_portable(row, n, m, t, w);
  }

  Above above(const float* w, int64_t n, float t) const {
#ifdef CBATCH_X86
    if (avx512) return above_avx512(w, n, t);
    if (avx2) return above_avx2(w, n, t);
#endif
    return above_portable(w, n, t);
  }
};

// The largest t (a value of w) in [floor, 1] with keep(isa.above(w, t)), by bisection on the
// bits of t (a positive float's bits order as the float does): 30 passes at most.
// keep(above(w, floor)) must hold; returns floor if nothing larger does.
template <typename Keep>
float largest_threshold(const float* w, int64_t n, float floor, const Isa& isa, Keep keep) {
  uint32_t lo, hi;  // keep() holds at lo; the answer is in [lo, hi]
  const float one = 1.f;  // the largest w
  std::memcpy(&lo, &floor, 4);
  std::memcpy(&hi, &one, 4);
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    float t;
    std::memcpy(&t, &mid, 4);
    if (keep(isa.above(w, n, t))) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  float t;
  std::memcpy(&t, &lo, 4);
  return t;
}

struct RowRule {
  float temperature, top_p, min_p;
  int64_t top_k;
  double u;
};

template <typename T>
int64_t sample_row(const T* row, int64_t n, const RowRule& rule, std::vector<float>& w,
                   std::vector<float>& block_mass, const Isa& isa) {
  const float m = isa.max(row, n);
  if (m == kNegInf) return 0;  // every token banned (or NaN): nothing to draw from
  w.resize(n);
  isa.weights(row, n, m, rule.temperature, w.data());
  // min-p (the largest w is 1), and never a banned token (w = 0)
  float floor = std::max(rule.min_p, std::numeric_limits<float>::denorm_min());
  if (rule.top_k > 0 && rule.top_k < n) {  // the k-th largest w
    const int64_t k = rule.top_k;
    floor = largest_threshold(w.data(), n, floor, isa,
                              [k](const Above& a) { return a.count >= k; });
  }
  if (rule.top_p < 1.f) {  // the least likely of the most likely tokens holding top_p
    const double target = rule.top_p * isa.above(w.data(), n, floor).mass;
    floor = largest_threshold(w.data(), n, floor, isa,
                              [target](const Above& a) { return a.mass >= target; });
  }
  // the draw: the running kept mass in vocabulary order, by blocks, then within the block
  // that passes u times the total
  constexpr int64_t kBlock = 64;
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  block_mass.resize(num_blocks);
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t begin = b * kBlock;
    block_mass[b] = static_cast<float>(isa.above(w.data() + begin, std::min(kBlock, n - begin),
                                                 floor).mass);
    total += block_mass[b];
  }
  const double target = rule.u * total;
  double run = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (block_mass[b] == 0.f) continue;
    if (run + block_mass[b] <= target) {
      run += block_mass[b];
      continue;
    }
    int64_t last = -1;
    for (int64_t i = b * kBlock, end = std::min(i + kBlock, n); i < end; ++i) {
      if (w[i] >= floor) {
        run += w[i], last = i;
        if (run > target) return i;
      }
    }
    return last;  // rounding: the block's own sum passed target, its elements not quite
  }
  for (int64_t i = n - 1; i >= 0; --i)  // rounding at the very end: the last kept token
    if (w[i] >= floor) return i;
  return 0;
}

template <typename T>
CpuPath run(const at::Tensor& logits, const at::Tensor& rows, const std::vector<RowRule>& rules,
            at::Tensor& out) {
  const int64_t V = logits.size(1), stride = logits.stride(0);
  const T* data = logits.data_ptr<T>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  int64_t* result = out.data_ptr<int64_t>();
#ifdef CBATCH_X86
  const Isa isa{cpu_has_avx512(), !cpu_has_avx512() && cpu_has_avx2()};
#else
  const Isa isa{false, false};
#endif
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, block_mass;
    for (int64_t r = begin; r < end; ++r) {
      result[r] = sample_row(data + row_ids[r] * stride, V, rules[r], w, block_mass, isa);
    }
  });
  return isa.avx512 ? CpuPath::kSampleAvx512
         : isa.avx2 ? CpuPath::kSampleAvx2
                    : CpuPath::kSampleGeneric;
}

}  // namespace

at::Tensor sample_cpu(const at::Tensor& logits, const at::Tensor& rows,
                      const at::Tensor& temperature, const at::Tensor& top_k,
                      const at::Tensor& top_p, const at::Tensor& min_p,
                      const at::Tensor& uniform) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.stride(1) == 1,
                    "logits must be [S, V] with dense rows, got ", logits.sizes(), " strides ",
                    logits.strides());
  TORCH_CHECK_VALUE(logits.size(1) > 0, "sampling from an empty vocabulary");
  const int64_t R = rows.numel();
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kLong && top_k.scalar_type() == at::kLong,
                   "rows and top_k must be int64");
  TORCH_CHECK_TYPE(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat
                       && min_p.scalar_type() == at::kFloat,
                   "temperature, top_p and min_p must be float32");
  TORCH_CHECK_TYPE(uniform.scalar_type() == at::kDouble, "uniform must be float64");
  for (const at::Tensor* t : {&rows, &temperature, &top_k, &top_p, &min_p, &uniform}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() == R && t->is_contiguous(),
                      "rows, temperature, top_k, top_p, min_p and uniform must be 1-D, "
                      "contiguous, one entry per sampled row (", R, ")");
    TORCH_CHECK_VALUE(t->device().is_cpu(), "sample's tensors must be on the CPU");
  }
  at::Tensor out = at::empty({R}, rows.options());
  if (R == 0) return out;
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  std::vector<RowRule> rules(R);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK_INDEX(row_ids[r] >= 0 && row_ids[r] < logits.size(0), "row ", row_ids[r],
                      " is out of range for ", logits.size(0), " rows of logits");
    rules[r] = {temperature.data_ptr<float>()[r], top_p.data_ptr<float>()[r],
                min_p.data_ptr<float>()[r], top_k.data_ptr<int64_t>()[r],
                uniform.data_ptr<double>()[r]};
    TORCH_CHECK_VALUE(rules[r].temperature > 0.f, "sampled rows need a temperature > 0");
    TORCH_CHECK_VALUE(rules[r].u >= 0.0 && rules[r].u < 1.0, "uniforms must be in [0, 1)");
  }
  CpuPath path;
  switch (logits.scalar_type()) {
    case at::kFloat: path = run<float>(logits, rows, rules, out); break;
    case at::kBFloat16: path = run<c10::BFloat16>(logits, rows, rules, out); break;
    case at::kHalf: path = run<c10::Half>(logits, rows, rules, out); break;
    default:
      TORCH_CHECK_TYPE(false, "sample takes float32, bfloat16 or float16 logits, got ",
                       logits.scalar_type());
  }
  count_path(path);
  return out;
}

at::Tensor& apply_bitmask_cpu(at::Tensor& logits, const at::Tensor& bitmask) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.stride(1) == 1 &&
                        logits.scalar_type() == at::kFloat,
                    "logits must be float32 [S, V] with dense rows");
  TORCH_CHECK_VALUE(bitmask.dim() == 2 && bitmask.size(0) == logits.size(0) &&
                        bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt &&
                        bitmask.device().is_cpu(),
                    "bitmask must be a dense int32 [", logits.size(0), ", W] on the CPU");
  const int64_t V = logits.size(1), W = bitmask.size(1), n = std::min(V, 32 * W);
  float* data = logits.data_ptr<float>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float* x = data + s * logits.stride(0);
      const int32_t* w = words + s * W;
      bool constrained = false;
      for (int64_t i = 0; i < W; ++i) {
        if (w[i] == -1) continue;  // 32 allowed tokens: the common case, one compare
        constrained = true;
        const uint32_t allowed = static_cast<uint32_t>(w[i]);
        for (int64_t b = 0, t = 32 * i; b < 32 && t < n; ++b, ++t) {
          if (!((allowed >> b) & 1u)) x[t] = kNegInf;
        }
      }
      if (constrained) std::fill(x + n, x + V, kNegInf);  // ids past the mask: a grammar's
    }
  });
  count_path(CpuPath::kBitmaskCpu);
  return logits;
}

at::Tensor& apply_penalties_cpu(at::Tensor& logits, const at::Tensor& rows,
                                const at::Tensor& slots, const at::Tensor& counts,
                                const at::Tensor& prompt, const at::Tensor& presence,
                                const at::Tensor& frequency, const at::Tensor& repetition) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.stride(1) == 1 &&
                        logits.scalar_type() == at::kFloat,
                    "logits must be float32 [S, V] with dense rows");
  const int64_t V = logits.size(1), P = rows.numel();
  TORCH_CHECK_VALUE(counts.dim() == 2 && counts.size(1) == V && counts.is_contiguous() &&
                        counts.scalar_type() == at::kInt,
                    "counts must be a dense int32 [slots, ", V, "]");
  TORCH_CHECK_VALUE(prompt.sizes() == counts.sizes() && prompt.is_contiguous() &&
                        prompt.scalar_type() == at::kBool,
                    "prompt must be a dense bool of counts' shape");
  for (const at::Tensor* t : {&rows, &slots, &presence, &frequency, &repetition}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() == P && t->is_contiguous() &&
                          t->device().is_cpu(),
                      "rows, slots and the penalties must be dense 1-D, one per row (", P, ")");
  }
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                       presence.scalar_type() == at::kFloat &&
                       frequency.scalar_type() == at::kFloat &&
                       repetition.scalar_type() == at::kFloat,
                   "rows and slots must be int64, the penalties float32");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK_INDEX(row[p] >= 0 && row[p] < logits.size(0) && slot[p] >= 0 &&
                          slot[p] < counts.size(0),
                      "row ", row[p], " or slot ", slot[p], " out of range");
  }
  float* data = logits.data_ptr<float>();
  const int32_t* count = counts.data_ptr<int32_t>();
  const bool* in_prompt = prompt.data_ptr<bool>();
  const float *pres = presence.data_ptr<float>(), *freq = frequency.data_ptr<float>(),
              *rep = repetition.data_ptr<float>();
  // one pass per row: the repetition penalty where the token was seen (prompt or output),
  // then frequency and presence by its output count (vLLM's and transformers' rules)
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* x = data + row[p] * logits.stride(0);
      const int32_t* c = count + slot[p] * V;
      const bool* seen = in_prompt + slot[p] * V;
      const float r = rep[p], f = freq[p], e = pres[p];
      for (int64_t v = 0; v < V; ++v) {
        const int32_t n = c[v];
        float y = x[v];
        if (n > 0 || seen[v]) y = y > 0 ? y / r : y * r;
        if (n > 0) y -= f * static_cast<float>(n) + e;
        x[v] = y;
      }
    }
  });
  count_path(CpuPath::kPenaltiesCpu);
  return logits;
}

}  // namespace cbatch
