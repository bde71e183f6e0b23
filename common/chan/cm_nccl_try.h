/* common/chan/cm_nccl_try.h — NCCL_TRY, shared by the files that call NCCL (cm_nccl.c, and the
 * trainer's data parallelism, drafter-trainer/model/dt_dp.c): returns CM_ERR_NCCL naming the call
 * and NCCL's message unless it succeeded or is in progress on a non-blocking communicator.
 * Include after <nccl.h> and cm_status.h. */
#ifndef CM_NCCL_TRY_H
#define CM_NCCL_TRY_H

#define NCCL_TRY(x)                                                                                          \
    do {                                                                                                     \
        ncclResult_t r_ = (x);                                                                               \
        if (r_ != ncclSuccess && r_ != ncclInProgress)                                                       \
            return CM_FAIL(CM_ERR_NCCL, "%s failed: %s (%s)", #x, ncclGetErrorString(r_),                    \
                           ncclGetLastError(NULL));                                                          \
    } while (0)

#endif /* CM_NCCL_TRY_H */
