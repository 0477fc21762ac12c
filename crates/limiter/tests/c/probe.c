/*
 * A driver-API program for the limiter's tests (a real cudart cannot run on a fake driver,
 * so this calls the driver API directly). Built twice: linked against libcuda.so.1 and
 * libnvidia-ml.so.1 (-DLINKED, the "linked" route), and loading them with dlopen only.
 *
 *   probe <route> <op>...
 *
 * Routes (how every entry point is obtained):
 *   linked                  the symbols the program is linked with (LINKED build only)
 *   dlsym-default           dlsym(RTLD_DEFAULT, "<versioned name>")
 *   dlsym-next              dlsym(RTLD_NEXT, ...) from the program
 *   interposer-next         dlsym(RTLD_NEXT, ...) from a library between the program and the driver
 *   dlsym-handle            dlsym(dlopen("libcuda.so.1", RTLD_LOCAL), ...)
 *   getproc:<ver>           cuGetProcAddress("<base name>", ver, 0)
 *   getproc2:<ver>          cuGetProcAddress_v2("<base name>", ver, 0)
 *   getproc2-ptsz:<ver>     cuGetProcAddress_v2 with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 *   getproc-chain:<ver>     the cuGetProcAddress that cuGetProcAddress_v2 returns for "cuGetProcAddress"
 *   A dlsym route with "+ptsz" uses the _ptsz names of the stream-ordered entry points.
 *
 * Every op prints one line (see the tests for the ops). Exit status 0 unless the
 * program itself could not run (a missing library, an unknown op: 64).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUhandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type; int requestedHandleTypes; CUmemLocation location; void *win32HandleMetaData;
  unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct {
  int allocType; int handleTypes; CUmemLocation location; void *win32SecurityAttributes;
  size_t maxSize; unsigned short usage; unsigned char reserved[54];
} CUmemPoolProps;
typedef struct { size_t Width; size_t Height; unsigned Format; unsigned NumChannels; } ArrayDesc;
typedef struct { size_t Width; size_t Height; size_t Depth; unsigned Format; unsigned NumChannels; unsigned Flags; } Array3dDesc;
typedef struct { unsigned long long total, free, used; } NvmlMemory;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } NvmlMemoryV2;

typedef CUresult (*gpa_t)(const char *, void **, int, unsigned long long);
typedef CUresult (*gpa2_t)(const char *, void **, int, unsigned long long, int *);

static const char *route;
static int version;
static unsigned long long gpa_flags;
static int ptsz_names;
static void *cuda, *nvml;
static gpa_t gpa;
static gpa2_t gpa2;

#ifdef LINKED
#define DECL(ret, name, args) extern ret name args;
DECL(CUresult, cuInit, (unsigned))
DECL(CUresult, cuDevicePrimaryCtxRetain, (void **, int))
DECL(CUresult, cuCtxSetCurrent, (void *))
DECL(CUresult, cuStreamCreate, (void **, unsigned))
DECL(CUresult, cuStreamBeginCapture_v2, (void *, int))
DECL(CUresult, cuStreamEndCapture, (void *, void **))
DECL(CUresult, cuMemAlloc_v2, (CUdeviceptr *, size_t))
DECL(CUresult, cuMemAllocManaged, (CUdeviceptr *, size_t, unsigned))
DECL(CUresult, cuMemAllocPitch_v2, (CUdeviceptr *, size_t *, size_t, size_t, unsigned))
DECL(CUresult, cuMemFree_v2, (CUdeviceptr))
DECL(CUresult, cuMemAllocAsync, (CUdeviceptr *, size_t, void *))
DECL(CUresult, cuMemAllocFromPoolAsync, (CUdeviceptr *, size_t, void *, void *))
DECL(CUresult, cuMemFreeAsync, (CUdeviceptr, void *))
DECL(CUresult, cuMemPoolCreate, (void **, const CUmemPoolProps *))
DECL(CUresult, cuMemPoolDestroy, (void *))
DECL(CUresult, cuMemCreate, (CUhandle *, size_t, const CUmemAllocationProp *, unsigned long long))
DECL(CUresult, cuMemRelease, (CUhandle))
DECL(CUresult, cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))
DECL(CUresult, cuMemMap, (CUdeviceptr, size_t, size_t, CUhandle, unsigned long long))
DECL(CUresult, cuMemUnmap, (CUdeviceptr, size_t))
DECL(CUresult, cuMemRetainAllocationHandle, (CUhandle *, void *))
DECL(CUresult, cuArrayCreate_v2, (void **, const ArrayDesc *))
DECL(CUresult, cuArray3DCreate_v2, (void **, const Array3dDesc *))
DECL(CUresult, cuArrayDestroy, (void *))
DECL(CUresult, cuMemGetInfo_v2, (size_t *, size_t *))
DECL(CUresult, cuDeviceTotalMem_v2, (size_t *, int))
DECL(CUresult, cuGetProcAddress, (const char *, void **, int, unsigned long long))
DECL(CUresult, cuGetProcAddress_v2, (const char *, void **, int, unsigned long long, int *))
DECL(int, nvmlInit_v2, (void))
DECL(int, nvmlDeviceGetHandleByIndex_v2, (unsigned, void **))
DECL(int, nvmlDeviceGetMemoryInfo, (void *, NvmlMemory *))
DECL(int, nvmlDeviceGetMemoryInfo_v2, (void *, NvmlMemoryV2 *))

static const struct { const char *name; void *fn; } linked_table[] = {
#define L(n) {#n, (void *)n}
  L(cuInit), L(cuDevicePrimaryCtxRetain), L(cuCtxSetCurrent), L(cuStreamCreate),
  L(cuStreamBeginCapture_v2), L(cuStreamEndCapture), L(cuMemAlloc_v2), L(cuMemAllocManaged),
  L(cuMemAllocPitch_v2), L(cuMemFree_v2), L(cuMemAllocAsync), L(cuMemAllocFromPoolAsync),
  L(cuMemFreeAsync), L(cuMemPoolCreate), L(cuMemPoolDestroy), L(cuMemCreate), L(cuMemRelease),
  L(cuMemAddressReserve), L(cuMemMap), L(cuMemUnmap), L(cuMemRetainAllocationHandle),
  L(cuArrayCreate_v2), L(cuArray3DCreate_v2), L(cuArrayDestroy), L(cuMemGetInfo_v2),
  L(cuDeviceTotalMem_v2), L(cuGetProcAddress), L(cuGetProcAddress_v2), L(nvmlInit_v2),
  L(nvmlDeviceGetHandleByIndex_v2), L(nvmlDeviceGetMemoryInfo), L(nvmlDeviceGetMemoryInfo_v2),
};
#endif

/* From libnext.so: dlsym(RTLD_NEXT, name) made from inside another library. */
extern void *next_sym(const char *name);

static void die(const char *what) {
  printf("error %s\n", what);
  fflush(stdout);
  exit(64);
}

static int is_stream_ordered(const char *base) {
  return !strcmp(base, "cuMemAllocAsync") || !strcmp(base, "cuMemAllocFromPoolAsync") ||
         !strcmp(base, "cuMemFreeAsync");
}

/* The exact name a dlsym route asks for. */
static void versioned(const char *base, char *out, size_t n) {
  static const char *v2[] = {"cuMemAlloc", "cuMemFree", "cuMemAllocPitch", "cuMemGetInfo",
                             "cuDeviceTotalMem", "cuArrayCreate", "cuArray3DCreate",
                             "cuStreamBeginCapture", NULL};
  for (int i = 0; v2[i]; i++) {
    if (!strcmp(base, v2[i])) { snprintf(out, n, "%s_v2", base); return; }
  }
  if (ptsz_names && is_stream_ordered(base)) { snprintf(out, n, "%s_ptsz", base); return; }
  snprintf(out, n, "%s", base);
}

static void *resolve(const char *base) {
  char name[128];
  versioned(base, name, sizeof name);
  if (!strncmp(base, "nvml", 4)) {
#ifdef LINKED
    if (!strcmp(route, "linked")) goto linked;
#endif
    return dlsym(nvml, name);
  }
  if (!strncmp(route, "linked", 6)) {
#ifdef LINKED
  linked:
    for (size_t i = 0; i < sizeof linked_table / sizeof linked_table[0]; i++)
      if (!strcmp(linked_table[i].name, name)) return linked_table[i].fn;
#endif
    return NULL;
  }
  if (!strncmp(route, "dlsym-default", 13)) return dlsym(RTLD_DEFAULT, name);
  if (!strncmp(route, "dlsym-next", 10)) return dlsym(RTLD_NEXT, name);
  if (!strncmp(route, "interposer-next", 15)) return next_sym(name);
  if (!strncmp(route, "dlsym-handle", 12)) return dlsym(cuda, name);
  void *fn = NULL;
  int status = -1;
  if (gpa2) {
    if (gpa2(base, &fn, version, gpa_flags, &status) != 0) return NULL;
  } else if (gpa) {
    if (gpa(base, &fn, version, gpa_flags) != 0) return NULL;
  }
  return fn;
}

static void *need(const char *base) {
  void *fn = resolve(base);
  if (!fn) { printf("missing %s\n", base); fflush(stdout); exit(64); }
  return fn;
}

#define CALL(type, base, ...) ((type)need(base))(__VA_ARGS__)
typedef CUresult (*f_init)(unsigned);
typedef CUresult (*f_retain)(void **, int);
typedef CUresult (*f_set)(void *);
typedef CUresult (*f_stream)(void **, unsigned);
typedef CUresult (*f_begin)(void *, int);
typedef CUresult (*f_end)(void *, void **);
typedef CUresult (*f_alloc)(CUdeviceptr *, size_t);
typedef CUresult (*f_managed)(CUdeviceptr *, size_t, unsigned);
typedef CUresult (*f_pitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
typedef CUresult (*f_free)(CUdeviceptr);
typedef CUresult (*f_async)(CUdeviceptr *, size_t, void *);
typedef CUresult (*f_from_pool)(CUdeviceptr *, size_t, void *, void *);
typedef CUresult (*f_free_async)(CUdeviceptr, void *);
typedef CUresult (*f_pool_create)(void **, const CUmemPoolProps *);
typedef CUresult (*f_pool_destroy)(void *);
typedef CUresult (*f_create)(CUhandle *, size_t, const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*f_release)(CUhandle);
typedef CUresult (*f_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*f_map)(CUdeviceptr, size_t, size_t, CUhandle, unsigned long long);
typedef CUresult (*f_unmap)(CUdeviceptr, size_t);
typedef CUresult (*f_retain_handle)(CUhandle *, void *);
typedef CUresult (*f_array)(void **, const ArrayDesc *);
typedef CUresult (*f_array3d)(void **, const Array3dDesc *);
typedef CUresult (*f_array_destroy)(void *);
typedef CUresult (*f_info)(size_t *, size_t *);
typedef CUresult (*f_total)(size_t *, int);
typedef int (*f_nvml_init)(void);
typedef int (*f_nvml_handle)(unsigned, void **);
typedef int (*f_nvml_mem)(void *, NvmlMemory *);
typedef int (*f_nvml_mem2)(void *, NvmlMemoryV2 *);
typedef CUresult (*f_truth)(int, unsigned long long *);

static CUdeviceptr ptrs[256]; static int nptrs;
static CUdeviceptr aptrs[256]; static int naptrs;
static CUhandle handles[64]; static size_t hsizes[64]; static int nhandles;
static CUdeviceptr maps[64]; static size_t msizes[64]; static int nmaps;
static CUhandle retained;
static void *arrays[64]; static int narrays;
static void *pool;
static void *stream;
static int device;

static void setup_route(const char *r) {
  route = r;
  ptsz_names = strstr(r, "+ptsz") != NULL;
  const char *colon = strchr(r, ':');
  version = colon ? atoi(colon + 1) : 12080;
  int local = !strncmp(r, "dlsym-handle", 12) || !strncmp(r, "getproc", 7);
  cuda = dlopen("libcuda.so.1", RTLD_NOW | (local ? RTLD_LOCAL : RTLD_GLOBAL));
  if (!cuda) die("dlopen libcuda.so.1");
  nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!strncmp(r, "getproc2-ptsz:", 14)) {
    gpa_flags = 2;
    gpa2 = (gpa2_t)dlsym(cuda, "cuGetProcAddress_v2");
  } else if (!strncmp(r, "getproc2:", 9)) {
    gpa2 = (gpa2_t)dlsym(cuda, "cuGetProcAddress_v2");
  } else if (!strncmp(r, "getproc:", 8)) {
    gpa = (gpa_t)dlsym(cuda, "cuGetProcAddress");
  } else if (!strncmp(r, "getproc-chain:", 14)) {
    gpa2_t first = (gpa2_t)dlsym(cuda, "cuGetProcAddress_v2");
    void *fn = NULL;
    int st;
    if (!first || first("cuGetProcAddress", &fn, version, 0, &st) != 0) die("cuGetProcAddress of cuGetProcAddress");
    if (version >= 12000) gpa2 = (gpa2_t)fn; else gpa = (gpa_t)fn;
  }
  if (!strncmp(r, "getproc", 7) && !gpa && !gpa2) die("cuGetProcAddress");
}

static void which(const char *base) {
  void *fn = resolve(base);
  Dl_info info;
  if (!fn || !dladdr(fn, &info)) { printf("which %s none\n", base); return; }
  const char *file = info.dli_fname ? strrchr(info.dli_fname, '/') : NULL;
  file = file ? file + 1 : info.dli_fname;
  int exact = info.dli_saddr == fn;
  printf("which %s %s %s\n", base, file ? file : "?", exact && info.dli_sname ? info.dli_sname : "?");
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) die("usage: probe <route> <op>...");
  setup_route(argv[1]);
  for (int i = 2; i < argc; i++) {
    const char *op = argv[i];
    const char *a1 = i + 1 < argc ? argv[i + 1] : "0";
    const char *a2 = i + 2 < argc ? argv[i + 2] : "0";
    const char *a3 = i + 3 < argc ? argv[i + 3] : "0";
    unsigned long long n1 = strtoull(a1, NULL, 0);
    if (!strcmp(op, "ctx")) {
      device = (int)n1; i++;
      void *ctx = NULL;
      CUresult r = CALL(f_init, "cuInit", 0);
      if (!r) r = CALL(f_retain, "cuDevicePrimaryCtxRetain", &ctx, device);
      if (!r) r = CALL(f_set, "cuCtxSetCurrent", ctx);
      printf("ctx %d %d\n", device, r);
    } else if (!strcmp(op, "alloc") || !strcmp(op, "managed")) {
      CUdeviceptr p = 0;
      CUresult r = !strcmp(op, "alloc") ? CALL(f_alloc, "cuMemAlloc", &p, n1)
                                        : CALL(f_managed, "cuMemAllocManaged", &p, n1, 1);
      if (!r) ptrs[nptrs++] = p;
      printf("%s %llu %d\n", op, n1, r); i++;
    } else if (!strcmp(op, "pitch")) {
      CUdeviceptr p = 0; size_t pitch = 0;
      unsigned long long h = strtoull(a2, NULL, 0);
      CUresult r = CALL(f_pitch, "cuMemAllocPitch", &p, &pitch, n1, h, 4);
      if (!r) ptrs[nptrs++] = p;
      printf("pitch %llu %llu %d %zu\n", n1, h, r, pitch); i += 2;
    } else if (!strcmp(op, "free")) {
      CUresult r = nptrs ? CALL(f_free, "cuMemFree", ptrs[--nptrs]) : -1;
      printf("free %d\n", r);
    } else if (!strcmp(op, "stream")) {
      CUresult r = CALL(f_stream, "cuStreamCreate", &stream, 0);
      printf("stream %d\n", r);
    } else if (!strcmp(op, "capture-begin")) {
      printf("capture-begin %d\n", CALL(f_begin, "cuStreamBeginCapture", stream, 0));
    } else if (!strcmp(op, "capture-end")) {
      void *g; printf("capture-end %d\n", CALL(f_end, "cuStreamEndCapture", stream, &g));
    } else if (!strcmp(op, "async")) {
      CUdeviceptr p = 0;
      CUresult r = CALL(f_async, "cuMemAllocAsync", &p, n1, stream);
      if (!r) aptrs[naptrs++] = p;
      printf("async %llu %d\n", n1, r); i++;
    } else if (!strcmp(op, "pool-alloc")) {
      CUdeviceptr p = 0;
      CUresult r = CALL(f_from_pool, "cuMemAllocFromPoolAsync", &p, n1, pool, stream);
      if (!r) aptrs[naptrs++] = p;
      printf("pool-alloc %llu %d\n", n1, r); i++;
    } else if (!strcmp(op, "free-async")) {
      CUresult r = naptrs ? CALL(f_free_async, "cuMemFreeAsync", aptrs[--naptrs], stream) : -1;
      printf("free-async %d\n", r);
    } else if (!strcmp(op, "free-async-sync")) {
      /* A stream-ordered allocation freed with cuMemFree. */
      CUresult r = naptrs ? CALL(f_free, "cuMemFree", aptrs[--naptrs]) : -1;
      printf("free-async-sync %d\n", r);
    } else if (!strcmp(op, "pool-create")) {
      CUmemPoolProps props;
      memset(&props, 0, sizeof props);
      props.allocType = 1;
      props.location.type = !strcmp(a1, "host") ? 3 : 1;
      props.location.id = !strcmp(a1, "host") ? 0 : (int)n1;
      printf("pool-create %d\n", CALL(f_pool_create, "cuMemPoolCreate", &pool, &props)); i++;
    } else if (!strcmp(op, "pool-destroy")) {
      printf("pool-destroy %d\n", CALL(f_pool_destroy, "cuMemPoolDestroy", pool));
    } else if (!strcmp(op, "vmm")) {
      CUmemAllocationProp prop;
      memset(&prop, 0, sizeof prop);
      prop.type = 1;
      int host = !strcmp(a2, "host");
      prop.location.type = host ? 3 : 1; /* HOST_NUMA (NCCL) or DEVICE */
      prop.location.id = host ? 0 : device;
      CUhandle h = 0;
      CUresult r = CALL(f_create, "cuMemCreate", &h, n1, &prop, 0);
      if (!r) { hsizes[nhandles] = n1; handles[nhandles++] = h; }
      printf("vmm %llu %d\n", n1, r); i += host ? 2 : 1;
    } else if (!strcmp(op, "map")) {
      CUdeviceptr va = 0;
      size_t size = hsizes[nhandles - 1];
      CUresult r = CALL(f_reserve, "cuMemAddressReserve", &va, size, 0, 0, 0);
      if (!r) r = CALL(f_map, "cuMemMap", va, size, 0, handles[nhandles - 1], 0);
      if (!r) { msizes[nmaps] = size; maps[nmaps++] = va; }
      printf("map %d\n", r);
    } else if (!strcmp(op, "unmap")) {
      CUresult r = nmaps ? CALL(f_unmap, "cuMemUnmap", maps[nmaps - 1], msizes[nmaps - 1]) : -1;
      if (!r) nmaps--;
      printf("unmap %d\n", r);
    } else if (!strcmp(op, "release")) {
      CUresult r = nhandles ? CALL(f_release, "cuMemRelease", handles[--nhandles]) : -1;
      printf("release %d\n", r);
    } else if (!strcmp(op, "retain")) {
      CUresult r = nmaps ? CALL(f_retain_handle, "cuMemRetainAllocationHandle", &retained, (void *)(uintptr_t)maps[nmaps - 1]) : -1;
      printf("retain %d\n", r);
    } else if (!strcmp(op, "release-retained")) {
      printf("release-retained %d\n", CALL(f_release, "cuMemRelease", retained));
    } else if (!strcmp(op, "array")) {
      ArrayDesc d = {n1, strtoull(a2, NULL, 0), 0x20, 1};
      void *a = NULL;
      CUresult r = CALL(f_array, "cuArrayCreate", &a, &d);
      if (!r) arrays[narrays++] = a;
      printf("array %d\n", r); i += 2;
    } else if (!strcmp(op, "array3d")) {
      Array3dDesc d = {n1, strtoull(a2, NULL, 0), strtoull(a3, NULL, 0), 0x20, 1, 0};
      void *a = NULL;
      CUresult r = CALL(f_array3d, "cuArray3DCreate", &a, &d);
      if (!r) arrays[narrays++] = a;
      printf("array3d %d\n", r); i += 3;
    } else if (!strcmp(op, "array-destroy")) {
      CUresult r = narrays ? CALL(f_array_destroy, "cuArrayDestroy", arrays[--narrays]) : -1;
      printf("array-destroy %d\n", r);
    } else if (!strcmp(op, "info")) {
      size_t f = 0, t = 0;
      CUresult r = CALL(f_info, "cuMemGetInfo", &f, &t);
      printf("info %d %zu %zu\n", r, f, t);
    } else if (!strcmp(op, "total")) {
      size_t t = 0;
      CUresult r = CALL(f_total, "cuDeviceTotalMem", &t, (int)n1);
      printf("total %d %zu\n", r, t); i++;
    } else if (!strcmp(op, "nvml") || !strcmp(op, "nvml2")) {
      if (!nvml) die("dlopen libnvidia-ml.so.1");
      void *dev = NULL;
      int r = CALL(f_nvml_init, "nvmlInit_v2");
      if (!r) r = CALL(f_nvml_handle, "nvmlDeviceGetHandleByIndex_v2", (unsigned)n1, &dev);
      if (!strcmp(op, "nvml")) {
        NvmlMemory m = {0, 0, 0};
        if (!r) r = CALL(f_nvml_mem, "nvmlDeviceGetMemoryInfo", dev, &m);
        printf("nvml %d %llu %llu %llu\n", r, m.total, m.free, m.used);
      } else {
        NvmlMemoryV2 m = {(unsigned)sizeof(NvmlMemoryV2) | (2u << 24), 0, 0, 0, 0};
        if (!r) r = CALL(f_nvml_mem2, "nvmlDeviceGetMemoryInfo_v2", dev, &m);
        printf("nvml2 %d %llu %llu %llu %llu\n", r, m.total, m.free, m.used, m.reserved);
      }
      i++;
    } else if (!strcmp(op, "truth")) {
      f_truth t = (f_truth)dlsym(cuda, "fakeCudaDeviceUsed");
      unsigned long long used = 0;
      if (t) t((int)n1, &used);
      printf("truth %llu\n", used); i++;
    } else if (!strcmp(op, "driver-version")) {
      typedef CUresult (*f_version)(int *);
      int v = 0;
      CUresult r = CALL(f_version, "cuDriverGetVersion", &v);
      printf("driver-version %d %d\n", r, v);
    } else if (!strcmp(op, "which")) {
      which(a1); i++;
    } else if (!strcmp(op, "ready")) {
      printf("ready\n");
    } else if (!strcmp(op, "wait")) {
      printf("waiting\n");
      char line[64];
      printf("%s\n", fgets(line, sizeof line, stdin) ? "resumed" : "eof");
    } else if (!strcmp(op, "fork-child")) {
      /* The ops up to ";" run in a child; the parent waits for it. */
      int end = i + 1;
      while (end < argc && strcmp(argv[end], ";")) end++;
      fflush(stdout);
      pid_t pid = fork();
      if (pid == 0) {
        if (end < argc) argv[end] = (char *)"exit";
        continue;
      }
      int status;
      waitpid(pid, &status, 0);
      printf("child-exited %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
      i = end;
    } else if (!strcmp(op, "exit")) {
      fflush(stdout);
      _exit(0);
    } else if (!strcmp(op, "fork-parent-exits")) {
      /* The parent exits; the child goes on once it is gone (its pipe end closes). */
      int fds[2];
      if (pipe(fds)) die("pipe");
      fflush(stdout);
      pid_t parent = getpid();
      pid_t pid = fork();
      if (pid != 0) {
        printf("parent-exits\n");
        fflush(stdout);
        _exit(0);
      }
      close(fds[1]);
      char c;
      while (read(fds[0], &c, 1) > 0) {}
      /* The pipe closes while the parent's other files may still be closing; it is
         reparented only once it has fully exited (locks released). */
      struct timespec start, t;
      clock_gettime(CLOCK_MONOTONIC, &start);
      while (getppid() == parent) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - start.tv_sec > 10) die("the parent did not exit");
        sched_yield();
      }
      printf("parent-gone\n");
    } else if (!strcmp(op, "exec")) {
      fflush(stdout);
      char *args[256];
      int k = 0;
      args[k++] = argv[0];
      args[k++] = argv[1];
      for (int j = i + 1; j < argc && k < 255; j++) args[k++] = argv[j];
      args[k] = NULL;
      execv("/proc/self/exe", args);
      die("exec");
    } else {
      die(op);
    }
  }
  return 0;
}
