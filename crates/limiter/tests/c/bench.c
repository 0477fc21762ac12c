/*
 * The allocation overhead benchmark: cuMemAlloc_v2 / cuMemFree_v2 of 1 MiB, N times, each
 * call timed alone (CLOCK_MONOTONIC), against whatever libcuda.so.1 the loader gives and
 * with or without the limiter preloaded (the harness runs it both ways). Prints
 *   alloc p50 p99 max   (nanoseconds)
 *   free  p50 p99 max
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int (*f_init)(unsigned);
typedef int (*f_retain)(void **, int);
typedef int (*f_set)(void *);
typedef int (*f_alloc)(unsigned long long *, size_t);
typedef int (*f_free)(unsigned long long);

static long long now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  long long x = *(const long long *)a, y = *(const long long *)b;
  return x < y ? -1 : x > y;
}

static void report(const char *what, long long *t, int n) {
  qsort(t, n, sizeof *t, cmp);
  printf("%s %lld %lld %lld\n", what, t[n / 2], t[(int)(n * 0.99)], t[n - 1]);
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 100000;
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!cuda) { printf("error dlopen\n"); return 64; }
  f_init init = (f_init)dlsym(cuda, "cuInit");
  f_retain retain = (f_retain)dlsym(cuda, "cuDevicePrimaryCtxRetain");
  f_set set = (f_set)dlsym(cuda, "cuCtxSetCurrent");
  f_alloc alloc = (f_alloc)dlsym(cuda, "cuMemAlloc_v2");
  f_free release = (f_free)dlsym(cuda, "cuMemFree_v2");
  void *ctx;
  if (init(0) || retain(&ctx, 0) || set(ctx)) { printf("error context\n"); return 64; }
  long long *ta = malloc(sizeof *ta * n), *tf = malloc(sizeof *tf * n);
  for (int i = 0; i < n + 1000; i++) {
    unsigned long long p;
    long long a = now();
    int r = alloc(&p, 1 << 20);
    long long b = now();
    if (r) { printf("error alloc %d\n", r); return 1; }
    int s = release(p);
    long long c = now();
    if (s) { printf("error free %d\n", s); return 1; }
    if (i >= 1000) { ta[i - 1000] = b - a; tf[i - 1000] = c - b; } /* 1000 warm-up calls */
  }
  report("alloc", ta, n);
  report("free", tf, n);
  return 0;
}
