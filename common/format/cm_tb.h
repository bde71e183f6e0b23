/* common/format/cm_tb.h — TensorBoard event files written from C: scalars that TensorBoard itself
 * reads (tensorboard --logdir RUN_DIR/tb), with no TensorFlow or protobuf library. One writer
 * per run owns one file RUN_DIR/tb/events.out.tfevents.<unix time>.<hostname> (".<n>" is
 * appended when a file of that name exists, e.g. a resume in the same second). Not
 * thread-safe: one owner thread. Records go through a stdio buffer and are flushed every
 * flush_every records and on flush/destroy, so a killed run loses at most that many.
 *
 * File format (TFRecord framing, as tensorflow/core/lib/io/record_writer.cc writes it):
 *   u64 LE   length of data
 *   u32 LE   masked CRC32C of the 8 length bytes
 *   data     one serialized tensorboard.Event (protobuf wire format)
 *   u32 LE   masked CRC32C of data
 * masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8, CRC32C = Castagnoli, reflected.
 * Event fields written (tensorboard/compat/proto/event.proto, summary.proto):
 *   1 wall_time double (seconds since the epoch)   2 step int64
 *   3 file_version string: "brain.Event:2", the first record of every file
 *   5 summary { 1 value { 1 tag string, 2 simple_value float } ... }
 *   7 session_log { 1 status = 1 (START) }: written at a resumed run's first step, so
 *     TensorBoard drops the points of the earlier file from that step on (it purges
 *     step >= the START event's step) instead of drawing both histories. */
#ifndef CM_TB_H
#define CM_TB_H

#include <stddef.h>
#include <stdint.h>

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CM_TB_FILE_VERSION "brain.Event:2"
#define CM_TB_MAX_TAG      255 /* bytes of one tag; longer tags are refused */
#define CM_TB_MAX_VALUES   64  /* scalars per event (per cm_tb_scalars call) */

// ---- CRC32C (exposed for the reader and its test)

/* CRC32C (Castagnoli) of len bytes; crc32c("123456789") = 0xe3069283. */
uint32_t cm_crc32c(const void *data, size_t len);
/* TFRecord's masked form of a CRC. */
uint32_t cm_crc32c_mask(uint32_t crc);

// ---- writer

typedef struct cm_tb cm_tb;

/* Creates RUN_DIR/tb (RUN_DIR must exist) and a new event file in it, and writes the
 * file_version record. resume_step > 0 also writes a SessionLog START event at step
 * resume_step + 1 (the first step the resumed run will log). flush_every ≥ 1. */
cm_status cm_tb_create(cm_tb **out, const char *run_dir, int flush_every, int64_t resume_step);
/* The file's path (valid until destroy). */
const char *cm_tb_path(const cm_tb *tb);
/* One event at (wall_time, step) holding n scalars tags[i] = values[i] (stored as float, as
 * TensorBoard's simple_value is; NaN and ±inf pass through). wall_time ≤ 0 means now.
 * Borrows tags and values. No allocation. */
cm_status cm_tb_scalars(cm_tb *tb, double wall_time, int64_t step, int n, const char *const *tags,
                        const double *values);
/* One scalar at step, now. */
cm_status cm_tb_scalar(cm_tb *tb, const char *tag, int64_t step, double value);
/* Writes buffered records to the file and syncs it. */
cm_status cm_tb_flush(cm_tb *tb);
/* Flushes (a failure is logged as a warning; call cm_tb_flush first to see it) and closes.
 * NULL-safe; sets *tb = NULL. */
void cm_tb_destroy(cm_tb **tb);

// ---- reader (tests and tools: checks every CRC, decodes what the writer writes)

typedef enum cm_tb_kind {
    CM_TB_KIND_OTHER = 0, /* an Event of a kind this reader does not decode */
    CM_TB_KIND_FILE_VERSION,
    CM_TB_KIND_SUMMARY,
    CM_TB_KIND_SESSION_START,
} cm_tb_kind;

typedef struct cm_tb_event {
    double     wall_time;
    int64_t    step;
    cm_tb_kind kind;
    char       file_version[64]; /* KIND_FILE_VERSION */
    int        n_values;         /* KIND_SUMMARY: simple_value entries */
    char       tags[CM_TB_MAX_VALUES][CM_TB_MAX_TAG + 1];
    float      values[CM_TB_MAX_VALUES];
} cm_tb_event;

typedef struct cm_tb_reader cm_tb_reader;

/* Reads the whole file into memory. Caller destroys with cm_tb_reader_destroy. */
cm_status cm_tb_reader_open(cm_tb_reader **out, const char *path);
/* The next record: *done = 1 (and ev untouched) at a clean end of file. A truncated record,
 * a CRC mismatch or malformed protobuf is CM_ERR_FORMAT naming the record's offset. */
cm_status cm_tb_reader_next(cm_tb_reader *r, cm_tb_event *ev, int *done);
void      cm_tb_reader_destroy(cm_tb_reader **r);

#ifdef __cplusplus
}
#endif
#endif /* CM_TB_H */
