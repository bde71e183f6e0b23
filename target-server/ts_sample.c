/* target-server/ts_sample.c — sampling a token from logits (ts_sample.h). */
#include "ts_sample.h"

#include <math.h>
#include <stdlib.h>

#include "cm_status.h"

static _Thread_local const float *g_sort_z; /* qsort has no context argument */

/* descending value, then ascending index */
static int by_value(const void *a, const void *b) {
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    const float   x = g_sort_z[i], y = g_sort_z[j];
    if (x != y) return x > y ? -1 : 1;
    return (i > j) - (i < j);
}

cm_status ts_sample(ts_sampler *s, const float *z, int64_t V, float temperature, int top_k, float top_p, cm_rng *rng,
                    int32_t *out) {
    int64_t best = 0;
    for (int64_t v = 1; v < V; v++)
        if (z[v] > z[best]) best = v;
    if (temperature <= 0 || top_k == 1) {
        *out = (int32_t)best;
        return CM_OK;
    }
    if (V > s->cap) {
        ts_sampler_free(s);
        s->idx = malloc((size_t)V * sizeof *s->idx);
        s->p   = malloc((size_t)V * sizeof *s->p);
        if (!s->idx || !s->p) {
            ts_sampler_free(s);
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate sampling scratch for %lld logits", (long long)V);
        }
        s->cap = V;
    }
    for (int64_t v = 0; v < V; v++) s->idx[v] = (int32_t)v;
    g_sort_z = z;
    qsort(s->idx, (size_t)V, sizeof *s->idx, by_value);
    int64_t n = V;
    if (top_k > 0 && top_k < V) { /* ties at the cut stay, as a threshold on the value keeps them */
        n = top_k;
        while (n < V && z[s->idx[n]] == z[s->idx[top_k - 1]]) n++;
    }
    const double zmax = (double)z[s->idx[0]] / temperature;
    double       sum  = 0;
    for (int64_t i = 0; i < n; i++) sum += s->p[i] = exp((double)z[s->idx[i]] / temperature - zmax);
    if (top_p < 1) {
        double mass = 0;
        int64_t keep = 0;
        while (keep < n && mass < (double)top_p * sum) mass += s->p[keep++];
        n   = keep > 0 ? keep : 1;
        sum = 0;
        for (int64_t i = 0; i < n; i++) sum += s->p[i];
    }
    const double u   = cm_rng_uniform(rng) * sum;
    double       acc = 0;
    for (int64_t i = 0; i < n; i++) {
        acc += s->p[i];
        if (u < acc) {
            *out = s->idx[i];
            return CM_OK;
        }
    }
    *out = s->idx[n - 1];
    return CM_OK;
}

void ts_sampler_free(ts_sampler *s) {
    free(s->idx);
    free(s->p);
    s->idx = NULL;
    s->p   = NULL;
    s->cap = 0;
}
