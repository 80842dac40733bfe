/* nvidia-cuda-mps-control, the fake's stand-in: starts and stops "MPS" on the fake GPU the way the
 * real control daemon is started and stopped, so tests and the sandbox drive it alike.
 *
 *   nvidia-cuda-mps-control -d     start the daemon in the background (returns once it runs)
 *   nvidia-cuda-mps-control -f     the same in the foreground
 *   nvidia-cuda-mps-control        read commands on stdin; `quit` stops the daemon (and waits for it)
 *
 * Its directory is CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps), its log
 * CUDA_MPS_LOG_DIRECTORY/control.log (default /var/log/nvidia-mps). While it runs it holds a lock on
 * `fakegpu-mps.lock` there: the fake libcuda makes a process whose CUDA_MPS_PIPE_DIRECTORY names that
 * directory an MPS client (src/cuda/mps.c). Commands travel through the FIFO `control` there, as the
 * real daemon's do through its pipes. The real daemon's other commands are not modelled. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "mps_lock.h"

#define CONTROL_FIFO "control"

static char pipe_dir[PATH_MAX - 64], log_path[PATH_MAX];

static void say(const char *what)
{
    FILE *f = fopen(log_path, "a");
    if (!f)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    fprintf(f, "[%lld.%03ld] fakegpu MPS control daemon: %s\n", (long long)ts.tv_sec, ts.tv_nsec / 1000000, what);
    fclose(f);
}

static int lock_held(void)
{
    return fg_mps_daemon_runs(pipe_dir);
}

/* The daemon's life: holds the lock (taken before, so a second daemon fails at once) and serves
 * the FIFO until `quit`. */
static int serve(int lock_fd, int ready_fd)
{
    char fifo[PATH_MAX];
    snprintf(fifo, sizeof fifo, "%s/%s", pipe_dir, CONTROL_FIFO);
    int fd = open(fifo, O_RDWR | O_CLOEXEC); /* read-write: never EOF while no client is connected */
    if (fd < 0) {
        fprintf(stderr, "nvidia-cuda-mps-control: cannot open %s: %s\n", fifo, strerror(errno));
        return 1;
    }
    say("started");
    if (ready_fd >= 0) {
        (void)!write(ready_fd, "1", 1);
        close(ready_fd);
    }
    char buf[4096];
    size_t used = 0;
    for (;;) {
        ssize_t n = read(fd, buf + used, sizeof buf - 1 - used);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
            break;
        }
        used += (size_t)n;
        buf[used] = '\0';
        char *line;
        while ((line = strchr(buf, '\n'))) {
            *line = '\0';
            if (strcmp(buf, "quit") == 0) {
                say("quit");
                unlink(fifo);
                close(lock_fd); /* clients stop being MPS clients from here */
                return 0;
            }
            if (buf[0])
                say("command not modelled by the fake");
            used -= (size_t)(line + 1 - buf);
            memmove(buf, line + 1, used + 1);
        }
        if (used == sizeof buf - 1)
            used = 0;
    }
    return 1;
}

static int start(int background)
{
    if (mkdir(pipe_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "nvidia-cuda-mps-control: cannot create %s: %s\n", pipe_dir, strerror(errno));
        return 1;
    }
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", pipe_dir, FG_MPS_LOCK_FILE);
    int lock_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    if (lock_fd < 0 || fcntl(lock_fd, F_OFD_SETLK, &fl) != 0) {
        fprintf(stderr, "An instance of this daemon is already running\n");
        return 1;
    }
    snprintf(path, sizeof path, "%s/%s", pipe_dir, CONTROL_FIFO);
    unlink(path);
    if (mkfifo(path, 0666) != 0) {
        fprintf(stderr, "nvidia-cuda-mps-control: cannot create %s: %s\n", path, strerror(errno));
        return 1;
    }
    if (!background)
        return serve(lock_fd, -1);
    int ready[2];
    if (pipe(ready) != 0)
        return 1;
    pid_t pid = fork();
    if (pid < 0)
        return 1;
    if (pid == 0) { /* the daemon: its own session, no terminal, stdio on /dev/null */
        close(ready[0]);
        setsid();
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 1);
            dup2(null, 2);
            if (null > 2)
                close(null);
        }
        _exit(serve(lock_fd, ready[1]));
    }
    close(ready[1]);
    char c;
    ssize_t n = read(ready[0], &c, 1); /* returns once the daemon serves (or died) */
    return n == 1 ? 0 : 1;
}

/* A control client: commands on stdin, each sent to the daemon. */
static int control(void)
{
    char line[1024];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\r\n")] = '\0';
        if (!line[0])
            continue;
        char fifo[PATH_MAX];
        snprintf(fifo, sizeof fifo, "%s/%s", pipe_dir, CONTROL_FIFO);
        int fd = open(fifo, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0 || !lock_held()) {
            fprintf(stderr, "Cannot find MPS control daemon process\n");
            return 1;
        }
        size_t len = strlen(line);
        line[len] = '\n';
        int ok = write(fd, line, len + 1) == (ssize_t)(len + 1);
        close(fd);
        line[len] = '\0';
        if (!ok)
            return 1;
        if (strcmp(line, "quit") == 0) { /* as the real one: back once the daemon is gone */
            for (int i = 0; i < 1000 && lock_held(); i++)
                usleep(10000);
            return lock_held();
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    const char *logs = getenv("CUDA_MPS_LOG_DIRECTORY");
    snprintf(pipe_dir, sizeof pipe_dir, "%s", dir && *dir ? dir : "/tmp/nvidia-mps");
    snprintf(log_path, sizeof log_path, "%s/control.log", logs && *logs ? logs : "/var/log/nvidia-mps");
    signal(SIGPIPE, SIG_IGN);
    if (argc == 2 && (strcmp(argv[1], "-d") == 0 || strcmp(argv[1], "-f") == 0))
        return start(strcmp(argv[1], "-d") == 0);
    if (argc == 1)
        return control();
    fprintf(stderr, "usage: nvidia-cuda-mps-control [-d | -f]   (commands on stdin: quit)\n");
    return 2;
}
