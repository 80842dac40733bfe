/* Per-GPU state in a mapped file shared across processes (layout: page.h), guarded by a robust
 * process-shared mutex (a process killed while holding it leaves it recoverable, never deadlocked):
 * mapping it, the slots of the processes using the GPU, and their device memory. */
#include "page.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static struct fg_shared g_shared[FG_MAX_GPUS];
static pthread_mutex_t g_shared_mutex = PTHREAD_MUTEX_INITIALIZER;

void fg_shared_fork_lock(int lock)
{
    if (lock)
        pthread_mutex_lock(&g_shared_mutex);
    else
        pthread_mutex_unlock(&g_shared_mutex);
}

uint64_t fg_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

void fg_sleep_until(uint64_t deadline_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000ULL),
                          .tv_nsec = (long)(deadline_ns % 1000000000ULL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

void fg_page_lock(struct fg_page *p)
{
    if (pthread_mutex_lock(&p->lock) == EOWNERDEAD) {
        /* The holder died mid-update; every update leaves the fields usable, so carry on. */
        pthread_mutex_consistent(&p->lock);
    }
}

void fg_page_unlock(struct fg_page *p)
{
    pthread_mutex_unlock(&p->lock);
}

/* The pid of the process behind `owner`, while its slot still names it ({0, 0} once reused). */
struct fg_pid fg_owner_pid(struct fg_shared *s, int32_t owner)
{
    const struct fg_proc_slot *slot = &s->page->procs[owner & (FG_MAX_PROCS - 1)];
    if (!slot->used || fg_slot_owner(s->page, owner & (FG_MAX_PROCS - 1)) != owner)
        return (struct fg_pid){0, 0};
    return (struct fg_pid){slot->pid, slot->pidns};
}

uint64_t fg_own_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static void reap_dead(struct fg_shared *s)
{
    struct fg_page *p = s->page;
    for (int i = 0; i < FG_MAX_PROCS; i++) {
        struct fg_proc_slot *slot = &p->procs[i];
        if (!slot->used || fg_slot_alive(s, i))
            continue;
        if (slot->submitted > p->sched.run[i].completed)
            fg_sched_drop(s, i, fg_now_ns()); /* a real GPU drops a dead context's queued work */
        p->mem_used -= slot->mem_used;
        *slot = (struct fg_proc_slot){.generation = slot->generation};
    }
}

/* Finds or claims this process's slot; caller holds the page lock. NULL if none can be had. */
static struct fg_proc_slot *own_slot(struct fg_shared *s)
{
    int own = fg_own_slot_index(s);
    if (own >= 0)
        return &s->page->procs[own];
    int fd = fg_lock_fd(s);
    if (fd < 0)
        return NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            reap_dead(s);
        for (int i = 0; i < FG_MAX_PROCS; i++) {
            struct fg_proc_slot *slot = &s->page->procs[i];
            struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = FG_LOCK_BASE + i, .l_len = 1};
            if (slot->used)
                continue;
            if (fcntl(fd, F_OFD_SETLK, &fl) != 0) {
                if (errno == EAGAIN || errno == EACCES)
                    continue; /* freed by a process that is still exiting: it holds the lock */
                fprintf(stderr, "fakegpu: cannot lock %s: %s\n", s->path, strerror(errno));
                return NULL;
            }
            uint32_t generation = (slot->generation + 1) & FG_GENERATION_MASK;
            if (slot->submitted > s->page->sched.run[i].completed)
                fg_sched_drop(s, i, fg_now_ns()); /* left by a process that died unnoticed */
            *slot = (struct fg_proc_slot){
                .used = 1, .pid = getpid(), .generation = generation ? generation : 1, .pidns = fg_own_pidns()};
            s->page->sched.run[i] = (struct fg_run){0};
            if (s->page->slot_limit < (uint32_t)i + 1)
                s->page->slot_limit = (uint32_t)i + 1;
            s->slot = i;
            s->slot_pid = getpid();
            return slot;
        }
    }
    fprintf(stderr, "fakegpu: more than %d processes on one gpu\n", FG_MAX_PROCS);
    return NULL;
}

int32_t fg_own_owner_locked(struct fg_shared *s)
{
    struct fg_proc_slot *slot = own_slot(s);
    return slot ? fg_slot_owner(s->page, s->slot) : 0;
}

static struct fg_page *map_page(const char *path)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        fprintf(stderr, "fakegpu: cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    /* The first opener sizes and initialises the file under an exclusive flock; others wait. */
    flock(fd, LOCK_EX);
    struct stat st;
    struct fg_page *p = MAP_FAILED;
    int ok = fstat(fd, &st) == 0;
    int fresh = ok && st.st_size == 0;
    if (fresh) /* readable and writable by every user, as a GPU's device node is */
        ok = fchmod(fd, 0666) == 0 && ftruncate(fd, (off_t)sizeof(struct fg_page)) == 0;
    else if (ok && st.st_size != (off_t)sizeof(struct fg_page)) {
        fprintf(stderr, "fakegpu: %s has another layout; remove the state dir\n", path);
        ok = 0;
    }
    if (ok)
        p = mmap(NULL, sizeof(struct fg_page), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED && fresh) {
        pthread_mutexattr_t attr;
        pthread_mutexattr_init(&attr);
        pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&p->lock, &attr);
        pthread_mutexattr_destroy(&attr);
        p->size = sizeof *p;
        p->sched.running = -1;
        p->sched.loaded = -1;
        p->magic = FG_PAGE_MAGIC;
    }
    flock(fd, LOCK_UN);
    close(fd);
    if (p == MAP_FAILED) {
        if (ok)
            fprintf(stderr, "fakegpu: cannot map %s: %s\n", path, strerror(errno));
        return NULL;
    }
    if (p->magic != FG_PAGE_MAGIC || p->size != sizeof *p) {
        fprintf(stderr, "fakegpu: %s is not a fake gpu state file; remove the state dir\n", path);
        munmap(p, sizeof *p);
        return NULL;
    }
    return p;
}

struct fg_shared *fg_shared_get(const struct fg_config *cfg, int gpu)
{
    struct fg_shared *s = &g_shared[gpu];
    pthread_mutex_lock(&g_shared_mutex);
    if (!s->page) {
        snprintf(s->path, sizeof s->path, "%s/%s.gpu", cfg->state_dir, cfg->gpus[gpu].uuid);
        s->total = cfg->gpus[gpu].memory_bytes;
        s->slot = -1;
        s->lock_fd = -1;
        s->timeslice_ns = (uint64_t)cfg->gpus[gpu].timeslice_us * 1000ULL;
        s->switch_ns = (uint64_t)cfg->gpus[gpu].switch_us * 1000ULL;
        s->sms = cfg->gpus[gpu].sm_count;
        s->page = map_page(s->path);
    }
    pthread_mutex_unlock(&g_shared_mutex);
    return s->page ? s : NULL;
}

int fg_mem_charge(struct fg_shared *s, uint64_t bytes)
{
    int rc = -1;
    fg_page_lock(s->page);
    struct fg_proc_slot *slot = own_slot(s);
    if (slot && s->page->mem_used + bytes > s->total)
        reap_dead(s);
    if (slot && bytes <= s->total && s->page->mem_used + bytes <= s->total) {
        s->page->mem_used += bytes;
        slot->mem_used += bytes;
        rc = 0;
    }
    fg_page_unlock(s->page);
    return rc;
}

void fg_mem_uncharge(struct fg_shared *s, uint64_t bytes)
{
    fg_page_lock(s->page);
    struct fg_proc_slot *slot = own_slot(s);
    if (slot) {
        uint64_t give = bytes < slot->mem_used ? bytes : slot->mem_used;
        slot->mem_used -= give;
        s->page->mem_used -= give;
    }
    fg_page_unlock(s->page);
}

uint64_t fg_mem_used(struct fg_shared *s)
{
    fg_page_lock(s->page);
    reap_dead(s);
    uint64_t used = s->page->mem_used;
    fg_page_unlock(s->page);
    return used;
}

void fg_proc_context(struct fg_shared *s, int delta)
{
    fg_page_lock(s->page);
    struct fg_proc_slot *slot = own_slot(s);
    if (slot && slot->contexts + delta >= 0)
        slot->contexts += delta;
    fg_page_unlock(s->page);
}

int fg_procs(struct fg_shared *s, struct fg_proc_info *out, int max)
{
    int n = 0;
    fg_page_lock(s->page);
    reap_dead(s);
    for (int i = 0; i < FG_MAX_PROCS; i++) {
        const struct fg_proc_slot *slot = &s->page->procs[i];
        if (!slot->used || (slot->contexts == 0 && slot->mem_used == 0))
            continue;
        if (n < max)
            out[n] = (struct fg_proc_info){.pid = {slot->pid, slot->pidns}, .mem_used = slot->mem_used};
        n++;
    }
    fg_page_unlock(s->page);
    return n;
}

/* A real driver frees a process's memory when it exits; do it at once rather than when reaped. */
__attribute__((destructor)) static void release_process(void)
{
    for (int g = 0; g < FG_MAX_GPUS; g++) {
        struct fg_shared *s = &g_shared[g];
        int own = s->page ? fg_own_slot_index(s) : -1;
        if (own < 0)
            continue;
        fg_page_lock(s->page);
        struct fg_proc_slot *slot = &s->page->procs[own];
        if (slot->submitted > s->page->sched.run[own].completed)
            fg_sched_drop(s, own, fg_now_ns()); /* its queued work goes with it, as on a real GPU */
        s->page->mem_used -= slot->mem_used;
        *slot = (struct fg_proc_slot){.generation = slot->generation};
        s->slot = -1;
        fg_page_unlock(s->page);
        close(s->lock_fd); /* the slot is free for others at once, even if the library is reloaded */
        s->lock_fd = -1;
    }
}
