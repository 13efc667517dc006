/* PyTorch's CUDA caching allocator as ONNX Runtime's CUDA allocator. ORT's CUDA provider takes an
 * external allocator as two C functions, void* alloc(size_t) and void free(void*) (provider options
 * gpu_external_alloc/gpu_external_free); torch's stable C shim (AOTInductor's, in libtorch_cuda)
 * has raw_alloc/raw_delete returning an error code. These adapt one to the other. The shim's two
 * functions are handed in by ort_dynamo/_cuda_allocator.py (torch's libraries are not global). */
#include <stddef.h>
#include <stdint.h>

#define ORTD_EXPORT __attribute__((visibility("default")))

typedef int32_t (*raw_alloc_fn)(uint64_t nbytes, void** ptr);
typedef int32_t (*raw_delete_fn)(void* ptr);

static raw_alloc_fn raw_alloc;
static raw_delete_fn raw_delete;
/* The size of the last allocation PyTorch refused (0: none): ORT only says "p != nullptr", so
 * ort_dynamo reads this to say "out of memory" instead. */
static volatile uint64_t refused_bytes;

ORTD_EXPORT void ortd_torch_allocator_init(void* alloc, void* delete_) {
  raw_alloc = (raw_alloc_fn)alloc;
  raw_delete = (raw_delete_fn)delete_;
}

ORTD_EXPORT void* ortd_torch_alloc(size_t nbytes) {
  void* ptr = NULL;
  if (raw_alloc == NULL || raw_alloc((uint64_t)nbytes, &ptr) != 0 || ptr == NULL) {
    refused_bytes = nbytes;
    return NULL;
  }
  return ptr;
}

ORTD_EXPORT void ortd_torch_free(void* ptr) {
  if (ptr != NULL && raw_delete != NULL) raw_delete(ptr);
}

/* The size of the last refused allocation, and forget it. */
ORTD_EXPORT uint64_t ortd_torch_refused_bytes(void) {
  uint64_t bytes = refused_bytes;
  refused_bytes = 0;
  return bytes;
}
