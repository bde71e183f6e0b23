/* tests/tst_fd.h — gradients checked by central finite differences: the analytic gradient of a
 * scalar objective L (a function of the current contents of its inputs) against
 * (L(x + h) − L(x − h)) / (x⁺ − x⁻), element by element and as a whole vector. Header-only,
 * after tst.h. */
#ifndef TST_FD_H
#define TST_FD_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tst.h"

static inline double *tst_fd_dnew(long n) {
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    if (!p) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
    return p;
}

/* The objective L as a function of the current contents of the inputs. */
typedef double (*loss_fn)(void *st);

/* Step and tolerances: the ops store fp32, so L carries rounding noise of about
 * sqrt(n_out)·6e-8 and the quotient about that over 2h; the truncation error is h²·L'''/6.
 * h = 1e-2 on O(1) inputs balances the two near 1e-5 absolute. */
#define FD_H      1e-2
#define FD_REL_L2 1e-3 /* whole gradient vector */
#define FD_RTOL   5e-3 /* per element, on top of an absolute floor of FD_AFLOOR·rms(fd) */
#define FD_AFLOOR 2e-3

/* g[i] = (L(x + h e_i) − L(x − h e_i)) / (x_i⁺ − x_i⁻), with the perturbed values as stored. */
static inline void fd_grad(loss_fn f, void *st, float *x, long n, double *g) {
    for (long i = 0; i < n; i++) {
        const float x0 = x[i], xp = (float)(x0 + FD_H), xm = (float)(x0 - FD_H);
        x[i] = xp;
        const double lp = f(st);
        x[i] = xm;
        const double lm = f(st);
        x[i] = x0;
        g[i] = (lp - lm) / ((double)xp - (double)xm);
    }
}

static inline int fd_agrees(const char *name, const float *got, const double *fd, long n, int quiet) {
    double ss = 0;
    for (long i = 0; i < n; i++)
        ss += fd[i] * fd[i];
    const double rms = sqrt(ss / (double)(n > 0 ? n : 1));
    const double rel = tst_rel_l2(got, fd, n);
    int          bad = 0;
    for (long i = 0; i < n; i++) {
        const double d = fabs((double)got[i] - fd[i]);
        if (!(d <= FD_AFLOOR * rms + FD_RTOL * fabs(fd[i]))) {
            if (!quiet && bad < 5)
                fprintf(stderr, "  %s[%ld]: analytic %.8g fd %.8g\n", name, i, got[i], fd[i]);
            bad++;
        }
    }
    const int good = bad == 0 && (rel <= FD_REL_L2 || (ss == 0 && rel == 0));
    if (!quiet && (!good || getenv("TST_VERBOSE")))
        fprintf(stderr, "%s: %s rel L2 %.3g (rms %.3g), %d of %ld elements off\n", good ? "ok" : "FAIL", name,
                rel, rms, bad, n);
    return good;
}

/* Checks an analytic gradient against finite differences of f over x. */
static inline void fd_check(const char *name, loss_fn f, void *st, float *x, const float *got, long n) {
    double *fd = tst_fd_dnew(n);
    fd_grad(f, st, x, n, fd);
    TST_CHECK(fd_agrees(name, got, fd, n, 0));
    free(fd);
}

#endif
