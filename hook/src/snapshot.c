/* Reads a region without joining it: no slot, no lock, so metrics never disturb a container. Each
 * word is read atomically; a snapshot taken during an allocation may be one allocation old, never
 * over the quota (see the end of vgpu_region_snapshot).
 *
 * The node agent reads every container's region on the host, as root, from a directory the
 * container can write. So the file is untrusted: it is opened without following a link and without
 * blocking (a FIFO put in its place must not hang metrics), must be a regular file, and is copied
 * with pread rather than mapped (a container truncating a mapped file would kill the reader with
 * SIGBUS); every count read from it is bounded by the layout before it indexes anything. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "snapshot.h"
#include "vgpu.h"

VGPU_API uint32_t vgpu_device_usage_size(void) { return sizeof(struct vgpu_device_usage); }

int vgpu_region_snapshot(const struct vgpu_region *r, int fd, struct vgpu_device_usage *out, int capacity,
                         int *live) {
    *live = 0;
    uint64_t magic = __atomic_load_n(&r->magic, __ATOMIC_ACQUIRE);
    if (magic == 0) return 0; /* sized, not initialised yet */
    if (magic != VGPU_REGION_MAGIC || r->version != VGPU_REGION_VERSION) return -EPROTO;
    uint32_t devices = __atomic_load_n(&r->devices, __ATOMIC_ACQUIRE);
    uint32_t procs = __atomic_load_n(&r->procs_hw, __ATOMIC_ACQUIRE);
    if (devices > VGPU_MAX_DEVICES || procs > VGPU_MAX_PROCS) return -EPROTO; /* never written by a hook */
    if (capacity < 0) capacity = 0;
    int n = (int)devices < capacity ? (int)devices : capacity;
    memset(out, 0, (size_t)n * sizeof *out);
    for (int d = 0; d < n; d++) {
        memcpy(out[d].uuid, r->dev[d].uuid, sizeof out[d].uuid);
        out[d].uuid[sizeof out[d].uuid - 1] = 0;
        out[d].memory_quota = __atomic_load_n(&r->dev[d].memory_quota, __ATOMIC_RELAXED);
        out[d].busy_ns = __atomic_load_n(&r->dev[d].busy_ns, __ATOMIC_RELAXED);
        out[d].throttled_ns = __atomic_load_n(&r->dev[d].throttled_ns, __ATOMIC_RELAXED);
        out[d].launches = __atomic_load_n(&r->dev[d].launches, __ATOMIC_RELAXED);
        out[d].memory_peak = __atomic_load_n(&r->dev[d].peak, __ATOMIC_RELAXED);
        out[d].refused = __atomic_load_n(&r->dev[d].refused, __ATOMIC_RELAXED);
        out[d].cores = r->dev[d].cores;
        out[d].elastic = r->dev[d].elastic;
    }
    int alive = 0;
    for (uint32_t i = 0; i < procs; i++) {
        if (!__atomic_load_n(&r->proc[i].pid, __ATOMIC_ACQUIRE) || !vgpu_slot_alive(fd, (int)i)) continue;
        alive++;
        for (int d = 0; d < n; d++) {
            uint64_t used = __atomic_load_n(&r->proc[i].used[d], __ATOMIC_RELAXED);
            /* Saturating: a forged slot must not wrap the sum round to something small. */
            out[d].memory_used = used > UINT64_MAX - out[d].memory_used ? UINT64_MAX : out[d].memory_used + used;
            out[d].processes += used > 0;
            uint64_t waiting = __atomic_load_n(&r->proc[i].waiting[d], __ATOMIC_RELAXED);
            out[d].memory_waiting =
                waiting > UINT64_MAX - out[d].memory_waiting ? UINT64_MAX : out[d].memory_waiting + waiting;
        }
    }
    /* The slots are summed without the lock, so a free in one slot and a reservation in another
     * can both be seen, over the quota. dev[d].used is the same sum kept under the lock (it also
     * holds dead processes' memory until reaped): the smaller of the two is a real past state. */
    for (int d = 0; d < n; d++) {
        uint64_t total = __atomic_load_n(&r->dev[d].used, __ATOMIC_ACQUIRE);
        if (out[d].memory_used > total) out[d].memory_used = total;
        if (out[d].memory_waiting > out[d].memory_used) out[d].memory_waiting = out[d].memory_used;
    }
    *live = alive;
    return n;
}

VGPU_API int vgpu_region_read(const char *path, struct vgpu_device_usage *out, int capacity, int *live) {
    *live = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return -errno;
    struct stat st;
    struct vgpu_region *r = NULL;
    int result = -EPROTO;
    if (fstat(fd, &st) != 0) {
        result = -errno;
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        result = -EINVAL;
        goto out;
    }
    if (st.st_size == 0) {
        result = 0; /* just created: its first process is initialising it */
        goto out;
    }
    if ((size_t)st.st_size < sizeof *r) goto out;
    if (!(r = malloc(sizeof *r))) {
        result = -ENOMEM;
        goto out;
    }
    size_t got = 0;
    while (got < sizeof *r) {
        ssize_t n = pread(fd, (char *)r + got, sizeof *r - got, (off_t)got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break; /* truncated meanwhile: not a region any more */
        got += (size_t)n;
    }
    if (got == sizeof *r) result = vgpu_region_snapshot(r, fd, out, capacity, live);
out:
    free(r);
    close(fd);
    return result;
}
