/* tests/tst_proc.h — running a program of the build as a real child process: argv, exit
 * status, and its stderr captured to a file for checking messages; a child waited for with a
 * deadline or ended with a signal (SIGKILL when it outlives the wait), a shell line's output,
 * small files read back (whole, a child's .err, their lines, compared byte for byte), and the
 * removal of the test's folder. Sanitizer exit codes are moved away from 1 so "exit 1 with a
 * message" cannot be mistaken for a sanitizer report. */
#ifndef TST_PROC_H
#define TST_PROC_H

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

/* Starts argv (argv[0] a path) with stderr opened on err_path with oflag (O_TRUNC or O_APPEND)
 * and stdout on /dev/null, sanitizer exit codes set; the pid, or -1 (said on stderr). */
static inline pid_t tst_spawn_(char *const argv[], const char *err_path, int oflag) {
    setenv("ASAN_OPTIONS", "exitcode=86", 1);
    setenv("UBSAN_OPTIONS", "halt_on_error=1:exitcode=87:print_stacktrace=1", 1);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, err_path, O_WRONLY | O_CREAT | oflag, 0644);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    pid_t pid;
    int   rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
        fprintf(stderr, "cannot start '%s': %s\n", argv[0], strerror(rc));
        return -1;
    }
    return pid;
}

/* Runs argv (argv[0] a path), stderr into err_path. Returns the exit status, or 128 + signal. */
static inline int tst_run(char *const argv[], const char *err_path) {
    pid_t pid = tst_spawn_(argv, err_path, O_TRUNC);
    if (pid < 0)
        return -1;
    int status;
    if (waitpid(pid, &status, 0) < 0)
        return -1;
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}

static inline void tst_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Starts argv (argv[0] a path) as a child with stderr appended to err_path, without waiting
 * (sanitizer exit codes as tst_run). Returns the pid, or -1. */
static inline pid_t tst_spawn(char *const argv[], const char *err_path) {
    return tst_spawn_(argv, err_path, O_APPEND);
}

/* Waits up to ms for pid; its exit status (128 + signal), or -1 if it is still running. */
static inline int tst_wait_exit(pid_t pid, int ms) {
    int status;
    for (int waited = 0;; waited += 10) {
        if (waitpid(pid, &status, WNOHANG) == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (waited >= ms)
            return -1;
        tst_sleep_ms(10);
    }
}

/* Reads a whole small text file into a static buffer ("" if unreadable). */
static inline const char *tst_slurp(const char *path) {
    static char buf[1 << 16];
    buf[0]  = '\0';
    FILE *f = fopen(path, "rb");
    if (!f) return buf;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n]   = '\0';
    fclose(f);
    return buf;
}

/* Waits up to ms for a `serve --endpoint-file EP_FILE` child to write its bound endpoint into
 * out (cap bytes); 1 then. 0 if it exited first or did not bind in time (its log printed, a
 * late child killed). */
static inline int tst_await_endpoint(pid_t pid, const char *ep_file, const char *log, char *out, size_t cap,
                                     int ms) {
    for (int waited = 0; pid > 0 && waited < ms; waited += 50) {
        FILE *f = fopen(ep_file, "r");
        if (f) {
            int ok = fgets(out, (int)cap, f) != NULL;
            fclose(f);
            out[strcspn(out, "\n")] = '\0';
            if (ok && out[0]) return 1;
        }
        if (tst_wait_exit(pid, 0) >= 0) {
            fprintf(stderr, "serve exited early:\n%s\n", tst_slurp(log));
            return 0;
        }
        tst_sleep_ms(50);
    }
    fprintf(stderr, "serve did not bind within %d ms:\n%s\n", ms, tst_slurp(log));
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    return 0;
}

/* Sends sig to pid (after a SIGCONT, so a stopped child can act on it) and waits up to ms:
 * its exit status (128 + signal), or -1 when it had to be killed with SIGKILL (or pid <= 0). */
static inline int tst_end(pid_t pid, int sig, int ms) {
    if (pid <= 0)
        return -1;
    kill(pid, SIGCONT);
    kill(pid, sig);
    int rc = tst_wait_exit(pid, ms);
    if (rc < 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    return rc;
}

/* Ends *pid with SIGTERM (SIGKILL after 15 s) and sets it to -1; nothing when it is < 0. */
static inline void tst_stop(pid_t *pid) {
    if (*pid < 0)
        return;
    tst_end(*pid, SIGTERM, 15000);
    *pid = -1;
}

/* Waits up to ms for pid (-1 when none started); its exit status, or -1 when it ran past ms
 * (then it is killed). */
static inline int tst_finish(pid_t pid, int ms) {
    int rc = pid < 0 ? -1 : tst_wait_exit(pid, ms);
    if (rc < 0 && pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    return rc;
}

/* The text of dir/name (tst_slurp: a static buffer, "" if unreadable). */
static inline const char *tst_text_in(const char *dir, const char *name) {
    char p[900];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return tst_slurp(p);
}

/* The text of dir/NAME.err, where a child's stderr was sent (as tst_text_in). */
static inline const char *tst_err_in(const char *dir, const char *name) {
    char p[900];
    snprintf(p, sizeof p, "%s/%s.err", dir, name);
    return tst_slurp(p);
}

/* The lines of a text file (its '\n's; 0 if unreadable). */
static inline int tst_lines(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int n = 0, c;
    while ((c = fgetc(f)) != EOF)
        n += c == '\n';
    fclose(f);
    return n;
}

/* 1 if files a and b both open and hold the same bytes. */
static inline int tst_same_file(const char *a, const char *b) {
    FILE *f = fopen(a, "rb"), *g = fopen(b, "rb");
    int   same = f && g;
    while (same) {
        int x = fgetc(f), y = fgetc(g);
        if (x != y)
            same = 0;
        if (x == EOF || y == EOF)
            break;
    }
    if (f)
        fclose(f);
    if (g)
        fclose(g);
    return same;
}

/* Runs cmd (a shell line) and returns its exit status (-1 if it did not run or exit); its
 * stdout (and whatever cmd redirects there) into out, cap bytes. */
static inline int tst_sh(const char *cmd, char *out, size_t cap) {
    out[0] = '\0';
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    int status = pclose(f);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* rm -rf dir; 1 if that succeeded, else 0 with a message. */
static inline int tst_rmdir(const char *dir) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) == 0)
        return 1;
    fprintf(stderr, "cannot remove %s\n", dir);
    return 0;
}

/* Removes the test's folder dir when rc is 0 (a failed run keeps its logs); returns rc. */
static inline int tst_cleanup(const char *dir, int rc) {
    if (rc == 0)
        tst_rmdir(dir);
    return rc;
}

#endif /* TST_PROC_H */
