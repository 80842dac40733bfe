/* The scheduler model: what a real GPU runs when several processes queue work on it (docs/fakegpu.md,
 * "Time model", says what each rule is calibrated to).
 *
 * - A context is a process's work on the GPU, or the MPS server's (every MPS client's work). One
 *   context holds the GPU at a time; its work runs in the order it was queued.
 * - Time-slicing: when another context becomes runnable while one runs, the running one keeps the GPU
 *   for one time slice from that moment (or until it runs out of work), then the GPU switches to the
 *   context waiting longest (round robin), which costs `switch_ns` of nobody's work. A kernel cut off
 *   at the slice's end resumes where it stopped when its context gets the GPU again.
 * - MPS: the server's clients' kernels run side by side on the SMs: a waiting kernel starts when an
 *   SM is free and takes at most its client's share of them; normal-priority clients' kernels start
 *   before below-normal ones', then the one waiting longest. MPS kernels are never preempted by each
 *   other; the server as a whole is time-sliced against other contexts.
 *
 * Completion times depend on what other processes queue later, so nothing is fixed at launch: the
 * page holds every process's queued kernels and this model's state as of some moment; each caller
 * runs it forward to the present under the page lock (fg_sched_advance), and one waiting for an item
 * runs a copy of it into the future to know how long to sleep (fg_sched_predict). As each busy piece
 * closes, the model writes its record: the ring timeline.c reads for NVML's utilization. */
#include <string.h>

#include "page.h"

#define NEVER UINT64_MAX

struct model {
    struct fg_shared *s;
    const struct fg_page *p;
    struct fg_sched *g;
    int commit; /* the page's own state: write completion times and busy records */
    int active[FG_MAX_PROCS]; /* slots with queued work when the model started */
    int nactive;
    int nmps; /* of them MPS clients: without any, the MPS server is never runnable */
    int target; /* a prediction: the slot and item whose completion ends the run, else -1 */
    uint64_t target_seq;
    uint64_t target_end;
};

static uint64_t min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

static int pending(const struct model *m, int i)
{
    return m->p->procs[i].submitted > m->g->run[i].completed;
}

static const struct fg_item *head(const struct model *m, int i)
{
    return &m->p->items[i][(m->g->run[i].completed + 1) % FG_QUEUE];
}

static int is_mps(const struct model *m, int i)
{
    return m->p->procs[i].mps;
}

/* Its first item is running, or was queued by `t`. */
static int eligible(const struct model *m, int i, uint64_t t)
{
    return pending(m, i) && (m->g->run[i].started || head(m, i)->submit_ns <= t);
}

static int runnable(const struct model *m, int e, uint64_t t)
{
    if (e != FG_MPS)
        return !is_mps(m, e) && eligible(m, e, t);
    if (!m->nmps)
        return 0;
    for (int k = 0; k < m->nactive; k++)
        if (is_mps(m, m->active[k]) && eligible(m, m->active[k], t))
            return 1;
    return 0;
}

/* Since when a runnable context waits: since it was preempted, else since its work arrived. */
static uint64_t ready_since(const struct model *m, int e, uint64_t t)
{
    if (e != FG_MPS)
        return m->g->run[e].ready_ns ? m->g->run[e].ready_ns : head(m, e)->submit_ns;
    if (m->g->mps_ready_ns)
        return m->g->mps_ready_ns;
    uint64_t since = NEVER;
    for (int k = 0; k < m->nactive; k++) {
        int i = m->active[k];
        if (is_mps(m, i) && eligible(m, i, t))
            since = min_u64(since, head(m, i)->submit_ns);
    }
    return since;
}

/* The runnable context, other than `except`, that waited longest (the loaded one on a tie: no
 * switch), or -1. */
static int pick(const struct model *m, uint64_t t, int except)
{
    int best = -1;
    uint64_t best_since = NEVER;
    for (int k = 0; k <= m->nactive; k++) {
        if (k == m->nactive && !m->nmps)
            break;
        int e = k < m->nactive ? m->active[k] : FG_MPS;
        if (e == except || (e != FG_MPS && is_mps(m, e)) || !runnable(m, e, t))
            continue;
        uint64_t since = ready_since(m, e, t);
        if (best < 0 || since < best_since || (since == best_since && e == m->g->loaded)) {
            best = e;
            best_since = since;
        }
    }
    return best;
}

/* When the next item of a context other than `except` arrives after `t` (only_mps: of an MPS client). */
static uint64_t next_arrival(const struct model *m, uint64_t t, int except, int only_mps)
{
    uint64_t next = NEVER;
    for (int k = 0; k < m->nactive; k++) {
        int i = m->active[k];
        int e = is_mps(m, i) ? FG_MPS : i;
        if (e == except || (only_mps && e != FG_MPS) || !pending(m, i) || m->g->run[i].started)
            continue;
        uint64_t at = head(m, i)->submit_ns;
        if (at > t)
            next = min_u64(next, at);
    }
    return next;
}

static uint64_t item_ns(const struct fg_item *it, int sms)
{
    if (!it->blocks)
        return it->ns;
    uint64_t waves = ((uint64_t)it->blocks + (uint64_t)sms - 1) / (uint64_t)sms;
    return FG_LAUNCH_OVERHEAD_NS + waves * it->ns;
}

/* Appends a busy piece to the ring of the most recent ones (timeline.c reads it). */
static void busy_add(struct fg_page *p, uint64_t start_ns, uint64_t end_ns, int32_t owner, int32_t flags)
{
    if (end_ns <= start_ns)
        return;
    uint32_t last = (p->ring_next + FG_RING - 1) % FG_RING;
    struct fg_busy *b = &p->ring[last];
    if (p->ring_count > 0 && b->owner == owner && b->flags == flags && b->end_ns == start_ns) {
        b->end_ns = end_ns; /* back-to-back work of one process: one record */
        return;
    }
    p->ring[p->ring_next] = (struct fg_busy){.start_ns = start_ns, .end_ns = end_ns, .owner = owner, .flags = flags};
    p->ring_next = (p->ring_next + 1) % FG_RING;
    if (p->ring_count < FG_RING)
        p->ring_count++;
}

static void record(struct model *m, uint64_t from, uint64_t to, int slot, int flags)
{
    if (m->commit && from && to > from)
        busy_add(m->s->page, from, to, slot >= 0 ? fg_slot_owner(m->p, slot) : 0, flags);
}

static void complete(struct model *m, int i, uint64_t t)
{
    struct fg_run *r = &m->g->run[i];
    uint64_t seq = r->completed + 1;
    if (m->commit) /* before `completed` moves: a reader never sees a completed item without its end */
        m->s->page->items[i][seq % FG_QUEUE].end_ns = t;
    r->completed = seq;
    r->started = 0;
    r->left_ns = 0;
    r->last_end_ns = t;
    if (i == m->target && seq >= m->target_seq && m->target_end == NEVER)
        m->target_end = t;
}

/* Context `e` gets the GPU at `t`: after a switch unless its context is the one loaded. */
static void begin(struct model *m, int e, uint64_t t)
{
    struct fg_sched *g = m->g;
    g->running = e;
    g->slice_end_ns = 0;
    g->switch_until_ns = e == g->loaded ? t : t + m->s->switch_ns;
    g->loaded = e;
    g->run_start_ns = g->switch_until_ns;
    if (e != FG_MPS) {
        g->run[e].ready_ns = 0;
        g->run[e].piece_ns = g->run_start_ns;
        return;
    }
    g->mps_ready_ns = 0;
    g->mps_piece_ns = g->run_start_ns;
    for (int k = 0; k < m->nactive; k++)
        if (is_mps(m, m->active[k]) && g->run[m->active[k]].started)
            g->run[m->active[k]].piece_ns = g->run_start_ns; /* paused kernels go on */
}

/* The running context gives up the GPU at `t`: out of work, or preempted with work left. */
static void stop(struct model *m, uint64_t t, int preempted)
{
    struct fg_sched *g = m->g;
    int e = g->running;
    if (e == FG_MPS) {
        record(m, g->mps_piece_ns, t, -1, FG_BUSY_DEVICE);
        g->mps_piece_ns = 0;
        for (int k = 0; k < m->nactive; k++) {
            struct fg_run *r = &g->run[m->active[k]];
            if (is_mps(m, m->active[k]) && r->started) {
                record(m, r->piece_ns, t, m->active[k], FG_BUSY_OWNER);
                r->piece_ns = 0;
            }
        }
        if (preempted)
            g->mps_ready_ns = t;
    } else {
        record(m, g->run[e].piece_ns, t, e, FG_BUSY_DEVICE | FG_BUSY_OWNER);
        g->run[e].piece_ns = 0;
        if (preempted)
            g->run[e].ready_ns = t;
    }
    g->running = -1;
    g->slice_end_ns = 0;
}

/* MPS kernels that can start at `t` start: 1 if one did. */
static int mps_fill(struct model *m, uint64_t t)
{
    struct fg_sched *g = m->g;
    int changed = 0;
    while (g->held_sms < m->s->sms) {
        int best = -1;
        uint64_t best_since = NEVER;
        for (int k = 0; k < m->nactive; k++) {
            int i = m->active[k];
            if (!is_mps(m, i) || g->run[i].started || !eligible(m, i, t))
                continue;
            uint64_t since = head(m, i)->submit_ns > g->run[i].last_end_ns ? head(m, i)->submit_ns
                                                                           : g->run[i].last_end_ns;
            int better = best < 0 || m->p->procs[i].low_priority < m->p->procs[best].low_priority ||
                         (m->p->procs[i].low_priority == m->p->procs[best].low_priority && since < best_since);
            if (better) {
                best = i;
                best_since = since;
            }
        }
        if (best < 0)
            break;
        struct fg_run *r = &g->run[best];
        int free_sms = m->s->sms - g->held_sms;
        int cap = m->p->procs[best].sm_cap > 0 ? m->p->procs[best].sm_cap : m->s->sms;
        r->sms = cap < free_sms ? cap : free_sms;
        r->started = 1;
        r->left_ns = item_ns(head(m, best), r->sms);
        r->piece_ns = t;
        g->held_sms += r->sms;
        changed = 1;
    }
    return changed;
}

static void mps_finish(struct model *m, int i, uint64_t t)
{
    struct fg_run *r = &m->g->run[i];
    record(m, r->piece_ns, t, i, FG_BUSY_OWNER);
    r->piece_ns = 0;
    m->g->held_sms -= r->sms;
    r->sms = 0;
    complete(m, i, t);
}

/* Runs the model from its now to `until` (NEVER: until the target completes or nothing is left). */
static void run(struct model *m, uint64_t until)
{
    struct fg_sched *g = m->g;
    for (;;) {
        if (m->target >= 0 && m->target_end != NEVER)
            return;
        uint64_t t = g->now_ns;
        int e = g->running;
        if (e < 0) {
            int next = pick(m, t, -1);
            if (next >= 0) {
                begin(m, next, t);
                continue;
            }
            uint64_t at = next_arrival(m, t, -1, 0);
            if (at == NEVER || at > until) {
                if (until != NEVER)
                    g->now_ns = until;
                return;
            }
            g->now_ns = at;
            continue;
        }
        if (g->switch_until_ns > t) {
            if (until < g->switch_until_ns) {
                g->now_ns = until;
                return;
            }
            g->now_ns = g->switch_until_ns;
            continue;
        }
        if (!runnable(m, e, t)) {
            stop(m, t, 0);
            continue;
        }
        if (e == FG_MPS) {
            if (mps_fill(m, t))
                continue;
        } else if (!g->run[e].started) {
            g->run[e].started = 1;
            g->run[e].left_ns = item_ns(head(m, e), m->s->sms);
            if (g->run[e].left_ns == 0)
                complete(m, e, t);
            continue;
        }
        if (!g->slice_end_ns) {
            int other = pick(m, t, e);
            if (other >= 0) {
                uint64_t since = ready_since(m, other, t);
                g->slice_end_ns = (since > g->run_start_ns ? since : g->run_start_ns) + m->s->timeslice_ns;
            }
        }
        if (g->slice_end_ns && t >= g->slice_end_ns) {
            stop(m, t, 1);
            continue;
        }
        if (t >= until)
            return;
        uint64_t ev = until;
        if (g->slice_end_ns)
            ev = min_u64(ev, g->slice_end_ns);
        else
            ev = min_u64(ev, next_arrival(m, t, e, 0)); /* starts the slice */
        if (e == FG_MPS) {
            for (int k = 0; k < m->nactive; k++)
                if (is_mps(m, m->active[k]) && g->run[m->active[k]].started)
                    ev = min_u64(ev, t + g->run[m->active[k]].left_ns);
            ev = min_u64(ev, next_arrival(m, t, -1, 1));
        } else {
            ev = min_u64(ev, t + g->run[e].left_ns);
        }
        if (ev == NEVER)
            return; /* nothing can happen: a prediction that cannot end */
        uint64_t dt = ev - t;
        g->now_ns = ev;
        if (e == FG_MPS) {
            for (int k = 0; k < m->nactive; k++) {
                int i = m->active[k];
                if (!is_mps(m, i) || !g->run[i].started)
                    continue;
                g->run[i].left_ns -= dt < g->run[i].left_ns ? dt : g->run[i].left_ns;
                if (g->run[i].left_ns == 0)
                    mps_finish(m, i, ev);
            }
        } else {
            g->run[e].left_ns -= dt < g->run[e].left_ns ? dt : g->run[e].left_ns;
            if (g->run[e].left_ns == 0)
                complete(m, e, ev);
        }
    }
}

static void model_init(struct model *m, struct fg_shared *s, struct fg_sched *g, int commit)
{
    m->s = s;
    m->p = s->page;
    m->g = g;
    m->commit = commit;
    m->target = -1;
    m->target_seq = 0;
    m->target_end = NEVER;
    m->nactive = 0;
    int limit = s->page->slot_limit < FG_MAX_PROCS ? (int)s->page->slot_limit : FG_MAX_PROCS;
    m->nmps = 0;
    for (int i = 0; i < limit; i++) {
        if (pending(m, i)) {
            m->active[m->nactive++] = i;
            m->nmps += is_mps(m, i);
        }
    }
}

/* Drops slot i's queued work at `t`, as if it had all completed then. */
static void drop_at(struct model *m, int i, uint64_t t)
{
    struct fg_sched *g = m->g;
    struct fg_run *r = &g->run[i];
    if (!pending(m, i))
        return;
    if (is_mps(m, i)) {
        if (r->started) {
            record(m, r->piece_ns, t, i, FG_BUSY_OWNER);
            g->held_sms -= r->sms;
        }
    } else if (g->running == i) {
        if (g->switch_until_ns <= t)
            record(m, r->piece_ns, t, i, FG_BUSY_DEVICE | FG_BUSY_OWNER);
        g->running = -1;
        g->slice_end_ns = 0;
    }
    uint64_t submitted = m->p->procs[i].submitted;
    uint64_t from = submitted - r->completed > FG_QUEUE ? submitted - FG_QUEUE : r->completed;
    for (uint64_t seq = from + 1; seq <= submitted; seq++)
        m->s->page->items[i][seq % FG_QUEUE].end_ns = t;
    *r = (struct fg_run){.completed = submitted, .last_end_ns = t};
}

void fg_sched_advance(struct fg_shared *s, uint64_t now)
{
    struct model m;
    model_init(&m, s, &s->page->sched, 1);
    if (now < m.g->now_ns)
        now = m.g->now_ns;
    run(&m, now);
    int dropped = 0;
    for (int k = 0; k < m.nactive; k++) {
        int i = m.active[k];
        if (pending(&m, i) && !fg_slot_alive(s, i)) { /* a real GPU drops a dead context's work */
            drop_at(&m, i, now);
            dropped = 1;
        }
    }
    if (dropped)
        run(&m, now); /* what the dropped work held goes to the others at once */
}

void fg_sched_drop(struct fg_shared *s, int slot, uint64_t now)
{
    fg_sched_advance(s, now);
    struct model m;
    model_init(&m, s, &s->page->sched, 1);
    drop_at(&m, slot, m.g->now_ns);
    run(&m, m.g->now_ns);
}

uint64_t fg_sched_predict(struct fg_shared *s, int slot, uint64_t seq)
{
    struct fg_sched copy = s->page->sched;
    struct model m;
    model_init(&m, s, &copy, 0);
    m.target = slot;
    m.target_seq = seq;
    run(&m, NEVER);
    return m.target_end;
}

void fg_sched_flush(struct fg_shared *s)
{
    struct model m;
    model_init(&m, s, &s->page->sched, 1);
    struct fg_sched *g = m.g;
    uint64_t t = g->now_ns;
    if (g->running < 0 || g->switch_until_ns > t)
        return;
    if (g->running != FG_MPS) {
        record(&m, g->run[g->running].piece_ns, t, g->running, FG_BUSY_DEVICE | FG_BUSY_OWNER);
        g->run[g->running].piece_ns = t;
        return;
    }
    record(&m, g->mps_piece_ns, t, -1, FG_BUSY_DEVICE);
    g->mps_piece_ns = t;
    for (int k = 0; k < m.nactive; k++) {
        struct fg_run *r = &g->run[m.active[k]];
        if (is_mps(&m, m.active[k]) && r->started && r->piece_ns) {
            record(&m, r->piece_ns, t, m.active[k], FG_BUSY_OWNER);
            r->piece_ns = t;
        }
    }
}
