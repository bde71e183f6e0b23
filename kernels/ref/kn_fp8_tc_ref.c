/* kernels/ref/kn_fp8_tc_ref.c — a model of how an FP8 tensor core adds a group's products, for
 * diagnosis: TANDEM_FP8_REF_TC=BITS[:CHUNK[:PROMOTE]] makes the CPU reference's gemm_fp8q sum each
 * 128-wide group with it instead of exactly (kn_fp8_ref.c). Not the specification, which stays
 * exact; this answers how far an accumulation of limited width moves the W8A8 forward
 * (bench/fp8_accum_model.sh, docs/checks.md).
 *
 * The model, after the published descriptions of the Hopper FP8 MMA (products exact, a
 * multi-operand adder of about 14 bits): the group's products are taken CHUNK at a time (32, one
 * m64nNk32 instruction, by default). Each chunk's products and the running sum are aligned to the
 * largest exponent among them and cut toward zero to BITS bits below it (a value in
 * [2^(e-1), 2^e) keeps multiples of 2^(e-BITS)), added exactly, and the total rounded to F32 as
 * the new running sum. PROMOTE = 1 starts every chunk from zero and adds each chunk's F32 result
 * to the group's sum in double, as a kernel that promotes to fp32 after every instruction would;
 * PROMOTE = 0 (the default) chains the chunks of a group in the tensor core, as cuBLASLt's
 * block-scaled product and Tandem's wgmma kernel do. Each chunk's sum is exact in double for
 * BITS ≤ 40 (129 terms on a grid of 2^-BITS of the largest); BITS = 40 with CHUNK = 128 cuts only
 * products 2^32 times below the group's largest, and is otherwise the exact sum rounded once to F32. */
#include "kn_ref.h"

#include <stdlib.h>
#include <string.h>

cm_status kn_ref_fp8_tc_model(kn_fp8_tc_model *m) {
    memset(m, 0, sizeof *m);
    const char *e = getenv("TANDEM_FP8_REF_TC");
    if (!e || !*e)
        return CM_OK;
    int bits = 0, chunk = 32, promote = 0, used = 0;
    int n = sscanf(e, "%d%n:%d%n:%d%n", &bits, &used, &chunk, &used, &promote, &used);
    if (n < 1 || e[used] != '\0' || bits < 4 || bits > 40 || chunk < 1 || chunk > 128 ||
        (promote != 0 && promote != 1))
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "TANDEM_FP8_REF_TC='%s' is not BITS[:CHUNK[:PROMOTE]] with BITS in 4..40, CHUNK in 1..128 "
            "and PROMOTE 0 or 1 (e.g. 14, 14:32:1); unset it for the exact reference",
            e);
    m->bits = bits;
    m->chunk = chunk;
    m->promote = promote;
    return CM_OK;
}

/* t cut toward zero to a multiple of q (a power of two). */
static double cut(double t, double q) {
    return trunc(t / q) * q;
}

double kn_ref_fp8_tc_dot(const float *a, const float *w, int64_t n, const kn_fp8_tc_model *m) {
    double total = 0;
    float  run = 0;
    for (int64_t c0 = 0; c0 < n; c0 += m->chunk) {
        const int64_t c1 = c0 + m->chunk < n ? c0 + m->chunk : n;
        int           top = INT32_MIN, ex;
        if (run != 0)
            frexp((double)run, &top);
        for (int64_t i = c0; i < c1; i++) {
            const double p = (double)a[i] * (double)w[i];
            if (p == 0)
                continue;
            frexp(p, &ex);
            if (ex > top)
                top = ex;
        }
        if (top == INT32_MIN)
            continue; /* all zero */
        const double q = ldexp(1.0, top - m->bits);
        double       s = cut((double)run, q);
        for (int64_t i = c0; i < c1; i++)
            s += cut((double)a[i] * (double)w[i], q);
        run = (float)s;
        if (m->promote)
            total += (double)run, run = 0;
    }
    return total + (double)run;
}
