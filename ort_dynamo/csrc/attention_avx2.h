/* attention_avx2.h -- attention.h's hot loops for CPUs with AVX2 and FMA but not AVX-512 (AMD
 * Zen 1-3, Intel client CPUs): the products' register tiles, the key and value blocks'
 * transposes and the softmax passes over a row, in vectors of 8 floats. attention.h includes it in place of its generic versions, whose 64-byte
 * vectors GCC lowers for such a target through the stack (a load and a store around each
 * operation: 9x eager's attention). Same arithmetic, same results up to the order of the sums.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_ATTENTION_AVX2_H
#define ORT_DYNAMO_ATTENTION_AVX2_H
#include <immintrin.h>

/* pw_att_tile's product, one vector of 16 columns wide (PW_ATT_TILE_VECS): 6 rows x 2 halves are
 * 12 of the 16 registers, the y row 2, the broadcast 1. */
PW_ATT_INLINE void pw_att_tile(const int R, const int V, int64_t K, const float* restrict x, int64_t xi, int64_t xk,
                               const float* restrict y, int64_t ys, float* restrict c, int64_t cs, int add) {
  __m256 acc[PW_ATT_TILE][2];
  (void)V;
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) acc[r][h] = add ? _mm256_loadu_ps(c + r * cs + 8 * h) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 y0 = _mm256_loadu_ps(y + k * ys), y1 = _mm256_loadu_ps(y + k * ys + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * xi + k * xk);
      acc[r][0] = _mm256_fmadd_ps(xr, y0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, y1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + r * cs + 8 * h, acc[r][h]);
}

/* attention.h's pw_att_transpose: out[d * ld + j] = in[j * rs + d] for j < n, 0 up to np (a
 * multiple of 16); D a multiple of 16. By blocks of 8 x 8. */
static void pw_att_transpose(const float* restrict in, int64_t rs, int64_t n, int64_t D, float* restrict out,
                             int64_t np, int64_t ld) {
  for (int64_t j0 = 0; j0 < np; j0 += 8)
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8], t[8];
      for (int j = 0; j < 8; ++j) r[j] = j0 + j < n ? _mm256_loadu_ps(in + (j0 + j) * rs + d0) : _mm256_setzero_ps();
      for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
      }
      for (int j = 0; j < 8; j += 4) {
        r[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int d = 0; d < 4; ++d) {
        _mm256_storeu_ps(out + (d0 + d) * ld + j0, _mm256_permute2f128_ps(r[d], r[d + 4], 0x20));
        _mm256_storeu_ps(out + (d0 + d + 4) * ld + j0, _mm256_permute2f128_ps(r[d], r[d + 4], 0x31));
      }
    }
}

static inline float pw_att_hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

static inline float pw_att_hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

/* pw_att_exp on 8 lanes: e^x for x <= 0, -inf or NaN; FMAs, no overflow clamp. */
PW_ATT_INLINE __m256 pw_att_exp8(__m256 v) {
  const __m256 lo = _mm256_set1_ps(PW_EXP_LN_FLT_MIN);
  const __m256 c = _mm256_max_ps(v, lo);                     /* NaN: lo (maxps's second operand), replaced below */
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(PW_EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(PW_EXP_LN2_HI), c);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(PW_EXP_LN2_LO), r);
  __m256 p = _mm256_set1_ps(PW_EXP_P5);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(PW_EXP_P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(PW_EXP_P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(PW_EXP_P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(PW_EXP_P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(PW_EXP_P0));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  /* c >= ln FLT_MIN: n >= -126, 2^n a normal float */
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(v, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(y, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* attention.h's pw_att_scores: row s[0:np] scaled and masked in place (keys from n on -inf), its
 * max returned, NaN if a score is NaN. */
PW_ATT_INLINE float pw_att_scores(float* restrict s, int64_t np, int64_t n, const void* mask_row, int64_t mask_step,
                                  int mask_kind, float scale) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY), scales = _mm256_set1_ps(scale);
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), keys = _mm256_set1_ps((float)n);
  __m256 peak = minus_inf, nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j < n; j += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), scales);
    const int whole = j + 8 <= n;
    if (mask_kind == 1) {
      const float* m = (const float*)mask_row;
      __m256 add;
      if (mask_step == 1 && whole) {
        add = _mm256_loadu_ps(m + j);
      } else {
        float part[8];
        for (int l = 0; l < 8; ++l) part[l] = j + l < n ? m[(j + l) * mask_step] : 0.0f;
        add = _mm256_loadu_ps(part);
      }
      x = _mm256_add_ps(x, add);
    } else if (mask_kind == 2) {
      const uint8_t* m = (const uint8_t*)mask_row;
      float keep[8];
      for (int l = 0; l < 8; ++l) keep[l] = j + l < n && m[(j + l) * mask_step] ? 1.0f : 0.0f;
      x = _mm256_blendv_ps(minus_inf, x, _mm256_cmp_ps(_mm256_loadu_ps(keep), _mm256_setzero_ps(), _CMP_NEQ_OQ));
    }
    if (!whole) x = _mm256_blendv_ps(minus_inf, x, _mm256_cmp_ps(_mm256_add_ps(lanes, _mm256_set1_ps((float)j)), keys, _CMP_LT_OQ));
    _mm256_storeu_ps(s + j, x);
    peak = _mm256_max_ps(x, peak); /* a NaN x leaves peak: maxps's second operand */
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  for (; j < np; j += 8) _mm256_storeu_ps(s + j, minus_inf); /* past the keys: neither read nor masked */
  if (_mm256_movemask_ps(nan)) return NAN;
  return pw_att_hmax8(peak);
}

/* attention.h's pw_att_exp_row: row[j] = e^(row[j] - peak), j < nr; their sum. */
PW_ATT_INLINE float pw_att_exp_row(float* restrict row, int64_t nr, float peak) {
  const __m256 peaks = _mm256_set1_ps(peak);
  __m256 sums = _mm256_setzero_ps();
  for (int64_t j = 0; j < nr; j += 8) {
    const __m256 e = pw_att_exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), peaks));
    _mm256_storeu_ps(row + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  return pw_att_hsum8(sums);
}

/* attention.h's pw_att_dot. */
PW_ATT_INLINE float pw_att_dot(const float* restrict a, const float* restrict b, int64_t D) {
  __m256 dots = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) dots = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), dots);
  return pw_att_hsum8(dots);
}

/* attention.h's pw_att_grad_row: p = e^(s - lse) into row, ds = p (dp - di) scale into drow. */
PW_ATT_INLINE void pw_att_grad_row(float* restrict row, float* restrict drow, int64_t nr, float lse, float di,
                                   float scale) {
  const __m256 lses = _mm256_set1_ps(lse), dis = _mm256_set1_ps(di), scales = _mm256_set1_ps(scale);
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t j = 0; j < nr; j += 8) {
    const __m256 p = pw_att_exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), lses)); /* masked: exp(-inf) = 0 */
    _mm256_storeu_ps(row + j, p);
    /* Past the tile's keys dp was not computed: what is there must not reach ds. */
    const __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(drow + j), dis)), scales);
    _mm256_storeu_ps(drow + j, _mm256_blendv_ps(zero, ds, _mm256_cmp_ps(p, zero, _CMP_NEQ_UQ)));
  }
}

#endif
