/*
 * A fake libnvidia-ml.so.1 for the limiter's tests: the GPUs of FAKE_GPUS (as fake_cuda.c
 * reads them), each with all its memory free, and the entry points nvidia-smi and pynvml
 * use to show memory. Types follow nvml.h.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define EXPORT __attribute__((visibility("default")))

struct device { char uuid[80]; unsigned long long total; };
static struct device devs[8];
static int ndev, initialized;

static void load(void) {
  if (ndev) return;
  const char *spec = getenv("FAKE_GPUS");
  if (!spec || !*spec) spec = "GPU-00000000-0000-0000-0000-000000000001=17179869184";
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", spec);
  for (char *save = NULL, *item = strtok_r(buf, ",", &save); item && ndev < 8; item = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(item, '=');
    if (!eq) continue;
    *eq = 0;
    snprintf(devs[ndev].uuid, sizeof devs[ndev].uuid, "%s", item);
    devs[ndev].total = strtoull(eq + 1, NULL, 10);
    ndev++;
  }
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { load(); initialized = 1; return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
EXPORT nvmlReturn_t nvmlShutdown(void) { initialized = 0; return NVML_SUCCESS; }
EXPORT const char *nvmlErrorString(nvmlReturn_t r) { return r == 0 ? "Success" : "Error"; }

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n) {
  if (!initialized) return NVML_ERROR_UNINITIALIZED;
  *n = (unsigned)ndev;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, void **dev) {
  if (!initialized) return NVML_ERROR_UNINITIALIZED;
  if (i >= (unsigned)ndev) return NVML_ERROR_INVALID_ARGUMENT;
  *dev = &devs[i];
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(void *dev, char *buf, unsigned len) {
  if (!initialized) return NVML_ERROR_UNINITIALIZED;
  struct device *d = dev;
  if (strlen(d->uuid) + 1 > len) return NVML_ERROR_INVALID_ARGUMENT;
  memcpy(buf, d->uuid, strlen(d->uuid) + 1);
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(void *dev, nvmlMemory_t *m) {
  if (!initialized) return NVML_ERROR_UNINITIALIZED;
  struct device *d = dev;
  m->total = d->total;
  m->free = d->total;
  m->used = 0;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *dev, nvmlMemory_v2_t *m) {
  if (!initialized) return NVML_ERROR_UNINITIALIZED;
  if (m->version != ((unsigned)sizeof(nvmlMemory_v2_t) | (2u << 24))) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  struct device *d = dev;
  m->total = d->total;
  m->reserved = 512ULL << 20;
  m->free = d->total - m->reserved;
  m->used = 0;
  return NVML_SUCCESS;
}
