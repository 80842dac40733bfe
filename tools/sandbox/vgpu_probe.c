/* vgpu-probe: the driver-API test program of the sandbox's probe image.
 *
 * Loads libcuda.so.1 the way the CUDA runtime does (dlopen by soname, so the library the NVIDIA
 * container toolkit - or the sandbox - placed in the container is the one used), reports the total
 * memory the driver claims, then allocates CHUNK_MIB blocks until the driver refuses one and reports
 * how many succeeded. Everything is freed before exit, so the probe can run again in the same
 * container. Output is one "key=value" line per fact, for tests and for people.
 *
 * Usage: vgpu-probe [CHUNK_MIB [HOLD_SECONDS [FOLLOW_SECONDS]]]   (default 256, 0, 0)
 * HOLD_SECONDS keeps the blocks allocated that long before freeing them, so that the GPU's memory
 * use can be watched from outside (NVML, the device plugin's metrics).
 * FOLLOW_SECONDS: after the refusal, keeps asking for one more block every 10 ms for that long,
 * printing "followed=<blocks held>" at each success (a live resize that grows the quota), then
 * "follow_total_mib=<the total the driver claims now>".
 * Exit status: 0 when the driver refused an allocation with out-of-memory, 1 otherwise.
 *
 * Kernels (the QoS classes between containers, tests/draplugin/test_node.py), KERNEL a fake GPU
 * kernel name such as sleep_us_1000:
 *   vgpu-probe paced KERNEL PERIOD_US SECONDS   one launch per period (at once when the last ended
 *       late), each waited for: "paced=<count> <p50 us> <p99 us> <max us> <seconds>"
 *   vgpu-probe launch KERNEL SECONDS            launches flat out: "launched=<count>"
 * Exit status 0, or 1 with an "error=" line.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUevent;
typedef void *CUstream;

enum { CUDA_SUCCESS = 0, CUDA_ERROR_OUT_OF_MEMORY = 2, MAX_BLOCKS = 4096 };

struct driver {
    CUresult (*init)(unsigned int);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_get_name)(char *, int, CUdevice);
    CUresult (*ctx_create)(CUcontext *, unsigned int, CUdevice);
    CUresult (*ctx_destroy)(CUcontext);
    CUresult (*mem_get_info)(size_t *, size_t *);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
};

static void *symbol(void *lib, const char *name) {
    void *fn = dlsym(lib, name);
    if (fn == NULL) {
        printf("error=missing symbol %s\n", name);
        exit(1);
    }
    return fn;
}

static int check(CUresult rc, const char *what) {
    if (rc != CUDA_SUCCESS) {
        printf("error=%s returned %d\n", what, rc);
        return 0;
    }
    return 1;
}

struct kernels {
    CUresult (*module_load_data)(CUmodule *, const void *);
    CUresult (*module_get_function)(CUfunction *, CUmodule, const char *);
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void **, void **);
    CUresult (*ctx_synchronize)(void);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_synchronize)(CUevent);
    CUresult (*event_elapsed)(float *, CUevent, CUevent);
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int launch_one(const struct kernels *k, CUfunction f) {
    return check(k->launch(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "cuLaunchKernel");
}

/* The kernel modes: argv is {mode, KERNEL, [PERIOD_US,] SECONDS}. */
static int run_kernels(void *lib, int argc, char **argv) {
    int paced = strcmp(argv[1], "paced") == 0;
    if (argc != (paced ? 5 : 4)) {
        printf("error=usage: vgpu-probe paced KERNEL PERIOD_US SECONDS | vgpu-probe launch KERNEL SECONDS\n");
        return 1;
    }
    double period_us = paced ? atof(argv[3]) : 0.0;
    double seconds = atof(argv[paced ? 4 : 3]);
    struct kernels k = {
        .module_load_data = symbol(lib, "cuModuleLoadData"),
        .module_get_function = symbol(lib, "cuModuleGetFunction"),
        .launch = symbol(lib, "cuLaunchKernel"),
        .ctx_synchronize = symbol(lib, "cuCtxSynchronize"),
        .event_create = symbol(lib, "cuEventCreate"),
        .event_record = symbol(lib, "cuEventRecord"),
        .event_synchronize = symbol(lib, "cuEventSynchronize"),
        .event_elapsed = symbol(lib, "cuEventElapsedTime_v2"),
    };
    static const char image[] = "fake";
    CUmodule module;
    CUfunction f;
    if (!check(k.module_load_data(&module, image), "cuModuleLoadData") ||
        !check(k.module_get_function(&f, module, argv[2]), "cuModuleGetFunction"))
        return 1;
    static double latency_us[1000000];
    long n = 0;
    double start = now_s(), next = start;
    if (!paced) {
        while (now_s() - start < seconds) {
            if (!launch_one(&k, f))
                return 1;
            n++;
        }
        if (!check(k.ctx_synchronize(), "cuCtxSynchronize"))
            return 1;
        printf("launched=%ld\n", n);
        return 0;
    }
    CUevent before, after;
    if (!check(k.event_create(&before, 0), "cuEventCreate") || !check(k.event_create(&after, 0), "cuEventCreate"))
        return 1;
    while (now_s() - start < seconds && n < (long)(sizeof latency_us / sizeof *latency_us)) {
        double wait = next - now_s();
        if (wait > 0)
            usleep((useconds_t)(wait * 1e6));
        float ms;
        if (!check(k.event_record(before, NULL), "cuEventRecord") || !launch_one(&k, f) ||
            !check(k.event_record(after, NULL), "cuEventRecord") ||
            !check(k.event_synchronize(after), "cuEventSynchronize") ||
            !check(k.event_elapsed(&ms, before, after), "cuEventElapsedTime"))
            return 1;
        latency_us[n++] = ms * 1e3;
        next += period_us * 1e-6;
        if (next < now_s())
            next = now_s();
    }
    double took = now_s() - start;
    if (n == 0) {
        printf("error=no launch in %s seconds\n", argv[4]);
        return 1;
    }
    qsort(latency_us, (size_t)n, sizeof *latency_us, by_value);
    printf("paced=%ld %.1f %.1f %.1f %.6f\n", n, latency_us[n / 2], latency_us[(n * 99) / 100], latency_us[n - 1],
           took);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && (strcmp(argv[1], "paced") == 0 || strcmp(argv[1], "launch") == 0)) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW);
        CUdevice dev;
        CUcontext ctx;
        if (lib == NULL) {
            printf("error=dlopen libcuda.so.1: %s\n", dlerror());
            return 1;
        }
        CUresult (*init)(unsigned int) = symbol(lib, "cuInit");
        CUresult (*device_get)(CUdevice *, int) = symbol(lib, "cuDeviceGet");
        CUresult (*ctx_create)(CUcontext *, unsigned int, CUdevice) = symbol(lib, "cuCtxCreate_v2");
        if (!check(init(0), "cuInit") || !check(device_get(&dev, 0), "cuDeviceGet") ||
            !check(ctx_create(&ctx, 0, dev), "cuCtxCreate"))
            return 1;
        int rc = run_kernels(lib, argc, argv);
        fflush(stdout);
        return rc;
    }
    long chunk_mib = argc > 1 ? strtol(argv[1], NULL, 10) : 256;
    if (chunk_mib <= 0) {
        printf("error=CHUNK_MIB must be a positive number of MiB, got %s\n", argv[1]);
        return 1;
    }
    long hold_seconds = argc > 2 ? strtol(argv[2], NULL, 10) : 0;
    if (hold_seconds < 0) {
        printf("error=HOLD_SECONDS must not be negative, got %s\n", argv[2]);
        return 1;
    }
    long follow_seconds = argc > 3 ? strtol(argv[3], NULL, 10) : 0;
    if (follow_seconds < 0) {
        printf("error=FOLLOW_SECONDS must not be negative, got %s\n", argv[3]);
        return 1;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        printf("error=dlopen libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    struct driver cu = {
        .init = symbol(lib, "cuInit"),
        .device_get = symbol(lib, "cuDeviceGet"),
        .device_get_name = symbol(lib, "cuDeviceGetName"),
        .ctx_create = symbol(lib, "cuCtxCreate_v2"),
        .ctx_destroy = symbol(lib, "cuCtxDestroy_v2"),
        .mem_get_info = symbol(lib, "cuMemGetInfo_v2"),
        .mem_alloc = symbol(lib, "cuMemAlloc_v2"),
        .mem_free = symbol(lib, "cuMemFree_v2"),
    };
    CUdevice dev;
    CUcontext ctx;
    char name[256] = "";
    size_t free_bytes = 0, total_bytes = 0;
    if (!check(cu.init(0), "cuInit") || !check(cu.device_get(&dev, 0), "cuDeviceGet") ||
        !check(cu.device_get_name(name, sizeof name, dev), "cuDeviceGetName") ||
        !check(cu.ctx_create(&ctx, 0, dev), "cuCtxCreate") ||
        !check(cu.mem_get_info(&free_bytes, &total_bytes), "cuMemGetInfo"))
        return 1;
    printf("device=%s\n", name);
    printf("total_mib=%zu\n", total_bytes >> 20);
    printf("free_mib=%zu\n", free_bytes >> 20);

    static CUdeviceptr blocks[MAX_BLOCKS];
    int ok = 0;
    CUresult rc = CUDA_SUCCESS;
    while (ok < MAX_BLOCKS) {
        rc = cu.mem_alloc(&blocks[ok], (size_t)chunk_mib << 20);
        if (rc != CUDA_SUCCESS)
            break;
        ok++;
    }
    printf("chunk_mib=%ld\n", chunk_mib);
    printf("allocations_ok=%d\n", ok);
    printf("refused_with=%d\n", rc);
    fflush(stdout);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (now = start; now.tv_sec - start.tv_sec < follow_seconds && ok < MAX_BLOCKS;
         clock_gettime(CLOCK_MONOTONIC, &now)) {
        if (cu.mem_alloc(&blocks[ok], (size_t)chunk_mib << 20) == CUDA_SUCCESS) {
            printf("followed=%d\n", ++ok);
            fflush(stdout);
        } else {
            usleep(10000);
        }
    }
    if (follow_seconds > 0 && check(cu.mem_get_info(&free_bytes, &total_bytes), "cuMemGetInfo"))
        printf("follow_total_mib=%zu\n", total_bytes >> 20);
    fflush(stdout);
    if (hold_seconds > 0)
        sleep((unsigned)hold_seconds);
    for (int i = 0; i < ok; i++)
        cu.mem_free(blocks[i]);
    cu.ctx_destroy(ctx);
    fflush(stdout);
    return rc == CUDA_ERROR_OUT_OF_MEMORY ? 0 : 1;
}
