/* pointwise_cuda_runtime.c -- ort_dynamo's generated GPU kernels as ONNX Runtime custom ops
 * of its CUDA execution provider.
 *
 * A library is this file and a table (_kernels.py writes it): the kernels' definitions and
 * one CUDA binary (NVRTC's, for the machine's GPU) holding them all. Each op broadcasts its
 * inputs as ONNX does, has ORT allocate its outputs on the device, and launches its kernel
 * on the stream ORT gives the op (KernelContext_GetGPUComputeStream): no host wait, no copy.
 * The CUDA driver is opened at run time, so building the library needs no CUDA toolkit.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"
#include "pointwise_cuda.h"

/* Defined by the library's table. */
extern const PwCudaKernelDef* const pw_cuda_kernels[];
extern const unsigned char pw_cuda_image[];

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
#define PWC_SM_COUNT_ATTRIBUTE 16 /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */

static struct {
  CUresult (*Init)(unsigned);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxGetDevice)(CUdevice*);
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**);
  CUresult (*GetErrorString)(CUresult, const char**);
} cu;

/* One module per CUDA context the library's kernels ran in (a process's devices). */
#define PWC_CONTEXTS 16
typedef struct PwcModule {
  CUcontext context;
  int sms;
  CUfunction* functions; /* per kernel: the 64-bit entry, then the 32-bit one */
} PwcModule;
static PwcModule modules[PWC_CONTEXTS];
static int module_count;
static int kernel_count;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct PwcKernel {
  const OrtApiTable* api;
  const PwCudaKernelDef* def;
  int index;
} PwcKernel;

static OrtStatus* pwc_error(const OrtApiTable* api, const PwCudaKernelDef* def, const char* what, CUresult rc) {
  char message[512];
  const char* text = NULL;
  if (rc && cu.GetErrorString) cu.GetErrorString(rc, &text);
  if (rc)
    snprintf(message, sizeof message, "ort_dynamo CUDA kernel %s: %s (CUDA error %d: %s)", def ? def->name : "-",
             what, rc, text ? text : "?");
  else
    snprintf(message, sizeof message, "ort_dynamo CUDA kernel %s: %s", def ? def->name : "-", what);
  return ORTD_CALL(api, CreateStatus)(ORTD_RUNTIME_EXCEPTION, message);
}

#define PWC_TRY(call)              \
  do {                             \
    OrtStatus* status_ = (call);   \
    if (status_) return status_;   \
  } while (0)

static const char* pwc_open_driver(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return "cannot open the CUDA driver (libcuda.so.1)";
#define PWC_SYM(field, symbol) \
  if (!(*(void**)&cu.field = dlsym(lib, symbol))) return "the CUDA driver lacks " symbol;
  PWC_SYM(Init, "cuInit")
  PWC_SYM(CtxGetCurrent, "cuCtxGetCurrent")
  PWC_SYM(CtxGetDevice, "cuCtxGetDevice")
  PWC_SYM(DeviceGetAttribute, "cuDeviceGetAttribute")
  PWC_SYM(ModuleLoadData, "cuModuleLoadData")
  PWC_SYM(ModuleGetFunction, "cuModuleGetFunction")
  PWC_SYM(LaunchKernel, "cuLaunchKernel")
  PWC_SYM(GetErrorString, "cuGetErrorString")
#undef PWC_SYM
  return cu.Init(0) ? "cuInit failed" : NULL;
}

/* The module of the calling thread's context (ORT's CUDA provider made it current), loaded
 * on first use there. */
static OrtStatus* pwc_module(const OrtApiTable* api, const PwCudaKernelDef* def, PwcModule** out) {
  static const char* driver_error = "not opened";
  CUcontext context = NULL;
  OrtStatus* status = NULL;
  pthread_mutex_lock(&lock);
  if (driver_error && strcmp(driver_error, "not opened") == 0) driver_error = pwc_open_driver();
  if (driver_error) {
    status = pwc_error(api, def, driver_error, 0);
    goto done;
  }
  CUresult rc = cu.CtxGetCurrent(&context);
  if (rc || !context) {
    status = pwc_error(api, def, "no current CUDA context on ONNX Runtime's thread", rc);
    goto done;
  }
  for (int m = 0; m < module_count; ++m)
    if (modules[m].context == context) {
      *out = &modules[m];
      goto done;
    }
  if (module_count == PWC_CONTEXTS) {
    status = pwc_error(api, def, "more CUDA contexts than the library keeps modules for", 0);
    goto done;
  }
  PwcModule* m = &modules[module_count];
  CUmodule module;
  CUdevice device;
  if ((rc = cu.ModuleLoadData(&module, pw_cuda_image))) {
    status = pwc_error(api, def, "the kernels' binary does not load on this GPU", rc);
    goto done;
  }
  if ((rc = cu.CtxGetDevice(&device)) || (rc = cu.DeviceGetAttribute(&m->sms, PWC_SM_COUNT_ATTRIBUTE, device))) {
    status = pwc_error(api, def, "cannot query the device", rc);
    goto done;
  }
  m->functions = (CUfunction*)calloc(2 * (size_t)kernel_count, sizeof(CUfunction));
  if (!m->functions) {
    status = pwc_error(api, def, "out of memory", 0);
    goto done;
  }
  for (int k = 0; k < kernel_count; ++k) {
    char name32[256];
    snprintf(name32, sizeof name32, "%s_32", pw_cuda_kernels[k]->name);
    if ((rc = cu.ModuleGetFunction(&m->functions[2 * k], module, pw_cuda_kernels[k]->name)) ||
        (rc = cu.ModuleGetFunction(&m->functions[2 * k + 1], module, name32))) {
      status = pwc_error(api, pw_cuda_kernels[k], "not in the kernels' binary", rc);
      free(m->functions);
      goto done;
    }
  }
  m->context = context;
  *out = m;
  ++module_count;
done:
  pthread_mutex_unlock(&lock);
  return status;
}

static OrtStatus* pwc_compute(void* kernel, OrtKernelContext* ctx) {
  const PwcKernel* k = (const PwcKernel*)kernel;
  const OrtApiTable* api = k->api;
  const PwCudaKernelDef* def = k->def;
  PwCudaArgs a;
  memset(&a, 0, sizeof a);
  int64_t shapes[PW_MAX_ARGS][PW_MAX_RANK];
  size_t ranks[PW_MAX_ARGS];
  for (int i = 0; i < def->n_in; ++i) {
    const OrtValue* value;
    PWC_TRY(ORTD_CALL(api, KernelContext_GetInput)(ctx, (size_t)i, &value));
    PWC_TRY(ortd_tensor_shape(api, value, shapes[i], &ranks[i], PW_MAX_RANK));
    if (ranks[i] > PW_MAX_RANK) return pwc_error(api, def, "an input has more than 8 axes", 0);
    PWC_TRY(ORTD_CALL(api, GetTensorMutableData)((OrtValue*)value, (void**)&a.in[i]));
  }
  if (pw_cuda_prepare(&a, def->n_in, (const int64_t(*)[PW_MAX_RANK])shapes, ranks))
    return pwc_error(api, def, "the inputs' shapes do not broadcast", 0);
  const int64_t numel = a.numel;
  int64_t row_sum_dims[PW_MAX_RANK]; /* a row sum's shape: the last axis 1 */
  memcpy(row_sum_dims, a.dims, sizeof row_sum_dims);
  if (a.rank > 0) row_sum_dims[a.rank - 1] = 1;
  for (int j = 0; j < def->n_out; ++j) {
    OrtValue* value;
    const int row_sum = def->rows && def->out_kinds[j] == 1;
    PWC_TRY(ORTD_CALL(api, KernelContext_GetOutput)(ctx, (size_t)j, row_sum ? row_sum_dims : a.dims,
                                                    (size_t)a.rank, &value));
    PWC_TRY(ORTD_CALL(api, GetTensorMutableData)(value, &a.out[j]));
  }
  if (numel == 0) return NULL;
  PwcModule* module;
  PWC_TRY(pwc_module(api, def, &module));
  void* stream = NULL;
  PWC_TRY(ORTD_CALL(api, KernelContext_GetGPUComputeStream)(ctx, &stream));
  const int narrow = numel < ((int64_t)1 << 31);
  int64_t blocks = def->rows ? numel / a.dims[a.rank - 1] : (numel + PW_THREADS - 1) / PW_THREADS;
  const int64_t most = (int64_t)module->sms * 16;
  if (blocks > most) blocks = most;
  void* params[] = {&a};
  const CUresult rc = cu.LaunchKernel(module->functions[2 * k->index + narrow], (unsigned)blocks, 1, 1, PW_THREADS,
                                      1, 1, 0, (CUstream)stream, params, NULL);
  return rc ? pwc_error(api, def, "launch failed", rc) : NULL;
}

/* -- the custom ops ------------------------------------------------------------------------------ */

typedef struct PwcOp {
  OrtCustomOp op; /* first: ORT hands back this pointer */
  const PwCudaKernelDef* def;
  int index;
} PwcOp;

static const PwcOp* pwc_op(const OrtCustomOp* op) { return (const PwcOp*)op; }
static OrtStatus* pwc_create(const OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info,
                             void** out) {
  (void)info;
  PwcKernel* k = (PwcKernel*)malloc(sizeof(PwcKernel));
  if (!k) return ORTD_CALL(api, CreateStatus)(ORTD_FAIL, "ort_dynamo CUDA kernels: out of memory");
  k->api = api;
  k->def = pwc_op(op)->def;
  k->index = pwc_op(op)->index;
  *out = k;
  return NULL;
}
static void* pwc_create_v1(const OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info) {
  void* k = NULL;
  OrtStatus* status = pwc_create(op, api, info, &k);
  if (status) ORTD_CALL(api, ReleaseStatus)(status);
  return k;
}
static void pwc_compute_v1(void* kernel, OrtKernelContext* ctx) {
  OrtStatus* status = pwc_compute(kernel, ctx);
  if (status) ORTD_CALL(((PwcKernel*)kernel)->api, ReleaseStatus)(status); /* V2 is what ORT calls */
}
static void pwc_destroy(void* kernel) { free(kernel); }
static const char* pwc_name(const OrtCustomOp* op) { return pwc_op(op)->def->name; }
static const char* pwc_provider(const OrtCustomOp* op) {
  (void)op;
  return "CUDAExecutionProvider";
}
static int pwc_input_type(const OrtCustomOp* op, size_t i) { return pwc_op(op)->def->types[i]; }
static size_t pwc_input_count(const OrtCustomOp* op) { return (size_t)pwc_op(op)->def->n_in; }
static int pwc_output_type(const OrtCustomOp* op, size_t i) { return pwc_op(op)->def->out_types[i]; }
static size_t pwc_output_count(const OrtCustomOp* op) { return (size_t)pwc_op(op)->def->n_out; }

ORTD_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  static PwcOp* ops; /* filled on the first registration; later sessions share them */
  const OrtApiTable* api = base->GetApi(ORTD_API_VERSION);
  if (!api) return NULL;
  pthread_mutex_lock(&lock);
  if (!ops) {
    int count = 0;
    while (pw_cuda_kernels[count]) ++count;
    ops = (PwcOp*)calloc(count ? (size_t)count : 1, sizeof(PwcOp));
    for (int i = 0; ops && i < count; ++i) {
      PwcOp* p = &ops[i];
      p->def = pw_cuda_kernels[i];
      p->index = i;
      p->op.version = ORTD_CUSTOM_OP_VERSION;
      p->op.CreateKernel = pwc_create_v1;
      p->op.GetName = pwc_name;
      p->op.GetExecutionProviderType = pwc_provider;
      p->op.GetInputType = pwc_input_type;
      p->op.GetInputTypeCount = pwc_input_count;
      p->op.GetOutputType = pwc_output_type;
      p->op.GetOutputTypeCount = pwc_output_count;
      p->op.KernelCompute = pwc_compute_v1;
      p->op.KernelDestroy = pwc_destroy;
      p->op.GetInputCharacteristic = ortd_io_required;
      p->op.GetOutputCharacteristic = ortd_io_required;
      p->op.GetInputMemoryType = ortd_on_device;
      p->op.CreateKernelV2 = pwc_create;
      p->op.KernelComputeV2 = pwc_compute;
    }
    kernel_count = count;
  }
  pthread_mutex_unlock(&lock);
  if (!ops) return ORTD_CALL(api, CreateStatus)(ORTD_FAIL, "ort_dynamo CUDA kernels: out of memory");
  OrtCustomOpDomain* domain;
  PWC_TRY(ORTD_CALL(api, CreateCustomOpDomain)("ort_dynamo.pointwise", &domain));
  for (int i = 0; i < kernel_count; ++i) PWC_TRY(ORTD_CALL(api, CustomOpDomain_Add)(domain, &ops[i].op));
  return ORTD_CALL(api, AddCustomOpDomain)(options, domain); /* the domain outlives the sessions */
}
