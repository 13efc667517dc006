/* pointwise_runtime.c -- the ONNX Runtime side of ort_dynamo's generated kernels.
 *
 * Turns each kernel definition (pointwise.h) into a custom op of the "ort_dynamo.pointwise"
 * domain: reads the inputs' shapes, broadcasts them to the output shape, checks that the read
 * patterns the fast function was generated for hold (else runs the strided one, or reports
 * shapes that do not broadcast), allocates the outputs and splits the rows over the session's
 * intra-op threads. Compiled once per compiler and flags, linked into every kernel library.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#include "pointwise.h"

typedef struct PwOp {
  OrtCustomOp op; /* first: ORT hands back a pointer to it */
  const PwKernelDef* def;
} PwOp;

OrtStatus* pw_error(const PwKernel* k, const char* what) {
  char message[256];
  snprintf(message, sizeof message, "ort_dynamo pointwise kernel %s: %s", k->def->name, what);
  return ORTD_CALL(k->api, CreateStatus)(ORTD_INVALID_ARGUMENT, message);
}

#ifdef PW_OPENMP
/* The library's flavor for sessions that run on one thread while PyTorch's OpenMP threads do the
 * work (option cpu_thread_pool, ort_dynamo/_openmp.py): tasks go to the team of the libgomp torch
 * loaded, the threads eager's ops use, which spin a while after each op instead of sleeping as
 * ORT's do, so the next op finds them awake. Found by its soname, never loaded here; where it is
 * not loaded, ORT's (one-thread) pool runs the tasks. */
#include <dlfcn.h>

typedef void (*pw_gomp_parallel_fn)(void (*body)(void*), void* data, unsigned threads, unsigned flags);
typedef int (*pw_omp_int_fn)(void);
static pw_gomp_parallel_fn pw_gomp_parallel;
static pw_omp_int_fn pw_omp_max_threads;
static int pw_openmp_largest_team; /* for tests: the most threads one run of tasks was given */

typedef struct PwOpenmpJob {
  void (*task)(void*, size_t);
  void* user;
  int64_t tasks, next;
} PwOpenmpJob;

static void pw_openmp_body(void* data) {
  PwOpenmpJob* job = (PwOpenmpJob*)data;
  for (int64_t t; (t = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->tasks;) job->task(job->user, (size_t)t);
}

static int pw_openmp_found(void) {
  static int state; /* 0: not looked, 1: found, 2: absent (a benign race: every thread finds the same) */
  if (!state) {
    void* gomp = dlopen("libgomp.so.1", RTLD_NOLOAD | RTLD_LAZY);
    if (gomp) {
      pw_gomp_parallel = (pw_gomp_parallel_fn)dlsym(gomp, "GOMP_parallel");
      pw_omp_max_threads = (pw_omp_int_fn)dlsym(gomp, "omp_get_max_threads");
    }
    state = pw_gomp_parallel && pw_omp_max_threads ? 1 : 2;
  }
  return state == 1;
}

__attribute__((visibility("default"))) int ortd_pw_openmp_largest_team(void) { return pw_openmp_largest_team; }
#endif

OrtStatus* pw_run_tasks(const OrtApiTable* api, OrtKernelContext* ctx, void (*task)(void*, size_t), int64_t tasks,
                        void* user) {
#ifdef PW_OPENMP
  if (tasks > 1 && pw_openmp_found()) {
    int threads = pw_omp_max_threads(); /* the calling thread's count: torch.set_num_threads's */
    if (threads > tasks) threads = (int)tasks;
    if (threads > pw_openmp_largest_team) pw_openmp_largest_team = threads;
    PwOpenmpJob job = {task, user, tasks, 0};
    pw_gomp_parallel(pw_openmp_body, &job, (unsigned)threads, 0);
    return NULL;
  }
#endif
  if (tasks > 1) return ORTD_CALL(api, KernelContext_ParallelFor)(ctx, task, (size_t)tasks, 0, user);
  if (tasks == 1) task(user, 0);
  return NULL;
}

static void pw_task(void* user, size_t t) {
  const PwArgs* a = (const PwArgs*)user;
  const int64_t r0 = (int64_t)t * a->rows_per_task;
  const int64_t r1 = r0 + a->rows_per_task < a->rows ? r0 + a->rows_per_task : a->rows;
  a->rows_fn(a, r0, r1);
}

/* Whether input i, of padded shape `shape`, is read the way the fast function assumes. */
static int pw_kind_holds(int kind, const int64_t* shape, const PwArgs* a, int64_t numel_in) {
  const int64_t rank = a->rank;
  int64_t lead = 0;
  switch (kind) {
    case PW_FULL:
      return numel_in == a->numel;
    case PW_SCALAR:
      return numel_in == 1;
    case PW_SUFFIX:
      while (lead < rank && shape[lead] == 1) ++lead;
      for (int64_t d = lead; d < rank; ++d)
        if (shape[d] != a->dims[d]) return 0;
      return rank > 0;
    case PW_COL:
      if (rank == 0 || shape[rank - 1] != 1) return 0;
      for (int64_t d = 0; d < rank - 1; ++d)
        if (shape[d] != a->dims[d]) return 0;
      return 1;
    case PW_STRIDED_ROW: /* row offsets from the strides; read along the last axis */
      return rank > 0 && shape[rank - 1] == a->dims[rank - 1];
    case PW_STRIDED_COL:
      return rank > 0 && shape[rank - 1] == 1;
    default:
      return 1;
  }
}

typedef struct PwScatter {
  float* out;
  const float* updates;
  const int64_t* index;
  int64_t rows, row, block, dim0;
} PwScatter;

static void pw_scatter_task(void* user, size_t t) {
  const PwScatter* s = (const PwScatter*)user;
  const int64_t c0 = (int64_t)t * s->block, c1 = c0 + s->block < s->row ? c0 + s->block : s->row;
  for (int64_t r = 0; r < s->rows; ++r) {
    const int64_t at = s->index[r] < 0 ? s->index[r] + s->dim0 : s->index[r];
    float* restrict o = s->out + at * s->row;
    const float* restrict u = s->updates + r * s->row;
    for (int64_t c = c0; c < c1; ++c) o[c] += u[c];
  }
}

OrtStatus* pw_scatter_add_rows(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) {
  const PwKernel k = {api, def};
  const OrtValue *data, *index, *updates;
  int64_t data_dims[PW_MAX_RANK], index_dims[PW_MAX_RANK], update_dims[PW_MAX_RANK];
  size_t data_rank, index_rank, update_rank;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &data));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 1, &index));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 2, &updates));
  /* ScatterAddRowsToZeros: input 0 is the shape of all-zero data (int64), not the data. */
  const int into_zeros = def->types[0] == PW_INT64;
  if (into_zeros) {
    int64_t shape_dims[PW_MAX_RANK];
    size_t shape_rank;
    void* shape_data;
    PW_TRY(pw_shape(api, data, shape_dims, &shape_rank));
    if (shape_rank != 1 || shape_dims[0] < 1 || shape_dims[0] > PW_MAX_RANK)
      return pw_error(&k, "the zeros' shape must list 1 to 8 sizes");
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)data, &shape_data));
    data_rank = (size_t)shape_dims[0];
    memcpy(data_dims, shape_data, data_rank * sizeof(int64_t));
    for (size_t d = 0; d < data_rank; ++d)
      if (data_dims[d] < 0) return pw_error(&k, "the zeros' shape has a negative size");
  } else {
    PW_TRY(pw_shape(api, data, data_dims, &data_rank));
  }
  PW_TRY(pw_shape(api, index, index_dims, &index_rank));
  PW_TRY(pw_shape(api, updates, update_dims, &update_rank));
  if (data_rank < 1 || data_rank > PW_MAX_RANK || update_rank != data_rank || index_rank > PW_MAX_RANK)
    return pw_error(&k, "data and updates must have the same number of axes");
  int64_t row = 1, numel = data_dims[0], indices = 1;
  for (size_t d = 1; d < data_rank; ++d) {
    if (update_dims[d] != data_dims[d]) return pw_error(&k, "updates' rows must be shaped as data's");
    row *= data_dims[d];
  }
  numel *= row;
  for (size_t d = 0; d < index_rank; ++d) indices *= index_dims[d];
  if (indices != update_dims[0]) return pw_error(&k, "one index per row of updates is needed");
  void *out_data, *data_data, *index_data, *update_data;
  OrtValue* out;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, data_dims, data_rank, &out));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(out, &out_data));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)data, &data_data));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)index, &index_data));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)updates, &update_data));
  const int64_t* idx = (const int64_t*)index_data;
  for (int64_t r = 0; r < indices; ++r)
    if (idx[r] < -data_dims[0] || idx[r] >= data_dims[0]) return pw_error(&k, "index out of range");
  if (numel && into_zeros) memset(out_data, 0, (size_t)numel * sizeof(float));
  else if (numel && out_data != data_data) memcpy(out_data, data_data, (size_t)numel * sizeof(float));
  PwScatter s = {(float*)out_data, (const float*)update_data, idx, indices, row, 64, data_dims[0]};
  if (row == 0 || indices == 0) return NULL;
  /* Columns in blocks of at least 64 floats, about PW_TASK_ELEMENTS additions per task. */
  const int64_t per_task = PW_TASK_ELEMENTS / indices > 64 ? PW_TASK_ELEMENTS / indices : 64;
  s.block = (per_task + 15) / 16 * 16;
  return pw_run_tasks(api, ctx, pw_scatter_task, pw_task_count(row, s.block), &s);
}

typedef struct PwScatterLast {
  float* out;
  const float* updates;
  const int64_t* index;
  int64_t row, out_row, rows_per_task, rows;
} PwScatterLast;

static void pw_scatter_last_task(void* user, size_t t) {
  const PwScatterLast* s = (const PwScatterLast*)user;
  const int64_t r0 = (int64_t)t * s->rows_per_task;
  const int64_t r1 = r0 + s->rows_per_task < s->rows ? r0 + s->rows_per_task : s->rows;
  for (int64_t r = r0; r < r1; ++r) {
    float* restrict o = s->out + r * s->out_row;
    const float* restrict u = s->updates + r * s->row;
    const int64_t* restrict at = s->index + r * s->row;
    memset(o, 0, (size_t)s->out_row * sizeof(float));
    for (int64_t j = 0; j < s->row; ++j) o[at[j] < 0 ? at[j] + s->out_row : at[j]] += u[j];
  }
}

OrtStatus* pw_scatter_add_last_axis(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) {
  const PwKernel k = {api, def};
  const OrtValue *shape, *index, *updates;
  int64_t shape_dims[PW_MAX_RANK], dims[PW_MAX_RANK], index_dims[PW_MAX_RANK], update_dims[PW_MAX_RANK];
  size_t shape_rank, index_rank, update_rank;
  void *shape_data, *index_data, *update_data, *out_data;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &shape));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 1, &index));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 2, &updates));
  PW_TRY(pw_shape(api, shape, shape_dims, &shape_rank));
  PW_TRY(pw_shape(api, index, index_dims, &index_rank));
  PW_TRY(pw_shape(api, updates, update_dims, &update_rank));
  if (shape_rank != 1 || shape_dims[0] < 1 || shape_dims[0] > PW_MAX_RANK)
    return pw_error(&k, "the zeros' shape must list 1 to 8 sizes");
  const size_t rank = (size_t)shape_dims[0];
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)shape, &shape_data));
  memcpy(dims, shape_data, rank * sizeof(int64_t));
  if (index_rank != rank || update_rank != rank) return pw_error(&k, "index, updates and out must have one rank");
  int64_t rows = 1;
  for (size_t d = 0; d < rank; ++d) {
    if (dims[d] < 0 || index_dims[d] != update_dims[d]) return pw_error(&k, "index and updates must have one shape");
    if (d + 1 < rank && dims[d] != index_dims[d]) return pw_error(&k, "index's rows must be out's rows");
    if (d + 1 < rank) rows *= dims[d];
  }
  const int64_t row = index_dims[rank - 1], out_row = dims[rank - 1];
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)index, &index_data));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)updates, &update_data));
  const int64_t* idx = (const int64_t*)index_data;
  for (int64_t j = 0; j < rows * row; ++j)
    if (idx[j] < -out_row || idx[j] >= out_row) return pw_error(&k, "index out of range");
  OrtValue* out;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, dims, rank, &out));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(out, &out_data));
  if (rows == 0 || out_row == 0) return NULL;
  PwScatterLast s = {(float*)out_data, (const float*)update_data, idx, row, out_row, 1, rows};
  s.rows_per_task = pw_per_task(row + out_row);
  return pw_run_tasks(api, ctx, pw_scatter_last_task, pw_task_count(rows, s.rows_per_task), &s);
}

typedef struct PwTranspose {
  const void* x;
  void* out;
  int64_t rank, dims[PW_MAX_RANK], strides[PW_MAX_RANK]; /* output dims, input strides per output axis */
  int64_t blocks, blocks_per_task;
} PwTranspose;

/* Blocks b0..b1 of the last three output axes, elements of type T (float, or bfloat16 bits). */
#define PW_TRANSPOSE_BLOCKS(T)                                                                  \
  do {                                                                                          \
    for (int64_t b = b0; b < b1; ++b) {                                                         \
      int64_t base = 0, rest = b;                                                               \
      for (int64_t d = r - 4; d >= 0; --d) {                                                    \
        base += (rest % p->dims[d]) * p->strides[d];                                            \
        rest /= p->dims[d];                                                                     \
      }                                                                                         \
      T* restrict o = (T*)p->out + b * C * A * B;                                               \
      for (int64_t c = 0; c < C; ++c) {                                                         \
        const T* restrict x = (const T*)p->x + base + c * sc;                                   \
        for (int64_t a = 0; a < A; ++a, o += B)                                                 \
          for (int64_t j = 0; j < B; ++j) o[j] = x[a * sa + j * sb];                            \
      }                                                                                         \
    }                                                                                           \
  } while (0)

static void pw_transpose_task(void* user, size_t t, int bf16) {
  const PwTranspose* p = (const PwTranspose*)user;
  const int64_t b0 = (int64_t)t * p->blocks_per_task;
  const int64_t b1 = b0 + p->blocks_per_task < p->blocks ? b0 + p->blocks_per_task : p->blocks;
  const int64_t r = p->rank, C = p->dims[r - 3], A = p->dims[r - 2], B = p->dims[r - 1];
  const int64_t sc = p->strides[r - 3], sa = p->strides[r - 2], sb = p->strides[r - 1];
  if (bf16)
    PW_TRANSPOSE_BLOCKS(uint16_t);
  else
    PW_TRANSPOSE_BLOCKS(float);
}
static void pw_transpose_float_task(void* user, size_t t) { pw_transpose_task(user, t, 0); }
static void pw_transpose_bf16_task(void* user, size_t t) { pw_transpose_task(user, t, 1); }

OrtStatus* pw_transpose(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) {
  const PwKernel k = {api, def};
  const OrtValue *input, *perm_value;
  int64_t in_dims[PW_MAX_RANK], perm_dims[PW_MAX_RANK];
  size_t rank, perm_rank;
  void *in_data, *perm_data, *out_data;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &input));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 1, &perm_value));
  PW_TRY(pw_shape(api, input, in_dims, &rank));
  PW_TRY(pw_shape(api, perm_value, perm_dims, &perm_rank));
  if (rank < 3 || rank > PW_MAX_RANK || perm_rank != 1 || perm_dims[0] != (int64_t)rank)
    return pw_error(&k, "perm must list each of the input's 3 to 8 axes");
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)perm_value, &perm_data));
  const int64_t* perm = (const int64_t*)perm_data;
  PwTranspose p = {0};
  p.rank = (int64_t)rank;
  int64_t in_strides[PW_MAX_RANK], seen = 0, numel = 1;
  for (int64_t d = p.rank - 1, stride = 1; d >= 0; --d) {
    in_strides[d] = stride;
    stride *= in_dims[d];
  }
  for (int64_t d = 0; d < p.rank; ++d) {
    if (perm[d] < 0 || perm[d] >= p.rank || (seen >> perm[d]) & 1) return pw_error(&k, "perm is not a permutation");
    seen |= (int64_t)1 << perm[d];
    p.dims[d] = in_dims[perm[d]];
    p.strides[d] = in_strides[perm[d]];
    numel *= p.dims[d];
  }
  OrtValue* out;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, p.dims, rank, &out));
  if (numel == 0) return NULL;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)input, &in_data));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(out, &out_data));
  p.x = in_data;
  p.out = out_data;
  const int64_t block = p.dims[p.rank - 3] * p.dims[p.rank - 2] * p.dims[p.rank - 1];
  p.blocks = numel / block;
  p.blocks_per_task = pw_per_task(block);
  return pw_run_tasks(api, ctx, def->types[0] == PW_BF16 ? pw_transpose_bf16_task : pw_transpose_float_task,
                      pw_task_count(p.blocks, p.blocks_per_task), &p);
}

/* Attention's heads between rows [B, S, W] and parts [B, H_i, S, D_i] (W = the sum of H_i * D_i):
 * each (row, part, head) is D_i contiguous elements on both sides. */
typedef struct PwHeads {
  char* parts[PW_MAX_ARGS];
  const float* bias[PW_MAX_ARGS]; /* split only; NULL: none */
  int64_t heads[PW_MAX_ARGS], depth[PW_MAX_ARGS], offset[PW_MAX_ARGS]; /* offset: in a row, in elements */
  int n, into_rows; /* into_rows: parts -> rows (merge), else rows -> parts (split) */
  int64_t seq, width, rows, rows_per_task;
  size_t size; /* bytes per element */
  char* rows_data;
} PwHeads;

static void pw_heads_task(void* user, size_t t) {
  const PwHeads* p = (const PwHeads*)user;
  const int64_t r0 = (int64_t)t * p->rows_per_task;
  const int64_t r1 = r0 + p->rows_per_task < p->rows ? r0 + p->rows_per_task : p->rows;
  for (int64_t r = r0; r < r1; ++r) { /* r = b * seq + s */
    const int64_t b = r / p->seq, s = r % p->seq;
    char* row = p->rows_data + (size_t)(r * p->width) * p->size;
    for (int i = 0; i < p->n; ++i) {
      const int64_t H = p->heads[i], D = p->depth[i];
      for (int64_t h = 0; h < H; ++h) {
        char* in_row = row + (size_t)(p->offset[i] + h * D) * p->size;
        char* in_part = p->parts[i] + (size_t)(((b * H + h) * p->seq + s) * D) * p->size;
        if (p->into_rows) {
          memcpy(in_row, in_part, (size_t)D * p->size);
        } else if (p->bias[i]) {
          const float* restrict x = (const float*)in_row;
          const float* restrict c = p->bias[i] + h * D;
          float* restrict o = (float*)in_part;
          for (int64_t d = 0; d < D; ++d) o[d] = x[d] + c[d];
        } else {
          memcpy(in_part, in_row, (size_t)D * p->size);
        }
      }
    }
  }
}

static OrtStatus* pw_run_heads(const OrtApiTable* api, OrtKernelContext* ctx, PwHeads* p) {
  if (p->rows == 0 || p->width == 0) return NULL;
  p->rows_per_task = pw_per_task(p->width);
  return pw_run_tasks(api, ctx, pw_heads_task, pw_task_count(p->rows, p->rows_per_task), p);
}

OrtStatus* pw_merge_heads(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) {
  const PwKernel k = {api, def};
  PwHeads p = {0};
  p.n = def->n_in;
  p.into_rows = 1;
  p.size = def->types[0] == PW_BF16 ? 2 : 4;
  int64_t batch = -1;
  for (int i = 0; i < p.n; ++i) {
    const OrtValue* value;
    int64_t dims[PW_MAX_RANK];
    size_t rank;
    void* data;
    PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, (size_t)i, &value));
    PW_TRY(pw_shape(api, value, dims, &rank));
    if (rank != 4) return pw_error(&k, "each input must be [batch, heads, sequence, depth]");
    if (i == 0) {
      batch = dims[0];
      p.seq = dims[2];
    } else if (dims[0] != batch || dims[2] != p.seq) {
      return pw_error(&k, "the inputs' batch and sequence sizes differ");
    }
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)value, &data));
    p.parts[i] = (char*)data;
    p.heads[i] = dims[1];
    p.depth[i] = dims[3];
    p.offset[i] = p.width;
    p.width += dims[1] * dims[3];
  }
  /* One input: its Transpose, [B, S, H, D]; several: their Concat, [B, S, sum of H * D]. */
  const int64_t out_dims[4] = {batch, p.seq, p.n == 1 ? p.heads[0] : p.width, p.depth[0]};
  OrtValue* out;
  void* out_data;
  PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, out_dims, p.n == 1 ? 4 : 3, &out));
  p.rows = batch * p.seq;
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)(out, &out_data));
  p.rows_data = (char*)out_data;
  return pw_run_heads(api, ctx, &p);
}

OrtStatus* pw_split_heads(const OrtApiTable* api, OrtKernelContext* ctx, const PwKernelDef* def) {
  const PwKernel k = {api, def};
  PwHeads p = {0};
  p.n = def->n_out;
  p.size = sizeof(float);
  const OrtValue *x, *sizes;
  int64_t dims[PW_MAX_RANK], size_dims[PW_MAX_RANK];
  size_t rank, size_rank;
  void *x_data, *size_data;
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &x));
  PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 1, &sizes));
  PW_TRY(pw_shape(api, x, dims, &rank));
  PW_TRY(pw_shape(api, sizes, size_dims, &size_rank));
  if (rank != 3) return pw_error(&k, "x must be [batch, sequence, width]");
  if (size_rank != 2 || size_dims[0] != p.n || size_dims[1] != 2) return pw_error(&k, "sizes must be [outputs, 2]");
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)x, &x_data));
  PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)sizes, &size_data));
  const int64_t* hd = (const int64_t*)size_data;
  p.rows_data = (char*)x_data;
  p.seq = dims[1];
  p.width = dims[2];
  p.rows = dims[0] * dims[1];
  int64_t offset = 0;
  for (int i = 0; i < p.n; ++i) {
    p.heads[i] = hd[2 * i];
    p.depth[i] = hd[2 * i + 1];
    if (p.heads[i] < 0 || p.depth[i] < 0) return pw_error(&k, "sizes must not be negative");
    p.offset[i] = offset;
    offset += p.heads[i] * p.depth[i];
  }
  if (offset != p.width) return pw_error(&k, "the parts' heads * depth must add up to x's width");
  if (def->n_in > 2) {
    const OrtValue* bias;
    int64_t bias_dims[PW_MAX_RANK];
    size_t bias_rank;
    void* bias_data;
    PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, 2, &bias));
    PW_TRY(pw_shape(api, bias, bias_dims, &bias_rank));
    if (bias_rank != 1 || bias_dims[0] != p.width) return pw_error(&k, "bias must be [width]");
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)bias, &bias_data));
    for (int i = 0; i < p.n; ++i) p.bias[i] = (const float*)bias_data + p.offset[i];
  }
  for (int i = 0; i < p.n; ++i) {
    const int64_t out_dims[4] = {dims[0], p.heads[i], p.seq, p.depth[i]};
    OrtValue* out;
    void* out_data;
    PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, (size_t)i, out_dims, 4, &out));
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)(out, &out_data));
    p.parts[i] = (char*)out_data;
  }
  return pw_run_heads(api, ctx, &p);
}

static size_t pw_type_size(int type) {
  return type == PW_BOOL ? 1 : type == PW_BF16 ? 2 : type == PW_INT64 ? 8 : 4;
}

/* Whether a full output's memory overlaps an input's (an optimizer step binds outputs in place):
 * a value stashed in the output's row would overwrite what the last phase reads. */
static int pw_outputs_overlap_inputs(const PwArgs* a, const PwKernelDef* def) {
  for (int j = 0; j < def->n_out; ++j) {
    if (def->out_kinds[j] != PW_OUT_FULL) continue;
    const char* out = (const char*)a->out[j];
    const char* out_end = out + (size_t)a->numel * pw_type_size(def->out_types ? def->out_types[j] : PW_FLOAT);
    for (int i = 0; i < def->n_in; ++i) {
      const char* in = (const char*)a->in[i];
      const char* in_end = in + (size_t)a->numel_in[i] * pw_type_size(def->types[i]);
      if (in < out_end && out < in_end) return 1;
    }
  }
  return 0;
}

/* Rows shorter than this gain from being merged with the axis before: a row's setup (an offset
 * per input, from the strides) costs about what a few dozen lanes do. */
#define PW_SHORT_ROW 256

/* Iterate the last two axes as one while the rows are short and every input reads both alike
 * (both its own or both broadcast): a per-channel scale over a 4 x 4 plane runs as rows of 16,
 * not 4. The outputs are already allocated at the full shape; inputs lie in their own layout,
 * so merged axes stay contiguous. */
static void pw_merge_short_rows(PwArgs* a, int64_t shapes[][PW_MAX_RANK], int64_t own[][PW_MAX_RANK], int n_in) {
  while (a->rank >= 2 && a->dims[a->rank - 1] < PW_SHORT_ROW) {
    const int64_t d = a->rank - 2;
    int alike = 1;
    for (int i = 0; i < n_in && alike; ++i) {
      const int both_own = shapes[i][d] == a->dims[d] && shapes[i][d + 1] == a->dims[d + 1];
      const int both_broadcast = shapes[i][d] == 1 && shapes[i][d + 1] == 1;
      alike = both_own || both_broadcast;
    }
    if (!alike) return;
    a->dims[d] *= a->dims[d + 1];
    for (int i = 0; i < n_in; ++i) {
      shapes[i][d] *= shapes[i][d + 1];
      own[i][d] *= own[i][d + 1];
    }
    --a->rank;
  }
}

static OrtStatus* pw_compute(void* kernel, OrtKernelContext* ctx) {
  const PwKernel* k = (const PwKernel*)kernel;
  const PwKernelDef* def = k->def;
  const OrtApiTable* api = k->api;
  if (def->compute) return def->compute(api, ctx, def);
  PwArgs a;
  int64_t shapes[PW_MAX_ARGS][PW_MAX_RANK]; /* as the iteration sees them (transposes applied) */
  int64_t own[PW_MAX_ARGS][PW_MAX_RANK];    /* as they lie in memory */
  a.rank = def->rank;
  for (int64_t d = 0; d < a.rank; ++d) a.dims[d] = 1;
  for (int i = 0; i < def->n_in; ++i) {
    const OrtValue* value;
    size_t rank;
    int64_t dims[PW_MAX_RANK];
    PW_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, (size_t)i, &value));
    PW_TRY(pw_shape(api, value, dims, &rank));
    if (rank > (size_t)a.rank) return pw_error(k, "an input has more axes than the output");
    a.numel_in[i] = 1;
    const int64_t pad = a.rank - (int64_t)rank;
    for (int64_t d = 0; d < a.rank; ++d) own[i][d] = d < pad ? 1 : dims[d - pad];
    for (int64_t d = 0; d < a.rank; ++d) {
      const int64_t size = own[i][def->perms ? def->perms[i * a.rank + d] : d];
      shapes[i][d] = size;
      a.numel_in[i] *= size;
      if (size != 1) {
        if (a.dims[d] != 1 && a.dims[d] != size) return pw_error(k, "input shapes do not broadcast");
        a.dims[d] = size;
      }
    }
    void* data;
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)value, &data));
    a.in[i] = data;
  }
  a.numel = 1;
  for (int64_t d = 0; d < a.rank; ++d) a.numel *= a.dims[d];
  int64_t row_sum_dims[PW_MAX_RANK], column_sum_dims[PW_MAX_RANK];
  for (int64_t d = 0; d < a.rank; ++d) {
    row_sum_dims[d] = d == a.rank - 1 ? 1 : a.dims[d];
    column_sum_dims[d] = d == a.rank - 1 ? a.dims[d] : 1;
  }
  int has_row_sums = 0, column_sums = 0; /* column_sums: how many outputs are column sums */
  for (int j = 0; j < def->n_out; ++j) {
    OrtValue* value;
    void* data;
    const int kind = def->out_kinds[j];
    const int64_t* dims = kind == PW_OUT_FULL ? a.dims : kind == PW_OUT_ROW_SUM ? row_sum_dims : column_sum_dims;
    const size_t rank = kind == PW_OUT_COLUMN_SUM ? 1 : (size_t)a.rank;
    if (kind == PW_OUT_COLUMN_SUM) dims += a.rank - 1;
    int64_t transposed[PW_MAX_RANK];
    if (kind == PW_OUT_FULL && def->perms) {
      /* Written transposed: allocated in its own layout, whose axis perm[d] is our axis d. */
      const int* perm = def->perms + (def->n_in + j) * a.rank;
      for (int64_t d = 0; d < a.rank; ++d) transposed[perm[d]] = a.dims[d];
      int64_t stride = 1, own_strides[PW_MAX_RANK];
      for (int64_t d = a.rank - 1; d >= 0; --d) {
        own_strides[d] = stride;
        stride *= transposed[d];
      }
      for (int64_t d = 0; d < a.rank; ++d) a.out_strides[j][d] = own_strides[perm[d]];
      dims = transposed;
    }
    PW_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, (size_t)j, dims, rank, &value));
    PW_TRY(ORTD_CALL(api, GetTensorMutableData)(value, &data));
    a.out[j] = data;
    a.partial[j] = (float*)data;
    has_row_sums |= kind == PW_OUT_ROW_SUM;
    column_sums += kind >= PW_OUT_COLUMN_SUM;
  }
  if (def->merges) pw_merge_short_rows(&a, shapes, own, def->n_in);
  int fast = 1;
  for (int i = 0; i < def->n_in; ++i) {
    int64_t stride = 1, own_strides[PW_MAX_RANK];
    for (int64_t d = a.rank - 1; d >= 0; --d) {
      own_strides[d] = stride;
      stride *= own[i][d];
    }
    for (int64_t d = 0; d < a.rank; ++d)
      a.strides[i][d] = shapes[i][d] == 1 ? 0 : own_strides[def->perms ? def->perms[i * a.rank + d] : d];
    a.inner_stride[i] = a.rank ? a.strides[i][a.rank - 1] : 0;
    fast = fast && pw_kind_holds(def->kinds[i], shapes[i], &a, a.numel_in[i]);
  }
  if (a.numel == 0) {
    /* Nothing to compute, except row sums over an empty last axis: 0 (mean: NaN, as torch),
     * and column sums over no rows: 0. */
    int64_t rows = 1;
    for (int64_t d = 0; d + 1 < a.rank; ++d) rows *= a.dims[d];
    for (int j = 0; j < def->n_out; ++j)
      if (def->out_kinds[j] >= PW_OUT_COLUMN_SUM && a.rank) memset(a.out[j], 0, (size_t)a.dims[a.rank - 1] * sizeof(float));
    if (has_row_sums && rows > 0) {
      a.inner = 0;
      a.rows = a.rows_per_task = rows;
      def->any(&a, 0, rows);
    }
    return NULL;
  }
  if (fast && def->stashes) fast = !pw_outputs_overlap_inputs(&a, def);
  a.rows_fn = fast ? def->fast : def->any;
  if (fast && def->flat) {
    a.inner = PW_BLOCK;
  } else {
    a.inner = a.rank ? a.dims[a.rank - 1] : 1;
  }
  a.rows = (a.numel + a.inner - 1) / a.inner;
  a.rows_per_task = pw_per_task(a.inner);
  const int64_t tasks = pw_task_count(a.rows, a.rows_per_task);
  if (!column_sums) return pw_run_tasks(api, ctx, pw_task, tasks, &a);
  /* Column sums: each task adds its rows into its own row of partial sums; then the partial
   * rows are added in task order (which depends on the shapes only: the same sums each run). */
  float* partials = (float*)calloc((size_t)(tasks * a.inner * column_sums), sizeof(float));
  if (!partials) return ORTD_CALL(api, CreateStatus)(ORTD_FAIL, "ort_dynamo pointwise kernel: out of memory");
  for (int j = 0, block = 0; j < def->n_out; ++j)
    if (def->out_kinds[j] >= PW_OUT_COLUMN_SUM) a.partial[j] = partials + (block++) * tasks * a.inner;
  OrtStatus* status = pw_run_tasks(api, ctx, pw_task, tasks, &a);
  for (int j = 0; j < def->n_out && !status; ++j) {
    if (def->out_kinds[j] < PW_OUT_COLUMN_SUM) continue;
    float* restrict out = (float*)a.out[j];
    const float* restrict part = a.partial[j];
    memcpy(out, part, (size_t)a.inner * sizeof(float));
    for (int64_t t = 1; t < tasks; ++t)
      for (int64_t c = 0; c < a.inner; ++c) out[c] += part[t * a.inner + c];
  }
  free(partials);
  return status;
}

static const PwKernelDef* pw_def(const OrtCustomOp* op) { return ((const PwOp*)op)->def; }

static OrtStatus* pw_create(const OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info, void** out) {
  (void)info;
  PwKernel* k = (PwKernel*)malloc(sizeof(PwKernel));
  if (!k) return ORTD_CALL(api, CreateStatus)(ORTD_FAIL, "ort_dynamo pointwise kernel: out of memory");
  k->api = api;
  k->def = pw_def(op);
  *out = k;
  return NULL;
}

static void* pw_create_v1(const OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info) {
  void* kernel = NULL;
  OrtStatus* status = pw_create(op, api, info, &kernel);
  if (status) ORTD_CALL(api, ReleaseStatus)(status);
  return kernel;
}

static void pw_compute_v1(void* kernel, OrtKernelContext* ctx) {
  /* Not called: ORT uses KernelComputeV2, which can report errors. */
  OrtStatus* status = pw_compute(kernel, ctx);
  if (status) ORTD_CALL(((PwKernel*)kernel)->api, ReleaseStatus)(status);
}

static void pw_destroy(void* kernel) { free(kernel); }
static const char* pw_name(const OrtCustomOp* op) { return pw_def(op)->name; }
static const char* pw_provider(const OrtCustomOp* op) { (void)op; return NULL; }
static int pw_elem_type(int type) {
  return type == PW_BOOL ? ORTD_ELEM_BOOL : type == PW_INT64 ? ORTD_ELEM_INT64
       : type == PW_BF16 ? ORTD_ELEM_BFLOAT16 : ORTD_ELEM_FLOAT;
}
static int pw_input_type(const OrtCustomOp* op, size_t i) {
  return pw_elem_type(pw_def(op)->types[i]);
}
static size_t pw_input_count(const OrtCustomOp* op) { return (size_t)pw_def(op)->n_in; }
static int pw_output_type(const OrtCustomOp* op, size_t i) {
  const int* types = pw_def(op)->out_types;
  return types ? pw_elem_type(types[i]) : ORTD_ELEM_FLOAT;
}
static size_t pw_output_count(const OrtCustomOp* op) { return (size_t)pw_def(op)->n_out; }

static void pw_init_op(PwOp* p, const PwKernelDef* def) {
  p->def = def;
  p->op.version = ORTD_CUSTOM_OP_VERSION;
  p->op.CreateKernel = pw_create_v1;
  p->op.GetName = pw_name;
  p->op.GetExecutionProviderType = pw_provider;
  p->op.GetInputType = pw_input_type;
  p->op.GetInputTypeCount = pw_input_count;
  p->op.GetOutputType = pw_output_type;
  p->op.GetOutputTypeCount = pw_output_count;
  p->op.KernelCompute = pw_compute_v1;
  p->op.KernelDestroy = pw_destroy;
  p->op.GetInputCharacteristic = ortd_io_required;
  p->op.GetOutputCharacteristic = ortd_io_required;
  p->op.GetInputMemoryType = ortd_on_device;
  p->op.CreateKernelV2 = pw_create;
  p->op.KernelComputeV2 = pw_compute;
}

OrtStatus* pw_register(OrtSessionOptions* options, const OrtApiBase* base, const PwKernelDef* const* defs) {
  static PwOp* ops; /* one per kernel, filled on the first registration; later sessions share them */
  const OrtApiTable* api = base->GetApi(ORTD_API_VERSION);
  if (!api) return NULL; /* unreachable on ORT >= 1.17; nothing we can report through */
  size_t count = 0;
  while (defs[count]) ++count;
  if (!ops) {
    ops = (PwOp*)calloc(count ? count : 1, sizeof(PwOp));
    if (!ops) return ORTD_CALL(api, CreateStatus)(ORTD_FAIL, "ort_dynamo pointwise kernels: out of memory");
    for (size_t i = 0; i < count; ++i) pw_init_op(&ops[i], defs[i]);
  }
  OrtCustomOpDomain* domain;
  PW_TRY(ORTD_CALL(api, CreateCustomOpDomain)("ort_dynamo.pointwise", &domain));
  for (size_t i = 0; i < count; ++i) PW_TRY(ORTD_CALL(api, CustomOpDomain_Add)(domain, &ops[i].op));
  /* The domain must outlive every session using it: it is never released. */
  return ORTD_CALL(api, AddCustomOpDomain)(options, domain);
}

