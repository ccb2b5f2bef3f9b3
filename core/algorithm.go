package core

// The algorithm table: the Algorithm enum (values fixed by the C ABI),
// each algorithm's name, frame operation and entry points, and Config,
// the per-tensor settings of sparse allreduce, with Validate and K.

import (
	"context"
	"fmt"
	"math"
	"strings"

	"github.com/oktopk/oktopk/transport"
)

// Algorithm selects the collective. The values are the C ABI's
// oktopk_algorithm_t and must not change.
type Algorithm int

const (
	DenseRing Algorithm = iota
	DenseRabenseifner
	OkTopk
	TopkA
	TopkDSA
	SSARRecursiveDouble
	SSARSplitAllgather
	DSARSplitAllgather
	GTopk
	Gaussiank
	// Auto picks one of the others for every call from a cost model and
	// the communicator's measured link (see auto.go). It has no messages
	// of its own: every frame carries the algorithm it chose.
	Auto
	numAlgorithms
)

// DefaultAlgorithm is what DefaultConfig (and so the C ABI's
// oktopk_config_init and the Python plugins) uses.
const DefaultAlgorithm = OkTopk

// denseAllreduceFunc sums data over every rank, in place; every rank ends
// with bitwise identical data.
type denseAllreduceFunc func(ctx context.Context, call *Call, data []float32) error

// sparseAllreduceFunc reduces one rank's dense gradient with error feedback:
// on return grad holds the averaged sparse global result (zeros elsewhere,
// bitwise identical on every rank) and st.Residual what was not sent.
type sparseAllreduceFunc func(ctx context.Context, call *Call, st *TensorState, grad []float32) error

// sparseInputFunc reduces sparse inputs with no state and returns the summed
// (not averaged) sparse global result, identical on every rank.
type sparseInputFunc func(ctx context.Context, call *Call, n int, in Sparse, k int) (Sparse, error)

// algorithmEntry is one row of the algorithm table: the algorithm's name,
// the operation kind its frames carry, and its entry points, nil where it
// has none. Every algorithm file holds the functions its row names.
type algorithmEntry struct {
	name        string
	op          transport.Op
	dense       denseAllreduceFunc  // a dense allreduce: no selection, no residual
	sparse      sparseAllreduceFunc // a dense gradient in, reduced with error feedback
	sparseInput sparseInputFunc     // sparse inputs in, no state
	halfValues  bool                // sends float16/bfloat16 values (values.go)
	// exactCall says whether a tensor's next call selects exactly (rather
	// than reusing a threshold); it goes into the call's descriptor, so
	// ranks whose states disagree on it fail with a mismatch. nil: never
	// says (the call's selection is the same kind on every call).
	exactCall func(st *TensorState, k, n int) bool
	// cost is the algorithm's predicted work on one rank's critical path
	// for Auto's model (auto.go); nil for Auto itself.
	cost costFunc
}

// algorithms is the table, indexed by Algorithm. It is filled in init, not
// by an initializer, because the entry points reach back into it (their
// errors name algorithms through String, which reads it), which Go would
// reject as an initialization cycle.
var algorithms [numAlgorithms]algorithmEntry

func init() {
	algorithms = [numAlgorithms]algorithmEntry{
		DenseRing: {name: "dense_ring", op: transport.OpAllreduceRing, dense: RingAllreduce, cost: ringCost},
		DenseRabenseifner: {name: "dense_rabenseifner", op: transport.OpAllreduceRabenseifner, dense: RabenseifnerAllreduce,
			cost: rabenseifnerCost},
		OkTopk: {name: "oktopk", op: transport.OpOkTopk, sparse: okTopkAllreduce, sparseInput: okTopkSparseInput,
			halfValues: true, exactCall: (*TensorState).okTopkExact, cost: okTopkCost},
		TopkA: {name: "topka", op: transport.OpTopkA, sparse: withExactTopK(topkAReduce), sparseInput: topkAReduce,
			halfValues: true, cost: topkACost},
		TopkDSA: {name: "topkdsa", op: transport.OpTopkDSA, sparse: withExactTopK(topkDSAReduce), sparseInput: topkDSAReduce,
			cost: splitAllgatherCost(reducedRegionGoesDense)},
		SSARRecursiveDouble: {name: "ssar_recursive_double", op: transport.OpSSARRecursiveDouble,
			sparse: withExactTopK(ssarRecursiveDouble), sparseInput: ssarRecursiveDouble, cost: ssarRecursiveDoubleCost},
		SSARSplitAllgather: {name: "ssar_split_allgather", op: transport.OpSSARSplitAllgather,
			sparse: withExactTopK(ssarSplitAllgather), sparseInput: ssarSplitAllgather,
			cost: splitAllgatherCost(neverDense)},
		DSARSplitAllgather: {name: "dsar_split_allgather", op: transport.OpDSARSplitAllgather,
			sparse: withExactTopK(dsarSplitAllgather), sparseInput: dsarSplitAllgather,
			cost: splitAllgatherCost(denseIsNoLarger)},
		GTopk: {name: "gtopk", op: transport.OpGTopk, sparse: gTopkAllreduce, sparseInput: gTopkSparseInput, cost: gTopkCost},
		Gaussiank: {name: "gaussiank", op: transport.OpGaussiank, sparse: gaussiankAllreduce, halfValues: true,
			cost: gaussiankCost},
		// Auto runs another row's entry points; it chooses among those
		// that send half values when asked to.
		Auto: {name: "auto", op: transport.OpNone, halfValues: true}, // never on the wire
	}
}

func (a Algorithm) String() string {
	if a.Valid() {
		return algorithms[a].name
	}
	return fmt.Sprintf("algorithm(%d)", int(a))
}

func (a Algorithm) Valid() bool { return a >= 0 && a < numAlgorithms }

// row is a's row of the table; an invalid a has an empty one (no entry
// points).
func (a Algorithm) row() algorithmEntry {
	if !a.Valid() {
		return algorithmEntry{}
	}
	return algorithms[a]
}

// Dense reports whether a is a dense allreduce (no selection, no residual).
func (a Algorithm) Dense() bool { return a.row().dense != nil }

// Op is the frame-header operation kind of a's messages.
func (a Algorithm) Op() transport.Op { return a.row().op }

// Algorithms lists every algorithm in enum order.
func Algorithms() []Algorithm {
	out := make([]Algorithm, numAlgorithms)
	for i := range out {
		out[i] = Algorithm(i)
	}
	return out
}

// ParseAlgorithm accepts the names of String, case-insensitively.
func ParseAlgorithm(name string) (Algorithm, error) {
	names := make([]string, 0, numAlgorithms)
	for a, row := range algorithms {
		if strings.EqualFold(name, row.name) {
			return Algorithm(a), nil
		}
		names = append(names, row.name)
	}
	return 0, fmt.Errorf("%w: unknown algorithm %q (one of %s)", ErrInvalidArgument, name, strings.Join(names, ", "))
}

// Config holds the settings of sparse allreduce for one tensor.
type Config struct {
	Algorithm Algorithm
	Density   float64 // k = ceil(Density·n), 0 ≤ Density ≤ 1 (0: k = 0, nothing selected)
	Tau       int     // Ok-Topk: repartition the index space every Tau calls
	TauPrime  int     // exact thresholds every TauPrime calls, reused in between

	// Values is the precision selected values travel in (values.go):
	// float16 and bfloat16 halve a value's bytes, int8 quarters it (with a
	// scale per 32 values, int8values.go), the rounding error going back
	// into the residuals. OkTopk, TopkA and Gaussiank only.
	Values     ValueType
	Stochastic bool // round 16-bit Values stochastically (unbiased) instead of to nearest
}

// DefaultConfig is the reference implementation's setting for CNNs.
func DefaultConfig() Config {
	return Config{Algorithm: DefaultAlgorithm, Density: 0.01, Tau: 64, TauPrime: 32}
}

// Validate reports a bad setting as ErrInvalidArgument.
func (c Config) Validate() error {
	switch {
	case !c.Algorithm.Valid():
		return fmt.Errorf("%w: %v", ErrInvalidArgument, c.Algorithm)
	case !(c.Density >= 0 && c.Density <= 1):
		return fmt.Errorf("%w: density %v not in [0, 1]", ErrInvalidArgument, c.Density)
	case c.Tau < 1:
		return fmt.Errorf("%w: tau %d < 1", ErrInvalidArgument, c.Tau)
	case c.TauPrime < 1:
		return fmt.Errorf("%w: tau_prime %d < 1", ErrInvalidArgument, c.TauPrime)
	case !c.Values.Valid():
		return fmt.Errorf("%w: %v (float32, float16, bfloat16 or int8)", ErrInvalidArgument, c.Values)
	case c.Values != ValuesFloat32 && !c.Algorithm.takesReducedValues():
		return fmt.Errorf("%w: %v values need algorithm oktopk, topka, gaussiank or auto: %s", ErrInvalidArgument, c.Values, c.Algorithm.whyNoReducedValues())
	case c.Stochastic && !c.Values.half():
		return fmt.Errorf("%w: stochastic rounding needs float16 or bfloat16 values", ErrInvalidArgument)
	}
	return nil
}

// K is the number of entries selected from n: ⌈density·n⌉, at most n, where
// a product within a relative 2^-40 above an integer counts as that integer.
// density is a float64, so density·n carries rounding: 0.07·100 comes out
// as 7.000000000000001, and a density computed as k/n need not give k back;
// a plain ceiling would select one entry more than meant.
func (c Config) K(n int) int {
	x := c.Density * float64(n)
	k := int(math.Ceil(x - x*0x1p-40))
	return max(0, min(k, n))
}
