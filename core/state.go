package core

// TensorState is what sparse allreduce keeps for one tensor between calls:
// the residual of error feedback, the reused thresholds and the region
// boundaries of Ok-Topk, and the call counter that schedules their refresh.
type TensorState struct {
	N      int
	Config Config
	Iter   int // calls completed on this tensor

	Residual        []float32 // error feedback: what was computed but not yet sent
	LocalThreshold  float32   // reused |x| > threshold selection (0: not yet known)
	GlobalThreshold float32
	Boundaries      []uint32 // P+1 region starts: rank r owns [Boundaries[r], Boundaries[r+1])
}

// NewTensorState makes the state of a tensor of n elements.
func NewTensorState(n int, cfg Config) *TensorState {
	return &TensorState{N: n, Config: cfg, Residual: make([]float32, n)}
}
