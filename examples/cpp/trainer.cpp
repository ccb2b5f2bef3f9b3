// trainer.cpp — data-parallel logistic regression on the oktopk C ABI.
//
// The problem is in the spirit of the URL and Webspam sets SparCML was
// measured on: d = 2^18 features, each sample has a few hundred nonzero
// features drawn from a skewed (Zipf-like) popularity, and the labels come
// from a hidden sparse weight vector plus label noise. The samples are split
// across the ranks; each step every rank computes the gradient of its
// mini-batch and the ranks combine it, once with a dense allreduce and once
// with Ok-Topk at density 1% (with error feedback). The run prints the
// training loss per epoch and the time per iteration of both, and exits
// nonzero unless Ok-Topk's final loss is within the stated tolerance of
// dense's.
//
// Launch it with any launcher oktopk_comm_init_env understands: torchrun-style
// variables (tests/c/launch.sh 4 build/trainer sets RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT), `mpirun -np 4 build/trainer` or
// `srun -n 4 build/trainer`.
#include "oktopk.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int kFeatures = 1 << 18;
constexpr int kNonzerosPerSample = 200;
constexpr int kTrueNonzeros = 4000;
constexpr int kSamplesPerRank = 2048;
constexpr int kBatch = 64;
constexpr int kEpochs = 6;
constexpr float kLearningRate = 4.0f;
constexpr double kDensity = 0.01;
// Ok-Topk passes if its final loss is at most dense's plus this margin.
constexpr double kLossTolerance = 0.05;

// Every present feature has the same value, normalised per sample (as
// binary bag-of-words features usually are).
const float kValue = 1.0f / std::sqrt(static_cast<float>(kNonzerosPerSample));

struct Sample {
  std::vector<uint32_t> features;  // ascending; each has value kValue
  float label;                     // 0 or 1
};

void check(oktopk_result_t r, oktopk_comm_t comm, const char *what) {
  if (r == oktopkSuccess) return;
  char msg[512];
  oktopk_get_last_error(comm, msg, sizeof msg, nullptr);
  std::fprintf(stderr, "%s: %s: %s\n", what, oktopk_get_error_string(r), msg);
  std::exit(1);
}

// Features follow a Zipf-like popularity (a few are in most samples, most
// are rare), as word and URL features do.
uint32_t draw_feature(std::mt19937_64 &rng) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  double x = std::pow(u(rng), 3.0);  // skewed towards 0
  return static_cast<uint32_t>(x * (kFeatures - 1));
}

std::vector<float> hidden_weights() {
  std::mt19937_64 rng(12345);  // the same on every rank
  std::vector<float> w(kFeatures, 0.0f);
  std::normal_distribution<float> g(0.0f, 4.0f);
  for (int i = 0; i < kTrueNonzeros; i++) w[draw_feature(rng)] = g(rng);
  return w;
}

std::vector<Sample> make_shard(int rank, const std::vector<float> &w_true) {
  std::mt19937_64 rng(1000 + rank);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<Sample> shard(kSamplesPerRank);
  for (auto &s : shard) {
    for (int j = 0; j < kNonzerosPerSample; j++) s.features.push_back(draw_feature(rng));
    std::sort(s.features.begin(), s.features.end());
    s.features.erase(std::unique(s.features.begin(), s.features.end()), s.features.end());
    float margin = 0;
    for (uint32_t f : s.features) margin += w_true[f] * kValue;
    s.label = (margin > 0) != (u(rng) < 0.05f) ? 1.0f : 0.0f;  // 5% label noise
  }
  return shard;
}

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// Mean logistic loss over every rank's samples (a dense allreduce of the
// local sum and count).
double global_loss(oktopk_comm_t comm, const std::vector<Sample> &shard, const std::vector<float> &w) {
  double sum = 0;
  for (const auto &s : shard) {
    float z = 0;
    for (uint32_t f : s.features) z += w[f] * kValue;
    float p = std::min(std::max(sigmoid(z), 1e-7f), 1.0f - 1e-7f);
    sum += -(s.label * std::log(p) + (1 - s.label) * std::log(1 - p));
  }
  float buf[2] = {static_cast<float>(sum), static_cast<float>(shard.size())};
  check(oktopk_allreduce(comm, buf, 2, OKTOPK_FLOAT32, 0, OKTOPK_ALGO_DENSE_RING), comm, "loss allreduce");
  return buf[0] / buf[1];
}

struct Result {
  double final_loss;
  double ms_per_iteration;
  double ms_in_allreduce;
  uint64_t bytes_sent;
};

// Trains from zero weights; sparse selects the communicator's sparse
// algorithm (tensor id 1) instead of the dense ring allreduce.
Result train(oktopk_comm_t comm, int rank, int size, const std::vector<Sample> &shard, const char *name,
             bool sparse) {
  std::vector<float> w(kFeatures, 0.0f), grad(kFeatures);
  double loss = global_loss(comm, shard, w);
  if (rank == 0) std::printf("%-6s epoch 0: loss %.4f\n", name, loss);
  int iterations = 0;
  double total = 0, in_allreduce = 0;
  uint64_t bytes = 0;
  for (int epoch = 1; epoch <= kEpochs; epoch++) {
    for (size_t start = 0; start + kBatch <= shard.size(); start += kBatch) {
      auto t0 = std::chrono::steady_clock::now();
      std::fill(grad.begin(), grad.end(), 0.0f);
      for (size_t i = start; i < start + kBatch; i++) {
        const Sample &s = shard[i];
        float z = 0;
        for (uint32_t f : s.features) z += w[f] * kValue;
        float err = (sigmoid(z) - s.label) / kBatch;
        for (uint32_t f : s.features) grad[f] += err * kValue;
      }
      auto t1 = std::chrono::steady_clock::now();
      if (sparse) {
        oktopk_stats_t st{};
        st.size = sizeof st;
        check(oktopk_sparse_allreduce(comm, 1, grad.data(), grad.size(), OKTOPK_FLOAT32, &st), comm,
              "sparse allreduce");
        bytes += st.bytes_sent;
      } else {
        oktopk_stats_t st{};
        st.size = sizeof st;
        check(oktopk_allreduce(comm, grad.data(), grad.size(), OKTOPK_FLOAT32, 1, OKTOPK_ALGO_DENSE_RING), comm,
              "dense allreduce");
        bytes += 2ull * (size - 1) * grad.size() * sizeof(float) / size;  // ring volume
      }
      auto t2 = std::chrono::steady_clock::now();
      for (int f = 0; f < kFeatures; f++) w[f] -= kLearningRate * grad[f];
      auto t3 = std::chrono::steady_clock::now();
      total += std::chrono::duration<double, std::milli>(t3 - t0).count();
      in_allreduce += std::chrono::duration<double, std::milli>(t2 - t1).count();
      iterations++;
    }
    loss = global_loss(comm, shard, w);
    if (rank == 0) std::printf("%-6s epoch %d: loss %.4f\n", name, epoch, loss);
  }
  return {loss, total / iterations, in_allreduce / iterations, bytes / static_cast<uint64_t>(iterations)};
}

// The sparse algorithm to compare with dense: Ok-Topk unless argv[1] names
// one of the baselines.
oktopk_algorithm_t parse_algorithm(int argc, char **argv, const char **name) {
  const std::pair<const char *, oktopk_algorithm_t> names[] = {
      {"oktopk", OKTOPK_ALGO_OKTOPK}, {"topka", OKTOPK_ALGO_TOPKA},   {"topkdsa", OKTOPK_ALGO_TOPKDSA},
      {"gtopk", OKTOPK_ALGO_GTOPK},   {"gaussiank", OKTOPK_ALGO_GAUSSIANK}};
  *name = names[0].first;
  if (argc < 2) return OKTOPK_ALGO_OKTOPK;
  for (const auto &n : names)
    if (std::string(argv[1]) == n.first) {
      *name = n.first;
      return n.second;
    }
  std::fprintf(stderr, "usage: %s [oktopk|topka|topkdsa|gtopk|gaussiank]\n", argv[0]);
  std::exit(2);
}

}  // namespace

int main(int argc, char **argv) {
  oktopk_config_t cfg;
  oktopk_config_init(&cfg);
  const char *sparse_name;
  cfg.algorithm = parse_algorithm(argc, argv, &sparse_name);
  cfg.density = kDensity;
  oktopk_comm_t comm;
  check(oktopk_comm_init_env(&comm, &cfg), 0, "init");
  int rank, size;
  check(oktopk_comm_rank(comm, &rank), comm, "rank");
  check(oktopk_comm_size(comm, &size), comm, "size");
  if (rank == 0)
    std::printf("logistic regression: d = %d features, %d nonzeros per sample, %d samples per rank, %d ranks, "
                "batch %d per rank\n",
                kFeatures, kNonzerosPerSample, kSamplesPerRank, size, kBatch);

  std::vector<float> w_true = hidden_weights();
  std::vector<Sample> shard = make_shard(rank, w_true);

  Result dense = train(comm, rank, size, shard, "dense", false);
  Result sparse = train(comm, rank, size, shard, sparse_name, true);
  check(oktopk_comm_destroy(comm), 0, "destroy");

  if (rank != 0) return 0;
  std::printf("%-6s: final loss %.4f, %.2f ms per iteration (%.2f ms in allreduce), %llu bytes sent per iteration\n",
              "dense", dense.final_loss, dense.ms_per_iteration, dense.ms_in_allreduce,
              static_cast<unsigned long long>(dense.bytes_sent));
  std::printf("%-6s: final loss %.4f, %.2f ms per iteration (%.2f ms in allreduce), %llu bytes sent per iteration\n",
              sparse_name, sparse.final_loss, sparse.ms_per_iteration, sparse.ms_in_allreduce,
              static_cast<unsigned long long>(sparse.bytes_sent));
  if (!(sparse.final_loss <= dense.final_loss + kLossTolerance)) {
    std::printf("FAIL: %s's final loss %.4f exceeds dense's %.4f + %.2f\n", sparse_name, sparse.final_loss,
                dense.final_loss, kLossTolerance);
    return 1;
  }
  std::printf("ok: %s's final loss is within %.2f of dense's\n", sparse_name, kLossTolerance);
  return 0;
}
