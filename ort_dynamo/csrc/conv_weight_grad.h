/* conv_weight_grad.h -- a convolution's weight gradient as one float32 product whose input
 * columns are read straight from the input, never stored (ONNX Runtime custom op, CPU).
 *
 * decompositions.py writes dL/dW of a one-group convolution as ONNX's Conv of the input by the
 * output gradient, both with their first two axes swapped, and the result's swapped back. ORT
 * runs that Conv as an im2col and a product only as wide as the taps (16 of a 3x3 layer's 25 ms
 * at 8x64x32x32); the input's columns stacked by Slices and a Concat, then one product, took
 * half its time to stack them (benchmarks/layer_ops.py --profile conv3x3_64). Here it is
 *
 *     C[(c, t), co] = sum over (n, o) of x[n, c, t A + o B - P] gy[n, co, o]
 *
 * (per spatial axis: tap t, output position o, the Conv's strides A and dilations B, pads P
 * before; outside the input, zeros): M = input channels x taps, K = images x output positions,
 * N = output channels, with bf16_gemm.h's float32 register tile. Each task packs its rows of A
 * from the input, a chunk of K at a time, each row one contiguous run (bf16_gemm.h's KC blocks
 * cut output rows apart, and packing took 4x as long), so the columns exist only in its packed
 * rows; B (the output gradient) is packed once, by 16 x 16 transposes. The result leaves as the
 * Conv's, [c, co, t], or as the Transpose after it would have left it, [co, c, t]. Each element
 * is summed over K in the same order whatever the threads (K's parts are fixed by the sizes).
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_CONV_WEIGHT_GRAD_H
#define ORT_DYNAMO_CONV_WEIGHT_GRAD_H
#include "bf16_gemm.h"
#include "conv.h" /* pw_strided_load, pw_conv_lanes; group_conv.h's pw_conv_range */

typedef struct PwWeightGrad {
  const float *x, *gy;
  float *c, *packed;          /* C: [part][M, N] scratch; B's panels: [N panel][K block][KC][NR] */
  int64_t images, cin, cout;  /* N, Cin, Cout of the convolution */
  int64_t x_image, x_channel; /* elements between the input's images, its channels */
  int64_t in[3], out[3], taps[3];  /* per spatial axis (1-D and 2-D as 3-D, leading axes of 1) */
  int64_t step_t[3], step_o[3], pad[3];
  int64_t T, O, M, K, kblocks, npanels, mblocks, panel_rows;
  int64_t splits, part; /* K in `splits` parts of `part` (a multiple of the chunk), each summed into its own C */
  float* result;         /* the output: C's rows in blocks of `rows`, each block transposed */
  int64_t rows, blocks;  /* swapped: one block of all M rows; else one per input channel, T rows */
  int* out_of_memory;
} PwWeightGrad;

/* Values n of row m = (c, t) of A from K index k0 into dst (contiguous; up to 15 floats past
 * the n may be written): the input read at each output position for this tap, zeros where that
 * falls outside the input. Output rows are walked in order, not divided out per row; each 16
 * values are one load and store (for a stride of 2, conv.h's two loads and a permute: 12% off
 * conv3x3_s2's kernel against element by element), a masked load only at a row's edges. */
static void pw_weight_grad_row(const PwWeightGrad* g, int64_t m, int64_t k0, int64_t n, float* restrict dst,
                              __m512i steps) {
  const int64_t c = m / g->T, t = m % g->T;
  const int64_t t0 = t / (g->taps[1] * g->taps[2]), t1 = t / g->taps[2] % g->taps[1], t2 = t % g->taps[2];
  const int64_t width = g->out[2], s2 = g->step_o[2], first2 = t2 * g->step_t[2] - g->pad[2];
  int64_t lo, hi; /* the output positions o2 whose input column first2 + o2 s2 lies inside [0, in[2]) */
  pw_conv_range(g->in[2], s2, first2, width, &lo, &hi);
  const int64_t line = k0 / width;
  int64_t o2 = k0 % width, o1 = line % g->out[1], o0 = line / g->out[1] % g->out[0];
  int64_t image = line / g->out[1] / g->out[0];
  for (int64_t j = 0; j < n;) {
    const int64_t p0 = t0 * g->step_t[0] + o0 * g->step_o[0] - g->pad[0];
    const int64_t p1 = t1 * g->step_t[1] + o1 * g->step_o[1] - g->pad[1];
    const float* src = g->x + image * g->x_image + c * g->x_channel + (p0 * g->in[1] + p1) * g->in[2] + first2;
    const int64_t take = pw_min64(width - o2, n - j); /* this line's values; the next line overwrites past them */
    float* out = dst + j - o2;                         /* position o2 of the line at out + o2 */
    if (p0 < 0 || p0 >= g->in[0] || p1 < 0 || p1 >= g->in[1]) {
      for (int64_t q = o2; q < o2 + take; q += 16) _mm512_storeu_ps(out + q, _mm512_setzero_ps());
    } else {
      for (int64_t q = o2; q < o2 + take; q += 16) {
        __m512 v;
        if (q >= lo && q + 16 <= hi && s2 == 1)
          v = _mm512_loadu_ps(src + q);
        else {
          const __mmask16 m16 = pw_conv_lanes(pw_min64(lo > q ? lo - q : 0, 16), pw_min64(hi - q, 16));
          v = m16 ? pw_strided_load(_mm512_setzero_ps(), m16, src + q * s2, s2, steps) : _mm512_setzero_ps();
        }
        _mm512_storeu_ps(out + q, v);
      }
    }
    j += take;
    o2 = 0;
    if (++o1 == g->out[1]) {
      o1 = 0;
      if (++o0 == g->out[0]) {
        o0 = 0;
        ++image;
      }
    }
  }
}

/* r[j] = column j of the 16 x 16 block r (rows r[0..15]). */
static inline void pw_transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) { /* r[i + p], 128-bit lane L: column 4 L + p of rows i..i+3 */
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int p = 0; p < 4; ++p) {
    const __m512 a = _mm512_shuffle_f32x4(r[p], r[4 + p], 0x88), b = _mm512_shuffle_f32x4(r[p], r[4 + p], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + p], r[12 + p], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + p], r[12 + p], 0xdd);
    t[p] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[8 + p] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[4 + p] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + p] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}

/* Task t packs one K block of one N panel of B: B[k, co] = gy[n, co, o] for k = (n, o), 16 k
 * of one image at a time as 16 x 16 transposes (element by element, reading gy's 32 rows at
 * once, 4 KB apart, conv3x3's kernel took 5.4 ms, not 4.7: benchmarks/convolution.py). */
static void pw_weight_grad_pack_b(void* user, size_t t) {
  const PwWeightGrad* g = (const PwWeightGrad*)user;
  const int64_t kb = (int64_t)t % g->kblocks, j = (int64_t)t / g->kblocks;
  const int64_t k0 = kb * PW_GEMM_KC, kc = pw_min64(g->K - k0, PW_GEMM_KC);
  const int64_t co0 = j * PW_GEMM_NR, nr = pw_min64(g->cout - co0, PW_GEMM_NR);
  float* restrict dst = g->packed + ((j * g->kblocks) + kb) * g->panel_rows * PW_GEMM_NR;
  for (int64_t k = 0; k < kc;) {
    const int64_t n = (k0 + k) / g->O, o = (k0 + k) % g->O;
    const float* src = g->gy + (n * g->cout + co0) * g->O + o;
    if (k + 16 <= kc && o + 16 <= g->O) {
      for (int h = 0; h < 2; ++h) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = 16 * h + i < nr ? _mm512_loadu_ps(src + (16 * h + i) * g->O) : _mm512_setzero_ps();
        pw_transpose16(r);
        for (int q = 0; q < 16; ++q) _mm512_storeu_ps(dst + (k + q) * PW_GEMM_NR + 16 * h, r[q]);
      }
      k += 16;
      continue;
    }
    int64_t col = 0;
    for (; col < nr; ++col) dst[k * PW_GEMM_NR + col] = src[col * g->O];
    for (; col < PW_GEMM_NR; ++col) dst[k * PW_GEMM_NR + col] = 0.0f;
    ++k;
  }
}

/* K a task packs and multiplies at a time: its rows of A (48 x 1024 floats) and the chunk's B
 * panels stay in L2, where the whole of K (16K at 4x64x64x64) streamed from L3 (111 against 150
 * GF/s). Each chunk's sums are added to C. A row of A is one run of the chunk (packed a line of
 * output positions at a time, not a KC block), the rows 16 floats more apart than the chunk so
 * that the tile's 12 rows do not share one L1 set. */
enum { PW_WG_CHUNK = 4 * PW_GEMM_KC, PW_WG_ROW = PW_WG_CHUNK + 16 };
PW_GEMM_TILE_F32(pw_weight_grad_tile, pa[r * PW_WG_ROW + k])

/* Task t: MC rows of one part of K's C over every N panel, a chunk at a time, their A packed
 * from the input. */
static void pw_weight_grad_task(void* user, size_t t) {
  const PwWeightGrad* g = (const PwWeightGrad*)user;
  const int64_t split = (int64_t)t % g->splits, m0 = (int64_t)t / g->splits * PW_GEMM_MC;
  const int64_t mc = pw_min64(g->M - m0, PW_GEMM_MC), first = split * g->part;
  const int64_t end = pw_min64(g->K, first + g->part);
  float* part_c = g->c + split * g->M * g->cout;
  const int64_t tiles = (mc + PW_GEMM_MR - 1) / PW_GEMM_MR, a_tile = PW_GEMM_MR * PW_WG_ROW;
  float* pa = (float*)aligned_alloc(64, (size_t)(tiles * a_tile + 16) * sizeof(float)); /* 16: a row's overrun */
  if (!pa) {
    __atomic_store_n(g->out_of_memory, 1, __ATOMIC_RELAXED);
    return;
  }
  float sums[PW_GEMM_MR * PW_GEMM_NR];
  const __m512i steps = pw_lane_steps(g->step_o[2]);
  for (int64_t k0 = first; k0 < end; k0 += PW_WG_CHUNK) {
    const int64_t span = pw_min64(end - k0, PW_WG_CHUNK);
    for (int64_t i = 0; i < tiles; ++i)
      for (int64_t r = 0; r < PW_GEMM_MR; ++r) {
        const int64_t m = m0 + i * PW_GEMM_MR + r;
        float* dst = pa + i * a_tile + r * PW_WG_ROW;
        if (m < m0 + mc)
          pw_weight_grad_row(g, m, k0, span, dst, steps);
        else
          memset(dst, 0, (size_t)span * sizeof(float));
      }
    for (int64_t j = 0; j < g->npanels; ++j) {
      const float* panel = g->packed + (j * g->kblocks + k0 / PW_GEMM_KC) * g->panel_rows * PW_GEMM_NR;
      const int64_t nr = pw_min64(g->cout - j * PW_GEMM_NR, PW_GEMM_NR);
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t mr = pw_min64(mc - i * PW_GEMM_MR, PW_GEMM_MR);
        float* c = part_c + (m0 + i * PW_GEMM_MR) * g->cout + j * PW_GEMM_NR;
        /* the chunk's B blocks lie one after another: one block of `span` rows */
        pw_weight_grad_tile(pa + i * a_tile, 0, panel, 0, 1, span, span, NULL, k0 > first ? sums : c,
                            k0 > first ? PW_GEMM_NR : g->cout, mr, nr);
        if (k0 > first)
          for (int64_t r = 0; r < mr; ++r)
            for (int64_t col = 0; col < nr; ++col) c[r * g->cout + col] += sums[r * PW_GEMM_NR + col];
      }
    }
  }
  free(pa);
}

/* Task t: 16 rows of one block of C, each part's sum added in order, into the output
 * transposed ([Cout, rows] per block): [co, c, t] is C's [(c, t), co] as one block, [c, co, t]
 * one block per input channel. 16 x 16 at a time, where element by element (one thread, the
 * output's writes M floats apart) took 11% of conv3x3_deep's kernel. */
static void pw_weight_grad_result(void* user, size_t t) {
  const PwWeightGrad* g = (const PwWeightGrad*)user;
  const int64_t per_block = (g->rows + 15) / 16, block = (int64_t)t / per_block, r0 = (int64_t)t % per_block * 16;
  const int64_t n = pw_min64(g->rows - r0, 16);
  const float* c = g->c + (block * g->rows + r0) * g->cout;
  float* out = g->result + block * g->rows * g->cout + r0;
  for (int64_t co0 = 0; co0 < g->cout; co0 += 16) {
    const __mmask16 cols = pw_conv_lanes(0, pw_min64(g->cout - co0, 16));
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) {
      r[i] = _mm512_setzero_ps();
      if (i >= n) continue;
      for (int64_t split = 0; split < g->splits; ++split)
        r[i] = _mm512_add_ps(r[i], _mm512_maskz_loadu_ps(cols, c + split * g->M * g->cout + i * g->cout + co0));
    }
    pw_transpose16(r);
    for (int64_t j = 0; j < pw_min64(g->cout - co0, 16); ++j)
      _mm512_mask_storeu_ps(out + (co0 + j) * g->rows, pw_conv_lanes(0, n), r[j]);
  }
}

/* Inputs x [N, Cin, spatial...] (`x_swapped`: [Cin, N, spatial...], as the Conv reads it) and gy
 * [N, Cout, output spatial...]; the Conv's attributes per spatial axis (strides A, dilations B,
 * pads before P and after E) and the taps kept (W, the layer's window; 0: all the Conv's, which
 * a stride-2 layer over an even size has one more of); output [Cin, Cout, taps...], or ([Cout,
 * Cin, taps...]) `swapped`. */
static inline OrtStatus* pw_conv_weight_grad(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def,
                                             int spatial, int x_swapped, int swapped, const int64_t* steps_t,
                                             const int64_t* steps_o, const int64_t* before, const int64_t* after,
                                             const int64_t* window) {
  const PwKernel kernel = {api, def};
  const OrtValue *x, *y;
  int64_t xd[PW_MAX_RANK], yd[PW_MAX_RANK], od[PW_MAX_RANK];
  size_t xr = 0, yr = 0;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &x));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 1, &y));
  PW_TRY(pw_shape(api, x, xd, &xr));
  PW_TRY(pw_shape(api, y, yd, &yr));
  if ((int)xr != spatial + 2 || (int)yr != spatial + 2 || xd[x_swapped] != yd[0])
    return pw_error(&kernel, "the input and the output gradient must have the convolution's axes and images");
  PwWeightGrad g = {0};
  g.images = xd[x_swapped];
  g.cin = xd[1 - x_swapped];
  g.cout = yd[1];
  g.T = g.O = 1;
  for (int d = 0; d < 3; ++d) {
    const int a = d - (3 - spatial); /* the spatial axis of this one, < 0: a leading axis of 1 */
    g.in[d] = a < 0 ? 1 : xd[2 + a];
    g.out[d] = a < 0 ? 1 : yd[2 + a];
    g.step_t[d] = a < 0 ? 1 : steps_t[a];
    g.step_o[d] = a < 0 ? 1 : steps_o[a];
    g.pad[d] = a < 0 ? 0 : before[a];
    const int64_t span = g.step_o[d] * (g.out[d] - 1) + 1, padded = g.in[d] + g.pad[d] + (a < 0 ? 0 : after[a]);
    g.taps[d] = g.out[d] >= 1 && padded >= span ? (padded - span) / g.step_t[d] + 1 : 0;
    if (g.taps[d] < 1) return pw_error(&kernel, "the output gradient is larger than the input allows");
    if (a >= 0 && window[a] > 0 && window[a] < g.taps[d]) g.taps[d] = window[a];
    g.T *= g.taps[d];
    g.O *= g.out[d];
    if (a >= 0) od[2 + a] = g.taps[d];
  }
  const int64_t plane = g.in[0] * g.in[1] * g.in[2];
  g.x_image = x_swapped ? plane : g.cin * plane;
  g.x_channel = x_swapped ? g.images * plane : plane;
  od[0] = swapped ? g.cout : g.cin;
  od[1] = swapped ? g.cin : g.cout;
  OrtValue* output;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, od, (size_t)spatial + 2, &output));
  void* data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(output, &data));
  float* out = (float*)data;
  g.M = g.cin * g.T;
  g.K = g.images * g.O;
  if (g.M == 0 || g.cout == 0) return NULL;
  if (g.K == 0) {
    memset(out, 0, (size_t)(g.M * g.cout) * sizeof(float));
    return NULL;
  }
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)x, &data));
  g.x = (const float*)data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)y, &data));
  g.gy = (const float*)data;
  g.kblocks = (g.K + PW_GEMM_KC - 1) / PW_GEMM_KC;
  g.panel_rows = pw_min64(PW_GEMM_KC, g.K);
  g.npanels = (g.cout + PW_GEMM_NR - 1) / PW_GEMM_NR;
  g.mblocks = (g.M + PW_GEMM_MC - 1) / PW_GEMM_MC;
  /* Few rows of C (a stem's 3 channels x 49 taps: 4 tasks of 48 rows, the last of 3) leave
   * threads idle: K is split into parts, chunks each, until there are 16 tasks, each part's C
   * summed in order at the end (the same sums whatever the threads), at most 4 MB of them:
   * the stem's kernel 4.5 -> 4.3 ms on 2 threads; more threads than row blocks gain more. */
  const int64_t chunks = (g.K + PW_WG_CHUNK - 1) / PW_WG_CHUNK;
  g.splits = pw_min64(pw_min64((16 + g.mblocks - 1) / g.mblocks, chunks), (1 << 20) / (g.M * g.cout) + 1);
  g.part = (chunks + g.splits - 1) / g.splits * PW_WG_CHUNK;
  g.splits = (g.K + g.part - 1) / g.part;
  g.packed = (float*)aligned_alloc(64, (size_t)(g.npanels * g.kblocks * g.panel_rows * PW_GEMM_NR) * sizeof(float));
  g.c = (float*)malloc((size_t)(g.splits * g.M * g.cout) * sizeof(float));
  if (!g.packed || !g.c) {
    free(g.packed);
    free(g.c);
    return pw_error(&kernel, "out of memory for the packed output gradient");
  }
  int out_of_memory = 0;
  g.out_of_memory = &out_of_memory;
  OrtStatus* status = pw_run_tasks(api, ctx, pw_weight_grad_pack_b, g.npanels * g.kblocks, &g);
  if (!status) status = pw_run_tasks(api, ctx, pw_weight_grad_task, g.mblocks * g.splits, &g);
  g.result = out;
  g.rows = swapped ? g.M : g.T;
  g.blocks = swapped ? 1 : g.cin;
  if (!status && !out_of_memory)
    status = pw_run_tasks(api, ctx, pw_weight_grad_result, g.blocks * ((g.rows + 15) / 16), &g);
  free(g.packed);
  free(g.c);
  if (!status && out_of_memory) return pw_error(&kernel, "out of memory for the packed input columns");
  return status;
}

/* One weight gradient: SPATIAL axes (1 to 3); X_SWAPPED: the input arrives with its first two
 * axes swapped; SWAPPED: the output's first two axes swapped; per axis (three given, the first
 * SPATIAL used) the Conv's strides (steps between taps), dilations (between output positions),
 * pads before and after, and the taps kept (0: all). Defines name_compute and the type lists;
 * the unit's PW_KERNEL line names the op. */
#define PW_CONV_WEIGHT_GRAD(name, SPATIAL, X_SWAPPED, SWAPPED, A0, A1, A2, B0, B1, B2, P0, P1, P2, E0, E1, E2, W0, W1, \
                            W2)                                                                                   \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) {      \
    static const int64_t steps_t[] = {A0, A1, A2}, steps_o[] = {B0, B1, B2};                                     \
    static const int64_t before[] = {P0, P1, P2}, after[] = {E0, E1, E2}, window[] = {W0, W1, W2};               \
    return pw_conv_weight_grad(api, ctx, def, SPATIAL, X_SWAPPED, SWAPPED, steps_t, steps_o, before, after,       \
                               window);                                                                           \
  }                                                                                                              \
  static const int name##_types[] = {PW_FLOAT, PW_FLOAT};                                                        \
  static const int name##_none[] = {0, 0}
#endif /* ORT_DYNAMO_CONV_WEIGHT_GRAD_H */
