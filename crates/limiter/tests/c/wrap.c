/*
 * libwrap.so: wraps getppid() and finds the real one with dlsym(RTLD_NEXT, "getppid"), as
 * malloc wrappers, profilers and sanitizers do. RTLD_NEXT is relative to the caller: with a
 * dlsym wrapper that called the real dlsym (instead of jumping to it), the lookup would be
 * relative to the wrapper and find this very function again; the depth guard turns that
 * endless recursion into exit status 42.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <unistd.h>

static int depth;

__attribute__((visibility("default"))) pid_t getppid(void) {
  if (++depth > 3) _exit(42);
  pid_t (*next)(void) = (pid_t (*)(void))dlsym(RTLD_NEXT, "getppid");
  pid_t r = next ? next() : -1;
  depth--;
  return r;
}
