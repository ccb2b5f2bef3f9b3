// The exported C ABI. Each function here refuses a child made by fork()
// after the library was loaded, then calls the Go export that does the work
// (go_oktopk_*, kept local to the library by exports.map).
//
// The refusal has to happen here, in C, before any Go code runs: entering
// the Go runtime in such a child can block forever, because the child has
// only the forking thread, while the runtime's processors and locks may
// still belong to threads that exist only in the parent. A check inside a
// Go export comes too late, after the runtime has been entered.
#include <string.h>
#include <unistd.h>

#include "_cgo_export.h"

static pid_t load_pid;

__attribute__((constructor)) static void remember_load_pid(void) { load_pid = getpid(); }

static int forked_child(void) { return getpid() != load_pid; }

static const char forked_message[] =
    "oktopk: called in a child process created by fork() after the library was loaded; "
    "the Go runtime does not survive fork: use the spawn or forkserver start method, or load oktopk in the child";

int oktopk_get_version(void) { return OKTOPK_VERSION_CODE; }

const char *oktopk_get_error_string(oktopk_result_t result) {
  static const char *const strings[] = {
      [oktopkSuccess] = "success",
      [oktopkInvalidArgument] = "invalid argument",
      [oktopkInvalidUsage] = "invalid usage",
      [oktopkSystemError] = "system error",
      [oktopkRemoteError] = "remote error",
      [oktopkTimeout] = "timeout",
      [oktopkMismatch] = "mismatched call across ranks",
      [oktopkAborted] = "communicator aborted",
      [oktopkInternalError] = "internal error",
      [oktopkInProgress] = "in progress",
      [oktopkNonFinite] = "gradient holds NaN or Inf",
  };
  if ((unsigned)result < sizeof strings / sizeof strings[0] && strings[result] != NULL) return strings[result];
  return "unknown result code";
}

const char *oktopk_algorithm_name(int algorithm) {
  if (forked_child()) return NULL;
  return go_oktopk_algorithm_name(algorithm);
}

int oktopk_algorithm_takes_reduced_values(int algorithm) {
  if (forked_child()) return -1;
  return go_oktopk_algorithm_takes_reduced_values(algorithm);
}

void oktopk_config_init(oktopk_config_t *config) {
  if (config == NULL || forked_child()) return;
  go_oktopk_config_init(config);
}

oktopk_result_t oktopk_get_last_error(oktopk_comm_t comm, char *buf, size_t len, int *truncated) {
  if (forked_child()) {
    // No Go state is safe here; the message and the check need none.
    if (buf == NULL || len == 0) return oktopkInvalidArgument;
    size_t n = strlen(forked_message);
    int cut = n >= len;
    if (cut) n = len - 1;
    memcpy(buf, forked_message, n);
    buf[n] = '\0';
    if (truncated != NULL) *truncated = cut;
    return oktopkSuccess;
  }
  return go_oktopk_get_last_error(comm, buf, len, truncated);
}

// FORWARD(name, (parameters), (arguments)) defines oktopk_name, which
// refuses a forked child and otherwise returns go_oktopk_name(arguments).
// Every result-returning function but oktopk_get_last_error is one; the
// header's prototypes check each definition's parameters.
#define FORWARD(name, params, args)                \
  oktopk_result_t oktopk_##name params {           \
    if (forked_child()) return oktopkInvalidUsage; \
    return go_oktopk_##name args;                  \
  }

FORWARD(get_unique_id, (oktopk_unique_id_t *id, const oktopk_config_t *config), (id, config))
FORWARD(comm_init_rank,
        (oktopk_comm_t *comm, int nranks, const oktopk_unique_id_t *id, int rank, const oktopk_config_t *config),
        (comm, nranks, id, rank, config))
FORWARD(comm_init_env, (oktopk_comm_t *comm, const oktopk_config_t *config), (comm, config))
FORWARD(make_token, (char *buf, size_t len), (buf, len))
FORWARD(comm_bind,
        (oktopk_comm_t *comm, int nranks, int rank, const char *job_token, const oktopk_config_t *config,
         char *endpoint, size_t endpoint_len),
        (comm, nranks, rank, job_token, config, endpoint, endpoint_len))
FORWARD(comm_connect, (oktopk_comm_t comm, const char *const *endpoints, int nranks), (comm, endpoints, nranks))
FORWARD(comm_rank, (oktopk_comm_t comm, int *rank), (comm, rank))
FORWARD(comm_size, (oktopk_comm_t comm, int *size), (comm, size))
FORWARD(comm_abort, (oktopk_comm_t comm), (comm))
FORWARD(comm_dropped, (oktopk_comm_t comm, uint64_t *count), (comm, count))
FORWARD(comm_destroy, (oktopk_comm_t comm), (comm))
FORWARD(comm_measure_link, (oktopk_comm_t comm, oktopk_link_model_t *link), (comm, link))
FORWARD(comm_get_link, (oktopk_comm_t comm, oktopk_link_model_t *link, int *measured), (comm, link, measured))
FORWARD(comm_set_link, (oktopk_comm_t comm, const oktopk_link_model_t *link), (comm, link))
FORWARD(predict_call,
        (const oktopk_link_model_t *link, int algorithm, int64_t n, int nranks, const oktopk_config_t *config,
         int *algorithm_run, double *seconds, double *bytes_per_rank),
        (link, algorithm, n, nranks, config, algorithm_run, seconds, bytes_per_rank))
FORWARD(allreduce,
        (oktopk_comm_t comm, void *data, size_t count, oktopk_dtype_t dtype, int average, int algorithm),
        (comm, data, count, dtype, average, algorithm))
FORWARD(sparse_allreduce,
        (oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count, oktopk_dtype_t dtype, oktopk_stats_t *stats),
        (comm, tensor_id, data, count, dtype, stats))
FORWARD(sparse_allreduce_hold,
        (oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count, oktopk_dtype_t dtype, const size_t *hold,
         size_t hold_count, oktopk_stats_t *stats),
        (comm, tensor_id, data, count, dtype, hold, hold_count, stats))
FORWARD(sparse_allreduce_ex,
        (oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count, oktopk_dtype_t dtype,
         const oktopk_call_options_t *options, oktopk_stats_t *stats),
        (comm, tensor_id, data, count, dtype, options, stats))
FORWARD(sparse_allreduce_sparse,
        (oktopk_comm_t comm, size_t n, const uint32_t *in_indices, const float *in_values, size_t in_count,
         uint32_t *out_indices, float *out_values, size_t out_capacity, size_t *out_count, oktopk_stats_t *stats),
        (comm, n, in_indices, in_values, in_count, out_indices, out_values, out_capacity, out_count, stats))
FORWARD(allreduce_start,
        (oktopk_comm_t comm, void *data, size_t count, oktopk_dtype_t dtype, int average, int algorithm,
         oktopk_request_t *request),
        (comm, data, count, dtype, average, algorithm, request))
FORWARD(sparse_allreduce_start,
        (oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count, oktopk_dtype_t dtype,
         oktopk_request_t *request),
        (comm, tensor_id, data, count, dtype, request))
FORWARD(test, (oktopk_request_t request), (request))
FORWARD(wait, (oktopk_request_t request, oktopk_stats_t *stats), (request, stats))
FORWARD(request_free, (oktopk_request_t request), (request))
FORWARD(tensor_state_size, (oktopk_comm_t comm, uint64_t tensor_id, size_t *size), (comm, tensor_id, size))
FORWARD(tensor_state_save, (oktopk_comm_t comm, uint64_t tensor_id, void *buf, size_t len), (comm, tensor_id, buf, len))
FORWARD(tensor_state_load,
        (oktopk_comm_t comm, uint64_t tensor_id, const void *buf, size_t len),
        (comm, tensor_id, buf, len))
FORWARD(comm_shrink, (oktopk_comm_t comm, oktopk_comm_t *newcomm), (comm, newcomm))
FORWARD(comm_admit, (oktopk_comm_t comm, oktopk_comm_t *newcomm), (comm, newcomm))
FORWARD(comm_join, (oktopk_comm_t *comm, const oktopk_config_t *config), (comm, config))
FORWARD(tensor_state_load_regrouped,
        (oktopk_comm_t comm, uint64_t tensor_id, const void *buf, size_t len),
        (comm, tensor_id, buf, len))
FORWARD(tensor_residual_fold,
        (oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count, oktopk_dtype_t dtype, const size_t *hold,
         size_t hold_count),
        (comm, tensor_id, data, count, dtype, hold, hold_count))
FORWARD(tensor_residual_unfold, (oktopk_comm_t comm, uint64_t tensor_id), (comm, tensor_id))
FORWARD(tensor_residual_read, (oktopk_comm_t comm, uint64_t tensor_id, float *data, size_t count), (comm, tensor_id, data, count))
FORWARD(tensor_residual_zeros,
        (oktopk_comm_t comm, uint64_t tensor_id, size_t n, const uint8_t *before, uint8_t *zero, int64_t *became,
         size_t capacity, size_t *count),
        (comm, tensor_id, n, before, zero, became, capacity, count))
FORWARD(tensor_undo_call, (oktopk_comm_t comm, uint64_t tensor_id), (comm, tensor_id))
FORWARD(selection_plan,
        (oktopk_comm_t comm, uint64_t tensor_id, size_t n, const oktopk_call_options_t *options,
         oktopk_selection_plan_t *plan),
        (comm, tensor_id, n, options, plan))
FORWARD(sparse_allreduce_selected,
        (oktopk_comm_t comm, uint64_t tensor_id, size_t n, oktopk_dtype_t dtype, const oktopk_call_options_t *options,
         oktopk_selected_t *io, oktopk_stats_t *stats),
        (comm, tensor_id, n, dtype, options, io, stats))
FORWARD(tensor_state_save_residual,
        (oktopk_comm_t comm, uint64_t tensor_id, const float *residual, size_t n, void *buf, size_t len),
        (comm, tensor_id, residual, n, buf, len))
FORWARD(tensor_state_load_residual,
        (oktopk_comm_t comm, uint64_t tensor_id, const void *buf, size_t len, float *residual, size_t n),
        (comm, tensor_id, buf, len, residual, n))
FORWARD(topk, (const float *x, size_t n, size_t k, uint32_t *indices, float *values), (x, n, k, indices, values))
FORWARD(threshold_select,
        (const float *x, size_t n, float threshold, uint32_t *indices, float *values, size_t capacity, size_t *count),
        (x, n, threshold, indices, values, capacity, count))

void oktopk_selection_rules(oktopk_selection_rules_t *rules) {
  if (forked_child()) return;
  go_oktopk_selection_rules(rules);
}

size_t oktopk_selected_capacity(size_t n, size_t k, int ranks) {
  if (forked_child()) return 0;
  return go_oktopk_selected_capacity(n, k, ranks);
}

int oktopk_debug_goroutines(void) {
  if (forked_child()) return -1;
  return go_oktopk_debug_goroutines();
}
