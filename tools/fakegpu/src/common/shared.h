/* Per-GPU state shared by every process using one fake GPU: a mapped file `<state dir>/<uuid>.gpu`
 * holding memory usage per process and the device timeline (when the GPU is busy, and for whom).
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

/* Puts `duration_ns` of work on the device timeline, starting no earlier than `not_before_ns`
 * (CLOCK_MONOTONIC) and after all work already queued by any process. Returns its end. */
uint64_t fg_timeline_submit(struct fg_shared *s, uint64_t not_before_ns, uint64_t duration_ns);

/* A process that put work on the timeline: `owner` names it uniquely (pids may repeat across PID
 * namespaces), `pid` is what it calls itself. */
struct fg_owner {
    int32_t owner;
    struct fg_pid pid;
};

/* Nanoseconds the GPU was busy within [from_ns, to_ns]; for one owner if owner != 0. `covered_from`
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
