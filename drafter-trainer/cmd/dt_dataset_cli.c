/* drafter-trainer/cmd/dt_dataset_cli.c — `drafter-trainer dataset convert|inspect`: JSONL to the
 * binary tokenized form, and a summary of a dataset (documents, tokens, supervised tokens,
 * length histogram, packs at a token budget). Formats and packing in dt_dataset.h. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_args.h"
#include "cm_log.h"
#include "dt_cmd.h"
#include "dt_data.h"
#include "dt_dataset.h"

static void usage(FILE *f) {
    fprintf(f, "usage: drafter-trainer dataset convert IN.jsonl OUT.safetensors\n"
               "       drafter-trainer dataset inspect FILE[,FILE...] [--token-budget N] [--vocab-size V]\n"
               "\n"
               "Tokenized datasets (drafter-trainer/feed/dt_dataset.h): JSONL, one document per line\n"
               "{\"input_ids\": [...], \"loss_mask\": [0|1, ...]}, or the binary tandem-tokens safetensors\n"
               "form (input_ids I32, loss_mask U8, doc_offsets I64). tools/prepare_data.py writes either\n"
               "from ShareGPT or OpenAI-messages conversations.\n"
               "\n"
               "  convert   checks IN (JSONL or binary) and writes its documents to OUT in the binary form\n"
               "            (atomically), which opens faster\n"
               "  inspect   documents, tokens, supervised tokens, a length histogram, and how train packs\n"
               "            the files at --token-budget (default 8192); --vocab-size also checks the ids\n");
}

static cm_status convert(const char *in, const char *out) {
    dt_docs d;
    CM_TRY(dt_docs_read(&d, in));
    cm_status st = dt_docs_write(&d, out);
    if (st == CM_OK)
        printf("wrote '%s': %" PRId64 " documents, %" PRId64 " tokens\n", out, d.n_docs, d.total);
    dt_docs_release(&d);
    return st;
}

/* Lengths into buckets [1, 2), [2, 4), ..., [2^k, 2^(k+1)). */
static void histogram(const int64_t *count) {
    printf("document lengths (tokens):\n");
    for (int k = 0; k < 63; k++)
        if (count[k])
            printf("  [%lld, %lld)  %" PRId64 "\n", 1LL << k, 1LL << (k + 1), count[k]);
}

static cm_status inspect(const char *list, int64_t budget, int64_t vocab) {
    char    **paths = NULL;
    int       n = 0;
    cm_status st = CM_OK;
    CM_TRY(dt_data_split_list(list, &paths, &n));
    int64_t hist[64] = {0}, docs = 0, tokens = 0, sup = 0, longest = 0, over = 0;
    for (int i = 0; i < n; i++) {
        dt_docs d;
        CM_TRY_GOTO(dt_docs_read(&d, paths[i]), st, done);
        int64_t s = 0;
        for (int64_t t = 0; t < d.total; t++)
            s += d.mask[t];
        for (int64_t k = 0; k < d.n_docs; k++) {
            const int64_t len = d.offsets[k + 1] - d.offsets[k];
            int           b = 0;
            while (b < 62 && (len >> (b + 1)) > 0)
                b++;
            hist[b]++;
            longest = len > longest ? len : longest;
            over += len > budget;
        }
        printf("%s: %" PRId64 " documents, %" PRId64 " tokens, %" PRId64 " supervised\n", paths[i], d.n_docs,
               d.total, s);
        docs += d.n_docs;
        tokens += d.total;
        sup += s;
        dt_docs_release(&d);
    }
    printf("total: %" PRId64 " documents, %" PRId64 " tokens, %" PRId64
           " supervised (%.1f%%), longest %" PRId64 "\n",
           docs, tokens, sup, tokens ? 100.0 * (double)sup / (double)tokens : 0.0, longest);
    histogram(hist);
    if (over) {
        printf("packing at --token-budget %" PRId64 ": impossible, %" PRId64
               " documents are longer (raise --token-budget to at least %" PRId64 " or truncate the data)\n",
               budget, over, longest);
        goto done;
    }
    dt_dataset *ds = NULL;
    CM_TRY_GOTO(dt_dataset_open(&ds, (const char *const *)paths, n, budget, (int)vocab), st, done);
    dt_dataset_stats s;
    dt_dataset_get_stats(ds, &s);
    printf(
        "packing at --token-budget %" PRId64 ": %" PRId64 " packs (batches), %" PRId64 " documents dropped "
        "(no two consecutive supervised tokens), %" PRId64
        " tokens packed, fill %.1f%%, largest pack %" PRId64 " tokens, at most %" PRId64
        " documents in a pack, hash %016" PRIx64 "\n",
        budget, s.n_packs, s.n_dropped, s.n_tokens, 100.0 * (double)s.n_tokens / ((double)s.n_packs * budget),
        s.max_pack_tokens, s.max_pack_docs, dt_dataset_hash(ds));
    dt_dataset_destroy(&ds);
done:
    dt_data_free_list(paths, n);
    return st;
}

int dt_cmd_dataset(int argc, char **argv) {
    if (argc < 1 || strcmp(argv[0], "-h") == 0 || strcmp(argv[0], "--help") == 0) {
        usage(argc < 1 ? stderr : stdout);
        return argc < 1 ? 2 : 0;
    }
    cm_status st;
    if (strcmp(argv[0], "convert") == 0) {
        if (argc != 3) {
            fprintf(stderr, "drafter-trainer dataset convert: expected IN and OUT (see --help)\n");
            return 2;
        }
        st = convert(argv[1], argv[2]);
    } else if (strcmp(argv[0], "inspect") == 0) {
        if (argc < 2 || argv[1][0] == '-') {
            fprintf(stderr, "drafter-trainer dataset inspect: expected FILE[,FILE...] (see --help)\n");
            return 2;
        }
        int64_t budget = DT_DATASET_DEFAULT_BUDGET, vocab = INT32_MAX;
        cm_args p;
        cm_args_init(&p, "drafter-trainer dataset inspect", argc - 2, argv + 2);
        while (cm_args_next(&p))
            if (!cm_args_i64(&p, "--token-budget", 2, INT32_MAX, &budget) &&
                !cm_args_i64(&p, "--vocab-size", 1, INT32_MAX, &vocab) && !cm_args_log_level(&p))
                cm_args_unknown(&p);
        if (p.bad)
            return 2;
        st = inspect(argv[1], budget, vocab);
    } else {
        fprintf(stderr, "drafter-trainer dataset: unknown action '%s' (convert or inspect; see --help)\n",
                argv[0]);
        return 2;
    }
    fflush(stdout);
    if (st != CM_OK) {
        fprintf(stderr, "drafter-trainer dataset %s: %s: %s\n", argv[0], cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
