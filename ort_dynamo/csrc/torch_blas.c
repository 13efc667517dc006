/* Matrix products by the BLAS eager's own products run on (torch's: MKL in PyTorch's x86
 * builds), as an ONNX Runtime custom op. On Intel CPUs MKL's sgemm ran 1.2x faster than ORT's
 * MLAS on the benchmark models' shapes (benchmarks/gemm.py), and the step is its products.
 * torch exports the Fortran symbol `sgemm_`; ort_dynamo/_torch_blas.py hands its address in
 * (torch's libraries are not global) before any session runs, with MKL's thread-local thread
 * count: a product is cut into pieces of rows (or of columns), each multiplied on one of ORT's threads.
 *
 * Domain ort_dynamo.blas:
 *   MatMul(a, b[, bias]) -> y    y[..., M, N] = op(a)[..., M, K] op(b)[K, N] (+ bias[N])
 *   Bf16MatMul(a, b[, bias]) -> y    the same of bfloat16 a and b (CPU autocast's operands), y
 *                                    float32: MKL's gemm_bf16bf16f32 (AMX where the CPU has it)
 * Attributes trans_a, trans_b (int): a held as [..., K, M], b as [..., N, K]. torch_threads (int,
 * optional): 1 where the session runs on one thread and PyTorch's OpenMP threads do the work
 * (option cpu_thread_pool, ort_dynamo/_openmp.py): each product is the BLAS's whole, threaded
 * by it on those threads, never cut into pieces for ORT's. a's leading axes
 * are a batch (rows of one product where a is not transposed and b one matrix); b is one matrix
 * or a batch of a's leading axes (attention's products written out, one product per matrix: on
 * PyTorch's threads one MKL sgemm_batch call, as eager's bmm). y and bias are float32. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

/* Fortran BLAS: column-major, every argument by pointer, LP64 ints. */
typedef void (*sgemm_fn)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                         const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                         const float* beta, float* c, const int* ldc);

/* MKL's sgemm_batch (Fortran's interface): groups of products of one geometry, here one group of
 * a batch's products, which MKL spreads over its threads as eager's bmm does. */
typedef void (*sgemm_batch_fn)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                               const float* alpha, const float** a, const int* lda, const float** b, const int* ldb,
                               const float* beta, float** c, const int* ldc, const int* groups, const int* group_size);

/* MKL's mkl_set_num_threads_local: this thread's products on n threads (0: the global count);
 * returns the count it replaces. */
typedef int (*threads_local_fn)(int n);

/* The same for bfloat16 a and b (uint16_t: their bits); c float32. */
typedef void (*bf16_gemm_fn)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                             const float* alpha, const uint16_t* a, const int* lda, const uint16_t* b, const int* ldb,
                             const float* beta, float* c, const int* ldc);

static sgemm_fn blas_sgemm;
static sgemm_batch_fn blas_sgemm_batch;
static bf16_gemm_fn blas_bf16_gemm;
static threads_local_fn blas_threads_local;
static int64_t blas_parts; /* how many pieces a product is cut into for ORT's threads */

#define ORTD_EXPORT_C __attribute__((visibility("default")))

ORTD_EXPORT_C void ortd_torch_blas_init(void* sgemm, void* bf16_gemm, void* threads_local, void* sgemm_batch,
                                        int64_t parts) {
  blas_sgemm = (sgemm_fn)sgemm;
  blas_sgemm_batch = (sgemm_batch_fn)sgemm_batch;
  blas_bf16_gemm = (bf16_gemm_fn)bf16_gemm;
  blas_threads_local = (threads_local_fn)threads_local;
  blas_parts = parts;
}

#define MAX_RANK 8

typedef struct Kernel {
  const OrtApiTable* api;
  int64_t trans_a, trans_b, torch_threads;
  int bf16;
} Kernel;

static OrtStatus* fail(const OrtApiTable* api, const char* what) {
  return ORTD_CALL(api, CreateStatus)(ORTD_RUNTIME_EXCEPTION, what);
}

static OrtStatus* tensor(const OrtApiTable* api, OrtKernelContext* ctx, size_t index, int64_t* dims, size_t* rank,
                         const void** data) {
  const OrtValue* value = NULL;
  OrtStatus* status = ORTD_CALL(api, KernelContext_GetInput)(ctx, index, &value);
  if (status) return status;
  if (value == NULL) {
    *data = NULL;
    return NULL;
  }
  status = ortd_tensor_shape(api, value, dims, rank, MAX_RANK);
  if (status) return status;
  if (*rank > MAX_RANK) return fail(api, "ort_dynamo.blas MatMul: a tensor of more than 8 dimensions");
  return ORTD_CALL(api, GetTensorMutableData)((OrtValue*)value, (void**)data);
}

static int fits(int64_t n) { return n >= 0 && n <= INT32_MAX; }

/* Each piece of a product at least this many rows: the BLAS packs b again for each. */
#define MIN_ROWS 64
/* A product with more columns than rows (a weight's gradient, 256 x 1024 for the models' MLPs)
 * is cut into pieces of at least this many columns: 10-20% faster than rows for those shapes,
 * the models' steps 1-8% faster. So is one too short to cut into rows (an unrolled RNN's step:
 * 16 rows), not left to MKL's own threads, which OpenMP wakes for each call: LSTM steps 6-8%
 * faster (benchmarks/layer_ops.py --variant cpu_matmul=ort lstm_16 lstm_64). */
#define MIN_COLS 128

typedef struct Product {
  const void *a, *b;
  float* y;
  int64_t rows, n, k, trans_a, trans_b, bf16, b_step; /* b_step: elements from one b to the next */
  float beta;
  int64_t parts, per, by_columns; /* pieces of per rows, or (by_columns) of per columns */
} Product;

/* Row-major y = op(a) op(b) is column-major y^T = op(b)^T op(a)^T: the BLAS gets b first. Its
 * operands' transposes and leading dimensions, the same for every product and piece of g. */
typedef struct Layout {
  char ta, tb;
  int lda, ldb, ldc;
} Layout;

static Layout layout(const Product* g) {
  Layout l = {g->trans_b ? 'T' : 'N', g->trans_a ? 'T' : 'N', (int)(g->trans_b ? g->k : g->n),
              (int)(g->trans_a ? g->rows : g->k), (int)g->n};
  return l;
}

/* Rows [r0, r1) and columns [c0, c1) of product p: op(b)^T's rows c0.. (see Layout). */
static void multiply(const Product* g, int64_t p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int im = (int)(c1 - c0), in = (int)(r1 - r0), ik = (int)g->k;
  const Layout l = layout(g);
  const float one = 1.0f;
  const int64_t a_at = p * g->rows * g->k + r0 * (g->trans_a ? 1 : g->k);
  const int64_t b_at = p * g->b_step + c0 * (g->trans_b ? g->k : 1);
  float* y = g->y + (p * g->rows + r0) * g->n + c0;
  if (g->bf16)
    blas_bf16_gemm(&l.ta, &l.tb, &im, &in, &ik, &one, (const uint16_t*)g->b + b_at, &l.lda,
                   (const uint16_t*)g->a + a_at, &l.ldb, &g->beta, y, &l.ldc);
  else
    blas_sgemm(&l.ta, &l.tb, &im, &in, &ik, &one, (const float*)g->b + b_at, &l.lda, (const float*)g->a + a_at,
               &l.ldb, &g->beta, y, &l.ldc);
}

/* All of a float32 batch's products in one call, MKL spreading them over its threads: one
 * threaded call per small product (attention's, 64 x 64) would wake the threads each time. */
static OrtStatus* multiply_batch(const OrtApiTable* api, const Product* g, int64_t products) {
  if (!fits(products)) return fail(api, "ort_dynamo.blas MatMul: a batch past 2^31");
  const void** pointers = (const void**)malloc(sizeof(void*) * 3 * (size_t)products);
  if (pointers == NULL) return fail(api, "ort_dynamo.blas MatMul: out of memory");
  const float **as = (const float**)pointers, **bs = as + products;
  float** ys = (float**)(bs + products);
  for (int64_t p = 0; p < products; p++) { /* b first, as in multiply() */
    as[p] = (const float*)g->b + p * g->b_step;
    bs[p] = (const float*)g->a + p * g->rows * g->k;
    ys[p] = g->y + p * g->rows * g->n;
  }
  const int im = (int)g->n, in = (int)g->rows, ik = (int)g->k, groups = 1, size = (int)products;
  const Layout l = layout(g);
  const float one = 1.0f;
  blas_sgemm_batch(&l.ta, &l.tb, &im, &in, &ik, &one, as, &l.lda, bs, &l.ldb, &g->beta, ys, &l.ldc, &groups, &size);
  free(pointers);
  return NULL;
}

/* One piece on one of ORT's threads, the BLAS kept to that thread: its own threads (OpenMP's)
 * would spin, once done, against ORT's next op on the same cores. */
static void part_task(void* user, size_t t) {
  const Product* g = (const Product*)user;
  int64_t p = (int64_t)t / g->parts, at = ((int64_t)t % g->parts) * g->per;
  int64_t end = g->by_columns ? g->n : g->rows;
  end = at + g->per < end ? at + g->per : end;
  if (at >= end) return;
  int before = blas_threads_local(1);
  if (g->by_columns)
    multiply(g, p, 0, g->rows, at, end);
  else
    multiply(g, p, at, end, 0, g->n);
  blas_threads_local(before);
}

static OrtStatus* compute(void* state, OrtKernelContext* ctx) {
  Kernel* k = (Kernel*)state;
  const OrtApiTable* api = k->api;
  if ((k->bf16 ? (void*)blas_bf16_gemm : (void*)blas_sgemm) == NULL)
    return fail(api, "ort_dynamo.blas MatMul: torch's BLAS function was not handed in");
  int64_t a_dims[MAX_RANK], b_dims[MAX_RANK], bias_dims[MAX_RANK], y_dims[MAX_RANK];
  size_t a_rank = 0, b_rank = 0, bias_rank = 0, count = 0;
  const void *a, *b, *bias = NULL;
  OrtStatus* status = ORTD_CALL(api, KernelContext_GetInputCount)(ctx, &count);
  if (!status) status = tensor(api, ctx, 0, a_dims, &a_rank, &a);
  if (!status) status = tensor(api, ctx, 1, b_dims, &b_rank, &b);
  if (!status && count > 2) status = tensor(api, ctx, 2, bias_dims, &bias_rank, &bias);
  if (status) return status;
  if (a_rank < 2 || b_rank < 2 || (b_rank > 2 && b_rank != a_rank))
    return fail(api, "ort_dynamo.blas MatMul: a needs 2 or more axes, b 2 or a's");
  for (size_t i = 0; i + 2 < b_rank; i++)
    if (b_dims[i] != a_dims[i]) return fail(api, "ort_dynamo.blas MatMul: a's and b's batches differ");
  int64_t m = a_dims[a_rank - (k->trans_a ? 1 : 2)], ka = a_dims[a_rank - (k->trans_a ? 2 : 1)];
  int64_t n = b_dims[b_rank - (k->trans_b ? 2 : 1)], kb = b_dims[b_rank - (k->trans_b ? 1 : 2)];
  if (ka != kb) return fail(api, "ort_dynamo.blas MatMul: the operands' inner dimensions differ");
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < a_rank; i++) batch *= a_dims[i];
  if (bias) {
    int64_t elements = 1;
    for (size_t i = 0; i < bias_rank; i++) elements *= bias_dims[i];
    if (elements != n) return fail(api, "ort_dynamo.blas MatMul: the bias is not one value per output column");
  }
  memcpy(y_dims, a_dims, sizeof(int64_t) * (a_rank - 2));
  y_dims[a_rank - 2] = m;
  y_dims[a_rank - 1] = n;
  OrtValue* out = NULL;
  float* y = NULL;
  status = ORTD_CALL(api, KernelContext_GetOutput)(ctx, 0, y_dims, a_rank, &out);
  if (!status) status = ORTD_CALL(api, GetTensorMutableData)(out, (void**)&y);
  if (status) return status;
  /* Rows of one product: a's batch where a is not transposed and b one matrix, else one product
   * per matrix. */
  int one_product = !k->trans_a && b_rank == 2;
  int64_t rows = one_product ? batch * m : m, products = one_product ? 1 : batch;
  if (!fits(rows) || !fits(n) || !fits(ka)) return fail(api, "ort_dynamo.blas MatMul: a dimension past 2^31");
  if (rows == 0 || n == 0) return NULL;
  if (bias)
    for (int64_t r = 0; r < rows * products; r++) memcpy(y + r * n, bias, sizeof(float) * (size_t)n);
  else if (ka == 0)
    memset(y, 0, sizeof(float) * (size_t)(rows * products * n));
  if (ka == 0) return NULL;
  Product g = {a, b, y, rows, n, ka, k->trans_a, k->trans_b, k->bf16, b_rank > 2 ? n * ka : 0, bias ? 1.0f : 0.0f,
               1, 0, 0};
  if (blas_threads_local == NULL || k->torch_threads) { /* the BLAS threads each product itself */
    if (products > 1 && !k->bf16 && blas_sgemm_batch != NULL) return multiply_batch(api, &g, products);
    for (int64_t p = 0; p < products; p++) multiply(&g, p, 0, rows, 0, n);
    return NULL;
  }
  int64_t parts = blas_parts < 1 ? 1 : blas_parts, row_parts = (rows + MIN_ROWS - 1) / MIN_ROWS;
  if (row_parts > parts) row_parts = parts;
  g.by_columns = products == 1 && parts > 1 && n >= 2 * MIN_COLS && (n > rows || row_parts == 1);
  if (g.by_columns) {
    g.parts = parts < n / MIN_COLS ? parts : n / MIN_COLS;
    g.per = (n + g.parts - 1) / g.parts;
  } else {
    g.parts = row_parts;
    g.per = (rows + row_parts - 1) / row_parts;
  }
  int64_t tasks = products * g.parts;
  if (tasks == 1) { /* too small to cut (a narrow weight's gradient): MKL threads it itself */
    multiply(&g, 0, 0, rows, 0, n);
    return NULL;
  }
  return ORTD_CALL(api, KernelContext_ParallelFor)(ctx, part_task, (size_t)tasks, 0, &g);
}

static const OrtCustomOp bf16_matmul_op;

static OrtStatus* create(const OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info, void** out) {
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (k == NULL) return fail(api, "ort_dynamo.blas MatMul: out of memory");
  k->api = api;
  k->bf16 = op == &bf16_matmul_op;
  OrtStatus* status = ORTD_CALL(api, KernelInfoGetAttribute_int64)(info, "trans_a", &k->trans_a);
  if (!status) status = ORTD_CALL(api, KernelInfoGetAttribute_int64)(info, "trans_b", &k->trans_b);
  if (!status) {
    OrtStatus* absent = ORTD_CALL(api, KernelInfoGetAttribute_int64)(info, "torch_threads", &k->torch_threads);
    if (absent) { /* optional: models made before it have none */
      ORTD_CALL(api, ReleaseStatus)(absent);
      k->torch_threads = 0;
    }
  }
  if (status) {
    free(k);
    return status;
  }
  *out = k;
  return NULL;
}

static void destroy(void* state) { free(state); }
static const char* name(const OrtCustomOp* op) { (void)op; return "MatMul"; }
static const char* bf16_name(const OrtCustomOp* op) { (void)op; return "Bf16MatMul"; }
static const char* on_cpu(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORTD_ELEM_FLOAT; }
static int bf16_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i < 2 ? ORTD_ELEM_BFLOAT16 : ORTD_ELEM_FLOAT; }
static size_t inputs(const OrtCustomOp* op) { (void)op; return 3; }
static size_t outputs(const OrtCustomOp* op) { (void)op; return 1; }
static int input_kind(const OrtCustomOp* op, size_t i) { (void)op; return i == 2 ? ORTD_IO_OPTIONAL : ORTD_IO_REQUIRED; }

static const OrtCustomOp matmul_op = {
    ORTD_CUSTOM_OP_VERSION, NULL, name, on_cpu, float_type, inputs, float_type, outputs, NULL, destroy,
    input_kind, ortd_io_required, ortd_on_device, NULL, NULL, NULL, NULL, create, compute};
static const OrtCustomOp bf16_matmul_op = {
    ORTD_CUSTOM_OP_VERSION, NULL, bf16_name, on_cpu, bf16_input_type, inputs, float_type, outputs, NULL, destroy,
    input_kind, ortd_io_required, ortd_on_device, NULL, NULL, NULL, NULL, create, compute};

ORTD_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApiTable* api = api_base->GetApi(ORTD_API_VERSION);
  if (api == NULL) return NULL;
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* status = ORTD_CALL(api, CreateCustomOpDomain)("ort_dynamo.blas", &domain);
  if (!status) status = ORTD_CALL(api, CustomOpDomain_Add)(domain, &matmul_op);
  if (!status) status = ORTD_CALL(api, CustomOpDomain_Add)(domain, &bf16_matmul_op);
  if (!status) status = ORTD_CALL(api, AddCustomOpDomain)(options, domain);
  return status;
}
