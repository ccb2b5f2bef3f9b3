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
 * Threads: the collective calls on one communicator (the blocking ones and
 * the _start ones) come from one thread at a time. While calls of one thread
 * are queued or running, a collective call from another thread is refused at
 * once with oktopkInvalidUsage and is not made (it takes no place in the
 * call order, its buffer is untouched); once they have completed, any thread
 * may make the next call. One thread may queue many requests; any thread may
 * test, wait on or free them, save or load tensor state, or abort.
 *
 * Failures, on every rank of a communicator:
 *  - A call refused for its arguments (oktopkInvalidArgument: a NULL or bad
 *    buffer, count, dtype, algorithm or stats size, a tensor whose size
 *    changed, bad sparse-input sizes) still takes its place in the call
 *    order, and the peers are told: a peer that made that call fails it with
 *    oktopkMismatch, naming this rank and the reason, and aborts, so this
 *    rank's next call fails too. When every rank refuses the same call, that
 *    is all: the communicator stays usable. (Refusals that take no place:
 *    an unknown or destroyed handle, another thread's call, a forked child,
 *    a communicator not yet connected. A call beyond 4096 outstanding
 *    requests is oktopkInvalidUsage and aborts the communicator instead.)
 *  - oktopkNonFinite (NaN/Inf on some rank) and a malformed sparse input
 *    (oktopkInvalidArgument on every rank) are agreed by every rank before
 *    data moves: every rank skips the call, and the communicator stays
 *    usable.
 *  - Any other failure (oktopkMismatch, oktopkRemoteError, oktopkTimeout,
 *    oktopkAborted, oktopkInternalError) poisons the communicator on every
 *    rank: every later collective call fails. A rank whose call failed
 *    fails the later ones at once with oktopkAborted; a rank whose copy of
 *    the call completed fails its next call with the cause
 *    (oktopkRemoteError, oktopkMismatch or oktopkTimeout), then oktopkAborted.
 *  - A failed call leaves the caller's buffer and the tensor's state
 *    (residual, thresholds, call count) as they were, on the rank where it
 *    failed. The ranks need not agree on whether it happened: a call that
 *    fails on one rank (aborted, timed out, a peer died, destroyed with
 *    requests in flight) may have completed on others, whose buffers and
 *    tensor states then include it. So after such a failure do not retry
 *    on that communicator, and do not carry on with states saved after the
 *    failure: destroy the communicator on every rank, make a new one, and
 *    load every tensor's state from a checkpoint saved on every rank after
 *    the same successful call (with the model and optimizer of that step).
 *    Loading states that differ by a call is caught, not silent: the first
 *    call on such a tensor fails with oktopkMismatch on "completed calls".
 *
 * The library embeds a Go runtime: load it once per process, never unload it,
 * and never call it from a child created by fork() after it was loaded.
 *
 * Environment settings (OKTOPK_SOCKET_IFNAME, OKTOPK_CURVE, OKTOPK_STALL_WARN,
 * OKTOPK_DEBUG_AUTO, and oktopk_comm_init_env's variables) are read when a
 * call uses them, from
 * the process's environment at that moment: a setenv() made after the
 * library was loaded takes effect.
 *
 * Memory. Per tensor reduced sparsely a rank keeps its residual, n float32
 * values whatever the buffer's dtype, and, while its calls are made with
 * OKTOPK_CALL_UNDOABLE (0.13), a copy of the residual as it was before the
 * latest call, for oktopk_tensor_undo_call: n float32 values more, one
 * buffer reused from call to call, filled on every core at each such call
 * but a tensor's first (5 to 6 ms for 2^24 values on two cores, where an
 * Ok-Topk call at density 0.01 takes about 65 ms); per communicator,
 * working memory reused by every call: Ok-Topk's sum of this rank's
 * region (n/P float32 values for the largest tensor), Rabenseifner's copy of the buffer (n
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
#define OKTOPK_VERSION_MINOR 19
#define OKTOPK_VERSION_PATCH 0
#define OKTOPK_VERSION_CODE \
  (OKTOPK_VERSION_MAJOR * 10000 + OKTOPK_VERSION_MINOR * 100 + OKTOPK_VERSION_PATCH)

typedef enum {
  oktopkSuccess = 0,
  oktopkInvalidArgument = 1, /* null pointer, bad size, k > n, unknown dtype... */
  oktopkInvalidUsage = 2,    /* destroyed handle, another thread's call, fork... */
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
  OKTOPK_BFLOAT16 = 2,
  OKTOPK_INT8 = 3, /* added in 0.16, for config.value_dtype only: no call takes int8 buffers */
  OKTOPK_INT4 = 4  /* added in 0.17, for config.value_dtype only: no call takes int4 buffers */
} oktopk_dtype_t;

/* oktopk_config_t.value_dtype: the precision selected values travel in.
 * OKTOPK_FLOAT16 or OKTOPK_BFLOAT16 make a value 2 bytes instead of 4
 * (indices travel coded as gaps whatever the values, about 1.2 bytes an
 * index at density 1%). Each rank rounds the values it sends once, each
 * Ok-Topk region owner its sums once (every rank uses the owner's rounded
 * sums, so results stay bitwise identical), and the rounding errors go into
 * the residuals (a sum's into its owner's): over any number of calls the
 * gradients' sum equals P x the results plus the residuals' change, up to
 * float32 rounding. Values beyond the format's range saturate and the rest
 * waits in the residual. Or-ing in OKTOPK_STOCHASTIC_ROUNDING rounds
 * unbiasedly at random instead of to nearest; its random bits are a hash of
 * (tensor id, call number on the tensor, rank, index), so reruns are
 * bitwise reproducible. Only OKTOPK_ALGO_OKTOPK, _TOPKA and _GAUSSIANK take
 * 16-bit values (the others forward partial sums whose rounding no one
 * residual could take back, or keep no residual), and since 0.6
 * OKTOPK_ALGO_AUTO, which then chooses among Ok-Topk, TopkA and the dense
 * allreduces (these send float32): config init refuses other algorithms
 * with them, and oktopk_sparse_allreduce_sparse (no
 * residual) refuses them. At density 1 Ok-Topk is a dense ring allreduce
 * in float32. Every rank must use the same value_dtype (else every rank's
 * first call fails with oktopkMismatch).
 *
 * OKTOPK_INT8 (since 0.16) makes a value a byte: each block of 32 values of
 * a message shares a power-of-two scale (4 bytes), so a pair with its coded
 * index is about 2.3 bytes at density 1%, against 8 for 32-bit indices and
 * values. The values are rounded to nearest as each message is made, and
 * every error is kept exactly: a rank's own selected values in its residual,
 * an Ok-Topk owner's sums in the owner's, and each rank's balanced share,
 * which it rounds once more as it allgathers it, in that rank's. The same
 * algorithms take it as the 16-bit values; OKTOPK_STOCHASTIC_ROUNDING does
 * not combine with it.
 *
 * OKTOPK_INT4 (since 0.17) is OKTOPK_INT8 with 4-bit codes (-7 to 7), two
 * to a byte: a block of 32 values takes 16 bytes and its 4-byte scale, so a
 * pair with its coded index is about 1.8 bytes at density 1%. A value moves
 * by at most 1/14 of its block's largest magnitude (8 bits: 1/254), and the
 * rest waits in the residual exactly as for OKTOPK_INT8, by the same rules;
 * the same algorithms take it. A peer of 0.16 or earlier refuses its
 * messages as bad frames. */
#define OKTOPK_STOCHASTIC_ROUNDING 0x100

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
  OKTOPK_ALGO_GAUSSIANK = 9,
  /* 0.4: per call, the algorithm a cost model predicts fastest from n, k,
   * the number of ranks and the link measured (oktopk_comm_measure_link) —
   * the same choice on every rank. The first call with it on a
   * communicator measures the link first, as a collective step of its own.
   * Accepted by oktopk_allreduce too (ring or Rabenseifner).
   * OKTOPK_DEBUG_AUTO=1 logs every choice to stderr. */
  OKTOPK_ALGO_AUTO = 10
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
  const char *ifname;    /* interface whose address to use; NULL: OKTOPK_SOCKET_IFNAME, else (init_env,
                          * init_rank) the address on the route to the rendezvous host, else 127.0.0.1 */
  int32_t algorithm;     /* oktopk_algorithm_t for oktopk_sparse_allreduce (default OKTOPK) */
  double density;        /* k = ceil(density * n), 0 <= density <= 1 (default 0.01; 0 sends nothing);
                          * a product within a relative 2^-40 above an integer counts as that
                          * integer, so rounding in a double never adds an entry: 0.07 * 100 is 7 */
  int32_t tau;           /* Ok-Topk space repartition period (default 64)      */
  int32_t tau_prime;     /* threshold refresh period (default 32)              */
  int32_t value_dtype;   /* precision of sparse values on the wire: an oktopk_dtype_t, optionally
                          * | OKTOPK_STOCHASTIC_ROUNDING (default FLOAT32; see above) */
  /* Added in 0.3: it fills what was tail padding, so sizeof(oktopk_config_t)
   * is unchanged and oktopk_config_init never writes past an older caller's
   * struct (which it zeroes). */
  int32_t curve;         /* 1: CURVE-encrypt and authenticate every connection
                          * (all ranks alike; OKTOPK_CURVE=1 has the same effect;
                          * default 0) */
} oktopk_config_t;

/* Per-call statistics (one rank's view). `size` must be set by the caller to
 * sizeof(oktopk_stats_t); pass NULL where not wanted. The library writes only
 * the fields that fit in `size`, so a caller built against an older header
 * gets the fields it knows.
 *
 * The *_seconds fields cut the call into phases that run back to back and
 * mean the same work in every algorithm (a phase an algorithm lacks is 0):
 * select (acc = grad + residual, then the local selection), agree (the
 * NaN/Inf agreement), reduce, global_select, balance, allgather and output
 * (the caller's buffer and the residual). Together they add up to
 * total_seconds, less the few microseconds before the algorithm starts. */
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
  double select_seconds;    /* accumulate + local selection             */
  double reduce_seconds;    /* split-and-reduce / reduction phase       */
  double allgather_seconds; /* balance + allgatherv / broadcast phase
                             * (before 0.4 it held Ok-Topk's global
                             * selection too, now global_select_seconds) */
  double total_seconds;
  /* Added in 0.4: the phases the fields above leave out. */
  double agree_seconds;         /* NaN/Inf agreement among the ranks        */
  double global_select_seconds; /* Ok-Topk's histogram cut                  */
  double balance_seconds;       /* Ok-Topk's balance (in allgather_seconds) */
  double output_seconds;        /* result into the buffer, residual         */
  /* ---- added in 0.4: which algorithm ran (OKTOPK_ALGO_AUTO's choice) ---- */
  int32_t algorithm;        /* oktopk_algorithm_t that ran; never OKTOPK_ALGO_AUTO */
  double predicted_seconds; /* the cost model's time for it (compare total_seconds);
                             * 0 while the communicator's link is unmeasured */
  /* ---- added in 0.5: xi, measured on request (OKTOPK_CALL_MEASURE_XI) ---- */
  double xi;               /* ||Topk(sum_r acc_r) - P x result|| / ||sum_r grad_r||, acc_r =
                            * grad_r + residual_r before the call, Topk the exact top-k (the
                            * call's k) of the sum: Assumption 1 of the Ok-Topk paper. The same
                            * on every rank; -1 when not measured (not asked for, or a dense
                            * algorithm ran by request, which selects nothing) */
  double xi_gradient_norm; /* ||sum_r grad_r||, xi's denominator (to combine tensors); -1 when
                            * xi was not measured */
  /* ---- added in 0.7: the traffic of xi's measurement, apart from bytes_sent/received,
   * which count the algorithm's own (what the paper's bounds count); 0 when xi was not
   * measured ---- */
  uint64_t xi_bytes_sent;
  uint64_t xi_bytes_received;
} oktopk_stats_t;

/* The link model behind OKTOPK_ALGO_AUTO, the same on every rank. `size`
 * must be set by the caller to sizeof(oktopk_link_model_t). */
typedef struct {
  uint32_t size;
  double latency_seconds;       /* alpha: per message                         */
  double seconds_per_byte;      /* beta: per byte one rank sends              */
  double pass_seconds_per_byte; /* gamma: per byte a pass over memory touches */
} oktopk_link_model_t;

/* ---- library ---------------------------------------------------------- */
int oktopk_get_version(void); /* OKTOPK_VERSION_CODE of the loaded library */
const char *oktopk_get_error_string(oktopk_result_t result);
/* The name of an oktopk_algorithm_t ("oktopk", "auto", ...), or NULL for a
 * value this library does not know; the string is static. */
const char *oktopk_algorithm_name(int algorithm);
/* 1 when an algorithm takes 16-bit values (config.value_dtype float16 or
 * bfloat16: those whose every rounding has a rank whose residual takes its
 * error, and auto, which then chooses among them and the dense ones), 0
 * when it takes float32 only, -1 for a value this library does not know.
 * Added in 0.9. */
int oktopk_algorithm_takes_reduced_values(int algorithm);
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
 * every rank calls oktopk_comm_init_rank. The rendezvous lasts until the
 * process that made the id has called oktopk_comm_init_rank with it: the
 * communicator then owns it, or, when that call failed, it is closed (make
 * a new id to try again). */
oktopk_result_t oktopk_get_unique_id(oktopk_unique_id_t *id, const oktopk_config_t *config);
oktopk_result_t oktopk_comm_init_rank(oktopk_comm_t *comm, int nranks, const oktopk_unique_id_t *id,
                                      int rank, const oktopk_config_t *config);

/* From the launcher's environment: torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
 * MASTER_PORT), Open MPI's mpirun (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK),
 * MPICH/PMI (PMI_RANK, PMI_SIZE) or Slurm's srun (SLURM_PROCID, SLURM_NTASKS,
 * SLURM_LOCALID), the first of these whose rank variable is set. Rank 0
 * serves rendezvous on MASTER_ADDR; without it, on the first host of Slurm's
 * SLURM_STEP_NODELIST, or on 127.0.0.1 when mpirun says every rank is on
 * this host; otherwise set MASTER_ADDR (mpirun -x MASTER_ADDR=host). The
 * port is OKTOPK_RENDEZVOUS_PORT, else MASTER_PORT + 1, else 20000 +
 * SLURM_JOB_ID mod 9000 under Slurm, else 29501. With no bind host or
 * interface configured, each rank binds its address on the route to the
 * rendezvous host. A failure names the launcher and the address it used.
 * Without OKTOPK_JOB_TOKEN that rendezvous
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
 * from any thread. The handle must still be destroyed. Peers' calls fail
 * too; the running call may still complete on some of them (see Failures). */
oktopk_result_t oktopk_comm_abort(oktopk_comm_t comm);
/* Releases the communicator; returns within one second (0.75 s by design,
 * on a machine that is not overloaded), even when peers are dead or a call is
 * running: queued and running calls are aborted, a running call gets 0.5 s
 * to return, then the sockets close (under it, if it is still busy with its
 * own computation; it then ends with an error, and its request must still
 * be waited on) within 0.25 s more, of which the last frames to peers get
 * up to 0.2 s to leave. An idle communicator is closed without the 0.5 s.
 * Destroying a handle twice is oktopkInvalidUsage. */
oktopk_result_t oktopk_comm_destroy(oktopk_comm_t comm);
/* Measures the link (latency, time per byte, cost of a memory pass) with a
 * few ping-pongs between ranks half the communicator apart, agrees on one
 * model with every rank and keeps it for OKTOPK_ALGO_AUTO; fills *link when
 * not NULL. A collective call: every rank makes it at the same point of its
 * call order (it fails like one, see Failures). The first OKTOPK_ALGO_AUTO
 * call measures by itself; call this to measure again (the network changed,
 * or before timing calls). Each pair of ranks exchanges a few small messages
 * and 1 MiB each way, and every rank times a few passes over 12 MiB: about
 * 0.1 s at 200 Mbit/s, a few milliseconds on loopback, once every rank has
 * made the call (like any collective, it waits for the slowest rank, up to
 * the timeout). */
oktopk_result_t oktopk_comm_measure_link(oktopk_comm_t comm, oktopk_link_model_t *link);
/* Added in 0.13. The link model this communicator's OKTOPK_ALGO_AUTO calls
 * choose by: *measured is 1 and *link filled when one was measured (by
 * oktopk_comm_measure_link or the first auto call) or set, else 0. Local.
 * With oktopk_comm_set_link it lets a resumed job, or a communicator made
 * again, choose as the saved one did, rather than measure a link that may
 * come out slightly different (a different algorithm where two are close). */
oktopk_result_t oktopk_comm_get_link(oktopk_comm_t comm, oktopk_link_model_t *link, int *measured);
/* Added in 0.13. Installs a link model for OKTOPK_ALGO_AUTO instead of a
 * measurement (every figure finite and >= 0, else oktopkInvalidArgument).
 * Local: tell no peer. Every rank must set the same figures at the same
 * point of its call order (one rank's oktopk_comm_get_link, saved on every
 * rank, is the same on every rank: the measurement is agreed), or their
 * auto calls may choose differently, which fails those calls with
 * oktopkMismatch. */
oktopk_result_t oktopk_comm_set_link(oktopk_comm_t comm, const oktopk_link_model_t *link);
/* Added in 0.4. Sets *count to what this rank has refused so far:
 * connections to its port that did not authenticate (no or a wrong job token
 * or CURVE key, not oktopk at all, a handshake frame over the size limit, a
 * handshake not done within 5 s; one still in its handshake counts until it
 * succeeds) and frames that failed validation. Refused traffic never
 * reaches a call: a nonzero count says only that something other than this
 * job's ranks reached the port. Readable until the handle is destroyed,
 * after an abort too. */
oktopk_result_t oktopk_comm_dropped(oktopk_comm_t comm, uint64_t *count);

/* ---- collectives (blocking) ------------------------------------------ */
/* Dense allreduce in place; average != 0 divides by the number of ranks.
 * algorithm is OKTOPK_ALGO_DENSE_RING, OKTOPK_ALGO_DENSE_RABENSEIFNER or
 * OKTOPK_ALGO_AUTO (the faster of the two by the link model). */
oktopk_result_t oktopk_allreduce(oktopk_comm_t comm, void *data, size_t count, oktopk_dtype_t dtype,
                                 int average, int algorithm);

/* Sparse allreduce of a dense gradient with error feedback, in place: data
 * holds this rank's gradient on entry and the averaged sparse global result
 * (dense, zeros elsewhere) on return. tensor_id names the per-tensor state
 * (residual, thresholds, region boundaries); use the same id for the same
 * tensor on every rank and every iteration. */
oktopk_result_t oktopk_sparse_allreduce(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                        oktopk_dtype_t dtype, oktopk_stats_t *stats);

/* oktopk_sparse_allreduce with hold_count ranges of data held back by this
 * rank for this call: range i is [hold[2i], hold[2i+1]), ascending and
 * disjoint, inside count. Held entries are not selected or sent, and this
 * rank's gradient there is added to its residual; other ranks' entries there
 * are reduced as usual. For entries whose result the caller discards, such
 * as a parameter a framework found unused at this step (PyTorch DDP leaves
 * the gradient of a parameter unused on every rank untouched): error
 * feedback then loses nothing of them. hold may be NULL when hold_count is
 * 0. Dense algorithms keep no residual and reduce held entries as usual. */
oktopk_result_t oktopk_sparse_allreduce_hold(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                             oktopk_dtype_t dtype, const size_t *hold, size_t hold_count,
                                             oktopk_stats_t *stats);

/* Added in 0.5: per-call options of oktopk_sparse_allreduce_ex. Zero the
 * struct, set `size` to sizeof(oktopk_call_options_t), then the flags and the
 * fields they name; the library reads only the fields that fit in `size`.
 * Every rank must pass the same density, tau_prime and flags in the same call (a rank
 * that differs fails the call with oktopkMismatch on every rank, which
 * leaves every buffer and tensor state as it was). */
#define OKTOPK_CALL_DENSITY 0x1    /* this call's k is ceil(density * n), not the communicator's */
#define OKTOPK_CALL_MEASURE_XI 0x2 /* measure xi into the stats (see oktopk_stats_t.xi): the call
                                    * first sums this rank's gradient and gradient + residual over
                                    * the ranks (a dense allreduce of 2 x count values, counted in
                                    * the stats' xi_bytes_sent and xi_bytes_received since 0.7),
                                    * then runs as it would without, with a bitwise identical
                                    * result */
#define OKTOPK_CALL_TAU_PRIME 0x4  /* added in 0.6: this call's tau_prime, not the communicator's:
                                    * Ok-Topk selects exactly when the tensor's completed calls are
                                    * a multiple of it (an adaptive tau'; ranks whose tau' makes one
                                    * call exact and another not fail with oktopkMismatch) */
#define OKTOPK_CALL_SPARSE_ONLY 0x8 /* added in 0.8: with OKTOPK_ALGO_AUTO, choose among the sparse
                                    * algorithms only, never a dense one: for a caller that weighs
                                    * sparse against a dense allreduce of its own (NCCL's) */
#define OKTOPK_CALL_UNDOABLE 0x10  /* added in 0.13: keep what oktopk_tensor_undo_call needs to take
                                    * this call back: a copy of the tensor's residual before the call
                                    * (see Memory at the top). Local: ranks need not agree on it. For a
                                    * caller that reduces a step as several tensors and skips the step
                                    * when any of them comes back oktopkNonFinite */
typedef struct {
  uint32_t size;       /* sizeof(oktopk_call_options_t) */
  uint32_t flags;      /* OKTOPK_CALL_* or-ed; other bits are oktopkInvalidArgument */
  double density;      /* with OKTOPK_CALL_DENSITY: 0 <= density <= 1, as oktopk_config_t.density */
  const size_t *hold;  /* hold_count ranges held back, as oktopk_sparse_allreduce_hold */
  size_t hold_count;
  /* ---- added in 0.6 ---- */
  int32_t tau_prime;   /* with OKTOPK_CALL_TAU_PRIME: >= 1, as oktopk_config_t.tau_prime */
} oktopk_call_options_t;

/* oktopk_sparse_allreduce with per-call options (NULL: none, the same as
 * oktopk_sparse_allreduce). A density schedule passes each call's density
 * here; the tensor's thresholds carry over when k changes between calls. */
oktopk_result_t oktopk_sparse_allreduce_ex(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                           oktopk_dtype_t dtype, const oktopk_call_options_t *options,
                                           oktopk_stats_t *stats);

/* Sparse in, sparse out, no state: in_count (index, value) pairs of a vector
 * of length n, indices strictly increasing and < n. The averaged global
 * result is written to out_indices/out_values and its length to *out_count.
 * A result longer than out_capacity is oktopkInvalidArgument with *out_count
 * set and nothing written; the call itself completed on every rank, and the
 * communicator stays usable. Uses the communicator's algorithm and density.
 * Memory and time follow in_count and the number of ranks, not n (any n up
 * to 2^32 - 1). */
oktopk_result_t oktopk_sparse_allreduce_sparse(oktopk_comm_t comm, size_t n, const uint32_t *in_indices,
                                               const float *in_values, size_t in_count,
                                               uint32_t *out_indices, float *out_values,
                                               size_t out_capacity, size_t *out_count,
                                               oktopk_stats_t *stats);

/* ---- collectives (asynchronous) -------------------------------------- */
/* Same as the blocking forms; data must stay valid until the request is
 * waited on. Requests of one communicator complete in issue order. At most
 * 4096 may be outstanding (see Failures at the top). */
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
 * so a resumed run continues where it stopped. A state belongs to the rank
 * that saved it and to its communicator's size (the blob records both):
 * every rank saves and loads its own, and loading one saved by another rank
 * or by a communicator of another size is oktopkInvalidArgument (nothing is
 * installed). The blob carries a CRC-32C of its bytes: a corrupted one is
 * oktopkInvalidArgument too, its message saying so. Save and load run in issue order with this thread's calls,
 * and still work after a failure: each rank then holds the state of the
 * calls it completed, which may differ by the failed call from rank to rank
 * (see Failures at the top). */
oktopk_result_t oktopk_tensor_state_size(oktopk_comm_t comm, uint64_t tensor_id, size_t *size);
oktopk_result_t oktopk_tensor_state_save(oktopk_comm_t comm, uint64_t tensor_id, void *buf, size_t len);
oktopk_result_t oktopk_tensor_state_load(oktopk_comm_t comm, uint64_t tensor_id, const void *buf, size_t len);
/* Added in 0.18. Loads a state this process saved under a communicator of
 * another size (or another rank number) of the same job: the job went on
 * without a lost rank, or took one back, and this rank's residual, its own
 * unsent gradient, comes with it whole. What depends on the rank count is
 * dropped (region boundaries, thresholds) and the call count starts again
 * at 0, so the tensor's next call selects exactly and partitions afresh:
 * every rank of the new communicator must load every tensor so before it.
 * Which process saved it cannot be checked (the rank numbers moved): load
 * only this process's own. Malformed or corrupted is oktopkInvalidArgument. */
oktopk_result_t oktopk_tensor_state_load_regrouped(oktopk_comm_t comm, uint64_t tensor_id, const void *buf, size_t len);

/* Added in 0.18. After a lost rank (a call failed with oktopkRemoteError,
 * oktopkTimeout or oktopkAborted), every survivor calls this on its
 * communicator, as ULFM's MPI_Comm_shrink: the survivors meet in the store
 * they first met through (oktopk_comm_init_env's or the unique id's, whose
 * host must still be up: rank 0, or the process that made the id) and make
 * *newcomm of their own, numbered in their old order, with a new token and
 * generation. Each waits until all but one of comm's ranks have come, or
 * until the timeout (two or more lost). Every tensor's state comes along,
 * regrouped (oktopk_tensor_state_load_regrouped): this rank's residual is
 * kept whole. comm is aborted; destroy it after (the rendezvous server
 * rank 0 serves stays with *newcomm). A rank that comes after the survivors
 * agreed (stopped longer than the timeout) gets oktopkRemoteError and no
 * communicator. A communicator made by oktopk_comm_bind and
 * oktopk_comm_connect has no store: oktopkInvalidUsage. */
oktopk_result_t oktopk_comm_shrink(oktopk_comm_t comm, oktopk_comm_t *newcomm);

/* Added in 0.18. A lost rank comes back: a new process, started with the
 * launcher's variables of that rank (as oktopk_comm_init_env reads them),
 * calls oktopk_comm_join, which asks in the store rank 0 serves and waits
 * (at most the config's timeout) until the members admit it. The members
 * call oktopk_comm_admit, all at the same point of their work (every N
 * steps, say): *newcomm is 0 when nobody asked since the last admit, else
 * a communicator of the members and the joiners, numbered by their ranks
 * in the original communicator, the members' tensor states regrouped
 * (residuals whole), the joiners' empty; destroy comm after. A process
 * that names a rank that is not lost is refused (oktopkInvalidUsage on its
 * side). What else the joiner needs (the model, the optimizer) is the
 * application's to send, over *newcomm. */
oktopk_result_t oktopk_comm_join(oktopk_comm_t *comm, const oktopk_config_t *config);
oktopk_result_t oktopk_comm_admit(oktopk_comm_t comm, oktopk_comm_t *newcomm);

/* Added in 0.8. Hands tensor_id's residual to a caller that reduces this step with a
 * dense allreduce of its own (NCCL's, a framework's), so that switching
 * between that and the sparse calls loses nothing: data += residual outside
 * the hold ranges (as in oktopk_sparse_allreduce_hold), rounded to dtype,
 * and the residual keeps only the held entries and what that rounding lost.
 * A tensor without state has nothing to fold (oktopkSuccess, data
 * unchanged). When some data + residual outside hold is NaN or Inf, neither
 * changes: the caller's dense sum is then non-finite and the step skipped,
 * and the residual waits. Local (no communication, not one of the tensor's
 * calls); runs in issue order with this thread's calls, from any thread. */
oktopk_result_t oktopk_tensor_residual_fold(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                            oktopk_dtype_t dtype, const size_t *hold, size_t hold_count);

/* Added in 0.12. Undoes tensor_id's latest oktopk_tensor_residual_fold for a
 * caller whose dense sum came out NaN or Inf (a non-finite gradient on any
 * rank: the step is skipped), so that on every rank the residual is again
 * what it was before the step, as after a sparse call skipped for the same
 * reason; a rank's own non-finite sum already left its residual unchanged.
 * Call it before the tensor's next call: a call or a load in between, or no
 * fold since the last one, leaves nothing to undo (oktopkSuccess). Local,
 * like the fold. */
oktopk_result_t oktopk_tensor_residual_unfold(oktopk_comm_t comm, uint64_t tensor_id);

/* Added in 0.14. Copies tensor_id's residual into data (count float32
 * values, the tensor's length), changing nothing: for a caller that reads,
 * after a call, which entries it took (their residual is now 0), as
 * momentum factor masking does, in one pass. A tensor without state (no
 * sparse call or load yet) has a zero residual; a caller-selected tensor's
 * residual is the caller's (oktopkInvalidArgument). Local, like the fold. */
oktopk_result_t oktopk_tensor_residual_read(oktopk_comm_t comm, uint64_t tensor_id, float *data, size_t count);

/* Added in 0.15. Marks in zero (n bytes, n the tensor's length) the
 * entries of tensor_id's residual that are exactly 0 (1; others 0): after a
 * call, those it took from this rank and those that have held nothing
 * since. Given before, the marks of an earlier read (NULL: none), it also
 * writes into became, ascending, the entries marked now and not then, as
 * many as capacity holds, and sets *count to how many there are, as
 * snprintf counts: the entries that left after waiting in the residual,
 * about k of them, which momentum factor masking stops. One pass over the
 * residual, where oktopk_tensor_residual_read and comparing the copy take
 * five. A tensor without state (no sparse call or load yet) has a zero
 * residual; a caller-selected tensor's residual is the caller's
 * (oktopkInvalidArgument). Changes nothing; local, like the fold. */
oktopk_result_t oktopk_tensor_residual_zeros(oktopk_comm_t comm, uint64_t tensor_id, size_t n, const uint8_t *before,
                                             uint8_t *zero, int64_t *became, size_t capacity, size_t *count);

/* Added in 0.13. Takes back tensor_id's latest sparse call, made with
 * OKTOPK_CALL_UNDOABLE (oktopk_sparse_allreduce_ex; every
 * oktopk_sparse_allreduce_selected is undoable), which completed, for a
 * caller that skips that call's step after all: a step reduced as several
 * tensors (a framework's buckets) where another tensor's call came back
 * oktopkNonFinite on every rank, so the whole step is void. The tensor's
 * residual, thresholds, region boundaries, settings and call count are
 * again bitwise what they were before the call (a tensor that call created
 * has no state again), and the calls that follow behave as if it never
 * happened: what the call sent of the residual waits in it again, and the
 * skipped step's gradient goes with the step (the caller discards the
 * call's result). A caller-selected tensor's residual is the caller's to
 * put back. Take back the same calls on every rank (every rank sees the same
 * oktopkNonFinite), before the tensor's next call. Nothing to take back
 * (oktopkSuccess, nothing changes) when the latest call failed (it left the
 * state as it was), after a load, after a second undo, after an
 * oktopk_tensor_residual_fold not undone by its oktopk_tensor_residual_unfold,
 * or for a tensor without state. A latest call that completed without
 * OKTOPK_CALL_UNDOABLE kept nothing to take it back with: oktopkInvalidUsage,
 * and nothing changes. Local (no communication, not one of the tensor's
 * calls); runs in issue order with this thread's calls, from any thread. */
oktopk_result_t oktopk_tensor_undo_call(oktopk_comm_t comm, uint64_t tensor_id);

/* ---- caller-selected sparse allreduce (added in 0.10) ------------------ */
/* Ok-Topk with error feedback for a caller whose gradient and residual live
 * where the library does not read them (a GPU's memory): only the selected
 * pairs come in, and only the result and what the residual needs go out.
 * Per tensor_id the library keeps the local and global thresholds, the
 * region boundaries and the call count; the caller keeps the residual and,
 * each call:
 *
 *  1. asks oktopk_selection_plan for k, whether the call is exact (every
 *     tau' calls) and the local threshold to reuse;
 *  2. forms acc = gradient + residual (float32) and, when acc is finite,
 *     selects by the library's rules (oktopk_threshold_select's): on an
 *     exact call, or with threshold 0, the exact top-k of |acc| (ties to
 *     the lower index), and the new threshold is the (k+1)-th largest |acc|
 *     (0 when k = n); otherwise |acc| > threshold; while more than 4k/3 pass,
 *     threshold *= 1.03 (float32) and reselect, at most 4 times; still more
 *     than 4k/3, or fewer than k/2: the exact top-k as above; else the
 *     threshold is nudged for the next call: *= 0.97 below 4k/5 entries,
 *     *= 1.03 above 5k/4;
 *  3. calls oktopk_sparse_allreduce_selected with the selection (ascending)
 *     and the new threshold;
 *  4. on success sets residual = acc, then residual[i] -= consumed value at
 *     each consumed index, then residual[i] += error value at each error
 *     index (a sum that is NaN or Inf becomes 0), and its output = 0 with the
 *     result's values at the result's indices. On failure it keeps its
 *     residual: the tensor's state is unchanged.
 *
 * The same inputs give the same bits as oktopk_sparse_allreduce_ex with
 * OKTOPK_ALGO_OKTOPK. A tensor id is used with one form only. */
typedef struct {
  uint64_t k;      /* entries to select: ceil(density * n) */
  int32_t exact;   /* nonzero: select the exact top-k */
  float threshold; /* otherwise: the threshold to reuse (0: select exactly) */
} oktopk_selection_plan_t;

/* The constants of the selection rules above (4/3, 1.03, 4, 1/2, 4/5 and
 * 0.97, 5/4 and 1.03), from the library itself, for a caller that selects
 * by them: the factors are float32, the count bounds double (a count c
 * passes "more than 4k/3" when c > too_many * k in double). */
typedef struct {
  double too_many;
  float raise;
  int32_t max_raises;
  double too_few;
  double nudge_low;
  float nudge_down;
  double nudge_high;
  float nudge_up;
} oktopk_selection_rules_t;
void oktopk_selection_rules(oktopk_selection_rules_t *rules);

/* The plan of tensor_id's next caller-selected call on n elements, with
 * that call's options (density and tau_prime; other flags are ignored).
 * Local; runs in issue order with this thread's calls. A tensor the call
 * will refuse (another n, a state of the other form) gets an exact plan,
 * so that the call is made and refused on every rank rather than left to
 * the peers' timeout. */
oktopk_result_t oktopk_selection_plan(oktopk_comm_t comm, uint64_t tensor_id, size_t n,
                                      const oktopk_call_options_t *options, oktopk_selection_plan_t *plan);

/* The most entries a caller-selected call returns as result or errors, for
 * n elements, k selected and `ranks` ranks: every rank's selection counted
 * whole (at most 4k/3 each), and at most n. */
size_t oktopk_selected_capacity(size_t n, size_t k, int ranks);

typedef struct {
  uint32_t size;              /* sizeof(oktopk_selected_t) */
  /* in: this rank's selection of acc, ascending, at most 4k/3 entries */
  const uint32_t *indices;
  const float *values;
  size_t count;
  float threshold;            /* the local threshold the rules left, for the next call */
  int32_t non_finite;         /* nonzero: acc holds NaN or Inf (count 0): every rank skips
                               * the step with oktopkNonFinite */
  /* out (capacities in entries; result and errors at least
   * oktopk_selected_capacity, consumed at least count) */
  uint32_t *result_indices;   /* the averaged global result, ascending */
  float *result_values;
  size_t result_capacity;
  size_t result_count;
  uint32_t *consumed_indices; /* this rank's selected entries in the result, with the value */
  float *consumed_values;     /* that left (rounded to 16 bits if the values travel so) */
  size_t consumed_capacity;
  size_t consumed_count;
  uint32_t *error_indices;    /* the rounding errors of this rank's sums as an owner */
  float *error_values;        /* (16-bit values only) */
  size_t error_capacity;
  size_t error_count;
} oktopk_selected_t;

/* One caller-selected call on tensor_id (n elements; dtype is the caller's
 * gradient type, checked across ranks). options as oktopk_sparse_allreduce_ex's
 * (density, tau_prime; hold and measure_xi are refused: leave held entries
 * out of the selection). The communicator's algorithm must be
 * OKTOPK_ALGO_OKTOPK or OKTOPK_ALGO_AUTO (Ok-Topk here). */
oktopk_result_t oktopk_sparse_allreduce_selected(oktopk_comm_t comm, uint64_t tensor_id, size_t n, oktopk_dtype_t dtype,
                                                 const oktopk_call_options_t *options, oktopk_selected_t *io,
                                                 oktopk_stats_t *stats);

/* Checkpoints of a caller-selected tensor, in oktopk_tensor_state_save's
 * format (its size from oktopk_tensor_state_size): save takes the caller's
 * residual (n float32); load installs the state for caller-selected calls
 * and writes its residual into the caller's n floats. A blob saved either
 * way loads either way. */
oktopk_result_t oktopk_tensor_state_save_residual(oktopk_comm_t comm, uint64_t tensor_id, const float *residual, size_t n,
                                                  void *buf, size_t len);
oktopk_result_t oktopk_tensor_state_load_residual(oktopk_comm_t comm, uint64_t tensor_id, const void *buf, size_t len,
                                                  float *residual, size_t n);

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

/* ---- blockwise rounding (no communication; added in 0.19) ----------- */
/* The local work of a quantized allreduce with error feedback (the PyTorch
 * plugin's 4-bit path), one pass each. n is a multiple of block; block a
 * multiple of 8, at most 4096; bits 2, 4 or 8.
 *
 * oktopk_quantize_blocks: acc = x + residual (residual NULL: x). Per block,
 * its scale is the largest |acc| rounded to bfloat16 (ties to even), written
 * as bfloat16 bits to scales (2 bytes a block, any alignment); s is that
 * scale, at least FLT_MIN. Each value is rounded to the nearest level
 * (ties to even) of step s / half, half = 2^(bits-1) - 1, clamped to
 * [-half, half]; codes gets level + half, bits each, 8/bits to a byte, the
 * first in the low bits (n * bits / 8 bytes); new_residual (may be x or
 * residual) gets acc - level * step. A NaN or Inf in acc sets *nonfinite
 * to 1 (else 0; nonfinite may be NULL), and its block is rounded as if NaN
 * were 0 and +-Inf +-FLT_MAX; its new residual then means nothing.
 *
 * oktopk_dequantize_blocks: out gets what the codes stand for, level * (s /
 * half): for the sender's own codes, acc - new_residual, bitwise. */
oktopk_result_t oktopk_quantize_blocks(const float *x, const float *residual, size_t n, int bits, size_t block,
                                       uint8_t *codes, void *scales, float *new_residual, int *nonfinite);
oktopk_result_t oktopk_dequantize_blocks(const uint8_t *codes, const void *scales, size_t n, int bits, size_t block,
                                         float *out);

/* ---- cost model (no communication; added in 0.11) ------------------- */
/* The cost model OKTOPK_ALGO_AUTO chooses by, for one call on a link the
 * caller describes (a link measured by oktopk_comm_measure_link, or one
 * planned): *seconds is the predicted time of a call of `algorithm` on a
 * dense float32 gradient of n elements over nranks ranks with config's
 * density, tau and tau_prime (NULL: the defaults), *bytes_per_rank the
 * bytes one rank sends on the call's critical path (gTopk's root, which
 * sends the most, in its tree), and *algorithm_run the algorithm that would
 * run: `algorithm` itself, or OKTOPK_ALGO_AUTO's choice. The terms are
 * rounds x latency + bytes x seconds_per_byte + bytes of memory passes x
 * pass_seconds_per_byte, counted from this library's implementations, one
 * link for every pair of ranks. algorithm_run and bytes_per_rank may be
 * NULL. */
oktopk_result_t oktopk_predict_call(const oktopk_link_model_t *link, int algorithm, int64_t n, int nranks,
                                    const oktopk_config_t *config, int *algorithm_run, double *seconds,
                                    double *bytes_per_rank);

/* ---- diagnostics ----------------------------------------------------- */
/* Number of goroutines in the library's Go runtime, for leak checks in tests
 * (a count that grows with init/destroy cycles is a leak). Not a stable
 * figure otherwise; -1 in a forked child. */
int oktopk_debug_goroutines(void);

#ifdef __cplusplus
}
#endif
#endif /* OKTOPK_H */
