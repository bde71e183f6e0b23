/* tests/tst_dt.h — what the drafter-model tests share: every gradient of a dt_model in one host array,
 * and the oracle fixtures found under a directory. Header-only; include after tst.h. */
#ifndef TST_DT_H
#define TST_DT_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dt_model.h"
#include "tst.h"

/* Every parameter's gradient (values: its values), in parameter order, downloaded into one malloc'd
 * array of *total floats (caller frees). */
static inline float *tst_dt_download(const dt_model *m, const kn_backend *be, kn_ctx *ctx, int64_t *total,
                                     int values) {
    *total = 0;
    for (int i = 0; i < dt_model_n_params(m); i++)
        *total += dt_model_param(m, i)->numel;
    float  *g = malloc((size_t)*total * sizeof *g);
    int64_t off = 0;
    for (int i = 0; g && i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        TST_CHECK(be->download(ctx, g + off, values ? p->data : p->grad, (size_t)p->numel * sizeof *g) ==
                  CM_OK);
        off += p->numel;
    }
    return g;
}
static inline float *tst_dt_grads(const dt_model *m, const kn_backend *be, kn_ctx *ctx, int64_t *total) {
    return tst_dt_download(m, be, ctx, total, 0);
}

/* The fixtures under root (the directories holding a ref.safetensors), names strdup'd into names
 * (at most 64) and sorted, for a stable report; returns how many. */
static inline int tst_dt_fixtures(const char *root, char **names) {
    DIR *d = opendir(root);
    int  n = 0;
    if (!d)
        return 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64) {
        char ref[2048];
        snprintf(ref, sizeof ref, "%s/%s/ref.safetensors", root, e->d_name);
        if (e->d_name[0] != '.' && access(ref, R_OK) == 0)
            names[n++] = strdup(e->d_name);
    }
    closedir(d);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (strcmp(names[j], names[i]) < 0) {
                char *t = names[i];
                names[i] = names[j];
                names[j] = t;
            }
    return n;
}

#endif /* TST_DT_H */
