/* Device memory: host memory mapped lazily (MAP_NORESERVE, so only what copies touch is ever
 * backed), charged against the GPU's size in the shared state, recorded in a sorted address map. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"

struct fg_region {
    CUdeviceptr base;
    size_t size;
    size_t charged; /* device bytes charged for it (0 for host memory and mappings) */
    CUdevice dev;
    CUcontext ctx;
    CUmemoryPool pool;
    enum fg_alloc_kind kind;
    int backed; /* 0 if only address space could be reserved: copies into it are refused */
};

static struct fg_region *g_regions;
static size_t g_region_count, g_region_cap;
static pthread_mutex_t g_regions_lock = PTHREAD_MUTEX_INITIALIZER;

void fg_memory_fork_lock(int lock)
{
    if (lock)
        pthread_mutex_lock(&g_regions_lock);
    else
        pthread_mutex_unlock(&g_regions_lock);
}

CUresult fg_charge(CUdevice dev, size_t bytes)
{
    return fg_mem_charge(fg_devices[dev].shared, bytes) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

void fg_uncharge(CUdevice dev, size_t bytes)
{
    fg_mem_uncharge(fg_devices[dev].shared, bytes);
}

/* Index of the last region with base <= ptr, or -1. Caller holds g_regions_lock. */
static long find_floor(CUdeviceptr ptr)
{
    long lo = 0, hi = (long)g_region_count - 1, found = -1;
    while (lo <= hi) {
        long mid = (lo + hi) / 2;
        if (g_regions[mid].base <= ptr) {
            found = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return found;
}

static int insert_region(const struct fg_region *r)
{
    if (g_region_count == g_region_cap) {
        size_t cap = g_region_cap ? g_region_cap * 2 : 256;
        struct fg_region *grown = realloc(g_regions, cap * sizeof *grown);
        if (!grown)
            return -1;
        g_regions = grown;
        g_region_cap = cap;
    }
    size_t at = (size_t)(find_floor(r->base) + 1);
    memmove(&g_regions[at + 1], &g_regions[at], (g_region_count - at) * sizeof *g_regions);
    g_regions[at] = *r;
    g_region_count++;
    return 0;
}

static void remove_region(size_t at)
{
    memmove(&g_regions[at], &g_regions[at + 1], (g_region_count - at - 1) * sizeof *g_regions);
    g_region_count--;
}

static void release_region(const struct fg_region *r)
{
    munmap((void *)(uintptr_t)r->base, r->size);
    if (r->charged)
        fg_uncharge(r->dev, r->charged);
}

CUresult fg_alloc(CUdevice dev, CUcontext ctx, CUmemoryPool pool, size_t size, enum fg_alloc_kind kind,
                  int low32, CUdeviceptr *out)
{
    if (!out || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int charge = kind != FG_ALLOC_HOST;
    if (charge && fg_charge(dev, size) != CUDA_SUCCESS)
        return CUDA_ERROR_OUT_OF_MEMORY;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (low32 ? MAP_32BIT : 0);
    int backed = 1;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED && !low32) {
        backed = 0; /* the host cannot back it (strict overcommit): keep the address space only */
        p = mmap(NULL, size, PROT_NONE, flags, -1, 0);
    }
    if (p == MAP_FAILED) {
        if (charge)
            fg_uncharge(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fg_region r = {.base = (CUdeviceptr)(uintptr_t)p,
                          .size = size,
                          .charged = charge ? size : 0,
                          .dev = dev,
                          .ctx = ctx,
                          .pool = pool,
                          .kind = kind,
                          .backed = backed};
    pthread_mutex_lock(&g_regions_lock);
    int ok = insert_region(&r) == 0;
    pthread_mutex_unlock(&g_regions_lock);
    if (!ok) {
        release_region(&r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = r.base;
    return CUDA_SUCCESS;
}

CUresult fg_free(CUdeviceptr ptr, unsigned kinds)
{
    struct fg_region r;
    pthread_mutex_lock(&g_regions_lock);
    long at = find_floor(ptr);
    int found = at >= 0 && g_regions[at].base == ptr && (kinds & (1u << g_regions[at].kind));
    if (found) {
        r = g_regions[at];
        remove_region((size_t)at);
    }
    pthread_mutex_unlock(&g_regions_lock);
    if (!found)
        return CUDA_ERROR_INVALID_VALUE;
    release_region(&r);
    return CUDA_SUCCESS;
}

void fg_free_ctx_allocations(CUcontext ctx)
{
    pthread_mutex_lock(&g_regions_lock);
    size_t keep = 0;
    for (size_t i = 0; i < g_region_count; i++) {
        if (g_regions[i].ctx == ctx && g_regions[i].kind != FG_ALLOC_MAPPING)
            release_region(&g_regions[i]);
        else
            g_regions[keep++] = g_regions[i];
    }
    g_region_count = keep;
    pthread_mutex_unlock(&g_regions_lock);
}

size_t fg_pool_used(CUmemoryPool pool)
{
    size_t used = 0;
    pthread_mutex_lock(&g_regions_lock);
    for (size_t i = 0; i < g_region_count; i++)
        if (g_regions[i].kind == FG_ALLOC_POOL && g_regions[i].pool == pool)
            used += g_regions[i].size;
    pthread_mutex_unlock(&g_regions_lock);
    return used;
}

CUresult fg_map_add(CUdeviceptr base, size_t size, CUdevice dev)
{
    struct fg_region r = {.base = base, .size = size, .dev = dev, .kind = FG_ALLOC_MAPPING, .backed = 1};
    pthread_mutex_lock(&g_regions_lock);
    int ok = insert_region(&r) == 0;
    pthread_mutex_unlock(&g_regions_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

void fg_map_remove(CUdeviceptr base, size_t size)
{
    pthread_mutex_lock(&g_regions_lock);
    size_t keep = 0;
    for (size_t i = 0; i < g_region_count; i++) {
        const struct fg_region *r = &g_regions[i];
        int inside = r->kind == FG_ALLOC_MAPPING && r->base >= base && r->base + r->size <= base + size;
        if (!inside)
            g_regions[keep++] = *r;
    }
    g_region_count = keep;
    pthread_mutex_unlock(&g_regions_lock);
}

int fg_addr_valid(CUdeviceptr ptr, size_t len)
{
    pthread_mutex_lock(&g_regions_lock);
    long at = find_floor(ptr);
    int ok = at >= 0 && g_regions[at].backed && ptr + len >= ptr &&
             ptr + len <= g_regions[at].base + g_regions[at].size;
    pthread_mutex_unlock(&g_regions_lock);
    return ok;
}

int fg_addr_known(CUdeviceptr ptr)
{
    pthread_mutex_lock(&g_regions_lock);
    long at = find_floor(ptr);
    int ok = at >= 0 && ptr < g_regions[at].base + g_regions[at].size;
    pthread_mutex_unlock(&g_regions_lock);
    return ok;
}

static CUresult alloc_in_current(size_t size, enum fg_alloc_kind kind, int low32, CUdeviceptr *out)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    return fg_alloc(ctx->dev, ctx, NULL, size, kind, low32, out);
}

FG_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    return alloc_in_current(bytesize, FG_ALLOC_DEVICE, 0, dptr);
}

/* The pre-3.2 ABI with 32-bit device pointers: the memory is mapped below 2 GiB. */
FG_API CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    CUdeviceptr p;
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_in_current(bytesize, FG_ALLOC_DEVICE, 1, &p);
    if (rc == CUDA_SUCCESS)
        *dptr = (CUdeviceptr_v1)p;
    return rc;
}

static CUresult pitch_of(size_t width, size_t height, unsigned elem, size_t *pitch)
{
    if (width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    *pitch = (width + 511) & ~(size_t)511;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                   unsigned int ElementSizeBytes)
{
    size_t pitch;
    if (!pPitch)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = pitch_of(WidthInBytes, Height, ElementSizeBytes, &pitch);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = alloc_in_current(pitch * Height, FG_ALLOC_DEVICE, 0, dptr);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch;
    return rc;
}

FG_API CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                unsigned int Height, unsigned int ElementSizeBytes)
{
    size_t pitch;
    CUdeviceptr p;
    if (!pPitch || !dptr)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = pitch_of(WidthInBytes, Height, ElementSizeBytes, &pitch);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = alloc_in_current(pitch * Height, FG_ALLOC_DEVICE, 1, &p);
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)p;
        *pPitch = (unsigned)pitch;
    }
    return rc;
}

FG_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    return alloc_in_current(bytesize, FG_ALLOC_MANAGED, 0, dptr);
}

#define FG_KINDS_FREE ((1u << FG_ALLOC_DEVICE) | (1u << FG_ALLOC_MANAGED) | (1u << FG_ALLOC_POOL))

FG_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr == 0)
        return CUDA_SUCCESS;
    return fg_free(dptr, FG_KINDS_FREE);
}

FG_API CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    return cuMemFree_v2(dptr);
}

FG_API CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!free || !total)
        return CUDA_ERROR_INVALID_VALUE;
    size_t size = fg_spec(ctx->dev)->memory_bytes;
    size_t used = fg_mem_used(fg_devices[ctx->dev].shared);
    *total = size;
    *free = used < size ? size - used : 0;
    return CUDA_SUCCESS;
}

static unsigned clamp32(size_t v)
{
    return v > 0xffffffffu ? 0xffffffffu : (unsigned)v;
}

FG_API CUresult cuMemGetInfo(unsigned int *free, unsigned int *total)
{
    size_t f, t;
    if (!free || !total)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) {
        *free = clamp32(f);
        *total = clamp32(t);
    }
    return rc;
}

FG_API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t b;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuDeviceTotalMem_v2(&b, dev);
    if (rc == CUDA_SUCCESS)
        *bytes = clamp32(b);
    return rc;
}

FG_API CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_regions_lock);
    long at = find_floor(dptr);
    int ok = at >= 0 && dptr < g_regions[at].base + g_regions[at].size;
    if (ok) {
        if (pbase)
            *pbase = g_regions[at].base;
        if (psize)
            *psize = g_regions[at].size;
    }
    pthread_mutex_unlock(&g_regions_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

/* Page-locked host memory: not device memory, but addressable by copies like an allocation. */
FG_API CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    struct CUctx_st *ctx;
    CUdeviceptr p;
    (void)Flags;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pp)
        return CUDA_ERROR_INVALID_VALUE;
    rc = fg_alloc(ctx->dev, ctx, NULL, bytesize, FG_ALLOC_HOST, 0, &p);
    if (rc == CUDA_SUCCESS)
        *pp = (void *)(uintptr_t)p;
    return rc;
}

FG_API CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return cuMemHostAlloc(pp, bytesize, 0);
}

FG_API CUresult cuMemFreeHost(void *p)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    return fg_free((CUdeviceptr)(uintptr_t)p, 1u << FG_ALLOC_HOST);
}

FG_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pdptr || Flags != 0 || !fg_addr_known((CUdeviceptr)(uintptr_t)p))
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}
