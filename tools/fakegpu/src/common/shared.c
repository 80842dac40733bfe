/* Per-GPU state in a mapped file shared across processes, guarded by a robust process-shared mutex
 * (a process killed while holding it leaves it recoverable, never deadlocked). */
#include "shared.h"

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

#define FG_PAGE_MAGIC 0x3350474b454b4146ULL /* "FAKEGPU3" */
#define FG_MAX_PROCS 256
#define FG_RING 16384
#define FG_SLOT_BITS 8 /* an owner id is generation << FG_SLOT_BITS | slot */
#define FG_GENERATION_MASK 0x7fffffu

/* One process using the GPU. Liveness is an OFD lock the owner holds on byte (sizeof page + slot)
 * of the state file while it lives: the kernel drops it when the process dies, however it dies, and
 * it works across PID namespaces (containers sharing the state dir), where pids mean nothing. */
struct fg_proc_slot {
    int32_t used;
    int32_t pid; /* as the process sees itself; may repeat across PID namespaces */
    int32_t contexts;
    uint32_t generation; /* bumped at each claim, so an owner id names one process */
    uint64_t mem_used;
    uint64_t pidns; /* the inode of its PID namespace: with `pid`, what NVML translates (fg_pid) */
};

struct fg_busy {
    uint64_t start_ns;
    uint64_t end_ns;
    int32_t owner; /* the process, by its slot: its pid is the slot's */
    int32_t unused;
};

struct fg_page {
    uint64_t magic;
    uint64_t size;
    pthread_mutex_t lock;
    uint64_t mem_used;
    uint64_t busy_until_ns;
    uint32_t ring_next; /* index of the next record to write */
    uint32_t ring_count;
    struct fg_proc_slot procs[FG_MAX_PROCS];
    struct fg_busy ring[FG_RING];
};

#define FG_LOCK_BASE ((off_t)sizeof(struct fg_page))

struct fg_shared {
    struct fg_page *page;
    char path[PATH_MAX + 64];
    uint64_t total;
    int slot;       /* this process's slot, -1 until it charges memory or holds a context */
    pid_t slot_pid; /* the pid that claimed `slot` (a forked child claims its own) */
    int lock_fd;    /* this process's own open file description of the state file */
    pid_t lock_pid;
};

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

static void page_lock(struct fg_page *p)
{
    if (pthread_mutex_lock(&p->lock) == EOWNERDEAD) {
        /* The holder died mid-update; every update leaves the fields usable, so carry on. */
        pthread_mutex_consistent(&p->lock);
    }
}

static void page_unlock(struct fg_page *p)
{
    pthread_mutex_unlock(&p->lock);
}

/* The OFD of this process (a forked child must not use its parent's: it would see the parent's
 * locks as its own). Caller holds the page lock. */
static int lock_fd(struct fg_shared *s)
{
    pid_t pid = getpid();
    if (s->lock_fd >= 0 && s->lock_pid == pid)
        return s->lock_fd;
    if (s->lock_fd >= 0)
        close(s->lock_fd); /* the inherited copy: the parent's locks live on through its own */
    s->lock_fd = open(s->path, O_RDWR | O_CLOEXEC);
    s->lock_pid = pid;
    if (s->lock_fd < 0)
        fprintf(stderr, "fakegpu: cannot open %s: %s\n", s->path, strerror(errno));
    return s->lock_fd;
}

static int own_slot_index(const struct fg_shared *s)
{
    return s->slot >= 0 && s->slot_pid == getpid() ? s->slot : -1;
}

static int slot_alive(struct fg_shared *s, int i)
{
    if (i == own_slot_index(s))
        return 1;
    int fd = lock_fd(s);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = FG_LOCK_BASE + i, .l_len = 1};
    if (fd < 0 || fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return 1; /* cannot tell: keep it */
    return fl.l_type != F_UNLCK;
}

static int owner_alive(struct fg_shared *s, int32_t owner)
{
    int i = owner & (FG_MAX_PROCS - 1);
    const struct fg_proc_slot *slot = &s->page->procs[i];
    return slot->used && (int32_t)(slot->generation << FG_SLOT_BITS | (uint32_t)i) == owner && slot_alive(s, i);
}

/* The pid of the process behind `owner`, while its slot still names it ({0, 0} once reused). */
static struct fg_pid owner_pid(struct fg_shared *s, int32_t owner)
{
    const struct fg_proc_slot *slot = &s->page->procs[owner & (FG_MAX_PROCS - 1)];
    if (!slot->used || (int32_t)(slot->generation << FG_SLOT_BITS | (uint32_t)(owner & (FG_MAX_PROCS - 1))) != owner)
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
        if (!slot->used || slot_alive(s, i))
            continue;
        p->mem_used -= slot->mem_used;
        *slot = (struct fg_proc_slot){.generation = slot->generation};
    }
}

/* Finds or claims this process's slot; caller holds the page lock. NULL if none can be had. */
static struct fg_proc_slot *own_slot(struct fg_shared *s)
{
    int own = own_slot_index(s);
    if (own >= 0)
        return &s->page->procs[own];
    int fd = lock_fd(s);
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
            *slot = (struct fg_proc_slot){
                .used = 1, .pid = getpid(), .generation = generation ? generation : 1, .pidns = fg_own_pidns()};
            s->slot = i;
            s->slot_pid = getpid();
            return slot;
        }
    }
    fprintf(stderr, "fakegpu: more than %d processes on one gpu\n", FG_MAX_PROCS);
    return NULL;
}

static int32_t own_owner(struct fg_shared *s)
{
    struct fg_proc_slot *slot = own_slot(s);
    return slot ? (int32_t)(slot->generation << FG_SLOT_BITS | (uint32_t)s->slot) : 0;
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
        s->page = map_page(s->path);
    }
    pthread_mutex_unlock(&g_shared_mutex);
    return s->page ? s : NULL;
}

int fg_mem_charge(struct fg_shared *s, uint64_t bytes)
{
    int rc = -1;
    page_lock(s->page);
    struct fg_proc_slot *slot = own_slot(s);
    if (slot && s->page->mem_used + bytes > s->total)
        reap_dead(s);
    if (slot && bytes <= s->total && s->page->mem_used + bytes <= s->total) {
        s->page->mem_used += bytes;
        slot->mem_used += bytes;
        rc = 0;
    }
    page_unlock(s->page);
    return rc;
}

void fg_mem_uncharge(struct fg_shared *s, uint64_t bytes)
{
    page_lock(s->page);
    struct fg_proc_slot *slot = own_slot(s);
    if (slot) {
        uint64_t give = bytes < slot->mem_used ? bytes : slot->mem_used;
        slot->mem_used -= give;
        s->page->mem_used -= give;
    }
    page_unlock(s->page);
}

uint64_t fg_mem_used(struct fg_shared *s)
{
    page_lock(s->page);
    reap_dead(s);
    uint64_t used = s->page->mem_used;
    page_unlock(s->page);
    return used;
}

void fg_proc_context(struct fg_shared *s, int delta)
{
    page_lock(s->page);
    struct fg_proc_slot *slot = own_slot(s);
    if (slot && slot->contexts + delta >= 0)
        slot->contexts += delta;
    page_unlock(s->page);
}

int fg_procs(struct fg_shared *s, struct fg_proc_info *out, int max)
{
    int n = 0;
    page_lock(s->page);
    reap_dead(s);
    for (int i = 0; i < FG_MAX_PROCS; i++) {
        const struct fg_proc_slot *slot = &s->page->procs[i];
        if (!slot->used || (slot->contexts == 0 && slot->mem_used == 0))
            continue;
        if (n < max)
            out[n] = (struct fg_proc_info){.pid = {slot->pid, slot->pidns}, .mem_used = slot->mem_used};
        n++;
    }
    page_unlock(s->page);
    return n;
}

/* A real GPU drops the queued work of a process that died. The fake can only drop it while it is
 * the last work queued (later work of others was placed after it already); caller holds the lock. */
static void drop_dead_tail(struct fg_shared *s, int32_t self, uint64_t now)
{
    struct fg_page *p = s->page;
    int dropped = 0;
    while (p->ring_count > 0) {
        uint32_t last = (p->ring_next + FG_RING - 1) % FG_RING;
        struct fg_busy *b = &p->ring[last];
        if (b->end_ns <= now || b->owner == self || owner_alive(s, b->owner))
            break;
        dropped = 1;
        if (b->start_ns < now) {
            b->end_ns = now;
            break;
        }
        p->ring_next = last;
        p->ring_count--;
    }
    if (dropped) {
        uint32_t last = (p->ring_next + FG_RING - 1) % FG_RING;
        p->busy_until_ns = p->ring_count > 0 && p->ring[last].end_ns > now ? p->ring[last].end_ns : now;
    }
}

uint64_t fg_timeline_submit(struct fg_shared *s, uint64_t not_before_ns, uint64_t duration_ns)
{
    struct fg_page *p = s->page;
    uint64_t now = fg_now_ns();
    page_lock(p);
    int32_t owner = own_owner(s);
    if (p->busy_until_ns > now)
        drop_dead_tail(s, owner, now);
    uint64_t start = not_before_ns > now ? not_before_ns : now;
    if (p->busy_until_ns > start)
        start = p->busy_until_ns;
    uint64_t end = start + duration_ns;
    p->busy_until_ns = end;
    uint32_t last = (p->ring_next + FG_RING - 1) % FG_RING;
    if (p->ring_count > 0 && p->ring[last].owner == owner && p->ring[last].end_ns == start) {
        p->ring[last].end_ns = end; /* back-to-back work of one process: one record */
    } else {
        p->ring[p->ring_next] =
            (struct fg_busy){.start_ns = start, .end_ns = end, .owner = owner};
        p->ring_next = (p->ring_next + 1) % FG_RING;
        if (p->ring_count < FG_RING)
            p->ring_count++;
    }
    page_unlock(p);
    return end;
}

uint64_t fg_timeline_busy(struct fg_shared *s, uint64_t from_ns, uint64_t to_ns, int32_t owner,
                          uint64_t *covered_from)
{
    struct fg_page *p = s->page;
    uint64_t busy = 0, covered = from_ns;
    page_lock(p);
    for (uint32_t k = 0; k < p->ring_count; k++) {
        const struct fg_busy *b = &p->ring[(p->ring_next + FG_RING - 1 - k) % FG_RING];
        if (b->end_ns <= from_ns)
            break;
        if (k == FG_RING - 1 && b->start_ns > from_ns)
            covered = b->start_ns; /* the ring dropped older records inside the window */
        if (owner != 0 && b->owner != owner)
            continue;
        uint64_t a = b->start_ns > from_ns ? b->start_ns : from_ns;
        uint64_t e = b->end_ns < to_ns ? b->end_ns : to_ns;
        if (e > a)
            busy += e - a;
    }
    page_unlock(p);
    if (covered_from)
        *covered_from = covered;
    return busy;
}

int fg_timeline_owners(struct fg_shared *s, uint64_t from_ns, uint64_t to_ns, struct fg_owner *out, int max)
{
    struct fg_page *p = s->page;
    int n = 0;
    page_lock(p);
    for (uint32_t k = 0; k < p->ring_count; k++) {
        const struct fg_busy *b = &p->ring[(p->ring_next + FG_RING - 1 - k) % FG_RING];
        if (b->end_ns <= from_ns)
            break;
        if (b->start_ns >= to_ns)
            continue;
        int seen = 0;
        for (int i = 0; i < n && i < max; i++)
            seen |= out[i].owner == b->owner;
        if (!seen) {
            if (n < max)
                out[n] = (struct fg_owner){.owner = b->owner, .pid = owner_pid(s, b->owner)};
            n++;
        }
    }
    page_unlock(p);
    return n;
}

/* A real driver frees a process's memory when it exits; do it at once rather than when reaped. */
__attribute__((destructor)) static void release_process(void)
{
    for (int g = 0; g < FG_MAX_GPUS; g++) {
        struct fg_shared *s = &g_shared[g];
        int own = s->page ? own_slot_index(s) : -1;
        if (own < 0)
            continue;
        page_lock(s->page);
        struct fg_proc_slot *slot = &s->page->procs[own];
        s->page->mem_used -= slot->mem_used;
        *slot = (struct fg_proc_slot){.generation = slot->generation};
        s->slot = -1;
        page_unlock(s->page);
        close(s->lock_fd); /* the slot is free for others at once, even if the library is reloaded */
        s->lock_fd = -1;
    }
}
