/* target-server/cmd/ts_main.c — the target-server command line: `target-server <command>
 * [options]` hands the options to the command (cmd/: dump, serve, status, generate; see --help). */
#include <stdio.h>
#include <string.h>

#include "ts_cmd.h"

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        ts_dump_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "dump") == 0) return ts_dump_main(argc - 2, argv + 2);
    if (strcmp(argv[1], "serve") == 0) return ts_serve_main(argc - 2, argv + 2);
    if (strcmp(argv[1], "status") == 0) return ts_status_main(argc - 2, argv + 2);
    if (strcmp(argv[1], "generate") == 0) return ts_generate_main(argc - 2, argv + 2);
    fprintf(stderr, "target-server: unknown command '%s' (commands: dump, serve, status, generate; see --help)\n", argv[1]);
    return 2;
}
