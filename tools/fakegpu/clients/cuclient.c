/* cuclient: a CUDA driver-API client for tests, reaching the driver by a chosen path and printing one
 * parseable line per step ("<step> key=value ...").
 *
 *   cuclient [--path linked|dlopen|procaddr|procaddr-ptds] [--device N] [--ctx primary|create] STEP...
 *
 * Paths: linked (calls the symbols it was linked with, -lcuda), dlopen (dlopen("libcuda.so.1") and
 * dlsym of each ABI name), procaddr (dlsym of cuGetProcAddress_v2 only, then every API through it at
 * the version of the signature the client uses, as cuda-bindings does), procaddr-ptds (the same,
 * asking for per-thread default stream variants).
 *
 * Steps:
 *   info                          device name, total (cuDeviceTotalMem), free/total (cuMemGetInfo)
 *   alloc KIND SIZE COUNT         COUNT allocations of SIZE bytes (k/m/g suffixes); one line each.
 *                                 KIND: mem pitch managed async pool vmm array array3d mipmap mem32
 *   free [INDEX]                  frees the INDEX-th live allocation (default: the last)
 *   free-all
 *   launch NAME GRID COUNT        COUNT launches of kernel NAME (see docs/fakegpu.md) with GRID blocks
 *   launch-ex NAME GRID COUNT     the same through cuLaunchKernelEx
 *   launch-coop NAME GRID COUNT   the same through cuLaunchCooperativeKernel
 *   graph NAME GRID COUNT         a graph of COUNT kernels, instantiated and launched once
 *   capture NAME GRID COUNT       the same graph recorded by stream capture
 *   sync                          cuCtxSynchronize; prints the wall time it took and when it ended
 *                                 (CLOCK_MONOTONIC us; launch steps print when they started)
 *   events NAME GRID COUNT        launches between two events; prints cuEventElapsedTime and the
 *                                 CLOCK_MONOTONIC wall times (us) around it
 *   wait                          prints "wait ready" and reads one line from stdin (a start barrier)
 *   stress THREADS ITERS MAXSIZE  threads allocating/freeing random sizes; prints counts
 *   forks COUNT                   forks COUNT children while two threads allocate and free; each
 *                                 child allocates once; prints how many finished in time
 *   sleep MS
 *   hold                          prints "hold ready" and waits until stdin closes
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

/* name (as cuGetProcAddress knows it), ABI symbol, pointer type */
#define API_LIST(X)                                                                                          \
    X(cuInit, cuInit, PFN_cuInit_v2000, 2000)                                                                      \
    X(cuGetErrorName, cuGetErrorName, PFN_cuGetErrorName_v6000, 6000)                                              \
    X(cuDeviceGet, cuDeviceGet, PFN_cuDeviceGet_v2000, 2000)                                                       \
    X(cuDeviceGetName, cuDeviceGetName, PFN_cuDeviceGetName_v2000, 2000)                                           \
    X(cuDeviceTotalMem, cuDeviceTotalMem_v2, PFN_cuDeviceTotalMem_v3020, 3020)                                     \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain_v7000, 7000)                \
    X(cuCtxCreate, cuCtxCreate_v4, PFN_cuCtxCreate_v12050, 12050)                                                   \
    X(cuCtxSetCurrent, cuCtxSetCurrent, PFN_cuCtxSetCurrent_v4000, 4000)                                           \
    X(cuCtxSynchronize, cuCtxSynchronize, PFN_cuCtxSynchronize_v2000, 2000)                                        \
    X(cuMemGetInfo, cuMemGetInfo_v2, PFN_cuMemGetInfo_v3020, 3020)                                                 \
    X(cuMemAlloc, cuMemAlloc_v2, PFN_cuMemAlloc_v3020, 3020)                                                       \
    X(cuMemAllocPitch, cuMemAllocPitch_v2, PFN_cuMemAllocPitch_v3020, 3020)                                        \
    X(cuMemAllocManaged, cuMemAllocManaged, PFN_cuMemAllocManaged_v6000, 6000)                                     \
    X(cuMemFree, cuMemFree_v2, PFN_cuMemFree_v3020, 3020)                                                          \
    X(cuMemAllocAsync, cuMemAllocAsync, PFN_cuMemAllocAsync_v11020, 11020)                                          \
    X(cuMemFreeAsync, cuMemFreeAsync, PFN_cuMemFreeAsync_v11020, 11020)                                             \
    X(cuMemPoolCreate, cuMemPoolCreate, PFN_cuMemPoolCreate_v11020, 11020)                                          \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, PFN_cuMemAllocFromPoolAsync_v11020, 11020)                  \
    X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity, PFN_cuMemGetAllocationGranularity_v10020, 10020) \
    X(cuMemCreate, cuMemCreate, PFN_cuMemCreate_v10020, 10020)                                                      \
    X(cuMemRelease, cuMemRelease, PFN_cuMemRelease_v10020, 10020)                                                   \
    X(cuMemAddressReserve, cuMemAddressReserve, PFN_cuMemAddressReserve_v10020, 10020)                              \
    X(cuMemAddressFree, cuMemAddressFree, PFN_cuMemAddressFree_v10020, 10020)                                       \
    X(cuMemMap, cuMemMap, PFN_cuMemMap_v10020, 10020)                                                               \
    X(cuMemUnmap, cuMemUnmap, PFN_cuMemUnmap_v10020, 10020)                                                         \
    X(cuMemSetAccess, cuMemSetAccess, PFN_cuMemSetAccess_v10020, 10020)                                             \
    X(cuArrayCreate, cuArrayCreate_v2, PFN_cuArrayCreate_v3020, 3020)                                              \
    X(cuArray3DCreate, cuArray3DCreate_v2, PFN_cuArray3DCreate_v3020, 3020)                                        \
    X(cuArrayDestroy, cuArrayDestroy, PFN_cuArrayDestroy_v2000, 2000)                                              \
    X(cuMipmappedArrayCreate, cuMipmappedArrayCreate, PFN_cuMipmappedArrayCreate_v5000, 5000)                      \
    X(cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, PFN_cuMipmappedArrayDestroy_v5000, 5000)                   \
    X(cuModuleLoadData, cuModuleLoadData, PFN_cuModuleLoadData_v2000, 2000)                                        \
    X(cuModuleGetFunction, cuModuleGetFunction, PFN_cuModuleGetFunction_v2000, 2000)                               \
    X(cuLaunchKernel, cuLaunchKernel, PFN_cuLaunchKernel_v4000, 4000)                                              \
    X(cuLaunchKernelEx, cuLaunchKernelEx, PFN_cuLaunchKernelEx_v11060, 11060)                                       \
    X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, PFN_cuLaunchCooperativeKernel_v9000, 9000)             \
    X(cuStreamCreate, cuStreamCreate, PFN_cuStreamCreate_v2000, 2000)                                              \
    X(cuStreamSynchronize, cuStreamSynchronize, PFN_cuStreamSynchronize_v2000, 2000)                               \
    X(cuStreamBeginCapture, cuStreamBeginCapture_v2, PFN_cuStreamBeginCapture_v10010, 10010)                        \
    X(cuStreamEndCapture, cuStreamEndCapture, PFN_cuStreamEndCapture_v10000, 10000)                                 \
    X(cuEventCreate, cuEventCreate, PFN_cuEventCreate_v2000, 2000)                                                 \
    X(cuEventRecord, cuEventRecord, PFN_cuEventRecord_v2000, 2000)                                                 \
    X(cuEventSynchronize, cuEventSynchronize, PFN_cuEventSynchronize_v2000, 2000)                                  \
    X(cuEventElapsedTime, cuEventElapsedTime_v2, PFN_cuEventElapsedTime_v12080, 12080)                              \
    X(cuGraphCreate, cuGraphCreate, PFN_cuGraphCreate_v10000, 10000)                                                \
    X(cuGraphAddKernelNode, cuGraphAddKernelNode_v2, PFN_cuGraphAddKernelNode_v12000, 12000)                        \
    X(cuGraphInstantiateWithFlags, cuGraphInstantiateWithFlags, PFN_cuGraphInstantiateWithFlags_v11040, 11040)      \
    X(cuGraphLaunch, cuGraphLaunch, PFN_cuGraphLaunch_v10000, 10000)                                                \
    X(cuGraphExecDestroy, cuGraphExecDestroy, PFN_cuGraphExecDestroy_v10000, 10000)                                 \
    X(cuGraphDestroy, cuGraphDestroy, PFN_cuGraphDestroy_v10000, 10000)

#define API_FIELD(name, abi, type, version) type name;
static struct {
    API_LIST(API_FIELD)
} api;

/* The pre-3.2 cuMemAlloc with 32-bit pointers (not declared by cuda.h outside the driver), asked
 * for at version 2000 on the procaddr paths or by its name "cuMemAlloc". */
typedef CUresult (*cuMemAlloc32_fn)(unsigned int *dptr, unsigned int bytesize);
static cuMemAlloc32_fn cuMemAlloc32;

enum alloc_kind { K_MEM, K_PITCH, K_MANAGED, K_ASYNC, K_POOL, K_VMM, K_ARRAY, K_ARRAY3D, K_MIPMAP, K_MEM32 };
static const char *kind_names[] = {"mem", "pitch", "managed", "async", "pool", "vmm", "array", "array3d", "mipmap", "mem32"};

struct allocation {
    enum alloc_kind kind;
    size_t size;
    CUdeviceptr ptr;
    CUmemGenericAllocationHandle vmm;
    CUarray array;
    CUmipmappedArray mipmap;
};

static struct allocation *allocs;
static size_t alloc_count, alloc_cap;
static CUdevice device;
static CUmemoryPool pool;

static const char *err_name(CUresult rc)
{
    const char *name = NULL;
    if (api.cuGetErrorName(rc, &name) != CUDA_SUCCESS || !name)
        return "UNKNOWN";
    return name;
}

static void die(const char *what, const char *detail)
{
    printf("error step=%s detail=%s\n", what, detail);
    exit(2);
}

static void check(const char *what, CUresult rc)
{
    if (rc != CUDA_SUCCESS)
        die(what, err_name(rc));
}

static int load_api(const char *path)
{
    if (strcmp(path, "linked") == 0) {
#define API_LINK(name, abi, type, version) api.name = (type)&abi;
        API_LIST(API_LINK)
        cuMemAlloc32 = (cuMemAlloc32_fn)dlsym(RTLD_DEFAULT, "cuMemAlloc");
        return 0;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        printf("error step=load detail=%s\n", dlerror());
        return -1;
    }
    if (strcmp(path, "dlopen") == 0) {
#define API_DLSYM(name, abi, type, version)                                                                         \
    if (!(api.name = (type)dlsym(lib, #abi))) {                                                              \
        printf("error step=load detail=missing-%s\n", #abi);                                                 \
        return -1;                                                                                           \
    }
        API_LIST(API_DLSYM)
        cuMemAlloc32 = (cuMemAlloc32_fn)dlsym(lib, "cuMemAlloc");
        return 0;
    }
    cuuint64_t flags;
    if (strcmp(path, "procaddr") == 0)
        flags = CU_GET_PROC_ADDRESS_DEFAULT;
    else if (strcmp(path, "procaddr-ptds") == 0)
        flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    else {
        printf("error step=load detail=unknown-path-%s\n", path);
        return -1;
    }
    PFN_cuGetProcAddress_v12000 gpa = (PFN_cuGetProcAddress_v12000)dlsym(lib, "cuGetProcAddress_v2");
    if (!gpa) {
        printf("error step=load detail=missing-cuGetProcAddress_v2\n");
        return -1;
    }
    CUdriverProcAddressQueryResult status;
#define API_PROC(name, abi, type, version)                                                                          \
    if (gpa(#name, (void **)&api.name, version, flags, &status) != CUDA_SUCCESS) {                                 \
        printf("error step=load detail=cuGetProcAddress-%s-status-%d\n", #name, (int)status);                \
        return -1;                                                                                           \
    }
    API_LIST(API_PROC)
    gpa("cuMemAlloc", (void **)&cuMemAlloc32, 2000, flags, &status);
    return 0;
}

static size_t parse_size(const char *text)
{
    char *end;
    unsigned long long v = strtoull(text, &end, 10);
    switch (*end) {
    case 'k': case 'K': v <<= 10; break;
    case 'm': case 'M': v <<= 20; break;
    case 'g': case 'G': v <<= 30; break;
    case '\0': break;
    default: die("parse", text);
    }
    return (size_t)v;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static CUresult alloc_vmm(struct allocation *a)
{
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device}};
    size_t gran;
    CUresult rc = api.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t size = (a->size + gran - 1) / gran * gran;
    a->size = size;
    if ((rc = api.cuMemCreate(&a->vmm, size, &prop, 0)) != CUDA_SUCCESS)
        return rc;
    if ((rc = api.cuMemAddressReserve(&a->ptr, size, 0, 0, 0)) != CUDA_SUCCESS) {
        api.cuMemRelease(a->vmm);
        return rc;
    }
    CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if ((rc = api.cuMemMap(a->ptr, size, 0, a->vmm, 0)) != CUDA_SUCCESS ||
        (rc = api.cuMemSetAccess(a->ptr, size, &access, 1)) != CUDA_SUCCESS) {
        api.cuMemAddressFree(a->ptr, size);
        api.cuMemRelease(a->vmm);
    }
    return rc;
}

static CUresult do_alloc(struct allocation *a)
{
    size_t pitch;
    switch (a->kind) {
    case K_MEM:
        return api.cuMemAlloc(&a->ptr, a->size);
    case K_PITCH:
        return api.cuMemAllocPitch(&a->ptr, &pitch, a->size, 1, 4);
    case K_MANAGED:
        return api.cuMemAllocManaged(&a->ptr, a->size, CU_MEM_ATTACH_GLOBAL);
    case K_ASYNC:
        return api.cuMemAllocAsync(&a->ptr, a->size, NULL);
    case K_POOL:
        if (!pool) {
            CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device}};
            check("pool", api.cuMemPoolCreate(&pool, &props));
        }
        return api.cuMemAllocFromPoolAsync(&a->ptr, a->size, pool, NULL);
    case K_VMM:
        return alloc_vmm(a);
    case K_ARRAY: {
        CUDA_ARRAY_DESCRIPTOR d = {.Width = a->size, .Height = 1, .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 1};
        return api.cuArrayCreate(&a->array, &d);
    }
    case K_ARRAY3D: {
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = a->size, .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 1};
        return api.cuArray3DCreate(&a->array, &d);
    }
    case K_MIPMAP: {
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = a->size, .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 1};
        return api.cuMipmappedArrayCreate(&a->mipmap, &d, 1);
    }
    case K_MEM32: {
        unsigned int p = 0;
        if (!cuMemAlloc32)
            return CUDA_ERROR_NOT_FOUND;
        CUresult rc = cuMemAlloc32(&p, (unsigned)a->size);
        a->ptr = p;
        return rc;
    }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult do_free(struct allocation *a)
{
    switch (a->kind) {
    case K_ASYNC:
    case K_POOL:
        return api.cuMemFreeAsync(a->ptr, NULL);
    case K_VMM: {
        CUresult rc = api.cuMemUnmap(a->ptr, a->size);
        if (rc == CUDA_SUCCESS)
            rc = api.cuMemAddressFree(a->ptr, a->size);
        return rc == CUDA_SUCCESS ? api.cuMemRelease(a->vmm) : rc;
    }
    case K_ARRAY:
    case K_ARRAY3D:
        return api.cuArrayDestroy(a->array);
    case K_MIPMAP:
        return api.cuMipmappedArrayDestroy(a->mipmap);
    default:
        return api.cuMemFree(a->ptr);
    }
}

static enum alloc_kind parse_kind(const char *text)
{
    for (size_t i = 0; i < sizeof kind_names / sizeof kind_names[0]; i++)
        if (strcmp(text, kind_names[i]) == 0)
            return (enum alloc_kind)i;
    die("alloc", text);
    return K_MEM;
}

static void step_alloc(enum alloc_kind kind, size_t size, int count)
{
    for (int i = 0; i < count; i++) {
        struct allocation a = {.kind = kind, .size = size};
        CUresult rc = do_alloc(&a);
        printf("alloc kind=%s size=%zu index=%d result=%s\n", kind_names[kind], size, i, err_name(rc));
        if (rc != CUDA_SUCCESS)
            continue;
        if (alloc_count == alloc_cap) {
            alloc_cap = alloc_cap ? alloc_cap * 2 : 64;
            allocs = realloc(allocs, alloc_cap * sizeof *allocs);
            if (!allocs)
                die("alloc", "host-out-of-memory");
        }
        allocs[alloc_count++] = a;
    }
}

static void step_free(size_t index)
{
    if (index >= alloc_count)
        die("free", "no-such-allocation");
    CUresult rc = do_free(&allocs[index]);
    printf("free kind=%s index=%zu result=%s\n", kind_names[allocs[index].kind], index, err_name(rc));
    memmove(&allocs[index], &allocs[index + 1], (alloc_count - index - 1) * sizeof *allocs);
    alloc_count--;
}

static CUfunction get_function(const char *name)
{
    static CUmodule module;
    static const char image[] = "fakegpu test module";
    CUfunction f;
    if (!module)
        check("module", api.cuModuleLoadData(&module, image));
    check("function", api.cuModuleGetFunction(&f, module, name));
    return f;
}

enum launch_api { VIA_LAUNCH, VIA_EX, VIA_COOP };

static CUresult launch_one(enum launch_api via, CUfunction f, unsigned grid, CUstream s)
{
    if (via == VIA_EX) {
        CUlaunchConfig cfg = {.gridDimX = grid, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 128,
                              .blockDimY = 1, .blockDimZ = 1, .hStream = s};
        return api.cuLaunchKernelEx(&cfg, f, NULL, NULL);
    }
    if (via == VIA_COOP)
        return api.cuLaunchCooperativeKernel(f, grid, 1, 1, 128, 1, 1, 0, s, NULL);
    return api.cuLaunchKernel(f, grid, 1, 1, 128, 1, 1, 0, s, NULL, NULL);
}

static void step_launch(const char *step, enum launch_api via, const char *name, unsigned grid, int count)
{
    CUfunction f = get_function(name);
    double start = now_us();
    CUresult rc = CUDA_SUCCESS;
    int done = 0;
    for (; done < count && rc == CUDA_SUCCESS; done++)
        rc = launch_one(via, f, grid, NULL);
    printf("%s name=%s grid=%u count=%d result=%s submit_us=%.0f wall_start_us=%.0f\n", step, name, grid, done,
           err_name(rc), now_us() - start, start);
}

static void step_graph(int capture, const char *name, unsigned grid, int count)
{
    CUfunction f = get_function(name);
    CUgraph graph;
    CUstream stream;
    check("stream", api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    if (capture) {
        check("capture", api.cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
        for (int i = 0; i < count; i++)
            check("capture-launch", launch_one(VIA_LAUNCH, f, grid, stream));
        check("capture-end", api.cuStreamEndCapture(stream, &graph));
    } else {
        check("graph", api.cuGraphCreate(&graph, 0));
        CUgraphNode prev = NULL;
        for (int i = 0; i < count; i++) {
            CUDA_KERNEL_NODE_PARAMS p = {.func = f, .gridDimX = grid, .gridDimY = 1, .gridDimZ = 1,
                                         .blockDimX = 128, .blockDimY = 1, .blockDimZ = 1};
            CUgraphNode node;
            check("graph-node", api.cuGraphAddKernelNode(&node, graph, prev ? &prev : NULL, prev ? 1 : 0, &p));
            prev = node;
        }
    }
    CUgraphExec exec;
    check("instantiate", api.cuGraphInstantiateWithFlags(&exec, graph, 0));
    double start = now_us();
    CUresult rc = api.cuGraphLaunch(exec, stream);
    if (rc == CUDA_SUCCESS)
        rc = api.cuStreamSynchronize(stream);
    printf("%s name=%s grid=%u count=%d result=%s elapsed_us=%.0f\n", capture ? "capture" : "graph", name, grid,
           count, err_name(rc), now_us() - start);
    api.cuGraphExecDestroy(exec);
    api.cuGraphDestroy(graph);
}

static void step_events(const char *name, unsigned grid, int count)
{
    CUfunction f = get_function(name);
    CUevent start, stop;
    check("event", api.cuEventCreate(&start, 0));
    check("event", api.cuEventCreate(&stop, 0));
    double wall_start = now_us();
    check("record", api.cuEventRecord(start, NULL));
    for (int i = 0; i < count; i++)
        check("launch", launch_one(VIA_LAUNCH, f, grid, NULL));
    check("record", api.cuEventRecord(stop, NULL));
    check("event-sync", api.cuEventSynchronize(stop));
    double wall_end = now_us();
    float ms = 0;
    CUresult rc = api.cuEventElapsedTime(&ms, start, stop);
    printf("events name=%s count=%d result=%s elapsed_ms=%.3f wall_start_us=%.0f wall_end_us=%.0f\n", name, count,
           err_name(rc), ms, wall_start, wall_end);
}

struct stress_args {
    int iters;
    size_t max_size;
    unsigned seed;
    long ok, oom, other;
};

static void *stress_thread(void *arg)
{
    struct stress_args *s = arg;
    CUdeviceptr held[64];
    int n = 0;
    CUcontext ctx;
    check("stress-ctx", api.cuDevicePrimaryCtxRetain(&ctx, device));
    check("stress-ctx", api.cuCtxSetCurrent(ctx));
    for (int i = 0; i < s->iters; i++) {
        if (n > 0 && (n == 64 || rand_r(&s->seed) % 2)) {
            int k = (int)(rand_r(&s->seed) % (unsigned)n);
            if (api.cuMemFree(held[k]) != CUDA_SUCCESS)
                s->other++;
            held[k] = held[--n];
            continue;
        }
        size_t size = 1 + (size_t)rand_r(&s->seed) % s->max_size;
        CUresult rc = api.cuMemAlloc(&held[n], size);
        if (rc == CUDA_SUCCESS) {
            s->ok++;
            n++;
        } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            s->oom++;
        } else {
            s->other++;
        }
    }
    while (n > 0)
        api.cuMemFree(held[--n]);
    return NULL;
}

static volatile int churning;

static void *churn_thread(void *arg)
{
    CUcontext ctx = arg;
    CUdeviceptr p;
    api.cuCtxSetCurrent(ctx);
    while (__atomic_load_n(&churning, __ATOMIC_RELAXED))
        if (api.cuMemAlloc(&p, 4096) == CUDA_SUCCESS)
            api.cuMemFree(p);
    return NULL;
}

/* Forks COUNT children while two threads allocate and free; each child allocates and frees once
 * and must finish within 10 s (a lock inherited held would hang it). */
static void step_forks(CUcontext ctx, int count)
{
    pthread_t tids[2];
    __atomic_store_n(&churning, 1, __ATOMIC_RELAXED);
    for (int t = 0; t < 2; t++)
        pthread_create(&tids[t], NULL, churn_thread, ctx);
    int ok = 0;
    for (int i = 0; i < count; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            alarm(10);
            CUdeviceptr p;
            CUresult rc = api.cuMemAlloc(&p, 4096);
            if (rc == CUDA_SUCCESS)
                rc = api.cuMemFree(p);
            _exit(rc == CUDA_SUCCESS ? 0 : 1);
        }
        int status = 0;
        if (pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0)
            ok++;
    }
    __atomic_store_n(&churning, 0, __ATOMIC_RELAXED);
    for (int t = 0; t < 2; t++)
        pthread_join(tids[t], NULL);
    printf("forks count=%d ok=%d\n", count, ok);
}

static void step_stress(int threads, int iters, size_t max_size)
{
    pthread_t tids[64];
    struct stress_args args[64];
    if (threads < 1 || threads > 64)
        die("stress", "threads-1-to-64");
    for (int t = 0; t < threads; t++) {
        args[t] = (struct stress_args){.iters = iters, .max_size = max_size, .seed = (unsigned)(getpid() * 31 + t)};
        pthread_create(&tids[t], NULL, stress_thread, &args[t]);
    }
    long ok = 0, oom = 0, other = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tids[t], NULL);
        ok += args[t].ok;
        oom += args[t].oom;
        other += args[t].other;
    }
    printf("stress threads=%d iters=%d ok=%ld oom=%ld other=%ld\n", threads, iters, ok, oom, other);
}

static const char *need(int argc, char **argv, int i)
{
    if (i >= argc)
        die("args", "missing-argument");
    return argv[i];
}

int main(int argc, char **argv)
{
    const char *path = "linked", *ctx_mode = "primary";
    int ordinal = 0, i = 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
        const char *value = need(argc, argv, i + 1);
        if (strcmp(argv[i], "--path") == 0)
            path = value;
        else if (strcmp(argv[i], "--device") == 0)
            ordinal = atoi(value);
        else if (strcmp(argv[i], "--ctx") == 0)
            ctx_mode = value;
        else
            die("args", argv[i]);
    }
    if (load_api(path) != 0)
        return 2;
    CUresult rc = api.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        printf("init result=%s\n", err_name(rc));
        return 1;
    }
    check("device", api.cuDeviceGet(&device, ordinal));
    CUcontext ctx;
    if (strcmp(ctx_mode, "create") == 0) {
        check("ctx", api.cuCtxCreate(&ctx, NULL, 0, device));
    } else {
        check("ctx", api.cuDevicePrimaryCtxRetain(&ctx, device));
        check("ctx", api.cuCtxSetCurrent(ctx));
    }
    while (i < argc) {
        const char *step = argv[i++];
        if (strcmp(step, "info") == 0) {
            char name[128];
            size_t total_dev, free_mem, total_mem;
            check("info", api.cuDeviceGetName(name, sizeof name, device));
            check("info", api.cuDeviceTotalMem(&total_dev, device));
            check("info", api.cuMemGetInfo(&free_mem, &total_mem));
            for (char *p = name; *p; p++)
                if (*p == ' ')
                    *p = '_';
            printf("info device=%d name=%s device_total=%zu free=%zu total=%zu\n", ordinal, name, total_dev,
                   free_mem, total_mem);
        } else if (strcmp(step, "alloc") == 0) {
            step_alloc(parse_kind(need(argc, argv, i)), parse_size(need(argc, argv, i + 1)),
                       atoi(need(argc, argv, i + 2)));
            i += 3;
        } else if (strcmp(step, "free") == 0) {
            size_t index = alloc_count ? alloc_count - 1 : 0;
            if (i < argc && argv[i][0] >= '0' && argv[i][0] <= '9')
                index = (size_t)atoi(argv[i++]);
            step_free(index);
        } else if (strcmp(step, "free-all") == 0) {
            while (alloc_count > 0)
                step_free(alloc_count - 1);
        } else if (strcmp(step, "launch") == 0 || strcmp(step, "launch-ex") == 0 ||
                   strcmp(step, "launch-coop") == 0) {
            enum launch_api via = step[6] == '\0' ? VIA_LAUNCH : step[7] == 'e' ? VIA_EX : VIA_COOP;
            step_launch(step, via, need(argc, argv, i), (unsigned)atoi(need(argc, argv, i + 1)),
                        atoi(need(argc, argv, i + 2)));
            i += 3;
        } else if (strcmp(step, "graph") == 0 || strcmp(step, "capture") == 0) {
            step_graph(step[0] == 'c', need(argc, argv, i), (unsigned)atoi(need(argc, argv, i + 1)),
                       atoi(need(argc, argv, i + 2)));
            i += 3;
        } else if (strcmp(step, "events") == 0) {
            step_events(need(argc, argv, i), (unsigned)atoi(need(argc, argv, i + 1)), atoi(need(argc, argv, i + 2)));
            i += 3;
        } else if (strcmp(step, "sync") == 0) {
            double start = now_us();
            rc = api.cuCtxSynchronize();
            double end = now_us();
            printf("sync result=%s elapsed_us=%.0f wall_end_us=%.0f\n", err_name(rc), end - start, end);
        } else if (strcmp(step, "stress") == 0) {
            step_stress(atoi(need(argc, argv, i)), atoi(need(argc, argv, i + 1)), parse_size(need(argc, argv, i + 2)));
            i += 3;
        } else if (strcmp(step, "forks") == 0) {
            step_forks(ctx, atoi(need(argc, argv, i++)));
        } else if (strcmp(step, "sleep") == 0) {
            usleep((useconds_t)atoi(need(argc, argv, i++)) * 1000);
        } else if (strcmp(step, "wait") == 0) {
            printf("wait ready\n");
            char line[64];
            if (!fgets(line, sizeof line, stdin))
                die("wait", "stdin-closed");
        } else if (strcmp(step, "hold") == 0) {
            printf("hold ready\n");
            char buf[64];
            while (fread(buf, 1, sizeof buf, stdin) > 0) {
            }
        } else {
            die("args", step);
        }
    }
    return 0;
}
