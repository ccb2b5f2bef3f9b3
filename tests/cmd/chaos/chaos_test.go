package main

// Tests of the chaos command's parts: the fault plan, error classification,
// the reference and state hash that calls are checked against, the judge,
// the flooder's ZMTP greeting, and half-precision calls like the C ABI's.

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

// The plan injects exactly the faults asked for, every kind at least once,
// link faults only with namespaces; each job ends with at most one fault
// that ends it (an init fault alone), carries at most maxRidersPerJob
// others, and every algorithm meets both float32 and a half dtype; the same
// seed gives the same plan.
func TestPlanInjectsEveryKindOverEveryAlgorithmAndDtype(t *testing.T) {
	for _, netns := range []bool{true, false} {
		for _, total := range []int{30, 500} {
			plan := makePlan(1, total, netns, true, 4, 2*time.Second)
			counts := map[string]int{}
			combos := map[string]bool{}
			values := map[string]bool{}
			n := 0
			for _, jp := range plan {
				enders := 0
				for i, f := range jp.faults {
					k := kindByName(f)
					counts[f]++
					n++
					if k.fatal || k.init {
						enders++
						if i != len(jp.faults)-1 {
							t.Fatalf("job %d: %s is not last in %v", jp.id, f, jp.faults)
						}
					}
					if k.init && len(jp.faults) != 1 {
						t.Fatalf("job %d: init fault %s shares its job: %v", jp.id, f, jp.faults)
					}
					if k.sparseOnly && isDense(jp.alg) {
						t.Fatalf("job %d: %s on dense %s", jp.id, f, jp.alg)
					}
					if k.valuesOnly && !takesValueFormats(jp.alg) {
						t.Fatalf("job %d: %s on %s, which sends float32 only", jp.id, f, jp.alg)
					}
					if k.netns && !netns {
						t.Fatalf("job %d: %s without namespaces", jp.id, f)
					}
				}
				if enders > 1 || len(jp.faults)-enders > maxRidersPerJob {
					t.Fatalf("job %d: %v", jp.id, jp.faults)
				}
				half := "float32"
				if jp.dtype != "float32" {
					half = "half"
				}
				combos[jp.alg+"/"+half] = true
				if jp.values != "float32" && !takesValueFormats(jp.alg) {
					t.Fatalf("job %d: %s values on %s", jp.id, jp.values, jp.alg)
				}
				values[jp.values] = true
			}
			if n != total {
				t.Fatalf("netns=%v: %d faults planned, want %d", netns, n, total)
			}
			for _, k := range kinds {
				if (!k.netns || netns) && counts[k.name] == 0 {
					t.Errorf("netns=%v total=%d: no %s fault", netns, total, k.name)
				}
			}
			if total == 500 && len(combos) != 2*len(campaignAlgs) {
				t.Errorf("netns=%v: algorithm × dtype combinations covered: %v", netns, combos)
			}
			if total == 500 && len(values) != len(valueFormats) {
				t.Errorf("netns=%v: value formats drawn: %v", netns, values)
			}
		}
	}
	if a, b := makePlan(9, 100, true, true, 4, time.Second), makePlan(9, 100, true, true, 4, time.Second); !reflect.DeepEqual(a, b) {
		t.Error("the same seed made two plans")
	}
	if a, b := makePlan(9, 100, true, true, 4, time.Second), makePlan(10, 100, true, true, 4, time.Second); reflect.DeepEqual(a, b) {
		t.Error("two seeds made the same plan")
	}
}

func TestNamesRank(t *testing.T) {
	cases := []struct {
		msg  string
		v    int
		want bool
	}{
		{"remote peer failed: peer 2 disconnected", 2, true},
		{"ranks [1 2] have not started it", 2, true},
		{"ranks [1 3] have not started it", 2, false},
		{"waiting for rank 12", 1, false},
		{"rank 1 silent for 2.0s", 1, true},
		{"tensor: rank 0 has 7, rank 2 has 8", 2, true},
		{"store at 127.0.0.1:2 unreachable", 0, false},
		{"peers 3", 3, true},
	}
	for _, c := range cases {
		if got := namesRank(c.msg, c.v); got != c.want {
			t.Errorf("namesRank(%q, %d) = %v", c.msg, c.v, got)
		}
	}
}

// classify follows the C ABI's order: an abort that wraps a timeout is
// "aborted", as oktopkAborted.
func TestClassifyFollowsTheCABI(t *testing.T) {
	cases := map[string]error{
		"ok":         nil,
		"aborted":    fmt.Errorf("%w: earlier failure: %w", transport.ErrAborted, transport.ErrTimeout),
		"timeout":    fmt.Errorf("x: %w", transport.ErrTimeout),
		"mismatch":   &transport.MismatchError{Field: "n"},
		"remote":     fmt.Errorf("%w: peer 1 disconnected", transport.ErrRemote),
		"nonfinite":  fmt.Errorf("%w: on another rank", core.ErrNonFinite),
		"invalid":    fmt.Errorf("%w: density", core.ErrInvalidArgument),
		"auth":       fmt.Errorf("%w: wrong job token", transport.ErrAuth),
		"rendezvous": fmt.Errorf("%w: store unreachable", transport.ErrRendezvous),
		"internal":   fmt.Errorf("%w: panic", core.ErrInternal),
		"other":      errors.New("?"),
	}
	for want, err := range cases {
		if got := classify(err); got != want {
			t.Errorf("classify(%v) = %s, want %s", err, got, want)
		}
	}
}

// The reference is what every real call is compared with, bit for bit: it
// must give the same bits for the same calls, whatever the goroutines'
// timing; NaN in a sparse call fails every rank with the buffer and state
// untouched, and the ranks go on.
func TestReferenceIsDeterministic(t *testing.T) {
	run := func(alg, dtype, values string) [][]Outcome {
		ref := newReference(3)
		defer ref.close()
		var out [][]Outcome
		for i := 0; i < 4; i++ {
			s := CallSpec{Index: i, Alg: alg, Dtype: dtype, Values: values, Tensor: 1, N: 2003, Density: 0.05, Tau: 3, TauPrime: 2,
				TimeoutMs: 10000, Seed: uint64(100 + i)}
			specs := []CallSpec{s, s, s}
			if i == 2 {
				specs[1].Poison, specs[1].PoisonAt = "nan", 17
			}
			out = append(out, ref.run(specs))
		}
		return out
	}
	for _, alg := range campaignAlgs {
		for _, c := range []struct{ dtype, values string }{
			{"float32", "float32"}, {"float16", "float32"}, {"bfloat16", "float32"}, {"float32", "int8"}, {"float32", "int4"}, {"float16", "bfloat16"},
		} {
			if c.values != "float32" && !takesValueFormats(alg) {
				continue
			}
			dtype := c.dtype + " buffer, " + c.values + " values"
			a, b := run(alg, c.dtype, c.values), run(alg, c.dtype, c.values)
			for i := range a {
				for r := range a[i] {
					x, y := a[i][r], b[i][r]
					if x.OK != y.OK || x.Out != y.Out || x.State != y.State || x.Class != y.Class {
						t.Fatalf("%s %s call %d rank %d: %+v then %+v", alg, dtype, i, r, x, y)
					}
					switch {
					case i == 2 && !isDense(alg):
						if x.OK || x.Class != "nonfinite" || !x.Intact {
							t.Fatalf("%s %s: NaN call on rank %d: %+v", alg, dtype, r, x)
						}
					case !x.OK:
						t.Fatalf("%s %s call %d rank %d failed: %s", alg, dtype, i, r, x.Err)
					}
				}
			}
		}
	}
}

// stateHash sees every change a failed call must not make (residual, call
// count, thresholds, boundaries) and none of the configuration a call sets;
// no state hashes as the fresh state the first call creates.
func TestStateHashCoversResidualNotConfig(t *testing.T) {
	tr := transport.NewInProc(1)
	c := core.NewCommunicator(tr[0])
	defer tr[0].Close()
	fresh := stateHash(c, 5, 10)
	st := core.NewTensorState(10, core.DefaultConfig())
	c.SetTensorState(5, st)
	if stateHash(c, 5, 10) != fresh {
		t.Fatal("a fresh state hashes differently from no state")
	}
	st.Config.Density, st.Config.Algorithm = 0.5, core.TopkA
	if stateHash(c, 5, 10) != fresh {
		t.Fatal("the configuration changed the hash")
	}
	for name, change := range map[string]func(){
		"residual":   func() { st.Residual[3] = 1 },
		"iter":       func() { st.Iter = 1 },
		"threshold":  func() { st.LocalThreshold = 0.5 },
		"boundaries": func() { st.Boundaries = []uint32{0, 10} },
	} {
		*st = *core.NewTensorState(10, core.DefaultConfig())
		change()
		if stateHash(c, 5, 10) == fresh {
			t.Errorf("a changed %s hashes as before", name)
		}
	}
}

// The judge counts every violation in its column: a result or state off by
// a bit, a failure that changed the buffer, a call past its bound, a
// failure where the reference succeeds.
func TestCheckOutcomeCountsEveryViolation(t *testing.T) {
	h := &harness{live: map[*rankProc]struct{}{}}
	plan := &jobPlan{p: 3, alg: "oktopk", dtype: "float16", n: 1000, density: 0.05, tau: 3, tauPrime: 2, timeout: time.Second}
	st := &jobState{h: h, plan: plan, rng: rand.New(rand.NewPCG(1, 2)), issued: map[int][]CallSpec{}, refOK: map[int]bool{},
		ref: newReference(3), refOut: map[int][]Outcome{}}
	defer st.ref.close()
	calls := st.uniform(1)
	good := st.reference(calls[0][0].Index)[1]
	if !good.OK {
		t.Fatalf("reference failed: %s", good.Err)
	}
	slow := good
	slow.EndNs = slow.StartNs + int64(2*time.Second)
	flipOut, flipState := good, good
	flip := func(h string) string { // another hash, one digit off
		if h[0] == '0' {
			return "1" + h[1:]
		}
		return "0" + h[1:]
	}
	flipOut.Out = flip(flipOut.Out)
	flipState.State = flip(flipState.State)
	failed := Outcome{Index: good.Index, Class: "remote", Err: "peer 2 disconnected", StartNs: good.StartNs, EndNs: good.EndNs, Intact: true}
	changed := failed
	changed.Intact = false
	cases := []struct {
		name   string
		o      Outcome
		strict bool
		count  func(*faultResult) int
	}{
		{"exact", good, true, func(f *faultResult) int { return len(f.problems) }},
		{"slow", slow, false, func(f *faultResult) int { return f.hangs }},
		{"result", flipOut, false, func(f *faultResult) int { return f.wrong }},
		{"state", flipState, false, func(f *faultResult) int { return f.wrong }},
		{"changed", changed, false, func(f *faultResult) int { return f.stateChanged }},
		{"unexpected failure", failed, true, func(f *faultResult) int { return f.badErr }},
		{"expected failure", failed, false, func(f *faultResult) int { return len(f.problems) }},
	}
	for _, c := range cases {
		res := &faultResult{}
		st.checkOutcome(res, 1, c.o, c.strict, false)
		want := 1
		if c.name == "exact" || c.name == "expected failure" {
			want = 0
		}
		if got := c.count(res); got != want || len(res.problems) != want {
			t.Errorf("%s: counted %d (%v), want %d", c.name, got, res.problems, want)
		}
	}
	// A failure must be of the right class and name the faulty rank.
	b := &batchResult{calls: []Outcome{failed}, finished: true}
	for _, c := range []struct {
		classes []string
		v, want int
	}{{[]string{"remote"}, 2, 0}, {[]string{"timeout"}, 2, 1}, {[]string{"remote"}, 1, 1}, {[]string{"remote"}, -2, 0}} {
		res := &faultResult{}
		expectFailure(res, 0, b, c.classes, c.v)
		if res.badErr != c.want {
			t.Errorf("expectFailure(%v, %d): %v", c.classes, c.v, res.problems)
		}
	}
	res := &faultResult{}
	expectFailure(res, 0, &batchResult{calls: []Outcome{good}, finished: true}, []string{"remote"}, 2)
	if res.badErr != 1 {
		t.Errorf("a fault nobody noticed was not counted: %v", res.problems)
	}
}

// The flooder's raw ZMTP greeting is one a ZeroMQ ROUTER accepts, so that
// the frames it announces after it reach the rank's decoder (and its
// memory): a frame sent after the greeting arrives as a message.
func TestFlooderGreetingIsAcceptedByZeroMQ(t *testing.T) {
	zctx, err := zmq.NewRawContext()
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Term()
	router, err := zctx.NewSocket(zmq.Router)
	if err != nil {
		t.Fatal(err)
	}
	defer router.Close()
	router.SetLinger(0)
	router.SetRcvtimeo(5 * time.Second)
	if err := router.Bind("tcp://127.0.0.1:*"); err != nil {
		t.Fatal(err)
	}
	ep, _ := router.LastEndpoint()
	c, err := net.Dial("tcp", strings.TrimPrefix(ep, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := zmtpOpen(c); err != nil {
		t.Fatal(err)
	}
	msg := append(zmtpFrameHeader(5), "hello"...)
	long := strings.Repeat("x", 300)
	msg = append(append(msg, zmtpFrameHeader(uint64(len(long)))...), long...)
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	go bufio.NewReader(c).Discard(1 << 20) // the router's READY
	for _, want := range []string{"hello", long} {
		parts, err := router.RecvMessage()
		if err != nil || len(parts) != 2 || parts[1] != want {
			t.Fatalf("router received %q, %v; want [id %.10q]", parts, err, want)
		}
	}
}

// The rank program's call runs what the C ABI runs: a half-precision buffer
// comes back narrowed from the float32 result, and a failed call leaves it
// as it was.
func TestRunCallHalfPrecisionLikeTheCABI(t *testing.T) {
	tr := transport.NewInProc(1)
	defer tr[0].Close()
	c := core.NewCommunicator(tr[0])
	s := CallSpec{Alg: "dense_ring", Dtype: "bfloat16", N: 64, Density: 1, Tau: 1, TauPrime: 1, TimeoutMs: 1000, Seed: 3}
	o := runCall(c, 0, s)
	in, _ := makeInput(s, 0)
	if !o.OK || o.Out != hashBytes(in.bytes()) {
		t.Fatalf("one rank's average is its own bfloat16 input: %+v", o)
	}
	s.Density = 2 // refused before anything moves
	if o := runCall(c, 0, s); o.OK || o.Class != "invalid" || !o.Intact {
		t.Fatalf("invalid call: %+v", o)
	}
}

// A mismatch-algorithm victim calls with an algorithm that differs on the
// wire and keeps its residual where the job's does: never the
// caller-selected form (Ok-Topk on the wire), and beside it only a dense
// algorithm; every other algorithm is drawn for some job.
func TestOtherAlgorithmDiffersOnTheWire(t *testing.T) {
	for _, alg := range campaignAlgs {
		seen := map[string]bool{}
		for i := 0; i < 64; i++ {
			seen[otherAlgorithm(alg, func(n int) int { return i % n })] = true
		}
		for other := range seen {
			if other == alg || other == selectedAlg || (alg == selectedAlg && !isDense(other)) {
				t.Fatalf("%s: drew %s", alg, other)
			}
		}
		want := len(campaignAlgs) - 2 // all but itself and the caller-selected form
		if alg == selectedAlg {
			want = 2 // the dense algorithms
		}
		if len(seen) != want {
			t.Fatalf("%s: drew %v, want %d algorithms", alg, seen, want)
		}
	}
}
