/* Stream-ordered allocation: memory pools (each device's default one and created ones). The fake GPU
 * allocates and frees at call time: it has no device work that could still use freed memory. */
#include <stdlib.h>

#include "internal.h"

static CUresult check_pool(CUmemoryPool pool)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    return pool && pool->magic == FG_MAGIC_POOL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pool_out)
        return CUDA_ERROR_INVALID_VALUE;
    *pool_out = &d->default_pool;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    *pool = d->current_pool;
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc == CUDA_SUCCESS)
        rc = check_pool(pool);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (pool->dev != dev)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    d->current_pool = pool;
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    struct fg_device *d;
    if (!pool || !poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_get_device(poolProps->location.id, &d);
    if (rc != CUDA_SUCCESS)
        return rc == CUDA_ERROR_INVALID_DEVICE ? CUDA_ERROR_INVALID_VALUE : rc;
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->magic = FG_MAGIC_POOL;
    p->dev = poolProps->location.id;
    p->props = *poolProps;
    *pool = p;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult rc = check_pool(pool);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct fg_device *d = &fg_devices[pool->dev];
    if (pool == &d->default_pool)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    if (d->current_pool == pool)
        d->current_pool = &d->default_pool;
    pool->magic = 0;
    pthread_mutex_unlock(&fg_lock);
    /* Kept allocated: allocations made from it still name it until they are freed. */
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    CUresult rc = check_pool(pool);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        *(cuuint64_t *)value = fg_pool_used(pool);
        return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        *(cuuint64_t *)value = 0;
        return CUDA_SUCCESS;
    default:
        *(int *)value = 0;
        return CUDA_SUCCESS;
    }
}

FG_API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    (void)attr;
    CUresult rc = check_pool(pool);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* Pools keep nothing back (frees return memory at once), so thresholds change nothing. */
    return value ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = check_pool(pool);
    if (rc == CUDA_SUCCESS)
        rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    return fg_alloc(pool->dev, s->ctx, pool, bytesize, FG_ALLOC_POOL, 0, dptr);
}

FG_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream)
{
    return cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream);
}

FG_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    CUmemoryPool pool = fg_devices[s->ctx->dev].current_pool;
    pthread_mutex_unlock(&fg_lock);
    return fg_alloc(s->ctx->dev, s->ctx, pool, bytesize, FG_ALLOC_POOL, 0, dptr);
}

FG_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return cuMemAllocAsync(dptr, bytesize, hStream);
}

FG_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    return fg_free(dptr, (1u << FG_ALLOC_POOL) | (1u << FG_ALLOC_DEVICE) | (1u << FG_ALLOC_MANAGED));
}

FG_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return cuMemFreeAsync(dptr, hStream);
}
