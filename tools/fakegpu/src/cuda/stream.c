/* Streams and events over the simulated timeline. A stream's tail is when its last queued work
 * completes; an event records the tail of its stream; synchronisation sleeps until then. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* How many launches a stream may have queued before cuLaunchKernel blocks, as a real push buffer. */
#define FG_QUEUE_DEPTH 1024

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    int recorded;
    uint64_t done_ns;
    uint64_t capture_id; /* last recorded inside that stream capture: a graph node, not a time */
};

/* A query, wait or timing of an event last recorded inside a stream capture: refused, and the
 * capture (if still in progress) is invalidated, as the real driver does. fg_lock held. */
static CUresult captured_event_misused(const struct CUevent_st *e)
{
    fg_graph_capture_misused(e->capture_id);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

CUresult fg_resolve_stream(CUstream s, struct CUstream_st **out)
{
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) {
        /* The legacy and per-thread default streams are both the context's one null stream. */
        struct CUctx_st *ctx;
        CUresult rc = fg_current_ctx(&ctx);
        if (rc != CUDA_SUCCESS)
            return rc;
        *out = &ctx->null_stream;
        return CUDA_SUCCESS;
    }
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (s->magic != FG_MAGIC_STREAM || !s->ctx || s->ctx->magic != FG_MAGIC_CTX)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = s;
    return CUDA_SUCCESS;
}

static uint64_t *queue_slot(struct CUstream_st *s)
{
    if (!s->queue) {
        s->queue = calloc(FG_QUEUE_DEPTH, sizeof *s->queue);
        if (!s->queue)
            return NULL;
    }
    return &s->queue[s->queued % FG_QUEUE_DEPTH];
}

uint64_t fg_stream_queue_wait(struct CUstream_st *s)
{
    uint64_t *slot = queue_slot(s);
    return slot ? *slot : 0;
}

void fg_stream_run(struct CUstream_st *s, uint64_t duration_ns)
{
    uint64_t end = fg_timeline_submit(fg_devices[s->ctx->dev].shared, s->tail_ns, duration_ns);
    uint64_t *slot = queue_slot(s);
    if (slot)
        *slot = end;
    s->queued++;
    s->tail_ns = end;
    if (s->ctx->tail_ns < end)
        s->ctx->tail_ns = end;
}

static void fg_stream_wait(struct CUstream_st *s)
{
    pthread_mutex_lock(&fg_lock);
    uint64_t until = s->tail_ns;
    pthread_mutex_unlock(&fg_lock);
    fg_sleep_until(until);
}

void fg_ctx_wait(struct CUctx_st *ctx)
{
    pthread_mutex_lock(&fg_lock);
    uint64_t until = ctx->tail_ns;
    pthread_mutex_unlock(&fg_lock);
    fg_sleep_until(until);
}

FG_API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = FG_MAGIC_STREAM;
    s->ctx = ctx;
    s->flags = flags;
    s->priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
    *phStream = s;
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    return cuStreamCreateWithPriority(phStream, Flags, 0);
}

FG_API CUresult cuStreamDestroy_v2(CUstream hStream)
{
    struct CUstream_st *s;
    if (!hStream)
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (s == &s->ctx->null_stream)
        return CUDA_ERROR_INVALID_HANDLE;
    /* Queued work still completes on the device timeline; the handle goes at once. */
    pthread_mutex_lock(&fg_lock);
    s->magic = 0;
    pthread_mutex_unlock(&fg_lock);
    free(s->queue);
    free(s);
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamDestroy(CUstream hStream)
{
    return cuStreamDestroy_v2(hStream);
}

FG_API CUresult cuStreamSynchronize(CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    uint64_t capture = s->capture ? fg_graph_capture_id(s->capture) : 0;
    fg_graph_capture_misused(capture); /* synchronising a capturing stream invalidates the capture */
    pthread_mutex_unlock(&fg_lock);
    if (capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    fg_stream_wait(s);
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    return cuStreamSynchronize(hStream);
}

FG_API CUresult cuStreamQuery(CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    uint64_t tail = s->tail_ns;
    uint64_t capture = s->capture ? fg_graph_capture_id(s->capture) : 0;
    fg_graph_capture_misused(capture); /* querying a capturing stream invalidates the capture */
    pthread_mutex_unlock(&fg_lock);
    if (capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return fg_now_ns() >= tail ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FG_API CUresult cuStreamQuery_ptsz(CUstream hStream)
{
    return cuStreamQuery(hStream);
}

FG_API CUresult cuStreamGetFlags(CUstream hStream, unsigned int *flags)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = s->flags;
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamGetFlags_ptsz(CUstream hStream, unsigned int *flags)
{
    return cuStreamGetFlags(hStream, flags);
}

FG_API CUresult cuStreamGetPriority(CUstream hStream, int *priority)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!priority)
        return CUDA_ERROR_INVALID_VALUE;
    *priority = s->priority;
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamGetPriority_ptsz(CUstream hStream, int *priority)
{
    return cuStreamGetPriority(hStream, priority);
}

FG_API CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = s->ctx;
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx)
{
    return cuStreamGetCtx(hStream, pctx);
}

FG_API CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (leastPriority)
        *leastPriority = 0;
    if (greatestPriority)
        *greatestPriority = -5;
    return CUDA_SUCCESS;
}

static CUresult resolve_event(CUevent e)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    return e && e->magic == FG_MAGIC_EVENT ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FG_API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!phEvent || (Flags & ~known))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = FG_MAGIC_EVENT;
    e->flags = Flags;
    *phEvent = e;
    return CUDA_SUCCESS;
}

FG_API CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = resolve_event(hEvent);
    if (rc == CUDA_SUCCESS)
        rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t now = fg_now_ns();
    pthread_mutex_lock(&fg_lock);
    hEvent->capture_id = s->capture ? fg_graph_capture_id(s->capture) : 0;
    hEvent->done_ns = s->tail_ns > now ? s->tail_ns : now;
    hEvent->recorded = 1;
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    return cuEventRecord(hEvent, hStream);
}

FG_API CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    if (flags & ~(unsigned)CU_EVENT_RECORD_EXTERNAL)
        return CUDA_ERROR_INVALID_VALUE;
    return cuEventRecord(hEvent, hStream);
}

FG_API CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    return cuEventRecordWithFlags(hEvent, hStream, flags);
}

FG_API CUresult cuEventQuery(CUevent hEvent)
{
    CUresult rc = resolve_event(hEvent);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    uint64_t done = hEvent->done_ns;
    if (hEvent->capture_id)
        rc = captured_event_misused(hEvent);
    pthread_mutex_unlock(&fg_lock);
    if (rc != CUDA_SUCCESS)
        return rc;
    return fg_now_ns() >= done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FG_API CUresult cuEventSynchronize(CUevent hEvent)
{
    CUresult rc = resolve_event(hEvent);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    uint64_t done = hEvent->done_ns;
    if (hEvent->capture_id)
        rc = captured_event_misused(hEvent);
    pthread_mutex_unlock(&fg_lock);
    if (rc != CUDA_SUCCESS)
        return rc;
    fg_sleep_until(done);
    return CUDA_SUCCESS;
}

FG_API CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    CUresult rc = resolve_event(hStart);
    if (rc == CUDA_SUCCESS)
        rc = resolve_event(hEnd);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    struct CUevent_st a = *hStart, b = *hEnd;
    if (a.capture_id || b.capture_id)
        rc = captured_event_misused(a.capture_id ? &a : &b);
    pthread_mutex_unlock(&fg_lock);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!a.recorded || !b.recorded || ((a.flags | b.flags) & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = fg_now_ns();
    if (now < a.done_ns || now < b.done_ns)
        return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)((double)((int64_t)(b.done_ns - a.done_ns)) / 1e6);
    return CUDA_SUCCESS;
}

FG_API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

FG_API CUresult cuEventDestroy_v2(CUevent hEvent)
{
    CUresult rc = resolve_event(hEvent);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    hEvent->magic = 0;
    pthread_mutex_unlock(&fg_lock);
    free(hEvent);
    return CUDA_SUCCESS;
}

FG_API CUresult cuEventDestroy(CUevent hEvent)
{
    return cuEventDestroy_v2(hEvent);
}

FG_API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    struct CUstream_st *s;
    CUresult rc = resolve_event(hEvent);
    if (rc == CUDA_SUCCESS)
        rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    if (hEvent->recorded && s->tail_ns < hEvent->done_ns)
        s->tail_ns = hEvent->done_ns;
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return cuStreamWaitEvent(hStream, hEvent, Flags);
}

FG_API CUresult cuStreamGetCtx_v2(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx)
{
    if (!pCtx || !pGreenCtx)
        return CUDA_ERROR_INVALID_VALUE;
    *pGreenCtx = NULL; /* green contexts are not modelled */
    return cuStreamGetCtx(hStream, pCtx);
}

FG_API CUresult cuStreamGetCtx_v2_ptsz(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx)
{
    return cuStreamGetCtx_v2(hStream, pCtx, pGreenCtx);
}
