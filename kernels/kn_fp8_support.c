/* kernels/kn_fp8_support.c — whether a CUDA device runs the block-scaled FP8 GEMMs
 * (kn_backend.h): cuBLASLt's 1 × 128 and 128 × 128 scale modes exist for compute capability 9.0
 * only (Hopper; Blackwell has other block formats) and from cuBLASLt 12.9 on. A pure rule, so
 * the refusal can be tested on any machine. */
#include "kn_backend.h"

#include <stdio.h>

int kn_fp8_support(int cc_major, int cc_minor, long lt_version, char *why, size_t n) {
    const char *what = NULL;
    if (cc_major != 9 || cc_minor != 0)
        what = "block-scaled FP8 GEMMs (1 x 128 and 128 x 128 scales) run on compute capability 9.0 (Hopper) only";
    else if (lt_version < 120900)
        what = "block-scaled FP8 GEMMs need cuBLASLt 12.9 or later";
    if (why && n) {
        if (what)
            snprintf(why, n, "this GPU (compute capability %d.%d, cuBLASLt %ld) cannot run --precision fp8: %s; "
                     "use --precision bf16 to run the FP8 checkpoint dequantized to bf16",
                     cc_major, cc_minor, lt_version, what);
        else
            why[0] = 0;
    }
    return what == NULL;
}
