/* drafter-trainer/cmd/nodec/dt_eval_nodec.c — stands in for cm_dec's client (common/chan/cm_dec.h) in a
 * tree that declares it but does not implement it yet, so that drafter-trainer links; `eval` then
 * refuses at run time. drafter-trainer/CMakeLists.txt adds this file only when no source of
 * common/chan defines cm_dec_client_create; delete the folder once every tree has the client. */
#include <stddef.h>

#include "cm_dec.h"

cm_status cm_dec_client_create(cm_dec_client **out, const cm_dec_client_config *cfg) {
    (void)cfg;
    if (out)
        *out = NULL;
    return CM_FAIL(CM_ERR_UNSUPPORTED,
                   "this build has no decoding client (common/chan implements no cm_dec client yet); rebuild "
                   "drafter-trainer from a tree that has it");
}

cm_status cm_dec_client_step(cm_dec_client *c, cm_proto_decode *rq, cm_proto_answer *ans) {
    (void)c, (void)rq, (void)ans;
    return CM_FAIL(CM_ERR_UNSUPPORTED, "this build has no decoding client");
}

void cm_dec_client_destroy(cm_dec_client **c) {
    if (c)
        *c = NULL;
}
