/* Shared declarations of the fake libcuda. Built with __CUDA_API_VERSION_INTERNAL so that every
 * entry point is defined under its exact ABI name (cuMemAlloc_v2, cuCtxCreate_v4, ...).
 *
 * The files depend on each other one way (tests/foundation/test_c_dependencies.py): init.c (the
 * devices, fg_lock) and memory.c (the address map) at the bottom; contexts above them; streams and
 * events (which misuse the captures capture.c keeps) above contexts; graphs and launches above
 * streams; the allocating entry points (alloc.c, array.c, pool.c, vmm.c) above what they use; fork.c,
 * which takes every file's lock, on top. */
#ifndef FAKEGPU_CUDA_INTERNAL_H
#define FAKEGPU_CUDA_INTERNAL_H

#include <cuda.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../common/config.h"
#include "../common/shared.h"

/* Exported entry points; everything else stays inside the library (see cuda.map). */
#define FG_API __attribute__((visibility("default")))

/* Magic numbers tell live handles from garbage; a destroyed object's magic is cleared. */
#define FG_MAGIC_CTX 0x43545831u
#define FG_MAGIC_STREAM 0x53545231u
#define FG_MAGIC_EVENT 0x45564e31u
#define FG_MAGIC_MODULE 0x4d4f4431u
#define FG_MAGIC_FUNC 0x46554e31u
#define FG_MAGIC_POOL 0x504f4f31u
#define FG_MAGIC_GRAPH 0x47525031u
#define FG_MAGIC_GRAPH_NODE 0x474e4431u
#define FG_MAGIC_GRAPH_EXEC 0x47455831u
#define FG_MAGIC_ARRAY 0x41525231u
#define FG_MAGIC_VMM 0x564d4d31u


struct CUstream_st {
    uint32_t magic;
    struct CUctx_st *ctx;
    unsigned flags;
    int priority;
    struct fg_ref tail;         /* the last kernel queued on this stream */
    struct fg_ref *queue;       /* its last FG_QUEUE_DEPTH launches */
    uint64_t queued;            /* launches so far */
    struct fg_shared *waits_on; /* cuStreamWaitEvent on another GPU's event: its next launch waits */
    struct fg_ref waits_for;
    struct CUgraph_st *capture; /* non-NULL while stream capture records into a graph */
};

struct CUctx_st {
    uint32_t magic;
    CUdevice dev;
    int primary;
    unsigned flags;
    struct fg_ref tail; /* the last kernel queued on any of its streams */
    struct CUstream_st null_stream;
};

/* A fresh context, live, with its null stream: a created one, or a device's primary one (init.c sets
 * each device's up, context.c again at each first retain). */
static inline void fg_ctx_init(struct CUctx_st *ctx, CUdevice dev, unsigned flags, int primary)
{
    memset(ctx, 0, sizeof *ctx);
    ctx->magic = FG_MAGIC_CTX;
    ctx->dev = dev;
    ctx->flags = flags;
    ctx->primary = primary;
    ctx->null_stream.magic = FG_MAGIC_STREAM;
    ctx->null_stream.ctx = ctx;
}

struct CUmemPoolHandle_st {
    uint32_t magic;
    CUdevice dev;
    CUmemPoolProps props;
};

struct fg_device {
    int gpu; /* index in the config */
    struct fg_shared *shared;
    struct CUctx_st primary;
    int primary_refs;
    unsigned primary_flags;
    struct CUmemPoolHandle_st default_pool;
    CUmemoryPool current_pool;
};

/* init.c */
extern const struct fg_config *fg_cfg;
extern int fg_device_count;
extern struct fg_device fg_devices[FG_MAX_GPUS];
/* Guards contexts, streams, events and graphs bookkeeping of this process. */
extern pthread_mutex_t fg_lock;
CUresult fg_check_init(void);
CUresult fg_get_device(CUdevice dev, struct fg_device **out);
const struct fg_gpu_spec *fg_spec(CUdevice dev);

/* context.c */
CUresult fg_current_ctx(struct CUctx_st **out);
/* Sleeps until the context's queued work completed. */
void fg_ctx_wait(struct CUctx_st *ctx);

/* A kernel: a named placeholder of a module; its simulated duration comes from its name. */
struct CUfunc_st {
    uint32_t magic;
    struct CUmod_st *mod;
    int fixed;         /* "sleep_us_<N>": the whole launch takes fixed_ns = N us */
    uint64_t fixed_ns;
    uint64_t wave_ns; /* otherwise each wave of blocks over the SMs takes this long */
    struct CUfunc_st *next;
    char name[128];
};
/* module.c: the work a launch of f over `grid` queues. */
struct fg_work fg_kernel_work(CUfunction f, const unsigned grid[3]);

/* stream.c */
CUresult fg_resolve_stream(CUstream s, struct CUstream_st **out);
/* Queues a kernel on the stream, after its process's earlier work on the GPU. fg_lock held. */
void fg_stream_run(struct CUstream_st *s, const struct fg_work *work);
/* Waits (fg_lock not held) until the stream may take another launch: the launch FG_QUEUE_DEPTH back
 * completed, and an event of another GPU it was told to wait for. */
void fg_stream_wait_room(struct CUstream_st *s);

/* memory.c: the address map of device allocations, host allocations and VMM mappings */
enum fg_alloc_kind { FG_ALLOC_DEVICE, FG_ALLOC_MANAGED, FG_ALLOC_POOL, FG_ALLOC_HOST, FG_ALLOC_MAPPING };
/* Charges `size` to the device (not for HOST), maps host memory for it and records it. */
CUresult fg_alloc(CUdevice dev, CUcontext ctx, CUmemoryPool pool, size_t size, enum fg_alloc_kind kind,
                  int low32, CUdeviceptr *out);
/* Frees an allocation of one of the kinds in `kinds` (a bit mask of 1 << kind). */
CUresult fg_free(CUdeviceptr ptr, unsigned kinds);
void fg_free_ctx_allocations(CUcontext ctx);
/* Bytes allocated from a pool that are still live. */
size_t fg_pool_used(CUmemoryPool pool);
/* VMM: records a mapping made by cuMemMap so copies into it are checked like allocations. */
CUresult fg_map_add(CUdeviceptr base, size_t size, CUdevice dev);
void fg_map_remove(CUdeviceptr base, size_t size);
/* 1 if [ptr, ptr+len) lies inside one allocation or mapping that is backed by host memory. */
int fg_addr_valid(CUdeviceptr ptr, size_t len);
/* 1 if ptr lies inside any allocation or mapping (device or host); then its base and size, where asked. */
int fg_addr_known(CUdeviceptr ptr, CUdeviceptr *base, size_t *size);
CUresult fg_charge(CUdevice dev, size_t bytes);
void fg_uncharge(CUdevice dev, size_t bytes);
/* fork(), for fork.c: hold (lock != 0) or release the process-local locks, so a child never inherits
 * one held by a thread it does not have. Lock order: fg_lock, the VMM lock, the address map lock. */
void fg_memory_fork_lock(int lock);
/* vmm.c */
void fg_vmm_fork_lock(int lock);

/* mps.c: how this process's work shares the GPU (an MPS client or not), decided once. */
const struct fg_client *fg_client(void);

/* A graph: its nodes, and the stream capture recording into it, if any (capture.c). */
struct CUgraph_st {
    uint32_t magic;
    struct CUgraphNode_st **nodes;
    size_t count, cap;
    uint64_t capture_id; /* while a stream capture records into it: its id, else 0 */
    int invalidated;     /* that capture was misused: it ends without a graph */
};

/* graph.c: stream capture records launches instead of running them. fg_lock held. */
CUresult fg_graph_capture_kernel(struct CUgraph_st *g, CUfunction f, const unsigned grid[3]);

/* capture.c, fg_lock held: a capture begins (0, or -1 when too many are in progress), ends, and the
 * capture of that id, if still in progress, is invalidated (an event recorded in it was misused). */
int fg_graph_capture_started(struct CUgraph_st *g);
void fg_graph_capture_ended(struct CUgraph_st *g);
void fg_graph_capture_misused(uint64_t capture_id);

#endif
