/* pointwise.h -- what ort_dynamo's generated elementwise kernels are written against.
 *
 * Each generated kernel (ort_dynamo/_pointwise.py) is a translation unit of its own, compiled
 * once into an object file cached by its hash: two row functions and a PW_KERNEL definition.
 * A library links the kernels a model needs with pointwise_runtime.c, which turns each
 * definition into an ONNX Runtime custom op, and a table of them (PW_DEFINE_REGISTRATION).
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_POINTWISE_H
#define ORT_DYNAMO_POINTWISE_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#define PW_HIDDEN __attribute__((visibility("hidden")))

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(PW_NO_MVEC)
/* glibc's libmvec has SIMD versions of these; declaring them lets the vectorizer use them
 * (what <math.h> does under -ffast-math, which we do not want for anything else). */
__attribute__((simd("notinbranch"))) float logf(float);
__attribute__((simd("notinbranch"))) float tanhf(float);
__attribute__((simd("notinbranch"))) float erff(float);
__attribute__((simd("notinbranch"))) float powf(float, float);
#endif

#if defined(__GNUC__) && !defined(__clang__)
#define PW_RARELY __attribute__((cold, optimize("O1")))
#else
#define PW_RARELY __attribute__((cold))
#endif

/* exp in float32, within 1 ulp wherever the result is a normal float (measured: 0.98 ulp);
 * results below FLT_MIN flush to 0, above FLT_MAX are inf, NaN stays NaN. Written to
 * vectorize without calls: libmvec's SIMD expf leaves its fast path for a whole vector when one
 * lane is -inf (5x slower), and every masked attention row holds -inf. Cody-Waite reduction by
 * ln 2 in two parts, then the degree-6 minimax polynomial of Cephes' expf. */
/* Its constants, which the attention kernels' vector exps share (attention.h, attention_avx2.h). */
#define PW_EXP_LN_FLT_MIN (-87.33654022216796875f)
#define PW_EXP_LOG2E 1.44269504088896341f
#define PW_EXP_LN2_HI 0.693359375f /* ln 2 = HI + LO */
#define PW_EXP_LN2_LO (-2.12194440e-4f)
#define PW_EXP_P5 1.9875691500e-4f /* p(r) = ((((P5 r + P4) r + P3) r + P2) r + P1) r + P0 */
#define PW_EXP_P4 1.3981999507e-3f
#define PW_EXP_P3 8.3334519073e-3f
#define PW_EXP_P2 4.1665795894e-2f
#define PW_EXP_P1 1.6666665459e-1f
#define PW_EXP_P0 5.0000001201e-1f
/* One select, not seven: each select is a compare and a blend per vector on AVX2, and they were
 * a third of the loop (exp 1.13 -> 0.73 ns per element on Zen 3, every one of the 2^32 results
 * bit for bit the same). NaN flows through the arithmetic to the result. Above 89, clamped, and
 * from ln FLT_MAX up, 2^n itself overflows to inf. Below ln FLT_MIN (-inf too) the lanes compute
 * garbage that the one select replaces by 0; the integer work on it is unsigned, so defined. */
static inline float pw_expf(float x) {
  const float c = x > 89.0f ? 89.0f : x;
  const float n = __builtin_rintf(c * PW_EXP_LOG2E);
  float r = c - n * PW_EXP_LN2_HI;
  r = r - n * PW_EXP_LN2_LO;
  float p = PW_EXP_P5;
  p = p * r + PW_EXP_P4;
  p = p * r + PW_EXP_P3;
  p = p * r + PW_EXP_P2;
  p = p * r + PW_EXP_P1;
  p = p * r + PW_EXP_P0;
  p = p * (r * r) + r + 1.0f;
  /* n as an integer without converting a float that may be NaN or huge: n + 1.5 * 2^23 holds n in
   * its low mantissa bits. Then 2^n for n in [-126, 128], as two representable powers of two. */
  const float shifted = n + 12582912.0f;
  uint32_t e;
  memcpy(&e, &shifted, sizeof e);
  e -= 0x4B400000u;
  const uint32_t e1 = (uint32_t)((int32_t)e >> 1), e2 = e - e1;
  const uint32_t b1 = (e1 + 127u) << 23, b2 = (e2 + 127u) << 23;
  float s1, s2;
  memcpy(&s1, &b1, sizeof s1);
  memcpy(&s2, &b2, sizeof s2);
  const float y = p * s1 * s2;
  return x < PW_EXP_LN_FLT_MIN ? 0.0f : y;
}

#define PW_MAX_RANK 8
#define PW_MAX_ARGS 32
#define PW_BLOCK 4096           /* elements per row when all inputs are full or scalar */
#define PW_TASK_ELEMENTS 16384  /* at least this much work per thread task */

enum { PW_FULL, PW_SCALAR, PW_SUFFIX, PW_COL, PW_STRIDED_ROW, PW_STRIDED_COL, PW_GENERAL };
enum { PW_FLOAT, PW_BOOL, PW_INT64, PW_BF16 };

/* bfloat16 is the upper half of a float32: a kernel holds each bfloat16 value as that float32,
 * rounds to it as torch and ORT do (to nearest, ties to even; a NaN stays a quiet NaN) and
 * stores only the upper half of a value it rounded. */
static inline float pw_bf16_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline float pw_round_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t r = (u & 0x7FFFFFFFu) > 0x7F800000u ? (u | 0x00400000u) & 0xFFFF0000u : rounded;
  float f;
  memcpy(&f, &r, sizeof f);
  return f;
}
static inline uint16_t pw_bf16_bits(float rounded) {
  uint32_t u;
  memcpy(&u, &rounded, sizeof u);
  return (uint16_t)(u >> 16);
}
/* What an output holds: the full result; a row sum (shaped as the output with a last axis of
 * 1); a column sum over all axes but the last (shaped [last]; or, KEPT, [1, ..., 1, last]). */
enum { PW_OUT_FULL, PW_OUT_ROW_SUM, PW_OUT_COLUMN_SUM, PW_OUT_COLUMN_SUM_KEPT };

typedef struct PwArgs {
  int64_t rank, numel, inner, rows, rows_per_task;
  int64_t dims[PW_MAX_RANK];
  const void* in[PW_MAX_ARGS];
  int64_t numel_in[PW_MAX_ARGS];
  int64_t strides[PW_MAX_ARGS][PW_MAX_RANK]; /* element strides per output axis, 0 = broadcast */
  int64_t inner_stride[PW_MAX_ARGS];
  void* out[PW_MAX_ARGS];
  int64_t out_strides[PW_MAX_ARGS][PW_MAX_RANK]; /* element strides per axis of a transposed output */
  float* partial[PW_MAX_ARGS]; /* a column sum's partial sums: a row of `inner` per task */
  void (*rows_fn)(const struct PwArgs*, int64_t, int64_t);
} PwArgs;

typedef void (*PwRowsFn)(const PwArgs*, int64_t, int64_t);
struct PwKernelDef;
/* A hand-written op's whole compute (the generated kernels leave it NULL). */
typedef OrtStatus* (*PwComputeFn)(const OrtApiTable*, OrtKernelContext*, const struct PwKernelDef*);

typedef struct PwKernelDef {
  const char* name;
  int n_in;
  const int* types;
  const int* kinds;
  int n_out;
  const int* out_kinds; /* per output, a PW_OUT_* */
  int rank;
  int flat; /* every input full or scalar: iterate in PW_BLOCK rows, not by the last axis */
  PwRowsFn fast, any;
  PwComputeFn compute;
  /* Transposes read or written in place, or NULL: per input then per output, rank entries,
   * entry d = the axis of the tensor's own layout (inputs padded to rank with leading 1s)
   * that axis d of the iteration is. An output's permutation keeps the last axis. */
  const int* perms;
  /* Per output, a PW_FLOAT, PW_INT64 or PW_BF16; NULL: all float. */
  const int* out_types;
  /* The fast function keeps an earlier phase's values in an output's row until the last phase
   * reads them back: an output sharing memory with an input runs the strided one instead. */
  int stashes;
  /* Lanes are independent of rows (no row or column sums, rotation or transposes): trailing
   * axes that every input reads alike may run as one row (csrc/pointwise_runtime.c). */
  int merges;
} PwKernelDef;

static inline int64_t pw_row_length(const PwArgs* a, int64_t r) {
  return r == a->rows - 1 ? a->numel - r * a->inner : a->inner;
}

/* Offset of row r (an index over all axes but the last) at these per-axis strides. */
static inline int64_t pw_row_offset(const PwArgs* a, const int64_t* strides, int64_t r) {
  int64_t offset = 0;
  for (int64_t d = a->rank - 2; d >= 0; --d) {
    const int64_t size = a->dims[d];
    offset += (r % size) * strides[d];
    r /= size;
  }
  return offset;
}

/* Offset of row r in input i. */
static inline int64_t pw_offset(const PwArgs* a, int i, int64_t r) { return pw_row_offset(a, a->strides[i], r); }

/* Offset of row r in output j, written transposed (out_strides). */
static inline int64_t pw_out_offset(const PwArgs* a, int j, int64_t r) {
  return pw_row_offset(a, a->out_strides[j], r);
}

/* A kernel's definition, visible to the library it is linked into (not outside it). */
#define PW_KERNEL(name, ...) PW_HIDDEN extern const PwKernelDef name##_def; const PwKernelDef name##_def = {#name, __VA_ARGS__}

/* Helpers of the hand-written ops (pointwise_runtime.c and max_pool.h). */
#define PW_TRY(call)             \
  do {                           \
    OrtStatus* status_ = (call); \
    if (status_) return status_; \
  } while (0)
typedef struct PwKernel {
  const OrtApiTable* api;
  const struct PwKernelDef* def;
} PwKernel;
/* An invalid-argument status naming the kernel. */
PW_HIDDEN OrtStatus* pw_error(const PwKernel* k, const char* what);
/* A tensor's shape; dims is filled only for a rank up to PW_MAX_RANK. */
static inline OrtStatus* pw_shape(const OrtApiTable* api, const OrtValue* value, int64_t* dims, size_t* rank) {
  return ortd_tensor_shape(api, value, dims, rank, PW_MAX_RANK);
}
/* Items per thread task for about PW_TASK_ELEMENTS of work each, given each item's work. */
static inline int64_t pw_per_task(int64_t work_per_item) {
  return work_per_item > 0 && PW_TASK_ELEMENTS / work_per_item > 1 ? PW_TASK_ELEMENTS / work_per_item : 1;
}
static inline int64_t pw_task_count(int64_t items, int64_t per_task) { return (items + per_task - 1) / per_task; }
/* task(user, t) for t < tasks on the session's intra-op threads; a single task runs here. */
PW_HIDDEN OrtStatus* pw_run_tasks(const OrtApiTable* api, OrtKernelContext* ctx, void (*task)(void*, size_t),
                                  int64_t tasks, void* user);

/* out = data; out[index[r]] += updates[r] for each row r (rows: the first axis): the gradient
 * of an embedding. Parallel over columns, so no two threads add to one element and each sum
 * is taken in row order. With a first input of type PW_INT64 (ScatterAddRowsToZeros), that
 * input is data's shape and data is all zeros. */
PW_HIDDEN OrtStatus* pw_scatter_add_rows(const OrtApiTable* api, OrtKernelContext* ctx, const struct PwKernelDef* def);
/* out = zeros of the shape in input 0; out[r, index[r, j]] += updates[r, j] along the last axis
 * (rows: every other axis, the same in index, updates and out): max pooling's gradient, each
 * window's gradient added where its maximum was. Parallel over rows; in index order within one. */
PW_HIDDEN OrtStatus* pw_scatter_add_last_axis(const OrtApiTable* api, OrtKernelContext* ctx,
                                              const struct PwKernelDef* def);

/* out = Transpose(x, perm), x of 3 to 8 axes (float32, or bfloat16 when the kernel's first
 * type is PW_BF16), perm an int64 input (a constant): blocks of the last three output axes
 * gathered at the input's strides, split over the intra-op threads. For the permutations ORT
 * moves element by element, or in blocks of a few floats, on one thread (pixel shuffle,
 * patches: einops' rearrangements, a patch convolution's weight gradient), and for the
 * bfloat16 ones ORT moves slower than float32 (attention's k transposed; _op_kernels says which). */
PW_HIDDEN OrtStatus* pw_transpose(const OrtApiTable* api, OrtKernelContext* ctx, const struct PwKernelDef* def);
/* Attention's heads moved back into rows, x_i [B, H_i, S, D_i] (float32, or bfloat16 when the
 * kernel's types are PW_BF16), in one pass of row copies. One input: out = Transpose(x, [0, 2, 1,
 * 3]), [B, S, H, D]. Several: out = Concat([Reshape(Transpose(x_i, [0, 2, 1, 3]), [B, S, H_i *
 * D_i]) ...], last axis), GPT-2's q, k and v gradients side by side for its one projection,
 * where ORT makes a Transpose per input and a Concat. */
PW_HIDDEN OrtStatus* pw_merge_heads(const OrtApiTable* api, OrtKernelContext* ctx, const struct PwKernelDef* def);
/* The reverse, for one projection of q, k and v (GPT-2's): x [B, S, W] (float32) split along its
 * last axis into parts of H_i * D_i (sizes: int64 [n, 2] of H_i, D_i), plus the bias [W] when the
 * kernel has a third input, each part written as out_i [B, H_i, S, D_i]: one pass, where ORT
 * makes a Split and, per part, a kernel that adds the bias into heads' layout. */
PW_HIDDEN OrtStatus* pw_split_heads(const OrtApiTable* api, OrtKernelContext* ctx, const struct PwKernelDef* def);
PW_HIDDEN OrtStatus* pw_register(OrtSessionOptions* options, const OrtApiBase* base,
                                 const PwKernelDef* const* defs);

/* The library's entry point over a NULL-terminated table of kernel definitions. */
#define PW_DEFINE_REGISTRATION(table)                                                             \
  ORTD_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) { \
    return pw_register(options, base, table);                                                    \
  }

#endif /* ORT_DYNAMO_POINTWISE_H */
