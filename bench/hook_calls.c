/* The hook's added cost, measured on the fake GPU (bench/hook_bench.py runs it hooked and not):
 *   launch <n>          latency of n cuLaunchKernel calls (1 us kernels), one by one; the context is
 *                       synchronised (untimed) every 64 launches so the fake's queue never fills
 *   alloc <n>           latency of n cuMemAlloc_v2 calls of 1 MiB (each freed, untimed)
 *   startup <spawn ns>  CLOCK_MONOTONIC ns from the parent's spawn to the first allocation done
 *   count-launch <n>    n zero-length kernel launches (sleep_us_0), untimed, for callgrind
 *   count-alloc <n>     n cuMemAlloc_v2 / cuMemFree_v2 pairs of 1 MiB, untimed, for callgrind
 * Prints the latencies in ns, one per line (startup: one number; the count modes nothing).
 * bench/hook_callgrind.py counts instructions inside counted_launches and counted_allocs only
 * (callgrind --toggle-collect), each after one untimed warm-up call, so that neither start-up nor
 * the hook's monitor thread is counted. Linked with -lcuda. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

static void check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "%s failed: %d\n", what, (int)r);
        exit(2);
    }
}

/* noinline: callgrind counts what runs inside these two functions, by name. */
__attribute__((noinline)) static void counted_launches(CUfunction f, long n) {
    for (long i = 0; i < n; i++) check(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "cuLaunchKernel");
}

__attribute__((noinline)) static void counted_allocs(long n) {
    for (long i = 0; i < n; i++) {
        CUdeviceptr p;
        check(cuMemAlloc(&p, 1 << 20), "cuMemAlloc");
        check(cuMemFree(p), "cuMemFree");
    }
}

static void count(const char *mode, long n) {
    if (!strcmp(mode, "count-launch")) {
        CUmodule m;
        CUfunction f;
        check(cuModuleLoadData(&m, "fake"), "cuModuleLoadData");
        check(cuModuleGetFunction(&f, m, "sleep_us_0"), "cuModuleGetFunction");
        counted_launches(f, 0); /* so that callgrind sees it even when n is 0 */
        check(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "cuLaunchKernel"); /* warm-up */
        counted_launches(f, n);
    } else {
        CUdeviceptr p;
        check(cuMemAlloc(&p, 1 << 20), "cuMemAlloc"); /* warm-up */
        check(cuMemFree(p), "cuMemFree");
        counted_allocs(n);
    }
    check(cuCtxSynchronize(), "cuCtxSynchronize");
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr p;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    if (!strcmp(argv[1], "startup")) {
        check(cuMemAlloc(&p, 1 << 20), "cuMemAlloc");
        printf("%llu\n", now_ns() - strtoull(argv[2], NULL, 10));
        return 0;
    }
    long n = atol(argv[2]);
    if (!strncmp(argv[1], "count-", 6)) {
        count(argv[1], n);
        return 0;
    }
    unsigned long long *ns = malloc(sizeof *ns * (size_t)n);
    if (!strcmp(argv[1], "launch")) {
        CUmodule m;
        CUfunction f;
        check(cuModuleLoadData(&m, "fake"), "cuModuleLoadData");
        check(cuModuleGetFunction(&f, m, "sleep_us_1"), "cuModuleGetFunction");
        for (long i = 0; i < n; i++) {
            unsigned long long t0 = now_ns();
            CUresult r = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
            ns[i] = now_ns() - t0;
            check(r, "cuLaunchKernel");
            if (i % 64 == 63) check(cuCtxSynchronize(), "cuCtxSynchronize");
        }
        check(cuCtxSynchronize(), "cuCtxSynchronize");
    } else {
        for (long i = 0; i < n; i++) {
            unsigned long long t0 = now_ns();
            CUresult r = cuMemAlloc(&p, 1 << 20);
            ns[i] = now_ns() - t0;
            check(r, "cuMemAlloc");
            check(cuMemFree(p), "cuMemFree");
        }
    }
    for (long i = 0; i < n; i++) printf("%llu\n", ns[i]);
    return 0;
}
