/* target-server/cmd/ts_status.c — `target-server status`: one STATUS request to a running server
 * (cm_chan_status_query; works while trainers are attached, needs no session) and a readable
 * summary of the reply, or the reply itself with --json (for scripts and monitoring). */
#include "ts_cmd.h"

#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_chan.h"
#include "cm_log.h"

static void usage(FILE *f) {
    fprintf(f, "usage: target-server status [--server ENDPOINT] [options]\n"
               "\n"
               "Asks a running target-server what it serves (model, device, load state), which trainers\n"
               "are attached and how fast it answers, and prints it.\n"
               "\n"
               "  --server ENDPOINT         the server's endpoint (default tcp://127.0.0.1:5555)\n"
               "  --curve-server-key FILE   the server's CURVE public key (needed for non-loopback endpoints)\n"
               "  --curve-secret-key FILE   this client's CURVE secret key (for a server with --curve-client-keys)\n"
               "  --timeout-ms N            how long to wait for the answer (default 3000)\n"
               "  --json                    print the server's JSON reply as it is\n");
}

static double num(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : 0.0;
}

static const char *str(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : "?";
}

static int flag(const cJSON *o, const char *k) {
    return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, k));
}

static void human_bytes(double b, char *out, size_t cap) {
    const char *u[] = {"B", "KB", "MB", "GB", "TB"};
    int         i = 0;
    while (b >= 1000 && i < 4) {
        b /= 1000;
        i++;
    }
    snprintf(out, cap, "%.1f %s", b, u[i]);
}

static void print_summary(const cJSON *o) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "target");
    const cJSON *tot = cJSON_GetObjectItemCaseSensitive(o, "totals");
    const cJSON *ses = cJSON_GetObjectItemCaseSensitive(o, "sessions");
    double       up = num(o, "uptime_s");
    printf("target-server '%s' on %s: weights %s (config %s), up %dh%02dm%02ds%s\n", str(o, "name"),
           str(o, "endpoint"), str(o, "weights_id"), str(o, "target_id"), (int)(up / 3600), (int)(up / 60) % 60, (int)up % 60,
           flag(o, "stopping") ? ", stopping" : "");
    if (t) {
        char         dev[64] = "";
        const cJSON *gpus = cJSON_GetObjectItemCaseSensitive(t, "gpus"), *g;
        if (strcmp(str(t, "device"), "cuda") == 0 && cJSON_GetArraySize(gpus) > 1) /* a replica per GPU */
            cJSON_ArrayForEach(g, gpus) {
                size_t n = strlen(dev);
                snprintf(dev + n, sizeof dev - n, "%s%d", n ? "," : ":", (int)cJSON_GetNumberValue(g));
            }
        else if (strcmp(str(t, "device"), "cuda") == 0)
            snprintf(dev, sizeof dev, ":%d", (int)num(t, "gpu"));
        printf("  model   %s (%s, %d layers, hidden %d, vocab %d) on %s%s%s%s; %s", str(t, "model"),
               str(t, "model_type"), (int)num(t, "n_layers"), (int)num(t, "hidden_size"), (int)num(t, "vocab_size"),
               str(t, "device"), dev, dev[0] ? ", " : "", dev[0] ? str(t, "precision") : "",
               flag(t, "loaded") ? "loaded" : "loading");
        if (flag(t, "loaded"))
            printf(" in %.1f s", num(t, "load_s"));
        printf("\n");
    }
    char         encs[128] = "";
    const cJSON *e;
    cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(o, "encodings")) {
        if (cJSON_IsString(e) && strlen(encs) + strlen(e->valuestring) + 2 < sizeof encs) {
            if (encs[0])
                strcat(encs, ",");
            strcat(encs, e->valuestring);
        }
    }
    char busy[64] = "idle";
    if (num(o, "workers") > 1)
        snprintf(busy, sizeof busy, "%.0f of %.0f replicas computing", num(o, "workers_busy"), num(o, "workers"));
    else if (flag(o, "computing"))
        snprintf(busy, sizeof busy, "computing now");
    printf("  serves  %s hidden states of layers 0..%d, up to %d tokens per request, %d credits; encodings %s; %s\n",
           str(o, "hidden_dtype"), (int)num(o, "n_layers") - 1, (int)num(o, "max_tokens"), (int)num(o, "credits"), encs,
           busy);
    if (tot) {
        char b[32];
        human_bytes(num(tot, "bytes_sent"), b, sizeof b);
        printf("  totals  %.0f answers, %.0f tokens, %s sent, %.0f tokens/s since start; %.0f sessions active, "
               "%.0f opened; %.0f resends, %.0f errors, %.0f malformed frames\n",
               num(tot, "answers"), num(tot, "tokens"), b, num(tot, "tokens_per_s"), num(tot, "sessions_active"),
               num(tot, "sessions_opened"), num(tot, "resends"), num(tot, "errors_sent"), num(tot, "bad_frames"));
    }
    const cJSON *x;
    cJSON_ArrayForEach(x, ses) {
        char b[32];
        human_bytes(num(x, "bytes_sent"), b, sizeof b);
        char computing[32] = ""; /* jobs of this session on replicas now */
        if (num(x, "computing") > 0)
            snprintf(computing, sizeof computing, ", %.0f computing", num(x, "computing"));
        printf("  session '%s' from %s for %.0f s: %.0f answers (%.0f queued%s), %.0f tokens, %s, %.0f tokens/s%s\n",
               str(x, "name"), str(x, "peer"), num(x, "age_s"), num(x, "answers"), num(x, "queued"), computing,
               num(x, "tokens"), b, num(x, "tokens_per_s"), flag(x, "nccl") ? ", over NCCL" : "");
    }
    if (!cJSON_GetArraySize(ses))
        printf("  no trainer attached\n");
}

int ts_status_main(int argc, char **argv) {
    const char *endpoint = "tcp://127.0.0.1:5555", *key = NULL, *secret = NULL;
    int         timeout_ms = 3000, json = 0;
    cm_args     p;
    cm_args_init(&p, "target-server status", argc, argv);
    while (cm_args_next(&p)) {
        if (cm_args_help(&p)) {
            usage(stdout);
            return 0;
        } else if (cm_args_flag(&p, "--json"))
            json = 1;
        else if (cm_args_str(&p, "--server", &endpoint) || cm_args_str(&p, "--curve-server-key", &key) ||
                 cm_args_str(&p, "--curve-secret-key", &secret) ||
                 cm_args_int(&p, "--timeout-ms", 1, 600000, &timeout_ms))
            ;
        else
            cm_args_unknown(&p);
    }
    if (p.bad)
        return 2;
    cm_log_set_level(CM_LOG_LEVEL_ERROR);
    static char reply[CM_PROTO_STATUS_MAX + 1];
    cm_status   st = cm_chan_status_query(endpoint, key, secret, timeout_ms, reply, sizeof reply);
    if (st != CM_OK) {
        fprintf(stderr, "target-server status: %s: %s\n", cm_status_str(st), cm_last_error());
        return 1;
    }
    if (json) {
        printf("%s\n", reply);
        return 0;
    }
    cJSON *o = cJSON_Parse(reply);
    if (!o) {
        fprintf(stderr, "target-server status: the server's reply is not JSON; rerun with --json to see it\n");
        return 1;
    }
    print_summary(o);
    cJSON_Delete(o);
    return 0;
}
