/* axis_softmax.h -- softmax and log-softmax over an axis other than the last, and their
 * gradients, as ONNX Runtime custom ops (float32).
 *
 * A segmentation loss takes its log-softmax over the channels of [N, C, H, W]. ORT's CPU kernel
 * moves that axis last and back, and runs rows as short as the classes; written out as
 * reductions over the axis and elementwise kernels, it is five passes over the tensor. Here the
 * tensor is [outer, C, inner]: each task takes blocks of neighbouring inner positions and does
 * the passes over the channels in cache, vectorized across the block. The arithmetic is eager's:
 * max, exp(x - max) summed channel by channel, x - max - log(sum) or exp(x - max) / sum;
 * gradients g - exp(y) * sum(g) and g * y - y * sum(g * y). A generated unit
 * (ort_dynamo/_op_kernels.py) instantiates PW_AXIS_SOFTMAX per kind, axis and channel count.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_AXIS_SOFTMAX_H
#define ORT_DYNAMO_AXIS_SOFTMAX_H
#include "pointwise.h"

/* Inner positions per block: as many as keep the block's C * block values within PW_AXIS_KEEP
 * floats (64 KiB), 16 to 1024. A block's channels lie inner * 4 bytes apart, a multiple of 4 KiB
 * for most maps, so they fall in a few cache sets and evict each other between passes: the
 * first pass copies the block into a contiguous `keep`, which the later passes read; the
 * longer the block, the longer each channel's run of reads from memory. */
#define PW_AXIS_KEEP 16384
#define PW_AXIS_MOST 1024
#define PW_AXIS_BLOCK(C) \
  ((PW_AXIS_KEEP / (C)) >= PW_AXIS_MOST ? PW_AXIS_MOST : (PW_AXIS_KEEP / (C)) >= 16 ? (PW_AXIS_KEEP / (C)) & ~15 : 16)

enum { PW_SOFTMAX, PW_LOG_SOFTMAX, PW_SOFTMAX_GRAD, PW_LOG_SOFTMAX_GRAD, PW_LOG_SOFTMAX_ONE_HOT_GRAD };

typedef struct PwAxisSoftmax {
  const float* a; /* x, or the gradient g */
  const float* b; /* the forward's result y (gradients only) */
  float* out;
  /* PW_LOG_SOFTMAX_ONE_HOT_GRAD: g = (c == index ? hit : miss) * scale, index and scale one
   * value per [outer, inner] position (a cross-entropy's target and its gradient). */
  const int64_t* index;
  const float* scale;
  float hit, miss;
  int64_t inner, blocks, items, items_per_task;
} PwAxisSoftmax;

/* One block of n inner positions at `at` (the offset of channel 0; `row` without the channels),
 * B apart in `keep`. n is B where the block is full, a constant there, so the loops over it
 * vectorize. */
static inline __attribute__((always_inline)) void pw_axis_block(const PwAxisSoftmax* s, int64_t at, int64_t row,
                                                                int64_t n, int64_t B, int64_t C, int kind,
                                                                float* restrict keep_a, float* restrict keep_b) {
  const int64_t inner = s->inner;
  const float* restrict a = s->a ? s->a + at : NULL;
  const float* restrict b = s->b ? s->b + at : NULL;
  float* restrict out = s->out + at;
  float peak[PW_AXIS_MOST], total[PW_AXIS_MOST];
  for (int64_t j = 0; j < n; ++j) total[j] = 0.0f;
  /* The block's values, kept or read again where they are. */
  const float* restrict ka = keep_a ? keep_a : a;
  const float* restrict kb = keep_b ? keep_b : b;
  const int64_t ks = keep_a ? B : inner;
  if (kind == PW_SOFTMAX || kind == PW_LOG_SOFTMAX) {
    for (int64_t j = 0; j < n; ++j) peak[j] = -INFINITY;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < n; ++j) {
        const float v = a[c * inner + j];
        if (keep_a) keep_a[c * B + j] = v;
        peak[j] = v > peak[j] || v != v ? v : peak[j]; /* a NaN stays the max: its column is NaN */
      }
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < n; ++j) {
        const float e = pw_expf(ka[c * ks + j] - peak[j]);
        total[j] += e;
        if (kind == PW_SOFTMAX) out[c * inner + j] = e;
      }
    if (kind == PW_SOFTMAX) {
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < n; ++j) out[c * inner + j] /= total[j];
    } else {
      for (int64_t j = 0; j < n; ++j) total[j] = logf(total[j]);
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < n; ++j) out[c * inner + j] = (ka[c * ks + j] - peak[j]) - total[j];
    }
  } else if (kind == PW_LOG_SOFTMAX_ONE_HOT_GRAD) { /* the graph's g, computed where it is read */
    const int64_t* restrict index = s->index + row;
    const float* restrict scale = s->scale + row;
    const float hit = s->hit, miss = s->miss;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < n; ++j) total[j] += (c == index[j] ? hit : miss) * scale[j];
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < n; ++j)
        out[c * inner + j] = (c == index[j] ? hit : miss) * scale[j] - pw_expf(b[c * inner + j]) * total[j];
  } else if (kind == PW_LOG_SOFTMAX_GRAD) {
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < n; ++j) {
        const float g = a[c * inner + j];
        if (keep_a) keep_a[c * B + j] = g;
        total[j] += g;
      }
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < n; ++j) out[c * inner + j] = ka[c * ks + j] - pw_expf(b[c * inner + j]) * total[j];
  } else { /* torch's decomposition: p = g * y, p - y * sum(p) */
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < n; ++j) {
        const float g = a[c * inner + j], y = b[c * inner + j];
        if (keep_a) {
          keep_a[c * B + j] = g;
          keep_b[c * B + j] = y;
        }
        total[j] += g * y;
      }
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < n; ++j) {
        const float y = kb[c * ks + j];
        out[c * inner + j] = ka[c * ks + j] * y - y * total[j];
      }
  }
}

static inline __attribute__((always_inline)) void pw_axis_task(const PwAxisSoftmax* s, size_t t, int64_t C,
                                                               int kind) {
  const int64_t B = PW_AXIS_BLOCK(C); /* constants once inlined */
  const int64_t keep = kind != PW_LOG_SOFTMAX_ONE_HOT_GRAD && C * B <= PW_AXIS_KEEP;
  float keep_a[keep ? C * B : 1], keep_b[keep && kind == PW_SOFTMAX_GRAD ? C * B : 1];
  float* restrict ka = keep ? keep_a : NULL;
  float* restrict kb = keep && kind == PW_SOFTMAX_GRAD ? keep_b : NULL;
  const int64_t first = (int64_t)t * s->items_per_task;
  const int64_t end = first + s->items_per_task < s->items ? first + s->items_per_task : s->items;
  for (int64_t item = first; item < end; ++item) {
    const int64_t outer = item / s->blocks, j = item % s->blocks * B;
    const int64_t at = outer * C * s->inner + j, row = outer * s->inner + j;
    if (s->inner - j >= B)
      pw_axis_block(s, at, row, B, B, C, kind, ka, kb);
    else
      pw_axis_block(s, at, row, s->inner - j, B, C, kind, ka, kb);
  }
}

/* Reads the inputs (x; g and y, of one shape; or the index, the scale and y, the first two of
 * y's shape but for one value along the axis), checks the axis holds C values, allocates the
 * output and runs `task` over the blocks. */
static inline __attribute__((always_inline)) OrtStatus* pw_axis_softmax_compute(
    const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def, void (*task)(void*, size_t), int64_t axis,
    int64_t C, int kind, float hit, float miss) {
  const PwKernel kernel = {api, def};
  const int one_hot = kind == PW_LOG_SOFTMAX_ONE_HOT_GRAD;
  const int inputs = one_hot ? 3 : kind == PW_SOFTMAX_GRAD || kind == PW_LOG_SOFTMAX_GRAD ? 2 : 1;
  const OrtValue* in[3];
  int64_t dims[PW_MAX_RANK], other[PW_MAX_RANK];
  size_t rank = 0, other_rank = 0;
  void* data[3];
  for (int i = 0; i < inputs; ++i) PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, i, &in[i]));
  PW_TRY(pw_shape(api, in[inputs - 1], dims, &rank)); /* x or y: the output's shape */
  if (rank > PW_MAX_RANK || (int64_t)rank <= axis + 1 || dims[axis] != C) {
    char message[160];
    snprintf(message, sizeof message, "the input must have more than %lld axes and %lld values along axis %lld",
             (long long)axis + 1, (long long)C, (long long)axis);
    return pw_error(&kernel, message);
  }
  for (int i = 0; i < inputs - 1; ++i) {
    PW_TRY(pw_shape(api, in[i], other, &other_rank));
    int same = other_rank == rank;
    for (size_t d = 0; same && d < rank; ++d) same = other[d] == (one_hot && (int64_t)d == axis ? 1 : dims[d]);
    if (!same)
      return pw_error(&kernel, one_hot ? "the target and its scale must have the softmax's shape with one class"
                                       : "the gradient and the softmax's result must have one shape");
  }
  PwAxisSoftmax s = {0};
  int64_t outer = 1;
  s.inner = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= dims[d];
  for (size_t d = (size_t)axis + 1; d < rank; ++d) s.inner *= dims[d];
  OrtValue* output;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, dims, rank, &output));
  if (outer == 0 || s.inner == 0) return NULL;
  for (int i = 0; i < inputs; ++i) PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)in[i], &data[i]));
  if (one_hot) {
    s.index = (const int64_t*)data[0];
    s.scale = (const float*)data[1];
    s.b = (const float*)data[2];
    s.hit = hit;
    s.miss = miss;
  } else {
    s.a = (const float*)data[0];
    s.b = inputs == 2 ? (const float*)data[1] : NULL;
  }
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(output, &data[0]));
  s.out = (float*)data[0];
  s.blocks = (s.inner + PW_AXIS_BLOCK(C) - 1) / PW_AXIS_BLOCK(C);
  s.items = outer * s.blocks;
  s.items_per_task = pw_per_task(3 * C * PW_AXIS_BLOCK(C));
  return pw_run_tasks(api, ctx, task, pw_task_count(s.items, s.items_per_task), &s);
}

/* One op: KIND (PW_SOFTMAX ...) over axis AXIS of C values. Defines name_compute and the type
 * lists; the generated unit's PW_KERNEL line names the op. */
#define PW_AXIS_SOFTMAX(name, KIND, AXIS, C)                                                                 \
  static void name##_task(void* user, size_t t) { pw_axis_task((const PwAxisSoftmax*)user, t, C, KIND); }    \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) { \
    return pw_axis_softmax_compute(api, ctx, def, name##_task, AXIS, C, KIND, 0.0f, 0.0f);                  \
  }                                                                                                         \
  static const int name##_types[] = {PW_FLOAT, PW_FLOAT};                                                   \
  static const int name##_none[] = {0, 0}

/* The log-softmax's gradient where g is a one-hot of the target: (c == index ? HIT : MISS) * scale
 * (float literals), inputs (index, scale, y). */
#define PW_AXIS_LOG_SOFTMAX_ONE_HOT_GRAD(name, AXIS, C, HIT, MISS)                                           \
  static void name##_task(void* user, size_t t) {                                                           \
    pw_axis_task((const PwAxisSoftmax*)user, t, C, PW_LOG_SOFTMAX_ONE_HOT_GRAD);                            \
  }                                                                                                         \
  static OrtStatus* name##_compute(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) { \
    return pw_axis_softmax_compute(api, ctx, def, name##_task, AXIS, C, PW_LOG_SOFTMAX_ONE_HOT_GRAD, HIT, MISS); \
  }                                                                                                         \
  static const int name##_types[] = {PW_INT64, PW_FLOAT, PW_FLOAT};                                         \
  static const int name##_none[] = {0, 0, 0}

#endif /* ORT_DYNAMO_AXIS_SOFTMAX_H */
