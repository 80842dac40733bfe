/* Checks that dlsym(RTLD_NEXT, ...) still means "after the caller" under the hook. Built three ways:
 *   -DPROBE_FIRST:  an interposer defining tessera_probe() (1) and asking dlsym(RTLD_NEXT) for the next one
 *   -DPROBE_SECOND: the next definition of tessera_probe() (2)
 *   neither:        the program, printing what the interposer's RTLD_NEXT lookup found (expected 2) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

#if defined(PROBE_FIRST)
int tessera_probe(void) { return 1; }
int tessera_probe_next(void) {
    int (*next)(void) = (int (*)(void))dlsym(RTLD_NEXT, "tessera_probe");
    return next ? next() : 0;
}
#elif defined(PROBE_SECOND)
int tessera_probe(void) { return 2; }
#else
int main(void) {
    int (*probe_next)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "tessera_probe_next");
    printf("%d\n", probe_next ? probe_next() : -1);
    return 0;
}
#endif
