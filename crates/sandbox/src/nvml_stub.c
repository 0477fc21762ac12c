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
 *   memacct dmem|misc|off                              (per-cgroup memory limits; default off)
 *   cgroup_root <path>                                 (the fake /sys/fs/cgroup; default /sys/fs/cgroup)
 *   fail_set <code>                                    (nvmlDeviceSetMemoryLimits_v1 answers <code>)
 * A missing config file makes nvmlInit fail with NVML_ERROR_DRIVER_NOT_LOADED, as NVML does
 * on a machine without the driver.
 *
 * XID events: nvmlEventSetWait_v2 re-reads the events file; each line `xid <gpu_index> <xid>`
 * is delivered once to every event set that existed when the line was appended and that has
 * the GPU registered (tracked by line number; lines present when a set is created are old).
 *
 * Per-cgroup memory limits (driver R615, "MPS v3 memory partitioning"), over a fake cgroup tree
 * under cgroup_root, with NVML's semantics as documented (nothing here is measured on a GPU):
 *   nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1 take the full path of a cgroup
 *   directory. A MIG-enabled GPU answers NOT_SUPPORTED; so does `memacct off`. A path that is no
 *   directory answers NOT_FOUND.
 *   - dmem: the limits live in the cgroup's own files, one line `nvidia/<pci>/vidmem <bytes|max>`
 *     per GPU: hard in dmem.max, soft in dmem.min, use in dmem.current. A cgroup without
 *     dmem.max (its parent did not enable +dmem) cannot be set (NOT_FOUND) and reads its nearest
 *     dmem-enabled ancestor. Setting a soft limit adds the change to dmem.min of every ancestor
 *     up to the first without dmem.min (the driver's propagation); removing a directory does not.
 *   - misc: the driver's own map, kept in `<config>.misc` beside the config (`<pci> <path> <soft>
 *     <hard> <used>`): a cgroup reads its nearest limited ancestor, and one without any answers
 *     NOT_SUPPORTED (what R615's misc backend does for a cgroup no limit reaches).
 *   nvmlDeviceGetMemoryInfo_v2 reports the calling process's hard limit as the total (the
 *   process's cgroup: $NVML_STUB_CGROUP, a full path, else /proc/self/cgroup under cgroup_root).
 *   nvmlStubAllocate(device, bytes) is the stub's stand-in for a CUDA allocation in the calling
 *   process's cgroup: NVML_ERROR_MEMORY past a hard limit (dmem: any level from the cgroup up),
 *   else the bytes are counted as used. nvml_stub_workload.c calls it as a container would.
 * Built with -DNVML_STUB_NO_MEMORY_LIMITS the library has no memory-limit symbols at all (a
 * driver older than R615).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
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
  NVML_ERROR_MEMORY = 20,
  NVML_ERROR_UNKNOWN = 999,
};

#define EVENT_TYPE_XID_CRITICAL 0x8ULL
#define MAX_GPUS 64
#define MAX_SETS 64
#define PATH_LEN 4096
/* Paths made from a PATH_LEN path and a file name. */
#define DERIVED_LEN (PATH_LEN + 64)

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
static char config_file[PATH_LEN] = "";
static int memacct = 0; /* 0 off, 1 misc, 2 dmem */
static char cgroup_root[PATH_LEN] = "/sys/fs/cgroup";
static int fail_set = 0;

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
  snprintf(config_file, sizeof config_file, "%s", path);
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
    } else if (!strcmp(word, "memacct")) {
      memacct = !strcmp(rest, "dmem") ? 2 : !strcmp(rest, "misc") ? 1 : 0;
    } else if (!strcmp(word, "cgroup_root")) {
      snprintf(cgroup_root, sizeof cgroup_root, "%s", rest);
    } else if (!strcmp(word, "fail_set")) {
      fail_set = atoi(rest);
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
    case 4: return "Insufficient Permissions";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
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

static int caller_limit(nvmlDevice_t d, unsigned long long *hard, unsigned long long *used);

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
  REQUIRE_DEVICE(d);
  if (!m) return NVML_ERROR_INVALID_ARGUMENT;
  m->total = d->memory_mib << 20;
  m->reserved = 0;
  m->used = 0;
  unsigned long long hard, used;
  if (caller_limit(d, &hard, &used) && hard < m->total) {
    m->total = hard;
    m->used = used;
  }
  m->free = m->total > m->used ? m->total - m->used : 0;
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

/* ---- Per-cgroup memory limits ------------------------------------------------------------ */

#define LIMIT_MAX 0xFFFFFFFFFFFFFFFFULL

typedef struct {
  const char *nameSpace;
  unsigned long long softLimit;
  unsigned long long hardLimit;
} nvmlSetMemoryLimits_v1_t;

typedef struct {
  const char *nameSpace;
  unsigned long long softLimit;
  unsigned long long hardLimit;
  unsigned long long currentUsed;
} nvmlGetMemoryLimits_v1_t;

/* A lock beside the config, so the hook, the node agent and workloads (separate processes)
 * never interleave a read-modify-write of the limit files. */
static int lock_state(void) {
  char path[DERIVED_LEN];
  snprintf(path, sizeof path, "%s.lock", config_file);
  int fd = open(path, O_RDWR | O_CREAT, 0644);
  if (fd >= 0) flock(fd, LOCK_EX);
  return fd;
}
static void unlock_state(int fd) {
  if (fd >= 0) {
    flock(fd, LOCK_UN);
    close(fd);
  }
}

static int is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static void dmem_key(nvmlDevice_t d, char *out, size_t n) {
  char pci[32];
  snprintf(pci, sizeof pci, "%s", d->pci_bus_id);
  for (char *c = pci; *c; c++)
    if (*c >= 'A' && *c <= 'Z') *c = (char)(*c - 'A' + 'a');
  snprintf(out, n, "nvidia/%s/vidmem", pci);
}

/* The value of `key` in `dir/file` (lines `key value`, value a number or max); 1 when found. */
static int read_keyed(const char *dir, const char *file, const char *key, unsigned long long *v) {
  char path[DERIVED_LEN];
  snprintf(path, sizeof path, "%s/%s", dir, file);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char line[512], k[256], val[64];
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) {
    if (sscanf(line, "%255s %63s", k, val) == 2 && !strcmp(k, key)) {
      *v = !strcmp(val, "max") ? LIMIT_MAX : strtoull(val, NULL, 10);
      found = 1;
    }
  }
  fclose(f);
  return found;
}

/* Rewrites `dir/file` with `key value` replaced or added; other lines kept. */
static int write_keyed(const char *dir, const char *file, const char *key, unsigned long long v) {
  char path[DERIVED_LEN], tmp[DERIVED_LEN + 8];
  snprintf(path, sizeof path, "%s/%s", dir, file);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *in = fopen(path, "r");
  FILE *out = fopen(tmp, "w");
  if (!out) {
    if (in) fclose(in);
    return 0;
  }
  char line[512], k[256];
  int done = 0;
  while (in && fgets(line, sizeof line, in)) {
    if (sscanf(line, "%255s", k) == 1 && !strcmp(k, key)) {
      if (v == LIMIT_MAX) fprintf(out, "%s max\n", key);
      else fprintf(out, "%s %llu\n", key, v);
      done = 1;
    } else {
      fputs(line, out);
    }
  }
  if (!done) {
    if (v == LIMIT_MAX) fprintf(out, "%s max\n", key);
    else fprintf(out, "%s %llu\n", key, v);
  }
  if (in) fclose(in);
  fclose(out);
  return rename(tmp, path) == 0;
}

/* Strips the last component of `path`; 0 when `path` is (or is above) the cgroup root. */
static int to_parent(char *path) {
  size_t root = strlen(cgroup_root);
  while (root > 1 && cgroup_root[root - 1] == '/') root--;
  if (strlen(path) <= root || strncmp(path, cgroup_root, root) != 0) return 0;
  char *slash = strrchr(path, '/');
  if (!slash || (size_t)(slash - path) < root) return 0;
  *slash = 0;
  return 1;
}

/* The calling process's cgroup directory (full path); 0 when unknown. */
static int caller_cgroup(char *out, size_t n) {
  const char *env = getenv("NVML_STUB_CGROUP");
  if (env && *env) {
    snprintf(out, n, "%s", env);
    return 1;
  }
  FILE *f = fopen("/proc/self/cgroup", "r");
  if (!f) return 0;
  char line[PATH_LEN];
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) {
    trim(line);
    if (!strncmp(line, "0::", 3)) {
      snprintf(out, n, "%s%s", cgroup_root, line + 3);
      found = 1;
    }
  }
  fclose(f);
  return found;
}

/* misc: the line of the nearest limited ancestor-or-self of `path` for GPU `pci`. */
static int misc_find(const char *pci, const char *path, char *found_path, unsigned long long *soft,
                     unsigned long long *hard, unsigned long long *used) {
  char state[DERIVED_LEN], cur[PATH_LEN];
  snprintf(state, sizeof state, "%s.misc", config_file);
  snprintf(cur, sizeof cur, "%s", path);
  for (;;) {
    FILE *f = fopen(state, "r");
    if (f) {
      char line[PATH_LEN + 128], p[32], ns[PATH_LEN];
      unsigned long long a, b, c;
      while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "%31s %4095s %llu %llu %llu", p, ns, &a, &b, &c) == 5 && !strcmp(p, pci) &&
            !strcmp(ns, cur)) {
          fclose(f);
          if (found_path) snprintf(found_path, PATH_LEN, "%s", cur);
          *soft = a;
          *hard = b;
          *used = c;
          return 1;
        }
      }
      fclose(f);
    }
    if (!to_parent(cur)) return 0;
  }
}

/* misc: writes (replaces) the line of `path` for GPU `pci`. */
static int misc_store(const char *pci, const char *path, unsigned long long soft,
                      unsigned long long hard, unsigned long long used) {
  char state[DERIVED_LEN], tmp[DERIVED_LEN + 8];
  snprintf(state, sizeof state, "%s.misc", config_file);
  snprintf(tmp, sizeof tmp, "%s.tmp", state);
  FILE *in = fopen(state, "r");
  FILE *out = fopen(tmp, "w");
  if (!out) {
    if (in) fclose(in);
    return 0;
  }
  char line[PATH_LEN + 128], p[32], ns[PATH_LEN];
  while (in && fgets(line, sizeof line, in)) {
    if (sscanf(line, "%31s %4095s", p, ns) == 2 && !strcmp(p, pci) && !strcmp(ns, path)) continue;
    fputs(line, out);
  }
  fprintf(out, "%s %s %llu %llu %llu\n", pci, path, soft, hard, used);
  if (in) fclose(in);
  fclose(out);
  return rename(tmp, state) == 0;
}

/* dmem: the nearest dmem-enabled ancestor-or-self of `path` (has dmem.max); 0 when none. */
static int dmem_enabled(char *path) {
  for (;;) {
    char file[DERIVED_LEN];
    snprintf(file, sizeof file, "%s/dmem.max", path);
    if (is_file(file)) return 1;
    if (!to_parent(path)) return 0;
  }
}

/* The calling process's effective hard limit and use on `d`; 1 when a limit reaches it. */
static int caller_limit(nvmlDevice_t d, unsigned long long *hard, unsigned long long *used) {
  char cg[PATH_LEN], key[96];
  if (memacct == 0 || d->mig_enabled || !caller_cgroup(cg, sizeof cg)) return 0;
  dmem_key(d, key, sizeof key);
  if (memacct == 1) {
    unsigned long long soft;
    return misc_find(d->pci_bus_id, cg, NULL, &soft, hard, used) && *hard != LIMIT_MAX;
  }
  if (!dmem_enabled(cg)) return 0;
  unsigned long long h = LIMIT_MAX, u = 0;
  read_keyed(cg, "dmem.max", key, &h);
  read_keyed(cg, "dmem.current", key, &u);
  *hard = h;
  *used = u;
  return h != LIMIT_MAX;
}

#ifndef NVML_STUB_NO_MEMORY_LIMITS
nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t d, nvmlSetMemoryLimits_v1_t *l) {
  REQUIRE_DEVICE(d);
  if (!l || !l->nameSpace) return NVML_ERROR_INVALID_ARGUMENT;
  if (fail_set) return (nvmlReturn_t)fail_set;
  if (memacct == 0 || d->mig_enabled) return NVML_ERROR_NOT_SUPPORTED;
  if (!is_dir(l->nameSpace)) return NVML_ERROR_NOT_FOUND;
  char key[96];
  dmem_key(d, key, sizeof key);
  int fd = lock_state();
  nvmlReturn_t ret = NVML_SUCCESS;
  if (memacct == 1) {
    unsigned long long soft, hard, used = 0;
    char at[PATH_LEN];
    if (!(misc_find(d->pci_bus_id, l->nameSpace, at, &soft, &hard, &used) &&
          !strcmp(at, l->nameSpace)))
      used = 0;
    if (!misc_store(d->pci_bus_id, l->nameSpace, l->softLimit, l->hardLimit, used))
      ret = NVML_ERROR_UNKNOWN;
  } else {
    char file[DERIVED_LEN];
    snprintf(file, sizeof file, "%s/dmem.max", l->nameSpace);
    if (!is_file(file)) {
      ret = NVML_ERROR_NOT_FOUND;
    } else {
      unsigned long long old_soft = 0;
      read_keyed(l->nameSpace, "dmem.min", key, &old_soft);
      write_keyed(l->nameSpace, "dmem.max", key, l->hardLimit);
      write_keyed(l->nameSpace, "dmem.min", key, l->softLimit);
      /* The driver's propagation: each ancestor's dmem.min moves by the change, up to the first
       * ancestor without dmem.min. */
      char up[PATH_LEN];
      snprintf(up, sizeof up, "%s", l->nameSpace);
      while (to_parent(up)) {
        char min_file[DERIVED_LEN];
        snprintf(min_file, sizeof min_file, "%s/dmem.min", up);
        if (!is_file(min_file)) break;
        unsigned long long v = 0;
        read_keyed(up, "dmem.min", key, &v);
        if (l->softLimit >= old_soft) v += l->softLimit - old_soft;
        else v = v > old_soft - l->softLimit ? v - (old_soft - l->softLimit) : 0;
        write_keyed(up, "dmem.min", key, v);
      }
    }
  }
  unlock_state(fd);
  return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t d, nvmlGetMemoryLimits_v1_t *l) {
  REQUIRE_DEVICE(d);
  if (!l || !l->nameSpace) return NVML_ERROR_INVALID_ARGUMENT;
  if (memacct == 0 || d->mig_enabled) return NVML_ERROR_NOT_SUPPORTED;
  if (!is_dir(l->nameSpace)) return NVML_ERROR_NOT_FOUND;
  char key[96];
  dmem_key(d, key, sizeof key);
  int fd = lock_state();
  nvmlReturn_t ret = NVML_SUCCESS;
  if (memacct == 1) {
    unsigned long long soft, hard, used;
    if (misc_find(d->pci_bus_id, l->nameSpace, NULL, &soft, &hard, &used)) {
      l->softLimit = soft;
      l->hardLimit = hard;
      l->currentUsed = used;
    } else {
      ret = NVML_ERROR_NOT_SUPPORTED;
    }
  } else {
    char at[PATH_LEN];
    snprintf(at, sizeof at, "%s", l->nameSpace);
    l->softLimit = 0;
    l->hardLimit = LIMIT_MAX;
    l->currentUsed = 0;
    if (dmem_enabled(at)) {
      read_keyed(at, "dmem.min", key, &l->softLimit);
      read_keyed(at, "dmem.max", key, &l->hardLimit);
      read_keyed(at, "dmem.current", key, &l->currentUsed);
    }
  }
  unlock_state(fd);
  return ret;
}
#endif

/* Stub only: an allocation of `bytes` on `d` by the calling process (see the header). */
nvmlReturn_t nvmlStubAllocate(nvmlDevice_t d, unsigned long long bytes) {
  REQUIRE_DEVICE(d);
  char cg[PATH_LEN], key[96];
  if (memacct == 0 || d->mig_enabled || !caller_cgroup(cg, sizeof cg)) return NVML_SUCCESS;
  dmem_key(d, key, sizeof key);
  int fd = lock_state();
  nvmlReturn_t ret = NVML_SUCCESS;
  if (memacct == 1) {
    unsigned long long soft, hard, used;
    char at[PATH_LEN];
    if (misc_find(d->pci_bus_id, cg, at, &soft, &hard, &used)) {
      if (hard != LIMIT_MAX && used + bytes > hard) ret = NVML_ERROR_MEMORY;
      else misc_store(d->pci_bus_id, at, soft, hard, used + bytes);
    }
  } else {
    /* Every level from the cgroup up bounds it; the charge lands on each level that counts. */
    char up[PATH_LEN];
    snprintf(up, sizeof up, "%s", cg);
    do {
      unsigned long long max = LIMIT_MAX, cur = 0;
      read_keyed(up, "dmem.max", key, &max);
      read_keyed(up, "dmem.current", key, &cur);
      if (max != LIMIT_MAX && cur + bytes > max) ret = NVML_ERROR_MEMORY;
    } while (ret == NVML_SUCCESS && to_parent(up));
    if (ret == NVML_SUCCESS) {
      snprintf(up, sizeof up, "%s", cg);
      do {
        char file[DERIVED_LEN];
        snprintf(file, sizeof file, "%s/dmem.max", up);
        if (is_file(file)) {
          unsigned long long cur = 0;
          read_keyed(up, "dmem.current", key, &cur);
          write_keyed(up, "dmem.current", key, cur + bytes);
        }
      } while (to_parent(up));
    }
  }
  unlock_state(fd);
  return ret;
}
