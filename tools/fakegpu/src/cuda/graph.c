/* CUDA graphs: kernel and empty nodes, built by hand or by stream capture. Nodes can only depend on
 * nodes added before them, so insertion order is a valid order: a launch runs the kernels in it. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct fg_kernel {
    CUfunction f;
    unsigned grid[3];
};

struct CUgraphNode_st {
    uint32_t magic;
    struct CUgraph_st *graph;
    int is_kernel;
    struct fg_kernel kernel;
};

struct CUgraphExec_st {
    uint32_t magic;
    struct fg_kernel *kernels;
    size_t count;
};

static CUresult check_graph(CUgraph g)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    return g && g->magic == FG_MAGIC_GRAPH ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phGraph || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = FG_MAGIC_GRAPH;
    *phGraph = g;
    return CUDA_SUCCESS;
}

/* Caller holds fg_lock. */
static CUresult add_node(struct CUgraph_st *g, const CUgraphNode *deps, size_t ndeps, CUfunction f,
                         const unsigned grid[3], CUgraphNode *out)
{
    for (size_t i = 0; i < ndeps; i++)
        if (!deps || !deps[i] || deps[i]->magic != FG_MAGIC_GRAPH_NODE || deps[i]->graph != g)
            return CUDA_ERROR_INVALID_VALUE;
    if (g->count == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 16;
        struct CUgraphNode_st **grown = realloc(g->nodes, cap * sizeof *grown);
        if (!grown)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g->nodes = grown;
        g->cap = cap;
    }
    struct CUgraphNode_st *n = calloc(1, sizeof *n);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    n->magic = FG_MAGIC_GRAPH_NODE;
    n->graph = g;
    if (f) {
        n->is_kernel = 1;
        n->kernel.f = f;
        memcpy(n->kernel.grid, grid, sizeof n->kernel.grid);
    }
    g->nodes[g->count++] = n;
    if (out)
        *out = n;
    return CUDA_SUCCESS;
}

CUresult fg_graph_capture_kernel(struct CUgraph_st *g, CUfunction f, const unsigned grid[3])
{
    if (g->invalidated)
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    return add_node(g, NULL, 0, f, grid, NULL);
}

static CUresult add_kernel_node(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                size_t numDependencies, CUfunction f, unsigned gx, unsigned gy, unsigned gz)
{
    CUresult rc = check_graph(hGraph);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phGraphNode || !f || f->magic != FG_MAGIC_FUNC || gx == 0 || gy == 0 || gz == 0)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned grid[3] = {gx, gy, gz};
    pthread_mutex_lock(&fg_lock);
    rc = add_node(hGraph, dependencies, numDependencies, f, grid, phGraphNode);
    pthread_mutex_unlock(&fg_lock);
    return rc;
}

FG_API CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                        size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS *nodeParams)
{
    if (!nodeParams)
        return CUDA_ERROR_INVALID_VALUE;
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, nodeParams->func,
                           nodeParams->gridDimX, nodeParams->gridDimY, nodeParams->gridDimZ);
}

FG_API CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                     size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams)
{
    if (!nodeParams)
        return CUDA_ERROR_INVALID_VALUE;
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, nodeParams->func,
                           nodeParams->gridDimX, nodeParams->gridDimY, nodeParams->gridDimZ);
}

FG_API CUresult cuGraphAddEmptyNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                    size_t numDependencies)
{
    CUresult rc = check_graph(hGraph);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phGraphNode)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    rc = add_node(hGraph, dependencies, numDependencies, NULL, NULL, phGraphNode);
    pthread_mutex_unlock(&fg_lock);
    return rc;
}

FG_API CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes)
{
    CUresult rc = check_graph(hGraph);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!numNodes)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    if (nodes) {
        size_t n = *numNodes < hGraph->count ? *numNodes : hGraph->count;
        memcpy(nodes, hGraph->nodes, n * sizeof *nodes);
        *numNodes = n;
    } else {
        *numNodes = hGraph->count;
    }
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphDestroy(CUgraph hGraph)
{
    CUresult rc = check_graph(hGraph);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    hGraph->magic = 0;
    for (size_t i = 0; i < hGraph->count; i++) {
        hGraph->nodes[i]->magic = 0;
        free(hGraph->nodes[i]);
    }
    free(hGraph->nodes);
    pthread_mutex_unlock(&fg_lock);
    free(hGraph);
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    (void)flags;
    CUresult rc = check_graph(hGraph);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phGraphExec)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&fg_lock);
    e->kernels = calloc(hGraph->count ? hGraph->count : 1, sizeof *e->kernels);
    for (size_t i = 0; e->kernels && i < hGraph->count; i++)
        if (hGraph->nodes[i]->is_kernel)
            e->kernels[e->count++] = hGraph->nodes[i]->kernel;
    pthread_mutex_unlock(&fg_lock);
    if (!e->kernels) {
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    e->magic = FG_MAGIC_GRAPH_EXEC;
    *phGraphExec = e;
    return CUDA_SUCCESS;
}

FG_API CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                             CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    CUresult rc = cuGraphInstantiateWithFlags(phGraphExec, hGraph, instantiateParams ? instantiateParams->flags : 0);
    if (instantiateParams)
        instantiateParams->result_out = rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS
                                                           : CUDA_GRAPH_INSTANTIATE_ERROR;
    return rc;
}

FG_API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                  CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    return cuGraphInstantiateWithParams(phGraphExec, hGraph, instantiateParams);
}

/* The pre-12.0 ABIs, with an error node and a log buffer. */
FG_API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                      char *logBuffer, size_t bufferSize)
{
    if (phErrorNode)
        *phErrorNode = NULL;
    if (logBuffer && bufferSize)
        logBuffer[0] = '\0';
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}

FG_API CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                   char *logBuffer, size_t bufferSize)
{
    return cuGraphInstantiate_v2(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

static CUresult check_exec(CUgraphExec e)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    return e && e->magic == FG_MAGIC_GRAPH_EXEC ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FG_API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = check_exec(hGraphExec);
    if (rc == CUDA_SUCCESS)
        rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    if (s->capture)
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    for (size_t i = 0; rc == CUDA_SUCCESS && i < hGraphExec->count; i++) {
        const struct fg_kernel *k = &hGraphExec->kernels[i];
        if (k->f->magic != FG_MAGIC_FUNC)
            rc = CUDA_ERROR_INVALID_HANDLE; /* its module was unloaded */
        else {
            struct fg_work work = fg_kernel_work(k->f, k->grid);
            fg_stream_run(s, &work);
        }
    }
    pthread_mutex_unlock(&fg_lock);
    return rc;
}

FG_API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return cuGraphLaunch(hGraphExec, hStream);
}

FG_API CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = check_exec(hGraphExec);
    return rc == CUDA_SUCCESS ? fg_resolve_stream(hStream, &s) : rc;
}

FG_API CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return cuGraphUpload(hGraphExec, hStream);
}

FG_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    CUresult rc = check_exec(hGraphExec);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    hGraphExec->magic = 0;
    pthread_mutex_unlock(&fg_lock);
    free(hGraphExec->kernels);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

static CUresult begin_capture(CUstream hStream)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (s == &s->ctx->null_stream)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    CUgraph g;
    rc = cuGraphCreate(&g, 0);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    if (s->capture)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else if (fg_graph_capture_started(g) != 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else
        s->capture = g;
    pthread_mutex_unlock(&fg_lock);
    if (rc != CUDA_SUCCESS)
        cuGraphDestroy(g);
    return rc;
}

FG_API CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    (void)mode;
    return begin_capture(hStream);
}

FG_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    return cuStreamBeginCapture_v2(hStream, mode);
}

FG_API CUresult cuStreamBeginCapture(CUstream hStream)
{
    return begin_capture(hStream);
}

FG_API CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return begin_capture(hStream);
}

FG_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phGraph)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *invalid = NULL;
    pthread_mutex_lock(&fg_lock);
    if (s->capture) {
        fg_graph_capture_ended(s->capture);
        if (s->capture->invalidated) {
            invalid = s->capture;
            *phGraph = NULL;
            rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        } else {
            *phGraph = s->capture;
        }
        s->capture = NULL;
    } else {
        rc = CUDA_ERROR_ILLEGAL_STATE;
    }
    pthread_mutex_unlock(&fg_lock);
    if (invalid)
        cuGraphDestroy(invalid);
    return rc;
}

FG_API CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return cuStreamEndCapture(hStream, phGraph);
}

FG_API CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    struct CUstream_st *s;
    CUresult rc = fg_resolve_stream(hStream, &s);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!captureStatus)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&fg_lock);
    *captureStatus = !s->capture             ? CU_STREAM_CAPTURE_STATUS_NONE
                     : s->capture->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                               : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    pthread_mutex_unlock(&fg_lock);
    return CUDA_SUCCESS;
}

FG_API CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return cuStreamIsCapturing(hStream, captureStatus);
}
