/* attention.h -- scaled dot-product attention for CPU, forward and backward, as ONNX Runtime
 * custom ops (float32): torch's flash attention for CPU (out and each row's logsumexp; the
 * gradients from those), computed by ort_dynamo's own kernels.
 *
 * Written out, attention is batched products of a head's blocks (128 x 64 at the benchmark
 * models' sizes) on ORT's GEMM, plus softmax passes over [batch, heads, q, kv] in memory. Here
 * one task takes a key head and the query heads it serves (backward: one, or a group under
 * grouped-query attention) or a block of a head's query rows (forward) and does every step in
 * cache: the products are register tiles of 6 rows x 64 columns (6 x 16 on AVX2:
 * attention_avx2.h) that read one operand in rows and broadcast the other's elements (so
 * either operand may be read transposed), the key and value blocks transposed once per task;
 * the probabilities of a block of rows never leave the task. Backward recomputes them from the
 * logsumexp, as flash attention's does. The arithmetic: s = q k^T * scale (+ mask), p = exp(s -
 * max) / sum; dp = dO v^T, ds = p (dp - rowsum(dO * out)) * scale. A row with every key masked
 * gives zeros (out, its gradients) and a logsumexp of -inf. A generated unit
 * (ort_dynamo/_op_kernels.py) instantiates PW_ATTENTION per head size, causality, mask type,
 * scale and the operands' layout.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_ATTENTION_H
#define ORT_DYNAMO_ATTENTION_H
#include "pointwise.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

typedef float pw_att_v __attribute__((vector_size(64), aligned(4)));
typedef int32_t pw_att_vi __attribute__((vector_size(64), aligned(4)));
#define PW_ATT_INLINE static inline __attribute__((always_inline))
/* Rows of a product's register tile: pw_att_product's tiles, and the causal skips per tile that
 * pw_att_row_cols must cover, go by it. */
#define PW_ATT_TILE 6

#if defined(__AVX512F__)
/* Vectors of 16 floats a tile is wide: 6 x 4 accumulators fill 24 of AVX-512's 32 registers. */
#define PW_ATT_TILE_VECS 4
#else
/* AVX2 has 16 registers of 8 floats: 6 rows x 16 floats is 12 of them, the widest tile that does
 * not spill (6 x 64 needs 48: with the stack traffic, 9x eager's attention). */
#define PW_ATT_TILE_VECS 1
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The products' tiles and the rows' softmax passes in AVX2 intrinsics: GCC keeps this file's
 * 64-byte vectors on the stack of an AVX2 target, a load and a store around each operation. */
#define PW_ATT_AVX2 1
#include "attention_avx2.h"
#endif

/* a * b + c, fused where the target has it (the flags keep the compiler from contracting). */
PW_ATT_INLINE pw_att_v pw_att_fma(pw_att_v a, pw_att_v b, pw_att_v c) {
#if defined(__AVX512F__)
  return (pw_att_v)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

/* *p in every lane: from memory on AVX-512 (a load port; a register broadcast would take the
 * port one of the two FMA units sits on). */
PW_ATT_INLINE pw_att_v pw_att_broadcast(const float* p) {
#if defined(__AVX512F__)
  return (pw_att_v)_mm512_set1_ps(*p);
#else
  return (pw_att_v){0} + *p;
#endif
}

#if !defined(PW_ATT_AVX2) /* else attention_avx2.h's */
/* C[r][0:16V] = (add ? C : 0) + sum_k X(r, k) * Y[k][0:16V] for r < R: X's elements broadcast
 * (at r * xi + k * xk, so X may be read transposed), Y's rows loaded. R and V constants. */
PW_ATT_INLINE void pw_att_tile(const int R, const int V, int64_t K, const float* restrict x, int64_t xi, int64_t xk,
                               const float* restrict y, int64_t ys, float* restrict c, int64_t cs, int add) {
  pw_att_v acc[PW_ATT_TILE][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = add ? *(const pw_att_v*)(c + r * cs + 16 * v) : (pw_att_v){0};
  for (int64_t k = 0; k < K; ++k) {
    pw_att_v yv[4];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) yv[v] = *(const pw_att_v*)(y + k * ys + 16 * v);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const pw_att_v xr = pw_att_broadcast(x + r * xi + k * xk);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = pw_att_fma(xr, yv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) *(pw_att_v*)(c + r * cs + 16 * v) = acc[r][v];
}
#endif

#define PW_ATT_TILE_ROWS(R)                                                                                   \
  static void pw_att_tile_##R(int V, int64_t K, const float* x, int64_t xi, int64_t xk, const float* y,        \
                              int64_t ys, float* c, int64_t cs, int add) {                                    \
    /* V <= PW_ATT_TILE_VECS: wider tiles are not compiled where they would spill */                        \
    if (PW_ATT_TILE_VECS >= 4 && V == 4)                                                                      \
      pw_att_tile(R, 4, K, x, xi, xk, y, ys, c, cs, add);                                                     \
    else if (PW_ATT_TILE_VECS >= 3 && V == 3)                                                                 \
      pw_att_tile(R, 3, K, x, xi, xk, y, ys, c, cs, add);                                                     \
    else if (PW_ATT_TILE_VECS >= 2 && V == 2)                                                                 \
      pw_att_tile(R, 2, K, x, xi, xk, y, ys, c, cs, add);                                                     \
    else                                                                                                      \
      pw_att_tile(R, 1, K, x, xi, xk, y, ys, c, cs, add);                                                     \
  }
PW_ATT_TILE_ROWS(1)
PW_ATT_TILE_ROWS(2)
PW_ATT_TILE_ROWS(3)
PW_ATT_TILE_ROWS(4)
PW_ATT_TILE_ROWS(5)
PW_ATT_TILE_ROWS(6)

/* The row stride of a buffer of n columns: whole vectors, and one more, so that rows are not a
 * multiple of 4 KiB apart (1024 keys: the rows a tile reads at once would share a few cache sets). */
static inline int64_t pw_att_whole(int64_t n) { return (n + 15) & ~(int64_t)15; } /* whole vectors */
static inline int64_t pw_att_stride(int64_t n) { return pw_att_whole(n) + 16; }
/* Row tile (R rows from row i) of one product: rows of 1-6, columns from w, V vectors wide. */
static void pw_att_tile_rows(int R, int V, int64_t K, const float* x, int64_t xi, int64_t xk, const float* y,
                             int64_t ys, float* c, int64_t cs, int add) {
  switch (R) {
    case 6: pw_att_tile_6(V, K, x, xi, xk, y, ys, c, cs, add); break;
    case 5: pw_att_tile_5(V, K, x, xi, xk, y, ys, c, cs, add); break;
    case 4: pw_att_tile_4(V, K, x, xi, xk, y, ys, c, cs, add); break;
    case 3: pw_att_tile_3(V, K, x, xi, xk, y, ys, c, cs, add); break;
    case 2: pw_att_tile_2(V, K, x, xi, xk, y, ys, c, cs, add); break;
    default: pw_att_tile_1(V, K, x, xi, xk, y, ys, c, cs, add); break;
  }
}

/* What a product skips, per tile of rows i..i+R-1, by `limit` (pw_att_row_limits: query row r
 * attends to keys below limit[r], rising with r): PW_ATT_COLS the columns (keys) past the
 * tile's last row's limit, in whole vectors; PW_ATT_DEPTH the depth (keys) past it; PW_ATT_FROM
 * (rows are keys, depth is query rows) the query rows that attend to none of the tile's keys,
 * whose probabilities are 0. */
enum { PW_ATT_COLS, PW_ATT_DEPTH, PW_ATT_FROM };

/* C[M x W] = (add ? C : 0) + X(M x K) Y[K x W], W a multiple of 16; `skip` and `limit` as above. */
static void pw_att_product(int64_t M, int64_t W, int64_t K, const float* x, int64_t xi, int64_t xk, const float* y,
                           int64_t ys, float* c, int64_t cs, int add, int skip, const int64_t* limit) {
  for (int64_t w = 0; w < W; w += 16 * PW_ATT_TILE_VECS) {
    int64_t k0 = 0;
    for (int64_t i = 0; i < M; i += PW_ATT_TILE) {
      const int R = M - i >= PW_ATT_TILE ? PW_ATT_TILE : (int)(M - i);
      int64_t width = W, k1 = K;
      if (skip == PW_ATT_COLS) {
        const int64_t end = pw_att_whole(limit[i + R - 1]);
        width = end < W ? end : W;
      } else if (skip == PW_ATT_DEPTH) {
        k1 = limit[i + R - 1] < K ? limit[i + R - 1] : K;
      } else {
        while (k0 < K && limit[k0] <= i) ++k0; /* tiles of keys in order: k0 only rises */
      }
      if (w >= width || (k0 >= k1 && add)) continue;
      const int V = width - w >= 16 * PW_ATT_TILE_VECS ? PW_ATT_TILE_VECS : (int)((width - w) / 16);
      pw_att_tile_rows(R, V, k1 - k0, x + i * xi + k0 * xk, xi, xk, y + k0 * ys + w, ys, c + i * cs + w, cs, add);
    }
  }
}

/* The columns row r's softmax must cover: its tile's keys (pw_att_product's PW_ATT_COLS) and a
 * tile of keys past them (PW_ATT_FROM reads up to 5 keys past a row's last), in whole vectors,
 * at most np. */
PW_ATT_INLINE int64_t pw_att_row_cols(const int64_t* limit, int64_t r, int64_t rows, int64_t np) {
  const int64_t end = r / PW_ATT_TILE * PW_ATT_TILE + PW_ATT_TILE; /* past r's tile */
  const int64_t last = (end < rows ? end : rows) - 1;
  const int64_t cols = pw_att_whole(limit[last]) + 16;
  return cols < np ? cols : np;
}

/* Two vectors' lanes picked by constant indices (0-15: a, 16-31: b). */
#if defined(__clang__) || __GNUC__ >= 12
#define PW_ATT_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PW_ATT_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (pw_att_vi){__VA_ARGS__})
#endif

/* The lanes pw_att_transpose16 takes for blocks of S lanes: the low and the high half. */
#define PW_ATT_LANES_8_0 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define PW_ATT_LANES_8_1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define PW_ATT_LANES_4_0 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define PW_ATT_LANES_4_1 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define PW_ATT_LANES_2_0 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define PW_ATT_LANES_2_1 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define PW_ATT_LANES_1_0 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define PW_ATT_LANES_1_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31

/* Transposes 16 rows of 16 floats in place: by blocks of 8, 4, 2, 1 lanes, off-diagonal ones swapped. */
PW_ATT_INLINE void pw_att_transpose16(pw_att_v* r) {
#define PW_ATT_SWAP(S)                                                   \
  for (int i = 0; i < 16; ++i)                                           \
    if (!(i & (S))) {                                                    \
      const pw_att_v a = r[i], b = r[i + (S)];                           \
      r[i] = PW_ATT_SHUFFLE(a, b, PW_ATT_LANES_##S##_0);                 \
      r[i + (S)] = PW_ATT_SHUFFLE(a, b, PW_ATT_LANES_##S##_1);           \
    }
  PW_ATT_SWAP(8)
  PW_ATT_SWAP(4)
  PW_ATT_SWAP(2)
  PW_ATT_SWAP(1)
#undef PW_ATT_SWAP
}

/* The keys rows up to `end` (exclusive) attend to: causal, the first `end`; else all N. */
static inline int64_t pw_att_keys(int causal, int64_t end, int64_t N) { return causal && end < N ? end : N; }

#if !defined(PW_ATT_AVX2) /* else attention_avx2.h's */
/* out[d * ld + j] = in[j * rs + d] for j < n, 0 up to np (a multiple of 16); D a multiple of 16. */
static void pw_att_transpose(const float* restrict in, int64_t rs, int64_t n, int64_t D, float* restrict out,
                             int64_t np, int64_t ld) {
  for (int64_t j0 = 0; j0 < np; j0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      pw_att_v r[16];
      for (int j = 0; j < 16; ++j) r[j] = j0 + j < n ? *(const pw_att_v*)(in + (j0 + j) * rs + d0) : (pw_att_v){0};
      pw_att_transpose16(r);
      for (int d = 0; d < 16; ++d) *(pw_att_v*)(out + (d0 + d) * ld + j0) = r[d];
    }
}
#endif

PW_ATT_INLINE pw_att_v pw_att_select(pw_att_vi m, pw_att_v a, pw_att_v b) {
  return (pw_att_v)(((pw_att_vi)a & m) | ((pw_att_vi)b & ~m));
}
/* Lane max and sum by halves (lane 0 of the last step holds the result). */
#define PW_ATT_HALVES(v, STEP)                                                                        \
  STEP(v, PW_ATT_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));                \
  STEP(v, PW_ATT_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));                      \
  STEP(v, PW_ATT_SHUFFLE(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));                      \
  STEP(v, PW_ATT_SHUFFLE(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0))
#define PW_ATT_MAX_STEP(v, other) v = pw_att_select((other) > v, (other), v)
#define PW_ATT_SUM_STEP(v, other) v += (other)
PW_ATT_INLINE float pw_att_max(pw_att_v v) {
  PW_ATT_HALVES(v, PW_ATT_MAX_STEP);
  return v[0];
}
PW_ATT_INLINE float pw_att_sum(pw_att_v v) {
  PW_ATT_HALVES(v, PW_ATT_SUM_STEP);
  return v[0];
}
/* e^x of scores less their row's max (x <= 0, -inf, NaN): pw_expf's reduction and polynomial,
 * its multiply-adds fused on AVX-512 (half the operations; attention is eager's fused kernel, not
 * op-by-op arithmetic to match), and neither overflow nor its clamp. */
PW_ATT_INLINE pw_att_v pw_att_exp(pw_att_v x) {
#if defined(__AVX512F__)
  const __m512 v = (__m512)x, lo = _mm512_set1_ps(PW_EXP_LN_FLT_MIN);
  const __m512 c = _mm512_max_ps(v, lo); /* NaN: lo, the result replaced below */
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(PW_EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(PW_EXP_LN2_HI), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(PW_EXP_LN2_LO), r);
  __m512 p = _mm512_set1_ps(PW_EXP_P5);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(PW_EXP_P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(PW_EXP_P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(PW_EXP_P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(PW_EXP_P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(PW_EXP_P0));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  /* c >= ln FLT_MIN: n >= -126, 2^n a normal float */
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(v, lo, _CMP_LT_OQ), _mm512_setzero_ps());
  return (pw_att_v)_mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
#else
  pw_att_v y;
  for (int l = 0; l < 16; ++l) y[l] = pw_expf(x[l]);
  return y;
#endif
}

static const float pw_att_lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* A [batch, heads, length, D] operand, its rows of D apart by `row`: [B, H, S, D] in memory, or
 * [B, S, H, D] (the heads still in a projection's rows: no Transpose before or after). */
typedef struct PwAttOperand {
  float* data;
  int64_t batch, head, row; /* element strides */
} PwAttOperand;

PW_ATT_INLINE float* pw_att_rows(const PwAttOperand* o, int64_t heads, int64_t head) {
  return o->data + head / heads * o->batch + head % heads * o->head;
}

/* The mask, broadcast to [batch, heads, q, kv]: element strides per axis (0 = broadcast). */
typedef struct PwAttention {
  PwAttOperand q, k, v, grad, out, y, gq, gk, gv;
  const float* lse;
  float* y_lse;
  const void* mask;
  int64_t heads, M, N, mask_strides[4];
  int64_t kv_heads, group; /* key and value heads; query heads per key head (grouped-query attention) */
  int64_t blocks, items, items_per_task;
} PwAttention;

#define PW_ATT_ROWS 64 /* query rows a forward task takes at once */

#if !defined(PW_ATT_AVX2) /* else attention_avx2.h's */
/* Row s[0:np] of the scores of query row i (an absolute index), scaled and masked in place:
 * keys from n on, masked keys (the causal or the input mask) -inf. Returns the row's max, NaN if
 * a score is NaN (as eager's row then is; a max of -inf means every key masked). */
PW_ATT_INLINE float pw_att_scores(float* restrict s, int64_t np, int64_t n, const void* mask_row, int64_t mask_step,
                                  int mask_kind, float scale) {
  const pw_att_v lanes = *(const pw_att_v*)pw_att_lanes, minus_inf = (pw_att_v){0} - INFINITY;
  pw_att_v peak = minus_inf;
  pw_att_vi nan = (pw_att_vi){0};
  int64_t j = 0;
  for (; j < n; j += 16) {
    pw_att_v x = *(pw_att_v*)(s + j) * scale;
    if (mask_kind == 1) {
      const float* m = (const float*)mask_row;
      pw_att_v add;
      if (mask_step == 1 && j + 16 <= n)
        add = *(const pw_att_v*)(m + j);
      else
        for (int l = 0; l < 16; ++l) add[l] = j + l < n ? m[(j + l) * mask_step] : 0.0f;
      x = x + add;
    } else if (mask_kind == 2) {
      const uint8_t* m = (const uint8_t*)mask_row;
      pw_att_vi keep;
      for (int l = 0; l < 16; ++l) keep[l] = j + l < n && m[(j + l) * mask_step] ? -1 : 0;
      x = pw_att_select(keep, x, minus_inf);
    }
    x = pw_att_select(lanes + (float)j < (float)n, x, minus_inf);
    *(pw_att_v*)(s + j) = x;
    peak = pw_att_select(x > peak, x, peak);
    nan |= x != x;
  }
  for (; j < np; j += 16) *(pw_att_v*)(s + j) = minus_inf; /* past the keys: neither read nor masked */
  for (int l = 0; l < 16; ++l)
    if (nan[l]) return NAN;
  return pw_att_max(peak);
}

/* row[j] = e^(row[j] - peak) for j < nr (whole vectors); returns their sum. */
PW_ATT_INLINE float pw_att_exp_row(float* restrict row, int64_t nr, float peak) {
  pw_att_v sums = (pw_att_v){0};
  for (int64_t j = 0; j < nr; j += 16) {
    const pw_att_v e = pw_att_exp(*(pw_att_v*)(row + j) - peak);
    *(pw_att_v*)(row + j) = e;
    sums += e;
  }
  return pw_att_sum(sums);
}

/* sum of a[d] * b[d], d < D (whole vectors). */
PW_ATT_INLINE float pw_att_dot(const float* restrict a, const float* restrict b, int64_t D) {
  pw_att_v dots = (pw_att_v){0};
  for (int64_t d = 0; d < D; d += 16) dots = pw_att_fma(*(const pw_att_v*)(a + d), *(const pw_att_v*)(b + d), dots);
  return pw_att_sum(dots);
}

/* Backward of a row's softmax, j < nr (whole vectors): row (its scores) becomes p = e^(s - lse),
 * drow (dp) becomes ds = p (dp - di) scale. */
PW_ATT_INLINE void pw_att_grad_row(float* restrict row, float* restrict drow, int64_t nr, float lse, float di,
                                   float scale) {
  const pw_att_v zero = (pw_att_v){0};
  for (int64_t j = 0; j < nr; j += 16) {
    const pw_att_v p = pw_att_exp(*(pw_att_v*)(row + j) - lse); /* masked: exp(-inf) = 0 */
    *(pw_att_v*)(row + j) = p;
    /* Past the tile's keys dp was not computed: what is there must not reach ds. */
    *(pw_att_v*)(drow + j) = pw_att_select(p != zero, p * (*(pw_att_v*)(drow + j) - di) * scale, zero);
  }
}
#endif

PW_ATT_INLINE const void* pw_att_mask_row(const PwAttention* a, int64_t head, int64_t i, int mask_kind) {
  if (!mask_kind) return NULL;
  const int64_t b = head / a->heads, h = head % a->heads;
  const int64_t at = b * a->mask_strides[0] + h * a->mask_strides[1] + i * a->mask_strides[2];
  return mask_kind == 1 ? (const void*)((const float*)a->mask + at) : (const void*)((const uint8_t*)a->mask + at);
}

/* keys less the mask row's last ones that are -inf (element `step` apart): by vectors where
 * they are adjacent, a causal mask's row end is found in a few loads. */
PW_ATT_INLINE int64_t pw_att_mask_end(const float* m, int64_t keys, int64_t step) {
  if (step == 1)
    for (; keys >= 16; keys -= 16) {
      const pw_att_v v = *(const pw_att_v*)(m + keys - 16);
#if defined(__AVX512F__)
      if (_mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ)) break;
#else
      int all = 1;
      for (int l = 0; l < 16; ++l) all &= v[l] == -INFINITY;
      if (!all) break;
#endif
    }
  while (keys > 0 && m[(keys - 1) * step] == -INFINITY) --keys;
  return keys;
}

/* limit[r]: the keys query row i0 + r (r < rows) of `head` attends to are below it: causal, i0 +
 * r + 1; a mask's last masked keys (-inf, false: a causal mask given as a mask, a padding mask)
 * are left out too. At most n. Returns the largest; if the limits do not rise with the row
 * (pw_att_product's skips need them rising), the mask's are not taken. */
PW_ATT_INLINE int64_t pw_att_row_limits(const PwAttention* a, int64_t head, int64_t i0, int64_t rows, int causal,
                                        int mask_kind, int64_t n, int64_t* limit) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t keys = pw_att_keys(causal, i0 + r + 1, n);
    if (mask_kind == 1) {
      keys = pw_att_mask_end((const float*)pw_att_mask_row(a, head, i0 + r, mask_kind), keys, a->mask_strides[3]);
    } else if (mask_kind == 2) {
      const uint8_t* m = (const uint8_t*)pw_att_mask_row(a, head, i0 + r, mask_kind);
      while (keys > 0 && !m[(keys - 1) * a->mask_strides[3]]) --keys;
    }
    limit[r] = keys;
    if (r > 0 && keys < limit[r - 1]) { /* the mask's ends do not rise: its keys all read */
      for (int64_t j = 0; j < rows; ++j) limit[j] = pw_att_keys(causal, i0 + j + 1, n);
      return n;
    }
  }
  return rows > 0 ? limit[rows - 1] : 0;
}

/* Forward of rows [i0, i0 + rows) of one head. kt: D rows, s: PW_ATT_ROWS rows, of the keys'
 * pw_att_stride at most. */
PW_ATT_INLINE void pw_att_forward_block(const PwAttention* a, int64_t head, int64_t i0, int64_t rows, const int D,
                                        const int causal, const int mask_kind, const float scale, float* kt,
                                        float* s) {
  const int64_t M = a->M, N = a->N, H = a->heads;
  /* The block's keys stop after its last row's (causal, or masked after it). */
  int64_t limit[PW_ATT_ROWS];
  const int64_t n_block = pw_att_row_limits(a, head, i0, rows, causal, mask_kind, pw_att_keys(causal, i0 + rows, N),
                                            limit);
  const int64_t np = pw_att_whole(n_block), ld = pw_att_stride(n_block);
  const int64_t qs = a->q.row, ks = a->k.row, vs = a->v.row, ys = a->y.row;
  float inverse[PW_ATT_ROWS];
  const int64_t kv_head = head / H * a->kv_heads + head % H / a->group;
  const float *q = pw_att_rows(&a->q, H, head) + i0 * qs, *k = pw_att_rows(&a->k, a->kv_heads, kv_head);
  const float* v = pw_att_rows(&a->v, a->kv_heads, kv_head);
  float *y = pw_att_rows(&a->y, H, head) + i0 * ys, *lse = a->y_lse + head * M + i0;
  pw_att_transpose(k, ks, n_block, D, kt, np, ld);
  pw_att_product(rows, np, D, q, qs, 1, kt, ld, s, ld, 0, PW_ATT_COLS, limit);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    /* Keys from limit[r] on are masked anyway; past the tile's, s was not computed. */
    const int64_t n = limit[r], nr = pw_att_row_cols(limit, r, rows, np);
    const float peak = pw_att_scores(row, nr, n, pw_att_mask_row(a, head, i0 + r, mask_kind),
                                     a->mask_strides[3], mask_kind, scale);
    if (peak == -INFINITY) { /* no key to attend to */
      for (int64_t j = 0; j < nr; ++j) row[j] = 0.0f;
      inverse[r] = 0.0f;
      lse[r] = -INFINITY;
      continue;
    }
    const float sum = pw_att_exp_row(row, nr, peak);
    inverse[r] = 1.0f / sum; /* applied to the row's output: D values, not the row's keys */
    lse[r] = peak + logf(sum);
  }
  pw_att_product(rows, D, n_block, s, ld, 1, v, vs, y, ys, 0, PW_ATT_DEPTH, limit);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) y[r * ys + d] *= inverse[r];
}

/* Backward of one key and value head and the query heads that read it (one, or a group):
 * the key and value gradients summed over them. kt, vt: D rows; s, dp: PW_ATT_ROWS rows; of the
 * keys' pw_att_stride. */
PW_ATT_INLINE void pw_att_backward_head(const PwAttention* a, int64_t kv_head, const int D, const int causal,
                                        const int mask_kind, const float scale, float* kt, float* vt, float* s,
                                        float* dp) {
  const int64_t M = a->M, N = a->N, H = a->heads, np_all = pw_att_whole(N), ld_all = pw_att_stride(N);
  const int64_t qs = a->q.row, ks = a->k.row, vs = a->v.row, gs = a->grad.row, os = a->out.row;
  const int64_t gqs = a->gq.row, gks = a->gk.row, gvs = a->gv.row;
  const float *k = pw_att_rows(&a->k, a->kv_heads, kv_head), *v = pw_att_rows(&a->v, a->kv_heads, kv_head);
  float *gk = pw_att_rows(&a->gk, a->kv_heads, kv_head), *gv = pw_att_rows(&a->gv, a->kv_heads, kv_head);
  pw_att_transpose(k, ks, N, D, kt, np_all, ld_all);
  pw_att_transpose(v, vs, N, D, vt, np_all, ld_all);
  for (int64_t j = 0; j < N; ++j) {
    memset(gk + j * gks, 0, sizeof(float) * D);
    memset(gv + j * gvs, 0, sizeof(float) * D);
  }
  const int64_t first = kv_head / a->kv_heads * H + kv_head % a->kv_heads * a->group;
  int64_t limit[PW_ATT_ROWS];
  for (int64_t head = first; head < first + a->group; ++head) {
    const float *q = pw_att_rows(&a->q, H, head), *grad = pw_att_rows(&a->grad, H, head);
    const float *out = pw_att_rows(&a->out, H, head), *lse = a->lse + head * M;
    float* gq = pw_att_rows(&a->gq, H, head);
    for (int64_t i0 = 0; i0 < M; i0 += PW_ATT_ROWS) {
      const int64_t rows = M - i0 < PW_ATT_ROWS ? M - i0 : PW_ATT_ROWS;
      /* Tiles of query rows stop at their last row's keys, tiles of keys start at the first row
       * that attends to them (pw_att_product's skips). */
      const int64_t n_block = pw_att_row_limits(a, head, i0, rows, causal, mask_kind,
                                                pw_att_keys(causal, i0 + rows, N), limit);
      const int64_t np = pw_att_whole(n_block), ld = pw_att_stride(n_block);
      /* kt and vt hold all keys: read the first np of each row. */
      pw_att_product(rows, np, D, q + i0 * qs, qs, 1, kt, ld_all, s, ld, 0, PW_ATT_COLS, limit);
      pw_att_product(rows, np, D, grad + i0 * gs, gs, 1, vt, ld_all, dp, ld, 0, PW_ATT_COLS, limit);
      for (int64_t r = 0; r < rows; ++r) {
        float *row = s + r * ld, *drow = dp + r * ld;
        const int64_t i = i0 + r, n = limit[r], nr = pw_att_row_cols(limit, r, rows, np);
        const float l = lse[i];
        pw_att_scores(row, nr, n, pw_att_mask_row(a, head, i, mask_kind), a->mask_strides[3], mask_kind, scale);
        if (l == -INFINITY) {
          for (int64_t j = 0; j < nr; ++j) row[j] = drow[j] = 0.0f;
          continue;
        }
        pw_att_grad_row(row, drow, nr, l, pw_att_dot(grad + i * gs, out + i * os, D), scale);
      }
      /* gv += p^T dO; gk += ds^T q; gq = ds k */
      pw_att_product(n_block, D, rows, s, 1, ld, grad + i0 * gs, gs, gv, gvs, 1, PW_ATT_FROM, limit);
      pw_att_product(n_block, D, rows, dp, 1, ld, q + i0 * qs, qs, gk, gks, 1, PW_ATT_FROM, limit);
      pw_att_product(rows, D, n_block, dp, ld, 1, k, ks, gq + i0 * gqs, gqs, 0, PW_ATT_DEPTH, limit);
    }
  }
}

PW_ATT_INLINE void pw_att_task(const PwAttention* a, size_t t, int backward, const int D, const int causal,
                               const int mask_kind, const float scale) {
  const int64_t ld = pw_att_stride(a->N);
  float* buffer = (float*)malloc(sizeof(float) * (size_t)ld * (backward ? 2 * (D + PW_ATT_ROWS) : D + PW_ATT_ROWS));
  if (!buffer) abort(); /* as ORT does when an allocation fails inside a kernel's thread */
  const int64_t first = (int64_t)t * a->items_per_task;
  const int64_t end = first + a->items_per_task < a->items ? first + a->items_per_task : a->items;
  for (int64_t item = first; item < end; ++item) {
    if (backward) {
      pw_att_backward_head(a, item, D, causal, mask_kind, scale, buffer, buffer + D * ld, buffer + 2 * D * ld,
                           buffer + 2 * D * ld + PW_ATT_ROWS * ld);
    } else {
      const int64_t head = item / a->blocks, i0 = item % a->blocks * PW_ATT_ROWS;
      const int64_t rows = a->M - i0 < PW_ATT_ROWS ? a->M - i0 : PW_ATT_ROWS;
      pw_att_forward_block(a, head, i0, rows, D, causal, mask_kind, scale, buffer, buffer + D * ld);
    }
  }
  free(buffer);
}

/* The operand of logical dims [B, H, S, D] at `data`, laid out as [B, S, H, D] if `rows`. */
static inline PwAttOperand pw_att_operand(void* data, const int64_t* dims, int rows) {
  const int64_t H = dims[1], S = dims[2], D = dims[3];
  PwAttOperand o = {(float*)data, H * S * D, rows ? D : S * D, rows ? H * D : D};
  return o;
}

/* Forward: inputs q [B, H, M, D], k and v [B, H, N, D], and the mask if mask_kind (1 float, 2
 * bool), broadcast to [B, H, M, N]; outputs out [B, H, M, D] and logsumexp [B, H, M]. Backward:
 * inputs grad_out, q, k, v, out, logsumexp (and the mask); outputs grad_q, grad_k, grad_v. Bit i
 * of `layout` (the 4-D operands in order, inputs then outputs, the logsumexp not counted) says
 * that operand is laid out [B, S, H, D]. */
static inline __attribute__((always_inline)) OrtStatus* pw_attention_compute(
    const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def, void (*task)(void*, size_t), int backward,
    int64_t D, int mask_kind, int layout) {
  const PwKernel kernel = {api, def};
  const int operands = backward ? 6 : 3, inputs = operands + (mask_kind ? 1 : 0);
  const OrtValue* in[7];
  void* data[7];
  int64_t dims[7][PW_MAX_RANK];
  size_t rank[7];
  for (int i = 0; i < inputs; ++i) {
    PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, i, &in[i]));
    PW_TRY(pw_shape(api, in[i], dims[i], &rank[i]));
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)in[i], &data[i]));
  }
  /* The 4-D operands' logical dims [B, H, S, D]. */
  const int lse_at = backward ? 5 : -1;
  int fits = 1;
  for (int i = 0, bit = 0; fits && i < operands; ++i) {
    if (i == lse_at) continue;
    fits = rank[i] == 4 && dims[i][3] == D;
    if (fits && (layout >> bit++ & 1)) {
      const int64_t s = dims[i][1];
      dims[i][1] = dims[i][2];
      dims[i][2] = s;
    }
  }
  const int qi = backward ? 1 : 0; /* q, k, v at qi, qi + 1, qi + 2 */
  const int64_t* qd = dims[qi];
  /* k and v: one batch, one head count that divides q's (each key head serves a group of query
   * heads), one length. */
  for (int i = 1; fits && i < 3; ++i)
    fits = dims[qi + i][0] == qd[0] && dims[qi + i][1] == dims[qi + 1][1] && dims[qi + i][1] > 0 &&
           qd[1] % dims[qi + i][1] == 0 && dims[qi + i][2] == dims[qi + 1][2];
  if (backward)
    for (int i = 0; fits && i < 5; i += 4) /* grad_out and out: q's shape */
      fits = dims[i][0] == qd[0] && dims[i][1] == qd[1] && dims[i][2] == qd[2];
  if (backward && fits)
    fits = rank[5] == 3 && dims[5][0] == qd[0] && dims[5][1] == qd[1] && dims[5][2] == qd[2];
  if (!fits) {
    char message[200];
    snprintf(message, sizeof message,
             "query, key and value must be [batch, heads, length, %lld] of one batch, key and value of one head "
             "count that divides the query's%s",
             (long long)D,
             backward ? ", the gradient and output the query's shape, the logsumexp [batch, heads, length]" : "");
    return pw_error(&kernel, message);
  }
  PwAttention a = {0};
  a.heads = qd[1];
  a.kv_heads = dims[qi + 1][1];
  a.group = a.heads / a.kv_heads; /* kv_heads > 0: checked above */
  a.M = qd[2];
  a.N = dims[qi + 1][2];
  if (mask_kind) { /* right-aligned against [B, H, M, N]; an axis of 1 broadcasts */
    const int mi = inputs - 1;
    const int64_t want[4] = {qd[0], qd[1], a.M, a.N};
    int64_t stride = 1;
    if (rank[mi] > 4) return pw_error(&kernel, "the mask must have at most 4 axes");
    for (int d = 3; d >= 0; --d) {
      const int md = d - (4 - (int)rank[mi]);
      const int64_t size = md >= 0 ? dims[mi][md] : 1;
      if (size != 1 && size != want[d])
        return pw_error(&kernel, "the mask must broadcast to [batch, heads, query length, key length]");
      a.mask_strides[d] = size == 1 ? 0 : stride;
      stride *= size;
    }
    a.mask = data[mi];
  }
  a.q = pw_att_operand(data[qi], dims[qi], layout >> qi & 1);
  a.k = pw_att_operand(data[qi + 1], dims[qi + 1], layout >> (qi + 1) & 1);
  a.v = pw_att_operand(data[qi + 2], dims[qi + 2], layout >> (qi + 2) & 1);
  const int64_t heads = qd[0] * qd[1];
  OrtValue* output;
  void* written;
  if (backward) {
    a.grad = pw_att_operand(data[0], dims[0], layout & 1);
    a.out = pw_att_operand(data[4], dims[4], layout >> 4 & 1);
    a.lse = (const float*)data[5];
    PwAttOperand* grads[3] = {&a.gq, &a.gk, &a.gv};
    for (int i = 0; i < 3; ++i) {
      const int rows = layout >> (5 + i) & 1;
      const int64_t* d = dims[qi + i];
      const int64_t shape[4] = {d[0], rows ? d[2] : d[1], rows ? d[1] : d[2], d[3]};
      PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, i, shape, 4, &output));
      PW_TRY(ORTD_CALL(api, GetTensorMutableData)(output, &written));
      *grads[i] = pw_att_operand(written, d, rows);
    }
  } else {
    const int rows = layout >> 3 & 1;
    const int64_t shape[4] = {qd[0], rows ? qd[2] : qd[1], rows ? qd[1] : qd[2], D};
    PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, shape, 4, &output));
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)(output, &written));
    a.y = pw_att_operand(written, qd, rows);
    PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 1, qd, 3, &output));
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)(output, &written));
    a.y_lse = (float*)written;
  }
  if (heads == 0) return NULL;
  if (a.M == 0) { /* no queries: nothing reads the keys */
    if (backward) {
      memset(a.gk.data, 0, sizeof(float) * (size_t)(qd[0] * a.kv_heads * a.N * D));
      memset(a.gv.data, 0, sizeof(float) * (size_t)(qd[0] * a.kv_heads * a.N * D));
    }
    return NULL;
  }
  if (a.N == 0) { /* no keys: every row masked */
    if (backward) {
      memset(a.gq.data, 0, sizeof(float) * (size_t)(heads * a.M * D));
    } else {
      memset(a.y.data, 0, sizeof(float) * (size_t)(heads * a.M * D));
      for (int64_t i = 0; i < heads * a.M; ++i) a.y_lse[i] = -INFINITY;
    }
    return NULL;
  }
  a.blocks = backward ? 1 : (a.M + PW_ATT_ROWS - 1) / PW_ATT_ROWS;
  a.items = backward ? qd[0] * a.kv_heads : heads * a.blocks; /* backward: per key head */
  a.items_per_task = 1;
  return pw_run_tasks(api, ctx, task, a.items, &a);
}

/* One op: attention's forward (BACKWARD 0) or backward over heads of D values, CAUSAL or not,
 * MASK none (0), float (1) or bool (2), scores scaled by SCALE, operands laid out as LAYOUT says
 * (pw_attention_compute). Defines name_compute and the type
 * lists; the generated unit's PW_KERNEL line names the op. */
#define PW_ATTENTION(name, BACKWARD, D, CAUSAL, MASK, SCALE, LAYOUT)                                                 \
  static void name##_task(void* user, size_t t) {                                                          \
    pw_att_task((const PwAttention*)user, t, BACKWARD, D, CAUSAL, MASK, SCALE);                            \
  }                                                                                                        \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) { \
    return pw_attention_compute(api, ctx, def, name##_task, BACKWARD, D, MASK, LAYOUT);                    \
  }                                                                                                        \
  static const int name##_types[] = {PW_FLOAT, PW_FLOAT, PW_FLOAT,                                         \
                                     !(BACKWARD) && (MASK) == 2 ? PW_BOOL : PW_FLOAT, PW_FLOAT, PW_FLOAT,  \
                                     (BACKWARD) && (MASK) == 2 ? PW_BOOL : PW_FLOAT};                      \
  static const int name##_none[] = {0, 0, 0, 0, 0, 0, 0}

#endif
