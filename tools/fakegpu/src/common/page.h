/* The layout of a GPU's state file (`<state dir>/<uuid>.gpu`), private to the common code: shared.c
 * maps it and keeps the process slots and memory, liveness.c tells whether a slot's process lives,
 * sched.c runs the scheduler model over the work queued in it and writes the record of when the GPU
 * was busy, which timeline.c reads. Every field is changed only under the page lock, and every
 * update leaves the fields usable (a holder may die mid-update).
 *
 * The files depend on each other one way: shared.c drops a dead process's work through sched.c,
 * which asks liveness.c; timeline.c and work.c run the model and use the slots. */
#ifndef FAKEGPU_PAGE_H
#define FAKEGPU_PAGE_H

#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

#include "shared.h"

#define FG_PAGE_MAGIC 0x3450474b454b4146ULL /* "FAKEGPU4" */
#define FG_MAX_PROCS 256
#define FG_RING 16384
#define FG_SLOT_BITS 8 /* an owner id is generation << FG_SLOT_BITS | slot */
#define FG_GENERATION_MASK 0x7fffffu
/* Work items one process may have queued on one GPU: a launch past it waits for the oldest, as a
 * stream past its own depth does (stream.c). Several streams' worth, so a stream's depth binds first. */
#define FG_QUEUE 2048
/* The scheduler's index of the MPS server, the one context all MPS clients' work runs in. */
#define FG_MPS FG_MAX_PROCS

/* One process using the GPU. Liveness is an OFD lock the owner holds on byte (sizeof page + slot)
 * of the state file while it lives: the kernel drops it when the process dies, however it dies, and
 * it works across PID namespaces (containers sharing the state dir), where pids mean nothing. */
struct fg_proc_slot {
    int32_t used;
    int32_t pid; /* as the process sees itself; may repeat across PID namespaces */
    int32_t contexts;
    uint32_t generation; /* bumped at each claim, so an owner id names one process */
    uint64_t mem_used;
    uint64_t pidns;     /* the inode of its PID namespace: with `pid`, what NVML translates (fg_pid) */
    uint64_t submitted; /* the number of the last work item it queued (items are numbered from 1) */
    int32_t mps;        /* an MPS client: its work runs in the MPS server's context */
    int32_t low_priority; /* MPS: CUDA_MPS_CLIENT_PRIORITY=1 */
    int32_t sm_cap;       /* MPS: the most SMs one of its kernels may take */
    int32_t unused;
};

/* A kernel in a process's queue. Its duration: `ns` if blocks == 0 (sleep_us_<N>), else the launch
 * overhead plus `ns` per wave of `blocks` over the SMs it runs on. */
struct fg_item {
    uint64_t submit_ns; /* when the GPU learnt of it: it cannot start before */
    uint64_t end_ns;    /* when it completed, once it has */
    uint64_t ns;
    uint64_t blocks;
};

/* What the scheduler knows of one process's queue. */
struct fg_run {
    uint64_t completed;   /* the number of its last completed item: the rest up to `submitted` wait */
    uint64_t left_ns;     /* work left of its first item, once started */
    uint64_t ready_ns;    /* when it was preempted with work left: its place in the round robin */
    uint64_t piece_ns;    /* start of its open busy piece (struct fg_busy), 0 if none */
    uint64_t last_end_ns; /* when its previous item completed (MPS: how long its next one waited) */
    int32_t started;      /* its first item has started */
    int32_t sms;          /* MPS: the SMs its running kernel holds */
};

/* The scheduler's state, as of `now_ns` (sched.c). A prediction runs a copy of it forward. */
struct fg_sched {
    uint64_t now_ns;          /* simulated up to here; work queued later arrives later */
    uint64_t switch_until_ns; /* a context switch to `running` lasts until here */
    uint64_t run_start_ns;    /* when `running` got the GPU (after the switch) */
    uint64_t slice_end_ns;    /* 0, or when `running` must give the GPU to one waiting */
    uint64_t mps_ready_ns;    /* the MPS server's `ready_ns` */
    uint64_t mps_piece_ns;    /* the MPS server's open busy piece */
    int32_t running;          /* the context holding the GPU: a slot, FG_MPS, or -1 */
    int32_t loaded;           /* the context last loaded: running it again costs no switch */
    int32_t held_sms;         /* SMs held by MPS kernels */
    int32_t unused;
    struct fg_run run[FG_MAX_PROCS];
};

/* A stretch of time the GPU, or one process on it, ran a kernel (sched.c writes it, timeline.c
 * reads it). */
struct fg_busy {
    uint64_t start_ns;
    uint64_t end_ns;
    int32_t owner; /* the process, by its slot: its pid is the slot's; 0: the MPS server */
    int32_t flags; /* FG_BUSY_* */
};
#define FG_BUSY_DEVICE 1 /* counts as the GPU busy */
#define FG_BUSY_OWNER 2  /* counts as `owner` busy */

struct fg_page {
    uint64_t magic;
    uint64_t size;
    pthread_mutex_t lock;
    uint64_t mem_used;
    uint32_t ring_next; /* index of the next busy record to write */
    uint32_t ring_count;
    uint32_t slot_limit; /* 1 + the highest slot ever claimed: the scheduler looks no further */
    uint32_t unused;
    struct fg_sched sched;
    struct fg_proc_slot procs[FG_MAX_PROCS];
    struct fg_busy ring[FG_RING];
    struct fg_item items[FG_MAX_PROCS][FG_QUEUE];
};

/* Byte `FG_LOCK_BASE + slot` of the state file: the lock that tells the slot's process lives. */
#define FG_LOCK_BASE ((off_t)sizeof(struct fg_page))

/* This process's view of one GPU's state. */
struct fg_shared {
    struct fg_page *page;
    char path[PATH_MAX + 64];
    uint64_t total;
    int slot;       /* this process's slot, -1 until it charges memory or holds a context */
    pid_t slot_pid; /* the pid that claimed `slot` (a forked child claims its own) */
    int lock_fd;    /* this process's own open file description of the state file */
    pid_t lock_pid;
    /* The scheduler model's parameters (config: timeslice_us, switch_us, sms). */
    uint64_t timeslice_ns;
    uint64_t switch_ns;
    int sms;
    /* Completion times of this process's items, kept after the page's queue reuses their places. */
    uint64_t *history;
    int32_t history_owner;
    uint64_t history_pulled;
};

/* The owner id of the process in slot i now (its generation and the slot). */
static inline int32_t fg_slot_owner(const struct fg_page *p, int i)
{
    return (int32_t)(p->procs[i].generation << FG_SLOT_BITS | (uint32_t)i);
}

/* This process's slot, -1 if it holds none (a forked child claims its own). */
static inline int fg_own_slot_index(const struct fg_shared *s)
{
    return s->slot >= 0 && s->slot_pid == getpid() ? s->slot : -1;
}

/* liveness.c: with the page lock held. */
/* This process's own open file description of the state file (-1 after a message on stderr). */
int fg_lock_fd(struct fg_shared *s);
/* 1 while the process in `slot` lives (or when it cannot be told), 0 once it died or exited. */
int fg_slot_alive(struct fg_shared *s, int slot);

/* shared.c, for timeline.c and work.c (the owner functions with the page lock held). */
int32_t fg_own_owner_locked(struct fg_shared *s);
void fg_page_lock(struct fg_page *p);
void fg_page_unlock(struct fg_page *p);
struct fg_pid fg_owner_pid(struct fg_shared *s, int32_t owner);

/* sched.c: with the page lock held. */
/* Runs the model up to `now` (no earlier than where it is), and drops the work of processes that died. */
void fg_sched_advance(struct fg_shared *s, uint64_t now);
/* Drops the queued work of a slot as of `now` (its process exited or died). */
void fg_sched_drop(struct fg_shared *s, int slot, uint64_t now);
/* When item `seq` of `slot` would complete if no more work came: a copy of the model run forward. */
uint64_t fg_sched_predict(struct fg_shared *s, int slot, uint64_t seq);
/* Closes the open busy pieces at the model's now and opens them again there (before reading records). */
void fg_sched_flush(struct fg_shared *s);

#endif
