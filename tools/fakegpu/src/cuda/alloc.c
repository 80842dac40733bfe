/* The allocation entry points of the current context: device, managed and page-locked host memory
 * (recorded in memory.c's address map), and what the GPU's memory holds. */
#include "internal.h"

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
    return fg_addr_known(dptr, pbase, psize) ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
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
    if (!pdptr || Flags != 0 || !fg_addr_known((CUdeviceptr)(uintptr_t)p, NULL, NULL))
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}
