/* kernels/kn_rope_int.h — private to the rope kernels (kn_rope.cu, kn_qk_prep.cu, kn_head_norm.cu): the
 * table of inverse frequencies, inv[i] = 1 / theta^((2i)/rot_dim), computed on the host in float32 by
 * the expression of ref/kn_rope_ref.c and passed by value as a 2 KiB kernel argument. */
#ifndef KN_ROPE_INT_H
#define KN_ROPE_INT_H

#include <math.h>

#define KN_ROPE_MAX_HALF 512 /* rot_dim <= 1024 */

typedef struct kn_rope_freqs {
    float inv[KN_ROPE_MAX_HALF];
} kn_rope_freqs;

/* The first rot_dim / 2 (≤ KN_ROPE_MAX_HALF) entries of f. */
static inline void kn_rope_freqs_fill(kn_rope_freqs *f, int rot_dim, float theta) {
    for (int i = 0; i < rot_dim / 2; i++) {
        float expo = (float)(2 * i) / (float)rot_dim;
        f->inv[i] = 1.0f / powf(theta, expo);
    }
}

#endif /* KN_ROPE_INT_H */
