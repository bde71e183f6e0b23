/* tests/test_cm_lock.c — cm_lock.h: a second lock on the same file is refused while the first
 * is held, from another process (a forked child) and from this one, and the refusal names the
 * holder's pid and host, the lock file and the caller's advice; the lock file is reused after
 * the holder releases it or is killed (no stale lock), and keeps only the newest holder's text. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cm_lock.h"
#include "tst.h"

static char dir[64], path[128];

static int refused_by(pid_t pid) {
    cm_lock  *l = NULL;
    cm_status st = cm_lock_create(&l, path, "run directory 'x'", "trainer", "stop it");
    char      want[64];
    snprintf(want, sizeof want, "in use by another trainer, pid %ld on host ", (long)pid);
    int ok = st == CM_ERR_INVALID_ARG && l == NULL && strstr(cm_last_error(), want) &&
             strstr(cm_last_error(), "run directory 'x' is in use") && strstr(cm_last_error(), path) &&
             strstr(cm_last_error(), "; stop it");
    if (!ok)
        fprintf(stderr, "expected a refusal naming pid %ld, got %d: %s\n", (long)pid, st, cm_last_error());
    cm_lock_destroy(&l);
    return ok;
}

static const char *text_of(const char *p) {
    static char buf[256];
    FILE       *f = fopen(p, "r");
    size_t      n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    buf[n] = '\0';
    if (f)
        fclose(f);
    return buf;
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/tandem-lock-XXXXXX");
    if (!mkdtemp(dir))
        return 1;
    snprintf(path, sizeof path, "%s/trainer.lock", dir);

    /* this process holds it: a second cm_lock (another open file) is refused */
    cm_lock *a = NULL;
    TST_CHECK(tst_ok(cm_lock_create(&a, path, "run directory 'x'", "trainer", "stop it"), "lock"));
    char self[64];
    snprintf(self, sizeof self, "pid %ld on host ", (long)getpid());
    TST_CHECK(strncmp(text_of(path), self, strlen(self)) == 0);
    TST_CHECK(refused_by(getpid()));
    cm_lock_destroy(&a);
    TST_CHECK(a == NULL);
    cm_lock_destroy(&a); /* NULL-safe */

    /* a child holds it until killed: refused meanwhile, free again once it is gone */
    int go[2];
    TST_CHECK(pipe(go) == 0);
    pid_t child = fork();
    if (child == 0) {
        cm_lock *c = NULL;
        char     b = cm_lock_create(&c, path, "d", "trainer", "x") == CM_OK ? 'y' : 'n';
        if (write(go[1], &b, 1) != 1)
            _exit(2);
        pause();
        _exit(0);
    }
    char b = 0;
    TST_CHECK(read(go[0], &b, 1) == 1 && b == 'y');
    TST_CHECK(refused_by(child));
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    /* the child's text is still in the file: a stale lock file, which must not block */
    char kid[64];
    snprintf(kid, sizeof kid, "pid %ld on host ", (long)child);
    TST_CHECK(strncmp(text_of(path), kid, strlen(kid)) == 0);
    TST_CHECK(tst_ok(cm_lock_create(&a, path, "d", "trainer", "x"), "lock after the holder died"));
    TST_CHECK(strncmp(text_of(path), self, strlen(self)) == 0 &&
              strchr(text_of(path), '\n') == text_of(path) + strlen(text_of(path)) - 1);
    cm_lock_destroy(&a);

    /* a lock file that cannot be created */
    TST_CHECK(cm_lock_create(&a, "/nonexistent-dir/x.lock", "d", "trainer", "x") == CM_ERR_IO && a == NULL &&
              strstr(cm_last_error(), "cannot create lock file '/nonexistent-dir/x.lock'"));
    unlink(path);
    rmdir(dir);
    return tst_report();
}
