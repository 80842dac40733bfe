/* The stream captures in progress, so that misusing an event recorded in one (queried, synchronised,
 * timed: it is a node of a graph, not a point in time) invalidates it as the real driver does, also
 * from another thread, after the capture's stream was destroyed or its graph ended. Below the
 * streams and events (stream.c), which misuse them, and graph.c, which starts and ends them. All
 * under fg_lock. */
#include "internal.h"

#define MAX_CAPTURES 256
static struct CUgraph_st *captures[MAX_CAPTURES];
static uint64_t last_capture_id;

void fg_graph_capture_misused(uint64_t capture_id)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (captures[i] && captures[i]->capture_id == capture_id)
            captures[i]->invalidated = 1;
}

int fg_graph_capture_started(struct CUgraph_st *g)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (!captures[i]) {
            captures[i] = g;
            g->capture_id = ++last_capture_id;
            return 0;
        }
    return -1;
}

void fg_graph_capture_ended(struct CUgraph_st *g)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (captures[i] == g)
            captures[i] = NULL;
    g->capture_id = 0;
}
