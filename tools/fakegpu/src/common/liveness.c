/* Whether a slot's process lives: while it does it holds an OFD lock on its byte of the state file
 * (page.h), which the kernel drops however it ends. Below the scheduler model, which drops a dead
 * process's work, and the slots' keeping (shared.c), which takes the lock when it claims a slot. */
#include "page.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int fg_lock_fd(struct fg_shared *s)
{
    /* A forked child must not use its parent's: it would see the parent's locks as its own. */
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

int fg_slot_alive(struct fg_shared *s, int i)
{
    if (i == fg_own_slot_index(s))
        return 1;
    int fd = fg_lock_fd(s);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = FG_LOCK_BASE + i, .l_len = 1};
    if (fd < 0 || fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return 1; /* cannot tell: keep it */
    return fl.l_type != F_UNLCK;
}
