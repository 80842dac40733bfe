/* Contexts: created ones, per-device primary ones, and each thread's stack of current contexts. */
#include <stdlib.h>

#include "internal.h"

#define FG_CTX_STACK 32

static __thread CUcontext tls_stack[FG_CTX_STACK];
static __thread int tls_depth;

static CUresult fg_check_ctx(CUcontext ctx)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    return ctx && ctx->magic == FG_MAGIC_CTX ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult fg_current_ctx(struct CUctx_st **out)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    CUcontext ctx = tls_depth > 0 ? tls_stack[tls_depth - 1] : NULL;
    if (!ctx || ctx->magic != FG_MAGIC_CTX)
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = ctx;
    return CUDA_SUCCESS;
}

void fg_ctx_wait(struct CUctx_st *ctx)
{
    pthread_mutex_lock(&fg_lock);
    struct fg_ref tail = ctx->tail;
    struct fg_shared *shared = fg_devices[ctx->dev].shared;
    pthread_mutex_unlock(&fg_lock);
    fg_work_wait(shared, tail);
}

static void forget_in_this_thread(CUcontext ctx)
{
    int keep = 0;
    for (int i = 0; i < tls_depth; i++)
        if (tls_stack[i] != ctx)
            tls_stack[keep++] = tls_stack[i];
    tls_depth = keep;
}

static CUresult create_context(CUcontext *pctx, unsigned flags, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (tls_depth == FG_CTX_STACK)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUctx_st *ctx = malloc(sizeof *ctx);
    if (!ctx)
        return CUDA_ERROR_OUT_OF_MEMORY;
    fg_ctx_init(ctx, dev, flags, 0);
    fg_proc_context(d->shared, +1);
    tls_stack[tls_depth++] = ctx;
    *pctx = ctx;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev)
{
    if (params && (params->numExecAffinityParams > 0 || params->cigParams))
        return CUDA_ERROR_NOT_SUPPORTED; /* MPS affinity and graphics interop are not modelled */
    return create_context(pctx, flags, dev);
}

FG_API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                               unsigned int flags, CUdevice dev)
{
    if (paramsArray && numParams > 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    return create_context(pctx, flags, dev);
}

FG_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return create_context(pctx, flags, dev);
}

FG_API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return create_context(pctx, flags, dev);
}

FG_API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CUresult rc = fg_check_ctx(ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    fg_ctx_wait(ctx);
    fg_free_ctx_allocations(ctx);
    pthread_mutex_lock(&fg_lock);
    ctx->magic = 0;
    ctx->null_stream.magic = 0;
    pthread_mutex_unlock(&fg_lock);
    forget_in_this_thread(ctx);
    fg_proc_context(fg_devices[ctx->dev].shared, -1);
    /* The struct is kept: streams and other threads may still hold the handle, and must read it as
     * destroyed rather than read freed memory. */
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxDestroy(CUcontext ctx)
{
    return cuCtxDestroy_v2(ctx);
}

FG_API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult rc = fg_check_ctx(ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (tls_depth == FG_CTX_STACK)
        return CUDA_ERROR_OUT_OF_MEMORY;
    tls_stack[tls_depth++] = ctx;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxPushCurrent(CUcontext ctx)
{
    return cuCtxPushCurrent_v2(ctx);
}

FG_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (tls_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext ctx = tls_stack[--tls_depth];
    if (pctx)
        *pctx = ctx;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxPopCurrent(CUcontext *pctx)
{
    return cuCtxPopCurrent_v2(pctx);
}

FG_API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!ctx) {
        if (tls_depth > 0)
            tls_depth--;
        return CUDA_SUCCESS;
    }
    rc = fg_check_ctx(ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (tls_depth == 0)
        tls_depth = 1;
    tls_stack[tls_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = tls_depth > 0 ? tls_stack[tls_depth - 1] : NULL;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetDevice(CUdevice *device)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = ctx->dev;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetFlags(unsigned int *flags)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = ctx->flags;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    if (!ctx) {
        CUresult rc = fg_current_ctx(&ctx);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    CUresult rc = fg_check_ctx(ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = 3020;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxSynchronize(void)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    fg_ctx_wait(ctx);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    if (d->primary_refs++ == 0) {
        fg_ctx_init(&d->primary, dev, d->primary_flags, 1);
        fg_proc_context(d->shared, +1);
    }
    pthread_mutex_unlock(&fg_lock);
    *pctx = &d->primary;
    return CUDA_SUCCESS;
}

static void deactivate_primary(struct fg_device *d)
{
    fg_free_ctx_allocations(&d->primary);
    d->primary.magic = 0;
    d->primary.null_stream.magic = 0;
    fg_proc_context(d->shared, -1);
}

FG_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    if (d->primary_refs == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else if (--d->primary_refs == 0) {
        deactivate_primary(d);
    }
    pthread_mutex_unlock(&fg_lock);
    return rc;
}

FG_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return cuDevicePrimaryCtxRelease_v2(dev);
}

/* Frees every allocation and queued work of the primary context; retains stay counted. */
FG_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    if (d->primary_refs > 0) {
        fg_free_ctx_allocations(&d->primary);
        d->primary.tail = (struct fg_ref){0, 0};
        d->primary.null_stream.tail = (struct fg_ref){0, 0};
    }
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return cuDevicePrimaryCtxReset_v2(dev);
}

FG_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    *flags = d->primary_flags;
    *active = d->primary_refs > 0;
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    d->primary_flags = flags;
    d->primary.flags = flags;
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)
{
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

/* CUDA 13 ABIs naming the context explicitly; NULL means the current one. */
static CUresult ctx_or_current(CUcontext ctx, struct CUctx_st **out)
{
    if (!ctx)
        return fg_current_ctx(out);
    CUresult rc = fg_check_ctx(ctx);
    if (rc == CUDA_SUCCESS)
        *out = ctx;
    return rc;
}

FG_API CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    struct CUctx_st *c;
    CUresult rc = ctx_or_current(ctx, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = c->dev;
    return CUDA_SUCCESS;
}

FG_API CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    struct CUctx_st *c;
    CUresult rc = ctx_or_current(ctx, &c);
    if (rc == CUDA_SUCCESS)
        fg_ctx_wait(c);
    return rc;
}
