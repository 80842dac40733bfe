/* A process's work on a GPU: queueing kernels, and asking or waiting for their completion, which the
 * scheduler model (sched.c) decides from everything queued on the GPU up to now. */
#include <stdlib.h>

#include "page.h"

/* Completion times this process keeps of its own items (the page's queue reuses their places). */
#define FG_HISTORY 65536
/* A waiter looks again at least this often: a process that died or exited frees the GPU early. */
#define FG_WAIT_RECHECK_NS 50000000ULL

/* Copies the completion times of this process's newly completed items; page lock held. */
static void pull(struct fg_shared *s, int32_t owner, int slot)
{
    uint64_t completed = s->page->sched.run[slot].completed;
    if (s->history_owner != owner) { /* a new slot (a forked child's): its numbering starts anew */
        __atomic_store_n(&s->history_pulled, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&s->history_owner, owner, __ATOMIC_RELEASE);
    }
    if (!s->history)
        s->history = calloc(FG_HISTORY, sizeof *s->history);
    if (completed - s->history_pulled > FG_QUEUE)
        s->history_pulled = completed - FG_QUEUE;
    for (uint64_t seq = s->history_pulled + 1; seq <= completed; seq++) {
        if (s->history)
            s->history[seq % FG_HISTORY] = s->page->items[slot][seq % FG_QUEUE].end_ns;
    }
    /* Last, released: a thread asking without the lock (known_done) sees the times it covers. */
    __atomic_store_n(&s->history_pulled, completed, __ATOMIC_RELEASE);
}

/* 1 if this process already knows the item completed (then *end_ns), without the page lock: the
 * common case of a query (the hook's events, found done at the next launch's look at the model). */
static int known_done(const struct fg_shared *s, struct fg_ref ref, uint64_t *end_ns)
{
    if (!s->history || ref.owner != __atomic_load_n(&s->history_owner, __ATOMIC_RELAXED))
        return 0;
    uint64_t pulled = __atomic_load_n(&s->history_pulled, __ATOMIC_ACQUIRE);
    if (ref.seq > pulled || pulled - ref.seq >= FG_HISTORY)
        return 0;
    *end_ns = s->history[ref.seq % FG_HISTORY];
    return 1;
}

/* The completion time of this process's completed item `seq`; 0 if no longer known. Lock held. */
static uint64_t end_of(const struct fg_shared *s, int slot, uint64_t seq)
{
    uint64_t pulled = s->history_pulled;
    if (pulled - seq < FG_HISTORY && s->history)
        return s->history[seq % FG_HISTORY];
    if (s->page->procs[slot].submitted - seq < FG_QUEUE)
        return s->page->items[slot][seq % FG_QUEUE].end_ns;
    return 0;
}

/* The model brought up to now, this process's completions pulled: its slot, or -1 if `ref` is not
 * this process's (or it has none). Page lock held. */
static int settle(struct fg_shared *s, struct fg_ref ref)
{
    int32_t owner = fg_own_owner_locked(s);
    fg_sched_advance(s, fg_now_ns());
    if (!owner)
        return -1;
    int slot = owner & (FG_MAX_PROCS - 1);
    pull(s, owner, slot);
    return ref.owner == owner ? slot : -1;
}

struct fg_ref fg_work_submit(struct fg_shared *s, const struct fg_work *work, const struct fg_client *client)
{
    struct fg_page *p = s->page;
    fg_page_lock(p);
    int32_t owner = fg_own_owner_locked(s);
    if (!owner) {
        fg_page_unlock(p);
        return (struct fg_ref){0, 0}; /* no slot (said on stderr): the work takes no time */
    }
    int slot = owner & (FG_MAX_PROCS - 1);
    /* Room is judged by the model as of the last look (it only frees more): one run of the model
     * per launch, after the item is queued. */
    while (p->procs[slot].submitted - p->sched.run[slot].completed >= FG_QUEUE) {
        settle(s, (struct fg_ref){owner, 0});
        uint64_t completed = p->sched.run[slot].completed;
        if (p->procs[slot].submitted - completed < FG_QUEUE)
            break;
        fg_page_unlock(p); /* the queue is full: wait for its oldest item, as a push buffer does */
        fg_work_wait(s, (struct fg_ref){owner, completed + 1});
        fg_page_lock(p);
    }
    uint64_t now = fg_now_ns();
    if (now < p->sched.now_ns)
        now = p->sched.now_ns;
    struct fg_proc_slot *ps = &p->procs[slot];
    if (ps->submitted == p->sched.run[slot].completed) { /* idle: its way of sharing may change */
        ps->mps = client->mps;
        ps->low_priority = client->mps && client->low_priority;
        int cap = (int)((double)s->sms * client->percentage / 100.0 + 0.5);
        ps->sm_cap = cap < 1 ? 1 : cap > s->sms ? s->sms : cap;
    }
    uint64_t seq = ps->submitted + 1;
    p->items[slot][seq % FG_QUEUE] =
        (struct fg_item){.submit_ns = now, .ns = work->ns, .blocks = work->blocks};
    ps->submitted = seq; /* last: the item is whole before the model can see it */
    /* The model up to now, the item included: one that takes no time is known complete from here. */
    fg_sched_advance(s, now);
    pull(s, owner, slot);
    fg_page_unlock(p);
    return (struct fg_ref){owner, seq};
}

int fg_work_done(struct fg_shared *s, struct fg_ref ref, uint64_t *end_ns)
{
    *end_ns = 0;
    if (!ref.seq || known_done(s, ref, end_ns))
        return 1;
    fg_page_lock(s->page);
    int slot = settle(s, ref);
    int done = slot < 0 || ref.seq <= s->page->sched.run[slot].completed;
    if (slot >= 0 && done)
        *end_ns = end_of(s, slot, ref.seq);
    fg_page_unlock(s->page);
    return done;
}

uint64_t fg_work_wait(struct fg_shared *s, struct fg_ref ref)
{
    uint64_t known;
    if (!ref.seq)
        return 0;
    if (known_done(s, ref, &known))
        return known;
    for (;;) {
        fg_page_lock(s->page);
        int slot = settle(s, ref);
        uint64_t now = s->page->sched.now_ns;
        if (slot < 0 || ref.seq <= s->page->sched.run[slot].completed) {
            uint64_t end = slot < 0 ? 0 : end_of(s, slot, ref.seq);
            fg_page_unlock(s->page);
            return end;
        }
        /* When it would complete if nothing more came; more work of others may push it later. */
        uint64_t until = fg_sched_predict(s, slot, ref.seq);
        fg_page_unlock(s->page);
        if (until > now + FG_WAIT_RECHECK_NS)
            until = now + FG_WAIT_RECHECK_NS;
        if (until <= now)
            until = now + 1000;
        fg_sleep_until(until);
    }
}
