/* How the fake GPU tells that an MPS control daemon runs in a pipe directory: the stand-in
 * nvidia-cuda-mps-control (mps/mps_control.c) holds a lock on this file there while it runs, and
 * libcuda (cuda/mps.c) asks whether someone holds it. One header, so that both spell it alike. */
#ifndef FG_MPS_LOCK_H
#define FG_MPS_LOCK_H

#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <unistd.h>

#define FG_MPS_LOCK_FILE "fakegpu-mps.lock"

/* 1 while a daemon holds the lock in `dir` (an open file description's lock: OFD, so that a forked
 * or threaded reader never takes it as its own). */
static inline int fg_mps_daemon_runs(const char *dir)
{
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", dir, FG_MPS_LOCK_FILE) >= (int)sizeof path)
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    int held = fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
    close(fd);
    return held;
}

#endif
