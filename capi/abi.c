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

#define REFUSE_IN_CHILD \
  if (forked_child()) return oktopkInvalidUsage

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

void oktopk_config_init(oktopk_config_t *config) {
  if (config == NULL || forked_child()) return;
  go_oktopk_config_init(config);
}

oktopk_result_t oktopk_get_last_error(oktopk_comm_t comm, char *buf, size_t len, int *truncated) {
  if (buf == NULL || len == 0) return oktopkInvalidArgument;
  if (forked_child()) {
    // No Go state is safe here; the message needs none.
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

oktopk_result_t oktopk_get_unique_id(oktopk_unique_id_t *id, const oktopk_config_t *config) {
  REFUSE_IN_CHILD;
  return go_oktopk_get_unique_id(id, config);
}

oktopk_result_t oktopk_comm_init_rank(oktopk_comm_t *comm, int nranks, const oktopk_unique_id_t *id, int rank,
                                      const oktopk_config_t *config) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_init_rank(comm, nranks, id, rank, config);
}

oktopk_result_t oktopk_comm_init_env(oktopk_comm_t *comm, const oktopk_config_t *config) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_init_env(comm, config);
}

oktopk_result_t oktopk_make_token(char *buf, size_t len) {
  REFUSE_IN_CHILD;
  return go_oktopk_make_token(buf, len);
}

oktopk_result_t oktopk_comm_bind(oktopk_comm_t *comm, int nranks, int rank, const char *job_token,
                                 const oktopk_config_t *config, char *endpoint, size_t endpoint_len) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_bind(comm, nranks, rank, job_token, config, endpoint, endpoint_len);
}

oktopk_result_t oktopk_comm_connect(oktopk_comm_t comm, const char *const *endpoints, int nranks) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_connect(comm, endpoints, nranks);
}

oktopk_result_t oktopk_comm_rank(oktopk_comm_t comm, int *rank) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_rank(comm, rank);
}

oktopk_result_t oktopk_comm_size(oktopk_comm_t comm, int *size) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_size(comm, size);
}

oktopk_result_t oktopk_comm_abort(oktopk_comm_t comm) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_abort(comm);
}

oktopk_result_t oktopk_comm_dropped(oktopk_comm_t comm, uint64_t *count) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_dropped(comm, count);
}

oktopk_result_t oktopk_comm_destroy(oktopk_comm_t comm) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_destroy(comm);
}

oktopk_result_t oktopk_comm_measure_link(oktopk_comm_t comm, oktopk_link_model_t *link) {
  REFUSE_IN_CHILD;
  return go_oktopk_comm_measure_link(comm, link);
}

oktopk_result_t oktopk_allreduce(oktopk_comm_t comm, void *data, size_t count, oktopk_dtype_t dtype, int average,
                                 int algorithm) {
  REFUSE_IN_CHILD;
  return go_oktopk_allreduce(comm, data, count, dtype, average, algorithm);
}

oktopk_result_t oktopk_sparse_allreduce(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                        oktopk_dtype_t dtype, oktopk_stats_t *stats) {
  REFUSE_IN_CHILD;
  return go_oktopk_sparse_allreduce(comm, tensor_id, data, count, dtype, stats);
}

oktopk_result_t oktopk_sparse_allreduce_hold(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                             oktopk_dtype_t dtype, const size_t *hold, size_t hold_count,
                                             oktopk_stats_t *stats) {
  REFUSE_IN_CHILD;
  return go_oktopk_sparse_allreduce_hold(comm, tensor_id, data, count, dtype, hold, hold_count, stats);
}

oktopk_result_t oktopk_sparse_allreduce_ex(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                           oktopk_dtype_t dtype, const oktopk_call_options_t *options,
                                           oktopk_stats_t *stats) {
  REFUSE_IN_CHILD;
  return go_oktopk_sparse_allreduce_ex(comm, tensor_id, data, count, dtype, options, stats);
}

oktopk_result_t oktopk_sparse_allreduce_sparse(oktopk_comm_t comm, size_t n, const uint32_t *in_indices,
                                               const float *in_values, size_t in_count, uint32_t *out_indices,
                                               float *out_values, size_t out_capacity, size_t *out_count,
                                               oktopk_stats_t *stats) {
  REFUSE_IN_CHILD;
  return go_oktopk_sparse_allreduce_sparse(comm, n, in_indices, in_values, in_count, out_indices, out_values,
                                           out_capacity, out_count, stats);
}

oktopk_result_t oktopk_allreduce_start(oktopk_comm_t comm, void *data, size_t count, oktopk_dtype_t dtype,
                                       int average, int algorithm, oktopk_request_t *request) {
  REFUSE_IN_CHILD;
  return go_oktopk_allreduce_start(comm, data, count, dtype, average, algorithm, request);
}

oktopk_result_t oktopk_sparse_allreduce_start(oktopk_comm_t comm, uint64_t tensor_id, void *data, size_t count,
                                              oktopk_dtype_t dtype, oktopk_request_t *request) {
  REFUSE_IN_CHILD;
  return go_oktopk_sparse_allreduce_start(comm, tensor_id, data, count, dtype, request);
}

oktopk_result_t oktopk_test(oktopk_request_t request) {
  REFUSE_IN_CHILD;
  return go_oktopk_test(request);
}

oktopk_result_t oktopk_wait(oktopk_request_t request, oktopk_stats_t *stats) {
  REFUSE_IN_CHILD;
  return go_oktopk_wait(request, stats);
}

oktopk_result_t oktopk_request_free(oktopk_request_t request) {
  REFUSE_IN_CHILD;
  return go_oktopk_request_free(request);
}

oktopk_result_t oktopk_tensor_state_size(oktopk_comm_t comm, uint64_t tensor_id, size_t *size) {
  REFUSE_IN_CHILD;
  return go_oktopk_tensor_state_size(comm, tensor_id, size);
}

oktopk_result_t oktopk_tensor_state_save(oktopk_comm_t comm, uint64_t tensor_id, void *buf, size_t len) {
  REFUSE_IN_CHILD;
  return go_oktopk_tensor_state_save(comm, tensor_id, buf, len);
}

oktopk_result_t oktopk_tensor_state_load(oktopk_comm_t comm, uint64_t tensor_id, const void *buf, size_t len) {
  REFUSE_IN_CHILD;
  return go_oktopk_tensor_state_load(comm, tensor_id, buf, len);
}

oktopk_result_t oktopk_topk(const float *x, size_t n, size_t k, uint32_t *indices, float *values) {
  REFUSE_IN_CHILD;
  return go_oktopk_topk(x, n, k, indices, values);
}

oktopk_result_t oktopk_threshold_select(const float *x, size_t n, float threshold, uint32_t *indices, float *values,
                                        size_t capacity, size_t *count) {
  REFUSE_IN_CHILD;
  return go_oktopk_threshold_select(x, n, threshold, indices, values, capacity, count);
}

int oktopk_debug_goroutines(void) {
  if (forked_child()) return -1;
  return go_oktopk_debug_goroutines();
}
