/* tests/tst_cuda.h — what a test that starts the CUDA driver needs under ASan: the default
 * shadow-gap protection makes the driver fail to initialise, and the driver keeps its
 * allocations until exit, so let it start and do not report its leaks. Header-only; include
 * once, in a test that may talk to a GPU. */
#ifndef TST_CUDA_H
#define TST_CUDA_H

#if defined(__SANITIZE_ADDRESS__)
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
    return "protect_shadow_gap=0";
}
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) {
    return "leak:libcuda.so\nleak:libcudart.so\nleak:libcublasLt.so\nleak:libcublas.so\n";
}
#endif

#endif /* TST_CUDA_H */
