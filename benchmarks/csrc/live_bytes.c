/* live_bytes.c -- counts the bytes malloc has handed out and not yet taken back, and their
 * peak, for benchmarks/memory_phases.py --live (loaded with LD_PRELOAD; glibc only).
 *
 * RSS counts what allocators keep as well as what is live: glibc's freed heap, ORT's arena.
 * These counters count only live blocks (their usable size), so two backends can be compared
 * without their allocators' habits. Every malloc-family call of the process goes through here:
 * PyTorch's CPU tensors, and ORT's when its arena is off (memory_phases.py turns it off).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

extern void* __libc_malloc(size_t);
extern void __libc_free(void*);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);

static _Atomic long live_bytes = 0, peak_bytes = 0;

static void count_in(void* p) {
  if (!p) return;
  const long size = (long)malloc_usable_size(p);
  const long now = atomic_fetch_add(&live_bytes, size) + size;
  long peak = atomic_load(&peak_bytes);
  while (now > peak && !atomic_compare_exchange_weak(&peak_bytes, &peak, now)) {
  }
}

static void count_out(void* p) {
  if (p) atomic_fetch_sub(&live_bytes, (long)malloc_usable_size(p));
}

void* malloc(size_t n) {
  void* p = __libc_malloc(n);
  count_in(p);
  return p;
}

void free(void* p) {
  count_out(p);
  __libc_free(p);
}

void* calloc(size_t count, size_t n) {
  void* p = __libc_calloc(count, n);
  count_in(p);
  return p;
}

void* realloc(void* old, size_t n) {
  count_out(old);
  void* p = __libc_realloc(old, n);
  count_in(p ? p : (n ? old : NULL)); /* a failed realloc leaves the old block live */
  return p;
}

void* memalign(size_t alignment, size_t n) {
  void* p = __libc_memalign(alignment, n);
  count_in(p);
  return p;
}

void* aligned_alloc(size_t alignment, size_t n) { return memalign(alignment, n); }

void* valloc(size_t n) { return memalign(4096, n); }

int posix_memalign(void** out, size_t alignment, size_t n) {
  void* p = __libc_memalign(alignment, n);
  if (!p) return ENOMEM;
  count_in(p);
  *out = p;
  return 0;
}

long live_bytes_now(void) { return atomic_load(&live_bytes); }

long live_bytes_peak(void) { return atomic_load(&peak_bytes); }

void live_bytes_reset_peak(void) { atomic_store(&peak_bytes, atomic_load(&live_bytes)); }
