/* common/base/cm_tensor.c — tensor descriptor helpers. */
#include "cm_tensor.h"

#include <stdio.h>

cm_tensor cm_tensor_make(void *data, cm_dtype dtype, int n_dims, const int64_t *ne) {
    CM_ASSERT(n_dims >= 0 && n_dims <= CM_TENSOR_MAX_DIMS);
    cm_tensor t = {.data = data, .dtype = dtype, .n_dims = n_dims};
    for (int i = 0; i < CM_TENSOR_MAX_DIMS; i++) t.ne[i] = i < n_dims ? ne[i] : 1;
    int64_t stride = (int64_t)cm_dtype_size(dtype);
    for (int i = CM_TENSOR_MAX_DIMS - 1; i >= 0; i--) {
        t.nb[i] = stride;
        stride *= t.ne[i];
    }
    return t;
}

int64_t cm_tensor_numel(const cm_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->n_dims; i++) n *= t->ne[i];
    return n;
}

size_t cm_tensor_nbytes(const cm_tensor *t) { return (size_t)cm_tensor_numel(t) * cm_dtype_size(t->dtype); }

int cm_tensor_is_contiguous(const cm_tensor *t) {
    int64_t stride = (int64_t)cm_dtype_size(t->dtype);
    for (int i = t->n_dims - 1; i >= 0; i--) {
        if (t->ne[i] != 1 && t->nb[i] != stride) return 0;
        stride *= t->ne[i];
    }
    return 1;
}

char *cm_shape_str(char *buf, size_t len, int n_dims, const int64_t *ne) {
    size_t off = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < n_dims && off < len; i++)
        off += (size_t)snprintf(buf + off, len - off, i ? ", %lld" : "%lld", (long long)ne[i]);
    if (off < len) snprintf(buf + off, len - off, "]");
    return buf;
}
