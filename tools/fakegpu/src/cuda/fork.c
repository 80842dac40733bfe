/* fork(): the process-local locks are held across it, in lock order, so a child never inherits one
 * held by a thread it does not have. Above every file whose lock it takes. */
#include "internal.h"

static void fork_prepare(void)
{
    pthread_mutex_lock(&fg_lock);
    fg_vmm_fork_lock(1);
    fg_memory_fork_lock(1);
    fg_shared_fork_lock(1);
}

static void fork_done(void)
{
    fg_shared_fork_lock(0);
    fg_memory_fork_lock(0);
    fg_vmm_fork_lock(0);
    pthread_mutex_unlock(&fg_lock);
}

__attribute__((constructor)) static void register_fork_handlers(void)
{
    pthread_atfork(fork_prepare, fork_done, fork_done);
}
