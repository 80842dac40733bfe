/* Streams and events over the scheduler model (common/sched.c). A stream's tail is its last queued
 * kernel; an event records the tail of its stream and completes with it (or at once on an idle
 * stream); synchronisation sleeps until the model says the kernel completed. When it completes
 * depends on what other processes queue meanwhile, so every answer is the model's as of the call. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* How many launches a stream may have queued before cuLaunchKernel blocks, as a real push buffer. */
#define FG_QUEUE_DEPTH 1024

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    int recorded;
    struct fg_shared *shared; /* the GPU of the stream it was recorded on */
    struct fg_ref ref;        /* that stream's last kernel then */
    uint64_t record_ns;       /* when it was recorded: it completes no earlier */
    int resolved;             /* done_ns is known */
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

/* The same check, taking fg_lock: CUDA_SUCCESS for an event recorded outside any capture. */
static CUresult captured_event_check(const struct CUevent_st *e)
{
    pthread_mutex_lock(&fg_lock);
    CUresult rc = e->capture_id ? captured_event_misused(e) : CUDA_SUCCESS;
    pthread_mutex_unlock(&fg_lock);
    return rc;
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

static struct fg_shared *shared_of(const struct CUstream_st *s)
{
    return fg_devices[s->ctx->dev].shared;
}

void fg_stream_wait_room(struct CUstream_st *s)
{
    pthread_mutex_lock(&fg_lock);
    struct fg_shared *shared = shared_of(s);
    struct fg_ref oldest = s->queue ? s->queue[s->queued % FG_QUEUE_DEPTH] : (struct fg_ref){0, 0};
    struct fg_shared *other = s->waits_on;
    struct fg_ref event = s->waits_for;
    s->waits_on = NULL;
    pthread_mutex_unlock(&fg_lock);
    if (other) /* another GPU's work does not run in this GPU's model: wait for it here */
        fg_work_wait(other, event);
    fg_work_wait(shared, oldest);
}

void fg_stream_run(struct CUstream_st *s, const struct fg_work *work)
{
    struct fg_ref ref = fg_work_submit(shared_of(s), work, fg_client());
    if (!s->queue)
        s->queue = calloc(FG_QUEUE_DEPTH, sizeof *s->queue);
    if (s->queue)
        s->queue[s->queued % FG_QUEUE_DEPTH] = ref;
    s->queued++;
    s->tail = ref;
    s->ctx->tail = ref; /* a process's work on a GPU runs in the order it was queued */
}

static void fg_stream_wait(struct CUstream_st *s)
{
    pthread_mutex_lock(&fg_lock);
    struct fg_ref tail = s->tail;
    struct fg_shared *shared = shared_of(s);
    pthread_mutex_unlock(&fg_lock);
    fg_work_wait(shared, tail);
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
    uint64_t capture = s->capture ? s->capture->capture_id : 0;
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
    struct fg_ref tail = s->tail;
    struct fg_shared *shared = shared_of(s);
    uint64_t capture = s->capture ? s->capture->capture_id : 0;
    fg_graph_capture_misused(capture); /* querying a capturing stream invalidates the capture */
    pthread_mutex_unlock(&fg_lock);
    if (capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    uint64_t end;
    return fg_work_done(shared, tail, &end) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
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
    hEvent->capture_id = s->capture ? s->capture->capture_id : 0;
    hEvent->shared = shared_of(s);
    hEvent->ref = s->tail;
    hEvent->record_ns = now;
    hEvent->resolved = 0;
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

/* 1 if the recorded event completed, and then its time in e->done_ns; fg_lock held. fg_work_done
 * takes the page lock inside fg_lock, the lock order of launches too. */
static int event_resolve(CUevent e)
{
    uint64_t end;
    if (e->resolved)
        return 1;
    if (!fg_work_done(e->shared, e->ref, &end))
        return 0;
    e->done_ns = end > e->record_ns ? end : e->record_ns;
    e->resolved = 1;
    return 1;
}

/* 1 if the event completed (or was never recorded), waiting for it first if `wait`. */
static int event_done(CUevent e, int wait)
{
    pthread_mutex_lock(&fg_lock);
    int done = !e->recorded || event_resolve(e);
    struct fg_shared *shared = e->shared;
    struct fg_ref ref = e->ref;
    pthread_mutex_unlock(&fg_lock);
    if (done || !wait)
        return done;
    fg_work_wait(shared, ref); /* without fg_lock: other threads go on meanwhile */
    pthread_mutex_lock(&fg_lock);
    if (e->magic == FG_MAGIC_EVENT && e->recorded)
        event_resolve(e);
    pthread_mutex_unlock(&fg_lock);
    return 1;
}

FG_API CUresult cuEventQuery(CUevent hEvent)
{
    CUresult rc = resolve_event(hEvent);
    if (rc != CUDA_SUCCESS)
        return rc;
    if ((rc = captured_event_check(hEvent)) != CUDA_SUCCESS)
        return rc;
    return event_done(hEvent, 0) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FG_API CUresult cuEventSynchronize(CUevent hEvent)
{
    CUresult rc = resolve_event(hEvent);
    if (rc != CUDA_SUCCESS)
        return rc;
    if ((rc = captured_event_check(hEvent)) != CUDA_SUCCESS)
        return rc;
    event_done(hEvent, 1);
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
    if (hStart->capture_id || hEnd->capture_id)
        rc = captured_event_misused(hStart->capture_id ? hStart : hEnd);
    else if (!hStart->recorded || !hEnd->recorded || ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING))
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (!event_resolve(hStart) || !event_resolve(hEnd))
        rc = CUDA_ERROR_NOT_READY;
    else
        *pMilliseconds = (float)((double)((int64_t)(hEnd->done_ns - hStart->done_ns)) / 1e6);
    pthread_mutex_unlock(&fg_lock);
    return rc;
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
    /* An event of this GPU needs nothing: the process's work on it runs in the order it was queued. */
    pthread_mutex_lock(&fg_lock);
    if (hEvent->recorded && hEvent->shared != shared_of(s)) {
        s->waits_on = hEvent->shared;
        s->waits_for = hEvent->ref;
    }
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
