/* MPS clients. A real client talks to the MPS control daemon through the directory
 * CUDA_MPS_PIPE_DIRECTORY names, and runs its work in the daemon's server if one answers there. The
 * fake's stand-in daemon (tools/fakegpu/mps/mps_control.c) holds a lock on FG_MPS_LOCK_FILE in that
 * directory while it runs; a client finds it by that lock. Only the variable is read, not the real
 * default /tmp/nvidia-mps: tests sharing a machine must not become each other's clients. */
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "../common/mps_lock.h"


static struct fg_client g_client = {.mps = 0, .low_priority = 0, .percentage = 100.0};
static pthread_once_t g_client_once = PTHREAD_ONCE_INIT;

static void decide(void)
{
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (!dir || !*dir || !fg_mps_daemon_runs(dir))
        return;
    g_client.mps = 1;
    const char *priority = getenv("CUDA_MPS_CLIENT_PRIORITY");
    if (priority && *priority) {
        if (strcmp(priority, "0") == 0 || strcmp(priority, "1") == 0)
            g_client.low_priority = priority[0] == '1';
        else
            fprintf(stderr, "fakegpu: CUDA_MPS_CLIENT_PRIORITY: bad value '%s' (want 0 or 1); using 0\n", priority);
    }
    const char *percentage = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    if (percentage && *percentage) {
        char *end;
        double p = strtod(percentage, &end);
        if (*end == '\0' && p > 0 && p <= 100)
            g_client.percentage = p;
        else
            fprintf(stderr, "fakegpu: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: bad value '%s' (want 0 to 100); using 100\n",
                    percentage);
    }
}

const struct fg_client *fg_client(void)
{
    pthread_once(&g_client_once, decide);
    return &g_client;
}
