/* common/base/cm_lock.c — the flock'd lock file of cm_lock.h: open (create), flock LOCK_EX|LOCK_NB,
 * then our "pid P on host H" written over the file's old text; a refused caller reads that text
 * back for its message. */
#include "cm_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "cm_log.h"

struct cm_lock {
    int fd; /* holds the flock */
};

/* The holder's text from the lock file, one printable line; "" when unreadable or not yet
 * written (the holder has the lock but has not recorded itself). */
static void read_holder(int fd, char *buf, size_t cap) {
    ssize_t n = pread(fd, buf, cap - 1, 0);
    buf[n > 0 ? n : 0] = '\0';
    for (char *c = buf; *c; c++)
        if (*c == '\n' || (unsigned char)*c < 0x20 || (unsigned char)*c > 0x7e) {
            *c = '\0';
            break;
        }
}

cm_status cm_lock_create(cm_lock **out, const char *path, const char *what, const char *holder,
                         const char *advice) {
    *out = NULL;
    cm_lock *l = calloc(1, sizeof *l);
    if (!l)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a lock");
    cm_status st = CM_OK;
    if ((l->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot create lock file '%s': %s", path, strerror(errno));
        goto fail;
    }
    if (flock(l->fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK) {
            st = CM_FAIL(CM_ERR_IO, "cannot lock '%s': %s", path, strerror(errno));
            goto fail;
        }
        char who[256];
        read_holder(l->fd, who, sizeof who);
        st = CM_FAIL(CM_ERR_INVALID_ARG, "%s is in use by another %s, %s (lock file '%s'); %s", what, holder,
                     who[0] ? who : "whose pid is not recorded yet", path, advice);
        goto fail;
    }
    char host[256] = "unknown", line[320];
    if (gethostname(host, sizeof host - 1) != 0)
        snprintf(host, sizeof host, "unknown");
    host[sizeof host - 1] = '\0';
    int n = snprintf(line, sizeof line, "pid %ld on host %s\n", (long)getpid(), host);
    /* the text is for messages only: the flock is the lock, so a failed write is not fatal */
    if (ftruncate(l->fd, 0) != 0 || pwrite(l->fd, line, (size_t)n, 0) != n)
        CM_LOG_WARN("cannot record this process in lock file '%s': %s; a refused writer will not see "
                    "its pid",
                    path, strerror(errno));
    *out = l;
    return CM_OK;
fail:
    cm_lock_destroy(&l);
    return st;
}

void cm_lock_destroy(cm_lock **lock) {
    if (!lock || !*lock)
        return;
    if ((*lock)->fd >= 0)
        close((*lock)->fd); /* releases the flock */
    free(*lock);
    *lock = NULL;
}
