/* Process ids as the caller of NVML sees them.
 *
 * The real driver knows every process by its pid in the host's PID namespace, so NVML in the host's
 * namespace (a node agent with hostPID, nvidia-smi on the node) gets pids it can look up in /proc,
 * and NVML in a container gets host pids that mean nothing there. The fake driver has no kernel
 * side: each process records the pid it sees itself by and the inode of its PID namespace
 * (common/shared.c), and NVML translates that here into the caller's view, by finding in the
 * caller's /proc the process in that namespace whose innermost pid (the last of `NSpid` in its
 * status) is the recorded one. A process the caller cannot see (it lives in another container's
 * namespace, or is gone) is reported as pid 0, which names no process: a caller can fail to
 * attribute it, never attribute it to the wrong one. */
#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "internal.h"

/* The innermost pid in /proc/<pid>/status's NSpid line, -1 when there is none. */
static long innermost_pid(unsigned long of)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%lu/status", of);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    long pid = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "NSpid:", 6) != 0)
            continue;
        for (char *p = line + 6, *end; *p; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p)
                break;
            pid = v;
        }
        break;
    }
    fclose(f);
    return pid;
}

unsigned fg_visible_pid(struct fg_pid pid)
{
    if (pid.pidns == 0 || pid.pidns == fg_own_pidns())
        return (unsigned)pid.pid; /* the caller's own namespace (or a process that could not tell) */
    DIR *proc = opendir("/proc");
    if (!proc)
        return 0;
    unsigned found = 0;
    for (struct dirent *e; !found && (e = readdir(proc));) {
        if (!isdigit((unsigned char)e->d_name[0]))
            continue;
        unsigned long candidate = strtoul(e->d_name, NULL, 10);
        char path[64];
        struct stat st;
        snprintf(path, sizeof path, "/proc/%lu/ns/pid", candidate);
        if (stat(path, &st) != 0 || (uint64_t)st.st_ino != pid.pidns)
            continue;
        if (innermost_pid(candidate) == pid.pid)
            found = (unsigned)candidate;
    }
    closedir(proc);
    return found;
}
