/* Device memory: host memory mapped lazily (MAP_NORESERVE, so only what copies touch is ever
 * backed), charged against the GPU's size in the shared state, recorded in a sorted address map.
 * Below the contexts (which free theirs) and the entry points that allocate (alloc.c, pool.c, vmm.c). */
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

int fg_addr_known(CUdeviceptr ptr, CUdeviceptr *base, size_t *size)
{
    pthread_mutex_lock(&g_regions_lock);
    long at = find_floor(ptr);
    int ok = at >= 0 && ptr < g_regions[at].base + g_regions[at].size;
    if (ok) {
        if (base)
            *base = g_regions[at].base;
        if (size)
            *size = g_regions[at].size;
    }
    pthread_mutex_unlock(&g_regions_lock);
    return ok;
}
