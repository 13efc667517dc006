/* group_conv.h -- 2-D convolutions with one output channel per group as ONNX Runtime custom
 * ops (float32, NCHW): depthwise convolutions, forward and transposed (a depthwise
 * convolution's input gradient), and the batch-1 grouped convolution that decompositions.py
 * writes a depthwise convolution's weight gradient as.
 *
 * ORT's CPU Conv and ConvTranspose run each group of each image as its own im2col and GEMM:
 * for a depthwise convolution, a matrix-vector product per (image, channel). ConvNeXt's 7x7
 * layer at (8, 96, 56, 56) took ORT 175 ms a step, forward and backward, against eager's 143
 * (benchmarks/layer_ops.py depthwise_conv). These pad each (image, group) plane once and sum
 * the window over 8 outputs at a time, its sizes compile-time constants: 16 ms. A generated
 * unit (ort_dynamo/_op_kernels.py) instantiates PW_GROUP_CONV once per convolution. A size
 * given as -1 (symbolic in the graph: dynamic=True) is read off the tensors at run time.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_GROUP_CONV_H
#define ORT_DYNAMO_GROUP_CONV_H
#include "pointwise.h"

/* 8 floats (one AVX2 register, half an AVX-512 one), loaded and stored unaligned. A row's last
 * outputs (fewer than 8) are computed 8 at a time too, the lanes past the row dropped: their
 * loads run up to 7 floats past the padded planes, so each buffer has PW_SLACK zeros after. */
typedef float pw_f8 __attribute__((vector_size(32)));
enum { PW_SLACK = 8 };
static inline pw_f8 pw_load8(const float* p) {
  pw_f8 v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* out[0..8) = bias + sum over (i < K0, j < K1) of taps[i K1 + j] * rows[i R + j D] (rows: 8
 * consecutive outputs' windows, R floats between window rows). One accumulator per window
 * row (up to 16, then row i adds to i % 16), so that the additions are independent chains. */
static inline __attribute__((always_inline)) pw_f8 pw_window8(pw_f8 sum, const float* restrict taps,
                                                              const float* restrict rows, int64_t K0, int64_t K1,
                                                              int64_t R, int64_t D) {
  enum { CHAINS = 16 };
  pw_f8 acc[CHAINS];
  const int64_t chains = K0 < CHAINS ? K0 : CHAINS;
  for (int64_t i = 0; i < K0; ++i) {
    pw_f8 row = taps[i * K1] * pw_load8(rows + i * R);
    for (int64_t j = 1; j < K1; ++j) row += taps[i * K1 + j] * pw_load8(rows + i * R + j * D);
    acc[i % CHAINS] = i < CHAINS ? row : acc[i % CHAINS] + row;
  }
  for (int64_t i = 0; i < chains; ++i) sum += acc[i];
  return sum;
}

typedef struct PwGroupConv {
  const float *x, *w, *b;
  float* y;
  int64_t groups, per_group; /* groups; input channels per group (transposed: output channels) */
  int64_t planes, planes_per_task;
  int64_t k[2], sizes[4]; /* the window; the planes H, W, OH, OW (as PW_GROUP_CONV names them) */
  int* out_of_memory;     /* set by a task that could not allocate its padded plane */
} PwGroupConv;

/* [lo, hi): the outputs o whose input position o * s + offset lies in [0, n). */
static inline __attribute__((always_inline)) void pw_conv_range(int64_t n, int64_t s, int64_t offset, int64_t outs,
                                                                int64_t* lo, int64_t* hi) {
  int64_t first = offset >= 0 ? 0 : (-offset + s - 1) / s;
  int64_t last = n - 1 - offset < 0 ? -1 : (n - 1 - offset) / s; /* the last o inside */
  *lo = first;
  *hi = last + 1 < outs ? last + 1 : outs;
  if (*hi < *lo) *hi = *lo;
}

/* plane (rows x cols) copied into pad (prows x pcols, zeroed), row r at pad row r + top, column c
 * at pad column c + left; what falls outside pad is dropped. */
static inline void pw_pad_plane(const float* restrict plane, int64_t rows, int64_t cols, float* restrict pad,
                                int64_t prows, int64_t pcols, int64_t top, int64_t left) {
  memset(pad, 0, (size_t)(prows * pcols) * sizeof(float));
  int64_t c0 = left < 0 ? -left : 0, c1 = cols < pcols - left ? cols : pcols - left;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pr = r + top;
    if (pr < 0 || pr >= prows || c1 <= c0) continue;
    memcpy(pad + pr * pcols + c0 + left, plane + r * cols + c0, (size_t)(c1 - c0) * sizeof(float));
  }
}

/* y[n, g] = b[g] + sum over (m, i, j) of w[g, m, i, j] * x[n, g * per_group + m, oh S0 + i D0 - P0, ow S1 + j D1 - P1]:
 * each input plane zero-padded once, so that every tap reads a whole row without bounds tests. */
static inline __attribute__((always_inline)) void pw_group_conv_planes(
    const PwGroupConv* a, size_t t, int64_t K0, int64_t K1, int64_t S0, int64_t S1, int64_t P0, int64_t P1, int64_t D0,
    int64_t D1, int64_t H, int64_t W, int64_t OH, int64_t OW) {
  const int64_t p0 = (int64_t)t * a->planes_per_task;
  const int64_t p1 = p0 + a->planes_per_task < a->planes ? p0 + a->planes_per_task : a->planes;
  const int64_t M = a->per_group;
  const int64_t PH = (OH - 1) * S0 + (K0 - 1) * D0 + 1, PW = (OW - 1) * S1 + (K1 - 1) * D1 + 1;
  float* pad = (float*)malloc((size_t)(M * PH * PW + PW_SLACK + K1) * sizeof(float));
  if (!pad) {
    __atomic_store_n(a->out_of_memory, 1, __ATOMIC_RELAXED);
    return;
  }
  memset(pad + M * PH * PW, 0, PW_SLACK * sizeof(float));
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g = p % a->groups;
    for (int64_t m = 0; m < M; ++m) /* (n, g) -> channels g*M.. of image n */
      pw_pad_plane(a->x + (p * M + m) * H * W, H, W, pad + m * PH * PW, PH, PW, P0, P1);
    const float* restrict w = a->w + g * M * K0 * K1;
    float* restrict y = a->y + p * OH * OW;
    const float bias = a->b ? a->b[g] : 0.0f;
    if (OW < K1 && (S1 != 1 || OW < 4)) {
      /* Few outputs a row, a wide window (a weight gradient's, of a 3 x 3 convolution): per
       * output, the window's columns as separate sums (after the padded planes), added up at
       * the end. With 4 to 7 outputs a row (a 7 x 7 one's), 8 at a time below is 3x faster. */
      float* restrict part = pad + M * PH * PW + PW_SLACK;
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          for (int64_t j = 0; j < K1; ++j) part[j] = 0.0f;
          for (int64_t m = 0; m < M; ++m)
            for (int64_t i = 0; i < K0; ++i) {
              const float* restrict row = pad + (m * PH + oh * S0 + i * D0) * PW + ow * S1;
              const float* restrict taps = w + (m * K0 + i) * K1;
              for (int64_t j = 0; j < K1; ++j) part[j] += taps[j] * row[j * D1];
            }
          float sum = bias;
          for (int64_t j = 0; j < K1; ++j) sum += part[j];
          y[oh * OW + ow] = sum;
        }
      continue;
    }
    /* Many outputs a row (a forward depthwise convolution): with stride 1, 8 outputs at a
     * time, the window's rows summed in registers (16 chains at most); else one by one. */
    for (int64_t oh = 0; oh < OH; ++oh) {
      float* restrict out = y + oh * OW;
      int64_t ow = 0;
      if (S1 == 1)
        for (; ow < OW; ow += 8) {
          pw_f8 sum = (pw_f8){0} + bias;
          for (int64_t m = 0; m < M; ++m)
            sum = pw_window8(sum, w + m * K0 * K1, pad + (m * PH + oh * S0) * PW + ow, K0, K1, D0 * PW, D1);
          memcpy(out + ow, &sum, (size_t)(OW - ow < 8 ? OW - ow : 8) * sizeof(float));
        }
      for (; ow < OW; ++ow) {
        float sum = bias;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t i = 0; i < K0; ++i) {
            const float* restrict row = pad + (m * PH + oh * S0 + i * D0) * PW + ow * S1;
            for (int64_t j = 0; j < K1; ++j) sum += w[(m * K0 + i) * K1 + j] * row[j * D1];
          }
        out[ow] = sum;
      }
    }
  }
  free(pad);
}

/* The transposed convolution with one input channel per group (a depthwise convolution's input
 * gradient): x[n, g] (OH x OW) spread by w[g, m] into y[n, g * per_group + m] (H x W):
 * y[oh S0 - P0 + i D0, ow S1 - P1 + j D1] += w[g, m, i, j] x[oh, ow]. With stride 1, a
 * correlation with the flipped window over x padded once; else a scatter. */
static inline __attribute__((always_inline)) void pw_group_conv_transposed_planes(
    const PwGroupConv* a, size_t t, int64_t K0, int64_t K1, int64_t S0, int64_t S1, int64_t P0, int64_t P1, int64_t D0,
    int64_t D1, int64_t H, int64_t W, int64_t OH, int64_t OW) {
  const int64_t p0 = (int64_t)t * a->planes_per_task;
  const int64_t p1 = p0 + a->planes_per_task < a->planes ? p0 + a->planes_per_task : a->planes;
  /* stride 1: y[h, c] = sum w[i, j] x[h + P0 - i D0, c + P1 - j D1], x padded so that index >= 0 */
  const int64_t T0 = (K0 - 1) * D0 > P0 ? (K0 - 1) * D0 - P0 : 0, T1 = (K1 - 1) * D1 > P1 ? (K1 - 1) * D1 - P1 : 0;
  const int64_t PH = H + P0 + T0, PW = W + P1 + T1;
  const int gather = S0 == 1 && S1 == 1;
  /* the padded plane (stride 1) and its slack, the flipped window; each tap column's range */
  const int64_t planed = gather ? PH * PW + PW_SLACK : 0;
  float* pad = (float*)malloc((size_t)(planed + K0 * K1) * sizeof(float));
  int64_t* lo = (int64_t*)malloc((size_t)(2 * K1) * sizeof(int64_t));
  if (!pad || !lo) {
    free(pad);
    free(lo);
    __atomic_store_n(a->out_of_memory, 1, __ATOMIC_RELAXED);
    return;
  }
  if (gather) memset(pad + PH * PW, 0, PW_SLACK * sizeof(float));
  float* restrict flipped = pad + planed;
  int64_t* hi = lo + K1;
  for (int64_t j = 0; j < K1; ++j) pw_conv_range(W, S1, j * D1 - P1, OW, &lo[j], &hi[j]);
  for (int64_t q = p0 * a->per_group; q < p1 * a->per_group; ++q) { /* output plane (n, g * per_group + m) */
    const int64_t c = q % (a->groups * a->per_group);
    const float* restrict x = a->x + q / a->per_group * OH * OW;
    const float* restrict w = a->w + c * K0 * K1;
    float* restrict y = a->y + q * H * W;
    const float bias = a->b ? a->b[c] : 0.0f;
    if (gather) {
      if (q == p0 * a->per_group || q % a->per_group == 0) pw_pad_plane(x, OH, OW, pad, PH, PW, T0, T1);
      /* The flipped window: tap (i, j) reads pad row h + P0 + T0 - i D0, column col + P1 + T1 - j D1. */
      for (int64_t i = 0; i < K0 * K1; ++i) flipped[i] = w[K0 * K1 - 1 - i];
      const int64_t top = P0 + T0 - (K0 - 1) * D0, left = P1 + T1 - (K1 - 1) * D1;
      for (int64_t h = 0; h < H; ++h) {
        float* restrict out = y + h * W;
        const float* restrict rows = pad + (h + top) * PW + left;
        for (int64_t col = 0; col < W; col += 8) {
          const pw_f8 sum = pw_window8((pw_f8){0} + bias, flipped, rows + col, K0, K1, D0 * PW, D1);
          memcpy(out + col, &sum, (size_t)(W - col < 8 ? W - col : 8) * sizeof(float));
        }
      }
      continue;
    }
    for (int64_t o = 0; o < H * W; ++o) y[o] = bias;
    for (int64_t oh = 0; oh < OH; ++oh) {
      const float* restrict in = x + oh * OW;
      for (int64_t i = 0; i < K0; ++i) {
        const int64_t h = oh * S0 - P0 + i * D0;
        if (h < 0 || h >= H) continue;
        float* restrict row = y + h * W;
        for (int64_t j = 0; j < K1; ++j) {
          const float tap = w[i * K1 + j];
          const int64_t shift = j * D1 - P1;
          for (int64_t ow = lo[j]; ow < hi[j]; ++ow) row[ow * S1 + shift] += tap * in[ow];
        }
      }
    }
  }
  free(pad);
  free(lo);
}

/* A plane length on the other side of the convolution from n, < 1 if none (ONNX's formulas;
 * `after`: the pads after, for a transposed convolution the output padding less them). */
static inline int64_t pw_conv_length(int transposed, int64_t n, int64_t k, int64_t s, int64_t before, int64_t after,
                                     int64_t d) {
  const int64_t span = d * (k - 1) + 1;
  if (transposed) return s * (n - 1) + span - before + after;
  return n + before + after >= span ? (n + before + after - span) / s + 1 : 0;
}

/* Reads x, w (and b), checks their shapes against the sizes the kernel was built for (k: the
 * window; planes: H, W, OH, OW; -1: any, the size read or computed at run time), allocates y,
 * runs `task` over the (image, group) planes. */
static inline __attribute__((always_inline)) OrtStatus* pw_group_conv_compute(
    const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def, void (*task)(void*, size_t),
    int transposed, int bias, const int64_t* k, const int64_t* geometry, const int64_t* planes) {
  const PwKernel kernel = {api, def};
  const OrtValue *input, *weight, *shift = NULL;
  int64_t dims[PW_MAX_RANK], wdims[PW_MAX_RANK], bdims[PW_MAX_RANK];
  size_t rank = 0, wrank = 0, brank = 0;
  void* data;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &input));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 1, &weight));
  PW_TRY(pw_shape(api, input, dims, &rank));
  PW_TRY(pw_shape(api, weight, wdims, &wrank));
  if (rank != 4 || wrank != 4 || (k[0] >= 0 && wdims[2] != k[0]) || (k[1] >= 0 && wdims[3] != k[1]) ||
      wdims[2] < 1 || wdims[3] < 1)
    return pw_error(&kernel, "the input and the weight must have 4 axes, the weight the kernel's window");
  PwGroupConv a = {0};
  a.groups = wdims[0];
  a.per_group = wdims[1];
  a.k[0] = wdims[2];
  a.k[1] = wdims[3];
  const int64_t channels = transposed ? a.groups * a.per_group : a.groups;
  if (a.groups < 1 || a.per_group < 1 || dims[1] != (transposed ? a.groups : a.groups * a.per_group))
    return pw_error(&kernel, "the input's channels must be the groups times the weight's channels per group");
  if (bias) {
    PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 2, &shift));
    PW_TRY(pw_shape(api, shift, bdims, &brank));
    if (brank != 1 || bdims[0] != channels) return pw_error(&kernel, "the bias must have one value per output channel");
  }
  /* geometry: per axis stride, pad before, pads after (transposed: output padding less them), dilation */
  int64_t* in = transposed ? a.sizes + 2 : a.sizes;
  int64_t* out = transposed ? a.sizes : a.sizes + 2;
  const int64_t *built_in = transposed ? planes + 2 : planes, *built_out = transposed ? planes : planes + 2;
  for (int axis = 0; axis < 2; ++axis) {
    const int64_t* g = geometry + 4 * axis;
    in[axis] = dims[2 + axis];
    out[axis] = pw_conv_length(transposed, in[axis], a.k[axis], g[0], g[1], g[2], g[3]);
    if ((built_in[axis] >= 0 && in[axis] != built_in[axis]) || (built_out[axis] >= 0 && out[axis] != built_out[axis]))
      return pw_error(&kernel, "the input's height and width must be those the kernel was built for");
    if (in[axis] < 1 || out[axis] < 1)
      return pw_error(&kernel, "the input's height and width leave the convolution no output");
  }
  int64_t out_dims[4] = {dims[0], channels, transposed ? a.sizes[0] : a.sizes[2], transposed ? a.sizes[1] : a.sizes[3]};
  OrtValue* output;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, out_dims, 4, &output));
  a.planes = dims[0] * a.groups;
  if (a.planes == 0) return NULL;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)input, &data));
  a.x = (const float*)data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)weight, &data));
  a.w = (const float*)data;
  if (shift) {
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)shift, &data));
    a.b = (const float*)data;
  }
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(output, &data));
  a.y = (float*)data;
  a.planes_per_task = pw_per_task(a.per_group * a.sizes[2] * a.sizes[3] * a.k[0] * a.k[1] + a.sizes[0] * a.sizes[1]);
  int out_of_memory = 0;
  a.out_of_memory = &out_of_memory;
  PW_TRY(pw_run_tasks(api, ctx, task, pw_task_count(a.planes, a.planes_per_task), &a));
  return out_of_memory ? pw_error(&kernel, "out of memory for a padded plane") : NULL;
}

/* A size fixed when the kernel is built (a constant the loops unroll over), else read at run time. */
#define PW_CONV_SIZE(N, runtime) ((N) >= 0 ? (int64_t)(N) : (runtime))

/* One convolution: per axis (H, W) kernel, stride, pad before, pads after (transposed: the
 * output padding less the pads after) and dilation; BIAS: a third input; the planes, H x W
 * (the forward convolution's input, the transposed one's output) and OH x OW (the other
 * side). Sizes are constants, so that the loops over them unroll, or -1: read at run time.
 * Defines name_compute and the type lists; the generated unit's PW_KERNEL line names the op. */
#define PW_GROUP_CONV(name, TRANSPOSED, BIAS, K0, K1, S0, S1, P0, P1, A0, A1, D0, D1, H, W, OH, OW)              \
  static void name##_task(void* user, size_t t) {                                                           \
    const PwGroupConv* a = (const PwGroupConv*)user;                                                        \
    const int64_t k0 = PW_CONV_SIZE(K0, a->k[0]), k1 = PW_CONV_SIZE(K1, a->k[1]);                          \
    const int64_t h = PW_CONV_SIZE(H, a->sizes[0]), w = PW_CONV_SIZE(W, a->sizes[1]);                      \
    const int64_t oh = PW_CONV_SIZE(OH, a->sizes[2]), ow = PW_CONV_SIZE(OW, a->sizes[3]);                  \
    if (TRANSPOSED)                                                                                         \
      pw_group_conv_transposed_planes(a, t, k0, k1, S0, S1, P0, P1, D0, D1, h, w, oh, ow);                  \
    else                                                                                                    \
      pw_group_conv_planes(a, t, k0, k1, S0, S1, P0, P1, D0, D1, h, w, oh, ow);                             \
  }                                                                                                         \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) { \
    static const int64_t k[] = {K0, K1}, planes[] = {H, W, OH, OW};                                         \
    static const int64_t geometry[] = {S0, P0, A0, D0, S1, P1, A1, D1};                                     \
    return pw_group_conv_compute(api, ctx, def, name##_task, TRANSPOSED, BIAS, k, geometry, planes);        \
  }                                                                                                         \
  static const int name##_types[] = {PW_FLOAT, PW_FLOAT, PW_FLOAT};                                         \
  static const int name##_none[] = {0, 0, 0}

#endif /* ORT_DYNAMO_GROUP_CONV_H */
