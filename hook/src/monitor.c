/* One background thread per process (started by devices.c once the process joins the region,
 * restarted in a forked child), which wakes every MONITOR_PERIOD_NS to
 *  - resize the quotas (live resize: devices.c re-reads the limits file when another took its place);
 *  - return the memory of dead processes: whichever process's thread finds the region's last scan
 *    older than SCAN_PERIOD_NS claims the scan with a compare-and-swap, so a container scans about
 *    four times a second however many processes it has;
 *  - in elastic mode, judge whether another container uses the GPU: NVML's utilization of the GPU
 *    minus the device time this container was charged over the same time;
 *  - open the coordination slots of containers that came to this container's GPUs (qos.c). */
#define _GNU_SOURCE
#include <nvml.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "symbols.h"
#include "vgpu.h"

#define MONITOR_PERIOD_NS 100000000ull
#define SCAN_PERIOD_NS 250000000ull
#define OWN_WINDOW 5               /* periods over which the container's own use is averaged */
#define OTHERS_BUSY_PERCENT 15     /* more than this from others: they need the GPU */
#define IDLE_BEFORE_ELASTIC_NS 1000000000ull

static pid_t monitor_pid;
/* Set before the first thread starts, never changed after (one caller, one function). */
static void (*resize_quotas)(void);
static pthread_mutex_t monitor_lock = PTHREAD_MUTEX_INITIALIZER;

struct elastic_state {
    int ours;
    uint64_t others_seen_ns;
    uint64_t busy[OWN_WINDOW];
    uint64_t at[OWN_WINDOW];
    unsigned util[OWN_WINDOW];
    unsigned util_sum;
    int next;
    nvmlDevice_t nvml;
};
static struct elastic_state elastic[VGPU_MAX_DEVICES];

/* Relaxed: a launch that reads a stale verdict runs one launch at the old rate, nothing worse. */
int vgpu_monitor_gpu_is_ours(int rdev) { return __atomic_load_n(&elastic[rdev].ours, __ATOMIC_RELAXED); }

static void scan_if_due(struct vgpu_region *r, uint64_t now) {
    uint64_t last = __atomic_load_n(&r->last_scan_ns, __ATOMIC_RELAXED);
    if (now - last < SCAN_PERIOD_NS) return;
    /* Only the process that moves last_scan_ns scans; the others see it fresh. */
    if (__atomic_compare_exchange_n(&r->last_scan_ns, &last, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        vgpu_region_reclaim_dead();
}

static void judge_elastic(struct vgpu_region *r, int d, uint64_t now) {
    struct elastic_state *e = &elastic[d];
    if (!e->nvml && REAL(nvmlDeviceGetHandleByUUID)(r->dev[d].uuid, &e->nvml) != NVML_SUCCESS) return;
    nvmlUtilization_t util;
    if (REAL(nvmlDeviceGetUtilizationRates)(e->nvml, &util) != NVML_SUCCESS) return;
    /* Both averaged over the same periods: NVML's utilization lags the charges, never leads them,
     * so a lag reads as "others are idle" only while our own use is rising. */
    e->util_sum += util.gpu - e->util[e->next];
    e->util[e->next] = util.gpu;
    uint64_t busy = __atomic_load_n(&r->dev[d].busy_ns, __ATOMIC_RELAXED);
    int oldest = (e->next + 1) % OWN_WINDOW;
    e->busy[e->next] = busy;
    e->at[e->next] = now;
    e->next = oldest;
    if (!e->at[oldest]) return; /* not a full window yet */
    double own = 100.0 * (double)(busy - e->busy[oldest]) / (double)(now - e->at[oldest]);
    double others = (double)e->util_sum / OWN_WINDOW - own;
    if (others > OTHERS_BUSY_PERCENT) {
        e->others_seen_ns = now;
        __atomic_store_n(&e->ours, 0, __ATOMIC_RELAXED);
    } else if (now - e->others_seen_ns > IDLE_BEFORE_ELASTIC_NS) {
        __atomic_store_n(&e->ours, 1, __ATOMIC_RELAXED);
    }
}

static void *monitor(void *unused) {
    (void)unused;
    const struct vgpu_limits *c = vgpu_limits();
    int nvml = c->elastic && REAL(nvmlInit_v2) && REAL(nvmlInit_v2)() == NVML_SUCCESS;
    uint64_t started = vgpu_now_ns();
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) elastic[d].others_seen_ns = started;
    for (;;) {
        struct timespec t = {.tv_sec = 0, .tv_nsec = (long)MONITOR_PERIOD_NS};
        nanosleep(&t, NULL);
        resize_quotas();
        struct vgpu_region *r = vgpu_region_attach();
        if (!r) continue;
        uint64_t now = vgpu_now_ns();
        scan_if_due(r, now);
        vgpu_qos_refresh();
        uint32_t devices = vgpu_region_devices(r);
        for (uint32_t d = 0; nvml && d < devices; d++)
            if (vgpu_cores_limit((int)r->dev[d].cores)) judge_elastic(r, (int)d, now);
    }
    return NULL;
}

void vgpu_monitor_ensure(void (*resize)(void)) {
    pid_t pid = getpid();
    /* Double-checked: the pid is stored (release) after the thread started, under monitor_lock. */
    if (__atomic_load_n(&monitor_pid, __ATOMIC_ACQUIRE) == pid) return;
    pthread_mutex_lock(&monitor_lock);
    if (monitor_pid != pid) {
        resize_quotas = resize;
        /* The host program's signals must never be delivered to this thread. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        pthread_t thread;
        if (pthread_create(&thread, &attr, monitor, NULL) != 0)
            vgpu_log("cannot start the monitor thread; dead processes' memory returns only when the quota is hit");
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        __atomic_store_n(&monitor_pid, pid, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&monitor_lock);
}

void vgpu_monitor_after_fork_child(void) {
    monitor_pid = 0;
    pthread_mutex_init(&monitor_lock, NULL);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) elastic[d] = (struct elastic_state){0};
}
