/* QoS classes on a shared GPU: each GPU has a coordination area, a directory shared by the
 * containers on it, with one slot (a small file) per container, in a subdirectory named after the
 * container's class:
 *
 *   <coordination>/<uuid>/latency-critical/<slot>   every container's slot, read-only to all
 *   <coordination>/<uuid>/standard/<slot>
 *   <coordination>/<uuid>/best-effort/<slot>
 *   <coordination>/<uuid>.slot                      this container's own slot, writable (managed)
 *
 * The device plugin creates the slots and mounts the GPU's directory read-only and the container's
 * own slot read-write, so a container writes only its own slot and cannot move it to another class
 * (docs/hook.md, "QoS classes on the GPU", says what a container can and cannot do). Standalone
 * (TESSERA_COORDINATION), each process creates its own slot, <pid>, in its class's directory.
 *
 * A latency-critical or standard container publishes in its slot the span its queued work runs in,
 * by its own estimates: at each launch, busy until = max(busy until, now) + the launch's estimated
 * device time, and busy since = now when the span had ended. A best-effort container launches only
 * once every latency-critical and standard span is past, so it yields within one of its own
 * kernels (and its queue of at most RUNAHEAD_NS, compute.c) whenever a higher class has work. The
 * estimates leave out queueing, so three more things hold a best-effort launch back:
 *  - the higher classes' work launched after this container's last launch queued behind that
 *    launch's kernel, all of it one after another: it runs from when that kernel was done (the
 *    moment the next launch comes here, as compute.c waits for it first) for the sum of it;
 *  - a container waiting for its own kernels (compute.c's run-ahead limit) publishes that it is
 *    syncing: its work is on the GPU, whatever its estimates said;
 *  - a container waiting for its compute quota publishes when its next launch is due: a
 *    best-effort kernel is launched only if it ends (by its estimate) before then, since the GPU
 *    runs kernels to the end and one in the way would cost the waiting container its share.
 * An elastic standard container keeps to its share while a latency-critical span is not past.
 *
 * A slot is read with pread, never mapped: its owner can truncate its own file, and a mapped page
 * that is truncated away kills the reader with SIGBUS. The writer maps its own slot (only its own
 * container can truncate it). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "spinlock.h"
#include "vgpu.h"

#define MAX_PEERS 64 /* slots read per GPU: far more containers than a GPU is split into */
/* Readers count a span open this much longer than its time: a launch's way to the GPU (and the
 * first launch of a signature, estimate 0), and the host's turnaround from one kernel's end to the
 * next launch, which a best-effort kernel slipped into would cost the higher class its share. */
#define SLACK_NS 300000ull
/* A time further ahead than this is not credible (a slot from before a reboot, a broken or hostile
 * writer): it is ignored, so no slot can stop best-effort containers for longer at a time. */
#define MAX_AHEAD_NS 1000000000ull
#define MAX_NAP_NS 1000000ull /* a waiting best-effort launch reads the slots again at least this often */
#define MIN_NAP_NS 20000ull
#define TORN_TRIES 3
#define RELIST_EVERY 10 /* monitor periods (100 ms): a new slot is seen within a second at worst */

/* A slot's words. All are written under the writing container's region lock (its processes share
 * the slot), the times first, then `check` = the complement of their exclusive or. A reader copies
 * them with one pread, which the kernel may copy in pieces while a store lands, so it takes them
 * only when they agree, and reads again when they do not. An all-zero slot (never written) is
 * idle. */
struct slot {
    uint64_t busy_since_ns; /* CLOCK_MONOTONIC, one clock for every container of the node */
    uint64_t busy_until_ns;
    uint64_t due_ns;     /* waiting for its compute quota until then; 0 = not waiting */
    uint64_t syncing_ns; /* waiting for its own kernels (compute.c's run-ahead) since; 0 = not */
    uint64_t check;
};

static uint64_t check_of(const struct slot *s) {
    return ~(s->busy_since_ns ^ s->busy_until_ns ^ s->due_ns ^ s->syncing_ns);
}

/* This container's slot as it is now; the region lock held. */
static struct slot own_words(const struct slot *own) {
    return (struct slot){__atomic_load_n(&own->busy_since_ns, __ATOMIC_RELAXED),
                         __atomic_load_n(&own->busy_until_ns, __ATOMIC_RELAXED),
                         __atomic_load_n(&own->due_ns, __ATOMIC_RELAXED),
                         __atomic_load_n(&own->syncing_ns, __ATOMIC_RELAXED), 0};
}

/* Stores the slot's words; the region lock held (see struct slot). */
static inline void publish(struct slot *own, const struct slot *s) {
    __atomic_store_n(&own->busy_since_ns, s->busy_since_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&own->busy_until_ns, s->busy_until_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&own->due_ns, s->due_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&own->syncing_ns, s->syncing_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&own->check, check_of(s), __ATOMIC_RELEASE);
}
_Static_assert(sizeof(struct slot) <= VGPU_COORDINATION_SLOT_BYTES, "the slot fits the file the device plugin makes");

struct peers {
    int fds[MAX_PEERS];
    int count;
};

struct qos_gpu {
    int joined; /* under devices.c's lock */
    int role;   /* VGPU_QOS_* bits */
    int ready;  /* stored (release) once joined: the monitor refreshes only what is ready */
    struct slot *own; /* mapped; NULL when this container publishes nothing on this GPU */
    dev_t own_dev;
    ino_t own_ino;
    int classes;              /* directories read: those of the classes above this container's */
    char dirs[2][PATH_MAX];
    struct timespec seen[2];  /* their modification times when last listed */
    unsigned refreshes;       /* the monitor's, for RELIST_EVERY */
    vgpu_spinlock peers_lock; /* guards peers: readers hold it across their preads */
    struct peers peers;
    uint64_t launched_ns; /* best-effort: this process's last launch (relaxed: a hint, see yield) */
};

static struct qos_gpu gpus[VGPU_MAX_DEVICES];

static const char *class_name(enum vgpu_qos qos) {
    switch (qos) {
    case VGPU_QOS_CLASS_LATENCY_CRITICAL: return VGPU_QOS_LATENCY_CRITICAL;
    case VGPU_QOS_CLASS_BEST_EFFORT: return VGPU_QOS_BEST_EFFORT;
    default: return VGPU_QOS_STANDARD;
    }
}

/* Standalone: <dir>/<uuid>/<class>/<pid>, created. */
static int create_own_slot(const char *root, const char *uuid, enum vgpu_qos qos) {
    char path[PATH_MAX];
    const char *parts[] = {uuid, class_name(qos)};
    snprintf(path, sizeof path, "%s", root);
    if (mkdir(path, 0777) != 0 && errno != EEXIST) return -1;
    for (int i = 0; i < 2; i++) {
        size_t n = strlen(path);
        if (snprintf(path + n, sizeof path - n, "/%s", parts[i]) >= (int)(sizeof path - n)) return -1;
        if (mkdir(path, 0777) != 0 && errno != EEXIST) return -1;
    }
    size_t n = strlen(path);
    if (snprintf(path + n, sizeof path - n, "/%d", (int)getpid()) >= (int)(sizeof path - n)) return -1;
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 && ftruncate(fd, VGPU_COORDINATION_SLOT_BYTES) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Managed (or a limits file): <dir>/<uuid>.slot, made by the device plugin; never created. */
static int open_own_slot(const char *root, const char *uuid) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s" VGPU_COORDINATION_SLOT_SUFFIX, root, uuid) >= (int)sizeof path) return -1;
    return open(path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
}

static void map_own_slot(struct qos_gpu *g, const struct vgpu_limits *c, const char *uuid) {
    int fd = c->from_file ? open_own_slot(c->coordination, uuid) : create_own_slot(c->coordination, uuid, c->qos);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size >= VGPU_COORDINATION_SLOT_BYTES) {
        void *p = mmap(NULL, VGPU_COORDINATION_SLOT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
            g->own = p;
            g->own_dev = st.st_dev;
            g->own_ino = st.st_ino;
        }
    }
    if (!g->own)
        vgpu_log("GPU %s: no slot of its own in the coordination area %s; best-effort containers do not see this "
                 "container's work",
                 uuid, c->coordination);
    if (fd >= 0) close(fd);
}

static int modified(const char *dir, struct timespec *seen) {
    struct stat st;
    if (stat(dir, &st) != 0) st.st_mtim = (struct timespec){0, 0};
    int changed = st.st_mtim.tv_sec != seen->tv_sec || st.st_mtim.tv_nsec != seen->tv_nsec;
    *seen = st.st_mtim;
    return changed;
}

/* Opens every slot in the class directories read (not this container's own), replacing the list. */
static void list_peers(struct qos_gpu *g) {
    struct peers fresh = {.count = 0};
    for (int k = 0; k < g->classes; k++) {
        int dfd = open(g->dirs[k], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        DIR *dir = dfd >= 0 ? fdopendir(dfd) : NULL;
        if (!dir) {
            if (dfd >= 0) close(dfd);
            continue;
        }
        for (struct dirent *e; (e = readdir(dir)) && fresh.count < MAX_PEERS;) {
            if (e->d_name[0] == '.') continue;
            int fd = openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
            struct stat st;
            if (fd < 0) continue;
            if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && !(g->own && st.st_dev == g->own_dev && st.st_ino == g->own_ino))
                fresh.fds[fresh.count++] = fd;
            else
                close(fd);
        }
        closedir(dir);
    }
    vgpu_spin_take(&g->peers_lock);
    struct peers old = g->peers;
    memcpy(g->peers.fds, fresh.fds, sizeof fresh.fds);
    __atomic_store_n(&g->peers.count, fresh.count, __ATOMIC_RELAXED); /* read unlocked: peers_busy_until */
    vgpu_spin_give(&g->peers_lock);
    for (int i = 0; i < old.count; i++) close(old.fds[i]); /* no reader holds them: the swap was locked */
}

int vgpu_qos_join(int rdev, const char *uuid) {
    const struct vgpu_limits *c = vgpu_limits();
    if (rdev < 0 || rdev >= VGPU_MAX_DEVICES) return 0;
    struct qos_gpu *g = &gpus[rdev];
    if (g->joined) return g->role; /* a fork child enumerating again */
    g->joined = 1;
    if (c->mps.pipe[0] && c->qos == VGPU_QOS_CLASS_BEST_EFFORT) {
        /* MPS holds best-effort back (mps.c): the yield rule, which did not help on a real
         * time-sliced GPU, made a latency-critical neighbour's p99 2.5x worse under MPS. */
        g->role = VGPU_QOS_SPATIAL;
        return g->role;
    }
    if (!c->coordination[0]) {
        if (c->qos == VGPU_QOS_CLASS_BEST_EFFORT)
            vgpu_log("best-effort without a coordination area: GPU %s runs as standard", uuid);
        return 0;
    }
    if (c->qos != VGPU_QOS_CLASS_BEST_EFFORT) map_own_slot(g, c, uuid);
    /* Best-effort reads the two classes above it; standard the one above it, for elastic mode. */
    const char *read[2] = {VGPU_QOS_LATENCY_CRITICAL, VGPU_QOS_STANDARD};
    g->classes = c->qos == VGPU_QOS_CLASS_BEST_EFFORT ? 2 : c->qos == VGPU_QOS_CLASS_STANDARD ? 1 : 0;
    for (int k = 0; k < g->classes; k++) {
        if (snprintf(g->dirs[k], PATH_MAX, "%s/%s/%s", c->coordination, uuid, read[k]) >= PATH_MAX) g->classes = k;
        modified(g->dirs[k], &g->seen[k]);
    }
    list_peers(g);
    g->role = (g->own ? VGPU_QOS_PUBLISHES : 0) | (c->qos == VGPU_QOS_CLASS_BEST_EFFORT ? VGPU_QOS_YIELDS : 0);
    __atomic_store_n(&g->ready, 1, __ATOMIC_RELEASE);
    return g->role;
}

void vgpu_qos_refresh(void) {
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        struct qos_gpu *g = &gpus[d];
        if (!__atomic_load_n(&g->ready, __ATOMIC_ACQUIRE) || !g->classes) continue;
        /* A directory's modification time is coarse (a clock tick): a slot made in the tick of
         * the last listing leaves it unchanged, so every RELIST_EVERY refreshes list anyway. */
        int changed = ++g->refreshes % RELIST_EVERY == 0;
        for (int k = 0; k < g->classes; k++) changed |= modified(g->dirs[k], &g->seen[k]);
        if (changed) list_peers(g);
    }
}

/* On every launch of a publishing container: inline, so that link-time optimisation puts it into
 * the launch path (docs/benchmarks.md). */
inline void vgpu_qos_launched(struct vgpu_region *r, int rdev, uint64_t estimate_ns) {
    struct slot *own = gpus[rdev].own;
    uint64_t now = vgpu_now_ns();
    vgpu_region_lock(r);
    struct slot s = own_words(own);
    if (s.busy_until_ns < now || s.busy_until_ns - now > MAX_AHEAD_NS || s.busy_since_ns > s.busy_until_ns)
        s.busy_since_ns = s.busy_until_ns = now;
    s.busy_until_ns += estimate_ns;
    if (__builtin_expect(s.due_ns != 0, 0)) {
        s.due_ns = 0;
        __atomic_store_n(&own->due_ns, 0, __ATOMIC_RELAXED);
    }
    /* Only the span's words change (the others are as read, under the same lock: see struct slot
     * for the order of the stores and how readers take them). */
    __atomic_store_n(&own->busy_since_ns, s.busy_since_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&own->busy_until_ns, s.busy_until_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&own->check, check_of(&s), __ATOMIC_RELEASE);
    vgpu_region_unlock(r);
}

void vgpu_qos_due(struct vgpu_region *r, int rdev, uint64_t due_ns) {
    struct slot *own = gpus[rdev].own;
    vgpu_region_lock(r);
    struct slot s = own_words(own);
    s.due_ns = due_ns;
    publish(own, &s);
    vgpu_region_unlock(r);
}

void vgpu_qos_syncing(struct vgpu_region *r, int rdev, int syncing) {
    struct slot *own = rdev >= 0 && rdev < VGPU_MAX_DEVICES ? gpus[rdev].own : NULL;
    if (!own) return;
    uint64_t now = vgpu_now_ns();
    vgpu_region_lock(r);
    struct slot s = own_words(own);
    s.syncing_ns = syncing ? now : 0;
    publish(own, &s);
    vgpu_region_unlock(r);
}

/* A launch from a waiting yielder. */
struct yielder {
    uint64_t after;       /* its last launch: a peer's work launched since queued behind that kernel */
    uint64_t done;        /* when that kernel was done */
    uint64_t estimate_ns; /* the coming kernel's */
};

/* Until when the latest credible peer is busy or due (0: none), for a launch of y (or none),
 * counting spans that ended after `from` (at most now). The peers' work launched after y's last
 * launch queued behind that launch's kernel, all of it, one after another: it runs until y->done
 * + the sum of it. */
static uint64_t peers_busy_until(struct qos_gpu *g, uint64_t from, uint64_t now, const struct yielder *y) {
    uint64_t latest = 0, queued = 0;
    /* No peer on the GPU (read without the lock, which guards the descriptors: a count that a
     * concurrent listing just raised is seen at the next launch, as if that listing had come a
     * moment later). */
    if (!__atomic_load_n(&g->peers.count, __ATOMIC_RELAXED)) return 0;
    vgpu_spin_take(&g->peers_lock);
    for (int i = 0; i < g->peers.count; i++) {
        struct slot s = {0, 0, 0, 0, 0};
        int agreed = 0;
        for (int tries = 0; tries < TORN_TRIES && !agreed; tries++) {
            ssize_t n = pread(g->peers.fds[i], &s, sizeof s, 0);
            if (n != (ssize_t)sizeof s) s = (struct slot){0, 0, 0, 0, 0}; /* emptied by its owner: idle */
            agreed = s.check == check_of(&s) || (!s.busy_until_ns && !s.due_ns && !s.syncing_ns && !s.check);
        }
        uint64_t until = s.busy_until_ns;
        if (agreed && y && y->after && until > y->after && s.busy_since_ns <= until && until <= now + MAX_AHEAD_NS)
            queued += until - (s.busy_since_ns > y->after ? s.busy_since_ns : y->after);
        /* Waiting for its own kernels (for at most MAX_AHEAD_NS: a process that died waiting). */
        if (agreed && s.syncing_ns && s.syncing_ns <= now && now - s.syncing_ns < MAX_AHEAD_NS && now + MIN_NAP_NS > until)
            until = now + MIN_NAP_NS;
        /* Due before the yielder's kernel would end: wait for it to launch (then its span counts). */
        if (agreed && y && s.due_ns > now && s.due_ns < now + y->estimate_ns + SLACK_NS && s.due_ns > until)
            until = s.due_ns;
        /* Still disagreeing: its writer is between its stores; busy for a moment. */
        until = agreed ? until + SLACK_NS : now + MIN_NAP_NS;
        if (until > from && until <= now + MAX_AHEAD_NS && until > latest) latest = until;
    }
    vgpu_spin_give(&g->peers_lock);
    if (queued && y->done + queued + SLACK_NS > latest) latest = y->done + queued + SLACK_NS;
    return latest;
}

int vgpu_qos_higher_busy(int rdev, uint64_t since) {
    struct qos_gpu *g = &gpus[rdev];
    uint64_t now = vgpu_now_ns();
    return g->classes && peers_busy_until(g, since < now ? since : now, now, NULL) != 0;
}

uint64_t vgpu_qos_yield(int rdev, uint64_t estimate_ns) {
    struct qos_gpu *g = &gpus[rdev];
    uint64_t waited = 0, now = vgpu_now_ns();
    /* Threads of one process race on the last launch; any of their launch times serves. */
    struct yielder y = {__atomic_load_n(&g->launched_ns, __ATOMIC_RELAXED), now, estimate_ns};
    for (;;) {
        uint64_t until = peers_busy_until(g, now, now, &y);
        if (until <= now) {
            __atomic_store_n(&g->launched_ns, now, __ATOMIC_RELAXED);
            return waited;
        }
        uint64_t ns = until - now;
        ns = ns > MAX_NAP_NS ? MAX_NAP_NS : ns < MIN_NAP_NS ? MIN_NAP_NS : ns;
        struct timespec t = {.tv_sec = 0, .tv_nsec = (long)ns};
        nanosleep(&t, NULL);
        waited += ns;
        now = vgpu_now_ns();
    }
}

void vgpu_qos_after_fork_child(void) {
    /* The slots stay: the mapping and the descriptors are the child's too (a standalone child
     * publishes in its parent's slot, as the processes of one container do). */
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) vgpu_spin_init(&gpus[d].peers_lock);
}
