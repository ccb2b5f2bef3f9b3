package core

// Fuzz tests: arbitrary checkpoint bytes are refused or load, save and run
// consistently, and an arbitrary peer payload in any call of any algorithm
// is refused or used, never a panic, a hang or a changed buffer or state.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// sameCheckpoint compares what a checkpoint carries, bit for bit.
func sameCheckpoint(a, b *TensorState) bool {
	return a.N == b.N && a.Iter == b.Iter && a.Config.Algorithm == b.Config.Algorithm &&
		math.Float64bits(a.Config.Density) == math.Float64bits(b.Config.Density) &&
		a.Config.Tau == b.Config.Tau && a.Config.TauPrime == b.Config.TauPrime &&
		math.Float32bits(a.LocalThreshold) == math.Float32bits(b.LocalThreshold) &&
		math.Float32bits(a.GlobalThreshold) == math.Float32bits(b.GlobalThreshold) &&
		slices.Equal(a.Boundaries, b.Boundaries) && equalBits(a.Residual, b.Residual)
}

// watchdog fails a fuzz input that does not return within 30 s (the
// calls' own timeouts are 20 s or less), with every goroutine's stack: a
// call stuck in a loop would otherwise stall the fuzzer without a word.
func watchdog(what func() string) *time.Timer {
	return time.AfterFunc(30*time.Second, func() {
		buf := make([]byte, 1<<20)
		panic(fmt.Sprintf("%s: no return after 30 s\n%s", what(), buf[:runtime.Stack(buf, true)]))
	})
}

// FuzzTensorState: any bytes either are refused by UnmarshalBinary or load
// into a state whose lengths and boundaries are consistent, that saves into
// bytes which load back into the same state, and that a sparse allreduce can
// run from, on both ranks of a job restoring it as a checkpoint, without a
// panic or a hang.
func FuzzTensorState(f *testing.F) {
	for _, alg := range []Algorithm{OkTopk, TopkA, GTopk, Gaussiank, DenseRing} {
		st := NewTensorState(37, Config{Algorithm: alg, Density: 0.1, Tau: 3, TauPrime: 2})
		for i := range st.Residual {
			st.Residual[i] = float32(i%7) - 3
		}
		st.Iter, st.LocalThreshold, st.GlobalThreshold = 5, 1.5, 2.5
		if alg == OkTopk {
			st.Boundaries = []uint32{0, 20, 37}
		}
		b, err := st.MarshalBinary()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte("OKTS"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var st TensorState
		if err := st.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrInvalidArgument) {
				t.Fatalf("refused with %v, not ErrInvalidArgument", err)
			}
			return
		}
		again, err := st.MarshalBinary()
		if err != nil {
			t.Fatalf("a loaded state does not save: %v", err)
		}
		var back TensorState
		if err := back.UnmarshalBinary(again); err != nil || !sameCheckpoint(&back, &st) {
			t.Fatalf("a loaded state saves into bytes that load as another state (%v)", err)
		}
		if len(st.Residual) != st.N {
			t.Fatalf("residual of %d for n=%d", len(st.Residual), st.N)
		}
		for i, x := range st.Boundaries {
			if int(x) > st.N || (i > 0 && x < st.Boundaries[i-1]) || (i == 0 && x != 0) || (i == len(st.Boundaries)-1 && int(x) != st.N) {
				t.Fatalf("boundaries %v for n=%d", st.Boundaries, st.N)
			}
		}
		// Restore it on both ranks of a job, as the C ABI's load does (which
		// refuses boundaries that are not P+1), and run one call from it.
		const p = 2
		if st.N > 4096 || (len(st.Boundaries) != 0 && len(st.Boundaries) != p+1) {
			return
		}
		defer watchdog(func() string { return fmt.Sprintf("a call from a loaded state (%v, n=%d)", st.Config, st.N) }).Stop()
		ts := transport.NewInProcDiagnostics(p, transport.Diagnostics{StallWarn: -1})
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		errs := make([]error, p)
		var wg sync.WaitGroup
		for r := 0; r < p; r++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := NewCommunicator(ts[r])
				var mine TensorState
				if err := mine.UnmarshalBinary(b); err != nil {
					errs[r] = err
					return
				}
				c.SetTensorState(1, &mine)
				grad := make([]float32, st.N)
				for i := range grad {
					grad[i] = float32((i*5+r*3)%11) - 5
				}
				_, errs[r] = c.SparseAllreduce(ctx, 1, grad, mine.Config)
			}()
		}
		wg.Wait()
		for r, err := range errs {
			if errors.Is(err, ErrInternal) || errors.Is(err, transport.ErrTimeout) {
				t.Fatalf("rank %d, from a loaded state (%v, n=%d, iter=%d, thresholds %v/%v, boundaries %v): %v",
					r, st.Config, st.N, st.Iter, st.LocalThreshold, st.GlobalThreshold, st.Boundaries, err)
			}
		}
	})
}

// A peer's messages as one rank received them in a fault-free job, for
// replaying them with one of them changed (FuzzPeerPayload).
type recordedCall struct {
	grad  []float32 // rank 0's input
	msgs  map[msgKey][]transport.Message
	keys  []msgKey  // sorted, for picking one by number
	out   []float32 // rank 0's result
	state []byte    // rank 0's tensor state after the call
}

type msgKey struct {
	peer int
	seq  uint64
	step uint32
}

// recorder is rank 0's transport in the fault-free run: it notes every
// message rank 0 receives.
type recorder struct {
	transport.Transport
	mu   sync.Mutex
	msgs map[msgKey][]transport.Message
}

func (r *recorder) Recv(ctx context.Context, peer int, tag transport.Tag) (transport.Message, error) {
	m, err := r.Transport.Recv(ctx, peer, tag)
	if err == nil {
		c := m
		c.Payload = append([]byte(nil), m.Payload...)
		r.mu.Lock()
		k := msgKey{peer, tag.Seq, tag.Step}
		r.msgs[k] = append(r.msgs[k], c)
		r.mu.Unlock()
	}
	return m, err
}

// replay is rank 0's transport in a fuzzed run: its receives are served
// from the recording (a message never recorded is a timeout at once); its
// sends go nowhere.
type replay struct {
	size int
	mu   sync.Mutex
	msgs map[msgKey][]transport.Message
}

func (r *replay) Rank() int                                          { return 0 }
func (r *replay) Size() int                                          { return r.size }
func (r *replay) StartCall(transport.Op, uint64, transport.CallDesc) {}
func (r *replay) Abort(error)                                        {}
func (r *replay) RefuseCall(context.Context, uint64, string)         {}
func (r *replay) Close() error                                       { return nil }
func (r *replay) Send(context.Context, int, transport.Tag, transport.Dtype, uint64, []byte) error {
	return nil
}

func (r *replay) Recv(_ context.Context, peer int, tag transport.Tag) (transport.Message, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := msgKey{peer, tag.Seq, tag.Step}
	q := r.msgs[k]
	if len(q) == 0 {
		return transport.Message{}, fmt.Errorf("%w: %v from peer %d was not recorded", transport.ErrTimeout, tag, peer)
	}
	r.msgs[k] = q[1:]
	// A copy: algorithms may reduce into a received payload in place, and
	// the recording serves every run.
	m := q[0]
	m.Payload = append([]byte(nil), m.Payload...)
	return m, nil
}

// peerPayloadRuns: per algorithm, three calls of a 3-rank job (τ′ = 2, τ = 3,
// so thresholds are both computed and reused, and Ok-Topk repartitions).
const (
	fuzzP     = 3
	fuzzN     = 300
	fuzzCalls = 3
)

var fuzzConfig = Config{Density: 0.05, Tau: 3, TauPrime: 2}

// fuzzLink is the link model of the recording and of every replay, so that
// Auto chooses the same algorithm in both. A measured one would not do: the
// replaying rank 0 times its ping-pong against recorded answers, which come
// at once, and at this size the choice between TopkA and the dense ring
// turns on a few per cent of the figures.
var fuzzLink = LinkModel{Alpha: 2e-6, Beta: 1e-9, Gamma: 6e-11}

func fuzzGrad(rank, call int) []float32 {
	g := make([]float32, fuzzN)
	for i := range g {
		g[i] = float32((rank*7+i*13+call*5)%29-14) * 0.25
	}
	return g
}

// fuzzCase is one recorded job of FuzzPeerPayload: an algorithm and the
// values it sends.
type fuzzCase struct {
	alg    Algorithm
	values ValueType
}

func (c fuzzCase) String() string { return fmt.Sprintf("%v (%v values)", c.alg, c.values) }

// fuzzCases is every algorithm with float32 values (case i is algorithm
// i), then with 8-bit values those that take them, then with 4-bit values.
func fuzzCases() []fuzzCase {
	var cases []fuzzCase
	for _, alg := range Algorithms() {
		cases = append(cases, fuzzCase{alg, ValuesFloat32})
	}
	for _, v := range []ValueType{ValuesInt8, ValuesInt4} {
		for _, alg := range Algorithms() {
			if alg.takesReducedValues() && alg != Auto {
				cases = append(cases, fuzzCase{alg, v})
			}
		}
	}
	return cases
}

var (
	recordOnce sync.Once
	recordings map[fuzzCase][]recordedCall
	recordErr  error
)

// record runs every case fault-free in process, noting what rank 0
// receives and returns in each call.
func record() (map[fuzzCase][]recordedCall, error) {
	recordOnce.Do(func() {
		recordings = map[fuzzCase][]recordedCall{}
		for _, fc := range fuzzCases() {
			alg := fc.alg
			ts := transport.NewInProcDiagnostics(fuzzP, transport.Diagnostics{StallWarn: -1})
			rec := &recorder{Transport: ts[0]}
			comms := []*Communicator{NewCommunicator(rec)}
			for r := 1; r < fuzzP; r++ {
				comms = append(comms, NewCommunicator(ts[r]))
			}
			for _, c := range comms {
				if err := c.SetLinkModel(fuzzLink); err != nil {
					recordErr = err
					return
				}
			}
			cfg := fuzzConfig
			cfg.Algorithm, cfg.Values = alg, fc.values
			for call := 0; call < fuzzCalls; call++ {
				rec.msgs = map[msgKey][]transport.Message{}
				outs := make([][]float32, fuzzP)
				errs := make([]error, fuzzP)
				var wg sync.WaitGroup
				for r := range comms {
					wg.Add(1)
					go func() {
						defer wg.Done()
						ctx, cancel := context.WithTimeout(context.Background(), inProcTimeout)
						defer cancel()
						outs[r] = fuzzGrad(r, call)
						_, errs[r] = comms[r].SparseAllreduce(ctx, 1, outs[r], cfg)
					}()
				}
				wg.Wait()
				if err := errors.Join(errs...); err != nil {
					recordErr = fmt.Errorf("%v call %d: %w", fc, call, err)
					return
				}
				rc := recordedCall{grad: fuzzGrad(0, call), msgs: rec.msgs, out: outs[0], state: savedState(comms[0])}
				for k := range rc.msgs {
					rc.keys = append(rc.keys, k)
				}
				sort.Slice(rc.keys, func(a, b int) bool {
					x, y := rc.keys[a], rc.keys[b]
					if x.seq != y.seq {
						return x.seq < y.seq
					}
					if x.step != y.step {
						return x.step < y.step
					}
					return x.peer < y.peer
				})
				recordings[fc] = append(recordings[fc], rc)
			}
		}
	})
	return recordings, recordErr
}

// savedState is tensor 1's saved state without its configuration fields
// (each call sets those from its own settings); a tensor without state yet
// saves as the fresh state its first call creates.
func savedState(c *Communicator) []byte {
	var st TensorState
	if live := c.TensorStateOf(1); live != nil {
		st = *live
	} else {
		st = *NewTensorState(fuzzN, fuzzConfig)
	}
	st.Config = fuzzConfig
	b, err := st.MarshalBinary()
	if err != nil {
		panic(err)
	}
	return b
}

// fuzzCount is the count a message of dtype carrying payload claims in
// FuzzPeerPayload: the recorded message's (orig), when it has that dtype
// (a sparse payload's count can be told from its length only roughly), else
// the payload's length over the dtype's width, as many as fit.
func fuzzCount(dtype transport.Dtype, payload []byte, orig transport.Message) uint64 {
	if dtype == orig.Dtype {
		return orig.Count
	}
	switch dtype {
	case transport.DtypeFloat16, transport.DtypeBFloat16:
		return uint64(len(payload) / 2)
	case transport.DtypeFloat32:
		return uint64(len(payload) / 4)
	case transport.DtypeUint64:
		return uint64(len(payload) / 8)
	case transport.DtypeSparseF32:
		return uint64(len(payload) / 5) // 4 bytes of value, and a coded index of about 8 bits
	case transport.DtypeSparseF16, transport.DtypeSparseBF16, transport.DtypeSparseI8:
		return uint64(len(payload) / 3)
	case transport.DtypeSparseI4:
		return uint64(len(payload) / 2)
	}
	return uint64(len(payload))
}

// FuzzPeerPayload: one message a peer sends, replaced by arbitrary bytes
// (of any dtype, with the count fuzzCount gives it, where the frame check
// lets it through), in any call of any algorithm, with float32 values or,
// where it takes them, 8-bit ones.
// Every decoder of peers' payloads inside the algorithms (dense chunks,
// sparse regions, Ok-Topk's histograms and boundaries, the agreement words,
// gTopk's and Gaussiank's exchanges) must refuse it or use it, never panic
// (caught as ErrInternal); a call that fails must leave the caller's buffer
// and the tensor's state as they were; and an unchanged message must
// reproduce the fault-free result exactly.
func FuzzPeerPayload(f *testing.F) {
	recs, err := record()
	if err != nil {
		f.Fatal(err)
	}
	cases := fuzzCases()
	for ci, fc := range cases {
		for call, rc := range recs[fc] {
			for i, k := range rc.keys {
				m := rc.msgs[k][0]
				f.Add(uint8(ci), uint8(call), uint16(i), uint8(m.Dtype), m.Payload)
			}
		}
	}
	f.Fuzz(func(t *testing.T, caseByte, callByte uint8, msgNum uint16, dtypeByte uint8, payload []byte) {
		fc := cases[int(caseByte)%len(cases)]
		alg := fc.alg
		rcs := recs[fc]
		target := int(callByte) % len(rcs)
		if len(rcs[target].keys) == 0 {
			return
		}
		key := rcs[target].keys[int(msgNum)%len(rcs[target].keys)]
		dtype := transport.Dtype(dtypeByte % 9)
		orig := rcs[target].msgs[key][0]
		count := fuzzCount(dtype, payload, orig)
		if transport.CheckPayloadSize(dtype, count, uint64(len(payload))) != nil {
			return // the frame check drops it before any algorithm sees it
		}
		cfg := fuzzConfig
		cfg.Algorithm, cfg.Values = alg, fc.values
		defer watchdog(func() string { return fmt.Sprintf("%v call %d with message %+v changed", fc, target, key) }).Stop()
		rep := &replay{size: fuzzP}
		c := NewCommunicator(rep)
		if err := c.SetLinkModel(fuzzLink); err != nil {
			t.Fatal(err)
		}
		for call := 0; call <= target; call++ {
			rc := rcs[call]
			rep.msgs = map[msgKey][]transport.Message{}
			for k, q := range rc.msgs {
				rep.msgs[k] = append([]transport.Message(nil), q...)
			}
			changed := false
			if call == target {
				m := orig
				m.Dtype, m.Count, m.Payload = dtype, count, append([]byte(nil), payload...)
				changed = m.Dtype != orig.Dtype || m.Count != orig.Count || !bytes.Equal(m.Payload, orig.Payload)
				rep.msgs[key] = append([]transport.Message{m}, rep.msgs[key][1:]...)
			}
			grad := append([]float32(nil), rc.grad...)
			stateBefore := savedState(c)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err := c.SparseAllreduce(ctx, 1, grad, cfg)
			cancel()
			switch {
			case errors.Is(err, ErrInternal):
				t.Fatalf("%v call %d, message %+v changed: %v", fc, call, key, err)
			case err != nil && !changed:
				t.Fatalf("%v call %d failed with its recorded messages: %v", fc, call, err)
			case err != nil:
				if !equalBits(grad, rc.grad) {
					t.Fatalf("%v call %d failed (%v) but changed the caller's buffer", fc, call, err)
				}
				if after := savedState(c); !bytes.Equal(after, stateBefore) {
					t.Fatalf("%v call %d failed (%v) but changed the tensor's state", fc, call, err)
				}
				return
			case !changed && (!equalBits(grad, rc.out) || !bytes.Equal(savedState(c), rc.state)):
				t.Fatalf("%v call %d: replaying the recorded messages gave another result", fc, call)
			}
		}
	})
}

func equalBits(a, b []float32) bool {
	return bytes.Equal(Float32Bytes(a), Float32Bytes(b))
}
