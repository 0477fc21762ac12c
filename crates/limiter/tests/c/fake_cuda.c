/*
 * A fake libcuda.so.1 for the limiter's tests: no GPU, no driver. It models memory per
 * device (allocations, stream-ordered pools with a cache, VMM handles with references and
 * mappings, arrays), hands out a distinct function for every versioned entry point through
 * cuGetProcAddress / cuGetProcAddress_v2 (chosen by cudaVersion and the per-thread flag, as
 * the driver does), and records every call.
 *
 * Environment:
 *   FAKE_GPUS            "GPU-<uuid>=<bytes>,..." (default: one 16 GiB GPU,
 *                        GPU-00000000-0000-0000-0000-000000000001)
 *   FAKE_CUDA_LOG        append "<entry point> <args>" per call to this file
 *   FAKE_CUDA_BLOCK_BYTES cuMemAlloc_v2 of exactly this many bytes prints "fake: blocked"
 *                        on stdout and never returns (a process killed mid-allocation)
 *   FAKE_CUDA_ALLOC_MS   cuMemAlloc_v2 takes this long (a real driver takes milliseconds for
 *                        large allocations): processes racing overlap inside the driver
 *
 * The memory model is per process: what one process allocates is not seen by another
 * (the limiter's ledger is what the container shares). fakeCudaDeviceUsed() reads it.
 * Types follow cuda.h; only what the tests use is here.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUmemoryPool;
typedef void *CUarray;
typedef void *CUgraph;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type; int requestedHandleTypes; CUmemLocation location; void *win32HandleMetaData;
  unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct {
  int allocType; int handleTypes; CUmemLocation location; void *win32SecurityAttributes;
  size_t maxSize; unsigned short usage; unsigned char reserved[54];
} CUmemPoolProps;
typedef struct { size_t Width; size_t Height; unsigned Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct {
  size_t Width; size_t Height; size_t Depth; unsigned Format; unsigned NumChannels; unsigned Flags;
} CUDA_ARRAY3D_DESCRIPTOR;
typedef struct { size_t size; size_t alignment; unsigned reserved[4]; } CUDA_ARRAY_MEMORY_REQUIREMENTS;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500
#define PER_THREAD 2ULL
#define LOC_DEVICE 1
#define MiB (1ULL << 20)

#define EXPORT __attribute__((visibility("default")))

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int ndev;
static struct { CUuuid uuid; char text[64]; unsigned long long total, used; } devs[8];
static __thread int current = -1;
static unsigned long long next_addr = 0x7f0000000000ULL;

enum kind { PLAIN, POOL, GRAPH };
static struct alloc { CUdeviceptr ptr; unsigned long long size; int dev; int kind; void *pool; } allocs[4096];

struct pool { int dev; int device_location; unsigned long long reserved, used; int live; };
static struct pool pools[64];
static struct pool default_pools[8];
static struct pool *current_pool[8];

struct stream { int dev; int capturing; };
static struct stream streams[64];
static int nstreams;

static struct handle { unsigned long long size; int dev; int on_device; int refs, maps; int live; } handles[1024];
static struct mapping { CUdeviceptr va; unsigned long long size; int handle; } mappings[1024];
static struct array { void *id; unsigned long long size; int dev; } arrays[256];
static int next_array = 1;

static void say(const char *fmt, ...) {
  const char *path = getenv("FAKE_CUDA_LOG");
  if (!path || !*path) return;
  char line[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > (int)sizeof line - 2) n = sizeof line - 2;
  line[n++] = '\n';
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) { (void)!write(fd, line, n); close(fd); }
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static void add_gpu(const char *uuid, unsigned long long bytes) {
  if (ndev >= 8) return;
  snprintf(devs[ndev].text, sizeof devs[ndev].text, "%s", uuid);
  int k = 0;
  for (const char *p = uuid + 4; *p && k < 32; p++) {
    int v = hexval(*p);
    if (v < 0) continue;
    if (k % 2 == 0) devs[ndev].uuid.bytes[k / 2] = (unsigned char)(v << 4);
    else devs[ndev].uuid.bytes[k / 2] |= (unsigned char)v;
    k++;
  }
  devs[ndev].total = bytes;
  default_pools[ndev].dev = ndev;
  default_pools[ndev].device_location = 1;
  default_pools[ndev].live = 1;
  current_pool[ndev] = &default_pools[ndev];
  ndev++;
}

static void load_gpus(void) {
  if (ndev) return;
  const char *spec = getenv("FAKE_GPUS");
  if (!spec || !*spec) {
    add_gpu("GPU-00000000-0000-0000-0000-000000000001", 16ULL << 30);
    return;
  }
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", spec);
  for (char *save = NULL, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(item, '=');
    if (!eq) continue;
    *eq = 0;
    add_gpu(item, strtoull(eq + 1, NULL, 10));
  }
}

/* ---- basics ---- */

EXPORT CUresult cuInit(unsigned flags) {
  (void)flags;
  pthread_mutex_lock(&mu);
  load_gpus();
  initialized = 1;
  pthread_mutex_unlock(&mu);
  say("cuInit");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *v) {
  const char *e = getenv("FAKE_CUDA_VERSION");
  *v = e ? atoi(e) : 12080;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *n) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  *n = ndev;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (ordinal < 0 || ordinal >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}

static CUresult get_uuid(CUuuid *u, CUdevice d) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  *u = devs[d].uuid;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { say("cuDeviceGetUuid %d", d); return get_uuid(u, d); }
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { say("cuDeviceGetUuid_v2 %d", d); return get_uuid(u, d); }

EXPORT CUresult cuDeviceTotalMem(unsigned *bytes, CUdevice d) {
  say("cuDeviceTotalMem %d", d);
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = (unsigned)(devs[d].total > 0xffffffffULL ? 0xffffffffULL : devs[d].total);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
  say("cuDeviceTotalMem_v2 %d", d);
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = devs[d].total;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  *ctx = (CUcontext)(uintptr_t)(d + 1);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
  current = (int)(uintptr_t)ctx - 1;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) {
  *ctx = current < 0 ? NULL : (CUcontext)(uintptr_t)(current + 1);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
  *d = current;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice d) {
  (void)flags;
  say("cuCtxCreate_v2 %d", d);
  CUresult r = cuDevicePrimaryCtxRetain(ctx, d);
  if (r == CUDA_SUCCESS) current = d;
  return r;
}
EXPORT CUresult cuCtxCreate_v3(CUcontext *ctx, void *params, int n, unsigned flags, CUdevice d) {
  (void)params; (void)n;
  say("cuCtxCreate_v3 %d", d);
  return cuCtxCreate_v2(ctx, flags, d);
}
EXPORT CUresult cuCtxCreate_v4(CUcontext *ctx, void *params, unsigned flags, CUdevice d) {
  (void)params;
  say("cuCtxCreate_v4 %d", d);
  return cuCtxCreate_v2(ctx, flags, d);
}

/* ---- plain allocations ---- */

static struct alloc *slot_for(CUdeviceptr p) {
  for (int i = 0; i < 4096; i++)
    if (allocs[i].ptr == p && allocs[i].size) return &allocs[i];
  return NULL;
}

/* Caller holds mu. */
static CUresult take(CUdeviceptr *out, unsigned long long size, int dev, int kind, void *pool, int counts) {
  if (dev < 0 || dev >= ndev) return CUDA_ERROR_INVALID_CONTEXT;
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (counts && devs[dev].used + size > devs[dev].total) return CUDA_ERROR_OUT_OF_MEMORY;
  for (int i = 0; i < 4096; i++) {
    if (allocs[i].size == 0) {
      allocs[i] = (struct alloc){next_addr, size, dev, kind, pool};
      *out = next_addr;
      next_addr += (size + 2 * MiB - 1) / (2 * MiB) * (2 * MiB) + 2 * MiB;
      if (counts) devs[dev].used += size;
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_OUT_OF_MEMORY;
}

static void maybe_slow(void) {
  const char *ms = getenv("FAKE_CUDA_ALLOC_MS");
  if (ms && *ms) {
    struct timespec t = {0, atol(ms) * 1000000L};
    nanosleep(&t, NULL);
  }
}

static void maybe_block(size_t bytes) {
  const char *b = getenv("FAKE_CUDA_BLOCK_BYTES");
  if (b && strtoull(b, NULL, 10) == bytes) {
    printf("fake: blocked\n");
    fflush(stdout);
    for (;;) pause();
  }
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
  say("cuMemAlloc_v2 %zu", bytes);
  maybe_block(bytes);
  maybe_slow();
  pthread_mutex_lock(&mu);
  CUresult r = current < 0 ? CUDA_ERROR_INVALID_CONTEXT : take(p, bytes, current, PLAIN, NULL, 1);
  pthread_mutex_unlock(&mu);
  return r;
}

/* The 32-bit API of CUDA < 3.2. */
EXPORT CUresult cuMemAlloc(unsigned *p, unsigned bytes) {
  say("cuMemAlloc %u", bytes);
  CUdeviceptr wide = 0;
  pthread_mutex_lock(&mu);
  CUresult r = current < 0 ? CUDA_ERROR_INVALID_CONTEXT : take(&wide, bytes, current, PLAIN, NULL, 1);
  pthread_mutex_unlock(&mu);
  *p = (unsigned)wide;
  return r;
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t bytes, unsigned flags) {
  say("cuMemAllocManaged %zu %u", bytes, flags);
  pthread_mutex_lock(&mu);
  CUresult r = current < 0 ? CUDA_ERROR_INVALID_CONTEXT : take(p, bytes, current, PLAIN, NULL, 1);
  pthread_mutex_unlock(&mu);
  return r;
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height, unsigned elem) {
  say("cuMemAllocPitch_v2 %zu %zu %u", width, height, elem);
  size_t row = (width + 511) / 512 * 512;
  pthread_mutex_lock(&mu);
  CUresult r = current < 0 ? CUDA_ERROR_INVALID_CONTEXT : take(p, (unsigned long long)row * height, current, PLAIN, NULL, 1);
  pthread_mutex_unlock(&mu);
  if (r == CUDA_SUCCESS) *pitch = row;
  return r;
}

static CUresult release_plain(CUdeviceptr p) {
  struct alloc *a = slot_for(p);
  if (!a) return CUDA_ERROR_INVALID_VALUE;
  if (a->kind == PLAIN) devs[a->dev].used -= a->size;
  else if (a->kind == POOL) ((struct pool *)a->pool)->used -= a->size;
  a->size = 0;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  say("cuMemFree_v2");
  pthread_mutex_lock(&mu);
  CUresult r = release_plain(p);
  pthread_mutex_unlock(&mu);
  return r;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
  say("cuMemGetInfo_v2");
  if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  *total = devs[current].total;
  *free_ = devs[current].total - devs[current].used;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetInfo(unsigned *free_, unsigned *total) {
  say("cuMemGetInfo");
  size_t f, t;
  CUresult r = cuMemGetInfo_v2(&f, &t);
  *free_ = (unsigned)(f > 0xffffffffULL ? 0xffffffffULL : f);
  *total = (unsigned)(t > 0xffffffffULL ? 0xffffffffULL : t);
  return r;
}

/* Not a CUDA entry point: the fake's own truth, for the tests. */
EXPORT CUresult fakeCudaDeviceUsed(CUdevice d, unsigned long long *used) {
  if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&mu);
  *used = devs[d].used;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

/* ---- streams and capture ---- */

static struct stream *stream_of(CUstream s) {
  uintptr_t i = (uintptr_t)s;
  if (i >= 0x100 && i < 0x100 + 64) return &streams[i - 0x100];
  return NULL;
}

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags) {
  (void)flags;
  if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  int i = nstreams++;
  streams[i].dev = current;
  pthread_mutex_unlock(&mu);
  *s = (CUstream)(uintptr_t)(0x100 + i);
  return CUDA_SUCCESS;
}

static CUresult stream_device(CUstream s, CUdevice *d) {
  struct stream *st = stream_of(s);
  if (st) { *d = st->dev; return CUDA_SUCCESS; }
  if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
  *d = current;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamGetDevice(CUstream s, CUdevice *d) { say("cuStreamGetDevice"); return stream_device(s, d); }
EXPORT CUresult cuStreamGetDevice_ptsz(CUstream s, CUdevice *d) { say("cuStreamGetDevice_ptsz"); return stream_device(s, d); }

static CUresult is_capturing(CUstream s, int *status) {
  struct stream *st = stream_of(s);
  *status = st && st->capturing ? 1 : 0;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamIsCapturing(CUstream s, int *status) { say("cuStreamIsCapturing"); return is_capturing(s, status); }
EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream s, int *status) { say("cuStreamIsCapturing_ptsz"); return is_capturing(s, status); }

EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
  (void)mode;
  struct stream *st = stream_of(s);
  if (!st) return CUDA_ERROR_INVALID_HANDLE;
  st->capturing = 1;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g) {
  struct stream *st = stream_of(s);
  if (!st) return CUDA_ERROR_INVALID_HANDLE;
  st->capturing = 0;
  *g = (CUgraph)0x1;
  return CUDA_SUCCESS;
}

/* ---- pools ---- */

EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *p, CUdevice d) {
  if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  *p = &default_pools[d];
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *p, CUdevice d) {
  say("cuDeviceGetMemPool %d", d);
  if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  *p = current_pool[d];
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool p) {
  if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
  current_pool[d] = p;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *p, const CUmemPoolProps *props) {
  say("cuMemPoolCreate %d %d", props->location.type, props->location.id);
  pthread_mutex_lock(&mu);
  for (int i = 0; i < 64; i++) {
    if (!pools[i].live) {
      pools[i] = (struct pool){props->location.id, props->location.type == LOC_DEVICE, 0, 0, 1};
      *p = &pools[i];
      pthread_mutex_unlock(&mu);
      return CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemPoolDestroy(CUmemoryPool p) {
  say("cuMemPoolDestroy");
  struct pool *pl = p;
  pthread_mutex_lock(&mu);
  if (pl->device_location) devs[pl->dev].used -= pl->reserved;
  pl->live = 0;
  pl->reserved = pl->used = 0;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool p, int attr, void *value) {
  struct pool *pl = p;
  if (attr == 5) { *(unsigned long long *)value = pl->reserved; return CUDA_SUCCESS; }
  if (attr == 7) { *(unsigned long long *)value = pl->used; return CUDA_SUCCESS; }
  return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool p, size_t keep) {
  say("cuMemPoolTrimTo %zu", keep);
  struct pool *pl = p;
  pthread_mutex_lock(&mu);
  unsigned long long floor = keep > pl->used ? keep : pl->used;
  if (pl->reserved > floor) {
    if (pl->device_location) devs[pl->dev].used -= pl->reserved - floor;
    pl->reserved = floor;
  }
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

static CUresult pool_take(CUdeviceptr *out, size_t bytes, struct pool *pl, CUstream s) {
  struct stream *st = stream_of(s);
  pthread_mutex_lock(&mu);
  CUresult r;
  if (st && st->capturing) {
    /* A graph memory node: an address, no memory until launch. */
    r = take(out, bytes, pl->dev, GRAPH, pl, 0);
  } else {
    unsigned long long cached = pl->reserved - pl->used;
    unsigned long long grow = bytes > cached ? bytes - cached : 0;
    if (pl->device_location && devs[pl->dev].used + grow > devs[pl->dev].total) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      r = take(out, bytes, pl->dev, POOL, pl, 0);
      if (r == CUDA_SUCCESS) {
        if (pl->device_location) devs[pl->dev].used += grow;
        pl->reserved += grow;
        pl->used += bytes;
      }
    }
  }
  pthread_mutex_unlock(&mu);
  return r;
}

static CUresult alloc_async(CUdeviceptr *p, size_t bytes, CUstream s) {
  CUdevice d;
  CUresult r = stream_device(s, &d);
  if (r) return r;
  return pool_take(p, bytes, current_pool[d], s);
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, CUstream s) { say("cuMemAllocAsync %zu", bytes); return alloc_async(p, bytes, s); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t bytes, CUstream s) { say("cuMemAllocAsync_ptsz %zu", bytes); return alloc_async(p, bytes, s); }
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t bytes, CUmemoryPool pl, CUstream s) { say("cuMemAllocFromPoolAsync %zu", bytes); return pool_take(p, bytes, pl, s); }
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t bytes, CUmemoryPool pl, CUstream s) { say("cuMemAllocFromPoolAsync_ptsz %zu", bytes); return pool_take(p, bytes, pl, s); }

static CUresult free_async(CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  CUresult r = release_plain(p);
  pthread_mutex_unlock(&mu);
  return r;
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; say("cuMemFreeAsync"); return free_async(p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { (void)s; say("cuMemFreeAsync_ptsz"); return free_async(p); }

/* ---- VMM ---- */

EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
  (void)prop; (void)option;
  *g = 2 * MiB;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
  (void)flags;
  say("cuMemCreate %zu %d %d", size, prop->location.type, prop->location.id);
  int on_device = prop->location.type == LOC_DEVICE;
  int dev = prop->location.id;
  if (on_device && (dev < 0 || dev >= ndev)) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&mu);
  if (on_device && devs[dev].used + size > devs[dev].total) {
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  for (int i = 0; i < 1024; i++) {
    if (!handles[i].live) {
      handles[i] = (struct handle){size, dev, on_device, 1, 0, 1};
      if (on_device) devs[dev].used += size;
      *h = (CUmemGenericAllocationHandle)(0x5000 + i);
      pthread_mutex_unlock(&mu);
      return CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

static struct handle *handle_of(CUmemGenericAllocationHandle h) {
  if (h < 0x5000 || h >= 0x5000 + 1024) return NULL;
  struct handle *x = &handles[h - 0x5000];
  return x->live ? x : NULL;
}

static void settle(struct handle *x) {
  if (x->refs == 0 && x->maps == 0) {
    if (x->on_device) devs[x->dev].used -= x->size;
    x->live = 0;
  }
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  say("cuMemRelease");
  pthread_mutex_lock(&mu);
  struct handle *x = handle_of(h);
  if (!x || x->refs == 0) { pthread_mutex_unlock(&mu); return CUDA_ERROR_INVALID_HANDLE; }
  x->refs--;
  settle(x);
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
  (void)align; (void)addr; (void)flags;
  pthread_mutex_lock(&mu);
  *p = next_addr;
  next_addr += (size + 2 * MiB - 1) / (2 * MiB) * (2 * MiB) + 2 * MiB;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { (void)p; (void)size; return CUDA_SUCCESS; }

EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  (void)offset; (void)flags;
  say("cuMemMap %zu", size);
  pthread_mutex_lock(&mu);
  struct handle *x = handle_of(h);
  if (!x) { pthread_mutex_unlock(&mu); return CUDA_ERROR_INVALID_HANDLE; }
  for (int i = 0; i < 1024; i++) {
    if (mappings[i].size == 0) {
      mappings[i] = (struct mapping){va, size, (int)(h - 0x5000)};
      x->maps++;
      pthread_mutex_unlock(&mu);
      return CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  say("cuMemUnmap %zu", size);
  pthread_mutex_lock(&mu);
  int found = 0;
  for (int i = 0; i < 1024; i++) {
    if (mappings[i].size && mappings[i].va >= va && mappings[i].va < va + size) {
      struct handle *x = &handles[mappings[i].handle];
      x->maps--;
      settle(x);
      mappings[i].size = 0;
      found = 1;
    }
  }
  pthread_mutex_unlock(&mu);
  return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const void *desc, size_t count) {
  (void)va; (void)size; (void)desc; (void)count;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
  say("cuMemRetainAllocationHandle");
  CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < 1024; i++) {
    if (mappings[i].size && a >= mappings[i].va && a < mappings[i].va + mappings[i].size) {
      handles[mappings[i].handle].refs++;
      *h = (CUmemGenericAllocationHandle)(0x5000 + mappings[i].handle);
      pthread_mutex_unlock(&mu);
      return CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_INVALID_VALUE;
}

/* ---- arrays ---- */

static unsigned long long format_bytes(unsigned f) {
  switch (f) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    default: return 4;
  }
}

/* The driver's size: the elements, rounded up to 64 KiB. */
static CUresult array_take(CUarray *a, unsigned long long elements) {
  if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
  unsigned long long size = (elements + 65535) / 65536 * 65536;
  pthread_mutex_lock(&mu);
  if (devs[current].used + size > devs[current].total) { pthread_mutex_unlock(&mu); return CUDA_ERROR_OUT_OF_MEMORY; }
  for (int i = 0; i < 256; i++) {
    if (!arrays[i].id) {
      arrays[i] = (struct array){(void *)(uintptr_t)(0xa000 + next_array++), size, current};
      devs[current].used += size;
      *a = arrays[i].id;
      pthread_mutex_unlock(&mu);
      return CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

static unsigned long long dim(size_t d) { return d ? d : 1; }

EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d) {
  say("cuArrayCreate_v2 %zu %zu", d->Width, d->Height);
  return array_take(a, dim(d->Width) * dim(d->Height) * d->NumChannels * format_bytes(d->Format));
}

EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d) {
  say("cuArray3DCreate_v2 %zu %zu %zu", d->Width, d->Height, d->Depth);
  return array_take(a, dim(d->Width) * dim(d->Height) * dim(d->Depth) * d->NumChannels * format_bytes(d->Format));
}

EXPORT CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *req, CUarray a, CUdevice d) {
  (void)d;
  for (int i = 0; i < 256; i++) {
    if (arrays[i].id == a) {
      req->size = arrays[i].size;
      req->alignment = 65536;
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuArrayDestroy(CUarray a) {
  say("cuArrayDestroy");
  pthread_mutex_lock(&mu);
  for (int i = 0; i < 256; i++) {
    if (arrays[i].id == a) {
      devs[arrays[i].dev].used -= arrays[i].size;
      arrays[i].id = NULL;
      pthread_mutex_unlock(&mu);
      return CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_INVALID_HANDLE;
}

/* ---- cuGetProcAddress ---- */

struct variant { const char *name; int since; int per_thread; void *fn; };

#define V(name, since, pt, fn) {name, since, pt, (void *)fn}
EXPORT CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

static const struct variant variants[] = {
  V("cuInit", 2000, 0, cuInit),
  V("cuDriverGetVersion", 2020, 0, cuDriverGetVersion),
  V("cuDeviceGet", 2000, 0, cuDeviceGet),
  V("cuDeviceGetCount", 2000, 0, cuDeviceGetCount),
  V("cuDeviceGetUuid", 9020, 0, cuDeviceGetUuid),
  V("cuDeviceGetUuid", 11040, 0, cuDeviceGetUuid_v2),
  V("cuDeviceTotalMem", 2000, 0, cuDeviceTotalMem),
  V("cuDeviceTotalMem", 3020, 0, cuDeviceTotalMem_v2),
  V("cuDevicePrimaryCtxRetain", 7000, 0, cuDevicePrimaryCtxRetain),
  V("cuCtxSetCurrent", 4000, 0, cuCtxSetCurrent),
  V("cuCtxGetCurrent", 4000, 0, cuCtxGetCurrent),
  V("cuCtxGetDevice", 2000, 0, cuCtxGetDevice),
  V("cuCtxCreate", 3020, 0, cuCtxCreate_v2),
  V("cuCtxCreate", 11040, 0, cuCtxCreate_v3),
  V("cuCtxCreate", 12050, 0, cuCtxCreate_v4),
  V("cuMemAlloc", 2000, 0, cuMemAlloc),
  V("cuMemAlloc", 3020, 0, cuMemAlloc_v2),
  V("cuMemAllocPitch", 3020, 0, cuMemAllocPitch_v2),
  V("cuMemAllocManaged", 6000, 0, cuMemAllocManaged),
  V("cuMemFree", 3020, 0, cuMemFree_v2),
  V("cuMemGetInfo", 2000, 0, cuMemGetInfo),
  V("cuMemGetInfo", 3020, 0, cuMemGetInfo_v2),
  V("cuStreamCreate", 2000, 0, cuStreamCreate),
  V("cuStreamGetDevice", 12080, 0, cuStreamGetDevice),
  V("cuStreamGetDevice", 12080, 1, cuStreamGetDevice_ptsz),
  V("cuStreamIsCapturing", 10000, 0, cuStreamIsCapturing),
  V("cuStreamIsCapturing", 10000, 1, cuStreamIsCapturing_ptsz),
  V("cuStreamBeginCapture", 10010, 0, cuStreamBeginCapture_v2),
  V("cuStreamEndCapture", 10000, 0, cuStreamEndCapture),
  V("cuDeviceGetDefaultMemPool", 11020, 0, cuDeviceGetDefaultMemPool),
  V("cuDeviceGetMemPool", 11020, 0, cuDeviceGetMemPool),
  V("cuDeviceSetMemPool", 11020, 0, cuDeviceSetMemPool),
  V("cuMemPoolCreate", 11020, 0, cuMemPoolCreate),
  V("cuMemPoolDestroy", 11020, 0, cuMemPoolDestroy),
  V("cuMemPoolGetAttribute", 11020, 0, cuMemPoolGetAttribute),
  V("cuMemPoolTrimTo", 11020, 0, cuMemPoolTrimTo),
  V("cuMemAllocAsync", 11020, 0, cuMemAllocAsync),
  V("cuMemAllocAsync", 11020, 1, cuMemAllocAsync_ptsz),
  V("cuMemAllocFromPoolAsync", 11020, 0, cuMemAllocFromPoolAsync),
  V("cuMemAllocFromPoolAsync", 11020, 1, cuMemAllocFromPoolAsync_ptsz),
  V("cuMemFreeAsync", 11020, 0, cuMemFreeAsync),
  V("cuMemFreeAsync", 11020, 1, cuMemFreeAsync_ptsz),
  V("cuMemGetAllocationGranularity", 10020, 0, cuMemGetAllocationGranularity),
  V("cuMemCreate", 10020, 0, cuMemCreate),
  V("cuMemRelease", 10020, 0, cuMemRelease),
  V("cuMemAddressReserve", 10020, 0, cuMemAddressReserve),
  V("cuMemAddressFree", 10020, 0, cuMemAddressFree),
  V("cuMemMap", 10020, 0, cuMemMap),
  V("cuMemUnmap", 10020, 0, cuMemUnmap),
  V("cuMemSetAccess", 10020, 0, cuMemSetAccess),
  V("cuMemRetainAllocationHandle", 11000, 0, cuMemRetainAllocationHandle),
  V("cuArrayCreate", 3020, 0, cuArrayCreate_v2),
  V("cuArray3DCreate", 3020, 0, cuArray3DCreate_v2),
  V("cuArrayDestroy", 2000, 0, cuArrayDestroy),
  V("cuArrayGetMemoryRequirements", 11060, 0, cuArrayGetMemoryRequirements),
  V("cuGetProcAddress", 11030, 0, cuGetProcAddress),
  V("cuGetProcAddress", 12000, 0, cuGetProcAddress_v2),
};

/* 0 found; 1 no such symbol; 2 the version asked for is too old. */
static int lookup(const char *name, int version, unsigned long long flags, void **fn) {
  const struct variant *best = NULL;
  int known = 0;
  int want_pt = (flags & PER_THREAD) != 0;
  for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
    const struct variant *v = &variants[i];
    if (strcmp(v->name, name) != 0) continue;
    known = 1;
    if (v->since > version) continue;
    if (v->per_thread && !want_pt) continue;
    if (!best || v->since > best->since || (v->since == best->since && v->per_thread)) best = v;
  }
  *fn = best ? best->fn : NULL;
  return best ? 0 : known ? 2 : 1;
}

EXPORT CUresult cuGetProcAddress(const char *name, void **fn, int version, unsigned long long flags) {
  say("cuGetProcAddress %s %d %llu", name, version, flags);
  return lookup(name, version, flags, fn) == 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress_v2(const char *name, void **fn, int version, unsigned long long flags, int *status) {
  say("cuGetProcAddress_v2 %s %d %llu", name, version, flags);
  int s = lookup(name, version, flags, fn);
  if (status) *status = s;
  return s == 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
