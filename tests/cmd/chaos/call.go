package main

// What a rank and the harness's reference share: one call's specification,
// the seeded input it reduces, how it runs on a communicator, and what is
// reported about it. The rank program runs a spec over ZeroMQ between real
// processes; the harness runs the same spec through the same function over
// the in-process transport, which is the fault-free reference every
// successful call is compared with, bit for bit.

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// CallSpec is one call as one rank issues it. Ranks of a fault-free call get
// identical specs (their inputs differ by rank through the seed); a mismatch
// fault changes one field on one rank.
type CallSpec struct {
	Index     int     `json:"i"`         // position in the job, the same on every rank
	Alg       string  `json:"alg"`       // core.ParseAlgorithm name
	Dtype     string  `json:"dtype"`     // float32, float16 or bfloat16: the caller's buffer
	Values    string  `json:"values"`    // float32, float16, bfloat16, int8 or int4: the format sparse values travel in
	Tensor    uint64  `json:"tensor"`    // tensor id (sparse algorithms keep state under it)
	N         int     `json:"n"`         // elements
	Density   float64 `json:"density"`   // k = ceil(density·n)
	Tau       int     `json:"tau"`       // Ok-Topk repartition period
	TauPrime  int     `json:"tau_prime"` // threshold refresh period
	TimeoutMs int     `json:"timeout_ms"`
	Seed      uint64  `json:"seed"`      // input seed; each rank mixes in its rank
	Poison    string  `json:"poison"`    // "", "nan", "inf" or "-inf": one element of this rank's input
	PoisonAt  int     `json:"poison_at"` // which element
}

// Outcome is what a rank reports about one call.
type Outcome struct {
	Index   int    `json:"i"`
	OK      bool   `json:"ok"`
	Class   string `json:"class,omitempty"` // classify(err)
	Err     string `json:"err,omitempty"`
	StartNs int64  `json:"start_ns"` // wall clock (every process reads the same clock)
	EndNs   int64  `json:"end_ns"`
	Out     string `json:"out,omitempty"`   // hash of the caller's buffer after a successful call
	State   string `json:"state,omitempty"` // hash of the tensor's state after the call
	// Intact: after a failed call, the caller's buffer and the tensor's
	// state (residual, thresholds, boundaries, call count) hash as before.
	Intact bool `json:"intact"`
}

// Took is the call's duration as the rank measured it.
func (o Outcome) Took() time.Duration { return time.Duration(o.EndNs - o.StartNs) }

// buffer is a caller's gradient in its own dtype: float32, or the raw bits
// of float16/bfloat16 values, as the C ABI receives them.
type buffer struct {
	dtype transport.Dtype
	f32   []float32
	half  []uint16
}

func parseDtype(s string) (transport.Dtype, error) {
	switch s {
	case "float32":
		return transport.DtypeFloat32, nil
	case "float16":
		return transport.DtypeFloat16, nil
	case "bfloat16":
		return transport.DtypeBFloat16, nil
	}
	return 0, fmt.Errorf("unknown dtype %q", s)
}

// valuesOf is the value format s's sparse values travel in (float32 when
// the spec names none).
func valuesOf(s CallSpec) (core.ValueType, error) {
	if s.Values == "" {
		return core.ValuesFloat32, nil
	}
	return core.ParseValueType(s.Values)
}

// makeInput is rank's input for s: values of varied magnitude (so that top-k
// selection has something to choose), rounded to the dtype, with the poison
// element if the spec has one.
func makeInput(s CallSpec, rank int) (buffer, error) {
	dt, err := parseDtype(s.Dtype)
	if err != nil {
		return buffer{}, err
	}
	rng := rand.New(rand.NewPCG(s.Seed, uint64(rank)+1))
	f := make([]float32, s.N)
	for i := range f {
		f[i] = float32((rng.Float64() - 0.5) * math.Ldexp(1, rng.IntN(8)-5))
	}
	b := buffer{dtype: dt}
	poison := float32(0)
	switch s.Poison {
	case "":
	case "nan":
		poison = float32(math.NaN())
	case "inf":
		poison = float32(math.Inf(1))
	case "-inf":
		poison = float32(math.Inf(-1))
	default:
		return buffer{}, fmt.Errorf("unknown poison %q", s.Poison)
	}
	if s.Poison != "" && s.N > 0 {
		f[s.PoisonAt%s.N] = poison
	}
	switch dt {
	case transport.DtypeFloat32:
		b.f32 = f
	case transport.DtypeFloat16:
		b.half = make([]uint16, s.N)
		core.Float32ToFloat16(b.half, f)
	case transport.DtypeBFloat16:
		b.half = make([]uint16, s.N)
		core.Float32ToBFloat16(b.half, f)
	}
	return b, nil
}

func (b buffer) bytes() []byte {
	if b.dtype == transport.DtypeFloat32 {
		return core.Float32Bytes(b.f32)
	}
	out := make([]byte, 2*len(b.half))
	for i, h := range b.half {
		binary.LittleEndian.PutUint16(out[2*i:], h)
	}
	return out
}

func hashBytes(bs ...[]byte) string {
	h := fnv.New128a()
	for _, b := range bs {
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// stateHash hashes what a failed call must leave as it was in tensor id's
// state: the call count, thresholds, region boundaries and residual. The
// saved form is what a checkpoint holds (oktopk_tensor_state_save); its
// configuration fields are left out, since each call sets them from its own
// settings. A tensor with no state yet hashes as a fresh state of n elements,
// which is what the first call on it creates.
func stateHash(comm *core.Communicator, id uint64, n int) string {
	var st core.TensorState
	if live := comm.TensorStateOf(id); live != nil {
		st = *live
	} else {
		st = *core.NewTensorState(n, core.DefaultConfig())
	}
	st.Config = core.DefaultConfig()
	var b []byte
	var err error
	if st.CallerResidual {
		// A caller-selected tensor: its residual is the rank's own.
		b, err = st.MarshalWithResidual(callerResidual(comm, id, st.N))
	} else {
		b, err = st.MarshalBinary()
	}
	if err != nil {
		return "unserialisable: " + err.Error()
	}
	return hashBytes(b)
}

// runCall issues s on comm as rank would through the C ABI, through package
// binding: a half-precision buffer is widened into float32, reduced, and
// narrowed back only when the call succeeds, with the caller's dtype in the
// call's options so that ranks passing different dtypes are caught.
func runCall(comm *core.Communicator, rank int, s CallSpec) Outcome {
	o := Outcome{Index: s.Index}
	fail := func(class string, err error) Outcome {
		o.Class, o.Err = class, err.Error()
		now := time.Now().UnixNano()
		o.StartNs, o.EndNs = now, now
		return o
	}
	if s.Alg == selectedAlg {
		return runSelected(comm, rank, s)
	}
	alg, err := core.ParseAlgorithm(s.Alg)
	if err != nil {
		return fail("harness", err)
	}
	buf, err := makeInput(s, rank)
	if err != nil {
		return fail("harness", err)
	}
	values, err := valuesOf(s)
	if err != nil {
		return fail("harness", err)
	}
	cfg := core.Config{Algorithm: alg, Density: s.Density, Tau: s.Tau, TauPrime: s.TauPrime, Values: values}
	gradBefore := hashBytes(buf.bytes())
	stateBefore := stateHash(comm, s.Tensor, s.N)

	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(s.TimeoutMs)*time.Millisecond)
	defer cancel()
	in := binding.Float32(buf.f32)
	if buf.dtype != transport.DtypeFloat32 {
		in = binding.Buffer{Dtype: buf.dtype, Half: buf.half}
	}
	o.StartNs = time.Now().UnixNano()
	_, err = new(binding.Widener).SparseAllreduce(ctx, comm, s.Tensor, in, cfg, core.CallOptions{})
	o.EndNs = time.Now().UnixNano()
	if err == nil {
		o.OK = true
		o.Out = hashBytes(buf.bytes())
		o.State = stateHash(comm, s.Tensor, s.N)
		return o
	}
	o.Class, o.Err = classify(err), err.Error()
	o.State = stateHash(comm, s.Tensor, s.N)
	o.Intact = hashBytes(buf.bytes()) == gradBefore && o.State == stateBefore
	return o
}

// selectedAlg is the campaign's name for Ok-Topk through the caller-selected
// call (core/oktopk_selected.go), as a GPU trainer makes it: the rank forms
// acc, selects by the library's rules, keeps the residual and applies the
// call's terms to it.
const selectedAlg = "oktopk_selected"

// callerResiduals holds each rank's caller-kept residuals: per
// communicator (one per rank, in the rank program and in the reference) and
// tensor id.
var callerResiduals sync.Map

type residualKey struct {
	comm   *core.Communicator
	tensor uint64
}

// callerResidual is the residual rank's comm keeps for tensor, n long (a
// call that resizes the tensor is refused, and gets a scratch one).
func callerResidual(comm *core.Communicator, tensor uint64, n int) []float32 {
	v, _ := callerResiduals.LoadOrStore(residualKey{comm, tensor}, make([]float32, n))
	if r := v.([]float32); len(r) == n {
		return r
	}
	return make([]float32, n)
}

// runSelected is runCall for selectedAlg.
func runSelected(comm *core.Communicator, rank int, s CallSpec) Outcome {
	o := Outcome{Index: s.Index}
	buf, err := makeInput(s, rank)
	values, verr := valuesOf(s)
	if err = errors.Join(err, verr); err != nil {
		o.Class, o.Err = "harness", err.Error()
		return o
	}
	cfg := core.Config{Algorithm: core.OkTopk, Density: s.Density, Tau: s.Tau, TauPrime: s.TauPrime, Values: values}
	gradBefore := hashBytes(buf.bytes())
	stateBefore := stateHash(comm, s.Tensor, s.N)
	residual := callerResidual(comm, s.Tensor, s.N)
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(s.TimeoutMs)*time.Millisecond)
	defer cancel()
	grad := buf.f32
	if buf.dtype == transport.DtypeFloat16 {
		grad = make([]float32, s.N)
		core.Float16ToFloat32(grad, buf.half)
	} else if buf.dtype == transport.DtypeBFloat16 {
		grad = make([]float32, s.N)
		core.BFloat16ToFloat32(grad, buf.half)
	}
	o.StartNs = time.Now().UnixNano()
	plan := comm.SelectionPlan(s.Tensor, s.N, cfg)
	acc := make([]float32, s.N)
	nonFinite := core.Accumulate(acc, grad, residual) > 0
	th := plan.Threshold
	var sel core.Sparse
	if !nonFinite {
		sel, _ = core.SelectByThreshold(core.Sparse{}, acc, plan.K, &th, plan.Exact)
	}
	out, _, err := comm.SparseAllreduceSelected(ctx, s.Tensor, s.N, sel, th, nonFinite, cfg, core.CallOptions{Dtype: buf.dtype})
	o.EndNs = time.Now().UnixNano()
	if err != nil {
		o.Class, o.Err = classify(err), err.Error()
		o.State = stateHash(comm, s.Tensor, s.N)
		o.Intact = hashBytes(buf.bytes()) == gradBefore && o.State == stateBefore
		return o
	}
	// Step 6 on the caller's side (include/oktopk.h): the residual, then
	// the result into the caller's buffer in its dtype.
	copy(residual, acc)
	for j, i := range out.Consumed.Idx {
		residual[i] = finiteOr0(residual[i] - out.Consumed.Val[j])
	}
	for j, i := range out.OwnerErr.Idx {
		residual[i] = finiteOr0(residual[i] + out.OwnerErr.Val[j])
	}
	clear(grad)
	for j, i := range out.Result.Idx {
		grad[i] = out.Result.Val[j]
	}
	switch buf.dtype {
	case transport.DtypeFloat16:
		core.Float32ToFloat16(buf.half, grad)
	case transport.DtypeBFloat16:
		core.Float32ToBFloat16(buf.half, grad)
	}
	o.OK, o.Out = true, hashBytes(buf.bytes())
	o.State = stateHash(comm, s.Tensor, s.N)
	return o
}

func finiteOr0(v float32) float32 {
	if v-v != 0 {
		return 0
	}
	return v
}

// classify names an error's kind, in the order the C ABI maps errors to
// result codes (capi/errors.go's resultOf), so "aborted" wins over the
// timeout it wraps, as oktopkAborted does; rendezvous and authentication
// failures, which the C ABI reports as system errors, get names of their own.
func classify(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, core.ErrInternal):
		return "internal"
	case errors.Is(err, core.ErrInvalidArgument):
		return "invalid"
	case errors.Is(err, core.ErrInvalidUsage):
		return "usage"
	case errors.Is(err, core.ErrNonFinite):
		return "nonfinite"
	case errors.Is(err, transport.ErrAborted), errors.Is(err, transport.ErrClosed), errors.Is(err, context.Canceled):
		return "aborted"
	case errors.Is(err, transport.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, transport.ErrMismatch):
		return "mismatch"
	case errors.Is(err, transport.ErrRemote), errors.Is(err, transport.ErrBadFrame):
		return "remote"
	case errors.Is(err, transport.ErrAuth):
		return "auth"
	case errors.Is(err, transport.ErrRendezvous):
		return "rendezvous"
	}
	return "other"
}
