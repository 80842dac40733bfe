/* This process's live allocations: what each free, release or destroy gives back, and to which
 * GPU. An open-addressing hash table (linear probing, backward-shift deletion) under one lock. */
#include <stdlib.h>
#include <string.h>

#include "spinlock.h"
#include "vgpu.h"

struct entry {
    uint64_t key; /* 0 = empty */
    uint64_t bytes;
    CUcontext ctx;
    int32_t rdev;
    int32_t kind;
};

static struct entry *table;
static size_t capacity; /* a power of two */
static size_t count;
static vgpu_spinlock tracking_lock; /* spinlock.h: taken on every allocation and free */

static inline size_t slot_of(uint64_t key, int kind) {
    uint64_t h = (key ^ ((uint64_t)kind << 61)) * 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 32) & (capacity - 1);
}

static inline void insert(struct entry e) {
    size_t i = slot_of(e.key, e.kind);
    while (table[i].key) i = (i + 1) & (capacity - 1);
    table[i] = e;
    count++;
}

static int grow(void) {
    size_t old_capacity = capacity;
    struct entry *old = table;
    struct entry *fresh = calloc(old_capacity ? old_capacity * 2 : 1024, sizeof *fresh);
    if (!fresh) return -1;
    table = fresh;
    capacity = old_capacity ? old_capacity * 2 : 1024;
    count = 0;
    for (size_t i = 0; i < old_capacity; i++)
        if (old[i].key) insert(old[i]);
    free(old);
    return 0;
}

int vgpu_track_add(enum vgpu_kind kind, uint64_t key, int rdev, uint64_t bytes, CUcontext ctx) {
    if (!key) return -1;
    vgpu_spin_take(&tracking_lock);
    int rc = 0;
    if ((count + 1) * 2 > capacity) rc = grow();
    if (rc == 0) insert((struct entry){.key = key, .bytes = bytes, .ctx = ctx, .rdev = rdev, .kind = (int32_t)kind});
    vgpu_spin_give(&tracking_lock);
    return rc;
}

/* Removes table[i], shifting back the entries of its probe chain. Lock held. */
static inline void remove_at(size_t i) {
    size_t j = i;
    for (;;) {
        table[i].key = 0;
        for (;;) {
            j = (j + 1) & (capacity - 1);
            if (!table[j].key) {
                count--;
                return;
            }
            size_t home = slot_of(table[j].key, table[j].kind);
            /* Move table[j] into the hole unless its home lies cyclically in (i, j]. */
            if (i <= j ? (i < home && home <= j) : (i < home || home <= j)) continue;
            break;
        }
        table[i] = table[j];
        i = j;
    }
}

int vgpu_track_take(enum vgpu_kind kind, uint64_t key, int *rdev, uint64_t *bytes) {
    int found = 0;
    vgpu_spin_take(&tracking_lock);
    if (capacity && key) {
        for (size_t i = slot_of(key, (int)kind); table[i].key; i = (i + 1) & (capacity - 1)) {
            if (table[i].key == key && table[i].kind == (int32_t)kind) {
                *rdev = table[i].rdev;
                *bytes = table[i].bytes;
                remove_at(i);
                found = 1;
                break;
            }
        }
    }
    vgpu_spin_give(&tracking_lock);
    return found;
}

void vgpu_track_drop_context(CUcontext ctx) {
    uint64_t freed[VGPU_MAX_DEVICES] = {0};
    vgpu_spin_take(&tracking_lock);
    for (size_t i = 0; i < capacity;) {
        if (table[i].key && table[i].ctx == ctx) {
            if (table[i].rdev >= 0 && table[i].rdev < VGPU_MAX_DEVICES) freed[table[i].rdev] += table[i].bytes;
            remove_at(i); /* may move a later entry into slot i: look at it again */
        } else {
            i++;
        }
    }
    vgpu_spin_give(&tracking_lock);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (freed[d]) vgpu_region_release(d, freed[d]);
}

void vgpu_track_after_fork_child(void) {
    /* The child's CUDA state is not the parent's: none of these allocations are the child's. */
    free(table);
    table = NULL;
    capacity = count = 0;
    vgpu_spin_init(&tracking_lock);
}
