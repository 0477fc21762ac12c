/*
 * A stub libnvidia-ml.so.1 for tests (gpushare_sandbox::nvml_stub) — never for production.
 *
 * Implements the NVML entry points gpushare's nvml backend reaches through nvml-wrapper:
 * init/shutdown, error strings, driver/NVML/CUDA versions, device count and handles, name,
 * UUID, memory, minor number, PCI info, index, MIG mode, and event sets for XID critical errors.
 *
 * Configuration is read at the first nvmlInit from the file named by $NVML_STUB_CONFIG, else
 * from nvml_stub.conf in the directory holding this library. Lines:
 *   driver <version>                                   (default 550.54.15)
 *   nvml <version>                                     (default 12.550.54.15)
 *   cuda <int>                                         (default 12040)
 *   gpu <uuid> <memory_mib> <minor|-> <pci_bus_id> <name, may contain spaces>
 *   noevents <gpu_index>                               (that GPU supports no events)
 *   mig <gpu_index>                                    (MIG mode enabled on that GPU; after its gpu line)
 *   events <path>                                      (default: nvml_stub.events beside the config)
 * A missing config file makes nvmlInit fail with NVML_ERROR_DRIVER_NOT_LOADED, as NVML does
 * on a machine without the driver.
 *
 * XID events: nvmlEventSetWait_v2 re-reads the events file; each line `xid <gpu_index> <xid>`
 * is delivered once to every event set that existed when the line was appended and that has
 * the GPU registered (tracked by line number; lines present when a set is created are old).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_NOT_FOUND = 6,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_TIMEOUT = 10,
  NVML_ERROR_UNKNOWN = 999,
};

#define EVENT_TYPE_XID_CRITICAL 0x8ULL
#define MAX_GPUS 64
#define MAX_SETS 64
#define PATH_LEN 4096

struct nvmlDevice_st {
  unsigned index;
  char uuid[96];
  char name[96];
  unsigned long long memory_mib;
  int has_minor;
  unsigned minor;
  char pci_bus_id[32];
  int events_supported;
  int mig_enabled;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
  char busIdLegacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[32];
} nvmlPciInfo_t;

typedef struct {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_t;

typedef struct {
  unsigned int version;
  unsigned long long total;
  unsigned long long reserved;
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
  nvmlDevice_t device;
  unsigned long long eventType;
  unsigned long long eventData;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} nvmlEventData_t;

struct nvmlEventSet_st {
  int in_use;
  long delivered_lines;
  int registered[MAX_GPUS];
};
typedef struct nvmlEventSet_st *nvmlEventSet_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count = 0;
static char driver_version[80] = "550.54.15";
static char nvml_version[80] = "12.550.54.15";
static int cuda_version = 12040;
static struct nvmlDevice_st gpus[MAX_GPUS];
static unsigned gpu_count = 0;
static char events_path[PATH_LEN] = "";
static struct nvmlEventSet_st sets[MAX_SETS];

static void config_path(char *out, size_t len) {
  const char *env = getenv("NVML_STUB_CONFIG");
  if (env && *env) {
    snprintf(out, len, "%s", env);
    return;
  }
  Dl_info info;
  out[0] = 0;
  if (dladdr((void *)&config_path, &info) && info.dli_fname) {
    char dir[PATH_LEN];
    snprintf(dir, sizeof dir, "%s", info.dli_fname);
    char *slash = strrchr(dir, '/');
    if (slash) {
      *slash = 0;
      snprintf(out, len, "%s/nvml_stub.conf", dir);
    } else {
      snprintf(out, len, "nvml_stub.conf");
    }
  }
}

static void trim(char *s) {
  size_t n = strlen(s);
  while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ')) s[--n] = 0;
}

static nvmlReturn_t load_config(void) {
  char path[PATH_LEN];
  config_path(path, sizeof path);
  FILE *f = path[0] ? fopen(path, "r") : NULL;
  if (!f) return NVML_ERROR_DRIVER_NOT_LOADED;
  gpu_count = 0;
  snprintf(events_path, sizeof events_path, "%s", path);
  char *slash = strrchr(events_path, '/');
  if (slash)
    snprintf(slash + 1, sizeof events_path - (size_t)(slash + 1 - events_path), "nvml_stub.events");
  else
    snprintf(events_path, sizeof events_path, "nvml_stub.events");
  char line[1024];
  while (fgets(line, sizeof line, f)) {
    trim(line);
    char word[32];
    int used = 0;
    if (sscanf(line, "%31s %n", word, &used) < 1 || word[0] == '#') continue;
    char *rest = line + used;
    if (!strcmp(word, "driver")) {
      snprintf(driver_version, sizeof driver_version, "%s", rest);
    } else if (!strcmp(word, "nvml")) {
      snprintf(nvml_version, sizeof nvml_version, "%s", rest);
    } else if (!strcmp(word, "cuda")) {
      cuda_version = atoi(rest);
    } else if (!strcmp(word, "events")) {
      snprintf(events_path, sizeof events_path, "%s", rest);
    } else if (!strcmp(word, "mig")) {
      unsigned i = (unsigned)atoi(rest);
      if (i < MAX_GPUS) gpus[i].mig_enabled = 1;
    } else if (!strcmp(word, "noevents")) {
      unsigned i = (unsigned)atoi(rest);
      if (i < MAX_GPUS) gpus[i].events_supported = 0;
    } else if (!strcmp(word, "gpu") && gpu_count < MAX_GPUS) {
      struct nvmlDevice_st *g = &gpus[gpu_count];
      char minor[16];
      int name_at = 0;
      memset(g, 0, sizeof *g);
      if (sscanf(rest, "%95s %llu %15s %31s %n", g->uuid, &g->memory_mib, minor, g->pci_bus_id,
                 &name_at) < 4)
        continue;
      snprintf(g->name, sizeof g->name, "%s", rest + name_at);
      g->index = gpu_count;
      g->has_minor = strcmp(minor, "-") != 0;
      g->minor = g->has_minor ? (unsigned)atoi(minor) : 0;
      g->events_supported = 1;
      gpu_count++;
    }
  }
  fclose(f);
  return NVML_SUCCESS;
}

static nvmlReturn_t init(void) {
  nvmlReturn_t ret = NVML_SUCCESS;
  pthread_mutex_lock(&lock);
  if (init_count == 0) ret = load_config();
  if (ret == NVML_SUCCESS) init_count++;
  pthread_mutex_unlock(&lock);
  return ret;
}

nvmlReturn_t nvmlInit_v2(void) { return init(); }
nvmlReturn_t nvmlInit(void) { return init(); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
  (void)flags;
  return init();
}

nvmlReturn_t nvmlShutdown(void) {
  nvmlReturn_t ret = NVML_SUCCESS;
  pthread_mutex_lock(&lock);
  if (init_count == 0)
    ret = NVML_ERROR_UNINITIALIZED;
  else
    init_count--;
  pthread_mutex_unlock(&lock);
  return ret;
}

const char *nvmlErrorString(nvmlReturn_t r) {
  switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Unknown Error";
  }
}

#define REQUIRE_INIT() \
  do { if (init_count == 0) return NVML_ERROR_UNINITIALIZED; } while (0)

static nvmlReturn_t copy_string(const char *value, char *out, unsigned int length) {
  if (!out) return NVML_ERROR_INVALID_ARGUMENT;
  if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
  memcpy(out, value, strlen(value) + 1);
  return NVML_SUCCESS;
}

static int valid_device(nvmlDevice_t d) {
  return d >= &gpus[0] && d < &gpus[gpu_count];
}

#define REQUIRE_DEVICE(d) \
  do { REQUIRE_INIT(); if (!valid_device(d)) return NVML_ERROR_INVALID_ARGUMENT; } while (0)

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
  REQUIRE_INIT();
  return copy_string(driver_version, version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
  REQUIRE_INIT();
  return copy_string(nvml_version, version, length);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) {
  REQUIRE_INIT();
  if (!v) return NVML_ERROR_INVALID_ARGUMENT;
  *v = cuda_version;
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
  REQUIRE_INIT();
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  *count = gpu_count;
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
  REQUIRE_INIT();
  if (!device || index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
  *device = &gpus[index];
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
  return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
  REQUIRE_INIT();
  if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
  for (unsigned i = 0; i < gpu_count; i++)
    if (!strcmp(gpus[i].uuid, uuid)) {
      *device = &gpus[i];
      return NVML_SUCCESS;
    }
  return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
  REQUIRE_DEVICE(d);
  return copy_string(d->name, name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
  REQUIRE_DEVICE(d);
  return copy_string(d->uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index) {
  REQUIRE_DEVICE(d);
  if (!index) return NVML_ERROR_INVALID_ARGUMENT;
  *index = d->index;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
  REQUIRE_DEVICE(d);
  if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
  *current = *pending = d->mig_enabled ? 1u : 0u; /* NVML_DEVICE_MIG_ENABLE / _DISABLE */
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
  REQUIRE_DEVICE(d);
  if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
  if (!d->has_minor) return NVML_ERROR_NOT_SUPPORTED;
  *minor = d->minor;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
  REQUIRE_DEVICE(d);
  if (!m) return NVML_ERROR_INVALID_ARGUMENT;
  m->total = d->memory_mib << 20;
  m->used = 0;
  m->free = m->total;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
  REQUIRE_DEVICE(d);
  if (!m) return NVML_ERROR_INVALID_ARGUMENT;
  m->total = d->memory_mib << 20;
  m->reserved = 0;
  m->used = 0;
  m->free = m->total;
  return NVML_SUCCESS;
}

static nvmlReturn_t pci_info(nvmlDevice_t d, nvmlPciInfo_t *p) {
  REQUIRE_DEVICE(d);
  if (!p) return NVML_ERROR_INVALID_ARGUMENT;
  memset(p, 0, sizeof *p);
  snprintf(p->busId, sizeof p->busId, "%s", d->pci_bus_id);
  /* Legacy form drops the first four domain digits: 00000000:3B:00.0 -> 0000:3B:00.0. */
  snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%.15s",
           strlen(d->pci_bus_id) > 4 ? d->pci_bus_id + 4 : d->pci_bus_id);
  sscanf(d->pci_bus_id, "%x:%x:%x", &p->domain, &p->bus, &p->device);
  p->pciDeviceId = 0x20B010DE;
  p->pciSubSystemId = 0x134F10DE;
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p) { return pci_info(d, p); }
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *p) { return pci_info(d, p); }
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t d, nvmlPciInfo_t *p) { return pci_info(d, p); }

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
  REQUIRE_DEVICE(d);
  if (!types) return NVML_ERROR_INVALID_ARGUMENT;
  *types = d->events_supported ? (EVENT_TYPE_XID_CRITICAL | 0x1ULL | 0x2ULL | 0x4ULL) : 0;
  return NVML_SUCCESS;
}

/* Number of lines in the events file now (0 when it does not exist). */
static long event_lines(void) {
  FILE *f = fopen(events_path, "r");
  if (!f) return 0;
  long n = 0;
  char line[256];
  while (fgets(line, sizeof line, f)) n++;
  fclose(f);
  return n;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
  REQUIRE_INIT();
  if (!set) return NVML_ERROR_INVALID_ARGUMENT;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < MAX_SETS; i++)
    if (!sets[i].in_use) {
      memset(&sets[i], 0, sizeof sets[i]);
      sets[i].in_use = 1;
      sets[i].delivered_lines = event_lines();
      *set = &sets[i];
      pthread_mutex_unlock(&lock);
      return NVML_SUCCESS;
    }
  pthread_mutex_unlock(&lock);
  return NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
  REQUIRE_DEVICE(d);
  if (!set || !set->in_use) return NVML_ERROR_INVALID_ARGUMENT;
  if (!d->events_supported) return NVML_ERROR_NOT_SUPPORTED;
  if (types & EVENT_TYPE_XID_CRITICAL) set->registered[d->index] = 1;
  return NVML_SUCCESS;
}

/* Delivers the next undelivered XID line for a GPU registered in `set`; 1 when one was found. */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *data) {
  FILE *f = fopen(events_path, "r");
  if (!f) return 0;
  long n = 0;
  int found = 0;
  char line[256];
  while (!found && fgets(line, sizeof line, f)) {
    n++;
    if (n <= set->delivered_lines) continue;
    /* A line still being written (no newline yet) is read on a later pass. */
    if (!strchr(line, '\n')) {
      n--;
      break;
    }
    set->delivered_lines = n;
    unsigned index;
    unsigned long long xid;
    if (sscanf(line, "xid %u %llu", &index, &xid) == 2 && index < gpu_count &&
        set->registered[index]) {
      memset(data, 0, sizeof *data);
      data->device = &gpus[index];
      data->eventType = EVENT_TYPE_XID_CRITICAL;
      data->eventData = xid;
      data->gpuInstanceId = 0xFFFFFFFFu;
      data->computeInstanceId = 0xFFFFFFFFu;
      found = 1;
    }
  }
  fclose(f);
  return found;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
  REQUIRE_INIT();
  if (!set || !set->in_use || !data) return NVML_ERROR_INVALID_ARGUMENT;
  const long step_ms = 10;
  for (long waited = 0;; waited += step_ms) {
    pthread_mutex_lock(&lock);
    int found = next_event(set, data);
    pthread_mutex_unlock(&lock);
    if (found) return NVML_SUCCESS;
    if (waited >= (long)timeoutms) return NVML_ERROR_TIMEOUT;
    struct timespec ts = {0, step_ms * 1000000L};
    nanosleep(&ts, NULL);
  }
}
nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
  return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
  REQUIRE_INIT();
  if (!set || !set->in_use) return NVML_ERROR_INVALID_ARGUMENT;
  pthread_mutex_lock(&lock);
  set->in_use = 0;
  pthread_mutex_unlock(&lock);
  return NVML_SUCCESS;
}
