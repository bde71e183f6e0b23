/* tests/test_cm_rng.c — cm_rng: the published xoshiro256** / splitmix64 reference values,
 * reproducibility from a seed and from a saved 4-word state, stream independence for
 * (seed, a, b) keys, uniformity (bucket chi-square), the bounded draw's range and balance,
 * and the normal draw's mean, variance and tails. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cm_rng.h"
#include "tst.h"

static void test_reference_values(void) {
    /* splitmix64 from 0: first outputs of Vigna's splitmix64.c */
    uint64_t x = 0;
    TST_CHECK(cm_rng_splitmix64(&x) == 0xe220a8397b1dcdafULL);
    TST_CHECK(cm_rng_splitmix64(&x) == 0x6e789e6aa1b965f4ULL);
    TST_CHECK(cm_rng_splitmix64(&x) == 0x06c45d188009454fULL);
    /* xoshiro256** from state {1, 2, 3, 4}: the reference implementation gives 11520, 0,
     * 1509978240, 1215971899390074240 */
    cm_rng r = {{1, 2, 3, 4}};
    TST_CHECK(cm_rng_u64(&r) == 11520ULL);
    TST_CHECK(cm_rng_u64(&r) == 0ULL);
    TST_CHECK(cm_rng_u64(&r) == 1509978240ULL);
    TST_CHECK(cm_rng_u64(&r) == 1215971899390074240ULL);
}

static void test_reproducible(void) {
    cm_rng a, b;
    cm_rng_seed(&a, 42);
    cm_rng_seed(&b, 42);
    int same = 1;
    for (int i = 0; i < 1000; i++)
        same &= cm_rng_u64(&a) == cm_rng_u64(&b);
    TST_CHECK(same);

    /* a saved state replays the same stream, normals included */
    cm_rng saved = a;
    double v1[16], v2[16];
    for (int i = 0; i < 16; i++)
        v1[i] = cm_rng_normal(&a);
    a = saved;
    for (int i = 0; i < 16; i++)
        v2[i] = cm_rng_normal(&a);
    TST_CHECK(memcmp(v1, v2, sizeof v1) == 0);

    /* different seeds differ; seed 0 gives a usable (non-zero) state */
    cm_rng_seed(&a, 0);
    cm_rng_seed(&b, 1);
    TST_CHECK(a.s[0] | a.s[1] | a.s[2] | a.s[3]);
    TST_CHECK(cm_rng_u64(&a) != cm_rng_u64(&b));
}

static void test_streams(void) {
    cm_rng a, b, c;
    cm_rng_seed_stream(&a, 7, 3, 5);
    cm_rng_seed_stream(&b, 7, 3, 5);
    TST_CHECK(memcmp(&a, &b, sizeof a) == 0);
    cm_rng_seed_stream(&c, 7, 5, 3); /* key order matters */
    TST_CHECK(memcmp(&a, &c, sizeof a) != 0);
    cm_rng_seed_stream(&c, 8, 3, 5);
    TST_CHECK(memcmp(&a, &c, sizeof a) != 0);
    cm_rng_seed_stream(&c, 7, 3, 6);
    TST_CHECK(memcmp(&a, &c, sizeof a) != 0);
    /* neighbouring keys give uncorrelated first draws: count equal top bits over many pairs */
    int agree = 0;
    for (uint64_t k = 0; k < 4096; k++) {
        cm_rng_seed_stream(&a, 0, 0, k);
        cm_rng_seed_stream(&b, 0, 0, k + 1);
        agree += (cm_rng_u64(&a) >> 63) == (cm_rng_u64(&b) >> 63);
    }
    TST_CHECK(agree > 2048 - 200 && agree < 2048 + 200);
}

static void test_uniform(void) {
    enum { NB = 64, N = 640000 };
    long   hist[NB] = {0};
    cm_rng r;
    cm_rng_seed(&r, 123);
    double sum = 0, lo = 1, hi = 0;
    for (int i = 0; i < N; i++) {
        double u = cm_rng_uniform(&r);
        if (u < lo)
            lo = u;
        if (u > hi)
            hi = u;
        sum += u;
        hist[(int)(u * NB)]++;
    }
    TST_CHECK(lo >= 0.0 && hi < 1.0);
    TST_CHECK(fabs(sum / N - 0.5) < 0.005);
    double chi2 = 0, e = (double)N / NB;
    for (int b = 0; b < NB; b++)
        chi2 += (hist[b] - e) * (hist[b] - e) / e;
    /* 63 degrees of freedom: the 0.999 quantile is about 104 */
    fprintf(stderr, "uniform chi2 %.1f (63 dof)\n", chi2);
    TST_CHECK(chi2 < 104.0);

    /* bounded draws: range and balance for a non-power-of-two n, and n = 1 */
    long cnt[7] = {0};
    for (int i = 0; i < 70000; i++) {
        uint64_t k = cm_rng_below(&r, 7);
        TST_CHECK(k < 7);
        if (k < 7)
            cnt[k]++;
    }
    for (int k = 0; k < 7; k++)
        TST_CHECK(cnt[k] > 9500 && cnt[k] < 10500);
    TST_CHECK(cm_rng_below(&r, 1) == 0);
    uint64_t big = (UINT64_MAX / 3) * 2; /* rejection region is large here */
    for (int i = 0; i < 1000; i++)
        TST_CHECK(cm_rng_below(&r, big) < big);
}

static void test_normal(void) {
    enum { N = 400000 };
    cm_rng r;
    cm_rng_seed(&r, 9);
    double s1 = 0, s2 = 0, s4 = 0;
    long   tail = 0;
    for (int i = 0; i < N; i++) {
        double z = cm_rng_normal(&r);
        TST_CHECK(isfinite(z));
        s1 += z;
        s2 += z * z;
        s4 += z * z * z * z;
        tail += fabs(z) > 1.959964;
    }
    double mean = s1 / N, var = s2 / N - mean * mean, kurt = s4 / N;
    fprintf(stderr, "normal mean %.5f var %.5f E[z^4] %.4f P(|z|>1.96) %.5f\n", mean, var, kurt,
            (double)tail / N);
    TST_CHECK(fabs(mean) < 0.01);    /* sd of the mean is 1/sqrt(N) = 0.0016 */
    TST_CHECK(fabs(var - 1) < 0.01); /* sd of the variance is sqrt(2/N) = 0.0022 */
    TST_CHECK(fabs(kurt - 3) < 0.06);
    TST_CHECK(fabs((double)tail / N - 0.05) < 0.002);
}

int main(void) {
    test_reference_values();
    test_reproducible();
    test_streams();
    test_uniform();
    test_normal();
    return tst_report();
}
