/* tests/bench_cm_nccl.c — GB/s of the NCCL data path between two GPUs of one host: two real
 * processes (the trainer as rank 0 on GPU 0, the server as rank 1 on GPU 1) joined through
 * cm_nccl exactly as a session joins them (the unique id travels from rank 0 to rank 1; here
 * through a pipe instead of NCCL_OFFER), then the server sends and the trainer receives
 * answers of several sizes: single buffers from 1 MB to 1 GB, and answer-shaped groups (5
 * taps of 8192 × 5120 BF16, the Qwen3.6-27B drafter's). Prints a markdown table; exits 77
 * without two GPUs.
 *
 *   bench_cm_nccl [--iters N]
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cm_log.h"
#include "cm_nccl.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

typedef struct shape {
    const char *what;
    int         n;     /* buffers per transfer */
    size_t      bytes; /* each */
} shape;

static const shape shapes[] = {
    {"1 MB", 1, 1u << 20},
    {"16 MB", 1, 16u << 20},
    {"64 MB", 1, 64u << 20},
    {"256 MB", 1, 256u << 20},
    {"1 GB", 1, 1u << 30},
    {"27B answer: 5 × [8192, 5120] bf16", 5, (size_t)8192 * 5120 * 2},
    {"27B answer: 5 × [16384, 5120] bf16", 5, (size_t)16384 * 5120 * 2},
};
#define N_SHAPES (int)(sizeof shapes / sizeof shapes[0])

static int run(int rank, int fd_uid, int iters) {
    cm_proto_nccl offer;
    if (rank == 0) {
        if (cudaSetDevice(0) != cudaSuccess || cm_nccl_make_offer(&offer, 0) != CM_OK) {
            fprintf(stderr, "rank 0: %s\n", cm_last_error());
            return 1;
        }
        if (write(fd_uid, &offer, sizeof offer) != (ssize_t)sizeof offer)
            return 1;
    } else if (read(fd_uid, &offer, sizeof offer) != (ssize_t)sizeof offer) {
        return 1;
    }
    cm_nccl_peer *p = NULL;
    double        t0 = now_s();
    if (cm_nccl_peer_open(&p, &offer, rank, rank, 60000) != CM_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, cm_last_error());
        return 1;
    }
    if (rank == 0)
        printf("communicator up in %.0f ms (GPU 0 = trainer, rank 0; GPU 1 = server, rank 1)\n\n"
               "| transfer | bytes per transfer | iterations | ms per transfer | GB/s |\n"
               "| --- | --- | --- | --- | --- |\n",
               1e3 * (now_s() - t0));
    void  *bufs[5];
    size_t bytes[5];
    size_t max = 0;
    for (int s = 0; s < N_SHAPES; s++)
        max = shapes[s].n * shapes[s].bytes > max ? shapes[s].n * shapes[s].bytes : max;
    void *mem = NULL;
    if (cudaMalloc(&mem, max) != cudaSuccess) {
        fprintf(stderr, "rank %d: cannot allocate %zu bytes\n", rank, max);
        return 1;
    }
    cudaMemset(mem, rank + 1, max);
    cudaDeviceSynchronize();
    for (int s = 0; s < N_SHAPES; s++) {
        const shape *sh = &shapes[s];
        for (int i = 0; i < sh->n; i++) {
            bufs[i] = (char *)mem + (size_t)i * sh->bytes;
            bytes[i] = sh->bytes;
        }
        double t = 0;
        for (int it = -2; it < iters; it++) { /* two warm-up transfers */
            double a = now_s();
            cm_status st = rank == 1 ? cm_nccl_peer_send(p, (const void *const *)bufs, bytes, sh->n)
                                     : cm_nccl_peer_recv(p, bufs, bytes, sh->n);
            if (st == CM_OK)
                st = cm_nccl_peer_wait(p, 60000);
            if (st != CM_OK) {
                fprintf(stderr, "rank %d: %s: %s\n", rank, sh->what, cm_last_error());
                return 1;
            }
            if (it >= 0)
                t += now_s() - a;
        }
        if (rank == 0) {
            double total = (double)sh->n * (double)sh->bytes;
            printf("| %s | %.1f MB | %d | %.3f | %.1f |\n", sh->what, total / 1e6, iters, 1e3 * t / iters,
                   total * iters / t / 1e9);
        }
    }
    /* the receiver checks the bytes of the last transfer: the sender filled them with rank 1 + 1 */
    int ok = 1;
    if (rank == 0) {
        unsigned char probe[4096];
        cudaMemcpy(probe, mem, sizeof probe, cudaMemcpyDeviceToHost);
        for (size_t i = 0; i < sizeof probe; i++)
            ok &= probe[i] == 2;
        printf("\nreceived bytes %s the sent pattern\n", ok ? "match" : "DO NOT match");
    }
    cudaFree(mem);
    cm_nccl_peer_close(&p);
    return ok ? 0 : 1;
}

int main(int argc, char **argv) {
    int iters = 10;
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--iters") == 0)
            iters = atoi(argv[i + 1]);
    if (iters < 1)
        iters = 1;
    cm_log_set_level(CM_LOG_LEVEL_WARN);
    int fds[2];
    if (pipe(fds) != 0)
        return 1;
    pid_t child = fork(); /* before any CUDA call: each process initialises its own */
    if (child < 0)
        return 1;
    if (child == 0) {
        close(fds[1]);
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2)
            _exit(77);
        _exit(run(1, fds[0], iters));
    }
    close(fds[0]);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
        fprintf(stderr, "bench_cm_nccl: needs two GPUs (found %d)\n", n);
        close(fds[1]);
        waitpid(child, NULL, 0);
        return 77;
    }
    int rc = run(0, fds[1], iters);
    close(fds[1]);
    int status = 0;
    waitpid(child, &status, 0);
    int crc = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    return rc ? rc : crc;
}
