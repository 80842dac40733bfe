/* Copies and memsets on device memory (host memory underneath). Synchronous calls first wait for the
 * context's queued work, as the legacy default stream does; asynchronous ones act at once, which is
 * indistinguishable since simulated kernels never touch memory. */
#include <string.h>

#include "internal.h"

static CUresult sync_context(void)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc == CUDA_SUCCESS)
        fg_ctx_wait(ctx);
    return rc;
}

static CUresult check_stream(CUstream s)
{
    struct CUstream_st *st;
    return fg_resolve_stream(s, &st);
}

/* Either side may be device memory (validated) or, for unified copies, host memory. */
static CUresult copy(CUdeviceptr dst, int dst_device, CUdeviceptr src, int src_device, size_t n)
{
    if (n == 0)
        return CUDA_SUCCESS;
    if ((dst_device && !fg_addr_valid(dst, n)) || (src_device && !fg_addr_valid(src, n)) || !dst || !src)
        return CUDA_ERROR_INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

static CUresult copy_unified(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    return copy(dst, fg_addr_known(dst, NULL, NULL), src, fg_addr_known(src, NULL, NULL), n);
}

#define HOST(p) ((CUdeviceptr)(uintptr_t)(p))

FG_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? copy(dstDevice, 1, HOST(srcHost), 0, ByteCount) : rc;
}

FG_API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? copy(HOST(dstHost), 0, srcDevice, 1, ByteCount) : rc;
}

FG_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? copy(dstDevice, 1, srcDevice, 1, ByteCount) : rc;
}

FG_API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? copy_unified(dst, src, ByteCount) : rc;
}

FG_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream)
{
    CUresult rc = check_stream(hStream);
    return rc == CUDA_SUCCESS ? copy(dstDevice, 1, HOST(srcHost), 0, ByteCount) : rc;
}

FG_API CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
{
    CUresult rc = check_stream(hStream);
    return rc == CUDA_SUCCESS ? copy(HOST(dstHost), 0, srcDevice, 1, ByteCount) : rc;
}

FG_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                     CUstream hStream)
{
    CUresult rc = check_stream(hStream);
    return rc == CUDA_SUCCESS ? copy(dstDevice, 1, srcDevice, 1, ByteCount) : rc;
}

FG_API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    CUresult rc = check_stream(hStream);
    return rc == CUDA_SUCCESS ? copy_unified(dst, src, ByteCount) : rc;
}

/* Per-thread default stream variants: the fake driver has one default stream per context. */
FG_API CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return cuMemcpyHtoD_v2(dstDevice, srcHost, ByteCount);
}

FG_API CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return cuMemcpyDtoH_v2(dstHost, srcDevice, ByteCount);
}

FG_API CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return cuMemcpyDtoD_v2(dstDevice, srcDevice, ByteCount);
}

FG_API CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return cuMemcpy(dst, src, ByteCount);
}

FG_API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                          CUstream hStream)
{
    return cuMemcpyHtoDAsync_v2(dstDevice, srcHost, ByteCount, hStream);
}

FG_API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
{
    return cuMemcpyDtoHAsync_v2(dstHost, srcDevice, ByteCount, hStream);
}

FG_API CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                          CUstream hStream)
{
    return cuMemcpyDtoDAsync_v2(dstDevice, srcDevice, ByteCount, hStream);
}

FG_API CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    return cuMemcpyAsync(dst, src, ByteCount, hStream);
}

/* The pre-3.2 ABI with 32-bit device pointers and sizes. */
FG_API CUresult cuMemcpyHtoD(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int ByteCount)
{
    return cuMemcpyHtoD_v2(dstDevice, srcHost, ByteCount);
}

FG_API CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount)
{
    return cuMemcpyDtoH_v2(dstHost, srcDevice, ByteCount);
}

FG_API CUresult cuMemcpyDtoD(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int ByteCount)
{
    return cuMemcpyDtoD_v2(dstDevice, srcDevice, ByteCount);
}

/* Writes `count` elements of `elem` bytes each, `width` per row of `pitch` bytes. */
static CUresult fill(CUdeviceptr dst, size_t pitch, const void *value, size_t elem, size_t width, size_t height)
{
    if (width == 0 || height == 0)
        return CUDA_SUCCESS;
    size_t row = width * elem;
    if (dst % elem || pitch < row || !fg_addr_valid(dst, pitch * (height - 1) + row))
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t y = 0; y < height; y++) {
        unsigned char *p = (unsigned char *)(uintptr_t)(dst + y * pitch);
        if (elem == 1) {
            memset(p, *(const unsigned char *)value, width);
            continue;
        }
        for (size_t x = 0; x < width; x++)
            memcpy(p + x * elem, value, elem);
    }
    return CUDA_SUCCESS;
}

FG_API CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? fill(dstDevice, N, &uc, 1, N, 1) : rc;
}

FG_API CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? fill(dstDevice, N * 2, &us, 2, N, 1) : rc;
}

FG_API CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? fill(dstDevice, N * 4, &ui, 4, N, 1) : rc;
}

FG_API CUresult cuMemsetD2D8_v2(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width,
                                size_t Height)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? fill(dstDevice, dstPitch, &uc, 1, Width, Height) : rc;
}

FG_API CUresult cuMemsetD2D32_v2(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width,
                                 size_t Height)
{
    CUresult rc = sync_context();
    return rc == CUDA_SUCCESS ? fill(dstDevice, dstPitch, &ui, 4, Width, Height) : rc;
}

FG_API CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    CUresult rc = check_stream(hStream);
    return rc == CUDA_SUCCESS ? fill(dstDevice, N, &uc, 1, N, 1) : rc;
}

FG_API CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    CUresult rc = check_stream(hStream);
    return rc == CUDA_SUCCESS ? fill(dstDevice, N * 2, &us, 2, N, 1) : rc;
}

FG_API CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    CUresult rc = check_stream(hStream);
    return rc == CUDA_SUCCESS ? fill(dstDevice, N * 4, &ui, 4, N, 1) : rc;
}

FG_API CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    return cuMemsetD8_v2(dstDevice, uc, N);
}

FG_API CUresult cuMemsetD16_v2_ptds(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    return cuMemsetD16_v2(dstDevice, us, N);
}

FG_API CUresult cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    return cuMemsetD32_v2(dstDevice, ui, N);
}

FG_API CUresult cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    return cuMemsetD8Async(dstDevice, uc, N, hStream);
}

FG_API CUresult cuMemsetD16Async_ptsz(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    return cuMemsetD16Async(dstDevice, us, N, hStream);
}

FG_API CUresult cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    return cuMemsetD32Async(dstDevice, ui, N, hStream);
}

FG_API CUresult cuMemsetD8(CUdeviceptr_v1 dstDevice, unsigned char uc, unsigned int N)
{
    return cuMemsetD8_v2(dstDevice, uc, N);
}

FG_API CUresult cuMemsetD32(CUdeviceptr_v1 dstDevice, unsigned int ui, unsigned int N)
{
    return cuMemsetD32_v2(dstDevice, ui, N);
}
