/* A CUDA driver-API client for the hook's tests. It reaches the driver the way the test asks:
 *   link      symbols resolved by the dynamic linker (built with -lcuda: hook_client_linked)
 *   dlsym     dlopen("libcuda.so.1") + dlsym of each ABI name
 *   proc      dlsym("cuGetProcAddress_v2") once, then cuGetProcAddress_v2 for every API
 *   proc-self as proc, but through the cuGetProcAddress_v2 that cuGetProcAddress_v2 returns for
 *             "cuGetProcAddress" (and the legacy 4-argument one at 11030 for cuMemAlloc)
 *   ptsz      as proc, with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 * then runs the commands given as arguments, printing one line per command:
 *   alloc|managed|create|async|pool|pitch|array <size>   -> "ok <index>" or "error <CUDA error name>"
 *   free <index>      info (-> "info <free> <total>")     total (-> "total <bytes>")
 *   hold (prints "holding", then sleeps until killed)     wait-stdin (prints "waiting", reads a line)
 *   await <kind> <size> <seconds>  retry the allocation until it succeeds -> "ok <index> <seconds taken>"
 *   await-free <bytes> <seconds>   poll cuMemGetInfo until free >= bytes -> "free <seconds taken>"
 *   launch <kernel> <count> <seconds>  (kernel name e.g. sleep_us_1000; launches until count or time)
 *                                      -> "launched <count> <seconds>", and "tick <seconds> <count>"
 *                                      every 100 ms while launching
 *   launch-ex, launch-coop: the same through cuLaunchKernelEx, cuLaunchCooperativeKernel
 *   graph <kernel> <count>             (one-kernel graph, launched count times)
 *   captured <kernel> <count>          (a graph of four launches recorded by stream capture in
 *                                      global mode on a stream of its own, launched count times
 *                                      there; "launched" counts graph launches)
 *   paced <kernel> <period us> <seconds>  one launch per period (or at once, when the last ended
 *                                      late), each waited for: -> "paced <count> <p50 us> <p99 us>
 *                                      <max us> <seconds>", the latencies from just before the
 *                                      launch call to the kernel's end, by events around it (device
 *                                      time: how long the client is descheduled after the launch
 *                                      does not count)
 *   release-primary, reset-primary: cuDevicePrimaryCtxRelease_v2 / _Reset_v2, then retain it again
 *   exec <command>...: replaces this process (same mode) by one running the commands
 *   fork <command>... end : runs the commands in a forked child (no exec), waits -> "child <exit status>"
 *   stress <threads> <iterations> <max bytes> <seed>  (random allocations and frees; -> "stress <ooms>")
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#undef cuGetProcAddress
typedef CUresult (*legacy_proc_fn)(const char *, void **, int, cuuint64_t);

#define APIS(X)                                    \
    X(cuInit, 2000)                                \
    X(cuDeviceGet, 2000)                           \
    X(cuDevicePrimaryCtxRetain, 7000)              \
    X(cuCtxSetCurrent, 4000)                       \
    X(cuDevicePrimaryCtxRelease_v2, 11000)         \
    X(cuDevicePrimaryCtxReset_v2, 11000)           \
    X(cuMemAlloc_v2, 3020)                         \
    X(cuMemFree_v2, 3020)                          \
    X(cuMemAllocManaged, 6000)                     \
    X(cuMemAllocPitch_v2, 3020)                    \
    X(cuMemAllocAsync, 11020)                      \
    X(cuMemAllocFromPoolAsync, 11020)              \
    X(cuMemFreeAsync, 11020)                       \
    X(cuDeviceGetDefaultMemPool, 11020)            \
    X(cuStreamSynchronize, 2000)                   \
    X(cuMemCreate, 10020)                          \
    X(cuMemRelease, 10020)                         \
    X(cuArrayCreate_v2, 3020)                      \
    X(cuArrayDestroy, 2000)                        \
    X(cuMemGetInfo_v2, 3020)                       \
    X(cuDeviceTotalMem_v2, 3020)                   \
    X(cuModuleLoadData, 2000)                      \
    X(cuModuleGetFunction, 2000)                   \
    X(cuLaunchKernel, 4000)                        \
    X(cuLaunchKernelEx, 11060)                     \
    X(cuLaunchCooperativeKernel, 9000)             \
    X(cuCtxSynchronize, 2000)                      \
    X(cuEventCreate, 2000)                         \
    X(cuEventRecord, 2000)                         \
    X(cuEventSynchronize, 2000)                    \
    X(cuEventElapsedTime_v2, 12080)                \
    X(cuGraphCreate, 10000)                        \
    X(cuGraphAddKernelNode_v2, 12000)              \
    X(cuGraphInstantiateWithFlags, 11040)          \
    X(cuGraphLaunch, 10000)                        \
    X(cuStreamCreate, 2000)                        \
    X(cuStreamBeginCapture_v2, 10010)              \
    X(cuStreamEndCapture, 10000)                   \
    X(cuGetErrorName, 6000)

static struct {
#define FIELD(name, version) __typeof__(&name) name;
    APIS(FIELD)
#undef FIELD
} api;

static void die(const char *what) {
    printf("fatal %s\n", what);
    fflush(stdout);
    exit(2);
}

#ifndef LINKED
static const char *base_name(const char *abi, char *out, size_t size) {
    snprintf(out, size, "%s", abi);
    char *v = strstr(out, "_v2");
    if (v && v[3] == 0) *v = 0;
    return out;
}
#endif

static void resolve(const char *mode) {
#ifdef LINKED
    if (strcmp(mode, "link")) die("hook_client_linked only supports mode link");
#define LINK(name, version) api.name = name;
    APIS(LINK)
#undef LINK
#else
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) die("dlopen libcuda.so.1");
    if (!strcmp(mode, "dlsym")) {
#define DLSYM(name, version) api.name = (__typeof__(api.name))dlsym(lib, #name);
        APIS(DLSYM)
#undef DLSYM
        return;
    }
    __typeof__(&cuGetProcAddress_v2) proc = (__typeof__(proc))dlsym(lib, "cuGetProcAddress_v2");
    if (!proc) die("dlsym cuGetProcAddress_v2");
    cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT;
    if (!strcmp(mode, "proc-self")) {
        void *self = NULL;
        CUdriverProcAddressQueryResult status;
        if (proc("cuGetProcAddress", &self, 12000, 0, &status) != CUDA_SUCCESS || !self) die("cuGetProcAddress self");
        proc = (__typeof__(proc))self;
        void *legacy = NULL;
        if (proc("cuGetProcAddress", &legacy, 11030, 0, &status) != CUDA_SUCCESS || !legacy) die("legacy self");
        void *alloc = NULL;
        if (((legacy_proc_fn)legacy)("cuMemAlloc", &alloc, 3020, 0) != CUDA_SUCCESS || !alloc) die("legacy lookup");
        api.cuMemAlloc_v2 = (__typeof__(api.cuMemAlloc_v2))alloc;
    } else if (!strcmp(mode, "ptsz")) {
        flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    } else if (strcmp(mode, "proc")) {
        die("unknown mode");
    }
    char base[128];
    CUdriverProcAddressQueryResult status;
#define PROC(name, version)                                                                        \
    if (!api.name) {                                                                               \
        void *fn = NULL;                                                                           \
        if (proc(base_name(#name, base, sizeof base), &fn, version >= 12000 ? version : 12000, flags, &status) == CUDA_SUCCESS) \
            api.name = (__typeof__(api.name))fn;                                                   \
    }
    APIS(PROC)
#undef PROC
#endif
}

static const char *err_name(CUresult r) {
    const char *name = NULL;
    if (api.cuGetErrorName) api.cuGetErrorName(r, &name);
    return name ? name : "UNKNOWN";
}

static void check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        printf("fatal %s %s\n", what, err_name(r));
        fflush(stdout);
        exit(2);
    }
}

enum kind { K_POINTER, K_ASYNC, K_HANDLE, K_ARRAY };
struct allocation {
    enum kind kind;
    uint64_t value;
};
static struct allocation allocations[4096];
static int nallocations;
static CUdevice device;

static uint64_t parse_size(const char *s) {
    char *end;
    uint64_t v = strtoull(s, &end, 10);
    if (*end == 'k') v <<= 10;
    if (*end == 'm') v <<= 20;
    if (*end == 'g') v <<= 30;
    return v;
}

static CUresult allocate(const char *how, uint64_t size, struct allocation *out) {
    CUresult r;
    if (!strcmp(how, "alloc") || !strcmp(how, "managed") || !strcmp(how, "pitch")) {
        CUdeviceptr p = 0;
        size_t pitch;
        r = !strcmp(how, "alloc")     ? api.cuMemAlloc_v2(&p, size)
            : !strcmp(how, "managed") ? api.cuMemAllocManaged(&p, size, CU_MEM_ATTACH_GLOBAL)
                                      : api.cuMemAllocPitch_v2(&p, &pitch, 1 << 20, size >> 20, 4);
        *out = (struct allocation){K_POINTER, p};
    } else if (!strcmp(how, "async") || !strcmp(how, "pool")) {
        CUdeviceptr p = 0;
        CUmemoryPool pool;
        if (!strcmp(how, "async")) r = api.cuMemAllocAsync(&p, size, NULL);
        else if ((r = api.cuDeviceGetDefaultMemPool(&pool, device)) == CUDA_SUCCESS)
            r = api.cuMemAllocFromPoolAsync(&p, size, pool, NULL);
        if (r == CUDA_SUCCESS) r = api.cuStreamSynchronize(NULL);
        *out = (struct allocation){K_ASYNC, p};
    } else if (!strcmp(how, "create")) {
        CUmemAllocationProp prop = {0};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        CUmemGenericAllocationHandle h = 0;
        r = api.cuMemCreate(&h, size, &prop, 0);
        *out = (struct allocation){K_HANDLE, h};
    } else {
        CUDA_ARRAY_DESCRIPTOR desc = {.Width = 1 << 16, .Height = size >> 18, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
        CUarray a = NULL;
        r = api.cuArrayCreate_v2(&a, &desc);
        *out = (struct allocation){K_ARRAY, (uint64_t)(uintptr_t)a};
    }
    return r;
}

static CUresult release(const struct allocation *a) {
    switch (a->kind) {
    case K_POINTER: return api.cuMemFree_v2(a->value);
    case K_ASYNC: {
        CUresult r = api.cuMemFreeAsync(a->value, NULL);
        return r == CUDA_SUCCESS ? api.cuStreamSynchronize(NULL) : r;
    }
    case K_HANDLE: return api.cuMemRelease(a->value);
    default: return api.cuArrayDestroy((CUarray)(uintptr_t)a->value);
    }
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Launches kernel f once every period_us for seconds, each waited for; prints its latencies. */
static void paced(CUfunction f, double period_us, double seconds) {
    static double latency_us[1000000];
    CUevent before, after;
    check(api.cuEventCreate(&before, CU_EVENT_DEFAULT), "cuEventCreate");
    check(api.cuEventCreate(&after, CU_EVENT_DEFAULT), "cuEventCreate");
    long n = 0;
    double start = now_s(), next = start;
    while (now_s() - start < seconds && n < (long)(sizeof latency_us / sizeof *latency_us)) {
        double wait = next - now_s();
        if (wait > 0) {
            struct timespec t = {.tv_sec = (time_t)wait, .tv_nsec = (long)((wait - (double)(time_t)wait) * 1e9)};
            nanosleep(&t, NULL);
        }
        float ms;
        check(api.cuEventRecord(before, NULL), "cuEventRecord");
        check(api.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "cuLaunchKernel");
        check(api.cuEventRecord(after, NULL), "cuEventRecord");
        check(api.cuEventSynchronize(after), "cuEventSynchronize");
        check(api.cuEventElapsedTime_v2(&ms, before, after), "cuEventElapsedTime");
        latency_us[n++] = ms * 1e3;
        next += period_us * 1e-6;
        if (next < now_s()) next = now_s();
    }
    double took = now_s() - start;
    if (!n) die("paced: no launch");
    qsort(latency_us, (size_t)n, sizeof *latency_us, by_value);
    printf("paced %ld %.1f %.1f %.1f %.6f\n", n, latency_us[n / 2], latency_us[(n * 99) / 100], latency_us[n - 1],
           took);
}

static CUfunction function(const char *name) {
    CUmodule m;
    CUfunction f;
    static const char image[] = "fake";
    check(api.cuModuleLoadData(&m, image), "cuModuleLoadData");
    check(api.cuModuleGetFunction(&f, m, name), "cuModuleGetFunction");
    return f;
}

struct stress_args {
    CUcontext ctx;
    int iterations;
    uint64_t max_bytes;
    unsigned seed;
    int ooms;
};

static void *stress_thread(void *p) {
    struct stress_args *a = p;
    check(api.cuCtxSetCurrent(a->ctx), "cuCtxSetCurrent");
    CUdeviceptr held[64];
    int nheld = 0;
    for (int i = 0; i < a->iterations; i++) {
        if (nheld == 64 || (nheld && rand_r(&a->seed) % 2)) {
            int k = (int)(rand_r(&a->seed) % (unsigned)nheld);
            check(api.cuMemFree_v2(held[k]), "cuMemFree_v2");
            held[k] = held[--nheld];
        } else {
            uint64_t size = 1 + (uint64_t)rand_r(&a->seed) % a->max_bytes;
            CUresult r = api.cuMemAlloc_v2(&held[nheld], size);
            if (r == CUDA_SUCCESS) nheld++;
            else if (r == CUDA_ERROR_OUT_OF_MEMORY) a->ooms++;
            else check(r, "cuMemAlloc_v2");
        }
    }
    while (nheld) check(api.cuMemFree_v2(held[--nheld]), "cuMemFree_v2");
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) die("usage: hook_client <mode> <command>...");
    setvbuf(stdout, NULL, _IOLBF, 0);
    resolve(argv[1]);
    CUcontext ctx;
    check(api.cuInit(0), "cuInit");
    check(api.cuDeviceGet(&device, 0), "cuDeviceGet");
    check(api.cuDevicePrimaryCtxRetain(&ctx, device), "cuDevicePrimaryCtxRetain");
    check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    for (int i = 2; i < argc; i++) {
        const char *cmd = argv[i];
        if (!strcmp(cmd, "info")) {
            size_t free_bytes, total;
            check(api.cuMemGetInfo_v2(&free_bytes, &total), "cuMemGetInfo_v2");
            printf("info %zu %zu\n", free_bytes, total);
        } else if (!strcmp(cmd, "total")) {
            size_t total;
            check(api.cuDeviceTotalMem_v2(&total, device), "cuDeviceTotalMem_v2");
            printf("total %zu\n", total);
        } else if (!strcmp(cmd, "free")) {
            int k = atoi(argv[++i]);
            CUresult r = release(&allocations[k]);
            printf(r == CUDA_SUCCESS ? "ok\n" : "error %s\n", err_name(r));
        } else if (!strcmp(cmd, "hold")) {
            printf("holding\n");
            fflush(stdout);
            for (;;) pause();
        } else if (!strcmp(cmd, "release-primary") || !strcmp(cmd, "reset-primary")) {
            check(cmd[2] == 'l' ? api.cuDevicePrimaryCtxRelease_v2(device) : api.cuDevicePrimaryCtxReset_v2(device),
                  cmd);
            check(api.cuDevicePrimaryCtxRetain(&ctx, device), "cuDevicePrimaryCtxRetain");
            check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
            nallocations = 0;
            printf("ok\n");
        } else if (!strcmp(cmd, "exec")) {
            char **next = calloc((size_t)(argc - i + 2), sizeof *next);
            next[0] = argv[0];
            next[1] = argv[1];
            for (int k = i + 1; k < argc; k++) next[k - i + 1] = argv[k];
            fflush(stdout);
            execv(argv[0], next);
            die("execv");
        } else if (!strcmp(cmd, "fork")) {
            fflush(stdout);
            pid_t child = fork();
            if (child == 0) continue; /* the child runs the commands up to "end" */
            while (i + 1 < argc && strcmp(argv[i + 1], "end")) i++;
            i++;
            int status = 0;
            waitpid(child, &status, 0);
            printf("child %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        } else if (!strcmp(cmd, "end")) {
            exit(0);
        } else if (!strcmp(cmd, "sleep-ms")) {
            usleep((useconds_t)atoi(argv[++i]) * 1000u);
        } else if (!strcmp(cmd, "wait-stdin")) {
            char line[64];
            printf("waiting\n");
            fflush(stdout);
            if (!fgets(line, sizeof line, stdin)) die("stdin closed");
        } else if (!strcmp(cmd, "await") || !strcmp(cmd, "await-free")) {
            int is_free = !strcmp(cmd, "await-free");
            const char *how = is_free ? NULL : argv[++i];
            uint64_t size = parse_size(argv[++i]);
            double limit = atof(argv[++i]), start = now_s(), taken = -1;
            struct allocation a;
            while (taken < 0 && now_s() - start < limit) {
                size_t free_bytes, total;
                if (is_free ? api.cuMemGetInfo_v2(&free_bytes, &total) == CUDA_SUCCESS && free_bytes >= size
                            : allocate(how, size, &a) == CUDA_SUCCESS)
                    taken = now_s() - start;
                else
                    usleep(5000);
            }
            if (taken < 0) printf("timeout\n");
            else if (is_free) printf("free %.6f\n", taken);
            else {
                allocations[nallocations] = a;
                printf("ok %d %.6f\n", nallocations++, taken);
            }
        } else if (!strcmp(cmd, "paced")) {
            paced(function(argv[i + 1]), atof(argv[i + 2]), atof(argv[i + 3]));
            i += 3;
        } else if (!strncmp(cmd, "launch", 6) || !strcmp(cmd, "graph") || !strcmp(cmd, "captured")) {
            CUfunction f = function(argv[i + 1]);
            long count = atol(argv[i + 2]);
            int is_graph = !strcmp(cmd, "graph") || !strcmp(cmd, "captured");
            CUstream stream = NULL;
            double seconds = !is_graph && i + 3 < argc ? atof(argv[i + 3]) : 1e9;
            i += is_graph ? 2 : 3;
            CUgraphExec exec = NULL;
            if (!strcmp(cmd, "captured")) {
                CUgraph g;
                check(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
                check(api.cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
                for (int k = 0; k < 4; k++)
                    check(api.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, NULL, NULL), "cuLaunchKernel (captured)");
                check(api.cuStreamEndCapture(stream, &g), "cuStreamEndCapture");
                check(api.cuGraphInstantiateWithFlags(&exec, g, 0), "cuGraphInstantiate");
            } else if (is_graph) {
                CUgraph g;
                CUgraphNode node;
                CUDA_KERNEL_NODE_PARAMS params = {.func = f, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1,
                                                  .blockDimX = 32, .blockDimY = 1, .blockDimZ = 1};
                check(api.cuGraphCreate(&g, 0), "cuGraphCreate");
                check(api.cuGraphAddKernelNode_v2(&node, g, NULL, 0, &params), "cuGraphAddKernelNode");
                check(api.cuGraphInstantiateWithFlags(&exec, g, 0), "cuGraphInstantiate");
            }
            double start = now_s(), next_tick = 0.1;
            long n = 0;
            for (; n < count && now_s() - start < seconds; n++) {
                if (now_s() - start >= next_tick) {
                    printf("tick %.6f %ld\n", now_s() - start, n);
                    next_tick += 0.1;
                }
                if (is_graph) {
                    check(api.cuGraphLaunch(exec, stream), "cuGraphLaunch");
                } else if (!strcmp(cmd, "launch-ex")) {
                    CUlaunchConfig config = {.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32,
                                             .blockDimY = 1, .blockDimZ = 1};
                    check(api.cuLaunchKernelEx(&config, f, NULL, NULL), "cuLaunchKernelEx");
                } else if (!strcmp(cmd, "launch-coop")) {
                    check(api.cuLaunchCooperativeKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL), "cuLaunchCooperativeKernel");
                } else {
                    check(api.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "cuLaunchKernel");
                }
            }
            check(api.cuCtxSynchronize(), "cuCtxSynchronize");
            printf("launched %ld %.6f\n", n, now_s() - start);
        } else if (!strcmp(cmd, "stress")) {
            int threads = atoi(argv[i + 1]);
            struct stress_args args[64];
            pthread_t tids[64];
            for (int t = 0; t < threads && t < 64; t++) {
                args[t] = (struct stress_args){ctx, atoi(argv[i + 2]), parse_size(argv[i + 3]),
                                               (unsigned)atoi(argv[i + 4]) * 64u + (unsigned)t, 0};
                pthread_create(&tids[t], NULL, stress_thread, &args[t]);
            }
            int ooms = 0;
            for (int t = 0; t < threads && t < 64; t++) {
                pthread_join(tids[t], NULL);
                ooms += args[t].ooms;
            }
            i += 4;
            printf("stress %d\n", ooms);
        } else {
            struct allocation a;
            CUresult r = allocate(cmd, parse_size(argv[++i]), &a);
            if (r == CUDA_SUCCESS) {
                allocations[nallocations] = a;
                printf("ok %d\n", nallocations++);
            } else {
                printf("error %s\n", err_name(r));
            }
        }
    }
    return 0;
}
