/* common/format/cm_proto.h — the wire format between drafter-trainer and target-server, and the
 * encoders/decoders of its messages. What both processes must agree on (magic, version, types,
 * encodings, field layout) lives here; cm_compress produces the encoded tensor bytes.
 * Encoders write into caller buffers; decoders read caller buffers and write into caller
 * structs and arrays: nothing is allocated. Decoders trust no length, count or offset: each
 * is checked against the bytes that remain and against a cm_proto_limits before use, and a bad
 * frame gives CM_ERR_PROTOCOL with a message naming the message and the field. All functions
 * are reentrant (no shared state). The host must be little-endian (checked at compile time).
 *
 * FRAME = HEADER (56 bytes) | BODY (body_len bytes) | DATA (data_len bytes; ANSWER only)
 * All integers are little-endian, no padding; offsets in bytes.
 *
 * HEADER
 *   off size field            meaning
 *   0   4    magic            0x4D444E54 (the bytes "TNDM")
 *   4   2    version          CM_PROTO_VERSION; any other version is refused
 *   6   2    type             cm_proto_type (HELLO .. DECODE)
 *   8   4    flags            CM_PROTO_FLAG_* bits; unknown bits are refused
 *   12  4    n_tensors        ANSWER: tensor descriptors in the body; 0 for every other type
 *   16  8    id               REQUEST/ANSWER/ERROR: the batch id; DECODE (and its ANSWER or
 *                             ERROR): the step's id; HEARTBEAT: a sequence number;
 *                             HELLO/WELCOME/BYE: 0 (not checked)
 *   24  4    body_len         bytes of BODY (≤ limits.max_body_bytes)
 *   28  4    reserved         0
 *   32  8    data_len         ANSWER: bytes of DATA (≤ limits.max_data_bytes); 0 for other types
 *   40  8    body_checksum    XXH64 (seed 0) of BODY
 *   48  8    header_checksum  XXH64 (seed 0) of header bytes 0..47
 * Every byte of a frame is covered by one checksum: the header by header_checksum, BODY by
 * body_checksum, DATA by the per-tensor checksums (DATA is the tensors' encoded bytes in
 * descriptor order, back to back, with no gap and nothing after the last).
 *
 * BODY by type ("str" = u16 length n, then n bytes of [A-Za-z0-9_.-], 1 ≤ n ≤ CM_PROTO_NAME_MAX;
 * "msg" = u16 length n ≤ CM_PROTO_MESSAGE_MAX, then n bytes, none a control character)
 *   HELLO (trainer → server), 26 + n bytes
 *     0  u64 target_id    config hash the trainer expects (cm_target_cfg_hash); 0 = any
 *     8  u64 weights_id   weights fingerprint the trainer expects (cm_weights_id); 0 = any
 *     16 u32 credits      requests in flight the trainer asks for (≥ 1)
 *     20 u32 encodings    bit (1 << cm_encoding) for each encoding the trainer accepts
 *     24 str name         the trainer's name, for logs
 *   WELCOME (server → trainer), 42 + n bytes
 *     0  u64 target_id    the target's architecture (hash of its config)
 *     8  u64 weights_id   the target's weights (fingerprint; ≠ 0): the identity that counts
 *     16 u16 version      protocol version, = the header's
 *     18 u8  hidden_dtype cm_dtype of decoded hidden states (F32 or BF16)
 *     19 u8  reserved     0
 *     20 u32 hidden_size  D (≥ 1)
 *     24 u32 n_layers     layers 0 .. n_layers-1 can be tapped (≥ 1)
 *     28 u32 max_tokens   largest T the server accepts in one request (≥ 1)
 *     32 u32 credits      requests the trainer may have in flight (≥ 1)
 *     36 u32 encodings    encodings the server will use (a subset of the HELLO's, ≠ 0)
 *     40 str name         the target's name, for logs
 *   REQUEST (trainer → server; id = batch id), exactly 16 + 4·(T + N + 1 + L) bytes
 *     0  u32 encoding     cm_encoding wanted for the answer's tensors
 *     4  u32 n_tokens     T, 1 ≤ T ≤ limits.max_tokens
 *     8  u32 n_seqs       N, 1 ≤ N ≤ min(T, limits.max_seqs)
 *     12 u32 n_layers     L, 1 ≤ L ≤ limits.max_layers
 *     16 i32 tokens[T]    packed token ids, each ≥ 0
 *     .. i32 cu_seqlens[N+1]  0 = c0 < c1 < ... < cN = T (no empty sequence)
 *     .. i32 layer_ids[L] distinct, 0 ≤ id < limits.max_layer_id; answer order = this order
 *   ANSWER (server → trainer; id = batch id), n_tensors descriptors back to back, each
 *     str name            unique within the answer, e.g. "layer_31"
 *     u8  dtype           cm_dtype of the decoded tensor
 *     u8  encoding        cm_encoding of its bytes in DATA
 *     u8  n_dims          1 ≤ n_dims ≤ CM_PROTO_MAX_DIMS
 *     u8  reserved        0
 *     i64 shape[n_dims]   outermost first, each ≥ 0; rows = product of all but the last
 *     u64 raw_size        decoded bytes = product(shape) × dtype size (≤ limits.max_tensor_bytes)
 *     u64 encoded_size    bytes in DATA (RAW: = raw_size)
 *     u64 checksum        XXH64 (seed 0) of those encoded bytes
 *   ERROR (either way; id = the batch id it refers to, 0 = the session), 6 + n bytes
 *     0  u32 code         cm_proto_error_code
 *     4  msg message      what went wrong and what to do
 *   HEARTBEAT, BYE: empty body.
 *   NCCL_OFFER (trainer → server, after WELCOME, only when WELCOME offers encoding nccl),
 *   exactly 8 + n bytes
 *     0  u32 device       the trainer's CUDA device ordinal (for logs)
 *     4  u32 uid_len      n, 1 ≤ n ≤ CM_PROTO_NCCL_UID_MAX
 *     8  u8  uid[n]       an ncclUniqueId made by the trainer, which is rank 0 of a two-rank
 *                         communicator; the server joins it as rank 1
 *   NCCL_READY (server → trainer: the communicator is up), exactly 4 bytes
 *     0  u32 device       the server's CUDA device ordinal (for logs)
 *   A server that cannot join answers the OFFER with ERROR bad-request (id 0).
 *   STATUS (anyone → server, outside any session: empty body; server → asker: the reply),
 *   reply exactly 4 + n bytes
 *     0  u32 n            1 ≤ n ≤ CM_PROTO_STATUS_MAX
 *     4  u8  json[n]      a JSON object: the target, its sessions and their throughput (ts_serve.c
 *                         and cm_chan_server.c document the fields); printable UTF-8, no control bytes
 *
 *   DECODE (client → the server's decoding endpoint; id = the step's id, chosen by the client),
 *   exactly 20 + 40·N + 4·(T + L) bytes
 *     0  u32 op           cm_decode_op: STEP (1) or CLOSE (2)
 *     4  u32 encoding     cm_encoding of every tensor of the answer: raw, zstd or zstd-byteplane
 *                         (lossless only; also on CLOSE, whose answer is the "decode" tensor alone)
 *     8  u32 n_seqs       N, 1 ≤ N ≤ limits.max_seqs
 *     12 u32 n_tokens     T = Σ (n_ctx + n_draft) ≤ limits.max_tokens (so T ≥ N on STEP; 0 on CLOSE)
 *     16 u32 n_layers     L ≤ limits.max_layers (0 on CLOSE; may be 0 on STEP: no hidden states)
 *     20 N records of 40 bytes, one per sequence:
 *        0  u32 handle       0: a new sequence (base 0; not on CLOSE); else a handle the server
 *                            returned (a handle twice in one DECODE is the server's to refuse)
 *        4  u32 base         tokens the client believes the sequence has committed (the server
 *                            checks it; not looked at on CLOSE)
 *        8  u32 n_ctx        tokens committed unconditionally: a new sequence's prompt, then the
 *                            token the previous step returned; ≥ 1 on STEP, 0 on CLOSE
 *        12 u32 n_draft      draft tokens to verify after them (0: the target alone; 0 on CLOSE)
 *        16 u32 top_k        0: no top-k cut
 *        20 f32 temperature  0: greedy (argmax); > 0: sampled; finite
 *        24 f32 top_p        in (0, 1] (1: no nucleus cut)
 *        28 u32 flags        CM_DECODE_FLAG_* bits; unknown bits are refused
 *        32 u64 seed         the sequence's sampling stream (read for new sequences)
 *        temperature, top_p and flags are checked on every record, CLOSE's included (whose
 *        sampling fields are otherwise unused: write top_p 1 there)
 *     .. i32 tokens[T]    per sequence in record order: its n_ctx tokens, then its n_draft tokens;
 *                         each ≥ 0 (the server checks them against its vocabulary)
 *     .. i32 layer_ids[L] distinct, 0 ≤ id < limits.max_layer_id: the hidden states returned
 *   The server answers a DECODE with an ANSWER (id = the step's id) whose first tensor is
 *   "decode", I32 [N, 4], per sequence (handle, committed tokens after the step, accepted drafts
 *   a, next token), followed on STEP by "layer_<id>" [Σ (n_ctx + a), D] in the hidden dtype for
 *   each layer id in request order: the committed tokens' hidden states, sequences in record
 *   order. Verification: the target's token at position base + n_ctx − 1 + i (sampled with the
 *   sequence's settings, or its argmax) is drawn for i = 0, 1, ...; draft i is accepted while it
 *   equals that token, and the first token not matched (or the one after the last draft) is the
 *   next token. On CLOSE each record is (handle, 0, 0, −1). A failed step is an ERROR (id = the
 *   step's id) and changes nothing (bad-request: a handle not this client's, a wrong base, a
 *   length past the server's limit, too many sequences; the message says which).
 *
 * The nccl encoding: an ANSWER whose tensors have encoding nccl carries no DATA for them
 * (encoded_size 0, checksum of zero bytes); right after sending it the server sends each
 * tensor's raw_size bytes (dtype elements, [T, D] row-major, in descriptor order) with ncclSend
 * over the session's communicator, and the trainer posts the matching ncclRecv for every such
 * ANSWER it reads, in the order it reads them (duplicates included, into scratch memory), so the
 * two streams of transfers stay paired. NCCL carries its own integrity checks; a trainer that
 * loses the pairing (a refused ANSWER head) drops the session, which aborts the communicator.
 */
#ifndef CM_PROTO_H
#define CM_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "cm_dtype.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CM_PROTO_MAGIC       0x4D444E54u /* "TNDM" */
#define CM_PROTO_VERSION     3 /* 2: HELLO and WELCOME carry weights_id; 3: DECODE */
/* The oldest version whose ANSWER frames are laid out as this one's: frames of versions
 * [CM_PROTO_ANSWER_MIN_VERSION, CM_PROTO_VERSION] pass cm_proto_peek when they are ANSWERs (shard
 * stores of earlier builds hold them); every other type must be of CM_PROTO_VERSION. */
#define CM_PROTO_ANSWER_MIN_VERSION 2
#define CM_PROTO_HEADER_SIZE 56
#define CM_PROTO_NAME_MAX    64  /* bytes of a name (tensor, trainer, target) */
#define CM_PROTO_MESSAGE_MAX 512 /* bytes of an ERROR message */
#define CM_PROTO_MAX_DIMS    4
#define CM_PROTO_NCCL_UID_MAX 128   /* bytes of an ncclUniqueId */
#define CM_PROTO_STATUS_MAX   65536 /* bytes of a STATUS reply's JSON */
/* Upper bound of a HELLO, WELCOME, ERROR, HEARTBEAT or BYE frame. */
#define CM_PROTO_SMALL_FRAME_MAX (CM_PROTO_HEADER_SIZE + 40 + CM_PROTO_MESSAGE_MAX)

typedef enum cm_proto_type {
    CM_PROTO_TYPE_HELLO = 1,
    CM_PROTO_TYPE_WELCOME,
    CM_PROTO_TYPE_REQUEST,
    CM_PROTO_TYPE_ANSWER,
    CM_PROTO_TYPE_ERROR,
    CM_PROTO_TYPE_HEARTBEAT,
    CM_PROTO_TYPE_BYE,
    CM_PROTO_TYPE_NCCL_OFFER,
    CM_PROTO_TYPE_NCCL_READY,
    CM_PROTO_TYPE_STATUS,
    CM_PROTO_TYPE_DECODE,
    CM_PROTO_TYPE_END /* one past the last */
} cm_proto_type;

/* Header flags. RESEND marks a REQUEST repeated after a lost, late or corrupted answer; the
 * server treats it like any request (requests are idempotent) and counts it. */
#define CM_PROTO_FLAG_RESEND 0x1u
#define CM_PROTO_FLAGS_KNOWN 0x1u

/* How a tensor's bytes are encoded (cm_compress.h documents each stream). */
typedef enum cm_encoding {
    CM_ENCODING_RAW = 0,        /* the elements as they are, little-endian */
    CM_ENCODING_ZSTD,           /* zstd over the element bytes, in chunks (lossless) */
    CM_ENCODING_ZSTD_BYTEPLANE, /* byte planes (high bytes apart from low) then zstd (lossless) */
    CM_ENCODING_FP8_ZSTD,       /* FP8 E4M3 with one F32 scale per row, then zstd (lossy, opt-in) */
    CM_ENCODING_NCCL,           /* raw elements sent GPU to GPU over the session's NCCL communicator */
    CM_ENCODING_END
} cm_encoding;
#define CM_ENCODING_LOSSLESS_MASK                                                                            \
    ((1u << CM_ENCODING_RAW) | (1u << CM_ENCODING_ZSTD) | (1u << CM_ENCODING_ZSTD_BYTEPLANE))

typedef enum cm_proto_error_code {
    CM_PROTO_ERROR_BAD_REQUEST = 1, /* the request is well formed but cannot be served (layer, token id) */
    CM_PROTO_ERROR_CORRUPT,         /* a frame arrived corrupted or malformed; send it again */
    CM_PROTO_ERROR_VERSION,         /* protocol version not spoken */
    CM_PROTO_ERROR_TARGET_MISMATCH, /* the HELLO asked for another target */
    CM_PROTO_ERROR_NO_CREDIT,       /* more requests in flight than granted */
    CM_PROTO_ERROR_BUSY,            /* try again later */
    CM_PROTO_ERROR_INTERNAL,        /* the server failed; see the message */
    CM_PROTO_ERROR_SHUTDOWN,        /* the server is stopping */
    CM_PROTO_ERROR_END
} cm_proto_error_code;

const char *cm_proto_type_name(int type);  /* "HELLO", ...; "unknown" */
const char *cm_encoding_name(int enc);     /* "raw", "zstd", "zstd-byteplane", "fp8-zstd", "nccl"; "unknown" */
const char *cm_proto_error_name(int code); /* "bad-request", ...; "unknown" */
/* Parses an encoding name (as cm_encoding_name spells it); CM_ERR_INVALID_ARG naming the choices. */
cm_status cm_encoding_parse(const char *name, cm_encoding *out);
/* Checks a name (trainer, target) by the wire's rules: 1 to CM_PROTO_NAME_MAX bytes of
 * A-Z a-z 0-9 _ . -; CM_ERR_INVALID_ARG with a message that starts with `what` (e.g. a flag). */
cm_status cm_proto_name_check(const char *what, const char *name);

/* Bounds applied by the decoders before anything is used or allocated; both sides configure
 * them (the server from its model and memory budget, the trainer from its batch size). */
typedef struct cm_proto_limits {
    uint32_t max_tokens;       /* T of one REQUEST */
    uint32_t max_seqs;         /* N of one REQUEST */
    uint32_t max_layers;       /* L of one REQUEST */
    uint32_t max_layer_id;     /* layer ids are < this */
    uint32_t max_tensors;      /* descriptors in one ANSWER */
    uint32_t max_body_bytes;   /* BODY of any frame */
    uint64_t max_tensor_bytes; /* decoded bytes of one tensor */
    uint64_t max_data_bytes;   /* DATA of one ANSWER */
} cm_proto_limits;
#define CM_PROTO_LIMITS_DEFAULT                                                                              \
    { 131072, 131072, 64, 1024, 64, 8u << 20, 4ull << 30, 16ull << 30 }

typedef struct cm_proto_header {
    uint16_t version;
    uint16_t type; /* cm_proto_type */
    uint32_t flags;
    uint32_t n_tensors;
    uint64_t id;
    uint32_t body_len;
    uint64_t data_len;
    uint64_t body_checksum;
} cm_proto_header;

typedef struct cm_proto_hello {
    uint64_t target_id;
    uint64_t weights_id;
    uint32_t credits;
    uint32_t encodings;
    char     name[CM_PROTO_NAME_MAX + 1]; /* NUL-terminated */
} cm_proto_hello;

typedef struct cm_proto_welcome {
    uint64_t target_id;
    uint64_t weights_id;
    uint16_t version;
    cm_dtype hidden_dtype;
    uint32_t hidden_size;
    uint32_t n_layers;
    uint32_t max_tokens;
    uint32_t credits;
    uint32_t encodings;
    char     name[CM_PROTO_NAME_MAX + 1];
} cm_proto_welcome;

/* A REQUEST. Encode reads n_* and the arrays. Decode writes n_* and copies into the arrays,
 * which the caller provides with room for cap_* elements (cap_cu_seqlens ≥ N + 1); a count
 * within the limits but beyond a capacity is the caller's error (CM_ERR_INVALID_ARG), so
 * size the arrays from the same limits. */
typedef struct cm_proto_request {
    uint64_t    batch_id;
    uint32_t    flags; /* CM_PROTO_FLAG_RESEND or 0 */
    cm_encoding encoding;
    uint32_t    n_tokens;   /* T */
    uint32_t    n_seqs;     /* N */
    uint32_t    n_layers;   /* L */
    int32_t    *tokens;     /* [T] */
    int32_t    *cu_seqlens; /* [N + 1] */
    int32_t    *layer_ids;  /* [L] */
    uint32_t    cap_tokens, cap_cu_seqlens, cap_layers;
} cm_proto_request;

typedef struct cm_proto_tensor {
    char        name[CM_PROTO_NAME_MAX + 1];
    cm_dtype    dtype; /* of the decoded tensor */
    cm_encoding encoding;
    int         n_dims;
    int64_t     shape[CM_PROTO_MAX_DIMS];
    uint64_t    raw_size;     /* decoded bytes */
    uint64_t    encoded_size; /* bytes at data */
    uint64_t    checksum;     /* XXH64 of the encoded bytes */
    const void *data;         /* encode: the caller's encoded bytes (borrowed);
                                 decode: points into the DATA the caller passed, with no
                                 alignment (tensors follow each other at their encoded sizes):
                                 read it with memcpy or cm_compress_decode_tensor, never through
                                 a cast to a wider type */
} cm_proto_tensor;

/* An ANSWER; tensors is caller storage with room for cap_tensors entries (decode). */
typedef struct cm_proto_answer {
    uint64_t         batch_id;
    uint32_t         n_tensors;
    cm_proto_tensor *tensors;
    uint32_t         cap_tensors;
} cm_proto_answer;

/* NCCL_OFFER (uid_len ≥ 1) and NCCL_READY (device only; uid_len 0). */
typedef struct cm_proto_nccl {
    uint32_t device;
    uint32_t uid_len;
    uint8_t  uid[CM_PROTO_NCCL_UID_MAX];
} cm_proto_nccl;

typedef enum cm_decode_op { CM_DECODE_STEP = 1, CM_DECODE_CLOSE = 2 } cm_decode_op;
/* Sample with the target's generation_config.json (temperature, top_p, top_k of the record are
 * not used). */
#define CM_DECODE_FLAG_TARGET_SAMPLING 0x1u
#define CM_DECODE_FLAGS_KNOWN          0x1u
#define CM_DECODE_RECORD_SIZE          40

typedef struct cm_proto_decode_seq {
    uint32_t handle, base, n_ctx, n_draft, top_k;
    float    temperature, top_p;
    uint32_t flags;
    uint64_t seed;
} cm_proto_decode_seq;

/* A DECODE. Encode reads n_* and the arrays (and refuses what decode would refuse, with
 * CM_ERR_INVALID_ARG); decode copies into the caller's arrays (room for cap_* elements; a count
 * within the limits but beyond a capacity is CM_ERR_INVALID_ARG). */
typedef struct cm_proto_decode {
    uint64_t             id;
    cm_decode_op         op;
    cm_encoding          encoding;
    uint32_t             n_seqs, n_tokens, n_layers;
    cm_proto_decode_seq *seqs;      /* [N] */
    int32_t             *tokens;    /* [T] */
    int32_t             *layer_ids; /* [L] */
    uint32_t             cap_seqs, cap_tokens, cap_layers;
} cm_proto_decode;

typedef struct cm_proto_error {
    uint64_t            batch_id;
    cm_proto_error_code code;
    char                message[CM_PROTO_MESSAGE_MAX + 1];
} cm_proto_error;

// ---- encoders
// Each writes one frame into buf (cap bytes) and sets *len to its size. A buffer that is too
// small gives CM_ERR_INVALID_ARG with *len set to the size needed; an invalid message (a name
// with a bad character, inconsistent counts, ...) gives CM_ERR_INVALID_ARG naming the field, so
// a malformed frame is never sent.

cm_status cm_proto_hello_encode(const cm_proto_hello *m, void *buf, size_t cap, size_t *len);
cm_status cm_proto_welcome_encode(const cm_proto_welcome *m, void *buf, size_t cap, size_t *len);
size_t    cm_proto_request_size(uint32_t n_tokens, uint32_t n_seqs, uint32_t n_layers);
cm_status cm_proto_request_encode(const cm_proto_request *m, void *buf, size_t cap, size_t *len);
cm_status cm_proto_error_encode(const cm_proto_error *m, void *buf, size_t cap, size_t *len);
cm_status cm_proto_heartbeat_encode(uint64_t seq, void *buf, size_t cap, size_t *len);
cm_status cm_proto_bye_encode(void *buf, size_t cap, size_t *len);
cm_status cm_proto_nccl_offer_encode(const cm_proto_nccl *m, void *buf, size_t cap, size_t *len);
cm_status cm_proto_nccl_ready_encode(uint32_t device, void *buf, size_t cap, size_t *len);
size_t    cm_proto_decode_size(uint32_t n_seqs, uint32_t n_tokens, uint32_t n_layers);
cm_status cm_proto_decode_encode(const cm_proto_decode *m, void *buf, size_t cap, size_t *len);
/* json NULL: the STATUS request (empty body); else the reply carrying n bytes of JSON. */
cm_status cm_proto_status_encode(const char *json, size_t n, void *buf, size_t cap, size_t *len);

/* An ANSWER is sent as HEAD (header + descriptors) followed by the tensors' encoded bytes,
 * which may travel in separate transport parts (zero copy). answer_head_size gives HEAD's size;
 * answer_encode_head computes each tensor's checksum from its data (writing it into
 * tensors[i].checksum) and writes HEAD; answer_encode writes the whole frame (HEAD + copies of
 * the data) into one buffer. Checks: names valid and unique, n_dims, raw_size = shape × dtype
 * size, RAW tensors have encoded_size = raw_size. */
size_t    cm_proto_answer_head_size(const cm_proto_answer *m);
cm_status cm_proto_answer_encode_head(cm_proto_answer *m, void *buf, size_t cap, size_t *len);
cm_status cm_proto_answer_encode(cm_proto_answer *m, void *buf, size_t cap, size_t *len);

// ---- decoders
// frame/len is exactly one frame. Errors: CM_ERR_PROTOCOL for anything wrong with the bytes
// (message names the field), CM_ERR_INVALID_ARG for a caller capacity that is too small.

/* Validates the header alone (magic, version, checksum, type, flags, lengths against the
 * limits); len may be longer than the header (the rest is not looked at). Use it to learn the
 * type and the frame's total size (CM_PROTO_HEADER_SIZE + body_len + data_len). */
cm_status cm_proto_peek(const void *frame, size_t len, const cm_proto_limits *lim, cm_proto_header *out);

cm_status cm_proto_hello_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                cm_proto_hello *out);
cm_status cm_proto_welcome_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                  cm_proto_welcome *out);
cm_status cm_proto_request_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                  cm_proto_request *out);
cm_status cm_proto_error_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                cm_proto_error *out);
cm_status cm_proto_heartbeat_decode(const void *frame, size_t len, const cm_proto_limits *lim, uint64_t *seq);
cm_status cm_proto_bye_decode(const void *frame, size_t len, const cm_proto_limits *lim);
cm_status cm_proto_nccl_offer_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                     cm_proto_nccl *out);
cm_status cm_proto_nccl_ready_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                     uint32_t *device);
/* Checks everything the body says by itself: op, encoding (lossless), counts against the limits
 * and the body's exact size, T = Σ (n_ctx + n_draft), n_ctx ≥ 1 on STEP, on CLOSE no tokens or
 * layers and records with a handle ≠ 0 and n_ctx = n_draft = 0, a new sequence's base 0,
 * temperature finite and ≥ 0, top_p in (0, 1], known flags, tokens ≥ 0, layer ids distinct and
 * < max_layer_id. What depends on the server's state (handles, bases, lengths) is its to check.
 * seqs must be non-NULL; tokens and layer_ids may be NULL when the step has none. */
cm_status cm_proto_decode_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                 cm_proto_decode *out);
/* A STATUS frame: *n = 0 for a request; a reply's JSON is copied NUL-terminated into out (cap ≥ n + 1). */
cm_status cm_proto_status_decode(const void *frame, size_t len, const cm_proto_limits *lim, char *out,
                                 size_t cap, size_t *n);

/* Decodes an ANSWER whose HEAD and DATA are in separate buffers (head_len = header + body,
 * data_len = the header's data_len) and verifies every tensor's checksum. tensors[i].data
 * point into data: valid while the caller keeps it. */
cm_status cm_proto_answer_decode_parts(const void *head, size_t head_len, const void *data, size_t data_len,
                                       const cm_proto_limits *lim, cm_proto_answer *out);
/* The same for a whole frame in one buffer. */
cm_status cm_proto_answer_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                 cm_proto_answer *out);

/* Checks a tensor descriptor (name, dtype, encoding and dtype together, dims, shape product
 * without overflow, raw_size, size bounds) and returns the number of rows (product of all dims
 * but the last) and the row length (the last dim); either out may be NULL. A bad descriptor
 * returns on_bad (CM_ERR_PROTOCOL for a peer's, CM_ERR_FORMAT for a file's, CM_ERR_INVALID_ARG
 * for our own) with a message naming the tensor and the field. Used by the codecs; exported
 * for shard readers. */
cm_status cm_proto_tensor_check(const cm_proto_tensor *t, const cm_proto_limits *lim, cm_status on_bad,
                                int64_t *n_rows, int64_t *row_len);

// ----------------------------------------------------------------------------
// what a frame claims before, or without, a decode (cm_proto_claims.c)

/* The counts a REQUEST's body claims, n_tokens (body offset 4) and n_layers (12), read without
 * checking the body, so that a server refuses a batch larger than it takes as bad-request
 * rather than as the corrupt frame its decode against the server's limits would report. The
 * header must have passed cm_proto_peek. CM_ERR_PROTOCOL when the frame or its body_len is
 * shorter than the body's fixed fields (the decode then fails on them). */
cm_status cm_proto_request_counts(const void *frame, size_t len, uint32_t *n_tokens, uint32_t *n_layers);
/* The same for a DECODE: n_seqs (body offset 8), n_tokens (12) and n_layers (16), so that a
 * decoding endpoint refuses a step larger than it takes as bad-request. */
cm_status cm_proto_decode_counts(const void *frame, size_t len, uint32_t *n_seqs, uint32_t *n_tokens,
                                 uint32_t *n_layers);

/* What the bytes of a frame that failed cm_proto_peek claim, for its refusal: *id is the id
 * field (0 when the frame is shorter than 24 bytes); returns 1 when the frame starts with the
 * magic and a version other than CM_PROTO_VERSION, stored in *version. */
int cm_proto_frame_claims(const void *frame, size_t len, uint64_t *id, uint16_t *version);

#ifdef __cplusplus
}
#endif
#endif /* CM_PROTO_H */
