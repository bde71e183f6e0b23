/* common/format/cm_compress.h — encodings of hidden-state tensors for the wire and the shard files:
 * raw, zstd, zstd over byte planes (lossless), and FP8 E4M3 with per-row scales then zstd
 * (lossy, opt-in). One cm_compress owns a pool of worker threads (the caller's thread is
 * worker 0), one ZSTD_CCtx and ZSTD_DCtx per worker, and per-worker scratch; a tensor is cut
 * into fixed-size chunks, each an independent zstd frame, so one tensor compresses on several
 * cores and the output bytes do not depend on the number of threads. A cm_compress is used by
 * one thread at a time; its scratch grows to the largest chunk seen, then is reused.
 *
 * STREAM (encodings zstd, zstd-byteplane, fp8-zstd; raw is the elements as they are)
 *   HEAD | CHUNK TABLE | SCALES (fp8-zstd only) | CHUNKS, little-endian, no padding
 *   HEAD (32 bytes)
 *     0  u32 magic        0x315A4354 (the bytes "TCZ1")
 *     4  u8  encoding     cm_encoding; must be the descriptor's
 *     5  u8  dtype        cm_dtype of the elements; must be the descriptor's
 *     6  u8  transform    zstd-byteplane: 0 = none, 1 = every element rotated left by one bit
 *                         before the split (puts the float exponent alone in the high byte);
 *                         other encodings: 0
 *     7  u8  reserved     0
 *     8  u64 n_elems      elements in the tensor (= rows × row length of the descriptor)
 *     16 u64 row_len      fp8-zstd: elements per scale row; other encodings: 0
 *     24 u32 chunk_elems  elements per chunk (the last one may be shorter); ≥ 1 when n_elems > 0;
 *                         chunk_elems × element size ≤ CM_COMPRESS_MAX_CHUNK_BYTES; fp8-zstd: a
 *                         multiple of row_len (chunks hold whole rows)
 *     28 u32 n_chunks     = ceil(n_elems / chunk_elems) (0 when n_elems = 0)
 *   CHUNK TABLE: n_chunks × u32: bits 0..30 the chunk's size in CHUNKS, bit 31 "stored": the
 *     chunk holds its zstd input (below) as it is, because zstd would not have shrunk it
 *   SCALES (fp8-zstd, non-empty tensors): n_rows × F32, scale of row r = absmax(row r) / 448
 *   CHUNKS back to back, nothing after the last. A chunk's input is:
 *     zstd            the chunk's element bytes
 *     zstd-byteplane  the chunk's element bytes split into planes: plane k holds byte k of every
 *                     element of the chunk (after the transform), planes in order 0 .. size-1
 *     fp8-zstd        one E4M3 byte per element: e4m3(x / scale) (round to nearest even,
 *                     saturating at ±448); decoded as e4m3 value × scale, rounded to the dtype
 *   and a zstd chunk is one zstd frame with its content size and content checksum.
 * Integrity: the decoder checks every field and size, and zstd checks each frame's content;
 * SCALES and stored chunks carry no checksum of their own: the enclosing checksum (the ANSWER
 * descriptor's, a shard record's) covers the whole stream and is verified before decoding.
 *
 * FP8 error: per element |x' − x| ≤ 2^-4·|x| + 2^-10·scale (E4M3 keeps 3 mantissa bits; below
 * 2^-6·scale the step is 2^-9·scale), plus the output dtype's rounding (2^-8·|x'| for BF16).
 * Rows whose absmax is below 448·FLT_MIN (≈ 5.3e-36) become zeros. A row holding Inf or NaN,
 * or a magnitude above 2^64, cannot be encoded (CM_ERR_INVALID_ARG): the server refuses such
 * captures anyway; a decoder refuses scales that are negative, not finite or above 2^56. */
#ifndef CM_COMPRESS_H
#define CM_COMPRESS_H

#include <stddef.h>
#include <stdint.h>

#include "cm_dtype.h"
#include "cm_proto.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CM_COMPRESS_MAGIC           0x315A4354u /* "TCZ1" */
#define CM_COMPRESS_HEAD_SIZE       32
#define CM_COMPRESS_MAX_CHUNK_BYTES (16u << 20)
#define CM_COMPRESS_MAX_THREADS     256

typedef struct cm_compress_config {
    int    n_threads;   /* workers, the calling thread included (1 .. CM_COMPRESS_MAX_THREADS) */
    int    level;       /* zstd level (ZSTD_minCLevel() .. ZSTD_maxCLevel(); 0 = zstd's default, 3) */
    size_t chunk_bytes; /* input bytes per chunk when encoding (4 KiB .. CM_COMPRESS_MAX_CHUNK_BYTES) */
    int    rotate;      /* zstd-byteplane: rotate elements left by one bit before the split (1) or not (0) */
    int    tune;        /* zstd-byteplane and fp8-zstd: 1 = entropy-first match parameters on top of the level
                           (hashLog 6, minMatch 7: few, long matches; the planes are mostly literals for
                           Huffman), measured faster and smaller on hidden states; 0 = the level's own */
} cm_compress_config;
#define CM_COMPRESS_CONFIG_DEFAULT                                                                           \
    { 1, 1, 256u << 10, 1, 1 }

typedef struct cm_compress cm_compress;

/* Starts n_threads − 1 workers and makes their zstd contexts. CM_ERR_INVALID_ARG for a bad
 * config, CM_ERR_NOMEM/CM_ERR_ZSTD otherwise. Caller destroys with cm_compress_destroy. */
cm_status cm_compress_create(cm_compress **out, const cm_compress_config *cfg);
void      cm_compress_destroy(cm_compress **c); /* NULL-safe; joins the workers; sets *c = NULL */

/* The largest encoded size of n_rows × row_len elements of dt (for sizing dst), or 0 if the
 * combination cannot be encoded (bad dtype for the encoding, sizes overflow). */
size_t cm_compress_bound(const cm_compress *c, cm_encoding enc, cm_dtype dt, int64_t n_rows, int64_t row_len);

/* Encodes n_rows × row_len elements of dt at src (contiguous, any alignment; row_len matters
 * only to fp8-zstd) into dst, which must hold cm_compress_bound bytes (raw: the raw size);
 * *len receives the encoded size. Borrows src and dst. CM_ERR_INVALID_ARG for bad arguments
 * or a non-finite value in fp8-zstd mode; CM_ERR_ZSTD if zstd fails. */
cm_status cm_compress_encode(cm_compress *c, cm_encoding enc, cm_dtype dt, const void *src, int64_t n_rows,
                             int64_t row_len, void *dst, size_t cap, size_t *len);

/* Decodes src_len bytes at src, which must be a stream of encoding enc, dtype dt and n_rows ×
 * row_len elements (as its descriptor says), into dst (exactly n_rows × row_len × size of dt
 * bytes, else CM_ERR_INVALID_ARG). Every field of the stream is checked against the expected
 * values and the bytes present before use; a stream that is malformed or does not decode
 * (including a zstd content checksum mismatch) gives CM_ERR_PROTOCOL naming the field or chunk. */
cm_status cm_compress_decode(cm_compress *c, cm_encoding enc, cm_dtype dt, const void *src, size_t src_len,
                             int64_t n_rows, int64_t row_len, void *dst, size_t dst_len);

/* Decodes a tensor of a decoded ANSWER (cm_proto_answer_decode has checked its descriptor and
 * checksum) into dst of t->raw_size bytes. */
cm_status cm_compress_decode_tensor(cm_compress *c, const cm_proto_tensor *t, void *dst, size_t dst_len);

#ifdef __cplusplus
}
#endif
#endif /* CM_COMPRESS_H */
