/* common/format/cm_safetensors.h — safetensors reader (mmap) and writer.
 *
 * File format (https://huggingface.co/docs/safetensors): 8 bytes little-endian u64 N, then N
 * bytes of UTF-8 JSON {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}, ...,
 * "__metadata__": {str: str}}, then the data area; offsets are relative to the data area.
 * Every header field is validated before use: N within the file, JSON well formed, known
 * dtype, shape non-negative with product × dtype size = e − b, 0 ≤ b ≤ e ≤ data size.
 *
 * A cm_st is a read-only set of tensors from one file or from a model directory (sharded:
 * model.safetensors.index.json whose weight_map names each tensor's shard; or a single
 * model.safetensors). Tensor data stays in the mmapped files and is borrowed: valid until
 * cm_st_destroy. A cm_st is immutable after open and may be read from several threads. */
#ifndef CM_SAFETENSORS_H
#define CM_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "cm_dtype.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CM_ST_MAX_DIMS 8

typedef struct cm_st_tensor {
    const char *name;                    /* borrowed from the cm_st */
    cm_dtype    dtype;                   /* from the header */
    int         n_dims;
    int64_t     shape[CM_ST_MAX_DIMS];   /* outermost first */
    const void *data;                    /* borrowed; in the mmapped file; may be unaligned */
    size_t      nbytes;
    const char *file;                    /* path of the file holding it, for messages */
} cm_st_tensor;

typedef struct cm_st cm_st;

/* Opens one .safetensors file. Errors: CM_ERR_IO (missing, unreadable, shorter than its
 * header says), CM_ERR_FORMAT (any malformed header field); the message names the file
 * and the field. Caller destroys with cm_st_destroy. */
cm_status cm_st_open_file(cm_st **out, const char *path);
/* Opens a model directory: model.safetensors.index.json if present (every shard it names
 * must exist and hold the tensors the map assigns to it), else model.safetensors. */
cm_status cm_st_open_dir(cm_st **out, const char *dir);
void      cm_st_destroy(cm_st **st); /* NULL-safe; sets *st = NULL */

int                 cm_st_count(const cm_st *st);
const cm_st_tensor *cm_st_at(const cm_st *st, int i);
const cm_st_tensor *cm_st_find(const cm_st *st, const char *name); /* NULL if absent */
/* The value of a "__metadata__" key, or NULL (first file that has it). */
const char *cm_st_metadata(const cm_st *st, const char *key);

/* Finds name and checks its shape (n_dims and every extent; a negative extent in want
 * matches anything). CM_ERR_FORMAT naming the tensor, what was found and what was expected,
 * e.g. "tensor 'x' has shape [4, 8], expected [4, 16] (in model.safetensors)", or "missing
 * tensor 'x' (looked in DIR)". */
cm_status cm_st_expect(const cm_st *st, const char *name, int n_dims, const int64_t *want,
                       const cm_st_tensor **out);
/* Same, and also requires one of the float dtypes (F32, F64, BF16, F16, F8_E4M3) and converts
 * the data into dst (numel × sizeof dst_dt). */
cm_status cm_st_read(const cm_st *st, const char *name, int n_dims, const int64_t *want, void *dst,
                     cm_dtype dst_dt);
/* Checks that t has exactly dtype dt: CM_ERR_FORMAT "tensor 'x' has dtype F32, expected I32". */
cm_status cm_st_expect_dtype(const cm_st_tensor *t, cm_dtype dt);

// ---- writer

typedef struct cm_st_writer cm_st_writer;

cm_status cm_st_writer_create(cm_st_writer **out);
void      cm_st_writer_destroy(cm_st_writer **w); /* NULL-safe */
/* Adds a tensor; copies name, shape and data (nbytes = numel × dtype size). Names must be
 * unique (CM_ERR_INVALID_ARG otherwise). */
cm_status cm_st_writer_add(cm_st_writer *w, const char *name, cm_dtype dt, int n_dims, const int64_t *shape,
                           const void *data);
/* Adds a tensor whose bytes the caller gives only while the file is written (cm_st_writer_write_with):
 * nothing is copied or held, so a file larger than the memory at hand can be written. */
cm_status cm_st_writer_add_later(cm_st_writer *w, const char *name, cm_dtype dt, int n_dims,
                                 const int64_t *shape);
cm_status cm_st_writer_set_metadata(cm_st_writer *w, const char *key, const char *value);
/* Writes the file atomically: path.tmp, fsync, rename. The header JSON lists tensors in
 * insertion order and is padded with spaces to a multiple of 8 bytes; the data is contiguous
 * (the safetensors library rejects gaps between tensors), ordered by element size 8, 4, 2, 1
 * (insertion order within a size), so every tensor is aligned to its element size. A tensor
 * added later is CM_ERR_INVALID_ARG here: use cm_st_writer_write_with. */
cm_status cm_st_writer_write(cm_st_writer *w, const char *path);
/* The bytes of the tensor added `entry`-th (0-based, over every add) for a writer that is writing:
 * *data points to its nbytes, valid until the next call or the end of the write. */
typedef cm_status (*cm_st_fill_fn)(void *user, int entry, const void **data);
/* cm_st_writer_write, asking fill for each tensor added later just before writing it; a failed
 * fill leaves no file (its status and message are returned). */
cm_status cm_st_writer_write_with(cm_st_writer *w, const char *path, cm_st_fill_fn fill, void *user);

#ifdef __cplusplus
}
#endif
#endif /* CM_SAFETENSORS_H */
