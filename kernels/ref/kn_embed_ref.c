/* kernels/ref/kn_embed_ref.c — reference embedding lookup: out[t, :] = table[ids[t], :] with
 * the table in F32 or BF16 (widened exactly). The caller checks ids < V before upload (the
 * op does not know V); negative ids are rejected here. */
#include "kn_ref.h"

#include <string.h>

cm_status kn_ref_embed(kn_ctx *ctx, float *out, const int32_t *ids, const void *table, cm_dtype tdt,
                       int64_t T, int64_t C) {
    KN_REF_CHECK(ctx, "embed: ctx is NULL");
    KN_REF_CHECK(T >= 0 && C >= 0, "embed: bad shape T=%lld C=%lld (must be >= 0)", (long long)T,
                 (long long)C);
    if (tdt != CM_DTYPE_F32 && tdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "embed: table dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(tdt));
    if (T == 0 || C == 0) return CM_OK;
    KN_REF_CHECK(out && ids && table, "embed: out, ids or table is NULL");
    for (int64_t t = 0; t < T; t++)
        KN_REF_CHECK(ids[t] >= 0, "embed: ids[%lld]=%d is negative", (long long)t, (int)ids[t]);
    for (int64_t t = 0; t < T; t++) {
        int64_t row = ids[t];
        float  *o   = out + t * C;
        if (tdt == CM_DTYPE_F32) {
            memcpy(o, (const float *)table + row * C, (size_t)C * sizeof(float));
        } else {
            const uint16_t *src = (const uint16_t *)table + row * C;
            for (int64_t c = 0; c < C; c++) o[c] = cm_bf16_to_f32(src[c]);
        }
    }
    return CM_OK;
}
