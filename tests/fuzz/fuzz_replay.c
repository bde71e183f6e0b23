/* tests/fuzz/fuzz_replay.c — a main() for the fuzz targets without libFuzzer: feeds every file
 * named on the command line (a directory: each file in it, in name order) once to
 * LLVMFuzzerTestOneInput. The unit tests replay tests/fuzz/regress/<target>/ (inputs that once
 * crashed) and the seed corpus this way under gcc and ASan, so every fix stays fixed on any
 * machine. Exits 1 if an argument cannot be read or no input was found. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Under ASan, an allocation above 2 GiB is a finding, as under libFuzzer's -rss_limit_mb=2048
 * (a parser sized something from the bytes it read without bounding it); without ASan such
 * inputs replay only for the other checks. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
    return "max_allocation_size_mb=2048:allocator_may_return_null=0";
}
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz replay: cannot open '%s'\n", path);
        return -1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    /* an exact-size copy, so ASan sees a read past the end of the input */
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
        fprintf(stderr, "fuzz replay: cannot read '%s'\n", path);
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    fprintf(stderr, "fuzz replay: %s (%ld bytes)\n", path, n);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 1;
}

static int skip_dot(const struct dirent *e) {
    return e->d_name[0] != '.';
}

int main(int argc, char **argv) {
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);
    long total = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0) {
            fprintf(stderr, "fuzz replay: cannot open '%s'\n", argv[i]);
            return 1;
        }
        if (!S_ISDIR(sb.st_mode)) {
            if (replay_file(argv[i]) < 0)
                return 1;
            total++;
            continue;
        }
        struct dirent **names;
        int             n = scandir(argv[i], &names, skip_dot, alphasort);
        if (n < 0) {
            fprintf(stderr, "fuzz replay: cannot list '%s'\n", argv[i]);
            return 1;
        }
        for (int k = 0; k < n; k++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[i], names[k]->d_name);
            if (replay_file(path) < 0)
                return 1;
            total++;
            free(names[k]);
        }
        free(names);
    }
    if (total == 0) {
        fprintf(stderr, "fuzz replay: no inputs (usage: %s FILE|DIR ...)\n", argv[0]);
        return 1;
    }
    fprintf(stderr, "fuzz replay: %ld inputs, no crash\n", total);
    return 0;
}
