/* Per-GPU state shared by every process using one fake GPU: a mapped file `<state dir>/<uuid>.gpu`
 * holding memory usage per process, the work each process queued and the scheduler model's state
 * (what runs when: sched.c), and the record of when the GPU was busy, and for whom.
 * Processes may live in different PID namespaces (containers sharing the state dir). */
#ifndef FAKEGPU_SHARED_H
#define FAKEGPU_SHARED_H

#include <stdint.h>
#include <sys/types.h>

#include "config.h"

struct fg_shared;

/* The shared state of cfg->gpus[gpu]; NULL (after a message on stderr) if it cannot be mapped. */
struct fg_shared *fg_shared_get(const struct fg_config *cfg, int gpu);

/* Charges `bytes` of device memory to this process: 0, or -1 when it does not fit the GPU. */
int fg_mem_charge(struct fg_shared *s, uint64_t bytes);
void fg_mem_uncharge(struct fg_shared *s, uint64_t bytes);
/* Bytes in use on the GPU, after returning the memory of processes that exited. */
uint64_t fg_mem_used(struct fg_shared *s);

/* This process holds (+1) or dropped (-1) a context on the GPU; listed by NVML while it holds one. */
void fg_proc_context(struct fg_shared *s, int delta);

/* A process as it saw itself: its pid in its own PID namespace, and that namespace's inode (0: not
 * known). A real driver reports processes by their pid in the host's namespace; the fake has no
 * kernel side, so NVML translates this into the pid its caller sees (fg_visible_pid). */
struct fg_pid {
    pid_t pid;
    uint64_t pidns;
};
/* The inode of the calling process's PID namespace, 0 if /proc cannot tell. */
uint64_t fg_own_pidns(void);

struct fg_proc_info {
    struct fg_pid pid;
    uint64_t mem_used;
};
/* Live processes with a context or memory on the GPU; returns how many (may exceed `max`). */
int fg_procs(struct fg_shared *s, struct fg_proc_info *out, int max);

/* A kernel: it runs `ns` if blocks == 0 (sleep_us_<N>), else the launch overhead plus `ns` per wave
 * of `blocks` over the SMs it runs on (all of the GPU's, or an MPS client's share). */
struct fg_work {
    uint64_t ns;
    uint64_t blocks;
};
#define FG_LAUNCH_OVERHEAD_NS 10000ULL

/* How this process's work shares the GPU (docs/fakegpu.md, "Time model"): an MPS client's kernels
 * run in the MPS server's context beside other clients', on at most `percentage` of the SMs, and
 * after normal-priority clients' waiting kernels if low_priority. */
struct fg_client {
    int mps;
    int low_priority;
    double percentage;
};

/* One queued work item: the process that queued it (its owner id) and its number (0: none). */
struct fg_ref {
    int32_t owner;
    uint64_t seq;
};

/* Queues a kernel after this process's earlier work on the GPU; waits while FG_QUEUE of its items
 * are queued. Its completion depends on what every process queues: ask fg_work_done. */
struct fg_ref fg_work_submit(struct fg_shared *s, const struct fg_work *work, const struct fg_client *client);
/* 1 if the item completed by now (then *end_ns: when; 0 if too long ago to know), else 0. An item
 * of another process (a parent's, after fork) or none counts as completed. */
int fg_work_done(struct fg_shared *s, struct fg_ref ref, uint64_t *end_ns);
/* Sleeps until the item completed; returns when it did (as fg_work_done). */
uint64_t fg_work_wait(struct fg_shared *s, struct fg_ref ref);

/* A process that put work on the timeline: `owner` names it uniquely (pids may repeat across PID
 * namespaces), `pid` is what it calls itself. */
struct fg_owner {
    int32_t owner;
    struct fg_pid pid;
};

/* Nanoseconds the GPU ran some kernel within [from_ns, to_ns]; one owner's kernels if owner != 0. `covered_from`
 * receives the start of the span the records still cover (>= from_ns when old records were dropped). */
uint64_t fg_timeline_busy(struct fg_shared *s, uint64_t from_ns, uint64_t to_ns, int32_t owner,
                          uint64_t *covered_from);

/* Processes that ran work within [from_ns, to_ns]; returns how many (may exceed `max`). */
int fg_timeline_owners(struct fg_shared *s, uint64_t from_ns, uint64_t to_ns, struct fg_owner *out, int max);

/* fork(): hold (lock != 0) or release this library's lock of the mapped files, last in lock order. */
void fg_shared_fork_lock(int lock);

uint64_t fg_now_ns(void);
void fg_sleep_until(uint64_t deadline_ns);

#endif
