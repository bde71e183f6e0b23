/* common/base/cm_dtype.h — element types shared by files, the wire and kernels, scalar
 * conversions between them, and shape strings for messages. Names are the safetensors
 * spellings ("F32", "BF16", ...).
 * Conversions to narrower types round to nearest even; NaN stays NaN; F8 E4M3 (the
 * "fn" variant: no infinities, max 448) saturates finite values to ±448. */
#ifndef CM_DTYPE_H
#define CM_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cm_dtype {
    CM_DTYPE_F32 = 0,
    CM_DTYPE_F64,
    CM_DTYPE_BF16,
    CM_DTYPE_F16,
    CM_DTYPE_F8_E4M3,
    CM_DTYPE_I64,
    CM_DTYPE_I32,
    CM_DTYPE_I16,
    CM_DTYPE_I8,
    CM_DTYPE_U8,
    CM_DTYPE_BOOL,
    CM_DTYPE_COUNT
} cm_dtype;

size_t      cm_dtype_size(cm_dtype dt);      /* bytes per element */
const char *cm_dtype_name(cm_dtype dt);      /* "F32", "BF16", "F8_E4M3", ... */
/* Parses a safetensors dtype string; CM_ERR_FORMAT (with a message) for unknown names. */
cm_status cm_dtype_parse(const char *name, cm_dtype *out);
int       cm_dtype_is_float(cm_dtype dt);

float    cm_bf16_to_f32(uint16_t h);
uint16_t cm_f32_to_bf16(float f);
float    cm_f16_to_f32(uint16_t h);
uint16_t cm_f32_to_f16(float f);
float    cm_f8e4m3_to_f32(uint8_t b);
uint8_t  cm_f32_to_f8e4m3(float f);

/* Converts n float elements between any two float dtypes (F32, F64, BF16, F16, F8_E4M3).
 * dst and src must not overlap. CM_ERR_INVALID_ARG for a non-float dtype. */
cm_status cm_convert(void *dst, cm_dtype dst_dt, const void *src, cm_dtype src_dt, size_t n);

/* Whether any of the n values of dt (BF16 or F32) at data is NaN or Inf (*any_bad) and whether every
 * one is zero (*all_zero; 0 when n is 0): one vectorisable pass over the bits. */
void cm_scan_values(cm_dtype dt, const void *data, size_t n, int *any_bad, int *all_zero);

/* Writes the extents ne[0..n_dims) as "[a, b, c]" into buf (truncated to len); returns buf. */
char *cm_shape_str(char *buf, size_t len, int n_dims, const int64_t *ne);

#ifdef __cplusplus
}
#endif
#endif /* CM_DTYPE_H */
