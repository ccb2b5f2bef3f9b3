// mpi_example.cpp — oktopk under MPI, set up the way NCCL's examples are:
// rank 0 makes a unique id, MPI_Bcast hands it to every rank, and each rank
// calls oktopk_comm_init_rank with MPI's rank and size. MPI only starts the
// processes and carries the id; the gradients travel through oktopk.
//
// It then checks oktopk against MPI itself:
//   1. a dense allreduce (sum) of integer-valued floats equals MPI_Allreduce
//      of the same buffer, bit for bit (the sums are exact);
//   2. a sparse allreduce at density 1.0 equals the MPI average;
//   3. ten Ok-Topk sparse allreduces at density 1% leave every rank with the
//      same result (compared through MPI).
// It prints "ok" on rank 0 and exits 0, or names the failed check and exits
// 1. Run it with `mpirun -np 4 build/mpi_example` (built by `make examples`
// where mpicxx exists). Across hosts, set OKTOPK_SOCKET_IFNAME (as with
// NCCL_SOCKET_IFNAME) so that rank 0 serves the id on an address the other
// hosts reach.
// The C API is all this needs: skip the C++ bindings that Open MPI and
// MPICH still ship (deprecated since MPI-2.2, and noisy under -Wextra).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include "oktopk.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

int rank_ = -1;

void check(oktopk_result_t r, oktopk_comm_t comm, const char *what) {
  if (r == oktopkSuccess) return;
  char msg[512];
  oktopk_get_last_error(comm, msg, sizeof msg, nullptr);
  std::fprintf(stderr, "rank %d: %s: %s: %s\n", rank_, what, oktopk_get_error_string(r), msg);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

// FNV-1a of a buffer's bytes: ranks compare results through MPI by hash.
uint64_t digest(const std::vector<float> &v) {
  uint64_t h = 1469598103934665603ull;
  const unsigned char *p = reinterpret_cast<const unsigned char *>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// True on every rank when x is the same on every rank.
bool same_everywhere(uint64_t x) {
  unsigned long long lo = x, hi = x, in = x;
  MPI_Allreduce(&in, &lo, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&in, &hi, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

// True on every rank when ok holds on every rank.
bool all(bool ok) {
  int in = ok ? 1 : 0, out = 0;
  MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return out == 1;
}

}  // namespace

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  rank_ = rank;

  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  cfg.timeout_ms = 30000;
  cfg.density = 1.0;

  // NCCL's pattern: the id is made once, on rank 0, and broadcast verbatim.
  oktopk_unique_id_t id;
  if (rank == 0) check(oktopk_get_unique_id(&id, &cfg), 0, "oktopk_get_unique_id");
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  oktopk_comm_t comm;
  check(oktopk_comm_init_rank(&comm, size, &id, rank, &cfg), 0, "oktopk_comm_init_rank");
  int okrank, oksize;
  check(oktopk_comm_rank(comm, &okrank), comm, "rank");
  check(oktopk_comm_size(comm, &oksize), comm, "size");
  bool ok = all(okrank == rank && oksize == size);
  if (rank == 0 && !ok) std::printf("FAIL: oktopk's rank or size differs from MPI's\n");

  const size_t n = 1 << 16;
  std::mt19937 rng(1000 + rank);
  std::uniform_int_distribution<int> small(-1000, 1000);

  // 1. Dense sum against MPI_Allreduce: integers below 2^24 add exactly, so
  // any summation order gives the same bits.
  std::vector<float> mine(n), ours(n), mpi(n);
  for (auto &x : mine) x = static_cast<float>(small(rng));
  ours = mine;
  check(oktopk_allreduce(comm, ours.data(), n, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), comm, "allreduce");
  MPI_Allreduce(mine.data(), mpi.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  bool dense_ok = all(std::memcmp(ours.data(), mpi.data(), n * sizeof(float)) == 0);
  if (rank == 0) std::printf("dense allreduce equals MPI_Allreduce: %s\n", dense_ok ? "yes" : "NO");

  // 2. Sparse allreduce at density 1.0 is the average. With 4 ranks (a
  // power of two) the division is exact too; otherwise allow rounding.
  ours = mine;
  oktopk_stats_t st{};
  st.size = sizeof st;
  check(oktopk_sparse_allreduce(comm, 1, ours.data(), n, OKTOPK_FLOAT32, &st), comm, "sparse allreduce, density 1");
  double worst = 0;
  for (size_t i = 0; i < n; i++) {
    double want = static_cast<double>(mpi[i]) / size;
    double d = ours[i] > want ? ours[i] - want : want - ours[i];
    if (d > worst) worst = d;
  }
  bool full_ok = all(worst <= 1e-3);
  if (rank == 0) std::printf("sparse allreduce at density 1 equals the MPI average: %s (worst difference %g)\n", full_ok ? "yes" : "NO", worst);
  check(oktopk_comm_destroy(comm), 0, "destroy");

  // 3. Ok-Topk at density 1%, with error feedback across ten calls: every
  // rank must end with the same result.
  cfg.density = 0.01;
  if (rank == 0) check(oktopk_get_unique_id(&id, &cfg), 0, "oktopk_get_unique_id");
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  check(oktopk_comm_init_rank(&comm, size, &id, rank, &cfg), 0, "oktopk_comm_init_rank (density 1%)");
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> grad(n);
  uint64_t bytes = 0;
  bool sparse_ok = true;
  for (int step = 0; step < 10; step++) {
    for (auto &x : grad) x = g(rng);
    check(oktopk_sparse_allreduce(comm, 2, grad.data(), n, OKTOPK_FLOAT32, &st), comm, "sparse allreduce, density 1%");
    bytes += st.bytes_sent;
    sparse_ok = same_everywhere(digest(grad)) && sparse_ok;
  }
  sparse_ok = all(sparse_ok);
  if (rank == 0)
    std::printf("Ok-Topk at density 1%%, 10 calls: identical on every rank: %s (%llu bytes sent per call by rank 0)\n",
                sparse_ok ? "yes" : "NO", static_cast<unsigned long long>(bytes / 10));
  check(oktopk_comm_destroy(comm), 0, "destroy");

  ok = ok && dense_ok && full_ok && sparse_ok;
  if (rank == 0) std::printf("%s: %d ranks, unique id passed with MPI_Bcast\n", ok ? "ok" : "FAIL", size);
  MPI_Finalize();
  return ok ? 0 : 1;
}
