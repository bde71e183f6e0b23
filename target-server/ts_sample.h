/* target-server/ts_sample.h — drawing a token from a row of logits on the host, as Hugging Face's
 * generate samples: logits / temperature, then the top_k largest, then the top_p nucleus, then
 * one draw from what is left, renormalised. */
#ifndef TS_SAMPLE_H
#define TS_SAMPLE_H

#include <stdint.h>

#include "cm_rng.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Scratch for rows of up to V logits, reused between draws. */
typedef struct ts_sampler {
    int64_t  cap;
    int32_t *idx;
    double  *p;
} ts_sampler;

/* temperature 0 (or top_k 1): the argmax (lowest index on ties), no draw. Else: z = logits /
 * temperature; keep the top_k largest (0: all; equal values at the cut all kept); softmax over
 * them; keep the smallest prefix of them in descending order whose mass reaches top_p (at least
 * one); draw from it with one uniform of rng, tokens in descending probability (lower index first
 * among equals). CM_ERR_NOMEM only. */
cm_status ts_sample(ts_sampler *s, const float *logits, int64_t V, float temperature, int top_k, float top_p,
                    cm_rng *rng, int32_t *out);
void      ts_sampler_free(ts_sampler *s);

#ifdef __cplusplus
}
#endif
#endif /* TS_SAMPLE_H */
