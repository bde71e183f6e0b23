/* kernels/ref/kn_parallel_ref.c — the one OpenMP scaffold of the reference kernels that need
 * per-thread scratch: every thread allocates its scratch once, runs its share of the tasks, and
 * frees it; a thread that cannot allocate runs none and the call fails with CM_ERR_NOMEM. The
 * tasks write disjoint outputs, so the result does not depend on the thread count or the
 * schedule. */
#include "kn_ref.h"

#include <stdlib.h>

cm_status kn_ref_parallel(const char *op, int64_t n_tasks, int chunk, size_t scratch_bytes, kn_ref_task_fn fn,
                          const void *user) {
    int failed = 0;
    if (chunk < 1) chunk = 1;
#ifdef _OPENMP
#pragma omp parallel
#endif
    {
        void *scratch = malloc(scratch_bytes > 0 ? scratch_bytes : 1);
        if (!scratch) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, chunk)
#endif
        for (int64_t task = 0; task < n_tasks; task++)
            if (scratch) fn(task, scratch, user);
        free(scratch);
    }
    if (failed)
        return CM_FAIL(CM_ERR_NOMEM, "%s: cannot allocate %zu bytes of scratch for each thread", op,
                       scratch_bytes);
    return CM_OK;
}
