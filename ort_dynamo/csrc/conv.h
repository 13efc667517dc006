/* conv.h -- a one-group convolution as one float32 product whose columns are read straight
 * from the input, never stored (ONNX Runtime custom op, CPU).
 *
 * ORT's Conv stores the input's columns (im2col) and multiplies them with MLAS: 5.9 ms of a 3x3
 * layer at 8x64x32x32 (benchmarks/layer_ops.py --profile conv3x3), about 100 GF/s, where its
 * products alone run near 180. Here it is
 *
 *     y[n, co, o] = b[co] + sum over (c, t) of w[co, c, t] x[n, c, o A + t B - P]
 *
 * (per spatial axis: output position o, tap t, the Conv's strides A and dilations B, pads P
 * before; outside the input, zeros): M = output channels, K = input channels x taps, N = images
 * x output positions, with bf16_gemm.h's float32 blocking and register tile. The weight is A,
 * packed once; each task packs its panels of B (32 output positions over all of K) from the
 * input with masked loads (for a stride of 2, two loads and the even lanes picked out; for other
 * strides, a gather), so the columns exist only in its packed panel, and stores C straight into
 * y's [n, co, o] layout. A panel's positions may span rows and images. Each element is summed
 * over K in the same order whatever the threads.
 *
 * A stride-1 ConvTranspose (how decompositions.py writes a stride-1 layer's input gradient) is
 * this Conv of its input by the flipped, swapped weight, which the kernel reads in place
 * (`transposed`): so it covers both of a layer's passes that are not its weight gradient
 * (conv_weight_grad.h).
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_CONV_H
#define ORT_DYNAMO_CONV_H
#include "bf16_gemm.h"
#include "group_conv.h" /* pw_conv_range */

typedef struct PwConv {
  const float *x, *w, *b;
  float *y, *pa;                 /* pa: the weight packed, [M tile][K block][MR][KC] */
  int64_t images, cin, cout, T, O, K, columns; /* columns: images x output positions */
  int64_t x_image, plane;        /* elements between the input's images, its channels */
  int64_t in[3], out[3], taps[3], stride[3], dilation[3], pad[3]; /* 1-D and 2-D as 3-D */
  int64_t kblocks, mtiles, panels, per_task;
  int transposed; /* w is a stride-1 ConvTranspose's, [Cin, Cout, taps...]: read flipped and swapped */
  int* out_of_memory;
} PwConv;

/* Task t packs the weight's rows of M tile t: A as a stored [Cout, Cin x taps] matrix, or,
 * `transposed`, A[co, (c, t)] = w[c, co, T - 1 - t]. */
static void pw_conv_pack_a(void* user, size_t t) {
  const PwConv* g = (const PwConv*)user;
  const int64_t m0 = (int64_t)t * PW_GEMM_MR, rows = pw_min64(g->cout - m0, PW_GEMM_MR);
  for (int64_t kb = 0; kb < g->kblocks; ++kb) {
    float* dst = g->pa + ((int64_t)t * g->kblocks + kb) * PW_GEMM_MR * PW_GEMM_KC;
    const int64_t k0 = kb * PW_GEMM_KC, kc = pw_min64(g->K - k0, PW_GEMM_KC);
    if (!g->transposed) {
      pw_gemm_pack_a_f32(dst, g->w, g->K, 0, m0, rows, k0, kc);
      continue;
    }
    for (int64_t r = 0; r < PW_GEMM_MR; ++r)
      for (int64_t k = 0; k < PW_GEMM_KC; ++k) {
        const int64_t c = (k0 + k) / g->T, t = (k0 + k) % g->T;
        dst[r * PW_GEMM_KC + k] = r < rows && k < kc ? g->w[(c * g->cout + m0 + r) * g->T + g->T - 1 - t] : 0.0f;
      }
  }
}

/* Lanes [lo, hi) of a 16-lane half as a mask. */
static inline __mmask16 pw_conv_lanes(int64_t lo, int64_t hi) {
  return hi <= lo ? 0 : (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
}

/* v with lanes j of mask m set to src[j s] (others not read): a masked load where s is 1; where
 * it is 2 (a stride-2 layer), two masked loads of the 32 floats and the even ones picked out (a
 * gather there made conv3x3_s2's forward 3.2 ms, not 2.1); else a gather (`steps`: j s per lane). */
static inline __m512 pw_strided_load(__m512 v, __mmask16 m, const float* src, int64_t s, __m512i steps) {
  if (s == 1) return _mm512_mask_loadu_ps(v, m, src);
  if (s == 2) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)_pdep_u32(m & 0xffu, 0x5555u), src);
    const __m512 hi = _mm512_maskz_loadu_ps((__mmask16)_pdep_u32(m >> 8, 0x5555u), src + 16);
    return _mm512_mask_mov_ps(v, m, _mm512_permutex2var_ps(lo, even, hi));
  }
  return _mm512_mask_i32gather_ps(v, m, steps, src, 4);
}

/* j s for lanes j = 0..15. */
static inline __m512i pw_lane_steps(int64_t s) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32((int)s));
}

/* B's panel of columns [q0, q0 + 32) over all of K, as [K][NR]: row k = (c, t) holds the
 * input that tap t of channel c reads at each of the panel's output positions (zeros outside
 * the input, and past the last column). */
static void pw_conv_pack_b(const PwConv* g, int64_t q0, float* restrict dst) {
  /* runs: lanes of one output row (n, o0, o1), o2 counting from run_o2 */
  int64_t run_lane[PW_GEMM_NR], run_len[PW_GEMM_NR], run_o2[PW_GEMM_NR], run_x[PW_GEMM_NR], run_o0[PW_GEMM_NR],
      run_o1[PW_GEMM_NR];
  int runs = 0;
  const int64_t width = g->out[2];
  for (int64_t lane = 0; lane < PW_GEMM_NR && q0 + lane < g->columns; ++runs) {
    const int64_t q = q0 + lane, n = q / g->O, o = q % g->O, line = o / width;
    run_lane[runs] = lane;
    run_o2[runs] = o % width;
    run_len[runs] = pw_min64(pw_min64(width - run_o2[runs], PW_GEMM_NR - lane), g->columns - q);
    run_o0[runs] = line / g->out[1];
    run_o1[runs] = line % g->out[1];
    run_x[runs] = n * g->x_image;
    lane += run_len[runs];
  }
  const int64_t s2 = g->stride[2];
  const __m512i steps = pw_lane_steps(s2);
  for (int64_t t = 0; t < g->T; ++t) {
    const int64_t t0 = t / (g->taps[1] * g->taps[2]), t1 = t / g->taps[2] % g->taps[1], t2 = t % g->taps[2];
    const int64_t first2 = t2 * g->dilation[2] - g->pad[2];
    int64_t lo, hi;
    pw_conv_range(g->in[2], s2, first2, width, &lo, &hi);
    /* per half of the panel: the segments it reads, as a lane mask and the input index of lane 0 */
    __mmask16 masks[2][PW_GEMM_NR];
    int64_t bases[2][PW_GEMM_NR];
    int count[2] = {0, 0};
    for (int r = 0; r < runs; ++r) {
      const int64_t p0 = run_o0[r] * g->stride[0] + t0 * g->dilation[0] - g->pad[0];
      const int64_t p1 = run_o1[r] * g->stride[1] + t1 * g->dilation[1] - g->pad[1];
      const int64_t a = run_o2[r] > lo ? run_o2[r] : lo, b = pw_min64(run_o2[r] + run_len[r], hi);
      if (p0 < 0 || p0 >= g->in[0] || p1 < 0 || p1 >= g->in[1] || b <= a) continue;
      const int64_t lane_a = run_lane[r] + a - run_o2[r], lane_b = lane_a + b - a;
      const int64_t row = run_x[r] + (p0 * g->in[1] + p1) * g->in[2] + first2; /* input index of o2 = 0 */
      for (int h = 0; h < 2; ++h) {
        const __mmask16 m = pw_conv_lanes(pw_min64(lane_a > 16 * h ? lane_a - 16 * h : 0, 16),
                                          pw_min64(lane_b > 16 * h ? lane_b - 16 * h : 0, 16));
        if (!m) continue;
        masks[h][count[h]] = m;
        bases[h][count[h]++] = row + (a + 16 * h - lane_a) * s2; /* lane j reads bases + j s2 */
      }
    }
    for (int64_t c = 0; c < g->cin; ++c) {
      const float* xc = g->x + c * g->plane;
      float* restrict row = dst + (c * g->T + t) * PW_GEMM_NR;
      for (int h = 0; h < 2; ++h) {
        __m512 v = _mm512_setzero_ps();
        for (int i = 0; i < count[h]; ++i) v = pw_strided_load(v, masks[h][i], xc + bases[h][i], s2, steps);
        _mm512_storeu_ps(row + 16 * h, v);
      }
    }
  }
}

/* Task t: `per_task` panels of 32 columns, each packed, multiplied by every M tile of the
 * weight, and stored with the bias into y. */
static void pw_conv_task(void* user, size_t t) {
  const PwConv* g = (const PwConv*)user;
  float* pb = (float*)aligned_alloc(64, (size_t)(g->K * PW_GEMM_NR) * sizeof(float));
  if (!pb) {
    __atomic_store_n(g->out_of_memory, 1, __ATOMIC_RELAXED);
    return;
  }
  const int64_t a_block = PW_GEMM_MR * PW_GEMM_KC, rows = pw_min64(PW_GEMM_KC, g->K);
  const int64_t last = g->K - (g->kblocks - 1) * PW_GEMM_KC;
  float sums[PW_GEMM_MR * PW_GEMM_NR];
  for (int64_t p = (int64_t)t * g->per_task; p < pw_min64(((int64_t)t + 1) * g->per_task, g->panels); ++p) {
    const int64_t q0 = p * PW_GEMM_NR;
    pw_conv_pack_b(g, q0, pb);
    for (int64_t i = 0; i < g->mtiles; ++i) {
      const int64_t mr = pw_min64(g->cout - i * PW_GEMM_MR, PW_GEMM_MR);
      pw_gemm_tile_rows_f32(g->pa + i * g->kblocks * a_block, a_block, pb, rows * PW_GEMM_NR, g->kblocks, rows,
                            last, NULL, sums, PW_GEMM_NR, mr, PW_GEMM_NR);
      /* the panel's columns image by image: lanes [l0, l1) are positions o0 + (lane - l0) of image n */
      for (int64_t l0 = 0; l0 < PW_GEMM_NR && q0 + l0 < g->columns;) {
        const int64_t n = (q0 + l0) / g->O, o0 = (q0 + l0) % g->O;
        const int64_t l1 = pw_min64(pw_min64(l0 + g->O - o0, PW_GEMM_NR), g->columns - q0);
        for (int64_t r = 0; r < mr; ++r) {
          const int64_t co = i * PW_GEMM_MR + r;
          const __m512 bias = _mm512_set1_ps(g->b ? g->b[co] : 0.0f);
          float* y = g->y + (n * g->cout + co) * g->O + o0 - l0; /* lane l's element: y[l] */
          for (int h = 0; h < 2; ++h) {
            const __mmask16 m = pw_conv_lanes(pw_min64(l0 > 16 * h ? l0 - 16 * h : 0, 16),
                                              pw_min64(l1 > 16 * h ? l1 - 16 * h : 0, 16));
            if (m)
              _mm512_mask_storeu_ps(y + 16 * h, m,
                                    _mm512_add_ps(_mm512_loadu_ps(sums + r * PW_GEMM_NR + 16 * h), bias));
          }
        }
        l0 = l1;
      }
    }
  }
  free(pb);
}

/* Inputs x [N, Cin, spatial...], w [Cout, Cin, taps...] (`transposed`: [Cin, Cout, taps...],
 * a stride-1 ConvTranspose's, which is this Conv by the flipped, swapped weight) and, `bias`, b
 * [Cout]; the Conv's attributes per spatial axis (strides A, dilations B, pads before P and after
 * E: for a ConvTranspose, the equivalent Conv's); output y [N, Cout, output spatial...]. */
static inline OrtStatus* pw_conv(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def, int spatial,
                                 int transposed, int bias, const int64_t* strides, const int64_t* dilations,
                                 const int64_t* before, const int64_t* after) {
  const PwKernel kernel = {api, def};
  const OrtValue *x, *w, *b = NULL;
  int64_t xd[PW_MAX_RANK], wd[PW_MAX_RANK], bd[PW_MAX_RANK], yd[PW_MAX_RANK];
  size_t xr = 0, wr = 0, br = 0;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &x));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 1, &w));
  PW_TRY(pw_shape(api, x, xd, &xr));
  PW_TRY(pw_shape(api, w, wd, &wr));
  if ((int)xr != spatial + 2 || (int)wr != spatial + 2 || xd[1] != wd[transposed ? 0 : 1])
    return pw_error(&kernel, "the input and the weight must have the convolution's axes and input channels");
  if (bias) {
    PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 2, &b));
    PW_TRY(pw_shape(api, b, bd, &br));
    if (br != 1 || bd[0] != wd[transposed ? 1 : 0])
      return pw_error(&kernel, "the bias must have one value per output channel");
  }
  PwConv g = {0};
  g.transposed = transposed;
  g.images = xd[0];
  g.cin = xd[1];
  g.cout = wd[transposed ? 1 : 0];
  g.T = g.O = 1;
  yd[0] = g.images;
  yd[1] = g.cout;
  for (int d = 0; d < 3; ++d) {
    const int a = d - (3 - spatial); /* the spatial axis of this one, < 0: a leading axis of 1 */
    g.in[d] = a < 0 ? 1 : xd[2 + a];
    g.taps[d] = a < 0 ? 1 : wd[2 + a];
    g.stride[d] = a < 0 ? 1 : strides[a];
    g.dilation[d] = a < 0 ? 1 : dilations[a];
    g.pad[d] = a < 0 ? 0 : before[a];
    const int64_t span = g.dilation[d] * (g.taps[d] - 1) + 1, padded = g.in[d] + g.pad[d] + (a < 0 ? 0 : after[a]);
    if (g.taps[d] < 1) return pw_error(&kernel, "the weight has an empty window");
    if (padded < span) return pw_error(&kernel, "the window is larger than the padded input");
    g.out[d] = (padded - span) / g.stride[d] + 1;
    g.T *= g.taps[d];
    g.O *= g.out[d];
    if (a >= 0) yd[2 + a] = g.out[d];
  }
  OrtValue* output;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, yd, (size_t)spatial + 2, &output));
  void* data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(output, &data));
  g.y = (float*)data;
  g.K = g.cin * g.T;
  g.columns = g.images * g.O;
  if (g.columns == 0 || g.cout == 0) return NULL;
  g.plane = g.in[0] * g.in[1] * g.in[2];
  g.x_image = g.cin * g.plane;
  if (b) {
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)b, &data));
    g.b = (const float*)data;
  }
  if (g.K == 0) { /* no input channels: the bias alone */
    for (int64_t n = 0; n < g.images; ++n)
      for (int64_t co = 0; co < g.cout; ++co)
        for (int64_t o = 0; o < g.O; ++o) g.y[(n * g.cout + co) * g.O + o] = g.b ? g.b[co] : 0.0f;
    return NULL;
  }
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)x, &data));
  g.x = (const float*)data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)w, &data));
  g.w = (const float*)data;
  g.kblocks = (g.K + PW_GEMM_KC - 1) / PW_GEMM_KC;
  g.mtiles = (g.cout + PW_GEMM_MR - 1) / PW_GEMM_MR;
  g.panels = (g.columns + PW_GEMM_NR - 1) / PW_GEMM_NR;
  /* a few panels per task where there are many: one packed-panel buffer per task */
  g.per_task = g.panels >= 64 ? pw_min64(g.panels / 32, 8) : 1;
  g.pa = (float*)aligned_alloc(64, (size_t)(g.mtiles * g.kblocks * PW_GEMM_MR * PW_GEMM_KC) * sizeof(float));
  if (!g.pa) return pw_error(&kernel, "out of memory for the packed weight");
  int out_of_memory = 0;
  g.out_of_memory = &out_of_memory;
  OrtStatus* status = pw_run_tasks(api, ctx, pw_conv_pack_a, g.mtiles, &g);
  if (!status) status = pw_run_tasks(api, ctx, pw_conv_task, (g.panels + g.per_task - 1) / g.per_task, &g);
  free(g.pa);
  if (!status && out_of_memory) return pw_error(&kernel, "out of memory for a packed panel of the input");
  return status;
}

/* One convolution: SPATIAL axes (1 to 3); TRANSPOSED: a stride-1 ConvTranspose's weight; BIAS:
 * a third input; per axis (three given, the first SPATIAL used) the Conv's strides, dilations,
 * pads before and after. Defines name_compute and the type lists; the unit's PW_KERNEL line
 * names the op. */
#define PW_CONV(name, SPATIAL, TRANSPOSED, BIAS, A0, A1, A2, B0, B1, B2, P0, P1, P2, E0, E1, E2)             \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) { \
    static const int64_t strides[] = {A0, A1, A2}, dilations[] = {B0, B1, B2};                              \
    static const int64_t before[] = {P0, P1, P2}, after[] = {E0, E1, E2};                                   \
    return pw_conv(api, ctx, def, SPATIAL, TRANSPOSED, BIAS, strides, dilations, before, after);            \
  }                                                                                                         \
  static const int name##_types[] = {PW_FLOAT, PW_FLOAT, PW_FLOAT};                                         \
  static const int name##_none[] = {0, 0, 0}
#endif /* ORT_DYNAMO_CONV_H */
