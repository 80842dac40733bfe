/* Reading the record of when the GPU ran kernels, and for whom: what NVML's utilization reports. The
 * scheduler model (sched.c) writes a record as each busy piece closes, in the order of their ends,
 * into a ring of the most recent ones; a reader first brings the model up to now, so the pieces still
 * open are closed there too. */
#include "page.h"

/* The model brought up to now with its open pieces recorded; page lock held. */
static void settle(struct fg_shared *s)
{
    fg_sched_advance(s, fg_now_ns());
    fg_sched_flush(s);
}

uint64_t fg_timeline_busy(struct fg_shared *s, uint64_t from_ns, uint64_t to_ns, int32_t owner,
                          uint64_t *covered_from)
{
    struct fg_page *p = s->page;
    uint64_t busy = 0, covered = from_ns;
    fg_page_lock(p);
    settle(s);
    for (uint32_t k = 0; k < p->ring_count; k++) {
        const struct fg_busy *b = &p->ring[(p->ring_next + FG_RING - 1 - k) % FG_RING];
        if (b->end_ns <= from_ns)
            break;
        if (k == FG_RING - 1 && b->start_ns > from_ns)
            covered = b->start_ns; /* the ring dropped older records inside the window */
        if (owner == 0 ? !(b->flags & FG_BUSY_DEVICE) : !(b->flags & FG_BUSY_OWNER) || b->owner != owner)
            continue;
        uint64_t a = b->start_ns > from_ns ? b->start_ns : from_ns;
        uint64_t e = b->end_ns < to_ns ? b->end_ns : to_ns;
        if (e > a)
            busy += e - a;
    }
    fg_page_unlock(p);
    if (covered_from)
        *covered_from = covered;
    return busy;
}

int fg_timeline_owners(struct fg_shared *s, uint64_t from_ns, uint64_t to_ns, struct fg_owner *out, int max)
{
    struct fg_page *p = s->page;
    int n = 0;
    fg_page_lock(p);
    settle(s);
    for (uint32_t k = 0; k < p->ring_count; k++) {
        const struct fg_busy *b = &p->ring[(p->ring_next + FG_RING - 1 - k) % FG_RING];
        if (b->end_ns <= from_ns)
            break;
        if (b->start_ns >= to_ns || !(b->flags & FG_BUSY_OWNER))
            continue;
        int seen = 0;
        for (int i = 0; i < n && i < max; i++)
            seen |= out[i].owner == b->owner;
        if (!seen) {
            if (n < max)
                out[n] = (struct fg_owner){.owner = b->owner, .pid = fg_owner_pid(s, b->owner)};
            n++;
        }
    }
    fg_page_unlock(p);
    return n;
}
