/* Process lifecycle: loading costs nothing (everything else starts on first use), and a forked
 * child starts afresh, since its CUDA state is not its parent's. */
#include <pthread.h>

#include "vgpu.h"

static void after_fork_child(void) {
    vgpu_region_after_fork_child();
    vgpu_devices_after_fork_child();
    vgpu_track_after_fork_child();
    vgpu_compute_after_fork_child();
    vgpu_capture_after_fork_child();
    vgpu_qos_after_fork_child();
    vgpu_monitor_after_fork_child();
}

__attribute__((constructor)) static void loaded(void) { pthread_atfork(NULL, NULL, after_fork_child); }
