// Package core holds the collectives of oktopk: dense allreduce (ring and
// Rabenseifner), Ok-Topk sparse allreduce (Li & Hoefler, PPoPP'22) and the
// sparse baselines it is judged against (TopkA, TopkDSA / SparCML, gTopk,
// Gaussiank), the top-k selection they share, and the per-tensor state
// (residual, thresholds, region boundaries) that error feedback needs.
//
// Each algorithm lives in its own file that opens with the algorithm in plain
// words and its cost in the α-β model: P ranks, n elements, k selected, α
// latency per message, β time per word (an index and a value are one word
// each, as in the papers; on the wire indices are coded as gaps,
// indexcode.go, and take less). Algorithms talk to peers only through
// transport.Transport.
package core
