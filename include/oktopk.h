/*
 * oktopk.h — public C ABI of liboktopk: sparse allreduce (Ok-Topk, Li &
 * Hoefler, PPoPP'22), the sparse baselines it is judged against, and dense
 * allreduce, between the ranks of a job started by torchrun, horovodrun,
 * mpirun or Slurm.
 *
 * Modelled on NCCL: an opaque communicator made from a unique id that rank 0
 * creates and the caller distributes by its own means; every call returns an
 * oktopk_result_t; oktopk_get_last_error(comm, ...) gives the detail.
 *
 * Handles are integers, never pointers. Operations on one communicator run in
 * the order they are issued, which must be the same on every rank.
 *
 * The library embeds a Go runtime: load it once per process, never unload it,
 * and never call it from a child created by fork() after it was loaded.
 *
 * Memory. Per tensor reduced sparsely a rank keeps its residual, n float32
 * values whatever the buffer's dtype; per communicator, working memory
 * reused by every call: Ok-Topk's sum of this rank's region (n/P float32
 * values for the largest tensor), Rabenseifner's copy of the buffer (n
 * values, to put back after a failure), and for float16/bfloat16 buffers
 * their float32 copy (n values). Everything else lives for one call: the
 * messages (the dense ring keeps the n values it receives until its last
 * step; dense messages are at most 1 MiB each) and about k entries of
 * sparse working memory. The library sets the Go collector's GOGC to 25
 * when it is loaded, so that its heap stays within a quarter of what it
 * holds (Go's default lets it double); OKTOPK_GOGC (a percentage, or
 * "off"), or Go's own GOGC or GOMEMLIMIT, set in the environment before
 * the library is loaded, replace that setting.
 */
#ifndef OKTOPK_H
#define OKTOPK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ABI version: major changes break callers, minor ones only add. */
#define OKTOPK_VERSION_MAJOR 0
#define OKTOPK_VERSION_MINOR 3
#define OKTOPK_VERSION_PATCH 0
#define OKTOPK_VERSION_CODE \
  (OKTOPK_VERSION_MAJOR * 10000 + OKTOPK_VERSION_MINOR * 100 + OKTOPK_VERSION_PATCH)

typedef enum {
  oktopkSuccess = 0,
  oktopkInvalidArgument = 1, /* null pointer, bad size, k > n, unknown dtype... */
  oktopkInvalidUsage = 2,    /* destroyed handle, call in a forked child...     */
  oktopkSystemError = 3,     /* socket, bind or resolve failure                 */
  oktopkRemoteError = 4,     /* a peer died or reported an error                */
  oktopkTimeout = 5,         /* a peer did not answer within the timeout        */
  oktopkMismatch = 6,        /* ranks issued different calls (n, dtype, algo...) */
  oktopkAborted = 7,         /* communicator aborted, or poisoned by an error   */
  oktopkInternalError = 8,   /* a bug in oktopk: please report                   */
  oktopkInProgress = 9,      /* oktopk_test: the request has not finished yet   */
  oktopkNonFinite = 10       /* the gradient held NaN/Inf on some rank: step skipped, state kept */
} oktopk_result_t;

typedef enum {
  OKTOPK_FLOAT32 = 0,
  OKTOPK_FLOAT16 = 1,
  OKTOPK_BFLOAT16 = 2
} oktopk_dtype_t;

typedef enum {
  OKTOPK_ALGO_DENSE_RING = 0,
  OKTOPK_ALGO_DENSE_RABENSEIFNER = 1,
  OKTOPK_ALGO_OKTOPK = 2,
  OKTOPK_ALGO_TOPKA = 3,
  OKTOPK_ALGO_TOPKDSA = 4,
  OKTOPK_ALGO_SSAR_RECURSIVE_DOUBLE = 5,
  OKTOPK_ALGO_SSAR_SPLIT_ALLGATHER = 6,
  OKTOPK_ALGO_DSAR_SPLIT_ALLGATHER = 7,
  OKTOPK_ALGO_GTOPK = 8,
  OKTOPK_ALGO_GAUSSIANK = 9
} oktopk_algorithm_t;

typedef int64_t oktopk_comm_t;    /* 0 is never a valid communicator */
typedef int64_t oktopk_request_t; /* 0 is never a valid request      */

#define OKTOPK_UNIQUE_ID_BYTES 256
/* Made by rank 0 with oktopk_get_unique_id; copied verbatim to every rank. */
typedef struct {
  char internal[OKTOPK_UNIQUE_ID_BYTES];
} oktopk_unique_id_t;

/* Communicator settings. Always start from oktopk_config_init(&cfg), which
 * fills the defaults and sets `size`; the library reads only the fields that
 * fit in `size`, so old callers keep working when fields are added. Every
 * call that takes a config accepts NULL for the defaults. */
typedef struct {
  uint32_t size;         /* sizeof(oktopk_config_t), set by oktopk_config_init */
  uint32_t version;      /* OKTOPK_VERSION_CODE the caller was built against   */
  int32_t timeout_ms;    /* per-call limit on waiting for a peer (default 60000; 0: none) */
  const char *bind_host; /* address to bind and advertise; NULL: see ifname    */
  const char *ifname;    /* interface whose address to use; NULL: OKTOPK_SOCKET_IFNAME, else 127.0.0.1 */
  int32_t algorithm;     /* oktopk_algorithm_t for oktopk_sparse_allreduce (default OKTOPK) */
  double density;        /* k = ceil(density * n), 0 <= density <= 1 (default 0.01; 0 sends nothing) */
  int32_t tau;           /* Ok-Topk space repartition period (default 64)      */
  int32_t tau_prime;     /* threshold refresh period (default 32)              */
  int32_t value_dtype;   /* precision of sparse values on the wire (default FLOAT32) */
  /* Added in 0.3: it fills what was tail padding, so sizeof(oktopk_config_t)
   * is unchanged and oktopk_config_init never writes past an older caller's
   * struct (which it zeroes). */
  int32_t curve;         /* 1: CURVE-encrypt and authenticate every connection
                          * (all ranks alike; OKTOPK_CURVE=1 has the same effect;
                          * default 0) */
} oktopk_config_t;

/* Per-call statistics (one rank's view). `size` must be set by the caller to
 * sizeof(oktopk_stats_t); pass NULL where not wanted. */
typedef struct {
  uint32_t size;
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t messages_sent;
  uint64_t messages_received;
  int64_t k;               /* target count: ceil(density * n)          */
  int64_t local_selected;  /* entries this rank contributed            */
  int64_t global_selected; /* entries in the global result             */
  float local_threshold;
  float global_threshold;
  double select_seconds;
  double reduce_seconds;    /* split-and-reduce / reduction phase       */
  double allgather_seconds; /* balance + allgatherv / broadcast phase   */
  double total_seconds;
} oktopk_stats_t;

/* ---- library ---------------------------------------------------------- */
int oktopk_get_version(void); /* OKTOPK_VERSION_CODE of the loaded library */
const char *oktopk_get_error_string(oktopk_result_t result);
void oktopk_config_init(oktopk_config_t *config);

/* Copies the message of the most recent failed call on `comm` (comm 0: of
 * any call in the process, including those that take no communicator) into
 * buf, always NUL-terminated; "" when none failed. Returns oktopkSuccess,
 * oktopkInvalidArgument when buf is NULL/len is 0, or oktopkInvalidUsage for
 * a destroyed or unknown comm (buf then says which). Sets *truncated (if not
 * NULL) to 1 when the message did not fit, else 0. */
oktopk_result_t oktopk_get_last_error(oktopk_comm_t comm, char *buf, size_t len, int *truncated);

/* ---- communicator lifecycle ------------------------------------------ */
/* NCCL style: rank 0 calls oktopk_get_unique_id (it starts rendezvous on
 * rank 0's address), sends the id to the other ranks by its own means, then
 * every rank calls oktopk_comm_init_rank. */
oktopk_result_t oktopk_get_unique_id(oktopk_unique_id_t *id, const oktopk_config_t *config);
oktopk_result_t oktopk_comm_init_rank(oktopk_comm_t *comm, int nranks, const oktopk_unique_id_t *id,
                                      int rank, const oktopk_config_t *config);

/* torchrun style: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the
 * environment; rank 0 serves rendezvous on MASTER_PORT + 1 unless
 * OKTOPK_RENDEZVOUS_PORT is set. Without OKTOPK_JOB_TOKEN that rendezvous
 * hands the job token to anyone who can reach the port; have the launcher
 * set OKTOPK_JOB_TOKEN to the same random secret on every rank (e.g. 64 hex
 * digits) and the rendezvous refuses everyone else. OKTOPK_CURVE=1 on every
 * rank encrypts the job's traffic (see oktopk_config_t.curve). */
oktopk_result_t oktopk_comm_init_env(oktopk_comm_t *comm, const oktopk_config_t *config);

/* Two-step init for callers that rendezvous through their own framework
 * (a torch.distributed store, Horovod collectives):
 *   1. rank 0 makes a job token (oktopk_make_token) and shares it;
 *   2. every rank binds and gets its endpoint string (oktopk_comm_bind);
 *   3. the caller gathers all endpoints, in rank order, to every rank;
 *   4. every rank connects (oktopk_comm_connect). */
oktopk_result_t oktopk_make_token(char *buf, size_t len);
oktopk_result_t oktopk_comm_bind(oktopk_comm_t *comm, int nranks, int rank, const char *job_token,
                                 const oktopk_config_t *config, char *endpoint, size_t endpoint_len);
oktopk_result_t oktopk_comm_connect(oktopk_comm_t comm, const char *const *endpoints, int nranks);

oktopk_result_t oktopk_comm_rank(oktopk_comm_t comm, int *rank);
oktopk_result_t oktopk_comm_size(oktopk_comm_t comm, int *size);
/* Fails every blocked and future call on comm with oktopkAborted; callable
 * from any thread. The handle must still be destroyed. */
oktopk_result_t oktopk_comm_abort(oktopk_comm_t comm);
/* Releases the communicator; returns within about a second even when peers
 * are dead. Destroying a handle twice is oktopkInvalidUsage. */
oktopk_result_t oktopk_comm_destroy(oktopk_comm_t comm);

/* ---- collectives (blocking) ------------------------------------------ */
/* Dense allreduce in place; average != 0 divides by the number of ranks.
 * algorithm is OKTOPK_ALGO_DENSE_RING or OKTOPK_ALGO_DENSE_RABENSEIFNER. */
oktopk_result_t oktopk_allreduce(oktopk_comm_t comm, void *data, size_t count, oktopk_dtype_t dtype,
                                 int average, int algorithm);

/* Sparse allreduce of a dense gradient with error feedback, in place: data
 * holds this rank's gradient on entry and the averaged sparse global result
 * (dense, zeros elsewhere) on return. tensor_id names the per-tensor state
 * (residual, thresholds, region boundaries); use the same id for the same
 * tensor on every rank and every iteration. */
oktopk_result_t oktopk_sparse_allreduce(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                        oktopk_dtype_t dtype, oktopk_stats_t *stats);

/* Sparse in, sparse out, no state: in_count (index, value) pairs of a vector
 * of length n, indices strictly increasing and < n. The averaged global
 * result (at most out_capacity pairs, or oktopkInvalidArgument) is written to
 * out_indices/out_values and its length to *out_count. Uses the
 * communicator's algorithm and density. */
oktopk_result_t oktopk_sparse_allreduce_sparse(oktopk_comm_t comm, size_t n, const uint32_t *in_indices,
                                               const float *in_values, size_t in_count,
                                               uint32_t *out_indices, float *out_values,
                                               size_t out_capacity, size_t *out_count,
                                               oktopk_stats_t *stats);

/* ---- collectives (asynchronous) -------------------------------------- */
/* Same as the blocking forms; data must stay valid until the request is
 * waited on. Requests of one communicator complete in issue order. */
oktopk_result_t oktopk_allreduce_start(oktopk_comm_t comm, void *data, size_t count, oktopk_dtype_t dtype,
                                       int average, int algorithm, oktopk_request_t *request);
oktopk_result_t oktopk_sparse_allreduce_start(oktopk_comm_t comm, uint64_t tensor_id, void *data,
                                              size_t count, oktopk_dtype_t dtype, oktopk_request_t *request);
/* oktopkSuccess when done (the request's own result is returned by wait),
 * oktopkInProgress when not yet. */
oktopk_result_t oktopk_test(oktopk_request_t request);
/* Blocks until done; returns the operation's result and fills stats. */
oktopk_result_t oktopk_wait(oktopk_request_t request, oktopk_stats_t *stats);
/* Frees a request; waits for it first if it is still running. */
oktopk_result_t oktopk_request_free(oktopk_request_t request);

/* ---- per-tensor state (checkpointing) -------------------------------- */
/* Serialized state of one tensor (residual, thresholds, boundaries, counter)
 * so a resumed run continues where it stopped. */
oktopk_result_t oktopk_tensor_state_size(oktopk_comm_t comm, uint64_t tensor_id, size_t *size);
oktopk_result_t oktopk_tensor_state_save(oktopk_comm_t comm, uint64_t tensor_id, void *buf, size_t len);
oktopk_result_t oktopk_tensor_state_load(oktopk_comm_t comm, uint64_t tensor_id, const void *buf, size_t len);

/* ---- selection (no communication) ------------------------------------ */
/* Exact top-k by magnitude: the k largest |x| with their indices, ascending
 * by index; ties go to the lower index. NaN in x is oktopkNonFinite; +-Inf
 * rank as the largest magnitudes. */
oktopk_result_t oktopk_topk(const float *x, size_t n, size_t k, uint32_t *indices, float *values);
/* Every entry with |x| > threshold, ascending by index, at most capacity of
 * them (*count tells how many passed; more than capacity is
 * oktopkInvalidArgument with nothing lost). NaN or +-Inf in x is
 * oktopkNonFinite with *count 0. */
oktopk_result_t oktopk_threshold_select(const float *x, size_t n, float threshold, uint32_t *indices,
                                        float *values, size_t capacity, size_t *count);

/* ---- diagnostics ----------------------------------------------------- */
/* Number of goroutines in the library's Go runtime, for leak checks in tests
 * (a count that grows with init/destroy cycles is a leak). Not a stable
 * figure otherwise; -1 in a forked child. */
int oktopk_debug_goroutines(void);

#ifdef __cplusplus
}
#endif
#endif /* OKTOPK_H */
