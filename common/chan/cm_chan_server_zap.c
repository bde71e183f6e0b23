/* common/chan/cm_chan_server_zap.c — which CURVE clients may connect: the client key directory read
 * at create, and the ZAP handler the server's thread runs when libzmq asks about a connecting
 * client (accepted when its public key is one of the directory's). Used by cm_chan_server and
 * cm_dec_server, each with its own context and handler. */
#include "cm_chan_int.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "cm_log.h"

static cm_status load_keys(cm_chan_zap *z, const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return CM_FAIL(CM_ERR_IO, "cannot open the client key directory '%s': %s", dir, strerror(errno));
    snprintf(z->dir, sizeof z->dir, "%s", dir);
    z->keys = calloc(MAX_CLIENT_KEYS, 32);
    cm_status st = z->keys ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "cannot allocate the client key table");
    struct dirent *e;
    while (st == CM_OK && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 5 || strcmp(e->d_name + n - 4, ".pub") != 0)
            continue;
        if (z->n_keys == MAX_CLIENT_KEYS) {
            st = CM_FAIL(CM_ERR_INVALID_ARG, "'%s' holds more than %d client keys", dir, MAX_CLIENT_KEYS);
            break;
        }
        char path[2048], key[CM_CHAN_KEY_LEN + 1];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        st = cm_chan_curve_read_key(path, key);
        if (st == CM_OK)
            zmq_z85_decode(z->keys[z->n_keys++], key);
    }
    closedir(d);
    if (st == CM_OK && z->n_keys == 0)
        st = CM_FAIL(CM_ERR_INVALID_ARG,
                     "the client key directory '%s' holds no *.pub key; copy each trainer's "
                     "public key there",
                     dir);
    return st;
}

cm_status cm_chan_zap_open_(cm_chan_zap *z, void *ctx, const char *dir) {
    CM_TRY(load_keys(z, dir));
    if (!(z->sock = zmq_socket(ctx, ZMQ_REP)))
        return CM_ZMQ(-1);
    CM_TRY(cm_chan_set_int(z->sock, ZMQ_LINGER, 0));
    return CM_ZMQ(zmq_bind(z->sock, "inproc://zeromq.zap.01"));
}

void cm_chan_zap_close_(cm_chan_zap *z) {
    if (z->sock)
        zmq_close(z->sock);
    z->sock = NULL;
    free(z->keys);
    z->keys = NULL;
    z->n_keys = 0;
}

static void zap_reply(void *sock, zmq_msg_t *req_id, const char *code, const char *text) {
    zmq_send(sock, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(sock, zmq_msg_data(req_id), zmq_msg_size(req_id), ZMQ_SNDMORE);
    zmq_send(sock, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(sock, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(sock, "", 0, ZMQ_SNDMORE);
    zmq_send(sock, "", 0, 0);
}

void cm_chan_zap_handle_(cm_chan_zap *z, cm_chan_warn *warn) {
    zmq_msg_t part[8];
    int       n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z->sock, n ? 0 : ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < 8)
            part[n++] = m;
        else
            zmq_msg_close(&m);
    }
    if (n == 0)
        return;
    /* version, request id, domain, address, routing id, mechanism, credentials... */
    if (n < 6) {
        zmq_msg_t none;
        zmq_msg_init(&none);
        zap_reply(z->sock, n > 1 ? &part[1] : &none, "500", "malformed ZAP request");
        zmq_msg_close(&none);
    } else {
        int         allowed = 0;
        const char *mech = zmq_msg_data(&part[5]);
        if (n >= 7 && zmq_msg_size(&part[5]) == 5 && memcmp(mech, "CURVE", 5) == 0 &&
            zmq_msg_size(&part[6]) == 32)
            for (int k = 0; k < z->n_keys && !allowed; k++)
                allowed = memcmp(z->keys[k], zmq_msg_data(&part[6]), 32) == 0;
        char addr[64];
        snprintf(addr, sizeof addr, "%.*s", (int)(zmq_msg_size(&part[3]) < 63 ? zmq_msg_size(&part[3]) : 63),
                 (const char *)zmq_msg_data(&part[3]));
        if (allowed) {
            zap_reply(z->sock, &part[1], "200", "OK");
        } else {
            char key[CM_CHAN_KEY_LEN + 1] = "?";
            if (n >= 7 && zmq_msg_size(&part[6]) == 32)
                zmq_z85_encode(key, zmq_msg_data(&part[6]), 32);
            if (cm_chan_warn_ok_(warn))
                CM_LOG_WARN("refused a CURVE client from %s: its public key %s is not in '%s'", addr, key,
                            z->dir);
            zap_reply(z->sock, &part[1], "400", "client key not accepted");
        }
    }
    for (int k = 0; k < n; k++)
        zmq_msg_close(&part[k]);
}
