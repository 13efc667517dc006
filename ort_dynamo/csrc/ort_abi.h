/* ort_abi.h -- the small slice of the ONNX Runtime C ABI that ort_dynamo's
 * custom-op kernels use.  Self-written from ABI facts (struct field order,
 * function-table slot numbers); no ONNX Runtime header is needed.
 *
 * Everything reaches us through the OrtApiBase pointer handed to
 * RegisterCustomOps(), so a kernel library never links against onnxruntime.
 * The OrtApi function table is append-only across releases, so the slot
 * numbers below stay valid in every runtime that supports ORTD_API_VERSION.
 *
 * Part of ort_dynamo; MIT licensed.
 */
#ifndef ORT_DYNAMO_ORT_ABI_H
#define ORT_DYNAMO_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- opaque runtime handles ------------------------------------------- */
typedef struct OrtStatus OrtStatus; /* NULL means success */
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtCustomOp OrtCustomOp; /* defined below */

/* C enums in the real ABI are int-sized; we pass them as plain int. */

/* Error codes for CreateStatus. */
#define ORTD_OK 0
#define ORTD_FAIL 1
#define ORTD_INVALID_ARGUMENT 2
#define ORTD_RUNTIME_EXCEPTION 6
#define ORTD_NOT_IMPLEMENTED 9

/* Tensor element types (ONNX TensorProto numbering). */
#define ORTD_ELEM_UNDEFINED 0 /* as an op type: "any type" */
#define ORTD_ELEM_FLOAT 1
#define ORTD_ELEM_INT64 7
#define ORTD_ELEM_BOOL 9
#define ORTD_ELEM_BFLOAT16 16

/* Input/output characteristic returned by OrtCustomOp getters. */
#define ORTD_IO_REQUIRED 0
#define ORTD_IO_OPTIONAL 1
#define ORTD_IO_VARIADIC 2

#define ORTD_MEM_DEFAULT 0 /* OrtMemType: input lives on the op's device */

/* ---- API table --------------------------------------------------------- */

/* Ask GetApi for this version: the first one with KernelContext_ParallelFor
 * (ONNX Runtime 1.17).  Any newer runtime returns the same table. */
#define ORTD_API_VERSION 17u

/* Slot numbers (0-based) in the OrtApi function table. */
#define ORTD_SLOT_CreateStatus 0
#define ORTD_SLOT_CreateCustomOpDomain 26
#define ORTD_SLOT_CustomOpDomain_Add 27
#define ORTD_SLOT_AddCustomOpDomain 28
#define ORTD_SLOT_GetTensorMutableData 51
#define ORTD_SLOT_GetTensorElementType 60
#define ORTD_SLOT_GetDimensionsCount 61
#define ORTD_SLOT_GetDimensions 62
#define ORTD_SLOT_GetTensorTypeAndShape 65
#define ORTD_SLOT_KernelInfoGetAttribute_float 85
#define ORTD_SLOT_KernelInfoGetAttribute_int64 86
#define ORTD_SLOT_KernelInfoGetAttribute_string 87
#define ORTD_SLOT_KernelContext_GetInputCount 88
#define ORTD_SLOT_KernelContext_GetOutputCount 89
#define ORTD_SLOT_KernelContext_GetInput 90
#define ORTD_SLOT_KernelContext_GetOutput 91
#define ORTD_SLOT_ReleaseStatus 93
#define ORTD_SLOT_ReleaseTensorTypeAndShapeInfo 99
#define ORTD_SLOT_KernelContext_GetGPUComputeStream 193 /* since API 14 */
#define ORTD_SLOT_KernelContext_ParallelFor 274 /* since API 17 */
#define ORTD_API_SLOTS 275 /* slots we may touch; the real table is longer */

typedef void (*ortd_any_fn)(void);
typedef struct OrtApiTable {
  const ortd_any_fn fn[ORTD_API_SLOTS];
} OrtApiTable;

/* Function types, one per slot above. */
typedef OrtStatus* (*ortd_CreateStatus_fn)(int code, const char* msg);
typedef OrtStatus* (*ortd_CreateCustomOpDomain_fn)(const char* domain, OrtCustomOpDomain** out);
typedef OrtStatus* (*ortd_CustomOpDomain_Add_fn)(OrtCustomOpDomain* domain, const OrtCustomOp* op);
typedef OrtStatus* (*ortd_AddCustomOpDomain_fn)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
typedef OrtStatus* (*ortd_GetTensorMutableData_fn)(OrtValue* value, void** out);
typedef OrtStatus* (*ortd_GetTensorElementType_fn)(const OrtTensorTypeAndShapeInfo* info, int* out);
typedef OrtStatus* (*ortd_GetDimensionsCount_fn)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
typedef OrtStatus* (*ortd_GetDimensions_fn)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t ndims);
typedef OrtStatus* (*ortd_GetTensorTypeAndShape_fn)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
typedef OrtStatus* (*ortd_KernelInfoGetAttribute_float_fn)(const OrtKernelInfo* info, const char* name, float* out);
typedef OrtStatus* (*ortd_KernelInfoGetAttribute_int64_fn)(const OrtKernelInfo* info, const char* name, int64_t* out);
/* out == NULL: *size gets the needed byte count (including the NUL). */
typedef OrtStatus* (*ortd_KernelInfoGetAttribute_string_fn)(const OrtKernelInfo* info, const char* name, char* out,
                                                            size_t* size);
typedef OrtStatus* (*ortd_KernelContext_GetInputCount_fn)(const OrtKernelContext* ctx, size_t* out);
typedef OrtStatus* (*ortd_KernelContext_GetOutputCount_fn)(const OrtKernelContext* ctx, size_t* out);
typedef OrtStatus* (*ortd_KernelContext_GetInput_fn)(const OrtKernelContext* ctx, size_t index, const OrtValue** out);
typedef OrtStatus* (*ortd_KernelContext_GetOutput_fn)(OrtKernelContext* ctx, size_t index, const int64_t* dims,
                                                      size_t ndims, OrtValue** out);
typedef void (*ortd_ReleaseStatus_fn)(OrtStatus* status);
typedef void (*ortd_ReleaseTensorTypeAndShapeInfo_fn)(OrtTensorTypeAndShapeInfo* info);
/* The stream (a cudaStream_t) the op's execution provider runs it on. */
typedef OrtStatus* (*ortd_KernelContext_GetGPUComputeStream_fn)(const OrtKernelContext* ctx, void** out);
/* Calls body(user, i) for i in [0, total) on the session's intra-op pool;
 * max_batches == 0 lets the runtime pick the batching.  Returns after all. */
typedef OrtStatus* (*ortd_KernelContext_ParallelFor_fn)(const OrtKernelContext* ctx, void (*body)(void* user, size_t i),
                                                        size_t total, size_t max_batches, void* user);

/* ORTD_CALL(api, Name) yields the typed function pointer for slot Name. */
#define ORTD_CALL(api, name) ((ortd_##name##_fn)((api)->fn[ORTD_SLOT_##name]))

/* ---- helpers both kernel libraries use --------------------------------- */

/* A tensor's shape and, where element_type is not NULL, its element type (ORTD_ELEM_*); dims
 * is filled only for a rank up to max_rank (the caller checks *rank). */
static inline OrtStatus* ortd_tensor_type_and_shape(const OrtApiTable* api, const OrtValue* value, int* element_type,
                                                    int64_t* dims, size_t* rank, size_t max_rank) {
  OrtTensorTypeAndShapeInfo* info;
  OrtStatus* status = ORTD_CALL(api, GetTensorTypeAndShape)(value, &info);
  if (status) return status;
  status = ORTD_CALL(api, GetDimensionsCount)(info, rank);
  if (!status && *rank <= max_rank) status = ORTD_CALL(api, GetDimensions)(info, dims, *rank);
  if (!status && element_type) status = ORTD_CALL(api, GetTensorElementType)(info, element_type);
  ORTD_CALL(api, ReleaseTensorTypeAndShapeInfo)(info);
  return status;
}

/* A tensor's shape (``ortd_tensor_type_and_shape`` without the type). */
static inline OrtStatus* ortd_tensor_shape(const OrtApiTable* api, const OrtValue* value, int64_t* dims,
                                           size_t* rank, size_t max_rank) {
  return ortd_tensor_type_and_shape(api, value, NULL, dims, rank, max_rank);
}

/* OrtCustomOp callbacks: every input and output required, and on the op's own device. */
static inline int ortd_io_required(const struct OrtCustomOp* op, size_t index) {
  (void)op;
  (void)index;
  return ORTD_IO_REQUIRED;
}
static inline int ortd_on_device(const struct OrtCustomOp* op, size_t index) {
  (void)op;
  (void)index;
  return ORTD_MEM_DEFAULT;
}

/* ---- entry point ------------------------------------------------------- */
typedef struct OrtApiBase {
  const OrtApiTable* (*GetApi)(uint32_t version); /* NULL if unsupported */
  const char* (*GetVersionString)(void);
} OrtApiBase;

#if defined(_WIN32)
#define ORTD_EXPORT __declspec(dllexport)
#else
#define ORTD_EXPORT __attribute__((visibility("default")))
#endif

/* Looked up by name by SessionOptions.register_custom_ops_library(). */
ORTD_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base);

/* ---- custom op description -------------------------------------------- */

/* Set op.version to this.  The runtime then reads exactly the fields
 * declared below: the V2 pair (>= 16) but not the shape-inference,
 * opset-range or in-place fields that follow in newer layouts (>= 17). */
#define ORTD_CUSTOM_OP_VERSION 16u

struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info);
  const char* (*GetName)(const struct OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp* op); /* NULL result = CPU */
  int (*GetInputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp* op);
  int (*GetOutputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* ctx);
  void (*KernelDestroy)(void* kernel);
  /* Always set these two: recent runtimes call them whatever the version. */
  int (*GetInputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  /* Called when version >= 13. */
  int (*GetInputMemoryType)(const struct OrtCustomOp* op, size_t index);
  /* Called only for VARIADIC inputs/outputs (version >= 14); may be NULL otherwise. */
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp* op);
  /* Used instead of CreateKernel / KernelCompute when version >= 16 and
   * non-NULL; a returned OrtStatus becomes the session/run error. */
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp* op, const OrtApiTable* api, const OrtKernelInfo* info,
                               void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* ctx);
};

#if defined(__cplusplus)
#define ORTD_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define ORTD_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif
ORTD_STATIC_ASSERT(offsetof(OrtCustomOp, CreateKernel) == sizeof(void*), "OrtCustomOp layout");
ORTD_STATIC_ASSERT(offsetof(OrtCustomOp, KernelComputeV2) == 18 * sizeof(void*), "OrtCustomOp layout");
ORTD_STATIC_ASSERT(sizeof(OrtApiBase) == 2 * sizeof(void*), "OrtApiBase layout");

#ifdef __cplusplus
}
#endif

#endif /* ORT_DYNAMO_ORT_ABI_H */
