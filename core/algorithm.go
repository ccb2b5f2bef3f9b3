package core

import (
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

var algorithmNames = [...]string{"dense_ring", "dense_rabenseifner", "oktopk", "topka", "topkdsa",
	"ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather", "gtopk", "gaussiank", "auto"}

var algorithmOps = [...]transport.Op{transport.OpAllreduceRing, transport.OpAllreduceRabenseifner,
	transport.OpOkTopk, transport.OpTopkA, transport.OpTopkDSA, transport.OpSSARRecursiveDouble,
	transport.OpSSARSplitAllgather, transport.OpDSARSplitAllgather, transport.OpGTopk, transport.OpGaussiank,
	transport.OpNone} // Auto: never on the wire

func (a Algorithm) String() string {
	if a.Valid() {
		return algorithmNames[a]
	}
	return fmt.Sprintf("algorithm(%d)", int(a))
}

func (a Algorithm) Valid() bool { return a >= 0 && a < numAlgorithms }

// Dense reports whether a is a dense allreduce (no selection, no residual).
func (a Algorithm) Dense() bool { return a == DenseRing || a == DenseRabenseifner }

// Op is the frame-header operation kind of a's messages.
func (a Algorithm) Op() transport.Op { return algorithmOps[a] }

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
	for i, n := range algorithmNames {
		if strings.EqualFold(name, n) {
			return Algorithm(i), nil
		}
	}
	return 0, fmt.Errorf("%w: unknown algorithm %q (one of %s)", ErrInvalidArgument, name, strings.Join(algorithmNames[:], ", "))
}

// Config holds the settings of sparse allreduce for one tensor.
type Config struct {
	Algorithm Algorithm
	Density   float64 // k = ceil(Density·n), 0 ≤ Density ≤ 1 (0: k = 0, nothing selected)
	Tau       int     // Ok-Topk: repartition the index space every Tau calls
	TauPrime  int     // exact thresholds every TauPrime calls, reused in between

	// Values is the precision selected values travel in (values.go):
	// float16 and bfloat16 halve a value's bytes, the rounding error going
	// back into the residuals. OkTopk, TopkA and Gaussiank only.
	Values     ValueType
	Stochastic bool // round Values stochastically (unbiased) instead of to nearest
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
		return fmt.Errorf("%w: %v (float32, float16 or bfloat16)", ErrInvalidArgument, c.Values)
	case c.Values != ValuesFloat32 && !c.Algorithm.takesReducedValues():
		return fmt.Errorf("%w: %v values need algorithm oktopk, topka, gaussiank or auto: %s", ErrInvalidArgument, c.Values, c.Algorithm.whyNoReducedValues())
	case c.Stochastic && c.Values == ValuesFloat32:
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
