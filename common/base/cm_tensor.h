/* common/base/cm_tensor.h — a tensor descriptor over borrowed memory (it owns nothing).
 * ne[] are extents, outermost first as in safetensors and PyTorch (ne[0] is the slowest
 * axis); nb[] are strides in bytes. Unused trailing axes have ne = 1. */
#ifndef CM_TENSOR_H
#define CM_TENSOR_H

#include <stdint.h>

#include "cm_dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CM_TENSOR_MAX_DIMS 4

typedef struct cm_tensor {
    void    *data;                   /* borrowed */
    cm_dtype dtype;
    int      n_dims;                 /* 0..4 */
    int64_t  ne[CM_TENSOR_MAX_DIMS]; /* extents, outermost first */
    int64_t  nb[CM_TENSOR_MAX_DIMS]; /* strides in bytes */
} cm_tensor;

/* A contiguous (row-major) descriptor over data. n_dims <= CM_TENSOR_MAX_DIMS. */
cm_tensor cm_tensor_make(void *data, cm_dtype dtype, int n_dims, const int64_t *ne);
int64_t   cm_tensor_numel(const cm_tensor *t);
size_t    cm_tensor_nbytes(const cm_tensor *t); /* of a contiguous tensor */
int       cm_tensor_is_contiguous(const cm_tensor *t);
/* Writes "[a, b, c]" into buf; returns buf. */
char *cm_shape_str(char *buf, size_t len, int n_dims, const int64_t *ne);

#ifdef __cplusplus
}
#endif
#endif /* CM_TENSOR_H */
