/* common/chan/cm_chan.c — the parts of cm_chan both ends share: ZeroMQ failure conversion, the
 * clock, CURVE key files (Z85 text; secret keys written 0600 and never logged or echoed), the
 * endpoint check behind "loopback unless CURVE" and the server's bind checks (an ipc:// path
 * held by a live server, tcp://localhost), and what the servers' sockets (cm_chan_server's and
 * cm_dec_server's) and clients' sockets share: CURVE on either side, the listening ROUTER, its
 * bind and socket file, a message read off it and an ERROR frame. The session logic lives in
 * cm_chan_server.c and cm_chan_client.c. */
#include "cm_chan_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_log.h"

// ----------------------------------------------------------------------------
// ZeroMQ helpers

cm_status cm_zmq_check_(int failed, const char *stmt, const char *file, int line) {
    if (!failed)
        return CM_OK;
    int e = zmq_errno();
    return cm_fail_at(CM_ERR_ZMQ, file, line, "%s: %s", stmt, zmq_strerror(e));
}

cm_status cm_chan_set_int(void *sock, int option, int value) {
    return CM_ZMQ(zmq_setsockopt(sock, option, &value, sizeof value));
}

cm_status cm_chan_set_i64(void *sock, int option, int64_t value) {
    return CM_ZMQ(zmq_setsockopt(sock, option, &value, sizeof value));
}

cm_status cm_chan_pipe_(int *read_end, int *write_end, const char *what) {
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot create %s: %s", what, strerror(errno));
    *read_end = fds[0];
    *write_end = fds[1];
    return CM_OK;
}

uint64_t cm_chan_random_u64(void) {
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, 0) == (ssize_t)sizeof v)
        return v;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)ts.tv_sec << 20 ^ (uint64_t)getpid();
}

void cm_chan_fmt(char *dst, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
}

void cm_chan_error_text(char *dst, const char *src) {
    size_t n = 0;
    for (; src && src[n] && n < CM_PROTO_MESSAGE_MAX; n++) {
        unsigned char ch = (unsigned char)src[n];
        dst[n] = ch < 0x20 || ch == 0x7f ? ' ' : (char)ch;
    }
    dst[n] = '\0';
}

// ----------------------------------------------------------------------------
// CURVE keys

int cm_chan_curve_available(void) {
    return zmq_has("curve") ? 1 : 0;
}

cm_status cm_chan_curve_require(const char *what) {
    if (cm_chan_curve_available())
        return CM_OK;
    return CM_FAIL(
        CM_ERR_UNSUPPORTED,
        "%s needs ZeroMQ CURVE, but the linked libzmq was built without it; install a "
        "libzmq with libsodium/tweetnacl CURVE support, or use a loopback or ipc:// endpoint without keys",
        what);
}

static int z85_char_ok(char ch) {
    static const char alphabet[] =
        "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
    return ch && strchr(alphabet, ch) != NULL;
}

cm_status cm_chan_curve_read_key(const char *path, char out[CM_CHAN_KEY_LEN + 1]) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return CM_FAIL(CM_ERR_IO, "cannot open key file '%s': %s", path, strerror(errno));
    char   line[512];
    int    found = 0, lines = 0, ok = 0;
    size_t n = 0;
    while (!found && lines++ < 64 && fgets(line, sizeof line, f)) {
        char *p = line;
        while (*p == ' ' || *p == '\t')
            p++;
        n = strlen(p);
        while (n && (p[n - 1] == '\n' || p[n - 1] == '\r' || p[n - 1] == ' ' || p[n - 1] == '\t'))
            p[--n] = '\0';
        if (n == 0 || p[0] == '#')
            continue;
        found = 1;
        ok = n == CM_CHAN_KEY_LEN;
        for (size_t i = 0; ok && i < n; i++)
            ok = z85_char_ok(p[i]);
        uint8_t bin[32];
        if (ok)
            ok = zmq_z85_decode(bin, p) != NULL;
        if (ok)
            memcpy(out, p, CM_CHAN_KEY_LEN + 1);
        memset(bin, 0, sizeof bin);
    }
    memset(line, 0, sizeof line);
    fclose(f);
    if (!found)
        return CM_FAIL(CM_ERR_FORMAT,
                       "key file '%s' holds no key: expected %d Z85 characters on the first line "
                       "that is not a '#' comment (write a key pair with --curve-keygen)",
                       path, CM_CHAN_KEY_LEN);
    if (!ok) /* the content is never echoed: it may be a secret key */
        return CM_FAIL(CM_ERR_FORMAT,
                       "key file '%s': the first line that is not a comment is not a key (%zu "
                       "characters; a key is %d Z85 characters)",
                       path, n, CM_CHAN_KEY_LEN);
    return CM_OK;
}

static cm_status write_key_file(const char *path, const char *comment, const char *key, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, mode);
    if (fd < 0) {
        if (errno == EEXIST)
            return CM_FAIL(CM_ERR_IO, "key file '%s' already exists; remove it or choose another prefix",
                           path);
        return CM_FAIL(CM_ERR_IO, "cannot create key file '%s': %s", path, strerror(errno));
    }
    char text[256];
    int  n = snprintf(text, sizeof text, "# %s\n%s\n", comment, key);
    int  ok = n > 0 && (size_t)n < sizeof text && write(fd, text, (size_t)n) == n && fsync(fd) == 0;
    int  e = errno;
    memset(text, 0, sizeof text);
    if (close(fd) != 0)
        ok = 0;
    if (!ok) {
        unlink(path);
        return CM_FAIL(CM_ERR_IO, "cannot write key file '%s': %s", path, strerror(e));
    }
    return CM_OK;
}

cm_status cm_chan_curve_keygen(const char *prefix) {
    CM_TRY(cm_chan_curve_require("--curve-keygen"));
    char pub_path[4096], key_path[4096];
    if (!prefix || !*prefix ||
        snprintf(pub_path, sizeof pub_path, "%s.pub", prefix) >= (int)sizeof pub_path ||
        snprintf(key_path, sizeof key_path, "%s.key", prefix) >= (int)sizeof key_path)
        return CM_FAIL(CM_ERR_INVALID_ARG, "key prefix is empty or too long");
    char pub[CM_CHAN_KEY_LEN + 1], sec[CM_CHAN_KEY_LEN + 1];
    CM_TRY(CM_ZMQ(zmq_curve_keypair(pub, sec)));
    cm_status st =
        write_key_file(key_path, "tandem CURVE secret key (Z85): keep this file private", sec, 0600);
    memset(sec, 0, sizeof sec);
    if (st != CM_OK)
        return st;
    st = write_key_file(pub_path, "tandem CURVE public key (Z85)", pub, 0644);
    if (st != CM_OK)
        unlink(key_path);
    return st;
}

// ----------------------------------------------------------------------------
// endpoints

cm_status cm_chan_endpoint_check(const char *ep, int *local) {
    *local = 0;
    if (!ep)
        return CM_FAIL(CM_ERR_INVALID_ARG, "no endpoint given: use tcp://HOST:PORT or ipc://PATH");
    if (strncmp(ep, "ipc://", 6) == 0) {
        if (!ep[6])
            return CM_FAIL(CM_ERR_INVALID_ARG, "endpoint '%s' names no path: use ipc:///path/to/socket", ep);
        *local = 1;
        return CM_OK;
    }
    if (strncmp(ep, "tcp://", 6) != 0)
        return CM_FAIL(CM_ERR_INVALID_ARG, "endpoint '%s': only tcp://HOST:PORT and ipc://PATH are supported",
                       ep);
    const char *host = ep + 6;
    const char *colon = strrchr(host, ':');
    if (!colon || colon == host || !colon[1])
        return CM_FAIL(CM_ERR_INVALID_ARG, "endpoint '%s' has no host or port: use tcp://HOST:PORT", ep);
    if (strchr(host, ';'))
        return CM_FAIL(CM_ERR_INVALID_ARG, "endpoint '%s': source addresses (';') are not supported", ep);
    size_t hl = (size_t)(colon - host);
    if ((hl == 9 && strncmp(host, "localhost", 9) == 0) || (hl == 5 && strncmp(host, "[::1]", 5) == 0)) {
        *local = 1;
        return CM_OK;
    }
    /* 127.0.0.0/8: four dotted decimal parts, the first 127 */
    if (hl >= 7 && hl <= 15 && strncmp(host, "127.", 4) == 0) {
        int dots = 0, digits = 0, ok = 1;
        for (size_t i = 0; i < hl && ok; i++) {
            if (host[i] == '.') {
                ok = digits > 0 && digits <= 3;
                dots++;
                digits = 0;
            } else if (host[i] >= '0' && host[i] <= '9') {
                digits++;
            } else {
                ok = 0;
            }
        }
        if (ok && dots == 3 && digits > 0 && digits <= 3)
            *local = 1;
    }
    return CM_OK;
}

/* libzmq's ipc bind unlinks whatever is at the path first, so binding a path that a running
 * server holds takes its endpoint over (and the file goes with the newcomer). A connect tells
 * a listener from a file a dead server left behind: a listener accepts (or its backlog is full:
 * EAGAIN, the socket being non-blocking), a stale file refuses. A server that is stopping may
 * hold its listener a moment longer (libzmq closes it on its I/O thread), hence the re-tries. */
static cm_status ipc_path_free(const char *ep, const char *path) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct stat        sb;
    if (path[0] == '@' || path[0] == '*' || strlen(path) >= sizeof sa.sun_path)
        return CM_OK; /* abstract names refuse a second bind themselves; zmq reports long paths */
    if (lstat(path, &sb) != 0)
        return errno == ENOENT
                   ? CM_OK
                   : CM_FAIL(CM_ERR_IO, "cannot bind '%s': cannot stat '%s': %s", ep, path, strerror(errno));
    if (!S_ISSOCK(sb.st_mode))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "cannot bind '%s': '%s' exists and is not a socket (binding would delete it); "
                       "bind another path",
                       ep, path);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    for (int attempt = 0;; attempt++) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return CM_FAIL(CM_ERR_IO, "cannot bind '%s': cannot create a socket to probe '%s': %s", ep, path,
                           strerror(errno));
        int          rc = connect(fd, (const struct sockaddr *)&sa, sizeof sa), e = errno;
        struct ucred cr = {0};
        socklen_t    crl = sizeof cr;
        if (rc != 0 || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &crl) != 0)
            cr.pid = 0;
        close(fd);
        if (rc != 0 && (e == ECONNREFUSED || e == ENOENT)) {
            if (e == ECONNREFUSED)
                CM_LOG_INFO(
                    "'%s' is a socket file no server listens on (left by one that died); replacing it", path);
            return CM_OK;
        }
        if (rc != 0 && e != EAGAIN)
            return CM_FAIL(CM_ERR_IO,
                           "cannot bind '%s': cannot tell whether a server listens on '%s' (connect: %s); "
                           "remove the file if none does, or bind another path",
                           ep, path, strerror(e));
        if (attempt == 4) {
            char who[48] = "another server";
            if (cr.pid > 0)
                snprintf(who, sizeof who, "another server (pid %d)", (int)cr.pid);
            return CM_FAIL(CM_ERR_ZMQ,
                           "cannot bind '%s': %s is listening on the socket file '%s'; stop it first, or "
                           "bind another path",
                           ep, who, path);
        }
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

int cm_chan_endpoint_ipv6_(const char *ep) {
    return ep && strncmp(ep, "tcp://[", 7) == 0;
}

cm_status cm_chan_bind_check_(const char *ep) {
    if (strncmp(ep, "ipc://", 6) == 0)
        return ipc_path_free(ep, ep + 6);
    /* libzmq binds an IP address, '*' or an interface name: a host name fails with "No such
     * device", so the one a loopback bind is likely to be given gets its fix here */
    if (strncmp(ep, "tcp://localhost:", 16) == 0)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "cannot bind '%s': ZeroMQ binds an IP address or an interface name, not a host name; "
                       "bind tcp://127.0.0.1:%s",
                       ep, ep + 16);
    return CM_OK;
}

cm_status cm_chan_server_endpoint_check_(const char *endpoint, const char *secret_key,
                                         const char *client_keys) {
    int local;
    CM_TRY(cm_chan_endpoint_check(endpoint, &local));
    if (!local && (!secret_key || !client_keys))
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "refusing to bind '%s' without CURVE: a non-loopback endpoint needs "
            "--curve-secret-key FILE and --curve-client-keys DIR; or bind tcp://127.0.0.1:PORT or ipc://PATH",
            endpoint);
    if (client_keys && !secret_key)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "--curve-client-keys needs --curve-secret-key (the server's own key)");
    if (secret_key)
        CM_TRY(cm_chan_curve_require("--curve-secret-key"));
    return cm_chan_bind_check_(endpoint);
}

cm_status cm_chan_curve_server_(void *sock, const char *secret_key, int zap, const char *what) {
    char secret[CM_CHAN_KEY_LEN + 1], public_key[CM_CHAN_KEY_LEN + 1];
    CM_TRY(cm_chan_curve_read_key(secret_key, secret));
    cm_status st = zmq_curve_public(public_key, secret) == 0
                       ? CM_OK
                       : CM_FAIL(CM_ERR_FORMAT, "key file '%s' does not hold a CURVE secret key", secret_key);
    if (st == CM_OK)
        st = cm_chan_set_int(sock, ZMQ_CURVE_SERVER, 1);
    if (st == CM_OK)
        st = CM_ZMQ(zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, secret, CM_CHAN_KEY_LEN + 1));
    memset(secret, 0, sizeof secret);
    if (st == CM_OK && zap)
        st = CM_ZMQ(zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, "tandem", 6));
    if (st == CM_OK)
        CM_LOG_INFO("%sCURVE on: server public key %s, %s", what, public_key,
                    zap ? "clients checked against the key directory" : "any client that knows it");
    return st;
}

cm_status cm_chan_bind_(void *sock, const char *endpoint, char *bound, size_t cap, ino_t *ino, dev_t *dev) {
    *ino = 0;
    *dev = 0;
    if (zmq_bind(sock, endpoint) != 0) {
        int e = zmq_errno();
        return CM_FAIL(CM_ERR_ZMQ, "cannot bind '%s': %s%s", endpoint, zmq_strerror(e),
                       e == EADDRINUSE ? " (another server runs there? choose another port)"
                       : e == ENODEV
                           ? " (a bind takes an IP address, '*' or an interface name, not a host name)"
                           : "");
    }
    size_t el = cap;
    if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, bound, &el) != 0)
        snprintf(bound, cap, "%s", endpoint);
    struct stat sb;
    if (strncmp(bound, "ipc://", 6) == 0 && bound[6] != '@' && stat(bound + 6, &sb) == 0) {
        *ino = sb.st_ino;
        *dev = sb.st_dev;
    }
    return CM_OK;
}

cm_status cm_chan_listen_(const cm_chan_listen *l, void **ctx, void **router, cm_chan_zap *zap, char *bound,
                          size_t cap, ino_t *ino, dev_t *dev) {
    if (!(*ctx = zmq_ctx_new()))
        return CM_ZMQ(-1);
    if (l->curve_client_keys)
        CM_TRY(cm_chan_zap_open_(zap, *ctx, l->curve_client_keys));
    if (!(*router = zmq_socket(*ctx, ZMQ_ROUTER)))
        return CM_ZMQ(-1);
    CM_TRY(cm_chan_set_int(*router, ZMQ_ROUTER_MANDATORY, 1));
    CM_TRY(cm_chan_set_int(*router, ZMQ_ROUTER_HANDOVER, 1));
    CM_TRY(cm_chan_set_int(*router, ZMQ_LINGER, l->linger_ms));
    if (cm_chan_endpoint_ipv6_(l->endpoint))
        CM_TRY(cm_chan_set_int(*router, ZMQ_IPV6, 1));
    if (l->sndhwm > 0)
        CM_TRY(cm_chan_set_int(*router, ZMQ_SNDHWM, l->sndhwm));
    CM_TRY(cm_chan_set_i64(*router, ZMQ_MAXMSGSIZE, l->max_msg));
    if (l->curve_secret_key)
        CM_TRY(cm_chan_curve_server_(*router, l->curve_secret_key, zap->sock != NULL, l->what));
    return cm_chan_bind_(*router, l->endpoint, bound, cap, ino, dev);
}

int cm_chan_recv_msg_(void *router, zmq_msg_t *fr, uint8_t *ident, size_t *ident_len, int *parts) {
    zmq_msg_t idm;
    zmq_msg_init(&idm);
    zmq_msg_init(fr);
    if (zmq_msg_recv(&idm, router, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&idm);
        zmq_msg_close(fr);
        return 0;
    }
    int more = zmq_msg_more(&idm);
    *parts = 0;
    if (more && zmq_msg_recv(fr, router, 0) >= 0) {
        *parts = 1;
        more = zmq_msg_more(fr);
    }
    while (more) { /* drain extra parts: a peer sends one frame per message */
        zmq_msg_t x;
        zmq_msg_init(&x);
        more = zmq_msg_recv(&x, router, 0) >= 0 && zmq_msg_more(&x);
        zmq_msg_close(&x);
        (*parts)++;
    }
    *ident_len = zmq_msg_size(&idm) <= IDENT_MAX ? zmq_msg_size(&idm) : IDENT_MAX;
    memcpy(ident, zmq_msg_data(&idm), *ident_len);
    zmq_msg_close(&idm);
    return 1;
}

cm_status cm_chan_error_frame_(uint8_t *buf, size_t cap, size_t *len, uint64_t id, cm_proto_error_code code,
                               const char *fmt, va_list ap) {
    cm_proto_error e = {.batch_id = id, .code = code};
    char           text[1024];
    vsnprintf(text, sizeof text, fmt, ap);
    cm_chan_error_text(e.message, text);
    return cm_proto_error_encode(&e, buf, cap, len);
}

void cm_chan_unbind_file_(const char *bound, ino_t ino, dev_t dev) {
    struct stat sb;
    if (ino && stat(bound + 6, &sb) == 0 && sb.st_ino == ino && sb.st_dev == dev)
        unlink(bound + 6);
}

// ----------------------------------------------------------------------------
// the client side of CURVE

cm_status cm_chan_curve_client_keys_(cm_chan_curve_keys *k, const char *endpoint, const char *server_key,
                                     const char *secret_key) {
    memset(k, 0, sizeof *k);
    int local;
    CM_TRY(cm_chan_endpoint_check(endpoint, &local));
    if (!local && !server_key)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "connecting to '%s' needs --curve-server-key (the server's public key): a "
                       "target-server binds a non-loopback endpoint only with CURVE",
                       endpoint);
    if (secret_key && !server_key)
        return CM_FAIL(CM_ERR_INVALID_ARG, "a client CURVE secret key needs --curve-server-key too");
    if (!server_key)
        return CM_OK;
    CM_TRY(cm_chan_curve_require("--curve-server-key"));
    cm_status st = cm_chan_curve_read_key(server_key, k->server);
    if (st == CM_OK && secret_key) {
        st = cm_chan_curve_read_key(secret_key, k->sec);
        if (st == CM_OK && zmq_curve_public(k->pub, k->sec) != 0)
            st = CM_FAIL(CM_ERR_FORMAT, "key file '%s' does not hold a CURVE secret key", secret_key);
    } else if (st == CM_OK) {
        st = CM_ZMQ(zmq_curve_keypair(k->pub, k->sec));
    }
    if (st != CM_OK) {
        cm_chan_curve_keys_wipe_(k);
        return st;
    }
    k->on = 1;
    return CM_OK;
}

cm_status cm_chan_curve_client_apply_(void *sock, const cm_chan_curve_keys *k) {
    if (!k->on)
        return CM_OK;
    CM_TRY(CM_ZMQ(zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, k->server, CM_CHAN_KEY_LEN + 1)));
    CM_TRY(CM_ZMQ(zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, k->pub, CM_CHAN_KEY_LEN + 1)));
    return CM_ZMQ(zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, k->sec, CM_CHAN_KEY_LEN + 1));
}

void cm_chan_curve_keys_wipe_(cm_chan_curve_keys *k) {
    volatile char *p = (volatile char *)k;
    for (size_t i = 0; i < sizeof *k; i++)
        p[i] = 0;
}

int cm_chan_default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN) / 2;
    return n < 2 ? 2 : n > 16 ? 16 : (int)n;
}
