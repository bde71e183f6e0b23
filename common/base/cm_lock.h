/* common/base/cm_lock.h — an exclusive lock on a directory that one writer at a time may own (a
 * trainer's run directory, a shard store): flock(2) on a lock file inside it, held while the
 * cm_lock lives. The holder writes "pid <P> on host <H>" into the file so that a second
 * writer's refusal can name it. The lock belongs to the open file, so the kernel drops it when
 * the holder exits or is killed: a lock file left behind never blocks anyone, and it is reused,
 * never removed or replaced (unlinking it would let a waiter and a newcomer lock two different
 * inodes). Advisory: it stops only writers that take it. On NFS, Linux emulates flock with POSIX
 * byte-range locks, so it also holds across hosts there (Lustre needs its flock mount option).
 * One owner thread; the descriptor is close-on-exec, so children do not inherit the lock. */
#ifndef CM_LOCK_H
#define CM_LOCK_H

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cm_lock cm_lock;

/* Takes the lock on path (created 0644 when absent) without waiting and records this process
 * in it. When another process (or another cm_lock of this one) holds it: CM_ERR_INVALID_ARG,
 * "<what> is in use by another <holder>, pid P on host H (lock file '<path>'); <advice>".
 * CM_ERR_IO when the file cannot be created or locked. Caller destroys with cm_lock_destroy. */
cm_status cm_lock_create(cm_lock **out, const char *path, const char *what, const char *holder,
                         const char *advice);
void      cm_lock_destroy(cm_lock **lock); /* NULL-safe; releases the lock; sets *lock = NULL */

#ifdef __cplusplus
}
#endif
#endif /* CM_LOCK_H */
