/* PyTorch's fused CPU attention (flash attention for CPU, forward and backward) as ONNX Runtime
 * custom ops, so that attention runs inside an ORT session with eager's own kernel instead of as
 * products and a softmax. The kernels are called through torch's stable C shim (AOTInductor's:
 * aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu and its _backward); ORT's buffers
 * are handed over as tensors made from their pointers, and torch's results copied into ORT's
 * outputs. The shim's functions are handed in by ort_dynamo/_torch_attention.py (torch's
 * libraries are not global), before any session runs.
 *
 * Domain ort_dynamo.torch:
 *   FlashAttentionCpu(q, k, v[, mask]) -> (out, logsumexp)
 *   FlashAttentionCpuGrad(grad_out, q, k, v, out, logsumexp[, mask]) -> (grad_q, grad_k, grad_v)
 * q, k, v: [batch, heads, length, head size], float32; mask: float32 or bool, broadcast to
 * [batch, heads, q length, kv length]. Attributes: is_causal (int), scale (float; has_scale 0:
 * torch's default 1/sqrt(head size)). No dropout: that attention stays ORT's own. */
#include <stdint.h>
#include <stdlib.h>

#include "ort_abi.h"

typedef void* AtenTensorHandle;
typedef int32_t (*from_blob_fn)(void* data, int64_t ndim, const int64_t* sizes, const int64_t* strides,
                                int64_t storage_offset, int32_t dtype, int32_t device_type, int32_t device_index,
                                AtenTensorHandle* ret);
typedef int32_t (*delete_fn)(AtenTensorHandle tensor);
typedef int32_t (*copy_fn)(AtenTensorHandle self, AtenTensorHandle src, int32_t non_blocking);
typedef int32_t (*forward_fn)(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, double dropout_p,
                              int32_t is_causal, AtenTensorHandle* mask, double* scale, AtenTensorHandle* out,
                              AtenTensorHandle* logsumexp);
typedef int32_t (*backward_fn)(AtenTensorHandle grad_out, AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                               AtenTensorHandle out, AtenTensorHandle logsumexp, double dropout_p, int32_t is_causal,
                               AtenTensorHandle* mask, double* scale, AtenTensorHandle* grad_q, AtenTensorHandle* grad_k,
                               AtenTensorHandle* grad_v);

static struct {
  from_blob_fn from_blob;
  delete_fn delete_tensor;
  copy_fn copy;
  forward_fn forward;
  backward_fn backward;
  int32_t float32, boolean, cpu; /* torch's dtype and device codes */
} torch_fns;

#define ORTD_EXPORT_C __attribute__((visibility("default")))

/* fns: from_blob, delete, copy_, forward, backward (the shim's functions, in that order). */
ORTD_EXPORT_C void ortd_torch_attention_init(void* const* fns, int32_t float32, int32_t boolean, int32_t cpu) {
  torch_fns.from_blob = (from_blob_fn)fns[0];
  torch_fns.delete_tensor = (delete_fn)fns[1];
  torch_fns.copy = (copy_fn)fns[2];
  torch_fns.forward = (forward_fn)fns[3];
  torch_fns.backward = (backward_fn)fns[4];
  torch_fns.float32 = float32;
  torch_fns.boolean = boolean;
  torch_fns.cpu = cpu;
}

#define MAX_RANK 4
#define MAX_HANDLES 12

typedef struct Kernel {
  const OrtApiTable* api;
  int grad;
  int64_t is_causal;
  int has_scale;
  double scale;
} Kernel;

/* The handles one call made; all deleted at its end, whatever happened. */
typedef struct Handles {
  AtenTensorHandle items[MAX_HANDLES];
  int count;
} Handles;

static void release(Handles* handles) {
  for (int i = 0; i < handles->count; i++) torch_fns.delete_tensor(handles->items[i]);
  handles->count = 0;
}

static OrtStatus* fail(const OrtApiTable* api, const char* what) {
  return ORTD_CALL(api, CreateStatus)(ORTD_RUNTIME_EXCEPTION, what);
}

/* A torch tensor over an ORT tensor's buffer (contiguous, as ORT's are). */
static OrtStatus* wrap(const OrtApiTable* api, OrtValue* value, Handles* handles, AtenTensorHandle* out) {
  int64_t dims[MAX_RANK], strides[MAX_RANK];
  size_t rank = 0;
  int type = 0;
  OrtStatus* status = ortd_tensor_type_and_shape(api, value, &type, dims, &rank, MAX_RANK);
  if (status) return status;
  if (rank > MAX_RANK) return fail(api, "ort_dynamo.torch attention: a tensor of more than 4 dimensions");
  int32_t dtype;
  if (type == ORTD_ELEM_FLOAT) dtype = torch_fns.float32;
  else if (type == ORTD_ELEM_BOOL) dtype = torch_fns.boolean;
  else return fail(api, "ort_dynamo.torch attention: a tensor neither float32 nor bool");
  int64_t stride = 1;
  for (size_t i = rank; i-- > 0;) {
    strides[i] = stride;
    stride *= dims[i] > 1 ? dims[i] : 1;
  }
  void* data = NULL;
  status = ORTD_CALL(api, GetTensorMutableData)(value, &data);
  if (status) return status;
  if (handles->count == MAX_HANDLES) return fail(api, "ort_dynamo.torch attention: too many tensors");
  if (torch_fns.from_blob(data, (int64_t)rank, dims, strides, 0, dtype, torch_fns.cpu, 0, out) != 0)
    return fail(api, "ort_dynamo.torch attention: torch could not take ORT's buffer as a tensor");
  handles->items[handles->count++] = *out;
  return NULL;
}

static OrtStatus* input(const OrtApiTable* api, OrtKernelContext* ctx, size_t index, Handles* handles,
                        AtenTensorHandle* out) {
  const OrtValue* value = NULL;
  OrtStatus* status = ORTD_CALL(api, KernelContext_GetInput)(ctx, index, &value);
  if (status) return status;
  if (value == NULL) {
    *out = NULL;
    return NULL;
  }
  return wrap(api, (OrtValue*)value, handles, out);
}

/* ORT's output ``index`` of ``like``'s shape (minus its last axis if ``drop_last``), filled
 * with torch's ``result``. */
static OrtStatus* output(const OrtApiTable* api, OrtKernelContext* ctx, size_t index, const OrtValue* like,
                         int drop_last, AtenTensorHandle result, Handles* handles) {
  int64_t dims[MAX_RANK];
  size_t rank = 0;
  OrtStatus* status = ortd_tensor_shape(api, like, dims, &rank, MAX_RANK);
  if (status) return status;
  OrtValue* value = NULL;
  status = ORTD_CALL(api, KernelContext_GetOutput)(ctx, index, dims, rank - (drop_last ? 1 : 0), &value);
  if (status) return status;
  AtenTensorHandle target;
  status = wrap(api, value, handles, &target);
  if (status) return status;
  if (torch_fns.copy(target, result, 0) != 0) return fail(api, "ort_dynamo.torch attention: copying torch's result failed");
  return NULL;
}

static OrtStatus* compute(void* state, OrtKernelContext* ctx) {
  Kernel* k = (Kernel*)state;
  const OrtApiTable* api = k->api;
  if (torch_fns.forward == NULL) return fail(api, "ort_dynamo.torch attention: torch's functions were not handed in");
  Handles handles = {{0}, 0};
  Handles results = {{0}, 0};
  AtenTensorHandle in[7] = {0};
  size_t count = 0;
  OrtStatus* status = ORTD_CALL(api, KernelContext_GetInputCount)(ctx, &count);
  size_t tensors = k->grad ? 6 : 3;
  for (size_t i = 0; !status && i < count && i < tensors + 1; i++) status = input(api, ctx, i, &handles, &in[i]);
  double* scale = k->has_scale ? &k->scale : NULL;
  AtenTensorHandle* mask = count > tensors && in[tensors] ? &in[tensors] : NULL;
  const OrtValue* like[3] = {0};
  if (!status) {
    AtenTensorHandle r[3] = {0};
    int32_t error;
    if (k->grad) {
      error = torch_fns.backward(in[0], in[1], in[2], in[3], in[4], in[5], 0.0, (int32_t)k->is_causal, mask, scale,
                                 &r[0], &r[1], &r[2]);
    } else {
      error = torch_fns.forward(in[0], in[1], in[2], 0.0, (int32_t)k->is_causal, mask, scale, &r[0], &r[1]);
    }
    int made = k->grad ? 3 : 2;
    for (int i = 0; i < made; i++)
      if (r[i]) results.items[results.count++] = r[i];
    if (error != 0 || results.count != made) {
      status = fail(api, "ort_dynamo.torch attention: torch's flash attention for CPU failed");
    } else if (k->grad) {
      /* grad_q, grad_k, grad_v: the shapes of q, k and v (inputs 1, 2, 3) */
      for (int i = 0; !status && i < 3; i++) {
        status = ORTD_CALL(api, KernelContext_GetInput)(ctx, (size_t)i + 1, &like[i]);
        if (!status) status = output(api, ctx, (size_t)i, like[i], 0, r[i], &handles);
      }
    } else {
      /* out: q's shape with v's head size (the same here); logsumexp: q's without the last */
      status = ORTD_CALL(api, KernelContext_GetInput)(ctx, 0, &like[0]);
      if (!status) status = output(api, ctx, 0, like[0], 0, r[0], &handles);
      if (!status) status = output(api, ctx, 1, like[0], 1, r[1], &handles);
    }
  }
  release(&results);
  release(&handles);
  return status;
}

static OrtStatus* create(const OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info, void** out);
static void destroy(void* state) { free(state); }

static const char* forward_name(const OrtCustomOp* op) { (void)op; return "FlashAttentionCpu"; }
static const char* backward_name(const OrtCustomOp* op) { (void)op; return "FlashAttentionCpuGrad"; }
static const char* on_cpu(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
/* Tensors float32; the mask (the last input) float32 or bool: any type, checked at run time. */
static int forward_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 3 ? ORTD_ELEM_UNDEFINED : ORTD_ELEM_FLOAT; }
static int backward_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 6 ? ORTD_ELEM_UNDEFINED : ORTD_ELEM_FLOAT; }
static size_t forward_inputs(const OrtCustomOp* op) { (void)op; return 4; }
static size_t backward_inputs(const OrtCustomOp* op) { (void)op; return 7; }
static int float_output(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORTD_ELEM_FLOAT; }
static size_t forward_outputs(const OrtCustomOp* op) { (void)op; return 2; }
static size_t backward_outputs(const OrtCustomOp* op) { (void)op; return 3; }
static int forward_input_kind(const OrtCustomOp* op, size_t i) { (void)op; return i == 3 ? ORTD_IO_OPTIONAL : ORTD_IO_REQUIRED; }
static int backward_input_kind(const OrtCustomOp* op, size_t i) { (void)op; return i == 6 ? ORTD_IO_OPTIONAL : ORTD_IO_REQUIRED; }

static const OrtCustomOp forward_op = {
    ORTD_CUSTOM_OP_VERSION, NULL, forward_name, on_cpu, forward_input_type, forward_inputs, float_output,
    forward_outputs, NULL, destroy, forward_input_kind, ortd_io_required, ortd_on_device, NULL, NULL, NULL, NULL,
    create, compute};
static const OrtCustomOp backward_op = {
    ORTD_CUSTOM_OP_VERSION, NULL, backward_name, on_cpu, backward_input_type, backward_inputs, float_output,
    backward_outputs, NULL, destroy, backward_input_kind, ortd_io_required, ortd_on_device, NULL, NULL, NULL, NULL,
    create, compute};

static OrtStatus* create(const OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info, void** out) {
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (k == NULL) return fail(api, "ort_dynamo.torch attention: out of memory");
  k->api = api;
  k->grad = op == &backward_op;
  int64_t has_scale = 0;
  float scale = 0.0f;
  OrtStatus* status = ORTD_CALL(api, KernelInfoGetAttribute_int64)(info, "is_causal", &k->is_causal);
  if (!status) status = ORTD_CALL(api, KernelInfoGetAttribute_int64)(info, "has_scale", &has_scale);
  if (!status && has_scale) status = ORTD_CALL(api, KernelInfoGetAttribute_float)(info, "scale", &scale);
  if (status) {
    free(k);
    return status;
  }
  k->has_scale = (int)has_scale;
  k->scale = (double)scale;
  *out = k;
  return NULL;
}

ORTD_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApiTable* api = api_base->GetApi(ORTD_API_VERSION);
  if (api == NULL) return NULL;
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* status = ORTD_CALL(api, CreateCustomOpDomain)("ort_dynamo.torch", &domain);
  if (!status) status = ORTD_CALL(api, CustomOpDomain_Add)(domain, &forward_op);
  if (!status) status = ORTD_CALL(api, CustomOpDomain_Add)(domain, &backward_op);
  if (!status) status = ORTD_CALL(api, AddCustomOpDomain)(options, domain);
  return status;
}
