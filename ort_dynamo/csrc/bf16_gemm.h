/* bf16_gemm.h -- CPU autocast's matrix products in bfloat16, as eager computes them.
 *
 * Under torch.autocast("cpu", bfloat16) eager multiplies bfloat16 matrices with oneDNN's
 * AVX512-BF16 kernels (VDPBF16PS: pairs of bfloat16 products summed into float32). ORT's CPU
 * provider has float32 GEMMs only, so a bfloat16 graph's products ran at float32 speed, half
 * of eager's (docs/performance-log.md, "CPU autocast"). This op multiplies bfloat16 values with the
 * same instruction: operands held as bfloat16, or as float32 that are bfloat16 values; the
 * result stored as bfloat16 (rounded to nearest even), as float32 holding those rounded values
 * (where only float32 ops read it), or as the float32 sums (where a bias is added before the
 * rounding). The rewrite (ort_dynamo/_op_kernels.py) picks the op's types from what reads and
 * writes the product, and uses it only where the compiler targets AVX512-BF16 (-march=native).
 *
 * Blocking as in GotoBLAS: B packed once per call (in chunks of at most 8 MB: a vocabulary's
 * projection would take tens of MB at once) into panels of NR columns, in blocks of KC
 * rows, as bfloat16 pairs along K (the instruction's operand layout); each task packs MC rows
 * of A and runs an MR x NR register tile over every panel, summing all of K in registers, so
 * that C is written once (summed into C block by block, K=1024 products took 4-7% longer).
 * Each output element is summed in the same order whatever the threads: results do not depend
 * on the thread count.
 *
 * The same driver multiplies float32 matrices exactly (F32MatMul*, `exact`): one K value per
 * unit instead of a pair, FMA instead of VDPBF16PS. The rewrite uses it for the products with a
 * long inner dimension, where ORT's (MLAS) was slower (benchmarks/gemm.py --ours). They, and the
 * convolutions built on them (conv.h, conv_weight_grad.h), need AVX-512 alone (F, BW, VL, DQ:
 * Skylake and Ice Lake Xeons too); the bfloat16 parts are compiled where AVX512-BF16 is there.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_BF16_GEMM_H
#define ORT_DYNAMO_BF16_GEMM_H
#include "pointwise.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__)
#error "bf16_gemm.h needs a compiler targeting AVX-512 (the rewrite checks before using it)"
#endif
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define PW_GEMM_BF16 1 /* the bfloat16 products too */
#else
#define PW_GEMM_BF16 0
#endif

#define PW_GEMM_MR 12          /* rows of a register tile: 24 accumulators, 2 B vectors, a broadcast */
#define PW_GEMM_NR 32          /* columns: two AVX-512 vectors */
#define PW_GEMM_KC 256         /* K per block (bfloat16): a 12 x 256 A panel and a 256 x 32 B panel, 22 KB */
#define PW_GEMM_KP (PW_GEMM_KC / 2)
#define PW_GEMM_MC 48          /* rows of C a task computes (A's, packed per task): four tiles */
#define PW_GEMM_PACKED (8 << 20) /* bytes of packed B at a time, at most (unless one panel needs more) */

static inline __mmask16 pw_lanes(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
static inline int64_t pw_min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Element i of an operand held as float32 or as bfloat16. */
static inline const void* pw_at(const void* base, int64_t i, int bf16) {
  return (const char*)base + i * (bf16 ? 2 : 4);
}

#if PW_GEMM_BF16
static const short pw_interleave16[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static inline __mmask32 pw_lanes32(int64_t n) { return n >= 32 ? 0xffffffffu : n <= 0 ? 0 : (__mmask32)((1u << n) - 1); }

/* 16 bfloat16 pairs (x0[i], x1[i]) for i < n (the rest zeros) from two lines of an operand,
 * x1 NULL for zeros; float32 values rounded to nearest even (exact for the bfloat16 values
 * this op is given). */
static inline __m512i pw_pairs_across(const void* x0, const void* x1, int64_t n, int bf16) {
  const __mmask16 m = pw_lanes(n);
  if (bf16) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x0));
    const __m512i hi = x1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x1)) : _mm512_setzero_si512();
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
  const __m512 f0 = _mm512_maskz_loadu_ps(m, x0), f1 = x1 ? _mm512_maskz_loadu_ps(m, x1) : _mm512_setzero_ps();
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(f1, f0); /* x0's 16, then x1's */
  return _mm512_permutexvar_epi16(_mm512_loadu_si512(pw_interleave16), both);
}

/* The 16 pairs of n (<= 32) consecutive values of a line (the rest zeros). */
static inline __m512i pw_pairs_along(const void* x, int64_t n, int bf16) {
  if (bf16) return _mm512_maskz_loadu_epi16(pw_lanes32(n), x);
  const __m512 lo = _mm512_maskz_loadu_ps(pw_lanes(n), x);
  const __m512 hi = _mm512_maskz_loadu_ps(pw_lanes(n - 16), (const float*)x + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Element (k, n) of B is b[k ldb + n], or b[n ldb + k] when transposed. One panel: columns
 * n0.. (nr of them, the rest zeros), rows k0.. (kc), as [pair][NR] 32-bit pairs. */
static void pw_gemm_pack_b(uint32_t* restrict dst, const void* b, int bf16, int64_t ldb, int tb, int64_t n0,
                           int64_t nr, int64_t k0, int64_t kc) {
  const int64_t pairs = (kc + 1) / 2;
  if (!tb) {
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t at = (k0 + 2 * p) * ldb + n0;
      for (int h = 0; h < 2; ++h)
        _mm512_storeu_si512(dst + p * PW_GEMM_NR + 16 * h,
                            pw_pairs_across(pw_at(b, at + 16 * h, bf16),
                                            2 * p + 1 < kc ? pw_at(b, at + ldb + 16 * h, bf16) : NULL, nr - 16 * h,
                                            bf16));
    }
    return;
  }
  uint32_t row[PW_GEMM_KP] __attribute__((aligned(64)));
  for (int64_t c = 0; c < PW_GEMM_NR; ++c) {
    if (c < nr) /* a column of B is a row in memory: its pairs are adjacent */
      for (int64_t q = 0; q < kc; q += 32)
        _mm512_store_si512(row + q / 2, pw_pairs_along(pw_at(b, (n0 + c) * ldb + k0 + q, bf16), kc - q, bf16));
    for (int64_t p = 0; p < pairs; ++p) dst[p * PW_GEMM_NR + c] = c < nr ? row[p] : 0;
  }
}

/* Element (m, k) of A is a[m lda + k], or a[k lda + m] when transposed. One tile's rows m0..
 * (mr of them, the rest zeros), k0.. (kc): as [row][KP] pairs (the rows' pairs are adjacent
 * in memory), or transposed as [pair][MR]. */
static void pw_gemm_pack_a(uint32_t* restrict dst, const void* a, int bf16, int64_t lda, int ta, int64_t m0,
                           int64_t mr, int64_t k0, int64_t kc) {
  const int64_t pairs = (kc + 1) / 2;
  if (!ta) {
    for (int64_t r = 0; r < PW_GEMM_MR; ++r)
      for (int64_t q = 0; q < 2 * pairs; q += 32)
        _mm512_storeu_si512(dst + r * PW_GEMM_KP + q / 2,
                            r < mr ? pw_pairs_along(pw_at(a, (m0 + r) * lda + k0 + q, bf16), kc - q, bf16)
                                   : _mm512_setzero_si512());
    return;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t at = (k0 + 2 * p) * lda + m0;
    _mm512_mask_storeu_epi32(dst + p * PW_GEMM_MR, (__mmask16)((1u << PW_GEMM_MR) - 1),
                             pw_pairs_across(pw_at(a, at, bf16), 2 * p + 1 < kc ? pw_at(a, at + lda, bf16) : NULL, mr,
                                             bf16));
  }
}

/* c (mr x nr of it, ldc apart) = the tile's products over all of K: `kblocks` blocks of A
 * (a_block apart) and of B (b_block apart), `pairs` in each but the last (`last`). The sums
 * stay in registers across the blocks: C is written once. */
#define PW_GEMM_TILE(name, A_PAIR)                                                                                 \
  static void name(const uint32_t* restrict pa, int64_t a_block, const uint32_t* restrict pb, int64_t b_block,    \
                   int64_t kblocks, int64_t pairs, int64_t last, const float* bias, void* c, int c_bf16,           \
                   int rounded, int64_t ldc, int64_t mr, int64_t nr) {                                             \
    __m512 acc[PW_GEMM_MR][2];                                                                                     \
    for (int r = 0; r < PW_GEMM_MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                              \
    for (int64_t kb = 0; kb < kblocks; ++kb, pa += a_block, pb += b_block) {                                       \
      const int64_t n = kb == kblocks - 1 ? last : pairs;                                                          \
      for (int64_t p = 0; p < n; ++p) {                                                                            \
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pb + p * PW_GEMM_NR);                                    \
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pb + p * PW_GEMM_NR + 16);                               \
        _Pragma("GCC unroll 12") for (int r = 0; r < PW_GEMM_MR; ++r) {                                            \
          const __m512bh x = (__m512bh)_mm512_set1_epi32((int)(A_PAIR));                                           \
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);                                                          \
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);                                                          \
        }                                                                                                          \
      }                                                                                                            \
    }                                                                                                              \
    const __mmask16 m0 = pw_lanes(nr), m1 = pw_lanes(nr - 16);                                                     \
    if (bias) { /* a Linear's: added to the float32 sums, before any rounding */                                   \
      const __m512 b0 = _mm512_maskz_loadu_ps(m0, bias), b1 = _mm512_maskz_loadu_ps(m1, bias + 16);                \
      for (int r = 0; r < PW_GEMM_MR; ++r) {                                                                       \
        acc[r][0] = _mm512_add_ps(acc[r][0], b0);                                                                  \
        acc[r][1] = _mm512_add_ps(acc[r][1], b1);                                                                  \
      }                                                                                                            \
    }                                                                                                              \
    for (int r = 0; r < mr; ++r) {                                                                                 \
      if (c_bf16) { /* rounded to nearest even, as eager's bfloat16 product is */                                  \
        uint16_t* row = (uint16_t*)c + r * ldc;                                                                    \
        _mm256_mask_storeu_epi16(row, m0, (__m256i)_mm512_cvtneps_pbh(acc[r][0]));                                 \
        _mm256_mask_storeu_epi16(row + 16, m1, (__m256i)_mm512_cvtneps_pbh(acc[r][1]));                            \
      } else {                                                                                                     \
        float* row = (float*)c + r * ldc;                                                                          \
        if (rounded) /* to bfloat16 and held as float32: a bfloat16 result only float32 ops read */          \
          for (int h = 0; h < 2; ++h)                                                                              \
            acc[r][h] = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(acc[r][h])), 16); \
        _mm512_mask_storeu_ps(row, m0, acc[r][0]);                                                                 \
        _mm512_mask_storeu_ps(row + 16, m1, acc[r][1]);                                                            \
      }                                                                                                            \
    }                                                                                                              \
  }
PW_GEMM_TILE(pw_gemm_tile_rows, pa[r * PW_GEMM_KP + p])
PW_GEMM_TILE(pw_gemm_tile_pairs, pa[p * PW_GEMM_MR + r])
#endif /* PW_GEMM_BF16 */

/* Float32 products (`exact`: the float32 ops, F32MatMul*): the same blocking with one K value
 * per unit instead of a pair, FMA instead of VDPBF16PS. B's panels as [k][NR] floats; a tile of
 * A as [row][KC] (rows of A in memory) or [k][MR] (A transposed). */
static void pw_gemm_pack_b_f32(float* restrict dst, const float* b, int64_t ldb, int tb, int64_t n0, int64_t nr,
                               int64_t k0, int64_t kc) {
  if (!tb) {
    const __mmask16 m0 = pw_lanes(nr), m1 = pw_lanes(nr - 16);
    for (int64_t k = 0; k < kc; ++k) {
      const float* row = b + (k0 + k) * ldb + n0;
      _mm512_storeu_ps(dst + k * PW_GEMM_NR, _mm512_maskz_loadu_ps(m0, row));
      _mm512_storeu_ps(dst + k * PW_GEMM_NR + 16, _mm512_maskz_loadu_ps(m1, row + 16));
    }
    return;
  }
  for (int64_t c = 0; c < PW_GEMM_NR; ++c) { /* a column of B is a row in memory */
    const float* col = b + (n0 + c) * ldb + k0;
    for (int64_t k = 0; k < kc; ++k) dst[k * PW_GEMM_NR + c] = c < nr ? col[k] : 0.0f;
  }
}

static void pw_gemm_pack_a_f32(float* restrict dst, const float* a, int64_t lda, int ta, int64_t m0, int64_t mr,
                               int64_t k0, int64_t kc) {
  if (!ta) {
    for (int64_t r = 0; r < PW_GEMM_MR; ++r)
      for (int64_t q = 0; q < kc; q += 16)
        _mm512_storeu_ps(dst + r * PW_GEMM_KC + q,
                         r < mr ? _mm512_maskz_loadu_ps(pw_lanes(kc - q), a + (m0 + r) * lda + k0 + q)
                                : _mm512_setzero_ps());
    return;
  }
  for (int64_t k = 0; k < kc; ++k)
    _mm512_mask_storeu_ps(dst + k * PW_GEMM_MR, (__mmask16)((1u << PW_GEMM_MR) - 1),
                          _mm512_maskz_loadu_ps(pw_lanes(mr), a + (k0 + k) * lda + m0));
}

#define PW_GEMM_TILE_F32(name, A_AT)                                                                           \
  static void name(const float* restrict pa, int64_t a_block, const float* restrict pb, int64_t b_block,       \
                   int64_t kblocks, int64_t kc, int64_t last, const float* bias, float* c, int64_t ldc,        \
                   int64_t mr, int64_t nr) {                                                                   \
    __m512 acc[PW_GEMM_MR][2];                                                                                 \
    for (int r = 0; r < PW_GEMM_MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                          \
    for (int64_t kb = 0; kb < kblocks; ++kb, pa += a_block, pb += b_block) {                                   \
      const int64_t n = kb == kblocks - 1 ? last : kc;                                                         \
      for (int64_t k = 0; k < n; ++k) {                                                                        \
        const __m512 b0 = _mm512_loadu_ps(pb + k * PW_GEMM_NR), b1 = _mm512_loadu_ps(pb + k * PW_GEMM_NR + 16); \
        _Pragma("GCC unroll 12") for (int r = 0; r < PW_GEMM_MR; ++r) {                                        \
          const __m512 x = _mm512_set1_ps(A_AT);                                                               \
          acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);                                                       \
          acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);                                                       \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    const __mmask16 m0 = pw_lanes(nr), m1 = pw_lanes(nr - 16);                                                 \
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();                            \
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();                       \
    for (int r = 0; r < mr; ++r) {                                                                             \
      _mm512_mask_storeu_ps(c + r * ldc, m0, _mm512_add_ps(acc[r][0], b0));                                    \
      _mm512_mask_storeu_ps(c + r * ldc + 16, m1, _mm512_add_ps(acc[r][1], b1));                               \
    }                                                                                                          \
  }
PW_GEMM_TILE_F32(pw_gemm_tile_rows_f32, pa[r * PW_GEMM_KC + k])
PW_GEMM_TILE_F32(pw_gemm_tile_cols_f32, pa[k * PW_GEMM_MR + r])

typedef struct PwGemm {
  const void *a, *b;
  const float* bias; /* [N] or NULL */
  void* c;
  int a_bf16, b_bf16, c_bf16; /* which are held as bfloat16, not float32 */
  int rounded;                /* C float32, holding values rounded to bfloat16 */
  int exact;                  /* float32 products (all of A, B, C float32): K units are values, not pairs */
  uint32_t* packed; /* B's panels of this chunk: [B batch][N panel][K block][panel_pairs][NR] (floats if exact) */
  int ta, tb;
  int64_t M, N, K, lda, ldb;
  int64_t kblocks, npanels, panel_pairs, mblocks; /* panel_pairs: K units (pairs, or values if exact) per block */
  int64_t first, chunk; /* the chunk of N panels packed and multiplied now: its first, its count */
  int64_t batches, b_batches; /* the output's, B's distinct ones */
  int64_t rank;               /* batch axes */
  int64_t dims[PW_MAX_RANK], a_strides[PW_MAX_RANK], b_strides[PW_MAX_RANK]; /* per batch axis; 0: broadcast */
  int* out_of_memory;         /* set by a task that could not allocate its rows' buffer */
} PwGemm;

static inline int64_t pw_gemm_batch_offset(const PwGemm* g, const int64_t* strides, int64_t t) {
  int64_t offset = 0;
  for (int64_t d = g->rank - 1; d >= 0; --d) {
    offset += (t % g->dims[d]) * strides[d];
    t /= g->dims[d];
  }
  return offset;
}

/* Task t packs one K block of one N panel of one of B's batches (numbered in B's own layout). */
static void pw_gemm_pack_task(void* user, size_t t) {
  const PwGemm* g = (const PwGemm*)user;
  const int64_t kb = (int64_t)t % g->kblocks, panel = (int64_t)t / g->kblocks;
  const int64_t batch = panel / g->chunk, n0 = (g->first + panel % g->chunk) * PW_GEMM_NR, k0 = kb * PW_GEMM_KC;
  if (g->exact) {
    pw_gemm_pack_b_f32((float*)g->packed + (int64_t)t * g->panel_pairs * PW_GEMM_NR,
                       (const float*)g->b + batch * g->K * g->N, g->ldb, g->tb, n0, pw_min64(g->N - n0, PW_GEMM_NR),
                       k0, pw_min64(g->K - k0, PW_GEMM_KC));
    return;
  }
#if PW_GEMM_BF16
  pw_gemm_pack_b(g->packed + (int64_t)t * g->panel_pairs * PW_GEMM_NR, pw_at(g->b, batch * g->K * g->N, g->b_bf16),
                 g->b_bf16, g->ldb, g->tb, n0, pw_min64(g->N - n0, PW_GEMM_NR), k0, pw_min64(g->K - k0, PW_GEMM_KC));
#endif
}

/* Task t: MC rows of one batch's C, over the chunk's N panels. */
static void pw_gemm_task(void* user, size_t t) {
  const PwGemm* g = (const PwGemm*)user;
  const int64_t batch = (int64_t)t / g->mblocks, m0 = (int64_t)t % g->mblocks * PW_GEMM_MC;
  const int64_t mc = pw_min64(g->M - m0, PW_GEMM_MC), tiles = (mc + PW_GEMM_MR - 1) / PW_GEMM_MR;
  const int64_t a_block = PW_GEMM_MR * (g->exact ? PW_GEMM_KC : PW_GEMM_KP), a_tile = g->kblocks * a_block;
  uint32_t* pa = (uint32_t*)aligned_alloc(64, (size_t)(tiles * a_tile) * sizeof(uint32_t));
  if (!pa) {
    __atomic_store_n(g->out_of_memory, 1, __ATOMIC_RELAXED);
    return;
  }
  const void* a = pw_at(g->a, pw_gemm_batch_offset(g, g->a_strides, batch), g->a_bf16);
  const int64_t b_batch = g->K ? pw_gemm_batch_offset(g, g->b_strides, batch) / (g->K * g->N) : 0;
  char* c = (char*)g->c + batch * g->M * g->N * (g->c_bf16 ? 2 : 4);
  for (int64_t i = 0; i < tiles; ++i)
    for (int64_t kb = 0; kb < g->kblocks; ++kb) {
      const int64_t rows = pw_min64(mc - i * PW_GEMM_MR, PW_GEMM_MR), kc = pw_min64(g->K - kb * PW_GEMM_KC, PW_GEMM_KC);
      if (g->exact)
        pw_gemm_pack_a_f32((float*)(pa + i * a_tile + kb * a_block), (const float*)a, g->lda, g->ta,
                           m0 + i * PW_GEMM_MR, rows, kb * PW_GEMM_KC, kc);
#if PW_GEMM_BF16
      else
        pw_gemm_pack_a(pa + i * a_tile + kb * a_block, a, g->a_bf16, g->lda, g->ta, m0 + i * PW_GEMM_MR, rows,
                       kb * PW_GEMM_KC, kc);
#endif
    }
  const int64_t b_block = g->panel_pairs * PW_GEMM_NR, tail = g->K - (g->kblocks - 1) * PW_GEMM_KC;
  const int64_t last = g->exact ? tail : (tail + 1) / 2;
  for (int64_t j = g->first; j < g->first + g->chunk; ++j) {
    const uint32_t* panel = g->packed + (b_batch * g->chunk + j - g->first) * g->kblocks * b_block;
    const int64_t nr = pw_min64(g->N - j * PW_GEMM_NR, PW_GEMM_NR);
    const float* bias = g->bias ? g->bias + j * PW_GEMM_NR : NULL;
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t mr = pw_min64(mc - i * PW_GEMM_MR, PW_GEMM_MR);
      void* tile = c + ((m0 + i * PW_GEMM_MR) * g->N + j * PW_GEMM_NR) * (g->c_bf16 ? 2 : 4);
      if (g->exact)
        (g->ta ? pw_gemm_tile_cols_f32 : pw_gemm_tile_rows_f32)(
            (const float*)(pa + i * a_tile), a_block, (const float*)panel, b_block, g->kblocks, g->panel_pairs, last,
            bias, (float*)tile, g->N, mr, nr);
#if PW_GEMM_BF16
      else if (g->ta)
        pw_gemm_tile_pairs(pa + i * a_tile, a_block, panel, b_block, g->kblocks, g->panel_pairs, last, bias, tile,
                           g->c_bf16, g->rounded, g->N, mr, nr);
      else
        pw_gemm_tile_rows(pa + i * a_tile, a_block, panel, b_block, g->kblocks, g->panel_pairs, last, bias, tile,
                          g->c_bf16, g->rounded, g->N, mr, nr);
#endif
    }
  }
  free(pa);
}

/* Few rows of A (an RNN's step: a batch of 16 rows against its recurrent weight): packing B
 * per call, as above, costs more than the product, and MC rows are one task, one thread. So for
 * float32 products of at most PW_SKINNY_M rows, one matrix each, B is read where it is and the
 * tasks split N: PW_SKINNY_NB columns each. A in rows, B in rows (NN): a tile of 8 (or 4) rows
 * by 32 columns, A's values broadcast from memory, B's rows loaded in place. B transposed (NT,
 * B's rows are C's columns): dot products along K of 4 rows of A by 4 rows of B, 16 partial
 * sums of 16 lanes reduced at the end. Rows and columns past the end read the last valid one
 * (not stored). One tile computes each output, in a fixed order: no dependence on threads. */
#define PW_SKINNY_M 32   /* as _op_kernels.F32_SKINNY_M */
#define PW_SKINNY_NB 128 /* an LSTM's 16 x 1024 step in 8 tasks: 60 us against 65 (64) and 78 (512) */

/* Scalars, not the PwGemm: reading K and the strides through its pointer, GCC kept the
 * accumulators in memory, stored back every k (a third of the speed). */
#define PW_SKINNY_NN_TILE(name, MR)                                                                         \
  static void name(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, const float* bias,  \
                   float* c, int64_t ldc, int64_t mr, int64_t nr) {                                         \
    const __mmask16 k0 = pw_lanes(nr), k1 = pw_lanes(nr - 16);                                              \
    const float* row[MR];                                                                                   \
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) row[r] = a + (r < mr ? r : mr - 1) * lda;          \
    __m512 acc[MR][2];                                                                                      \
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {                                                  \
      acc[r][0] = _mm512_setzero_ps();                                                                      \
      acc[r][1] = _mm512_setzero_ps();                                                                      \
    }                                                                                                       \
    for (int64_t k = 0; k < K; ++k, b += ldb) {                                                             \
      const __m512 b0 = _mm512_maskz_loadu_ps(k0, b), b1 = _mm512_maskz_loadu_ps(k1, b + 16);               \
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {                                                \
        const __m512 x = _mm512_set1_ps(row[r][k]);                                                         \
        acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);                                                      \
        acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);                                                      \
      }                                                                                                     \
    }                                                                                                       \
    const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(k0, bias) : _mm512_setzero_ps();                      \
    const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(k1, bias + 16) : _mm512_setzero_ps();                 \
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) if (r < mr) {                                     \
      _mm512_mask_storeu_ps(c + r * ldc, k0, _mm512_add_ps(acc[r][0], bias0));                              \
      _mm512_mask_storeu_ps(c + r * ldc + 16, k1, _mm512_add_ps(acc[r][1], bias1));                         \
    }                                                                                                       \
  }
PW_SKINNY_NN_TILE(pw_skinny_nn_tile8, 8)
PW_SKINNY_NN_TILE(pw_skinny_nn_tile4, 4)

/* The four sums of v0..v3, in order, as one 4-lane vector. */
static inline __m128 pw_sum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static void pw_skinny_nt_tile(const float* a0, int64_t lda, const float* b0, int64_t ldb, int64_t K,
                              const float* bias, float* c, int64_t ldc, int64_t mr, int64_t nr) {
  const float *a[4], *b[4];
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
    a[i] = a0 + (i < mr ? i : mr - 1) * lda;
    b[i] = b0 + (i < nr ? i : nr - 1) * ldb;
  }
  __m512 acc[4][4];
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i)
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = pw_lanes(K - k);
    __m512 x[4], y[4];
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
      x[i] = _mm512_maskz_loadu_ps(lanes, a[i] + k);
      y[i] = _mm512_maskz_loadu_ps(lanes, b[i] + k);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i)
      _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(x[i], y[j], acc[i][j]);
  }
  const __mmask8 cols = (__mmask8)((1u << nr) - 1);
  const __m128 add = bias ? _mm_maskz_loadu_ps(cols, bias) : _mm_setzero_ps();
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) if (i < mr)
    _mm_mask_storeu_ps(c + i * ldc, cols, _mm_add_ps(pw_sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), add));
}

/* Task t: C's columns [t * NB, (t + 1) * NB), all rows. */
static void pw_skinny_task(void* user, size_t t) {
  const PwGemm* g = (const PwGemm*)user;
  const int64_t first = (int64_t)t * PW_SKINNY_NB, end = pw_min64(g->N, first + PW_SKINNY_NB);
  const float *a = (const float*)g->a, *b = (const float*)g->b;
  float* c = (float*)g->c;
  if (g->tb) {
    for (int64_t n0 = first; n0 < end; n0 += 4)
      for (int64_t m0 = 0; m0 < g->M; m0 += 4)
        pw_skinny_nt_tile(a + m0 * g->lda, g->lda, b + n0 * g->ldb, g->ldb, g->K, g->bias ? g->bias + n0 : NULL,
                          c + m0 * g->N + n0, g->N, pw_min64(g->M - m0, 4), pw_min64(end - n0, 4));
    return;
  }
  for (int64_t n0 = first; n0 < end; n0 += PW_GEMM_NR)
    for (int64_t m0 = 0; m0 < g->M; m0 += 8)
      (g->M - m0 > 4 ? pw_skinny_nn_tile8 : pw_skinny_nn_tile4)(
          a + m0 * g->lda, g->lda, b + n0, g->ldb, g->K, g->bias ? g->bias + n0 : NULL, c + m0 * g->N + n0, g->N,
          pw_min64(g->M - m0, 8), pw_min64(end - n0, PW_GEMM_NR));
}

/* C = op(A) op(B) over broadcast batch axes (ONNX MatMul's, rank >= 2 each), op a transpose of
 * the last two axes where asked; each of A, B and C float32 or bfloat16 as the op's types say. */
static inline OrtStatus* pw_bf16_matmul(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def, int ta,
                                        int tb, int rounded, int exact) {
  const PwKernel kernel = {api, def};
  const OrtValue *x, *y;
  int64_t ad[PW_MAX_RANK], bd[PW_MAX_RANK], cd[PW_MAX_RANK];
  size_t ar = 0, br = 0;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &x));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 1, &y));
  PW_TRY(pw_shape(api, x, ad, &ar));
  PW_TRY(pw_shape(api, y, bd, &br));
  if (ar < 2 || br < 2 || ar > PW_MAX_RANK || br > PW_MAX_RANK)
    return pw_error(&kernel, "each operand must have 2 to 8 axes");
  PwGemm g = {0};
  g.ta = ta;
  g.tb = tb;
  g.a_bf16 = def->types[0] == PW_BF16;
  g.b_bf16 = def->types[1] == PW_BF16;
  g.c_bf16 = def->out_types && def->out_types[0] == PW_BF16;
  g.rounded = rounded;
  g.exact = exact;
  g.M = ad[ar - 2 + ta];
  g.K = ad[ar - 1 - ta];
  g.N = bd[br - 1 - tb];
  if (bd[br - 2 + tb] != g.K) return pw_error(&kernel, "the operands' inner dimensions differ");
  g.lda = ad[ar - 1];
  g.ldb = bd[br - 1];
  /* batch axes, aligned from the right; a broadcast one gets stride 0 */
  const size_t rank = (ar > br ? ar : br) - 2;
  int64_t a_step = g.M * g.K, b_step = g.K * g.N;
  g.rank = (int64_t)rank;
  g.batches = 1;
  g.b_batches = 1;
  for (int64_t d = (int64_t)rank - 1; d >= 0; --d) {
    const int64_t ai = d - (int64_t)rank + (int64_t)ar - 2, bi = d - (int64_t)rank + (int64_t)br - 2;
    const int64_t an = ai >= 0 ? ad[ai] : 1, bn = bi >= 0 ? bd[bi] : 1;
    if (an != bn && an != 1 && bn != 1) return pw_error(&kernel, "the operands' batch axes do not broadcast");
    g.dims[d] = an > bn ? an : bn;
    g.a_strides[d] = an == 1 ? 0 : a_step;
    g.b_strides[d] = bn == 1 ? 0 : b_step;
    a_step *= an;
    b_step *= bn;
    g.batches *= g.dims[d];
    g.b_batches *= bn;
    cd[d] = g.dims[d];
  }
  cd[rank] = g.M;
  cd[rank + 1] = g.N;
  /* B the same for every batch and A's rows contiguous across them (a Linear on a 3-D input):
   * one product of all the rows, which splits better over the threads. */
  if (g.b_batches == 1 && !ta && g.batches > 1) {
    int contiguous = 1;
    for (int64_t d = 0; d < g.rank; ++d) contiguous &= g.a_strides[d] != 0 || g.dims[d] == 1;
    if (contiguous) {
      g.M *= g.batches;
      g.batches = 1;
      g.rank = 0;
    }
  }
  OrtValue* output;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, cd, rank + 2, &output));
  void* data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(output, &data));
  g.c = data;
  if (g.batches == 0 || g.M == 0 || g.N == 0) return NULL;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)x, &data));
  g.a = data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)y, &data));
  g.b = data;
  if (def->n_in == 3) {
    const OrtValue* z;
    int64_t zd[PW_MAX_RANK];
    size_t zr = 0;
    PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 2, &z));
    PW_TRY(pw_shape(api, z, zd, &zr));
    if (zr != 1 || zd[0] != g.N) return pw_error(&kernel, "the bias must have one value per output column");
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)z, &data));
    g.bias = (const float*)data;
  }
  if (exact && !ta && g.batches == 1 && g.M <= PW_SKINNY_M)
    return pw_run_tasks(api, ctx, pw_skinny_task, (g.N + PW_SKINNY_NB - 1) / PW_SKINNY_NB, &g);
  g.kblocks = (g.K + PW_GEMM_KC - 1) / PW_GEMM_KC;
  if (g.K == 0) g.kblocks = 1; /* one empty block: the tiles store zeros (plus the bias) */
  g.npanels = (g.N + PW_GEMM_NR - 1) / PW_GEMM_NR;
  g.panel_pairs = exact ? pw_min64(PW_GEMM_KC, g.K) : pw_min64(PW_GEMM_KP, (g.K + 1) / 2);
  g.mblocks = (g.M + PW_GEMM_MC - 1) / PW_GEMM_MC;
  /* B packed a chunk of N panels at a time, at most PW_GEMM_PACKED bytes (a vocabulary's
   * projection would take tens of MB at once) */
  const int64_t panel_bytes = g.b_batches * g.kblocks * (g.panel_pairs ? g.panel_pairs : 1) * PW_GEMM_NR * 4;
  g.chunk = pw_min64(g.npanels, PW_GEMM_PACKED / panel_bytes > 1 ? PW_GEMM_PACKED / panel_bytes : 1);
  g.packed = (uint32_t*)aligned_alloc(64, (size_t)(g.chunk * panel_bytes));
  if (!g.packed) return pw_error(&kernel, "out of memory for the packed operand");
  int out_of_memory = 0;
  g.out_of_memory = &out_of_memory;
  OrtStatus* status = NULL;
  const int64_t all = g.npanels;
  for (g.first = 0; g.first < all && !status; g.first += g.chunk) {
    g.chunk = pw_min64(g.chunk, all - g.first);
    status = pw_run_tasks(api, ctx, pw_gemm_pack_task, g.b_batches * g.kblocks * g.chunk, &g);
    if (!status) status = pw_run_tasks(api, ctx, pw_gemm_task, g.batches * g.mblocks, &g);
  }
  free(g.packed);
  if (!status && out_of_memory) return pw_error(&kernel, "out of memory for a packed operand");
  return status;
}

/* One op per operand layout and types: PW_MATMUL_OP(name, TRANS_A, TRANS_B, A's, B's and C's
 * type: PW_FLOAT or PW_BF16, ROUND: a float32 C holds its values rounded to bfloat16, EXACT:
 * float32 products) defines name_compute and the type lists; the unit's PW_KERNEL line names
 * the op. */
#define PW_MATMUL_OP(name, TA, TB, A, B, C, ROUND, EXACT)                                                   \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) { \
    return pw_bf16_matmul(api, ctx, def, TA, TB, ROUND, EXACT);                                            \
  }                                                                                                         \
  static const int name##_types[] = {A, B, PW_FLOAT}; /* a third input: a float32 bias, [N] */            \
  static const int name##_out_types[] = {C};                                                                \
  static const int name##_none[] = {0, 0, 0}
#if PW_GEMM_BF16
#define PW_BF16_MATMUL(name, TA, TB, A, B, C, ROUND) PW_MATMUL_OP(name, TA, TB, A, B, C, ROUND, 0)
#else
#define PW_BF16_MATMUL(name, TA, TB, A, B, C, ROUND) \
  _Static_assert(0, "a bfloat16 product needs a compiler targeting AVX512-BF16")
#endif
#define PW_F32_MATMUL(name, TA, TB) PW_MATMUL_OP(name, TA, TB, PW_FLOAT, PW_FLOAT, PW_FLOAT, 0, 1)

#endif /* ORT_DYNAMO_BF16_GEMM_H */
