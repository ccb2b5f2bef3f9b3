/*
 * C ABI tests of liboktopk, run by `make test-c` (tests/c/launch.sh starts
 * the multi-process modes).
 *
 *   oktopk_test ranks    one of P processes started with RANK, WORLD_SIZE,
 *                        MASTER_ADDR, MASTER_PORT: dense and sparse allreduce
 *                        over real sockets (sparse-in at n = 2^32 - 1 within
 *                        half a second for every algorithm that takes
 *                        sparse input), the three ways to make a
 *                        communicator, asynchronous requests; prints
 *                        "HASH <name> <hex>" lines that the launcher compares
 *                        across ranks (every rank must hold the same bits).
 *   oktopk_test errors   one process: every error path of the ABI, and a
 *                        stranger's flood (counted, harmless, destroy
 *                        still prompt).
 *   oktopk_test cycles N one process: N init/destroy cycles; open files and
 *                        goroutines must stay flat.
 *   oktopk_test peerdeath  P processes: the last rank dies without a word;
 *                        the others' next call fails (not hangs) and their
 *                        destroy returns within about a second.
 *   oktopk_test memory ALG N CALLS [LIMIT [DTYPE]]
 *                        P processes (tests/c/memory.sh runs one job per
 *                        algorithm): CALLS calls of algorithm ALG (a name of
 *                        oktopk.h's OKTOPK_ALGO_*, lower case without the
 *                        prefix) on N elements of DTYPE (float32, or
 *                        bfloat16) at density 1%; prints "MEM" lines with
 *                        this rank's peak RSS growth over a baseline taken
 *                        once the caller's buffers are allocated and
 *                        touched, in units of N x the element size, and
 *                        fails when that exceeds LIMIT (if not 0).
 *   oktopk_test env      one process: every environment setting the library
 *                        reads, set with setenv() after the library was
 *                        loaded, takes effect.
 *   oktopk_test join MS  one of P processes started by any launcher
 *                        oktopk_comm_init_env understands, with a timeout of
 *                        MS milliseconds: joins, checks its rank and size and
 *                        one dense allreduce of the ranks' numbers, and
 *                        prints "joined"; or prints "JOIN FAILED after N ms:"
 *                        and the error, and exits 3 (tests/launch/twohosts.sh
 *                        reads both).
 */
#define _GNU_SOURCE
#include "oktopk.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int rank_ = -1;

static void fail(const char *file, int line, const char *what, oktopk_result_t got, oktopk_comm_t comm) {
  char msg[512];
  oktopk_get_last_error(comm, msg, sizeof msg, NULL);
  fprintf(stderr, "rank %d: %s:%d: %s: got %d (%s), last error: %s\n", rank_, file, line, what, (int)got,
          oktopk_get_error_string(got), msg);
  exit(1);
}

/* EXPECT(call, code): the call must return exactly code. */
#define EXPECT(call, code)                                         \
  do {                                                             \
    oktopk_result_t r_ = (call);                                   \
    if (r_ != (code)) fail(__FILE__, __LINE__, #call, r_, 0);      \
  } while (0)
#define OK(call) EXPECT(call, oktopkSuccess)
#define REQUIRE(cond)                                                            \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "rank %d: %s:%d: %s failed\n", rank_, __FILE__, __LINE__, #cond); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* FNV-1a over raw bytes: equal hashes on every rank mean equal bits. */
static uint64_t hash_bytes(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
#define HASH_SEED 14695981039346656037ull

static uint64_t lcg = 1;
static uint32_t next_rand(void) {
  lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(lcg >> 33);
}

/* A gradient with integer values in [-50, 50] at about a third of the
 * positions: sums and averages of such values stay exact in float32. */
static void fill_gradient(float *x, size_t n, int rank, int tensor) {
  lcg = 1000003ull * (uint64_t)(rank + 1) + 7919ull * (uint64_t)tensor;
  for (size_t i = 0; i < n; i++) x[i] = (next_rand() % 3 == 0) ? (float)((int)(next_rand() % 101) - 50) : 0.0f;
}

/* Rank 0's bytes to every rank over a dense allreduce (the others add
 * zeros): how a caller without MPI hands out a unique id or endpoints. */
static void broadcast_bytes(oktopk_comm_t comm, int rank, char *bytes, size_t n) {
  float *f = calloc(n, sizeof *f);
  if (rank == 0)
    for (size_t i = 0; i < n; i++) f[i] = (float)(unsigned char)bytes[i];
  OK(oktopk_allreduce(comm, f, n, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  for (size_t i = 0; i < n; i++) bytes[i] = (char)(unsigned char)f[i];
  free(f);
}

/* A communicator of cfg joined NCCL style: rank 0 makes the unique id and
 * hands it to every rank over env_comm. */
static oktopk_comm_t init_rank_by_id(oktopk_comm_t env_comm, int rank, int size, const oktopk_config_t *cfg) {
  oktopk_unique_id_t id;
  memset(&id, 0, sizeof id);
  if (rank == 0) OK(oktopk_get_unique_id(&id, cfg));
  broadcast_bytes(env_comm, rank, id.internal, sizeof id.internal);
  oktopk_comm_t comm;
  OK(oktopk_comm_init_rank(&comm, size, &id, rank, cfg));
  return comm;
}

/* This process's rank and size in comm; the rank is noted (rank_) for the
 * failure messages. */
static void note_rank(oktopk_comm_t comm, int *rank, int *size) {
  OK(oktopk_comm_rank(comm, rank));
  OK(oktopk_comm_size(comm, size));
  rank_ = *rank;
}

/* ------------------------------------------------------------------------ */

static void test_dense(oktopk_comm_t comm, int rank, int size) {
  const size_t n = 10007; /* not a multiple of any rank count */
  float *x = malloc(n * sizeof *x);
  for (int alg = OKTOPK_ALGO_DENSE_RING; alg <= OKTOPK_ALGO_DENSE_RABENSEIFNER; alg++) {
    for (size_t i = 0; i < n; i++) x[i] = (float)((rank + 1) * ((int)(i % 7) - 3));
    OK(oktopk_allreduce(comm, x, n, OKTOPK_FLOAT32, 1, alg));
    float ranks_sum = (float)(size * (size + 1) / 2);
    for (size_t i = 0; i < n; i++) REQUIRE(x[i] == ranks_sum * (float)((int)(i % 7) - 3) / (float)size);
    printf("HASH dense_f32_alg%d %016llx\n", alg, (unsigned long long)hash_bytes(x, n * 4, HASH_SEED));
  }
  /* float16 and bfloat16: small integers and their sums are exact in both. */
  uint16_t *h = malloc(n * sizeof *h);
  for (int dt = OKTOPK_FLOAT16; dt <= OKTOPK_BFLOAT16; dt++) {
    for (size_t i = 0; i < n; i++) {
      float v = (float)((rank + 1) * ((int)(i % 5) - 2));
      uint32_t bits;
      memcpy(&bits, &v, 4);
      if (dt == OKTOPK_BFLOAT16) {
        h[i] = (uint16_t)(bits >> 16); /* exact: small integers */
      } else {                          /* |v| <= 2*P: a normal half */
        uint32_t sign = (bits >> 16) & 0x8000, exp = (bits >> 23) & 0xff, mant = bits & 0x7fffff;
        h[i] = v == 0 ? (uint16_t)sign : (uint16_t)(sign | ((exp - 112) << 10) | (mant >> 13));
      }
    }
    OK(oktopk_allreduce(comm, h, n, (oktopk_dtype_t)dt, 0, OKTOPK_ALGO_DENSE_RING));
    for (size_t i = 0; i < n; i++) {
      float want = (float)(size * (size + 1) / 2 * ((int)(i % 5) - 2)), got;
      uint32_t bits;
      if (dt == OKTOPK_BFLOAT16) {
        bits = (uint32_t)h[i] << 16;
      } else {
        uint32_t sign = (uint32_t)(h[i] & 0x8000) << 16, exp = (h[i] >> 10) & 0x1f, mant = h[i] & 0x3ff;
        bits = exp == 0 ? sign : (sign | ((exp + 112) << 23) | (mant << 13));
      }
      memcpy(&got, &bits, 4);
      REQUIRE(got == want);
    }
  }
  free(h);
  free(x);
}

/* Density 1.0: every entry is selected, so the sparse result is the dense
 * average, exactly, and nothing is left in the residual. */
static void test_sparse_full_density(oktopk_comm_t comm, int rank, int size) {
  const size_t n = 4099;
  float *x = malloc(n * sizeof *x), *want = calloc(n, sizeof *want), *g = malloc(n * sizeof *g);
  for (int it = 0; it < 3; it++) {
    memset(want, 0, n * sizeof *want);
    for (int r = 0; r < size; r++) {
      fill_gradient(g, n, r, 10 + it);
      for (size_t i = 0; i < n; i++) want[i] += g[i];
    }
    for (size_t i = 0; i < n; i++) want[i] /= (float)size;
    fill_gradient(x, n, rank, 10 + it);
    oktopk_stats_t st = {.size = sizeof st};
    OK(oktopk_sparse_allreduce(comm, 1, x, n, OKTOPK_FLOAT32, &st));
    for (size_t i = 0; i < n; i++) REQUIRE(x[i] == want[i]);
    REQUIRE(st.k == (int64_t)n);
  }
  free(x);
  free(want);
  free(g);
}

/* oktopk_sparse_allreduce_ex (communicator density 1): a per-call density
 * sets that call's k, and the next call without one is back at the
 * communicator's; xi is -1 unless asked for, about 0 at density 1 (the
 * result is the whole sum, up to the summation order); unknown flags and a
 * density outside [0, 1] are refused on every rank, which keeps the
 * communicator usable. */
static void test_call_options(oktopk_comm_t comm, int rank) {
  const size_t n = 4099;
  float *x = malloc(n * sizeof *x);
  const double densities[] = {0.25, 0.1, 0.0};
  for (int i = 0; i < 3; i++) {
    fill_gradient(x, n, rank, 40 + i);
    oktopk_call_options_t o = {.size = sizeof o, .flags = OKTOPK_CALL_DENSITY, .density = densities[i]};
    oktopk_stats_t st = {.size = sizeof st};
    OK(oktopk_sparse_allreduce_ex(comm, 7, x, n, OKTOPK_FLOAT32, &o, &st));
    REQUIRE(st.k == (int64_t)ceil(densities[i] * (double)n));
    REQUIRE(st.xi == -1 && st.xi_gradient_norm == -1);
    REQUIRE(st.xi_bytes_sent == 0 && st.xi_bytes_received == 0);
  }
  fill_gradient(x, n, rank, 43);
  oktopk_stats_t st = {.size = sizeof st};
  OK(oktopk_sparse_allreduce_ex(comm, 7, x, n, OKTOPK_FLOAT32, NULL, &st));
  REQUIRE(st.k == (int64_t)n);
  fill_gradient(x, n, rank, 44);
  oktopk_call_options_t xi = {.size = sizeof xi, .flags = OKTOPK_CALL_MEASURE_XI};
  OK(oktopk_sparse_allreduce_ex(comm, 7, x, n, OKTOPK_FLOAT32, &xi, &st));
  REQUIRE(st.xi >= 0 && st.xi < 1e-6 && st.xi_gradient_norm > 0);
  /* xi's ring allreduce of 2n floats (0.7): this rank sends and receives
   * its share, at most twice the 2n values. */
  REQUIRE(st.xi_bytes_sent > 0 && st.xi_bytes_sent <= 2 * 2 * n * sizeof(float));
  REQUIRE(st.xi_bytes_received > 0 && st.xi_bytes_received <= 2 * 2 * n * sizeof(float));
  oktopk_call_options_t bad = {.size = sizeof bad, .flags = 0x80};
  EXPECT(oktopk_sparse_allreduce_ex(comm, 7, x, n, OKTOPK_FLOAT32, &bad, &st), oktopkInvalidArgument);
  bad.flags = OKTOPK_CALL_DENSITY;
  bad.density = 1.5;
  EXPECT(oktopk_sparse_allreduce_ex(comm, 7, x, n, OKTOPK_FLOAT32, &bad, &st), oktopkInvalidArgument);
  OK(oktopk_sparse_allreduce_ex(comm, 7, x, n, OKTOPK_FLOAT32, NULL, &st));
  /* A per-call tau_prime of 1 (0.6): every Ok-Topk call selects exactly,
   * exactly k entries on every rank, also on calls the communicator's
   * tau_prime would have reused a threshold in. */
  for (int i = 0; i < 4; i++) {
    fill_gradient(x, n, rank, 50 + i);
    oktopk_call_options_t o = {.size = sizeof o, .flags = OKTOPK_CALL_DENSITY | OKTOPK_CALL_TAU_PRIME, .density = 0.05, .tau_prime = 1};
    OK(oktopk_sparse_allreduce_ex(comm, 11, x, n, OKTOPK_FLOAT32, &o, &st));
    REQUIRE(st.algorithm == OKTOPK_ALGO_OKTOPK && st.k == (int64_t)ceil(0.05 * (double)n) && st.local_selected == st.k);
  }
  bad.flags = OKTOPK_CALL_TAU_PRIME;
  bad.tau_prime = 0;
  EXPECT(oktopk_sparse_allreduce_ex(comm, 11, x, n, OKTOPK_FLOAT32, &bad, &st), oktopkInvalidArgument);
  bad.tau_prime = 1;
  bad.size = offsetof(oktopk_call_options_t, tau_prime); /* a 0.5 caller's struct */
  EXPECT(oktopk_sparse_allreduce_ex(comm, 11, x, n, OKTOPK_FLOAT32, &bad, &st), oktopkInvalidArgument);
  OK(oktopk_sparse_allreduce_ex(comm, 11, x, n, OKTOPK_FLOAT32, NULL, &st));
  free(x);
}

/* Density 1%: the blocking results, then the same inputs on fresh tensors
 * through 8 requests started before any is waited on: bitwise equal. */
static void test_sparse_async(oktopk_comm_t comm, int rank) {
  enum { T = 8 };
  size_t n[T];
  float *blocking[T], *async[T];
  uint64_t h = HASH_SEED;
  for (int t = 0; t < T; t++) {
    n[t] = 3000 + 1237 * (size_t)t;
    blocking[t] = malloc(n[t] * sizeof(float));
    async[t] = malloc(n[t] * sizeof(float));
    fill_gradient(blocking[t], n[t], rank, t);
    memcpy(async[t], blocking[t], n[t] * sizeof(float));
    oktopk_stats_t st = {.size = sizeof st};
    OK(oktopk_sparse_allreduce(comm, 100 + (uint64_t)t, blocking[t], n[t], OKTOPK_FLOAT32, &st));
    REQUIRE(st.k == (int64_t)ceil(0.01 * (double)n[t]));
    REQUIRE(st.global_selected > 0);
    h = hash_bytes(blocking[t], n[t] * sizeof(float), h);
  }
  oktopk_request_t req[T];
  for (int t = 0; t < T; t++)
    OK(oktopk_sparse_allreduce_start(comm, 200 + (uint64_t)t, async[t], n[t], OKTOPK_FLOAT32, &req[t]));
  for (int t = T - 1; t >= 0; t--) { /* waiting out of order is fine */
    oktopk_stats_t st = {.size = sizeof st};
    OK(oktopk_wait(req[t], &st));
    OK(oktopk_test(req[t]));
    OK(oktopk_request_free(req[t]));
    EXPECT(oktopk_request_free(req[t]), oktopkInvalidUsage);
  }
  for (int t = 0; t < T; t++) {
    REQUIRE(memcmp(blocking[t], async[t], n[t] * sizeof(float)) == 0);
    free(blocking[t]);
    free(async[t]);
  }
  printf("HASH sparse_async %016llx\n", (unsigned long long)h);
}

/* Tensor state round trip: save tensor 100's state, run one more step on it
 * and on a copy loaded into tensor 300: both results are bitwise equal. */
static void test_tensor_state(oktopk_comm_t comm, int rank) {
  size_t sz = 0;
  OK(oktopk_tensor_state_size(comm, 100, &sz));
  void *buf = malloc(sz);
  EXPECT(oktopk_tensor_state_save(comm, 100, buf, sz - 1), oktopkInvalidArgument);
  OK(oktopk_tensor_state_save(comm, 100, buf, sz));
  OK(oktopk_tensor_state_load(comm, 300, buf, sz));
  size_t n = 3000;
  float *a = malloc(n * 4), *b = malloc(n * 4);
  fill_gradient(a, n, rank, 99);
  memcpy(b, a, n * 4);
  OK(oktopk_sparse_allreduce(comm, 100, a, n, OKTOPK_FLOAT32, NULL));
  OK(oktopk_sparse_allreduce(comm, 300, b, n, OKTOPK_FLOAT32, NULL));
  REQUIRE(memcmp(a, b, n * 4) == 0);
  free(a);
  free(b);
  free(buf);
}

/* Folding a residual before a caller's own dense allreduce: after a sparse
 * call at 1%, data + residual is the same sum before and after the fold,
 * and the residual is empty outside the held range, which keeps its own;
 * the dense allreduce of the folded buffers then averages exactly what the
 * ranks had not sent. Bad arguments are refused, the buffer untouched. */
static void test_residual_fold(oktopk_comm_t comm, int rank) {
  size_t n = 4096, hold[2] = {100, 200};
  float *g = malloc(n * 4), *x = malloc(n * 4), *r0 = malloc(n * 4), *r1 = malloc(n * 4);
  fill_gradient(g, n, rank, 7);
  OK(oktopk_sparse_allreduce(comm, 400, g, n, OKTOPK_FLOAT32, NULL));
  size_t sz = 0;
  OK(oktopk_tensor_state_size(comm, 400, &sz));
  char *state = malloc(sz);
  OK(oktopk_tensor_state_save(comm, 400, state, sz));
  memcpy(r0, state + sz - n * 4, n * 4); /* the residual is the state's last n floats */
  fill_gradient(x, n, rank, 8);
  memcpy(g, x, n * 4);
  EXPECT(oktopk_tensor_residual_fold(comm, 400, NULL, n, OKTOPK_FLOAT32, NULL, 0), oktopkInvalidArgument);
  EXPECT(oktopk_tensor_residual_fold(comm, 400, x, n - 1, OKTOPK_FLOAT32, NULL, 0), oktopkInvalidArgument);
  EXPECT(oktopk_tensor_residual_fold(comm, 400, x, n, OKTOPK_FLOAT32, (size_t[]){5, 5}, 1), oktopkInvalidArgument);
  REQUIRE(memcmp(x, g, n * 4) == 0);
  OK(oktopk_tensor_residual_fold(comm, 400, x, n, OKTOPK_FLOAT32, hold, 1));
  OK(oktopk_tensor_state_save(comm, 400, state, sz));
  memcpy(r1, state + sz - n * 4, n * 4);
  int nonzero = 0;
  for (size_t i = 0; i < n; i++) {
    int held = i >= hold[0] && i < hold[1];
    REQUIRE(x[i] == (held ? g[i] : g[i] + r0[i]));
    REQUIRE(r1[i] == (held ? r0[i] : 0.0f));
    nonzero += r0[i] != 0.0f;
  }
  REQUIRE(nonzero > (int)(n / 4)); /* a third of the entries are non-zero; a 1% call left nearly all waiting */
  OK(oktopk_tensor_residual_fold(comm, 401, x, n, OKTOPK_FLOAT32, NULL, 0)); /* no state: nothing to fold */
  OK(oktopk_allreduce(comm, x, n, OKTOPK_FLOAT32, 1, OKTOPK_ALGO_DENSE_RING));
  /* Had that sum come out NaN (a NaN on any rank: the step skipped), the
   * unfold puts the residual back as it was before the fold, bit for bit. */
  OK(oktopk_tensor_residual_unfold(comm, 400));
  OK(oktopk_tensor_state_save(comm, 400, state, sz));
  REQUIRE(memcmp(state + sz - n * 4, r0, n * 4) == 0);
  OK(oktopk_tensor_residual_unfold(comm, 400)); /* nothing left to undo */
  OK(oktopk_tensor_residual_unfold(comm, 401)); /* no state */
  free(g);
  free(x);
  free(r0);
  free(r1);
  free(state);
}

/* Taking a call back (0.13): after an undoable call the tensor's state is
 * again bitwise the one saved before it, a second undo changes nothing, and
 * the next call gives what it gives without the undone one; a call made
 * without OKTOPK_CALL_UNDOABLE cannot be taken back. */
static void test_undo_call(oktopk_comm_t comm, int rank) {
  size_t n = 4096, sz = 0;
  float *g = malloc(n * 4), *x = malloc(n * 4), *y = malloc(n * 4);
  oktopk_call_options_t undoable = {.size = sizeof undoable, .flags = OKTOPK_CALL_UNDOABLE};
  fill_gradient(g, n, rank, 9);
  OK(oktopk_sparse_allreduce_ex(comm, 500, g, n, OKTOPK_FLOAT32, &undoable, NULL));
  OK(oktopk_tensor_state_size(comm, 500, &sz));
  char *before = malloc(sz), *after = malloc(sz);
  OK(oktopk_tensor_state_save(comm, 500, before, sz));
  OK(oktopk_tensor_state_load(comm, 501, before, sz)); /* a twin that never makes the undone call */
  fill_gradient(x, n, rank, 10);
  OK(oktopk_sparse_allreduce_ex(comm, 500, x, n, OKTOPK_FLOAT32, &undoable, NULL));
  OK(oktopk_tensor_undo_call(comm, 500));
  OK(oktopk_tensor_state_save(comm, 500, after, sz));
  REQUIRE(memcmp(before, after, sz) == 0);
  OK(oktopk_tensor_undo_call(comm, 500)); /* nothing left to take back */
  OK(oktopk_tensor_state_save(comm, 500, after, sz));
  REQUIRE(memcmp(before, after, sz) == 0);
  fill_gradient(x, n, rank, 11);
  memcpy(y, x, n * 4);
  OK(oktopk_sparse_allreduce(comm, 500, x, n, OKTOPK_FLOAT32, NULL));
  OK(oktopk_sparse_allreduce(comm, 501, y, n, OKTOPK_FLOAT32, NULL));
  REQUIRE(memcmp(x, y, n * 4) == 0);
  EXPECT(oktopk_tensor_undo_call(comm, 500), oktopkInvalidUsage); /* that call was not undoable */
  OK(oktopk_tensor_undo_call(comm, 502)); /* no state */
  /* Reading the residual (0.14) gives what a fold into zeros gives, and
   * changes nothing; a tensor without state reads as zeros. */
  OK(oktopk_tensor_state_save(comm, 500, before, sz));
  OK(oktopk_tensor_residual_read(comm, 500, x, n));
  OK(oktopk_tensor_state_save(comm, 500, after, sz));
  REQUIRE(memcmp(before, after, sz) == 0);
  memset(y, 0, n * 4);
  OK(oktopk_tensor_residual_fold(comm, 500, y, n, OKTOPK_FLOAT32, NULL, 0));
  OK(oktopk_tensor_residual_unfold(comm, 500));
  REQUIRE(memcmp(x, y, n * 4) == 0);
  int nonzero = 0;
  for (size_t i = 0; i < n; i++) nonzero += x[i] != 0;
  REQUIRE(nonzero > 0); /* a residual to read: the comparison checks something */
  EXPECT(oktopk_tensor_residual_read(comm, 500, x, n - 1), oktopkInvalidArgument);
  /* Its zero entries (0.15): marked exactly where the read holds 0; with
   * earlier marks, those not marked then listed ascending, counted as
   * snprintf counts where the room is short; nothing changes. */
  uint8_t *zero = malloc(n), *before_marks = malloc(n);
  int64_t *became = malloc(n * sizeof *became);
  size_t count = 1, zeros = 0;
  OK(oktopk_tensor_residual_zeros(comm, 500, n, NULL, zero, NULL, 0, &count));
  REQUIRE(count == 0);
  for (size_t i = 0; i < n; i++) {
    REQUIRE(zero[i] == (x[i] == 0));
    zeros += zero[i];
    before_marks[i] = (uint8_t)(i % 2); /* as if every odd entry had left before */
  }
  REQUIRE(zeros > 0 && zeros < n);
  OK(oktopk_tensor_residual_zeros(comm, 500, n, before_marks, zero, became, n, &count));
  size_t want = 0;
  for (size_t i = 0; i < n; i++)
    if (x[i] == 0 && i % 2 == 0) REQUIRE(want < count && became[want++] == (int64_t)i);
  REQUIRE(count == want && want > 0);
  size_t short_count = 0;
  became[1] = -1;
  OK(oktopk_tensor_residual_zeros(comm, 500, n, before_marks, zero, became, 1, &short_count));
  REQUIRE(short_count == count && became[1] == -1);
  OK(oktopk_tensor_state_save(comm, 500, after, sz));
  REQUIRE(memcmp(before, after, sz) == 0);
  EXPECT(oktopk_tensor_residual_zeros(comm, 500, n - 1, NULL, zero, NULL, 0, &count), oktopkInvalidArgument);
  EXPECT(oktopk_tensor_residual_zeros(comm, 500, n, NULL, NULL, NULL, 0, &count), oktopkInvalidArgument);
  EXPECT(oktopk_tensor_residual_zeros(comm, 500, n, before_marks, zero, became, n, NULL), oktopkInvalidArgument);
  free(zero);
  free(before_marks);
  free(became);
  x[0] = 1;
  OK(oktopk_tensor_residual_read(comm, 502, x, n));
  REQUIRE(x[0] == 0);
  free(g);
  free(x);
  free(y);
  free(before);
  free(after);
}

/* A state belongs to one rank of a communicator of one size: rank 0's state
 * loaded on another rank, or any rank's state loaded into a communicator of
 * another size, is refused at load, with a message that says so once (no
 * repeated "oktopk: invalid argument:"). */
static void test_tensor_state_of_another_rank_or_size(oktopk_comm_t comm, int rank, int size) {
  size_t sz = 0;
  OK(oktopk_tensor_state_size(comm, 100, &sz));
  char *mine = malloc(sz), *rank0 = malloc(sz);
  OK(oktopk_tensor_state_save(comm, 100, mine, sz));
  memcpy(rank0, mine, sz);
  broadcast_bytes(comm, rank, rank0, sz);
  char msg[512];
  if (rank != 0) {
    EXPECT(oktopk_tensor_state_load(comm, 301, rank0, sz), oktopkInvalidArgument);
    OK(oktopk_get_last_error(comm, msg, sizeof msg, NULL));
    REQUIRE(strstr(msg, "saved by rank 0") != NULL);
    REQUIRE(strstr(msg, "oktopk: invalid argument: ") == msg && strstr(msg + 1, "oktopk:") == NULL);
    EXPECT(oktopk_tensor_state_size(comm, 301, &(size_t){0}), oktopkInvalidArgument); /* nothing installed */
  }
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  oktopk_unique_id_t id;
  oktopk_comm_t alone;
  OK(oktopk_get_unique_id(&id, &cfg));
  OK(oktopk_comm_init_rank(&alone, 1, &id, 0, &cfg));
  if (size != 1) {
    EXPECT(oktopk_tensor_state_load(alone, 100, mine, sz), oktopkInvalidArgument);
    OK(oktopk_get_last_error(alone, msg, sizeof msg, NULL));
    char want[64];
    snprintf(want, sizeof want, "communicator of %d ranks, this one has 1", size);
    REQUIRE(strstr(msg, want) != NULL);
    REQUIRE(strstr(msg + 1, "oktopk:") == NULL);
  }
  OK(oktopk_comm_destroy(alone));
  free(mine);
  free(rank0);
}

/* half-precision encodings of small integers and halves (exact in both). */
static uint16_t to_half(float v, int dt) {
  uint32_t bits;
  memcpy(&bits, &v, 4);
  if (dt == OKTOPK_BFLOAT16) return (uint16_t)(bits >> 16);
  uint32_t sign = (bits >> 16) & 0x8000, exp = (bits >> 23) & 0xff, mant = bits & 0x7fffff;
  return v == 0 ? (uint16_t)sign : (uint16_t)(sign | ((exp - 112) << 10) | (mant >> 13));
}

static float from_half(uint16_t h, int dt) {
  uint32_t bits;
  if (dt == OKTOPK_BFLOAT16) {
    bits = (uint32_t)h << 16;
  } else {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    bits = exp == 0 ? sign : (sign | ((exp + 112) << 23) | (mant << 13));
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* Sparse in, sparse out at the largest n (2^32 - 1) with 4 pairs per rank,
 * on a communicator of the given algorithm: the call must cost in proportion
 * to the pairs, not to n (an array over n, or over one rank's region of it,
 * takes seconds and gigabytes), so it must finish in well under a second.
 * Rank r sends index 0, its own index r + 1, n / 2 and n - 1; the result is
 * their union with the average of the contributions, exactly. */
static void test_sparse_in_largest_n(oktopk_comm_t comm, int rank, int size, int alg) {
  const size_t n = 4294967295u;
  const uint32_t in_idx[4] = {0, (uint32_t)rank + 1, (uint32_t)(n / 2), (uint32_t)(n - 1)};
  const float in_val[4] = {1, (float)(rank + 1), 2, (float)rank};
  enum { CAP = 64 };
  uint32_t out_idx[CAP];
  float out_val[CAP];
  size_t out_count = 0;
  float one = 1; /* a barrier first, so the time below is this call's alone */
  OK(oktopk_allreduce(comm, &one, 1, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  double t0 = now();
  OK(oktopk_sparse_allreduce_sparse(comm, n, in_idx, in_val, 4, out_idx, out_val, CAP, &out_count, NULL));
  double elapsed = now() - t0;
  if (elapsed >= 0.5) {
    fprintf(stderr, "rank %d: algorithm %d: sparse-in call at n = 2^32 - 1 took %.3f s, want < 0.5 s\n", rank, alg, elapsed);
    exit(1);
  }
  REQUIRE(out_count == (size_t)size + 3);
  REQUIRE(out_idx[0] == 0 && out_val[0] == (float)size / (float)size);
  for (int r = 0; r < size; r++) REQUIRE(out_idx[1 + r] == (uint32_t)r + 1 && out_val[1 + r] == (float)(r + 1) / (float)size);
  REQUIRE(out_idx[size + 1] == (uint32_t)(n / 2) && out_val[size + 1] == (float)(2 * size) / (float)size);
  REQUIRE(out_idx[size + 2] == (uint32_t)(n - 1) && out_val[size + 2] == (float)(size * (size - 1) / 2) / (float)size);
  printf("HASH sparse_sparse_largest_n_alg%d %016llx\n", alg,
         (unsigned long long)hash_bytes(out_val, out_count * 4, hash_bytes(out_idx, out_count * 4, HASH_SEED)));
}

/* OKTOPK_ALGO_AUTO on a communicator whose first auto call has measured the
 * link: every call's stats name a concrete algorithm (the same on every
 * rank: a HASH line) with a prediction; a re-measured link model is the
 * same on every rank; and dense auto allreduces sum exactly. */
static void test_auto(oktopk_comm_t comm, int rank, int size) {
  enum { N = 5000 };
  static float x[N];
  const size_t sizes[] = {1, 21, 1000, N};
  oktopk_stats_t st = {.size = sizeof st};
  for (int i = 0; i < 4; i++) {
    size_t n = sizes[i];
    for (size_t j = 0; j < n; j++) x[j] = (float)((rank + 1) * ((int)(j % 9) - 4));
    OK(oktopk_sparse_allreduce(comm, 100 + (uint64_t)i, x, n, OKTOPK_FLOAT32, &st));
    REQUIRE(st.algorithm >= OKTOPK_ALGO_DENSE_RING && st.algorithm < OKTOPK_ALGO_AUTO);
    REQUIRE(st.predicted_seconds > 0 && st.total_seconds > 0);
    printf("HASH auto_choice_%d %s\n", i, oktopk_algorithm_name(st.algorithm));
  }
  oktopk_link_model_t link = {.size = sizeof link};
  OK(oktopk_comm_measure_link(comm, &link));
  REQUIRE(link.latency_seconds > 0 && link.seconds_per_byte > 0 && link.pass_seconds_per_byte > 0);
  printf("HASH auto_link %016llx\n", (unsigned long long)hash_bytes(&link.latency_seconds, 3 * sizeof(double), HASH_SEED));
  oktopk_link_model_t bad = {.size = 2};
  EXPECT(oktopk_comm_measure_link(comm, &bad), oktopkInvalidArgument);
  /* The link kept (0.13): what the measurement agreed, and what a caller
   * sets instead (a resumed job's), read back bit for bit. */
  oktopk_link_model_t got = {.size = sizeof got};
  int measured = 0;
  OK(oktopk_comm_get_link(comm, &got, &measured));
  REQUIRE(measured == 1 && memcmp(&got.latency_seconds, &link.latency_seconds, 3 * sizeof(double)) == 0);
  oktopk_link_model_t set = {.size = sizeof set, .latency_seconds = 2e-4, .seconds_per_byte = 3e-9, .pass_seconds_per_byte = 1e-10};
  OK(oktopk_comm_set_link(comm, &set));
  OK(oktopk_comm_get_link(comm, &got, &measured));
  REQUIRE(measured == 1 && memcmp(&got.latency_seconds, &set.latency_seconds, 3 * sizeof(double)) == 0);
  oktopk_link_model_t nan_link = set;
  nan_link.seconds_per_byte = NAN;
  EXPECT(oktopk_comm_set_link(comm, &nan_link), oktopkInvalidArgument);
  EXPECT(oktopk_comm_set_link(comm, &bad), oktopkInvalidArgument);
  EXPECT(oktopk_comm_get_link(comm, &got, NULL), oktopkInvalidArgument);
  OK(oktopk_comm_set_link(comm, &link)); /* the measured one again, for what follows */
  float ones[3] = {1, 2, 3};
  OK(oktopk_allreduce(comm, ones, 3, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_AUTO));
  for (int j = 0; j < 3; j++) REQUIRE(ones[j] == (float)((j + 1) * size));
}

/* Every algorithm of the enum through oktopk_sparse_allreduce, on its own
 * communicator (the algorithm is a communicator setting), in float32,
 * float16 and bfloat16: at density 1.0 each must return the exact average
 * of integer-valued inputs (sums of small integers, and their halves and
 * quarters for P <= 4, are exact in every one of these precisions). */
/* The phase fields (0.4) cut the call into parts that run back to back:
 * none negative, balance inside allgather, together no more than the call
 * and (the few microseconds before the algorithm starts aside) most of it. */
static void check_phases(const oktopk_stats_t *st) {
  const double phases[] = {st->select_seconds, st->agree_seconds,  st->reduce_seconds,
                           st->global_select_seconds, st->allgather_seconds, st->output_seconds};
  double sum = 0;
  for (size_t i = 0; i < sizeof phases / sizeof phases[0]; i++) {
    REQUIRE(phases[i] >= 0);
    sum += phases[i];
  }
  REQUIRE(st->balance_seconds >= 0 && st->balance_seconds <= st->allgather_seconds);
  REQUIRE(st->total_seconds > 0);
  REQUIRE(sum <= st->total_seconds * (1 + 1e-9) && sum >= 0.5 * st->total_seconds); /* 1e-9: rounding to double */
}

static void test_sparse_every_algorithm(oktopk_comm_t env_comm, int rank, int size) {
  const size_t n = 1001;
  float *x = malloc(n * sizeof *x);
  uint16_t *h = malloc(n * sizeof *h);
  for (int alg = OKTOPK_ALGO_DENSE_RING; alg <= OKTOPK_ALGO_AUTO; alg++) {
    oktopk_config_t cfg;
    oktopk_config_init(&cfg);
    cfg.timeout_ms = 20000;
    cfg.density = 1.0;
    cfg.algorithm = alg;
    oktopk_comm_t comm = init_rank_by_id(env_comm, rank, size, &cfg);
    if (alg != OKTOPK_ALGO_DENSE_RING && alg != OKTOPK_ALGO_DENSE_RABENSEIFNER && alg != OKTOPK_ALGO_GAUSSIANK)
      test_sparse_in_largest_n(comm, rank, size, alg); /* the algorithms with a sparse-input form */
    float ranks_sum = (float)(size * (size + 1) / 2);
    for (int it = 0; it < 2; it++) {
      for (size_t i = 0; i < n; i++) x[i] = (float)((rank + 1) * ((int)((i + it) % 7) - 3));
      oktopk_stats_t st = {.size = sizeof st};
      OK(oktopk_sparse_allreduce(comm, 1, x, n, OKTOPK_FLOAT32, &st));
      check_phases(&st);
      for (size_t i = 0; i < n; i++) REQUIRE(x[i] == ranks_sum * (float)((int)((i + it) % 7) - 3) / (float)size);
    }
    printf("HASH sparse_f32_alg%d %016llx\n", alg, (unsigned long long)hash_bytes(x, n * 4, HASH_SEED));
    if (size <= 4) {
      for (int dt = OKTOPK_FLOAT16; dt <= OKTOPK_BFLOAT16; dt++) {
        for (size_t i = 0; i < n; i++) h[i] = to_half((float)((rank + 1) * ((int)(i % 5) - 2)), dt);
        OK(oktopk_sparse_allreduce(comm, 2 + (uint64_t)dt, h, n, (oktopk_dtype_t)dt, NULL));
        for (size_t i = 0; i < n; i++) REQUIRE(from_half(h[i], dt) == ranks_sum * (float)((int)(i % 5) - 2) / (float)size);
      }
    }
    if (alg == OKTOPK_ALGO_AUTO) test_auto(comm, rank, size);
    OK(oktopk_comm_destroy(comm));
  }
  free(h);
  free(x);
}

/* 16-bit values on the wire (config.value_dtype): the same gradient through
 * a float32 and a float16 communicator; the float16 one sends fewer bytes,
 * every rank ends with the same result (HASH), each result x P (exact for
 * P = 2, 4) is a float16 value, and the sparse-input call is refused there
 * (no residual to take its rounding error) while the communicator stays
 * usable. Then float16 | OKTOPK_STOCHASTIC_ROUNDING is accepted. */
static void test_float16_values(oktopk_comm_t env_comm, int rank, int size) {
  const size_t n = 4000;
  float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
  uint64_t bytes[2] = {0, 0};
  int dtypes[3] = {OKTOPK_FLOAT32, OKTOPK_FLOAT16, OKTOPK_FLOAT16 | OKTOPK_STOCHASTIC_ROUNDING};
  for (int c = 0; c < 3; c++) {
    oktopk_config_t cfg;
    oktopk_config_init(&cfg);
    cfg.timeout_ms = 20000;
    cfg.value_dtype = dtypes[c];
    oktopk_comm_t comm = init_rank_by_id(env_comm, rank, size, &cfg);
    for (size_t i = 0; i < n; i++) x[i] = sinf((float)(i * (size_t)(rank + 3))) * (float)(1 + i % 97);
    oktopk_stats_t st = {.size = sizeof st};
    OK(oktopk_sparse_allreduce(comm, 9, x, n, OKTOPK_FLOAT32, &st));
    if (c < 2) bytes[c] = st.bytes_sent;
    if (c == 1) {
      printf("HASH sparse_values_f16 %016llx\n", (unsigned long long)hash_bytes(x, n * 4, HASH_SEED));
      for (size_t i = 0; i < n && (size == 2 || size == 4); i++) {
        uint16_t h = to_half(x[i] * (float)size, OKTOPK_FLOAT16);
        REQUIRE(from_half(h, OKTOPK_FLOAT16) == x[i] * (float)size);
      }
      uint32_t in_idx[1] = {(uint32_t)rank}, out_idx[8];
      float in_val[1] = {1}, out_val[8];
      size_t out_count;
      EXPECT(oktopk_sparse_allreduce_sparse(comm, n, in_idx, in_val, 1, out_idx, out_val, 8, &out_count, NULL),
             oktopkInvalidArgument);
      for (size_t i = 0; i < n; i++) y[i] = 1;
      OK(oktopk_sparse_allreduce(comm, 9, y, n, OKTOPK_FLOAT32, NULL)); /* still usable */
    }
    OK(oktopk_comm_destroy(comm));
  }
  printf("rank %d: float16 values: %llu bytes sent, float32 values: %llu\n", rank, (unsigned long long)bytes[1],
         (unsigned long long)bytes[0]);
  REQUIRE(size == 1 || bytes[1] < bytes[0]);
  free(x);
  free(y);
}

/* Sparse in, sparse out on a density-1.0 communicator: each rank sends every
 * third index (shifted by its rank); the result is exactly the union of the
 * indices with the average of the contributions (absent ones count as 0). */
static void test_sparse_in_sparse_out(oktopk_comm_t comm, int rank, int size) {
  const size_t n = 3001;
  uint32_t *in_idx = malloc(n * sizeof *in_idx), *out_idx = malloc(n * sizeof *out_idx);
  float *in_val = malloc(n * sizeof *in_val), *out_val = malloc(n * sizeof *out_val);
  size_t in_count = 0;
  for (size_t i = 0; i < n; i++) {
    if ((i + (size_t)rank) % 3 != 0) continue;
    in_idx[in_count] = (uint32_t)i;
    in_val[in_count++] = (float)(rank + 1 + (int)(i % 4));
  }
  size_t out_count = 0;
  oktopk_stats_t st = {.size = sizeof st};
  OK(oktopk_sparse_allreduce_sparse(comm, n, in_idx, in_val, in_count, out_idx, out_val, n, &out_count, &st));
  size_t j = 0;
  for (size_t i = 0; i < n; i++) {
    float sum = 0;
    int any = 0;
    for (int r = 0; r < size; r++) {
      if ((i + (size_t)r) % 3 != 0) continue;
      sum += (float)(r + 1 + (int)(i % 4));
      any = 1;
    }
    if (!any) continue;
    REQUIRE(j < out_count);
    REQUIRE(out_idx[j] == i);
    REQUIRE(out_val[j] == sum / (float)size);
    j++;
  }
  REQUIRE(j == out_count);
  /* Too small an output buffer is refused. */
  EXPECT(oktopk_sparse_allreduce_sparse(comm, n, in_idx, in_val, in_count, out_idx, out_val, out_count - 1, &out_count, NULL),
         oktopkInvalidArgument);
  printf("HASH sparse_sparse %016llx\n", (unsigned long long)hash_bytes(out_val, out_count * 4, HASH_SEED));
  free(in_idx);
  free(out_idx);
  free(in_val);
  free(out_val);
}

/* The caller-selected call from C, as a trainer that selects on its own
 * device would make it: here every call is exact (tau' = 1), so the
 * selection is oktopk_topk of acc = gradient + residual, the threshold the
 * (k+1)-th largest |acc|. Its results and residual, and its checkpoint, are
 * the dense-input call's bit for bit; the checkpoint loads back with the
 * residual handed to the caller. */
static void test_caller_selected(oktopk_comm_t env_comm, int rank, int size) {
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.algorithm = OKTOPK_ALGO_OKTOPK;
  cfg.density = 0.02;
  cfg.tau = 2;
  cfg.tau_prime = 1;
  cfg.timeout_ms = 20000;
  oktopk_comm_t comm = init_rank_by_id(env_comm, rank, size, &cfg);
  oktopk_selection_rules_t rules;
  oktopk_selection_rules(&rules);
  REQUIRE(rules.max_raises == 4 && rules.raise == 1.03f && rules.too_many == 4.0 / 3.0 && rules.too_few == 0.5);
  const size_t n = 5000;
  float *g = malloc(n * 4), *dense = malloc(n * 4), *res = calloc(n, 4), *acc = malloc(n * 4), *out = malloc(n * 4);
  size_t k = (size_t)(0.02 * n), cap = oktopk_selected_capacity(n, k, size);
  REQUIRE(cap == (size_t)size * (4 * k / 3) && cap <= n);
  uint32_t *idx = malloc((k + 1) * 4), *ri = malloc(cap * 4), *ci = malloc((k + 1) * 4), *ei = malloc(cap * 4);
  float *val = malloc((k + 1) * 4), *rv = malloc(cap * 4), *cv = malloc((k + 1) * 4), *ev = malloc(cap * 4);
  for (int step = 0; step < 5; step++) {
    fill_gradient(g, n, rank, 20 + step);
    memcpy(dense, g, n * 4);
    OK(oktopk_sparse_allreduce(comm, 500, dense, n, OKTOPK_FLOAT32, NULL));
    oktopk_selection_plan_t plan;
    OK(oktopk_selection_plan(comm, 501, n, NULL, &plan));
    REQUIRE(plan.k == k && plan.exact);
    for (size_t i = 0; i < n; i++) acc[i] = g[i] + res[i];
    OK(oktopk_topk(acc, n, k + 1, idx, val)); /* the (k+1)-th largest magnitude: the threshold */
    float th = INFINITY;
    for (size_t j = 0; j <= k; j++) th = fabsf(val[j]) < th ? fabsf(val[j]) : th;
    OK(oktopk_topk(acc, n, k, idx, val));
    oktopk_selected_t io = {.size = sizeof io, .indices = idx, .values = val, .count = k, .threshold = th,
                            .result_indices = ri, .result_values = rv, .result_capacity = cap,
                            .consumed_indices = ci, .consumed_values = cv, .consumed_capacity = k,
                            .error_indices = ei, .error_values = ev, .error_capacity = cap};
    OK(oktopk_sparse_allreduce_selected(comm, 501, n, OKTOPK_FLOAT32, NULL, &io, NULL));
    memcpy(res, acc, n * 4);
    for (size_t j = 0; j < io.consumed_count; j++) res[ci[j]] -= cv[j];
    for (size_t j = 0; j < io.error_count; j++) res[ei[j]] += ev[j];
    memset(out, 0, n * 4);
    for (size_t j = 0; j < io.result_count; j++) out[ri[j]] = rv[j];
    REQUIRE(memcmp(out, dense, n * 4) == 0);
    REQUIRE(io.result_count > 0 && io.consumed_count > 0 && io.error_count == 0);
  }
  size_t sz = 0, sz_selected = 0;
  OK(oktopk_tensor_state_size(comm, 500, &sz));
  OK(oktopk_tensor_state_size(comm, 501, &sz_selected));
  REQUIRE(sz == sz_selected);
  char *a = malloc(sz), *b = malloc(sz);
  OK(oktopk_tensor_state_save(comm, 500, a, sz));
  EXPECT(oktopk_tensor_state_save(comm, 501, b, sz), oktopkInvalidArgument); /* its residual is the caller's */
  OK(oktopk_tensor_state_save_residual(comm, 501, res, n, b, sz));
  REQUIRE(memcmp(a, b, sz) == 0);
  float *back = malloc(n * 4);
  OK(oktopk_tensor_state_load_residual(comm, 502, a, sz, back, n));
  REQUIRE(memcmp(back, res, n * 4) == 0);
  EXPECT(oktopk_tensor_state_load_residual(comm, 502, a, sz, back, n - 1), oktopkInvalidArgument);
  OK(oktopk_comm_destroy(comm));
  free(g), free(dense), free(res), free(acc), free(out), free(idx), free(val), free(ri), free(rv), free(ci), free(cv), free(ei), free(ev);
  free(a), free(b), free(back);
}

static int run_ranks(void) {
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.density = 1.0;
  cfg.timeout_ms = 20000;
  oktopk_comm_t env_comm;
  OK(oktopk_comm_init_env(&env_comm, &cfg));
  int rank, size;
  note_rank(env_comm, &rank, &size);
  REQUIRE(rank == atoi(getenv("RANK")) && size == atoi(getenv("WORLD_SIZE")));

  test_dense(env_comm, rank, size);
  test_sparse_full_density(env_comm, rank, size);
  test_call_options(env_comm, rank);
  test_sparse_in_sparse_out(env_comm, rank, size);
  test_sparse_every_algorithm(env_comm, rank, size);
  test_float16_values(env_comm, rank, size);
  test_caller_selected(env_comm, rank, size);

  /* A second communicator, NCCL style: rank 0 makes the id, hands it out. */
  oktopk_config_init(&cfg);
  cfg.timeout_ms = 20000;
  oktopk_comm_t id_comm = init_rank_by_id(env_comm, rank, size, &cfg);

  /* A third, two-step: token from rank 0, bind, gather endpoints, connect. */
  char token[128] = {0};
  if (rank == 0) OK(oktopk_make_token(token, sizeof token));
  broadcast_bytes(env_comm, rank, token, sizeof token);
  char endpoint[256];
  oktopk_comm_t bound;
  OK(oktopk_comm_bind(&bound, size, rank, token, &cfg, endpoint, sizeof endpoint));
  char *all = calloc((size_t)size, 256);
  for (int r = 0; r < size; r++) {
    char slot[256] = {0};
    if (r == rank) strcpy(slot, endpoint);
    /* each rank in turn acts as "rank 0" of the broadcast */
    float f[256];
    for (int i = 0; i < 256; i++) f[i] = r == rank ? (float)(unsigned char)slot[i] : 0.0f;
    OK(oktopk_allreduce(env_comm, f, 256, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
    for (int i = 0; i < 256; i++) all[r * 256 + i] = (char)(unsigned char)f[i];
  }
  const char *eps[64];
  for (int r = 0; r < size; r++) eps[r] = all + r * 256;
  OK(oktopk_comm_connect(bound, eps, size));
  test_dense(bound, rank, size);

  test_sparse_async(id_comm, rank);
  test_tensor_state(id_comm, rank);
  test_residual_fold(id_comm, rank);
  test_undo_call(id_comm, rank);
  test_tensor_state_of_another_rank_or_size(id_comm, rank, size);

  OK(oktopk_comm_destroy(bound));
  OK(oktopk_comm_destroy(id_comm));
  OK(oktopk_comm_destroy(env_comm));
  free(all);
  printf("rank %d of %d: ok\n", rank, size);
  return 0;
}

/* ------------------------------------------------------------------------ */

struct two_ranks {
  oktopk_comm_t comm[2];
  char ep[2][256]; /* each rank's endpoint */
};

struct connect_arg {
  oktopk_comm_t comm;
  const char **eps;
  oktopk_result_t result;
};

static void *connect_thread(void *p) {
  struct connect_arg *a = p;
  a->result = oktopk_comm_connect(a->comm, a->eps, 2);
  return NULL;
}

/* Two ranks of one communicator in this one process, on their own threads. */
static struct two_ranks make_two_ranks(int timeout_ms) {
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = timeout_ms;
  char token[128];
  struct two_ranks t;
  OK(oktopk_make_token(token, sizeof token));
  for (int r = 0; r < 2; r++) OK(oktopk_comm_bind(&t.comm[r], 2, r, token, &cfg, t.ep[r], sizeof t.ep[r]));
  const char *eps[2] = {t.ep[0], t.ep[1]};
  struct connect_arg a[2] = {{t.comm[0], eps, 0}, {t.comm[1], eps, 0}};
  pthread_t th;
  pthread_create(&th, NULL, connect_thread, &a[1]);
  connect_thread(&a[0]);
  pthread_join(th, NULL);
  OK(a[0].result);
  OK(a[1].result);
  return t;
}

struct abort_arg {
  oktopk_comm_t comm;
  double delay;
};

static void *abort_later(void *p) {
  struct abort_arg *a = p;
  usleep((useconds_t)(a->delay * 1e6));
  OK(oktopk_comm_abort(a->comm));
  return NULL;
}

static void test_abort_unblocks(void) {
  struct two_ranks t = make_two_ranks(30000);
  /* Rank 1 never joins: rank 0's call blocks until the abort. */
  float x[64] = {0};
  struct abort_arg a = {t.comm[0], 0.3};
  pthread_t th;
  pthread_create(&th, NULL, abort_later, &a);
  double t0 = now();
  EXPECT(oktopk_allreduce(t.comm[0], x, 64, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), oktopkAborted);
  double blocked = now() - t0;
  pthread_join(th, NULL);
  printf("abort: blocked call returned %.3f s after its start (abort at 0.300 s)\n", blocked);
  REQUIRE(blocked < 0.3 + 1.0);
  /* Every later call fails fast too, and the handle must still be destroyed. */
  EXPECT(oktopk_allreduce(t.comm[0], x, 64, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), oktopkAborted);
  char msg[256];
  OK(oktopk_get_last_error(t.comm[0], msg, sizeof msg, NULL));
  REQUIRE(strstr(msg, "abort") != NULL);
  OK(oktopk_comm_destroy(t.comm[0]));
  OK(oktopk_comm_destroy(t.comm[1]));
}

struct dtype_arg {
  oktopk_comm_t comm;
  void *x;
  oktopk_dtype_t dtype;
  oktopk_result_t result;
};

static void *sparse_dtype_thread(void *p) {
  struct dtype_arg *a = p;
  a->result = oktopk_sparse_allreduce(a->comm, 5, a->x, 64, a->dtype, NULL);
  return NULL;
}

/* Two ranks pass the same tensor in different dtypes: both learn it is a
 * mismatch (the dtype travels in every frame), neither gets data. */
static void test_dtype_mismatch(void) {
  struct two_ranks t = make_two_ranks(10000);
  float x[64];
  uint16_t h[64];
  for (int i = 0; i < 64; i++) {
    x[i] = (float)i;
    h[i] = to_half((float)i, OKTOPK_FLOAT16);
  }
  struct dtype_arg a = {t.comm[1], h, OKTOPK_FLOAT16, 0};
  pthread_t th;
  pthread_create(&th, NULL, sparse_dtype_thread, &a);
  oktopk_result_t r0 = oktopk_sparse_allreduce(t.comm[0], 5, x, 64, OKTOPK_FLOAT32, NULL);
  pthread_join(th, NULL);
  printf("dtype mismatch: rank 0 %s, rank 1 %s\n", oktopk_get_error_string(r0), oktopk_get_error_string(a.result));
  REQUIRE(r0 == oktopkMismatch && a.result == oktopkMismatch);
  for (int i = 0; i < 64; i++) REQUIRE(x[i] == (float)i && h[i] == to_half((float)i, OKTOPK_FLOAT16));
  OK(oktopk_comm_destroy(t.comm[0]));
  OK(oktopk_comm_destroy(t.comm[1]));
}

/* Rank 1 of a two-rank communicator, for the refusal test: one agreed
 * call, one refused for a NULL buffer, then a valid one that must fail. */
struct refusal_arg {
  oktopk_comm_t comm;
  oktopk_result_t refused, after;
};

static void *refusing_rank(void *p) {
  struct refusal_arg *a = p;
  float x[64];
  for (int i = 0; i < 64; i++) x[i] = (float)i;
  OK(oktopk_sparse_allreduce(a->comm, 3, x, 64, OKTOPK_FLOAT32, NULL));
  a->refused = oktopk_sparse_allreduce(a->comm, 3, NULL, 64, OKTOPK_FLOAT32, NULL);
  a->after = oktopk_sparse_allreduce(a->comm, 3, x, 64, OKTOPK_FLOAT32, NULL);
  return NULL;
}

/* A call refused at the C ABI on one rank only (a NULL buffer) still takes
 * its place in the call sequence and tells the peer: rank 0's call fails
 * with oktopkMismatch naming rank 1, the call and the reason, and rank 1's
 * next call fails too. (Before, rank 1's next call met rank 0's call and
 * both returned success.) */
static void test_refusal_reaches_peer(void) {
  struct two_ranks t = make_two_ranks(10000);
  struct refusal_arg a = {t.comm[1], 0, 0};
  pthread_t th;
  pthread_create(&th, NULL, refusing_rank, &a);
  float x[64];
  for (int i = 0; i < 64; i++) x[i] = (float)i;
  OK(oktopk_sparse_allreduce(t.comm[0], 3, x, 64, OKTOPK_FLOAT32, NULL));
  for (int i = 0; i < 64; i++) x[i] = (float)i;
  double t0 = now();
  oktopk_result_t r0 = oktopk_sparse_allreduce(t.comm[0], 3, x, 64, OKTOPK_FLOAT32, NULL);
  double took = now() - t0;
  char msg[512];
  OK(oktopk_get_last_error(t.comm[0], msg, sizeof msg, NULL));
  pthread_join(th, NULL);
  printf("refusal on rank 1: rank 0 %s after %.3f s (%s); rank 1 %s, then %s\n", oktopk_get_error_string(r0), took, msg,
         oktopk_get_error_string(a.refused), oktopk_get_error_string(a.after));
  REQUIRE(r0 == oktopkMismatch && took < 5.0);
  REQUIRE(strstr(msg, "rank 1 refused call 2: invalid argument: data is NULL") != NULL);
  REQUIRE(a.refused == oktopkInvalidArgument);
  REQUIRE(a.after != oktopkSuccess);
  for (int i = 0; i < 64; i++) REQUIRE(x[i] == (float)i); /* the failed call left the buffer alone */
  OK(oktopk_comm_destroy(t.comm[0]));
  OK(oktopk_comm_destroy(t.comm[1]));
}

/* Rank 1 of the concurrency test, on one thread: starts late, then makes
 * three sparse calls and two dense ones, as rank 0's threads do in turn. */
struct steady_arg {
  oktopk_comm_t comm;
  float x[3][64];
  float d[2][8];
};

static void *steady_rank(void *p) {
  struct steady_arg *a = p;
  usleep(400000); /* rank 0's first call waits for this rank meanwhile */
  for (int c = 0; c < 3; c++) OK(oktopk_sparse_allreduce(a->comm, 4, a->x[c], 64, OKTOPK_FLOAT32, NULL));
  usleep(300000); /* rank 0's requests stay queued meanwhile */
  for (int c = 0; c < 2; c++) OK(oktopk_allreduce(a->comm, a->d[c], 8, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  return NULL;
}

struct thread_call_arg {
  oktopk_comm_t comm;
  float *x;
  oktopk_request_t req;
  oktopk_result_t result;
  double took;
};

static void *sparse_call_thread(void *p) {
  struct thread_call_arg *a = p;
  double t0 = now();
  a->result = oktopk_sparse_allreduce(a->comm, 4, a->x, 64, OKTOPK_FLOAT32, NULL);
  a->took = now() - t0;
  return NULL;
}

static void *dense_call_thread(void *p) {
  struct thread_call_arg *a = p;
  double t0 = now();
  a->result = oktopk_allreduce(a->comm, a->x, 8, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING);
  a->took = now() - t0;
  return NULL;
}

static void *wait_thread(void *p) {
  struct thread_call_arg *a = p;
  a->result = oktopk_wait(a->req, NULL);
  return NULL;
}

/* Two threads on one communicator: while thread A's call runs, thread B's
 * call on the same tensor is refused at once with oktopkInvalidUsage and
 * takes no sequence number (A's call, and B's call made after A's returned,
 * meet rank 1's first and second calls, bitwise). While one thread's
 * asynchronous requests are queued another thread's call is refused too;
 * any thread may wait on them. (Before, B's call was queued behind A's and
 * met whichever call rank 1 made next.) */
static void test_concurrent_threads(void) {
  struct two_ranks t = make_two_ranks(10000);
  struct steady_arg r1;
  float x[3][64];
  for (int c = 0; c < 3; c++)
    for (int i = 0; i < 64; i++) {
      x[c][i] = (float)((i * (c + 3)) % 11) - 5;
      r1.x[c][i] = (float)((i * (c + 5)) % 13) - 6;
    }
  for (int c = 0; c < 2; c++)
    for (int i = 0; i < 8; i++) r1.d[c][i] = (float)(100 * (c + 1) + i);
  r1.comm = t.comm[1];
  pthread_t th1, tha, thb;
  pthread_create(&th1, NULL, steady_rank, &r1);
  float bx[64];
  memcpy(bx, x[2], sizeof bx);
  struct thread_call_arg a = {t.comm[0], x[0], 0, 0, 0}, b = {t.comm[0], bx, 0, 0, 0};
  pthread_create(&tha, NULL, sparse_call_thread, &a);
  usleep(100000);
  pthread_create(&thb, NULL, sparse_call_thread, &b);
  pthread_join(thb, NULL);
  char msg[512];
  OK(oktopk_get_last_error(t.comm[0], msg, sizeof msg, NULL));
  printf("concurrent call on another thread: %s after %.3f s (%s)\n", oktopk_get_error_string(b.result), b.took, msg);
  REQUIRE(b.result == oktopkInvalidUsage && b.took < 0.2);
  REQUIRE(strstr(msg, "another thread") != NULL);
  REQUIRE(memcmp(bx, x[2], sizeof bx) == 0); /* the refused call left its buffer alone */
  pthread_join(tha, NULL);
  OK(a.result);
  /* One call after the other from two threads is fine: this thread now. */
  OK(oktopk_sparse_allreduce(t.comm[0], 4, x[1], 64, OKTOPK_FLOAT32, NULL));
  OK(oktopk_sparse_allreduce(t.comm[0], 4, x[2], 64, OKTOPK_FLOAT32, NULL));
  /* Asynchronous requests of this thread, then a call of another thread
   * while they are queued (rank 1 is late), which waits on one of them. */
  float d[2][8];
  for (int c = 0; c < 2; c++)
    for (int i = 0; i < 8; i++) d[c][i] = (float)(c + 1);
  oktopk_request_t req[2];
  for (int c = 0; c < 2; c++)
    OK(oktopk_allreduce_start(t.comm[0], d[c], 8, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING, &req[c]));
  float other[8] = {0};
  struct thread_call_arg o = {t.comm[0], other, 0, 0, 0}, w = {t.comm[0], NULL, req[0], 0, 0};
  pthread_create(&thb, NULL, dense_call_thread, &o);
  pthread_join(thb, NULL);
  REQUIRE(o.result == oktopkInvalidUsage && o.took < 0.2);
  pthread_create(&thb, NULL, wait_thread, &w);
  pthread_join(thb, NULL);
  OK(w.result);
  OK(oktopk_wait(req[1], NULL));
  for (int c = 0; c < 2; c++) OK(oktopk_request_free(req[c]));
  pthread_join(th1, NULL);
  /* Rank 0's three sparse calls met rank 1's three, in order. */
  for (int c = 0; c < 3; c++) REQUIRE(memcmp(x[c], r1.x[c], sizeof x[c]) == 0);
  for (int c = 0; c < 2; c++)
    for (int i = 0; i < 8; i++) REQUIRE(d[c][i] == (float)(c + 1) + (float)(100 * (c + 1) + i) && r1.d[c][i] == d[c][i]);
  OK(oktopk_comm_destroy(t.comm[0]));
  OK(oktopk_comm_destroy(t.comm[1]));
}

/* 4096 requests outstanding (rank 1 never calls, so none completes): one
 * more is refused with oktopkInvalidUsage and aborts the communicator, so
 * the queued requests fail at once instead of this rank skipping a call its
 * peers will make. */
static void test_too_many_outstanding(void) {
  enum { MAX = 4096 };
  struct two_ranks t = make_two_ranks(30000);
  static float x[MAX + 1][2];
  static oktopk_request_t req[MAX];
  for (int i = 0; i < MAX; i++)
    OK(oktopk_allreduce_start(t.comm[0], x[i], 2, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING, &req[i]));
  oktopk_request_t extra;
  EXPECT(oktopk_allreduce_start(t.comm[0], x[MAX], 2, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING, &extra),
         oktopkInvalidUsage);
  double t0 = now();
  for (int i = 0; i < MAX; i++) {
    EXPECT(oktopk_wait(req[i], NULL), oktopkAborted);
    OK(oktopk_request_free(req[i]));
  }
  printf("request %d: refused; the %d queued ones aborted within %.3f s\n", MAX + 1, MAX, now() - t0);
  REQUIRE(now() - t0 < 5.0);
  OK(oktopk_comm_destroy(t.comm[0]));
  OK(oktopk_comm_destroy(t.comm[1]));
}

static void test_destroy_after_peer_died(void) {
  struct two_ranks t = make_two_ranks(30000);
  OK(oktopk_comm_destroy(t.comm[1])); /* the peer is gone */
  float x[64] = {0};
  oktopk_request_t req;
  OK(oktopk_allreduce_start(t.comm[0], x, 64, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING, &req));
  usleep(100000);
  double t0 = now();
  OK(oktopk_comm_destroy(t.comm[0]));
  double took = now() - t0;
  printf("destroy with a dead peer and a blocked request: %.3f s\n", took);
  REQUIRE(took < 1.0);
  oktopk_result_t r = oktopk_wait(req, NULL);
  REQUIRE(r == oktopkAborted || r == oktopkRemoteError);
  OK(oktopk_request_free(req));
}

struct allreduce_arg {
  oktopk_comm_t comm;
  float *x;
  size_t n;
  oktopk_result_t result;
};

static void *allreduce_thread(void *p) {
  struct allreduce_arg *a = p;
  a->result = oktopk_allreduce(a->comm, a->x, a->n, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING);
  return NULL;
}

/* A stranger without the job token: connects to the host:port of endpoint
 * ("tcp://a.b.c.d:port..."), sends a ZMTP 3.0 greeting and READY as a NULL
 * client would, then zero bytes (an empty frame every two bytes) until
 * `seconds` have passed or the rank has closed the connection. */
struct flood_arg {
  const char *endpoint;
  double seconds;
};

static void *flood_thread(void *p) {
  const struct flood_arg *a = p;
  char host[64];
  int port;
  REQUIRE(sscanf(a->endpoint, "tcp://%63[0-9.]:%d", host, &port) == 2);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  REQUIRE(inet_pton(AF_INET, host, &sa.sin_addr) == 1);
  REQUIRE(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
  struct timeval tv = {0, 100000};
  REQUIRE(setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) == 0);
  unsigned char opening[64 + 30] = {0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0, 'N', 'U', 'L', 'L'};
  static const unsigned char ready[30] = {0x04, 28,  5,   'R', 'E', 'A', 'D', 'Y', 11,  'S',
                                          'o',  'c', 'k', 'e', 't', '-', 'T', 'y', 'p', 'e',
                                          0,    0,   0,   6,   'D', 'E', 'A', 'L', 'E', 'R'};
  memcpy(opening + 64, ready, sizeof ready);
  static unsigned char zeros[1 << 16];
  const unsigned char *next = opening;
  size_t len = sizeof opening;
  double t0 = now();
  /* MSG_NOSIGNAL: a connection the rank has closed must not raise SIGPIPE. */
  while (now() - t0 < a->seconds && send(fd, next, len, MSG_NOSIGNAL) >= 0) {
    next = zeros;
    len = sizeof zeros;
  }
  close(fd);
  return NULL;
}

/* Strangers flood rank 0's port (the attack that once made a rank queue 32
 * bytes per byte received, without bound): oktopk_comm_dropped counts their
 * connections as refused, the job still computes exactly, and destroy still
 * returns within its one second. */
static void test_flood_is_counted_and_destroy_stays_prompt(void) {
  struct two_ranks t = make_two_ranks(10000);
  uint64_t before, after;
  EXPECT(oktopk_comm_dropped(t.comm[0], NULL), oktopkInvalidArgument);
  OK(oktopk_comm_dropped(t.comm[0], &before));
  enum { strangers = 4 };
  struct flood_arg fa = {t.ep[0], 0.5};
  pthread_t th[strangers];
  for (int i = 0; i < strangers; i++) pthread_create(&th[i], NULL, flood_thread, &fa);
  for (int i = 0; i < strangers; i++) pthread_join(th[i], NULL);
  for (double waited = now();; usleep(10000)) {
    OK(oktopk_comm_dropped(t.comm[0], &after));
    if (after >= before + strangers || now() - waited > 2.0) break;
  }
  printf("flood: rank 0 refused %llu connections or frames\n", (unsigned long long)(after - before));
  REQUIRE(after >= before + strangers);
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  struct allreduce_arg a = {t.comm[1], y, 8, 0};
  pthread_t peer;
  pthread_create(&peer, NULL, allreduce_thread, &a);
  OK(oktopk_allreduce(t.comm[0], x, 8, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  pthread_join(peer, NULL);
  OK(a.result);
  REQUIRE(x[7] == 16 && y[7] == 16);
  for (int r = 0; r < 2; r++) {
    double t0 = now();
    OK(oktopk_comm_destroy(t.comm[r]));
    double took = now() - t0;
    printf("flood: rank %d destroyed in %.3f s\n", r, took);
    REQUIRE(took < 1.0);
  }
  EXPECT(oktopk_comm_dropped(t.comm[0], &after), oktopkInvalidUsage);
}

/* A child made by fork() gets a clear refusal from every call, never a hang:
 * the refusal must come before any Go code runs, since the child's copy of
 * the Go runtime may wait forever for threads that stayed in the parent.
 * Many forks, with the communicator's socket goroutines running, make that
 * window likely to be hit if the check came too late. */
static void test_fork_is_refused(oktopk_comm_t comm) {
  for (int i = 0; i < 40; i++) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      alarm(5); /* a hang in the child is a failure, not a stuck test */
      int rank;
      if (oktopk_comm_rank(comm, &rank) != oktopkInvalidUsage) _exit(2);
      char msg[512];
      if (oktopk_get_last_error(0, msg, sizeof msg, NULL) != oktopkSuccess || strstr(msg, "fork") == NULL) _exit(3);
      if (oktopk_debug_goroutines() != -1) _exit(4);
      if (oktopk_get_version() != OKTOPK_VERSION_CODE) _exit(5);
      if (strcmp(oktopk_get_error_string(oktopkTimeout), "timeout") != 0) _exit(6);
      float x[4] = {1, 2, 3, 4};
      uint32_t idx[1];
      float val[1];
      if (oktopk_topk(x, 4, 1, idx, val) != oktopkInvalidUsage) _exit(7);
      /* The blockwise rounding is plain C, no Go runtime: it works here. */
      float y[8] = {1, -2, 3, -4, 5, -6, 7, -8}, res[8];
      uint8_t codes[4], scales[2];
      if (oktopk_quantize_blocks(y, NULL, 8, 4, 8, codes, scales, res, NULL) != oktopkSuccess) _exit(8);
      _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0))
      fprintf(stderr, "fork %d: child %s %d\n", i, WIFEXITED(status) ? "exited" : "killed by signal",
              WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    REQUIRE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
}

/* oktopk_predict_call: Auto's model without a communicator. A ring's time
 * is its rounds, bytes and passes on the link given (ring.go's terms); its
 * bytes per rank are 2n(P-1)/P float32 values; auto names what it would
 * run; bad arguments are refused. */
static void test_predict_call(void) {
  oktopk_link_model_t link = {sizeof link, 1e-4, 1e-8, 0};
  double seconds = -1, bytes = -1;
  int ran = -1;
  OK(oktopk_predict_call(&link, OKTOPK_ALGO_DENSE_RING, 1 << 20, 4, NULL, &ran, &seconds, &bytes));
  REQUIRE(ran == OKTOPK_ALGO_DENSE_RING && bytes == 8.0 * (1 << 20) * 3 / 4);
  REQUIRE(fabs(seconds - (6 * 1e-4 + bytes * 1e-8)) < 1e-12);
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.density = 0.001;
  link.seconds_per_byte = 1e-7; /* a slow link: a sparse algorithm wins */
  OK(oktopk_predict_call(&link, OKTOPK_ALGO_AUTO, 1 << 24, 16, &cfg, &ran, &seconds, NULL));
  REQUIRE(ran != OKTOPK_ALGO_AUTO && ran != OKTOPK_ALGO_DENSE_RING && ran != OKTOPK_ALGO_DENSE_RABENSEIFNER && seconds > 0);
  OK(oktopk_predict_call(&link, OKTOPK_ALGO_OKTOPK, 1 << 24, 1, &cfg, NULL, &seconds, &bytes));
  REQUIRE(bytes == 0); /* one rank: nothing travels */
  EXPECT(oktopk_predict_call(NULL, OKTOPK_ALGO_OKTOPK, 100, 2, NULL, NULL, &seconds, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_predict_call(&link, OKTOPK_ALGO_AUTO + 1, 100, 2, NULL, NULL, &seconds, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_predict_call(&link, OKTOPK_ALGO_OKTOPK, 0, 2, NULL, NULL, &seconds, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_predict_call(&link, OKTOPK_ALGO_OKTOPK, 100, 0, NULL, NULL, &seconds, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_predict_call(&link, OKTOPK_ALGO_OKTOPK, 100, 2, NULL, NULL, NULL, NULL), oktopkInvalidArgument);
  link.latency_seconds = -1;
  EXPECT(oktopk_predict_call(&link, OKTOPK_ALGO_OKTOPK, 100, 2, NULL, NULL, &seconds, NULL), oktopkInvalidArgument);
  link.latency_seconds = 1e-4;
  link.size = 4;
  EXPECT(oktopk_predict_call(&link, OKTOPK_ALGO_OKTOPK, 100, 2, NULL, NULL, &seconds, NULL), oktopkInvalidArgument);
  cfg.density = 2;
  link.size = sizeof link;
  EXPECT(oktopk_predict_call(&link, OKTOPK_ALGO_OKTOPK, 100, 2, &cfg, NULL, &seconds, NULL), oktopkInvalidArgument);
}

static int run_errors(void) {
  rank_ = 0;
  /* Library-level calls. */
  REQUIRE(oktopk_get_version() == OKTOPK_VERSION_CODE);
  REQUIRE(strcmp(oktopk_get_error_string(oktopkTimeout), "timeout") == 0);
  REQUIRE(oktopk_get_error_string((oktopk_result_t)999) != NULL);
  REQUIRE(strcmp(oktopk_algorithm_name(OKTOPK_ALGO_OKTOPK), "oktopk") == 0);
  REQUIRE(strcmp(oktopk_algorithm_name(OKTOPK_ALGO_AUTO), "auto") == 0);
  for (int a = OKTOPK_ALGO_DENSE_RING; a <= OKTOPK_ALGO_AUTO; a++) REQUIRE(oktopk_algorithm_name(a) != NULL);
  REQUIRE(oktopk_algorithm_name(OKTOPK_ALGO_AUTO + 1) == NULL && oktopk_algorithm_name(-1) == NULL);
  /* 16-bit values: the algorithms whose roundings each have an owner, and auto. */
  for (int a = OKTOPK_ALGO_DENSE_RING; a <= OKTOPK_ALGO_AUTO; a++) {
    int want = a == OKTOPK_ALGO_OKTOPK || a == OKTOPK_ALGO_TOPKA || a == OKTOPK_ALGO_GAUSSIANK || a == OKTOPK_ALGO_AUTO;
    REQUIRE(oktopk_algorithm_takes_reduced_values(a) == want);
  }
  REQUIRE(oktopk_algorithm_takes_reduced_values(OKTOPK_ALGO_AUTO + 1) == -1 && oktopk_algorithm_takes_reduced_values(-1) == -1);
  oktopk_config_init(NULL); /* must not crash */
  test_predict_call();
  EXPECT(oktopk_get_last_error(0, NULL, 10, NULL), oktopkInvalidArgument);
  char small[4];
  EXPECT(oktopk_get_last_error(0, small, 0, NULL), oktopkInvalidArgument);

  /* Null pointers everywhere. */
  EXPECT(oktopk_get_unique_id(NULL, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_comm_init_rank(NULL, 1, NULL, 0, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_comm_init_env(NULL, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_make_token(NULL, 10), oktopkInvalidArgument);
  oktopk_comm_t comm;
  char ep[256];
  EXPECT(oktopk_comm_bind(&comm, 1, 0, NULL, NULL, ep, sizeof ep), oktopkInvalidArgument);
  EXPECT(oktopk_comm_bind(&comm, 2, 2, "t", NULL, ep, sizeof ep), oktopkInvalidArgument); /* rank >= nranks */
  EXPECT(oktopk_topk(NULL, 10, 1, NULL, NULL), oktopkInvalidArgument);

  /* Last error: the detail, NUL-terminated, truncation reported. */
  int truncated = -1;
  OK(oktopk_get_last_error(0, small, sizeof small, &truncated));
  REQUIRE(truncated == 1 && strlen(small) == 3);
  char msg[512];
  OK(oktopk_get_last_error(0, msg, sizeof msg, &truncated));
  REQUIRE(truncated == 0 && strstr(msg, "NULL") != NULL);

  /* Config: a size that is too small, a bad density, an unsupported wire dtype. */
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  REQUIRE(cfg.size == sizeof cfg && cfg.timeout_ms == 60000 && cfg.algorithm == OKTOPK_ALGO_OKTOPK &&
          cfg.density == 0.01 && cfg.tau == 64 && cfg.tau_prime == 32 && cfg.value_dtype == OKTOPK_FLOAT32);
  oktopk_config_t bad = cfg;
  bad.size = 4;
  EXPECT(oktopk_comm_bind(&comm, 1, 0, "t", &bad, ep, sizeof ep), oktopkInvalidArgument);
  bad = cfg;
  bad.density = 1.5;
  EXPECT(oktopk_comm_bind(&comm, 1, 0, "t", &bad, ep, sizeof ep), oktopkInvalidArgument);
  bad = cfg;
  bad.value_dtype = 7;
  EXPECT(oktopk_comm_bind(&comm, 1, 0, "t", &bad, ep, sizeof ep), oktopkInvalidArgument);
  OK(oktopk_get_last_error(0, msg, sizeof msg, NULL));
  REQUIRE(strstr(msg, "value_dtype") != NULL);
  bad.value_dtype = OKTOPK_FLOAT32 | OKTOPK_STOCHASTIC_ROUNDING; /* nothing to round */
  EXPECT(oktopk_comm_bind(&comm, 1, 0, "t", &bad, ep, sizeof ep), oktopkInvalidArgument);
  bad.value_dtype = OKTOPK_BFLOAT16;
  bad.algorithm = OKTOPK_ALGO_SSAR_SPLIT_ALLGATHER; /* forwards partial sums: no owner for their rounding */
  EXPECT(oktopk_comm_bind(&comm, 1, 0, "t", &bad, ep, sizeof ep), oktopkInvalidArgument);
  OK(oktopk_get_last_error(0, msg, sizeof msg, NULL));
  REQUIRE(strstr(msg, "bfloat16 values need algorithm oktopk, topka, gaussiank or auto") != NULL);
  /* An older caller's shorter config: the fields past its size are not read. */
  bad = cfg;
  bad.size = (uint32_t)offsetof(oktopk_config_t, density);
  bad.density = -1; /* beyond size: ignored, the default is used */
  OK(oktopk_comm_bind(&comm, 1, 0, "t", &bad, ep, sizeof ep));
  OK(oktopk_comm_destroy(comm));

  /* Selection: exact top-k and threshold select, k > n, capacity kept. */
  float x[8] = {1, -7, 3, 7, 0, -2, 5, NAN};
  uint32_t idx[8];
  float val[8];
  EXPECT(oktopk_topk(x, 8, 9, idx, val), oktopkInvalidArgument);
  EXPECT(oktopk_topk(x, 8, 2, idx, val), oktopkNonFinite);
  OK(oktopk_topk(x, 7, 3, idx, val)); /* |-7| = |7|: both, then 5 */
  REQUIRE(idx[0] == 1 && idx[1] == 3 && idx[2] == 6 && val[0] == -7 && val[1] == 7 && val[2] == 5);
  size_t count = 0;
  uint32_t cidx[3] = {0, 0, 0xdeadbeef};
  float cval[3] = {0, 0, 42};
  EXPECT(oktopk_threshold_select(x, 7, 2.5f, cidx, cval, 2, &count), oktopkInvalidArgument);
  REQUIRE(count == 4 && cidx[0] == 1 && cidx[1] == 2 && cidx[2] == 0xdeadbeef && cval[2] == 42);
  OK(oktopk_threshold_select(x, 7, 2.5f, idx, val, 8, &count));
  REQUIRE(count == 4 && idx[3] == 6 && val[3] == 5);
  EXPECT(oktopk_threshold_select(x, 7, NAN, idx, val, 8, &count), oktopkInvalidArgument);
  EXPECT(oktopk_threshold_select(x, 7, 1, idx, val, 8, NULL), oktopkInvalidArgument);
  /* NaN is reported, never silently dropped (|NaN| > t is false). */
  EXPECT(oktopk_threshold_select(x, 8, 2.5f, idx, val, 8, &count), oktopkNonFinite);
  REQUIRE(count == 0);
  x[7] = INFINITY;
  EXPECT(oktopk_threshold_select(x, 8, 2.5f, idx, val, 8, &count), oktopkNonFinite);
  OK(oktopk_topk(x, 8, 1, idx, val)); /* top-k ranks an infinity first, as documented */
  REQUIRE(idx[0] == 7 && isinf(val[0]));
  x[7] = NAN;

  /* Blockwise rounding: codes, scales and residual as include/oktopk.h
   * spells them; what the codes stand for plus the new residual is the
   * input, bitwise; bad arguments refused, a NaN flagged. */
  {
    float q[64], r[64], res[64], back[64];
    uint8_t codes[32], scales[4];
    int nonfinite = -1;
    for (int i = 0; i < 64; i++) {
      q[i] = (float)(i % 13) - 6.25f + (i >= 32 ? 100.0f * (float)(i % 3) : 0.0f);
      r[i] = 0.03125f * (float)(i % 5);
    }
    EXPECT(oktopk_quantize_blocks(q, r, 64, 3, 32, codes, scales, res, &nonfinite), oktopkInvalidArgument);
    EXPECT(oktopk_quantize_blocks(q, r, 60, 4, 32, codes, scales, res, &nonfinite), oktopkInvalidArgument);
    EXPECT(oktopk_quantize_blocks(q, r, 64, 4, 12, codes, scales, res, &nonfinite), oktopkInvalidArgument);
    EXPECT(oktopk_quantize_blocks(NULL, r, 64, 4, 32, codes, scales, res, &nonfinite), oktopkInvalidArgument);
    EXPECT(oktopk_dequantize_blocks(codes, scales, 64, 5, 32, back), oktopkInvalidArgument);
    OK(oktopk_quantize_blocks(q, r, 64, 4, 32, codes, scales, res, &nonfinite));
    REQUIRE(nonfinite == 0);
    OK(oktopk_dequantize_blocks(codes, scales, 64, 4, 32, back));
    for (int b = 0; b < 2; b++) {
      float largest = 0;
      for (int i = 32 * b; i < 32 * b + 32; i++) largest = fmaxf(largest, fabsf(q[i] + r[i]));
      uint16_t bits16;
      memcpy(&bits16, scales + 2 * b, 2);
      uint32_t u = (uint32_t)bits16 << 16;
      float scale;
      memcpy(&scale, &u, sizeof scale);
      REQUIRE(fabsf(scale - largest) <= largest / 256); /* bfloat16: 8 bits of mantissa */
      for (int i = 32 * b; i < 32 * b + 32; i++) {
        float acc = q[i] + r[i];
        int code = (codes[i / 2] >> (4 * (i % 2))) & 15;
        REQUIRE(code <= 14);                                          /* levels -7..7 */
        REQUIRE(back[i] == (float)(code - 7) * (scale / 7));          /* what a code stands for */
        REQUIRE(acc - back[i] == res[i]);                             /* the residual keeps the rest, exactly */
        REQUIRE(fabsf(res[i]) <= scale / 14 * (1 + 1e-6f) + fmaxf(0, fabsf(acc) - scale)); /* half a step, or what a clamp kept */
      }
    }
    /* In place (new_residual = x, residual NULL): the same codes. */
    float acc2[64];
    uint8_t codes2[32];
    for (int i = 0; i < 64; i++) acc2[i] = q[i] + r[i];
    OK(oktopk_quantize_blocks(acc2, NULL, 64, 4, 32, codes2, scales, acc2, NULL));
    REQUIRE(memcmp(codes, codes2, sizeof codes) == 0 && memcmp(acc2, res, sizeof res) == 0);
    q[40] = NAN;
    OK(oktopk_quantize_blocks(q, r, 64, 4, 32, codes, scales, res, &nonfinite));
    REQUIRE(nonfinite == 1);
    q[40] = 0;
  }

  /* A single-rank communicator: bad arguments, then destroyed handles. */
  oktopk_unique_id_t id;
  OK(oktopk_get_unique_id(&id, NULL));
  OK(oktopk_comm_init_rank(&comm, 1, &id, 0, NULL));
  float data[16] = {0};
  EXPECT(oktopk_allreduce(comm, NULL, 16, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), oktopkInvalidArgument);
  EXPECT(oktopk_allreduce(comm, data, 0, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), oktopkInvalidArgument);
  EXPECT(oktopk_allreduce(comm, data, 16, (oktopk_dtype_t)7, 0, OKTOPK_ALGO_DENSE_RING), oktopkInvalidArgument);
  EXPECT(oktopk_allreduce(comm, data, 16, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_OKTOPK), oktopkInvalidArgument);
  EXPECT(oktopk_allreduce(comm, data, 16, OKTOPK_FLOAT32, 0, 77), oktopkInvalidArgument);
  EXPECT(oktopk_sparse_allreduce(comm, 1, NULL, 16, OKTOPK_FLOAT32, NULL), oktopkInvalidArgument);
  oktopk_stats_t st = {.size = 0};
  EXPECT(oktopk_sparse_allreduce(comm, 1, data, 16, OKTOPK_FLOAT32, &st), oktopkInvalidArgument);
  EXPECT(oktopk_sparse_allreduce_start(comm, 1, data, 16, OKTOPK_FLOAT32, NULL), oktopkInvalidArgument);
  /* Held ranges: refused when out of order, empty, outside count, or NULL. */
  size_t overlapping[4] = {2, 5, 4, 8}, empty[2] = {3, 3}, outside[2] = {10, 17};
  EXPECT(oktopk_sparse_allreduce_hold(comm, 2, data, 16, OKTOPK_FLOAT32, overlapping, 2, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_sparse_allreduce_hold(comm, 2, data, 16, OKTOPK_FLOAT32, empty, 1, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_sparse_allreduce_hold(comm, 2, data, 16, OKTOPK_FLOAT32, outside, 1, NULL), oktopkInvalidArgument);
  EXPECT(oktopk_sparse_allreduce_hold(comm, 2, data, 16, OKTOPK_FLOAT32, NULL, 1, NULL), oktopkInvalidArgument);
  /* A held entry is not sent but kept: the largest entry, held, comes back
   * 0, and the next call (gradient 0, nothing held) sends it. k = 1 here. */
  float g[16] = {0};
  g[3] = 1;
  g[9] = 100;
  size_t hold9[2] = {9, 10};
  OK(oktopk_sparse_allreduce_hold(comm, 3, g, 16, OKTOPK_FLOAT32, hold9, 1, NULL));
  REQUIRE(g[9] == 0 && g[3] == 1);
  memset(g, 0, sizeof g);
  OK(oktopk_sparse_allreduce_hold(comm, 3, g, 16, OKTOPK_FLOAT32, NULL, 0, NULL));
  REQUIRE(g[9] == 100 && g[3] == 0);
  EXPECT(oktopk_comm_rank(comm, NULL), oktopkInvalidArgument);
  size_t out_count;
  uint32_t in_idx[2] = {3, 1}; /* not increasing */
  float in_val[2] = {1, 1};
  EXPECT(oktopk_sparse_allreduce_sparse(comm, 16, in_idx, in_val, 2, idx, val, 8, &out_count, NULL),
         oktopkInvalidArgument);
  EXPECT(oktopk_sparse_allreduce_sparse(comm, 16, in_idx, in_val, 2, idx, val, 8, NULL, NULL),
         oktopkInvalidArgument);
  EXPECT(oktopk_tensor_state_size(comm, 12345, &count), oktopkInvalidArgument); /* no such tensor */
  EXPECT(oktopk_tensor_state_load(comm, 1, NULL, 4), oktopkInvalidArgument);
  EXPECT(oktopk_tensor_state_load(comm, 1, "junk", 4), oktopkInvalidArgument);
  OK(oktopk_get_last_error(comm, msg, sizeof msg, NULL));
  REQUIRE(strstr(msg, "oktopk: invalid argument: tensor 1: ") == msg && strstr(msg + 1, "oktopk:") == NULL);
  /* The communicator's own last error holds its detail. */
  OK(oktopk_get_last_error(comm, msg, sizeof msg, NULL));
  REQUIRE(msg[0] != 0);
  OK(oktopk_allreduce(comm, data, 16, OKTOPK_FLOAT32, 1, OKTOPK_ALGO_DENSE_RING));
  EXPECT(oktopk_comm_connect(comm, NULL, 1), oktopkInvalidUsage); /* already connected */

  EXPECT(oktopk_wait((oktopk_request_t)comm, NULL), oktopkInvalidUsage); /* a comm is not a request */
  test_fork_is_refused(comm);

  OK(oktopk_comm_destroy(comm));
  EXPECT(oktopk_comm_destroy(comm), oktopkInvalidUsage);
  EXPECT(oktopk_allreduce(comm, data, 16, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), oktopkInvalidUsage);
  EXPECT(oktopk_comm_rank(comm, &(int){0}), oktopkInvalidUsage);
  EXPECT(oktopk_comm_abort(comm), oktopkInvalidUsage);
  EXPECT(oktopk_get_last_error(comm, msg, sizeof msg, NULL), oktopkInvalidUsage);
  REQUIRE(strstr(msg, "destroyed") != NULL);
  EXPECT(oktopk_comm_destroy(0), oktopkInvalidUsage);
  EXPECT(oktopk_comm_destroy(-5), oktopkInvalidUsage);
  EXPECT(oktopk_wait(12345678, NULL), oktopkInvalidUsage);
  EXPECT(oktopk_test(0), oktopkInvalidUsage);

  /* Two-step init: calls before connect are refused, not hung. */
  OK(oktopk_comm_bind(&comm, 2, 0, "t", NULL, ep, sizeof ep));
  EXPECT(oktopk_allreduce(comm, data, 16, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), oktopkInvalidUsage);
  EXPECT(oktopk_comm_connect(comm, (const char *[]){ep}, 1), oktopkInvalidArgument); /* 1 endpoint, 2 ranks */
  OK(oktopk_comm_destroy(comm));
  char tiny[4];
  EXPECT(oktopk_comm_bind(&comm, 1, 0, "t", NULL, tiny, sizeof tiny), oktopkInvalidArgument);

  test_abort_unblocks();
  test_destroy_after_peer_died();
  test_dtype_mismatch();
  test_refusal_reaches_peer();
  test_concurrent_threads();
  test_too_many_outstanding();
  test_flood_is_counted_and_destroy_stays_prompt();

  printf("errors: ok\n");
  return 0;
}

static int run_peer_death(void) {
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = 5000;
  oktopk_comm_t comm;
  OK(oktopk_comm_init_env(&comm, &cfg));
  int rank, size;
  note_rank(comm, &rank, &size);
  float x[1024] = {0};
  OK(oktopk_allreduce(comm, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  /* The dying rank's last sends of that call are queued, not yet delivered,
   * when its own call returns; dying at once can drop them, and a survivor's
   * first call would fail instead of its second. So survivors mark their
   * first call done with a file in the launcher's directory, and the last
   * rank dies only once every mark is there. */
  const char *dir = getenv("OKTOPK_TEST_DIR");
  REQUIRE(dir != NULL);
  char mark[4096];
  if (rank != size - 1) {
    snprintf(mark, sizeof mark, "%s/first_call_done.%d", dir, rank);
    FILE *f = fopen(mark, "w");
    REQUIRE(f != NULL);
    fclose(f);
  } else {
    for (int r = 0; r < size - 1; r++) {
      snprintf(mark, sizeof mark, "%s/first_call_done.%d", dir, r);
      double waited = now();
      while (access(mark, F_OK) != 0) {
        REQUIRE(now() - waited < 30.0);
        usleep(1000);
      }
    }
    _exit(0); /* dies: no destroy, sockets dropped by the kernel */
  }
  double t0 = now();
  oktopk_result_t r = oktopk_allreduce(comm, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING);
  double failed = now() - t0;
  char msg[512];
  oktopk_get_last_error(comm, msg, sizeof msg, NULL);
  printf("rank %d: call with a dead peer: %s after %.3f s (%s)\n", rank, oktopk_get_error_string(r), failed, msg);
  REQUIRE(r == oktopkRemoteError || r == oktopkTimeout || r == oktopkAborted);
  REQUIRE(failed < 5.0 + 1.0);
  t0 = now();
  OK(oktopk_comm_destroy(comm));
  double destroyed = now() - t0;
  printf("rank %d: destroy took %.3f s\n", rank, destroyed);
  REQUIRE(destroyed < 1.0);
  return 0;
}

/* ------------------------------------------------------------------------ */

/* oktopk_comm_shrink: the last rank is lost after a sparse call (it dies,
 * or with "stop" stops itself: SIGSTOP), the survivors' next call fails,
 * and they shrink the communicator: numbered as before, their residuals
 * whole, a dense sum over the survivors exact, a sparse call on the kept
 * state fine. A stopped rank woken afterwards is refused a place. */
static void wait_for_mark(const char *dir, const char *name, int rank) {
  char mark[4096];
  snprintf(mark, sizeof mark, "%s/%s.%d", dir, name, rank);
  double waited = now();
  while (access(mark, F_OK) != 0) {
    REQUIRE(now() - waited < 60.0);
    usleep(1000);
  }
}

static void put_mark(const char *dir, const char *name, int rank) {
  char mark[4096];
  snprintf(mark, sizeof mark, "%s/%s.%d", dir, name, rank);
  FILE *f = fopen(mark, "w");
  REQUIRE(f != NULL);
  fprintf(f, "%d\n", (int)getpid());
  fclose(f);
}

/* Wake the stopped rank (its pid in its "stopping" mark) and wait until it
 * was refused a place; rank 0 calls it, since it serves the store. */
static void wake_and_wait_refused(const char *dir, int rank) {
  char path[4096];
  snprintf(path, sizeof path, "%s/stopping.%d", dir, rank);
  FILE *f = fopen(path, "r");
  REQUIRE(f != NULL);
  int pid = 0;
  REQUIRE(fscanf(f, "%d", &pid) == 1);
  fclose(f);
  kill(pid, SIGCONT);
  wait_for_mark(dir, "woken_done", rank);
}

static int run_shrink(int stop) {
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = 3000;
  cfg.algorithm = OKTOPK_ALGO_OKTOPK;
  cfg.density = 0.05;
  oktopk_comm_t comm;
  OK(oktopk_comm_init_env(&comm, &cfg));
  int rank, size;
  note_rank(comm, &rank, &size);
  enum { N = 4096 };
  static float g[N], before[N], after[N];
  fill_gradient(g, N, rank, 7);
  OK(oktopk_sparse_allreduce(comm, 7, g, N, OKTOPK_FLOAT32, NULL));
  OK(oktopk_tensor_residual_read(comm, 7, before, N));
  const char *dir = getenv("OKTOPK_TEST_DIR");
  REQUIRE(dir != NULL);
  float x[1024];
  if (rank != size - 1) {
    put_mark(dir, "first_call_done", rank);
  } else {
    for (int r = 0; r < size - 1; r++) wait_for_mark(dir, "first_call_done", r);
    if (!stop) _exit(0); /* dies: sockets dropped by the kernel */
    put_mark(dir, "stopping", rank);
    raise(SIGSTOP);
    /* Woken once the survivors went on: this communicator fails, and the
     * survivors' agreement has closed without this rank. */
    for (int i = 0; i < 1024; i++) x[i] = 1.0f;
    REQUIRE(oktopk_allreduce(comm, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING) != oktopkSuccess);
    oktopk_comm_t none = 0;
    oktopk_result_t r = oktopk_comm_shrink(comm, &none);
    char msg[512];
    oktopk_get_last_error(comm, msg, sizeof msg, NULL);
    printf("rank %d, woken: shrink %s (%s)\n", rank, oktopk_get_error_string(r), msg);
    REQUIRE(r == oktopkRemoteError && none == 0);
    REQUIRE(strstr(msg, "after it closed") != NULL);
    OK(oktopk_comm_destroy(comm));
    put_mark(dir, "woken_done", rank);
    return 0;
  }
  for (int i = 0; i < 1024; i++) x[i] = 1.0f;
  double t0 = now();
  oktopk_result_t r = oktopk_allreduce(comm, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING);
  printf("rank %d: call with a lost peer: %s after %.3f s\n", rank, oktopk_get_error_string(r), now() - t0);
  REQUIRE(r == oktopkRemoteError || r == oktopkTimeout || r == oktopkAborted);
  t0 = now();
  oktopk_comm_t next = 0;
  OK(oktopk_comm_shrink(comm, &next));
  int nrank, nsize;
  note_rank(next, &nrank, &nsize);
  printf("rank %d: shrunk to rank %d of %d in %.3f s\n", rank, nrank, nsize, now() - t0);
  REQUIRE(nrank == rank && nsize == size - 1);
  OK(oktopk_tensor_residual_read(next, 7, after, N));
  REQUIRE(memcmp(before, after, sizeof before) == 0); /* this rank's residual, whole */
  for (int i = 0; i < 1024; i++) x[i] = (float)(rank + 1);
  OK(oktopk_allreduce(next, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  for (int i = 0; i < 1024; i++) REQUIRE(x[i] == (float)((size - 1) * size / 2)); /* 1 + ... + (size - 1): the survivors only */
  fill_gradient(g, N, rank, 8);
  OK(oktopk_sparse_allreduce(next, 7, g, N, OKTOPK_FLOAT32, NULL));
  OK(oktopk_comm_destroy(comm));
  if (stop && rank == 0) {
    wake_and_wait_refused(dir, size - 1); /* rank 0 serves the store until that rank was refused */
  }
  OK(oktopk_comm_destroy(next));
  return 0;
}

/* oktopk_comm_join and oktopk_comm_admit: the last rank of 4 dies (with
 * "stop": stops, and is refused when woken at the end), the survivors
 * shrink, rank 0 starts a new process as that rank ("rejoin joiner"), and
 * the members admit it at the same step of a loop. On the
 * grown communicator every rank, the joiner included, is numbered by its
 * original rank, a dense sum is exact over all four, the members keep
 * their residuals whole and the joiner has none, and a sparse call comes
 * back bitwise alike on every rank. */
extern char **environ;

static void after_join(oktopk_comm_t comm, int rank, int size, const float *kept) {
  enum { N = 4096 };
  static float g[N], residual[N];
  int r, n;
  note_rank(comm, &r, &n);
  REQUIRE(r == rank && n == size);
  float x[1024];
  for (int i = 0; i < 1024; i++) x[i] = (float)(rank + 1);
  OK(oktopk_allreduce(comm, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  for (int i = 0; i < 1024; i++) REQUIRE(x[i] == (float)(size * (size + 1) / 2));
  OK(oktopk_tensor_residual_read(comm, 7, residual, N));
  if (kept != NULL) {
    REQUIRE(memcmp(kept, residual, sizeof residual) == 0); /* a member's residual, whole */
  } else {
    for (int i = 0; i < N; i++) REQUIRE(residual[i] == 0.0f); /* the joiner starts empty */
  }
  fill_gradient(g, N, rank, 9);
  OK(oktopk_sparse_allreduce(comm, 7, g, N, OKTOPK_FLOAT32, NULL));
  /* The result alike on every rank: its hash in 16-bit pieces, summed. */
  uint64_t h = hash_bytes(g, sizeof g, 1469598103934665603ULL);
  float pieces[4], sums[4];
  for (int i = 0; i < 4; i++) pieces[i] = sums[i] = (float)((h >> (16 * i)) & 0xffff);
  OK(oktopk_allreduce(comm, sums, 4, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  for (int i = 0; i < 4; i++) REQUIRE(sums[i] == (float)size * pieces[i]);
  printf("rank %d of %d after the join: sums exact, residual %s, sparse result alike\n", r, n, kept ? "kept" : "empty");
}

static oktopk_config_t rejoin_config(void) {
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = 3000;
  cfg.algorithm = OKTOPK_ALGO_OKTOPK;
  cfg.density = 0.05;
  return cfg;
}

static int run_rejoin_joiner(void) {
  oktopk_config_t cfg = rejoin_config();
  oktopk_comm_t comm;
  double t0 = now();
  OK(oktopk_comm_join(&comm, &cfg));
  int rank, size;
  note_rank(comm, &rank, &size);
  printf("joiner: admitted as rank %d of %d after %.3f s\n", rank, size, now() - t0);
  after_join(comm, atoi(getenv("RANK")), 4, NULL);
  OK(oktopk_comm_destroy(comm));
  return 0;
}

static int run_rejoin(const char *self, int stop) {
  oktopk_config_t cfg = rejoin_config();
  oktopk_comm_t comm;
  OK(oktopk_comm_init_env(&comm, &cfg));
  int rank, size;
  note_rank(comm, &rank, &size);
  REQUIRE(size == 4);
  enum { N = 4096 };
  static float g[N], kept[N];
  fill_gradient(g, N, rank, 7);
  OK(oktopk_sparse_allreduce(comm, 7, g, N, OKTOPK_FLOAT32, NULL));
  const char *dir = getenv("OKTOPK_TEST_DIR");
  REQUIRE(dir != NULL);
  float x[1024] = {0};
  if (rank != size - 1) {
    put_mark(dir, "first_call_done", rank);
  } else {
    for (int r = 0; r < size - 1; r++) wait_for_mark(dir, "first_call_done", r);
    if (!stop) _exit(0);
    put_mark(dir, "stopping", rank);
    raise(SIGSTOP);
    /* Woken after a new process took this rank's place: refused. */
    REQUIRE(oktopk_allreduce(comm, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING) != oktopkSuccess);
    oktopk_comm_t none = 0;
    REQUIRE(oktopk_comm_shrink(comm, &none) == oktopkRemoteError && none == 0);
    OK(oktopk_comm_destroy(comm));
    put_mark(dir, "woken_done", rank);
    return 0;
  }
  REQUIRE(oktopk_allreduce(comm, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING) != oktopkSuccess);
  oktopk_comm_t shrunk = 0;
  OK(oktopk_comm_shrink(comm, &shrunk));
  OK(oktopk_comm_destroy(comm));
  OK(oktopk_tensor_residual_read(shrunk, 7, kept, N));
  pid_t joiner = 0;
  if (rank == 0) {
    /* The lost rank's new process: this program again, as rank 3. */
    int n = 0;
    while (environ[n] != NULL) n++;
    char **env = calloc((size_t)n + 2, sizeof *env);
    REQUIRE(env != NULL);
    int k = 0;
    for (int i = 0; i < n; i++)
      if (strncmp(environ[i], "RANK=", 5) != 0) env[k++] = environ[i];
    char rank_var[32];
    snprintf(rank_var, sizeof rank_var, "RANK=%d", size - 1);
    env[k++] = rank_var;
    env[k] = NULL;
    char *argv[] = {(char *)self, "rejoin", "joiner", NULL};
    REQUIRE(posix_spawn(&joiner, self, NULL, NULL, argv, env) == 0);
    free(env);
  }
  /* The members' loop: a step, then an admit, at the same point on each. */
  oktopk_comm_t grown = 0;
  int steps = 0;
  for (; steps < 400 && grown == 0; steps++) {
    for (int i = 0; i < 1024; i++) x[i] = 1.0f;
    OK(oktopk_allreduce(shrunk, x, 1024, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
    REQUIRE(x[0] == (float)(size - 1));
    usleep(20000);
    OK(oktopk_comm_admit(shrunk, &grown));
  }
  REQUIRE(grown != 0);
  printf("rank %d: admitted the joiner at step %d of the members' loop\n", rank, steps);
  OK(oktopk_comm_destroy(shrunk));
  after_join(grown, rank, size, kept);
  if (rank == 0) {
    int status = 0;
    REQUIRE(waitpid(joiner, &status, 0) == joiner);
    REQUIRE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (stop) {
      wake_and_wait_refused(dir, size - 1); /* the stopped process, whose rank the joiner took */
    }
  }
  OK(oktopk_comm_destroy(grown)); /* rank 0's: the store it serves closes with it */
  return 0;
}

static int open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory stream itself */
}


/* One cycle: a 1-rank communicator, or (every 20th cycle) two ranks of one
 * communicator in this process connected over TCP loopback, so per-peer
 * sockets and their goroutines are made and released too. A two-rank
 * cycle takes a few hundred milliseconds (connection set-up), hence not
 * every cycle. */
static void one_cycle(int i) {
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  if (i % 20 != 19) {
    oktopk_unique_id_t id;
    oktopk_comm_t comm;
    OK(oktopk_get_unique_id(&id, NULL));
    OK(oktopk_comm_init_rank(&comm, 1, &id, 0, NULL));
    oktopk_request_t req;
    OK(oktopk_allreduce_start(comm, x, 8, OKTOPK_FLOAT32, 1, OKTOPK_ALGO_DENSE_RING, &req));
    OK(oktopk_wait(req, NULL));
    OK(oktopk_request_free(req));
    REQUIRE(x[7] == 8);
    OK(oktopk_comm_destroy(comm));
    return;
  }
  struct two_ranks t = make_two_ranks(10000);
  struct allreduce_arg a = {t.comm[1], y, 8, 0};
  pthread_t th;
  pthread_create(&th, NULL, allreduce_thread, &a);
  OK(oktopk_allreduce(t.comm[0], x, 8, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  pthread_join(th, NULL);
  OK(a.result);
  REQUIRE(x[7] == 16 && y[7] == 16);
  OK(oktopk_comm_destroy(t.comm[0]));
  OK(oktopk_comm_destroy(t.comm[1]));
}

static int run_cycles(int cycles) {
  rank_ = 0;
  int fd0 = 0, g0 = 0, fd_max = 0, g_max = 0;
  int every = cycles >= 10 ? cycles / 10 : 1;
  double t0 = now();
  for (int i = 0; i <= cycles; i++) {
    if (i % every == 0) {
      usleep(50000); /* let exiting goroutines finish */
      int fd = open_fds(), g = oktopk_debug_goroutines();
      printf("cycle %4d: %d open files, %d goroutines\n", i, fd, g);
      if (i == every) { /* after warm-up: the runtime's own threads exist */
        fd0 = fd;
        g0 = g;
      } else if (i > every) {
        fd_max = fd > fd_max ? fd : fd_max;
        g_max = g > g_max ? g : g_max;
      }
    }
    if (i == cycles) break;
    one_cycle(i);
  }
  printf("%d cycles (every 20th with 2 ranks over TCP) in %.2f s; open files %d -> max %d, goroutines %d -> max %d\n",
         cycles, now() - t0, fd0, fd_max, g0, g_max);
  /* Flat: a leak of one descriptor or goroutine per cycle would add about
     0.9 * cycles, far past these margins from 100 cycles on. */
  REQUIRE(fd_max <= fd0 + 4);
  REQUIRE(g_max <= g0 + 8);
  return 0;
}

/* ------------------------------------------------------------------------ */

/* One field of /proc/self/status (VmRSS, VmHWM) in KiB, or -1. */
static long status_kib(const char *field) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long v = -1;
  size_t len = strlen(field);
  while (fgets(line, sizeof line, f))
    if (strncmp(line, field, len) == 0 && line[len] == ':') {
      v = atol(line + len + 1);
      break;
    }
  fclose(f);
  return v;
}

/* Resets VmHWM to the current RSS (Linux >= 4.0); 0 on success. */
static int reset_peak_rss(void) {
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (!f) return -1;
  int ok = fputs("5", f) >= 0;
  return fclose(f) == 0 && ok ? 0 : -1;
}

/* A gradient of distinct magnitudes (no ties, unlike fill_gradient's small
 * integers), as a trained network's are: uniform in (-1, 1), scaled by a
 * factor that varies along the vector. */
static void fill_continuous(float *x, size_t n, int rank, int call) {
  lcg = 1000003ull * (uint64_t)(rank + 1) + 7919ull * (uint64_t)call;
  for (size_t i = 0; i < n; i++)
    x[i] = ((float)next_rand() / 1073741824.0f - 1.0f) * (1.0f + (float)(i % 1021) / 256.0f); /* next_rand: 31 bits */
}

static const char *const algorithm_names[] = {"dense_ring", "dense_rabenseifner", "oktopk", "topka", "topkdsa",
                                              "ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather",
                                              "gtopk", "gaussiank"};

/* Peak RSS growth of one algorithm's calls: the caller's gradient (n floats)
 * is allocated and touched before the baseline, so what grows is what the
 * library holds (residual, scratch, message buffers, the Go heap's headroom)
 * and nothing of the workload's. The gradient is refilled before every call
 * (the call overwrites it with the result); the fill writes the same pages,
 * so it adds nothing to RSS. */
static int run_memory(const char *alg_name, size_t n, int calls, double limit, const char *dtype_name) {
  int alg = -1;
  for (int a = 0; a < (int)(sizeof algorithm_names / sizeof *algorithm_names); a++)
    if (strcmp(alg_name, algorithm_names[a]) == 0) alg = a;
  int half = strcmp(dtype_name, "bfloat16") == 0;
  if (alg < 0 || n == 0 || calls < 1 || (!half && strcmp(dtype_name, "float32") != 0)) {
    fprintf(stderr, "memory: unknown algorithm %s or dtype %s, or n or calls is 0\n", alg_name, dtype_name);
    return 2;
  }
  oktopk_dtype_t dtype = half ? OKTOPK_BFLOAT16 : OKTOPK_FLOAT32;
  size_t width = half ? 2 : 4;
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = 600000; /* many ranks on few cores: slow, never stuck */
  cfg.algorithm = alg;
  cfg.density = 0.01;
  /* Refresh and repartition inside the measured calls, as training does
   * every tau' and tau calls. */
  cfg.tau_prime = 4;
  cfg.tau = 8;
  oktopk_comm_t comm;
  OK(oktopk_comm_init_env(&comm, &cfg));
  int rank, size;
  note_rank(comm, &rank, &size);
  float *grad = malloc(n * sizeof *grad);
  uint16_t *grad16 = half ? malloc(n * sizeof *grad16) : NULL;
  REQUIRE(grad != NULL && (!half || grad16 != NULL));
  fill_continuous(grad, n, rank, 0);
  for (size_t i = 0; half && i < n; i++) grad16[i] = to_half(grad[i], OKTOPK_BFLOAT16);
  void *buffer = half ? (void *)grad16 : (void *)grad;
  REQUIRE(reset_peak_rss() == 0);
  long base = status_kib("VmRSS"), peak = base;
  double unit = (double)n * (double)width / 1024; /* n x the element size, in KiB */
  double t0 = now();
  for (int call = 1; call <= calls; call++) {
    fill_continuous(grad, n, rank, call);
    for (size_t i = 0; half && i < n; i++) grad16[i] = to_half(grad[i], OKTOPK_BFLOAT16);
    oktopk_stats_t st = {.size = sizeof st};
    if (alg <= OKTOPK_ALGO_DENSE_RABENSEIFNER)
      OK(oktopk_allreduce(comm, buffer, n, dtype, 1, alg));
    else
      OK(oktopk_sparse_allreduce(comm, 1, buffer, n, dtype, &st));
    long hwm = status_kib("VmHWM"), rss = status_kib("VmRSS");
    peak = hwm > peak ? hwm : peak;
    printf("call %2d: rss %+7.1f MiB, peak %+7.1f MiB (%.2f x n x %zu B); selected %lld here, %lld in all (k = %lld)\n",
           call, (rss - base) / 1024.0, (peak - base) / 1024.0, (peak - base) / unit, width, (long long)st.local_selected,
           (long long)st.global_selected, (long long)st.k);
  }
  printf("MEM %s dtype=%s P=%d n=%zu calls=%d base_mib=%.1f peak_extra_mib=%.1f ratio=%.2f seconds=%.1f\n", alg_name,
         dtype_name, size, n, calls, base / 1024.0, (peak - base) / 1024.0, (peak - base) / unit, now() - t0);
  OK(oktopk_comm_destroy(comm));
  free(grad);
  free(grad16);
  if (limit > 0 && (peak - base) / unit > limit) {
    fprintf(stderr, "rank %d: %s's peak RSS grew by %.2f x n x %zu B, above the limit of %.2f\n", rank, alg_name,
            (peak - base) / unit, width, limit);
    return 1;
  }
  return 0;
}

/* ------------------------------------------------------------------------ */

/* Every variable the library reads from the environment. */
static const char *const env_settings[] = {"OKTOPK_CURVE", "OKTOPK_SOCKET_IFNAME", "OKTOPK_STALL_WARN",
                                           "OKTOPK_JOB_TOKEN", "OKTOPK_RENDEZVOUS_PORT", "MASTER_ADDR",
                                           "MASTER_PORT", "RANK", "WORLD_SIZE"};
enum { N_ENV_SETTINGS = sizeof env_settings / sizeof env_settings[0] };

/* A port free a moment ago, below the kernel's ephemeral range (see
 * launch.sh for why). */
static int free_port(void) {
  int low = 32768;
  FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  if (f != NULL) {
    if (fscanf(f, "%d", &low) != 1) low = 32768;
    fclose(f);
  }
  srand((unsigned)getpid() ^ (unsigned)(now() * 1e6));
  for (int i = 0; i < 100; i++) {
    int port = 10000 + rand() % (low - 10002);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    if (ok) return port;
  }
  fprintf(stderr, "env: no free port\n");
  exit(1);
}

/* The library's last message for comm (0: the global one). */
static const char *last_error(oktopk_comm_t comm) {
  static char msg[1024];
  OK(oktopk_get_last_error(comm, msg, sizeof msg, NULL));
  return msg;
}

struct init_env_arg {
  oktopk_comm_t comm;
  oktopk_result_t result;
};

static void *init_env_thread(void *p) {
  struct init_env_arg *a = p;
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = 20000;
  a->result = oktopk_comm_init_env(&a->comm, &cfg);
  return NULL;
}

/* OKTOPK_CURVE=1 makes a communicator advertise a CURVE key in its endpoint
 * (or, with a libzmq built without CURVE, refuse to bind, saying so); unset,
 * it does not. */
static void env_curve(void) {
  oktopk_comm_t comm;
  char ep[256];
  setenv("OKTOPK_CURVE", "1", 1);
  oktopk_result_t r = oktopk_comm_bind(&comm, 1, 0, "t", NULL, ep, sizeof ep);
  if (r == oktopkSuccess) {
    printf("env: OKTOPK_CURVE=1: endpoint %.40s...\n", ep);
    REQUIRE(strstr(ep, "#curve=") != NULL);
    OK(oktopk_comm_destroy(comm));
  } else {
    printf("env: OKTOPK_CURVE=1: %s\n", last_error(0));
    REQUIRE(strstr(last_error(0), "CURVE") != NULL);
  }
  unsetenv("OKTOPK_CURVE");
  OK(oktopk_comm_bind(&comm, 1, 0, "t", NULL, ep, sizeof ep));
  REQUIRE(strstr(ep, "#curve=") == NULL);
  OK(oktopk_comm_destroy(comm));
}

/* OKTOPK_SOCKET_IFNAME names the interface whose address a rank binds. */
static void env_ifname(void) {
  oktopk_comm_t comm;
  char ep[256];
  setenv("OKTOPK_SOCKET_IFNAME", "oktopk-none0", 1);
  EXPECT(oktopk_comm_bind(&comm, 1, 0, "t", NULL, ep, sizeof ep), oktopkSystemError);
  printf("env: OKTOPK_SOCKET_IFNAME=oktopk-none0: %s\n", last_error(0));
  REQUIRE(strstr(last_error(0), "\"oktopk-none0\"") != NULL);
  setenv("OKTOPK_SOCKET_IFNAME", "lo", 1);
  OK(oktopk_comm_bind(&comm, 1, 0, "t", NULL, ep, sizeof ep));
  REQUIRE(strncmp(ep, "tcp://127.0.0.1:", 16) == 0);
  OK(oktopk_comm_destroy(comm));
  unsetenv("OKTOPK_SOCKET_IFNAME");
}

/* OKTOPK_STALL_WARN=0.2: a receive waiting 1 s logs its stall line (the
 * default would wait 10 s). The library logs to stderr, captured here. */
static void env_stall_warn(void) {
  setenv("OKTOPK_STALL_WARN", "0.2", 1);
  char path[] = "/tmp/oktopk-env-stderr-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  fflush(stderr);
  int saved = dup(2);
  dup2(fd, 2);
  struct two_ranks t = make_two_ranks(10000);
  float x[64] = {0};
  struct abort_arg a = {t.comm[0], 1.0};
  pthread_t th;
  pthread_create(&th, NULL, abort_later, &a);
  EXPECT(oktopk_allreduce(t.comm[0], x, 64, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), oktopkAborted);
  pthread_join(th, NULL);
  OK(oktopk_comm_destroy(t.comm[0]));
  OK(oktopk_comm_destroy(t.comm[1]));
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  char log[4096] = {0};
  REQUIRE(lseek(fd, 0, SEEK_SET) == 0);
  ssize_t got = read(fd, log, sizeof log - 1);
  close(fd);
  unlink(path);
  REQUIRE(got >= 0);
  printf("env: OKTOPK_STALL_WARN=0.2: %s", got > 0 ? log : "(nothing logged)\n");
  REQUIRE(strstr(log, "oktopk: rank 0 waiting") != NULL);
  unsetenv("OKTOPK_STALL_WARN");
}

/* The torchrun-style variables: each bad one is named by init_env; then
 * rank 0 joins by them (OKTOPK_RENDEZVOUS_PORT, OKTOPK_JOB_TOKEN) while this
 * thread, as rank 1, joins through a unique id naming that port and token:
 * a wrong token is refused, the right one makes one communicator. */
static void env_rendezvous(void) {
  int port = free_port();
  char port_text[16], master_port[16], token[128], id_text[256];
  snprintf(port_text, sizeof port_text, "%d", port);
  snprintf(master_port, sizeof master_port, "%d", port + 7); /* + 1 is not the rendezvous port */
  OK(oktopk_make_token(token, sizeof token));
  const char *good[][2] = {{"MASTER_ADDR", "127.0.0.1"}, {"RANK", "0"}, {"WORLD_SIZE", "2"},
                           {"MASTER_PORT", master_port}, {"OKTOPK_RENDEZVOUS_PORT", port_text}};
  oktopk_comm_t comm;
  for (int bad = 0; bad < 5; bad++) {
    for (int i = 0; i < 5; i++) setenv(good[i][0], i == bad ? "x" : good[i][1], 1);
    if (bad == 0) unsetenv("MASTER_ADDR");
    EXPECT(oktopk_comm_init_env(&comm, NULL), oktopkSystemError);
    REQUIRE(strstr(last_error(0), good[bad][0]) != NULL);
  }
  for (int i = 0; i < 5; i++) setenv(good[i][0], good[i][1], 1);
  setenv("OKTOPK_JOB_TOKEN", token, 1);
  struct init_env_arg rank0 = {0, 0};
  pthread_t th;
  pthread_create(&th, NULL, init_env_thread, &rank0);

  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = 20000;
  oktopk_unique_id_t id;
  memset(&id, 0, sizeof id);
  snprintf(id_text, sizeof id_text, "oktopk1:%s@127.0.0.1:%d", "not-the-job-token", port);
  memcpy(id.internal, id_text, strlen(id_text));
  oktopk_comm_t rank1;
  EXPECT(oktopk_comm_init_rank(&rank1, 2, &id, 1, &cfg), oktopkSystemError);
  printf("env: wrong job token: %s\n", last_error(0));
  REQUIRE(strstr(last_error(0), "wrong job token") != NULL);

  memset(&id, 0, sizeof id);
  snprintf(id_text, sizeof id_text, "oktopk1:%s@127.0.0.1:%d", token, port);
  memcpy(id.internal, id_text, strlen(id_text));
  OK(oktopk_comm_init_rank(&rank1, 2, &id, 1, &cfg));
  pthread_join(th, NULL);
  OK(rank0.result);
  float x[8] = {1, 1, 1, 1, 1, 1, 1, 1}, y[8] = {2, 2, 2, 2, 2, 2, 2, 2};
  struct allreduce_arg a = {rank0.comm, x, 8, 0};
  pthread_create(&th, NULL, allreduce_thread, &a);
  OK(oktopk_allreduce(rank1, y, 8, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  pthread_join(th, NULL);
  OK(a.result);
  REQUIRE(x[0] == 3 && y[7] == 3);
  printf("env: rank 0 by MASTER_ADDR, RANK, WORLD_SIZE, OKTOPK_RENDEZVOUS_PORT=%d, OKTOPK_JOB_TOKEN joined rank 1\n", port);
  OK(oktopk_comm_destroy(rank1));
  OK(oktopk_comm_destroy(rank0.comm));
  for (int i = 0; i < N_ENV_SETTINGS; i++) unsetenv(env_settings[i]);
}

/* The library must read each setting from the environment as it is when
 * the setting is used, not as it was when the library was loaded (a Go
 * runtime in a shared library keeps its own copy from load time). So every
 * setting here is made with setenv() after load, in a process whose initial
 * environment has none of them: one that has any is run again without. */
static int run_env(char **argv) {
  rank_ = 0;
  int inherited = 0;
  for (int i = 0; i < N_ENV_SETTINGS; i++)
    if (getenv(env_settings[i]) != NULL) {
      unsetenv(env_settings[i]);
      inherited = 1;
    }
  if (inherited) {
    execv("/proc/self/exe", argv);
    perror("env: execv");
    return 1;
  }
  env_curve();
  env_ifname();
  env_stall_warn();
  env_rendezvous();
  printf("env: ok\n");
  return 0;
}

/* ------------------------------------------------------------------------ */

static int run_join(int timeout_ms) {
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = timeout_ms;
  oktopk_comm_t comm;
  double t0 = now();
  oktopk_result_t rc = oktopk_comm_init_env(&comm, &cfg);
  if (rc != oktopkSuccess) {
    char msg[1024];
    oktopk_get_last_error(0, msg, sizeof msg, NULL);
    printf("JOIN FAILED after %.0f ms: %s: %s\n", (now() - t0) * 1000, oktopk_get_error_string(rc), msg);
    return 3;
  }
  int rank, size;
  note_rank(comm, &rank, &size);
  float x[4] = {(float)rank, 1, 2, 3};
  OK(oktopk_allreduce(comm, x, 4, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING));
  REQUIRE(x[0] == (float)(size * (size - 1) / 2) && x[1] == (float)size);
  OK(oktopk_comm_destroy(comm));
  printf("joined: rank %d of %d in %.0f ms\n", rank, size, (now() - t0) * 1000);
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc >= 2 && strcmp(argv[1], "ranks") == 0) return run_ranks();
  if (argc >= 2 && strcmp(argv[1], "errors") == 0) return run_errors();
  if (argc >= 3 && strcmp(argv[1], "cycles") == 0) return run_cycles(atoi(argv[2]));
  if (argc >= 2 && strcmp(argv[1], "peerdeath") == 0) return run_peer_death();
  if (argc >= 3 && strcmp(argv[1], "rejoin") == 0 && strcmp(argv[2], "joiner") == 0) return run_rejoin_joiner();
  if (argc >= 2 && strcmp(argv[1], "rejoin") == 0) return run_rejoin(argv[0], argc >= 3 && strcmp(argv[2], "stop") == 0);
  if (argc >= 2 && strcmp(argv[1], "shrink") == 0) return run_shrink(argc >= 3 && strcmp(argv[2], "stop") == 0);
  if (argc >= 5 && strcmp(argv[1], "memory") == 0)
    return run_memory(argv[2], (size_t)strtoull(argv[3], NULL, 0), atoi(argv[4]), argc >= 6 ? atof(argv[5]) : 0,
                      argc >= 7 ? argv[6] : "float32");
  if (argc >= 2 && strcmp(argv[1], "env") == 0) return run_env(argv);
  if (argc >= 3 && strcmp(argv[1], "join") == 0) return run_join(atoi(argv[2]));
  fprintf(stderr, "usage: %s ranks | errors | cycles N | peerdeath | shrink [stop] | rejoin [stop] | env | join MS | memory ALG N CALLS [LIMIT [DTYPE]]\n",
          argv[0]);
  return 2;
}
