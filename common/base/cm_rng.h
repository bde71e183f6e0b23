/* common/base/cm_rng.h — a small deterministic generator: xoshiro256** seeded through splitmix64.
 * The whole state is 4 × u64 (cm_rng.s), so it serialises as-is into checkpoints; nothing is
 * cached between calls (cm_rng_normal draws two uniforms per call and keeps no spare), so the
 * stream depends only on s. Streams derived from (seed, a, b) are independent of each other and
 * of call history: used for per-epoch / per-batch draws that must not depend on what ran before.
 * Caller-owned struct, no allocation; not thread-safe (one generator per thread). */
#ifndef CM_RNG_H
#define CM_RNG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cm_rng {
    uint64_t s[4]; /* xoshiro256** state; never all zero */
} cm_rng;

/* One splitmix64 step: advances *x by the golden-ratio increment and returns the mixed value. */
uint64_t cm_rng_splitmix64(uint64_t *x);

/* Seeds the 4 words from splitmix64(seed) (any seed, 0 included, gives a non-zero state). */
void cm_rng_seed(cm_rng *r, uint64_t seed);

/* Seeds a stream keyed by (seed, a, b): the words come from splitmix64 over a hash of the three
 * keys, so (seed, epoch, batch) → a state that does not depend on any earlier draw. */
void cm_rng_seed_stream(cm_rng *r, uint64_t seed, uint64_t a, uint64_t b);

uint64_t cm_rng_u64(cm_rng *r);               /* 64 uniform bits */
double   cm_rng_uniform(cm_rng *r);           /* uniform in [0, 1), 53-bit resolution */
uint64_t cm_rng_below(cm_rng *r, uint64_t n); /* uniform in [0, n) without modulo bias; n ≥ 1 */
double   cm_rng_normal(cm_rng *r);            /* N(0, 1) by Box–Muller (cosine branch) */

#ifdef __cplusplus
}
#endif
#endif /* CM_RNG_H */
