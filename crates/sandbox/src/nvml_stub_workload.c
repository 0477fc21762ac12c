/*
 * A GPU container's workload over the stub libnvidia-ml.so.1 (gpushare_sandbox::nvml_stub) —
 * tests only, never for production.
 *
 *   nvml_stub_workload <library> <gpu-uuid> [<bytes>...]
 *
 * Loads <library>, prints what this process sees of GPU <gpu-uuid> through
 * nvmlDeviceGetMemoryInfo_v2 (inside a limited cgroup: the hard limit as the total, as
 * nvidia-smi in a limited container shows) as `memory total=<b> used=<b> free=<b>`, then
 * allocates each amount with the stub's nvmlStubAllocate (a CUDA allocation's stand-in),
 * printing `alloc <b> ok` or `alloc <b> out-of-memory`. The process's cgroup is the stub's:
 * $NVML_STUB_CGROUP, else /proc/self/cgroup.
 *
 * Exit status: 0 every allocation succeeded, 2 one ran out of memory (it stops there), 1 a
 * usage or NVML error.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*init_fn)(void);
typedef int (*by_uuid_fn)(const char *, void **);
typedef struct {
  unsigned int version;
  unsigned long long total, reserved, free, used;
} memory_v2;
typedef int (*info_fn)(void *, memory_v2 *);
typedef int (*alloc_fn)(void *, unsigned long long);

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s <library> <gpu-uuid> [<bytes>...]\n", argv[0]);
    return 1;
  }
  void *lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
    return 1;
  }
  init_fn init = (init_fn)dlsym(lib, "nvmlInit_v2");
  by_uuid_fn by_uuid = (by_uuid_fn)dlsym(lib, "nvmlDeviceGetHandleByUUID");
  info_fn info = (info_fn)dlsym(lib, "nvmlDeviceGetMemoryInfo_v2");
  alloc_fn alloc = (alloc_fn)dlsym(lib, "nvmlStubAllocate");
  if (!init || !by_uuid || !info || !alloc) {
    fprintf(stderr, "%s is not the NVML stub\n", argv[1]);
    return 1;
  }
  void *dev = NULL;
  int ret = init();
  if (ret == 0) ret = by_uuid(argv[2], &dev);
  memory_v2 m = {2, 0, 0, 0, 0};
  if (ret == 0) ret = info(dev, &m);
  if (ret != 0) {
    fprintf(stderr, "NVML error %d\n", ret);
    return 1;
  }
  printf("memory total=%llu used=%llu free=%llu\n", m.total, m.used, m.free);
  for (int i = 3; i < argc; i++) {
    unsigned long long bytes = strtoull(argv[i], NULL, 10);
    if (alloc(dev, bytes) != 0) {
      printf("alloc %llu out-of-memory\n", bytes);
      return 2;
    }
    printf("alloc %llu ok\n", bytes);
  }
  return 0;
}
