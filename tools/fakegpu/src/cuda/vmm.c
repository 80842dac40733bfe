/* Virtual memory management: cuMemCreate makes a physical allocation (a memfd, charged to the
 * device), cuMemAddressReserve reserves address space, cuMemMap maps the memfd into it, so two
 * mappings of one allocation alias as on a real GPU. Memory returns when the handle is released and
 * its last mapping is gone. */
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

#define FG_VMM_GRANULARITY (2ULL << 20)

struct fg_vmm_alloc {
    uint32_t magic;
    int fd;
    CUdevice dev;
    size_t size;
    int released;
    int mappings;
};

struct fg_span {
    CUdeviceptr base;
    size_t size;
    struct fg_vmm_alloc *alloc; /* for mappings */
};

static struct fg_span g_reserved[1024], g_mapped[4096];
static int g_reserved_count, g_mapped_count;
static pthread_mutex_t g_vmm_lock = PTHREAD_MUTEX_INITIALIZER;

void fg_vmm_fork_lock(int lock)
{
    if (lock)
        pthread_mutex_lock(&g_vmm_lock);
    else
        pthread_mutex_unlock(&g_vmm_lock);
}

static CUresult check_prop(const CUmemAllocationProp *prop)
{
    struct fg_device *d;
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_get_device(prop->location.id, &d);
    return rc == CUDA_ERROR_INVALID_DEVICE ? CUDA_ERROR_INVALID_VALUE : rc;
}

FG_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                              CUmemAllocationGranularity_flags option)
{
    CUresult rc = check_prop(prop);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!granularity || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = FG_VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

/* Gives back the allocation once it is released and unmapped. Caller holds g_vmm_lock. */
static void maybe_destroy(struct fg_vmm_alloc *a)
{
    if (!a->released || a->mappings > 0)
        return;
    fg_uncharge(a->dev, a->size);
    close(a->fd);
    a->magic = 0;
    free(a);
}

FG_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags)
{
    CUresult rc = check_prop(prop);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!handle || size == 0 || size % FG_VMM_GRANULARITY || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_vmm_alloc *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    rc = fg_charge(prop->location.id, size);
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    a->fd = memfd_create("fakegpu-vmm", MFD_CLOEXEC);
    if (a->fd < 0 || ftruncate(a->fd, (off_t)size) != 0) {
        if (a->fd >= 0)
            close(a->fd);
        fg_uncharge(prop->location.id, size);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->magic = FG_MAGIC_VMM;
    a->dev = prop->location.id;
    a->size = size;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
    return CUDA_SUCCESS;
}

static struct fg_vmm_alloc *alloc_of(CUmemGenericAllocationHandle handle)
{
    struct fg_vmm_alloc *a = (struct fg_vmm_alloc *)(uintptr_t)handle;
    return a && a->magic == FG_MAGIC_VMM && !a->released ? a : NULL;
}

FG_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_vmm_lock);
    struct fg_vmm_alloc *a = alloc_of(handle);
    if (a) {
        a->released = 1;
        maybe_destroy(a);
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!ptr || size == 0 || size % FG_VMM_GRANULARITY || flags != 0 ||
        (alignment && (alignment & (alignment - 1))))
        return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > FG_VMM_GRANULARITY ? alignment : FG_VMM_GRANULARITY;
    /* Over-reserve, then trim to an aligned span. */
    char *raw = mmap((void *)(uintptr_t)addr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (raw == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
    if (base > (uintptr_t)raw)
        munmap(raw, base - (uintptr_t)raw);
    size_t tail = (uintptr_t)raw + size + align - (base + size);
    if (tail)
        munmap((void *)(base + size), tail);
    pthread_mutex_lock(&g_vmm_lock);
    int ok = g_reserved_count < (int)(sizeof g_reserved / sizeof g_reserved[0]);
    if (ok)
        g_reserved[g_reserved_count++] = (struct fg_span){.base = base, .size = size};
    pthread_mutex_unlock(&g_vmm_lock);
    if (!ok) {
        munmap((void *)base, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = base;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_vmm_lock);
    rc = CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < g_reserved_count; i++) {
        if (g_reserved[i].base == ptr && g_reserved[i].size == size) {
            g_reserved[i] = g_reserved[--g_reserved_count];
            munmap((void *)(uintptr_t)ptr, size);
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return rc;
}

/* Caller holds g_vmm_lock. */
static int inside_reservation(CUdeviceptr ptr, size_t size)
{
    for (int i = 0; i < g_reserved_count; i++)
        if (ptr >= g_reserved[i].base && ptr + size <= g_reserved[i].base + g_reserved[i].size)
            return 1;
    return 0;
}

static int overlaps_mapping(CUdeviceptr ptr, size_t size)
{
    for (int i = 0; i < g_mapped_count; i++)
        if (ptr < g_mapped[i].base + g_mapped[i].size && g_mapped[i].base < ptr + size)
            return 1;
    return 0;
}

FG_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (size == 0 || flags != 0 || ptr % FG_VMM_GRANULARITY || size % FG_VMM_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm_lock);
    struct fg_vmm_alloc *a = alloc_of(handle);
    if (!a)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (offset + size > a->size || !inside_reservation(ptr, size) || overlaps_mapping(ptr, size) ||
             g_mapped_count == (int)(sizeof g_mapped / sizeof g_mapped[0]))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, a->fd,
                  (off_t)offset) == MAP_FAILED)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if ((rc = fg_map_add(ptr, size, a->dev)) == CUDA_SUCCESS) {
        g_mapped[g_mapped_count++] = (struct fg_span){.base = ptr, .size = size, .alloc = a};
        a->mappings++;
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return rc;
}

FG_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_vmm_lock);
    int found = 0;
    for (int i = 0; i < g_mapped_count;) {
        struct fg_span m = g_mapped[i];
        if (m.base >= ptr && m.base + m.size <= ptr + size) {
            /* Back to reserved, inaccessible address space. */
            mmap((void *)(uintptr_t)m.base, m.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                 -1, 0);
            fg_map_remove(m.base, m.size);
            g_mapped[i] = g_mapped[--g_mapped_count];
            m.alloc->mappings--;
            maybe_destroy(m.alloc);
            found = 1;
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!desc || count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        struct fg_device *d;
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
            fg_get_device(desc[i].location.id, &d) != CUDA_SUCCESS)
            return CUDA_ERROR_INVALID_VALUE;
    }
    /* Mappings are readable and writable from the start; check only that the range is mapped. */
    return fg_addr_valid(ptr, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
