/* max_pool.h -- torch's max pooling with indices as one ONNX Runtime custom op (float32).
 *
 * ONNX's MaxPool skips NaN and numbers its indices across the whole tensor; with an Indices
 * output, ORT computes it in a generic loop, not in its blocked layout (8.5 ms for ResNet's stem:
 * benchmarks/layer_ops.py --profile max_pool2d). This computes what torch's CPU kernel does, in one pass: per (n, c) plane, each window's
 * value and the index within the plane of its first maximum in row-major order, or of its last
 * NaN. A generated unit (ort_dynamo/_op_kernels.py) instantiates PW_MAX_POOL once per
 * pooling, its sizes compile-time constants, so the window loops unroll.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_MAX_POOL_H
#define ORT_DYNAMO_MAX_POOL_H
#include "pointwise.h"

typedef struct PwPool {
  const float* x;
  float* y;
  int64_t* at;
  int64_t in[3], out[3]; /* (D, H, W); axes the pooling has not are 1 */
  int64_t planes, planes_per_task;
} PwPool;

/* torch's output size (pooling_output_shape), or -1 if the window does not fit. */
static inline int64_t pw_pool_size(int64_t n, int64_t k, int64_t s, int64_t p, int64_t e, int64_t d, int ceil) {
  const int64_t span = n + p + e - d * (k - 1) - 1;
  if (span < 0) return -1;
  int64_t o = (ceil ? span + s - 1 : span) / s + 1;
  if (ceil && (o - 1) * s >= n + p) --o; /* the last window must start inside the input */
  return o;
}

/* The first input position a window starting at `start` reads, and one past its last. */
static inline __attribute__((always_inline)) void pw_pool_window(int64_t start, int64_t k, int64_t d, int64_t n,
                                                                 int64_t* first, int64_t* end) {
  int64_t last = start + (k - 1) * d + 1;
  *end = last < n ? last : n;
  while (start < 0) start += d;
  *first = start;
}

static inline __attribute__((always_inline)) void pw_pool_planes(
    const PwPool* a, size_t t, int64_t K0, int64_t K1, int64_t K2, int64_t S0, int64_t S1, int64_t S2, int64_t P0,
    int64_t P1, int64_t P2, int64_t D0, int64_t D1, int64_t D2) {
  const int64_t c0 = (int64_t)t * a->planes_per_task;
  const int64_t c1 = c0 + a->planes_per_task < a->planes ? c0 + a->planes_per_task : a->planes;
  const int64_t H = a->in[1], W = a->in[2], plane = a->in[0] * H * W;
  const int64_t OD = a->out[0], OH = a->out[1], OW = a->out[2], out_plane = OD * OH * OW;
  /* Output columns whose windows lie inside the row: constant trip counts there. */
  int64_t ow_lo = (P2 + S2 - 1) / S2, ow_hi = W - (K2 - 1) * D2 + P2 > 0 ? (W - (K2 - 1) * D2 - 1 + P2) / S2 + 1 : 0;
  if (ow_hi > OW) ow_hi = OW;
  if (ow_lo > ow_hi) ow_lo = ow_hi;
  for (int64_t c = c0; c < c1; ++c) {
    const float* restrict x = a->x + c * plane;
    float* restrict y = a->y + c * out_plane;
    int64_t* restrict at = a->at + c * out_plane;
    for (int64_t od = 0; od < OD; ++od) {
      int64_t d0, d1;
      pw_pool_window(od * S0 - P0, K0, D0, a->in[0], &d0, &d1);
      for (int64_t oh = 0; oh < OH; ++oh) {
        int64_t h0, h1;
        pw_pool_window(oh * S1 - P1, K1, D1, H, &h0, &h1);
        const int64_t o = (od * OH + oh) * OW;
        for (int64_t ow = 0; ow < OW; ++ow) {
          if (ow == ow_lo && ow_lo < ow_hi) {
            /* Interior columns: window row by window row, each a pass over these columns
             * (constant strides: it vectorizes), the running maxima kept in the outputs. */
            for (int64_t c2 = ow_lo; c2 < ow_hi; ++c2) {
              y[o + c2] = -INFINITY;
              at[o + c2] = (d0 * H + h0) * W + c2 * S2 - P2;
            }
            for (int64_t d = d0; d < d1; d += D0)
              for (int64_t h = h0; h < h1; h += D1) {
                const int64_t row = (d * H + h) * W - P2;
                for (int64_t c2 = ow_lo; c2 < ow_hi; ++c2) {
                  float best = y[o + c2];
                  int64_t where = at[o + c2];
                  for (int64_t kw = 0; kw < K2; ++kw) {
                    const int64_t i = row + c2 * S2 + kw * D2;
                    const float v = x[i];
                    const int take = (v > best) | (v != v);
                    best = take ? v : best;
                    where = take ? i : where;
                  }
                  y[o + c2] = best;
                  at[o + c2] = where;
                }
              }
            ow = ow_hi;
            if (ow >= OW) break;
          }
          int64_t w0, w1;
          pw_pool_window(ow * S2 - P2, K2, D2, W, &w0, &w1);
          float best = -INFINITY;
          int64_t where = (d0 * H + h0) * W + w0;
          for (int64_t d = d0; d < d1; d += D0)
            for (int64_t h = h0; h < h1; h += D1)
              for (int64_t w = w0; w < w1; w += D2) {
                const int64_t i = (d * H + h) * W + w;
                const float v = x[i];
                if (v > best || v != v) {
                  best = v;
                  where = i;
                }
              }
          y[o + ow] = best;
          at[o + ow] = where;
        }
      }
    }
  }
}

/* Allocates the values and indices (out_dims), points `a` at them and at the input, and runs
 * `task` over the [N, C] planes, each `work` elements of reading. */
static inline __attribute__((always_inline)) OrtStatus* pw_pool_run(const OrtApiTable* api, OrtKernelContext* ctx,
                                                                    const OrtValue* input, const int64_t* dims,
                                                                    const int64_t* out_dims, size_t rank, PwPool* a,
                                                                    int64_t work, void (*task)(void*, size_t)) {
  OrtValue *values, *indices;
  void* data;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, out_dims, rank, &values));
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 1, out_dims, rank, &indices));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)input, &data));
  a->x = (const float*)data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(values, &data));
  a->y = (float*)data;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(indices, &data));
  a->at = (int64_t*)data;
  a->planes = dims[0] * dims[1];
  a->planes_per_task = pw_per_task(work);
  return pw_run_tasks(api, ctx, task, pw_task_count(a->planes, a->planes_per_task), a);
}

/* Reads x (rank 2 + spatial), allocates the values and indices, runs `task` over the planes. */
static inline __attribute__((always_inline)) OrtStatus* pw_pool_compute(
    const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def, void (*task)(void*, size_t), int spatial,
    const int64_t* k, const int64_t* s, const int64_t* p, const int64_t* e, const int64_t* d, int ceil) {
  const PwKernel kernel = {api, def};
  char message[128];
  const OrtValue* input;
  int64_t dims[PW_MAX_RANK];
  size_t rank = 0;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &input));
  PW_TRY(pw_shape(api, input, dims, &rank));
  if (rank != (size_t)spatial + 2) {
    snprintf(message, sizeof message, "the input must have %d axes, not %d", spatial + 2, (int)rank);
    return pw_error(&kernel, message);
  }
  PwPool a = {0};
  int64_t out_dims[PW_MAX_RANK] = {dims[0], dims[1]};
  for (int i = 0; i < 3; ++i) {
    const int axis = i - (3 - spatial); /* spatial axis, or < 0 for an axis the pooling has not */
    a.in[i] = axis < 0 ? 1 : dims[2 + axis];
    a.out[i] = axis < 0 ? 1 : pw_pool_size(a.in[i], k[i], s[i], p[i], e[i], d[i], ceil);
    if (a.out[i] < 1) {
      snprintf(message, sizeof message, "an input of size %lld is too small for the window", (long long)a.in[i]);
      return pw_error(&kernel, message);
    }
    if (axis >= 0) out_dims[2 + axis] = a.out[i];
  }
  return pw_pool_run(api, ctx, input, dims, out_dims, rank, &a,
                     a.out[0] * a.out[1] * a.out[2] * k[0] * k[1] * k[2] + a.in[0] * a.in[1] * a.in[2], task);
}

/* One pooling: per axis (D, H, W) kernel, stride, pad before, pad after, dilation. Defines
 * name_compute and the type lists; the generated unit's PW_KERNEL line names the op. */
#define PW_MAX_POOL(name, spatial, K0, K1, K2, S0, S1, S2, P0, P1, P2, E0, E1, E2, D0, D1, D2, CEIL)         \
  static void name##_task(void* user, size_t t) {                                                           \
    pw_pool_planes((const PwPool*)user, t, K0, K1, K2, S0, S1, S2, P0, P1, P2, D0, D1, D2);                 \
  }                                                                                                         \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) { \
    static const int64_t k[] = {K0, K1, K2}, s[] = {S0, S1, S2}, p[] = {P0, P1, P2}, e[] = {E0, E1, E2},      \
                         d[] = {D0, D1, D2};                                                                \
    return pw_pool_compute(api, ctx, def, name##_task, spatial, k, s, p, e, d, CEIL);                        \
  }                                                                                                         \
  static const int name##_types[] = {PW_FLOAT};                                                             \
  static const int name##_out_types[] = {PW_FLOAT, PW_INT64};                                               \
  static const int name##_none[] = {0, 0}

/* Adaptive max pooling over windows that overlap (56 positions into 6 windows of 10 or 11):
 * ``decompositions._adaptive_max_pool`` gathers each axis's windows at their largest size into
 * tiles (a shorter window repeats its last position), max-pools the tiles and looks each tile
 * index up in a table of plane positions. This reads the windows where they are, through the
 * same per-axis tables (rd, rh, rw: K positions per output, constants of the unit), and writes
 * the plane position of each maximum: what the chain computes, without the gathered copies. */
static inline __attribute__((always_inline)) void pw_gathered_pool_planes(const PwPool* a, size_t t, int64_t KD,
                                                                          int64_t KH, int64_t KW, const int64_t* rd,
                                                                          const int64_t* rh, const int64_t* rw) {
  const int64_t c0 = (int64_t)t * a->planes_per_task;
  const int64_t c1 = c0 + a->planes_per_task < a->planes ? c0 + a->planes_per_task : a->planes;
  const int64_t H = a->in[1], W = a->in[2], plane = a->in[0] * H * W;
  const int64_t OD = a->out[0], OH = a->out[1], OW = a->out[2], out_plane = OD * OH * OW;
  for (int64_t c = c0; c < c1; ++c) {
    const float* restrict x = a->x + c * plane;
    float* restrict y = a->y + c * out_plane;
    int64_t* restrict at = a->at + c * out_plane;
    /* Window row by window row, each a pass over the output row's windows (independent
     * chains), the running maxima kept in the outputs, as pw_pool_planes' interior does. */
    for (int64_t od = 0; od < OD; ++od)
      for (int64_t oh = 0; oh < OH; ++oh) {
        float* restrict yo = y + (od * OH + oh) * OW;
        int64_t* restrict ao = at + (od * OH + oh) * OW;
        for (int64_t ow = 0; ow < OW; ++ow) {
          yo[ow] = -INFINITY;
          ao[ow] = (rd[od * KD] * H + rh[oh * KH]) * W + rw[ow * KW];
        }
        for (int64_t i = 0; i < KD; ++i)
          for (int64_t j = 0; j < KH; ++j) {
            const int64_t row = (rd[od * KD + i] * H + rh[oh * KH + j]) * W;
            for (int64_t ow = 0; ow < OW; ++ow) {
              const int64_t* restrict cols = rw + ow * KW;
              float best = yo[ow];
              int64_t where = ao[ow];
              for (int64_t l = 0; l < KW; ++l) {
                const int64_t p = row + cols[l];
                const float v = x[p];
                const int take = (v > best) | (v != v); /* the first maximum, or the last NaN */
                best = take ? v : best;
                where = take ? p : where;
              }
              yo[ow] = best;
              ao[ow] = where;
            }
          }
      }
  }
}

/* Checks the input is [N, C, <in>] (spatial axes, as constants), allocates the values and
 * positions [N, C, <out>] and runs `task` over the planes. */
static inline __attribute__((always_inline)) OrtStatus* pw_gathered_pool_compute(
    const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def, void (*task)(void*, size_t), int spatial,
    const int64_t* k, const int64_t* in, const int64_t* out) {
  const PwKernel kernel = {api, def};
  const OrtValue* input;
  int64_t dims[PW_MAX_RANK];
  size_t rank = 0;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &input));
  PW_TRY(pw_shape(api, input, dims, &rank));
  int fits = rank == (size_t)spatial + 2;
  for (int i = 0; fits && i < spatial; ++i) fits = dims[2 + i] == in[3 - spatial + i];
  if (!fits) return pw_error(&kernel, "the input's spatial sizes are not the ones its windows were made for");
  PwPool a = {0};
  int64_t out_dims[PW_MAX_RANK] = {dims[0], dims[1]};
  for (int i = 0; i < 3; ++i) {
    a.in[i] = in[i];
    a.out[i] = out[i];
    if (i >= 3 - spatial) out_dims[2 + i - (3 - spatial)] = out[i];
  }
  return pw_pool_run(api, ctx, input, dims, out_dims, rank, &a, out[0] * out[1] * out[2] * k[0] * k[1] * k[2], task);
}

/* One adaptive pooling over gathered windows: per axis (D, H, W) the window's size K, the
 * output's size O and the input's I (1, 1, I for an axis the pooling has not); the unit defines
 * name##_rd, name##_rh and name##_rw (O * K positions each) before this. */
#define PW_GATHERED_MAX_POOL(name, spatial, KD, KH, KW, OD, OH, OW, ID, IH, IW)                              \
  static void name##_task(void* user, size_t t) {                                                           \
    pw_gathered_pool_planes((const PwPool*)user, t, KD, KH, KW, name##_rd, name##_rh, name##_rw);           \
  }                                                                                                         \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) { \
    static const int64_t k[] = {KD, KH, KW}, in[] = {ID, IH, IW}, out[] = {OD, OH, OW};                     \
    return pw_gathered_pool_compute(api, ctx, def, name##_task, spatial, k, in, out);                       \
  }                                                                                                         \
  static const int name##_types[] = {PW_FLOAT};                                                             \
  static const int name##_out_types[] = {PW_FLOAT, PW_INT64};                                               \
  static const int name##_none[] = {0, 0}

#endif /* ORT_DYNAMO_MAX_POOL_H */
