/* CUDA arrays and mipmapped arrays: opaque handles whose size is charged to the device. */
#include <stdlib.h>

#include "internal.h"

struct CUarray_st {
    uint32_t magic;
    CUdevice dev;
    size_t bytes;
    CUDA_ARRAY3D_DESCRIPTOR desc;
};

struct CUmipmappedArray_st {
    uint32_t magic;
    CUdevice dev;
    size_t bytes;
};

static size_t format_bytes(CUarray_format format)
{
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
    case CU_AD_FORMAT_UNORM_INT8X1:
    case CU_AD_FORMAT_SNORM_INT8X1:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
    case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X1:
        return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
        return 4;
    default:
        return 0;
    }
}

/* Bytes of one level of an array, 0 if the descriptor is invalid. */
static size_t level_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned level)
{
    size_t elem = format_bytes(d->Format);
    if (!elem || d->Width == 0 || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return 0;
    size_t w = d->Width >> level, h = d->Height >> level, z = d->Depth >> level;
    return (w ? w : 1) * (h ? h : 1) * (z ? z : 1) * elem * d->NumChannels;
}

static CUresult create_array(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t bytes = level_bytes(desc, 0);
    if (!pHandle || !bytes)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUarray_st *a = calloc(1, sizeof *a);
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    rc = fg_charge(ctx->dev, bytes);
    if (rc != CUDA_SUCCESS) {
        free(a);
        return rc;
    }
    *a = (struct CUarray_st){.magic = FG_MAGIC_ARRAY, .dev = ctx->dev, .bytes = bytes, .desc = *desc};
    *pHandle = a;
    return CUDA_SUCCESS;
}

FG_API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    if (!pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    return create_array(pHandle, pAllocateArray);
}

FG_API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    if (!pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = pAllocateArray->Width,
                                 .Height = pAllocateArray->Height,
                                 .Format = pAllocateArray->Format,
                                 .NumChannels = pAllocateArray->NumChannels};
    return create_array(pHandle, &d);
}

FG_API CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *pAllocateArray)
{
    if (!pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = pAllocateArray->Width,
                                 .Height = pAllocateArray->Height,
                                 .Format = pAllocateArray->Format,
                                 .NumChannels = pAllocateArray->NumChannels};
    return create_array(pHandle, &d);
}

FG_API CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *pAllocateArray)
{
    if (!pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = pAllocateArray->Width,
                                 .Height = pAllocateArray->Height,
                                 .Depth = pAllocateArray->Depth,
                                 .Format = pAllocateArray->Format,
                                 .NumChannels = pAllocateArray->NumChannels,
                                 .Flags = pAllocateArray->Flags};
    return create_array(pHandle, &d);
}

FG_API CUresult cuArrayDestroy(CUarray hArray)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!hArray || hArray->magic != FG_MAGIC_ARRAY)
        return CUDA_ERROR_INVALID_HANDLE;
    hArray->magic = 0;
    fg_uncharge(hArray->dev, hArray->bytes);
    free(hArray);
    return CUDA_SUCCESS;
}

FG_API CUresult cuArray3DGetDescriptor_v2(CUDA_ARRAY3D_DESCRIPTOR *pArrayDescriptor, CUarray hArray)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!hArray || hArray->magic != FG_MAGIC_ARRAY)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!pArrayDescriptor)
        return CUDA_ERROR_INVALID_VALUE;
    *pArrayDescriptor = hArray->desc;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                       unsigned int numMipmapLevels)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pHandle || !pMipmappedArrayDesc || numMipmapLevels == 0 || numMipmapLevels > 32)
        return CUDA_ERROR_INVALID_VALUE;
    size_t bytes = 0;
    for (unsigned level = 0; level < numMipmapLevels; level++) {
        size_t b = level_bytes(pMipmappedArrayDesc, level);
        if (!b)
            return CUDA_ERROR_INVALID_VALUE;
        bytes += b;
    }
    struct CUmipmappedArray_st *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    rc = fg_charge(ctx->dev, bytes);
    if (rc != CUDA_SUCCESS) {
        free(m);
        return rc;
    }
    *m = (struct CUmipmappedArray_st){.magic = FG_MAGIC_ARRAY, .dev = ctx->dev, .bytes = bytes};
    *pHandle = m;
    return CUDA_SUCCESS;
}

FG_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!hMipmappedArray || hMipmappedArray->magic != FG_MAGIC_ARRAY)
        return CUDA_ERROR_INVALID_HANDLE;
    hMipmappedArray->magic = 0;
    fg_uncharge(hMipmappedArray->dev, hMipmappedArray->bytes);
    free(hMipmappedArray);
    return CUDA_SUCCESS;
}
