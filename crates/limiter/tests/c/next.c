/*
 * libnext.so: a library between the program and the driver that looks entry points up with
 * dlsym(RTLD_NEXT, ...), as interposers and some runtimes do. The limiter must still answer
 * with its hooks.
 */
#define _GNU_SOURCE
#include <dlfcn.h>

__attribute__((visibility("default"))) void *next_sym(const char *name) {
  return dlsym(RTLD_NEXT, name);
}
