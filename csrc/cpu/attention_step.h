// The online-softmax step of the CPU attention kernels (attention.cpp) on kLanes-wide vectors,
// written once for both ISAs: attention.cpp includes this file twice, inside namespace avx512
// and inside namespace avx2, each time after defining CBATCH_STEP_TARGET (the ISA's target
// attribute); the ISA's helpers it calls (Vec, kLanes, load, exp, sum_each, lanes_sum, ...) are
// avx512.h's and avx2.h's, twins under the same names.  So the AVX2 step, which every x86 test
// machine runs, is the same code as the AVX-512 one.  Each is compiled for its ISA whatever the
// extension's baseline and chosen at run time (attention.cpp, step_for).
//
// A row's keys go kChunkKeys (16) at a time: their scores, one running-max update and one
// rescale of the row's sums, then their values.  The scores come two ways with the same bits:
// online_softmax_row takes one row over the keys as they lie (dot products, a decode token or
// a prompt row on the causal diagonal); online_softmax_rows takes up to kGroupRows rows of a
// prompt tile over the chunk's keys transposed (outer products, as a GEMM does: 12 sums in
// flight, each load of K and V shared by the rows; 1.7x the dot products' rate on a long
// prompt, NOTES.md "CPU attention kernels").  So a row's output never depends on the path it
// took or on its neighbours: decode and prefill agree bitwise, which batch invariance needs.
// fp16/bf16 K/V are widened as they are loaded (bf16: shifted into the top half of an fp32).
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

// The vectors of scores of a chunk of kChunkKeys keys (attention.cpp: a cache block's keys go
// kChunkKeys at a time through online_softmax_rows).
constexpr int kChunkVecs = static_cast<int>(kChunkKeys / kLanes);

// accumulate for kRows rows at once (online_softmax_rows), columns [d, d + kCols * kLanes):
// each row's acc = acc * correction[r] + sum over i < n of p[r][i] * v[i * stride, ...), each
// value vector loaded once for the kRows rows.
template <int kRows, int kCols, typename T>
CBATCH_STEP_TARGET CBATCH_INLINE void accumulate_rows(const float (&p)[kRows][kChunkKeys],
                                                      const float* correction,
                                                      const T* v, int64_t stride, int64_t n,
                                                      int64_t d, const StepRow* rows) {
  Vec a[kRows][kCols];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < kCols; ++j) {
      a[r][j] = mul(load(rows[r].acc + d + kLanes * j), set1(correction[r]));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    Vec vi[kCols];
#pragma GCC unroll 8
    for (int j = 0; j < kCols; ++j) vi[j] = load(v + i * stride + d + kLanes * j);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const Vec p_ri = set1(p[r][i]);
#pragma GCC unroll 8
      for (int j = 0; j < kCols; ++j) a[r][j] = fmadd(p_ri, vi[j], a[r][j]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < kCols; ++j) store(rows[r].acc + d + kLanes * j, a[r][j]);
  }
}

// The rest of a step once it has the scores of its (up to kLanes) keys: the running max m and
// sum l updated, acc rescaled and the keys' values added with their weights by kAccumulate
// (avx512's accumulate_pairs for bf16 values in the pair layout).
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

// Rows of the tile that go through online_softmax_rows together: 12 sums of scores in flight
// (AVX2: 6 rows x 2 vectors of 8 keys, with 2 of keys and 1 of the query in its 16
// registers; AVX-512: 12 rows x 1 vector of 16 keys), more than the FMA latency's worth of
// independent chains (8), so the FMAs, not their latency, set the pace.
constexpr int kGroupRows = 12 / kChunkVecs;

// The scores of a chunk of n <= kChunkKeys keys k[i * stride] for one row q (scaled, fp32),
// as dot products: key i's lane j sums q[d] k[d] over d = j, j + kLanes, ... in order, and
// sum_each adds the lanes.  This is the scores' arithmetic; outer_scores computes the same
// bits another way.
template <typename T>
CBATCH_STEP_TARGET CBATCH_INLINE void dot_scores(const float* q, const T* k, int64_t stride,
                                                 int64_t n, int64_t D,
                                                 Vec (&s)[kChunkVecs]) {
#pragma GCC unroll 2
  for (int j = 0; j < kChunkVecs; ++j) {
    s[j] = zero();
    if (kLanes * j >= n) continue;  // (no key: never read)
    const T* keys[kLanes];
    key_rows(k + kLanes * j * stride, stride, n - kLanes * j, keys);
    Vec dots[kLanes];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) dots[i] = zero();
    for (int64_t d = 0; d < D; d += kLanes) {
      const Vec qd = load(q + d);
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) dots[i] = fmadd(qd, load(keys[i] + d), dots[i]);
    }
    s[j] = sum_each(dots);
  }
}

// dot_scores' bits for kRows rows at once, from the chunk's keys transposed (kt,
// transpose_keys): keys are the lanes, so a row's q[d] times row d of kt adds element d to
// every key's sum.  Each key's kLanes partial sums (over d = j, j + kLanes, ...) are kept
// apart, then added as sum_each adds lanes (lanes_sum): the same additions in the same order.
// kRows x kChunkVecs sums in flight share each load of kt.
template <int kRows>
CBATCH_STEP_TARGET CBATCH_INLINE void outer_scores(const StepRow* rows, const float* kt,
                                                   int64_t D, Vec (&s)[kRows][kChunkVecs]) {
  Vec part[kLanes][kRows][kChunkVecs];  // [lane j][row][keys]: the sums over d = j mod kLanes
  for (int j = 0; j < kLanes; ++j) {
    Vec a[kRows][kChunkVecs];
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 2
      for (int c = 0; c < kChunkVecs; ++c) a[r][c] = zero();
    }
    for (int64_t d = j; d < D; d += kLanes) {
      Vec kd[kChunkVecs];
#pragma GCC unroll 2
      for (int c = 0; c < kChunkVecs; ++c) kd[c] = load(kt + d * kChunkKeys + kLanes * c);
#pragma GCC unroll 12
      for (int r = 0; r < kRows; ++r) {
        const Vec qd = set1(rows[r].q[d]);
#pragma GCC unroll 2
        for (int c = 0; c < kChunkVecs; ++c) a[r][c] = fmadd(qd, kd[c], a[r][c]);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 2
      for (int c = 0; c < kChunkVecs; ++c) part[j][r][c] = a[r][c];
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 2
    for (int c = 0; c < kChunkVecs; ++c) {
      Vec lanes[kLanes];
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) lanes[j] = part[j][r][c];
      s[r][c] = lanes_sum(lanes);
    }
  }
}

// The rest of the online-softmax step of kRows rows over a chunk of n <= kChunkKeys keys once
// it has their scores s: one running-max update and one rescale of acc for the chunk, then
// the values v[i * stride] of type T added.
template <int kRows, typename T>
CBATCH_STEP_TARGET CBATCH_INLINE void softmax_chunk(const StepRow* rows,
                                                    const Vec (&s)[kRows][kChunkVecs],
                                                    const T* v, int64_t stride, int64_t n,
                                                    int64_t D) {
  constexpr float kNoKey = -std::numeric_limits<float>::infinity();
  const int vecs = static_cast<int>((n + kLanes - 1) / kLanes);  // the others hold no key
  const bool full = n == kChunkKeys;  // (no lane to mask)
  float new_m[kRows];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    Vec most = full ? s[r][0] : keep_first(s[r][0], n, kNoKey);
    for (int j = 1; j < vecs; ++j) {
      most = max(most, full ? s[r][j] : keep_first(s[r][j], n - kLanes * j, kNoKey));
    }
    new_m[r] = std::max(*rows[r].m, reduce_max(most));
  }
  // every row's correction e^(m - new_m) (~0 on the first chunk, m = -inf), kLanes rows per
  // vector exp: no call to expf, which would spill the registers
  alignas(sizeof(Vec)) float correction[(kRows + kLanes - 1) / kLanes * kLanes] = {};
  if constexpr (kRows == 1) {  // (in a register: no store and reload to wait on)
    correction[0] = first(exp(set1(*rows[0].m - new_m[0])));
  } else {
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) correction[r] = *rows[r].m - new_m[r];
#pragma GCC unroll 2
    for (int r = 0; r < kRows; r += kLanes) store(correction + r, exp(load(correction + r)));
  }
  float p[kRows][kChunkKeys];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    Vec sum = zero();
    for (int j = 0; j < vecs; ++j) {
      Vec e = exp(sub(s[r][j], set1(new_m[r])));
      if (!full) e = keep_first(e, n - kLanes * j);
      store(p[r] + kLanes * j, e);
      sum = j == 0 ? e : add(sum, e);
    }
    *rows[r].l = *rows[r].l * correction[r] + reduce_add(sum);
    *rows[r].m = new_m[r];
  }
  // registers of columns per row: 12 sums in flight (8 for one row: D = 64 on AVX2)
  constexpr int kCols = std::clamp(12 / kRows, 1, 8);
  int64_t d = 0;
  for (; d + kCols * kLanes <= D; d += kCols * kLanes) {
    accumulate_rows<kRows, kCols>(p, correction, v, stride, n, d, rows);
  }
  for (; d < D; d += kLanes) accumulate_rows<kRows, 1>(p, correction, v, stride, n, d, rows);
}

// The online-softmax step for kRows query rows (each its own q, m, l and acc: a row of the
// tile for one query head) over the same chunk of n <= kChunkKeys keys (transposed in kt) and
// values v[i * stride] of type T: for the rows of a prefill tile, which share each load of K
// and V.  Each row's arithmetic is online_softmax_row's, bit for bit, whatever kRows is, so a
// row's output does not depend on which step it went through, or beside which rows; it
// depends on the keys' positions only (chunks start at multiples of kChunkKeys within each
// cache block).  Not inlined into the item loop (attention.cpp's flatten), whose registers
// would crowd out the sums' (two of them spilled cost a third of the time).
template <int kRows, typename T>
CBATCH_STEP_TARGET __attribute__((noinline)) void online_softmax_rows(
    const StepRow* rows, const float* kt, const T* v, int64_t stride, int64_t n, int64_t D) {
  Vec s[kRows][kChunkVecs];
  outer_scores<kRows>(rows, kt, D, s);
  softmax_chunk<kRows>(rows, s, v, stride, n, D);
}

// The online-softmax step of one row over a chunk of n <= kChunkKeys keys k[i * stride] and
// values v[i * stride] of type T, read as they lie (a decode token; a prefill row on the
// causal diagonal).
template <typename T>
CBATCH_STEP_TARGET void online_softmax_row(
    const StepRow& row, const T* k, const T* v, int64_t stride, int64_t n, int64_t D) {
  Vec s[1][kChunkVecs];
  dot_scores(row.q, k, stride, n, D, s[0]);
  softmax_chunk<1>(&row, s, v, stride, n, D);
}
