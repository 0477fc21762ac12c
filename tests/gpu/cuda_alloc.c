/*
 * A GPU container's workload for tests/gpu/enforcement.sh: the CUDA driver API through
 * libcuda.so.1 (no toolkit needed), on the first GPU CUDA_VISIBLE_DEVICES leaves.
 *
 *   cuda_alloc <MiB>...
 *
 * Prints `total=<MiB> free=<MiB>` (cuMemGetInfo: inside a limited cgroup the limit is the
 * total), then allocates each amount and keeps it, printing `alloc <MiB> ok` or
 * `alloc <MiB> out-of-memory`. Exit 0: all allocated; 2: one ran out of memory; 1: anything else.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*init_fn)(unsigned);
typedef int (*get_fn)(int *, int);
typedef int (*ctx_fn)(void **, unsigned, int);
typedef int (*info_fn)(size_t *, size_t *);
typedef int (*alloc_fn)(unsigned long long *, size_t);

#define CUDA_ERROR_OUT_OF_MEMORY 2

int main(int argc, char **argv) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) {
    fprintf(stderr, "cannot load libcuda.so.1: %s\n", dlerror());
    return 1;
  }
  init_fn cu_init = (init_fn)dlsym(cuda, "cuInit");
  get_fn cu_device_get = (get_fn)dlsym(cuda, "cuDeviceGet");
  ctx_fn cu_ctx_create = (ctx_fn)dlsym(cuda, "cuCtxCreate_v2");
  info_fn cu_mem_get_info = (info_fn)dlsym(cuda, "cuMemGetInfo_v2");
  alloc_fn cu_mem_alloc = (alloc_fn)dlsym(cuda, "cuMemAlloc_v2");
  if (!cu_init || !cu_device_get || !cu_ctx_create || !cu_mem_get_info || !cu_mem_alloc) {
    fprintf(stderr, "libcuda.so.1 lacks a driver API entry point\n");
    return 1;
  }
  int dev = 0, r;
  void *ctx = NULL;
  if ((r = cu_init(0)) || (r = cu_device_get(&dev, 0)) || (r = cu_ctx_create(&ctx, 0, dev))) {
    fprintf(stderr, "CUDA error %d before any allocation\n", r);
    return 1;
  }
  size_t free_b = 0, total_b = 0;
  if ((r = cu_mem_get_info(&free_b, &total_b))) {
    fprintf(stderr, "cuMemGetInfo: CUDA error %d\n", r);
    return 1;
  }
  printf("total=%zu free=%zu\n", total_b >> 20, free_b >> 20);
  fflush(stdout);
  for (int i = 1; i < argc; i++) {
    unsigned long long mib = strtoull(argv[i], NULL, 10), ptr = 0;
    r = cu_mem_alloc(&ptr, (size_t)(mib << 20));
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      printf("alloc %llu out-of-memory\n", mib);
      return 2;
    }
    if (r) {
      fprintf(stderr, "cuMemAlloc(%llu MiB): CUDA error %d\n", mib, r);
      return 1;
    }
    printf("alloc %llu ok\n", mib);
    fflush(stdout);
  }
  return 0;
}
