// The tile loop of cbatch::quantized_linear (quantized_linear.cpp), written once for both
// ISAs: quantized_linear.cpp includes this file twice, inside namespace avx512q and inside
// namespace avx2q, each time after defining CBATCH_Q_TARGET (the ISA's target attribute) and
// the ISA's wrappers this body calls: Vec / IVec, kLanes, kRows (a tile's rows), kAccRows
// (tile_rows' rows at a time over the dequantized buffer), the one-instruction helpers
// (zero, set1, set1i, load_i8, load_u8, low_nibbles, high_nibbles, to_float, fmadd, fnmadd,
// add, load_first, store_first) and the tile's geometry (vectors, vec_weights, vec_column).  So
// the AVX2 path, which every x86 test machine runs, runs this same code as the AVX-512 one.
// No include guard: it is meant to be included once per ISA.

// Group g's scales, zero points (without zeros a.zero: int4 8, int8 and mins 0) and mins (0
// without) for the V vectors at col.
template <int V>
CBATCH_Q_TARGET CBATCH_INLINE void group_scales(const QArgs& a, int64_t g, const int64_t* col,
                                                Vec* s, IVec* z, Vec* mn) {
#pragma GCC unroll 2
  for (int v = 0; v < V; ++v) {
    s[v] = load_first(a.scales + g * a.N16 + col[v], kLanes);
    z[v] = a.zeros ? load_i8(a.zeros + g * a.N16 + col[v]) : set1i(a.zero);
    mn[v] = a.mins ? load_first(a.mins + g * a.N16 + col[v], kLanes) : zero();
  }
}

// Rows [m, m + M) of the output: out plus the bias, in the lanes before N.
template <int V>
CBATCH_Q_TARGET CBATCH_INLINE void store_rows(const QArgs& a, int64_t m, int64_t M,
                                              const int64_t* col, const Vec (*out)[2]) {
  for (int v = 0; v < V; ++v) {
    const int64_t n = a.N - col[v];  // valid lanes (a vector past N has none)
    if (n <= 0) continue;
    const Vec bias = a.bias ? load_first(a.bias + col[v], n) : zero();
    for (int64_t r = 0; r < M; ++r) {
      store_first(a.out + (m + r) * a.N + col[v], add(out[r][v], bias), n);
    }
  }
}

// Rows [m, m + R) times the tile's V vectors of columns from `block` on: out = x @ W^T + bias.
template <int R, int V, int kBits, bool kSub>
CBATCH_Q_TARGET void tile(const QArgs& a, int64_t m, int64_t block) {
  Vec out[kRows][2];     // [row][vector]: the groups' scaled sums
  Vec acc[kRows][2][2];  // [row][vector][even / odd k]: this group's sums
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = zero();
  const uint8_t* w[2];
  int64_t col[2];
#pragma GCC unroll 2
  for (int v = 0; v < V; ++v) w[v] = vec_weights(a, block, v), col[v] = vec_column(block, v);
  const float* x = a.x + m * a.ldx;
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group_size, k1 = std::min(a.K, k0 + a.group_size);
    Vec s[2], mn[2];
    IVec z[2];
    group_scales<V>(a, g, col, s, z, mn);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 2; ++v) acc[r][v][0] = acc[r][v][1] = zero();
    }
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {  // a pair of k: int8, two rows of 16 bytes; int4, one
      Vec w0[2], w1[2];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        const uint8_t* p = w[v] + (kBits == 8 ? k : k / 2) * kQBlock;
        if (v < kPrefetchVectors) {
          _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
        }
        if constexpr (kBits == 8) {
          w0[v] = to_float<kSub>(load_i8(p), z[v]);
          w1[v] = to_float<kSub>(load_i8(p + kQBlock), z[v]);
        } else {
          const IVec b = load_u8(p);
          w0[v] = to_float<kSub>(low_nibbles(b), z[v]);
          w1[v] = to_float<kSub>(high_nibbles(b), z[v]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const Vec x0 = set1(x[r * a.ldx + k]), x1 = set1(x[r * a.ldx + k + 1]);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) {
          acc[r][v][0] = fmadd(x0, w0[v], acc[r][v][0]);
          acc[r][v][1] = fmadd(x1, w1[v], acc[r][v][1]);
        }
      }
    }
    if (k < k1) {  // an odd group's (or K's) last k
      Vec w0[2];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        if constexpr (kBits == 8) {
          w0[v] = to_float<kSub>(load_i8(w[v] + k * kQBlock), z[v]);
        } else {
          const IVec b = load_u8(w[v] + (k / 2) * kQBlock);
          w0[v] = to_float<kSub>(k % 2 ? high_nibbles(b) : low_nibbles(b), z[v]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const Vec x0 = set1(x[r * a.ldx + k]);
        for (int v = 0; v < V; ++v) acc[r][v][0] = fmadd(x0, w0[v], acc[r][v][0]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Vec xs = set1(a.mins ? a.xsum[(m + r) * a.groups + g] : 0.f);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        out[r][v] = fmadd(add(acc[r][v][0], acc[r][v][1]), s[v], out[r][v]);
        if (a.mins) out[r][v] = fnmadd(xs, mn[v], out[r][v]);  // W = s q - m: less m sum x
      }
    }
  }
  store_rows<V>(a, m, R, col, out);
}

// Rows [0, R) of x at k times one k's dequantized weights w (V vectors), into partial sums P.
template <int R, int V, int P>
CBATCH_Q_TARGET CBATCH_INLINE void add_k(const float* x, int64_t ldx, int64_t k, const Vec* w,
                                         Vec (*s)[2][2]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const Vec xk = set1(x[r * ldx + k]);
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) s[r][v][P] = fmadd(xk, w[v], s[r][v][P]);
  }
}

// k [c0, c1) of rows [0, R) of x times the dequantized weights buf (k - c0, vector): the fmas
// of tile()'s pair loop (and, at a group's odd end, its last k), on partial sums kept in acc.
// Each pair's even k is done for every row before its odd k, so that only one k's weights (V
// vectors) and one x wait in registers beside the sums: 3 rows at a time on AVX2's 16
// registers (12 sums), where a pair's 4 weight vectors left room for 2 (8 sums, as many fma
// chains as the FMA's latency times its pipes, and a load per fma).  Each sum's fmas keep
// their order, so the bits do not move.  Zen 3, W4A16 / W8A16 at 512-4096 rows: 50-59% ->
// 71-85% of the FMA's peak (benchmarks/NOTES.md, "Prompt GEMMs against the measured peak").
template <int R, int V>
CBATCH_Q_TARGET void accumulate(const float* x, int64_t ldx, const Vec (*buf)[2], int64_t c0,
                                int64_t c1, Vec (*acc)[2][2]) {
  Vec s[kAccRows][2][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) s[r][v][0] = acc[r][v][0], s[r][v][1] = acc[r][v][1];
  }
  int64_t k = c0;
  for (; k + 1 < c1; k += 2) {
    add_k<R, V, 0>(x, ldx, k, buf[k - c0], s);
    add_k<R, V, 1>(x, ldx, k + 1, buf[k - c0 + 1], s);
  }
  if (k < c1) add_k<R, V, 0>(x, ldx, k, buf[k - c0], s);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v][0] = s[r][v][0], acc[r][v][1] = s[r][v][1];
  }
}

// Rows [m0, m1) (at most kChunkRows) times the tile's V vectors from `block` on, for more rows
// than one tile holds: each chunk of k's weights is dequantized once (q - z as fp32, exact) into
// buf and read by every row tile, instead of once per tile.  Every output is the same fmas in
// the same order as tile()'s: the partial sums wait in acc between chunks and the groups' scaled
// sums in out, stored and reloaded exactly, so a row's result does not depend on M.
template <int V, int kBits, bool kSub>
CBATCH_Q_TARGET void tile_rows(const QArgs& a, int64_t m0, int64_t m1, int64_t block) {
  const int64_t M = m1 - m0;
  Vec out[kChunkRows][2];
  Vec acc[kChunkRows][2][2];
  Vec buf[kChunkK][2];
  const uint8_t* w[2];
  int64_t col[2];
#pragma GCC unroll 2
  for (int v = 0; v < V; ++v) w[v] = vec_weights(a, block, v), col[v] = vec_column(block, v);
  for (int64_t m = 0; m < M; ++m) out[m][0] = out[m][1] = zero();
  const float* x = a.x + m0 * a.ldx;
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t k0 = g * a.group_size, k1 = std::min(a.K, k0 + a.group_size);
    Vec s[2], mn[2];
    IVec z[2];
    group_scales<V>(a, g, col, s, z, mn);
    for (int64_t m = 0; m < M; ++m) {
      for (int v = 0; v < 2; ++v) acc[m][v][0] = acc[m][v][1] = zero();
    }
    for (int64_t c0 = k0; c0 < k1; c0 += kChunkK) {  // kChunkK is even: pairs stay tile()'s
      const int64_t c1 = std::min(k1, c0 + kChunkK);
      for (int64_t k = c0; k < c1; k += 2) {
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) {
          const uint8_t* p = w[v] + (kBits == 8 ? k : k / 2) * kQBlock;
          if (v < kPrefetchVectors) {
            _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
          }
          if constexpr (kBits == 8) {
            buf[k - c0][v] = to_float<kSub>(load_i8(p), z[v]);
            if (k + 1 < c1) buf[k - c0 + 1][v] = to_float<kSub>(load_i8(p + kQBlock), z[v]);
          } else {  // c0 and k are even: k's byte holds k and k + 1
            const IVec b = load_u8(p);
            buf[k - c0][v] = to_float<kSub>(low_nibbles(b), z[v]);
            if (k + 1 < c1) buf[k - c0 + 1][v] = to_float<kSub>(high_nibbles(b), z[v]);
          }
        }
      }
      int64_t m = 0;
      for (; m + kAccRows <= M; m += kAccRows) {
        accumulate<kAccRows, V>(x + m * a.ldx, a.ldx, buf, c0, c1, acc + m);
      }
      switch (M - m) {  // < kAccRows left
        case 3: accumulate<3 < kAccRows ? 3 : 1, V>(x + m * a.ldx, a.ldx, buf, c0, c1, acc + m);
                break;
        case 2: accumulate<2 < kAccRows ? 2 : 1, V>(x + m * a.ldx, a.ldx, buf, c0, c1, acc + m);
                break;
        case 1: accumulate<1, V>(x + m * a.ldx, a.ldx, buf, c0, c1, acc + m); break;
        default: break;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const Vec xs = set1(a.mins ? a.xsum[(m0 + m) * a.groups + g] : 0.f);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        out[m][v] = fmadd(add(acc[m][v][0], acc[m][v][1]), s[v], out[m][v]);
        if (a.mins) out[m][v] = fnmadd(xs, mn[v], out[m][v]);  // W = s q - m: less m sum x
      }
    }
  }
  store_rows<V>(a, m0, M, col, out);
}

// Rows [m0, m1) times the V vectors from `block` on: more than a tile's rows through
// tile_rows (the weights dequantized once for all of them), else one tile.
template <int V, int kBits, bool kSub>
void rows(const QArgs& a, int64_t block, int64_t m0, int64_t m1) {
  if (m1 - m0 > kRows) return tile_rows<V, kBits, kSub>(a, m0, m1, block);
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows) tile<kRows, V, kBits, kSub>(a, m, block);
  const int64_t rest = m1 - m;  // < kRows
  if constexpr (kRows > 3) {
    if (rest == 3) return tile<3, V, kBits, kSub>(a, m, block);
  }
  if constexpr (kRows > 2) {
    if (rest == 2) return tile<2, V, kBits, kSub>(a, m, block);
  }
  if (rest == 1) tile<1, V, kBits, kSub>(a, m, block);
}

// One work item: the blocks from `block` on that one tile's vectors cover.
struct Isa {
  static constexpr int64_t kItemBlocks = kBlocksPerItem;
  template <int kBits, bool kSub>
  static void item(const QArgs& a, int64_t block, int64_t blocks, int64_t m0, int64_t m1) {
    if (vectors(block, blocks) == 2) {
      rows<2, kBits, kSub>(a, block, m0, m1);
    } else {
      rows<1, kBits, kSub>(a, block, m0, m1);
    }
  }
};
