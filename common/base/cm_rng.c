/* common/base/cm_rng.c — xoshiro256** (Blackman & Vigna) with splitmix64 seeding, uniform, bounded
 * and normal draws. Everything is a pure function of the 4-word state, so a saved state
 * replays the same stream bit for bit on any platform (no floating point in the core). */
#include "cm_rng.h"

#include <math.h>

#include "cm_status.h"

static inline uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

uint64_t cm_rng_splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void cm_rng_seed(cm_rng *r, uint64_t seed) {
    CM_ASSERT(r);
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = cm_rng_splitmix64(&x);
    /* splitmix64 is a bijection of distinct counters, so four consecutive outputs are never all
     * zero; keep the guard anyway because xoshiro's all-zero state is a fixed point */
    if (!(r->s[0] | r->s[1] | r->s[2] | r->s[3]))
        r->s[0] = 1;
}

void cm_rng_seed_stream(cm_rng *r, uint64_t seed, uint64_t a, uint64_t b) {
    /* chain the keys through splitmix64 so (seed, a, b) and (seed, b, a) differ */
    uint64_t x = seed;
    uint64_t h = cm_rng_splitmix64(&x);
    x = h ^ a;
    h = cm_rng_splitmix64(&x);
    x = h ^ b;
    h = cm_rng_splitmix64(&x);
    cm_rng_seed(r, h);
}

uint64_t cm_rng_u64(cm_rng *r) {
    uint64_t *s = r->s;
    uint64_t  result = rotl(s[1] * 5, 7) * 9;
    uint64_t  t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double cm_rng_uniform(cm_rng *r) {
    return (double)(cm_rng_u64(r) >> 11) * 0x1.0p-53;
}

uint64_t cm_rng_below(cm_rng *r, uint64_t n) {
    CM_ASSERT(n >= 1);
    /* rejection on the top of the range: accept x < n·floor(2^64 / n) */
    uint64_t limit = UINT64_MAX - (UINT64_MAX % n + 1) % n;
    uint64_t x;
    do {
        x = cm_rng_u64(r);
    } while (x > limit);
    return x % n;
}

double cm_rng_normal(cm_rng *r) {
    double u1 = 1.0 - cm_rng_uniform(r); /* (0, 1]: log never sees 0 */
    double u2 = cm_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
}
