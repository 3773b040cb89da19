// The online-softmax step of the CPU attention kernels (attention.cpp) on kLanes-wide vectors,
// written once for both ISAs: attention.cpp includes this file twice, inside namespace avx512
// and inside namespace avx2, each time after defining CBATCH_STEP_TARGET (the ISA's target
// attribute); the ISA's helpers it calls (Vec, kLanes, load, exp, sum_each, keep_first, ...)
// are avx512.h's and avx2.h's, twins under the same names.  So the AVX2 step, which every x86
// test machine runs, is the same code as the AVX-512 one.  Each is compiled for its ISA
// whatever the extension's baseline and chosen at run time (attention.cpp, step_for).  It reads
// fp16/bf16 K/V in place, widening kLanes elements per load (bf16: shift into the top half of
// an fp32), so no block is copied; the scores of up to kLanes keys go through one vector exp.
// Needs D % kLanes == 0.  No include guard: it is meant to be included once per ISA.

// acc[0, kLanes * kRegs) = acc * correction + sum over i < n of p[i] * v[i * stride, ...): the
// kRegs registers of acc are independent chains of FMAs over the keys (one register's chain of
// n dependent FMAs would wait on the FMA latency at every key).  Each element adds its keys in
// the same order whatever kRegs is.
template <int kRegs, typename T>
CBATCH_STEP_TARGET CBATCH_INLINE void accumulate(const float* p, const T* v, int64_t stride,
                                                 int64_t n, float correction, float* acc) {
  Vec a[kRegs];
#pragma GCC unroll 8
  for (int j = 0; j < kRegs; ++j) a[j] = mul(load(acc + kLanes * j), set1(correction));
  for (int64_t i = 0; i < n; ++i) {
    const Vec p_i = set1(p[i]);
#pragma GCC unroll 8
    for (int j = 0; j < kRegs; ++j) a[j] = fmadd(p_i, load(v + i * stride + kLanes * j), a[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < kRegs; ++j) store(acc + kLanes * j, a[j]);
}

// accumulate over all D columns: 8 registers at a time, then the last D % (8 * kLanes) in one
// call of as many registers.
template <typename T>
CBATCH_STEP_TARGET CBATCH_INLINE void accumulate_columns(const float* p, const T* v,
                                                         int64_t stride, int64_t n, int64_t D,
                                                         float correction, float* acc) {
  int64_t d = 0;
  for (; d + 8 * kLanes <= D; d += 8 * kLanes) {
    accumulate<8>(p, v + d, stride, n, correction, acc + d);
  }
  switch ((D - d) / kLanes) {
    case 7: return accumulate<7>(p, v + d, stride, n, correction, acc + d);
    case 6: return accumulate<6>(p, v + d, stride, n, correction, acc + d);
    case 5: return accumulate<5>(p, v + d, stride, n, correction, acc + d);
    case 4: return accumulate<4>(p, v + d, stride, n, correction, acc + d);
    case 3: return accumulate<3>(p, v + d, stride, n, correction, acc + d);
    case 2: return accumulate<2>(p, v + d, stride, n, correction, acc + d);
    case 1: return accumulate<1>(p, v + d, stride, n, correction, acc + d);
    default: return;
  }
}

// The rest of a step once it has the scores of its (up to kLanes) keys: the running max m and
// sum l updated, acc rescaled and the keys' values added with their weights by kAccumulate
// (accumulate_columns, or avx512's accumulate_pairs for bf16 values in the pair layout).
template <auto kAccumulate, typename T>
CBATCH_STEP_TARGET CBATCH_INLINE void add_keys(Vec scores, int64_t count, const T* v,
                                               int64_t stride, int64_t D, float& m, float& l,
                                               float* acc) {
  alignas(sizeof(Vec)) float p[kLanes];
  scores = keep_first(scores, count, -std::numeric_limits<float>::infinity());
  const float new_m = std::max(m, reduce_max(scores));
  const float correction = std::exp(m - new_m);  // 0 on the first block (m = -inf)
  const Vec e = keep_first(exp(sub(scores, set1(new_m))), count);
  l = l * correction + reduce_add(e);
  store(p, e);
  kAccumulate(p, v, stride, count, D, correction, acc);
  m = new_m;
}

// The kLanes keys of a block (the last one repeated past its count, masked out of the scores).
template <typename T>
CBATCH_STEP_TARGET CBATCH_INLINE void key_rows(const T* k, int64_t stride, int64_t count,
                                               const T* (&keys)[kLanes]) {
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) keys[i] = k + std::min<int64_t>(i, count - 1) * stride;
}

// The online-softmax step for keys k[i * stride] and values v[i * stride] of type T, i < n,
// kLanes keys at a time: their dot products accumulate in kLanes registers, kLanes columns of
// q (scaled, fp32) at a time.
template <typename T>
CBATCH_STEP_TARGET void online_softmax_step(const float* q, const T* k, const T* v,
                                            int64_t stride, int64_t n, int64_t D, float& m,
                                            float& l, float* acc) {
  for (int64_t i0 = 0; i0 < n; i0 += kLanes, k += kLanes * stride, v += kLanes * stride) {
    const int64_t count = std::min<int64_t>(kLanes, n - i0);
    const T* keys[kLanes];
    key_rows(k, stride, count, keys);
    Vec dots[kLanes];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) dots[i] = zero();
    for (int64_t d = 0; d < D; d += kLanes) {
      const Vec qd = load(q + d);
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) dots[i] = fmadd(qd, load(keys[i] + d), dots[i]);
    }
    add_keys<accumulate_columns<T>>(sum_each(dots), count, v, stride, D, m, l, acc);
  }
}
