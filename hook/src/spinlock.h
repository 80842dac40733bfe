/* A process-private spinlock for the hook's short critical sections (compute.c's signatures and
 * measurements, tracking.c's table): an uncontended take is one atomic exchange and a give one
 * store, where a pthread mutex costs a few dozen instructions each way on every launch and
 * allocation. Acquire on taking and release on giving order the guarded data as a mutex would. A
 * waiter spins briefly, then yields the CPU, so a holder that was descheduled (or one doing the
 * rare long work under the lock: growing a table, a context's whole table scan) gets to finish.
 * Not robust and not process-shared: the region's lock (region.c) is the one that must survive a
 * process's death; a fork child re-initialises these (vgpu_spin_init). */
#ifndef VGPU_SPINLOCK_H
#define VGPU_SPINLOCK_H

#include <sched.h>

typedef int vgpu_spinlock;

static inline void vgpu_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline void vgpu_spin_take(vgpu_spinlock *lock) {
    unsigned spins = 0;
    while (__atomic_exchange_n(lock, 1, __ATOMIC_ACQUIRE)) {
        while (__atomic_load_n(lock, __ATOMIC_RELAXED)) {
            if (++spins % 64 == 0) sched_yield();
            else vgpu_cpu_relax();
        }
    }
}

static inline void vgpu_spin_give(vgpu_spinlock *lock) { __atomic_store_n(lock, 0, __ATOMIC_RELEASE); }

static inline void vgpu_spin_init(vgpu_spinlock *lock) { __atomic_store_n(lock, 0, __ATOMIC_RELAXED); }

#endif
