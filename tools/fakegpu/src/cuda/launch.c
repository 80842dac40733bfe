/* Kernel launches: a launch queues a kernel on the GPU after its process's earlier work; the
 * scheduler model (common/sched.c) decides when it runs. */
#include "internal.h"

static CUresult fg_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, CUstream stream)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(stream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!f || f->magic != FG_MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || gy > 65535 || gz > 65535 ||
        (uint64_t)bx * by * bz > 1024 || bz > 64)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned grid[3] = {gx, gy, gz};
    pthread_mutex_lock(&fg_lock);
    if (s->capture) {
        rc = fg_graph_capture_kernel(s->capture, f, grid);
        pthread_mutex_unlock(&fg_lock);
        return rc;
    }
    pthread_mutex_unlock(&fg_lock);
    fg_stream_wait_room(s); /* the stream's queue is full: block like a real push buffer */
    pthread_mutex_lock(&fg_lock);
    if (s->magic == FG_MAGIC_STREAM) {
        struct fg_work work = fg_kernel_work(f, grid);
        fg_stream_run(s, &work);
    } else
        rc = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_unlock(&fg_lock);
    return rc;
}

FG_API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                               unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    (void)kernelParams;
    (void)extra;
    return fg_launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

FG_API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                    unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                    unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                    void **kernelParams, void **extra)
{
    return cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                          hStream, kernelParams, extra);
}

FG_API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    (void)kernelParams;
    (void)extra;
    if (!config)
        return CUDA_ERROR_INVALID_VALUE;
    return fg_launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                     config->blockDimY, config->blockDimZ, config->hStream);
}

FG_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                      void **extra)
{
    return cuLaunchKernelEx(config, f, kernelParams, extra);
}

FG_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                          unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                          unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                          void **kernelParams)
{
    (void)sharedMemBytes;
    (void)kernelParams;
    return fg_launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream);
}

FG_API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                               unsigned int gridDimZ, unsigned int blockDimX,
                                               unsigned int blockDimY, unsigned int blockDimZ,
                                               unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    return cuLaunchCooperativeKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                     sharedMemBytes, hStream, kernelParams);
}
