/* target-server/ts_serve.h — `target-server serve`: loads the frozen target once and answers
 * hidden-state requests from any number of trainers over ZeroMQ (cm_chan) until SIGTERM or
 * SIGINT, then finishes the forward in progress, says BYE and exits 0. */
#ifndef TS_SERVE_H
#define TS_SERVE_H

#ifdef __cplusplus
extern "C" {
#endif

/* argv holds the options after "serve". Returns the exit status: 0 after a clean stop (or
 * --help, --curve-keygen), 1 for a failure (one message on stderr), 2 for a usage error. */
int ts_serve_main(int argc, char **argv);

/* `target-server status --server ENDPOINT [--json] ...` (ts_status.c): asks a running server for
 * its STATUS and prints it. 0, 1 (no answer, or a refusal; one message), 2 (usage). */
int ts_status_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif /* TS_SERVE_H */
