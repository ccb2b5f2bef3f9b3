package main

// Injecting each kind of fault into a running job, and judging what every
// rank did about it. The checks, for every fault:
//
//   - hangs: a call returned later than its timeout + 10% (as the rank
//     measured it), a rank went silent for longer than any call may take,
//     joining took longer than its timeout + 10%, or destroying the
//     communicator took longer than 1 s + 10%;
//   - crashes: a rank exited other than by the fault's own signal or its
//     orderly exit, or printed a Go panic or runtime error;
//   - wrong results: a call returned success with a buffer or tensor state
//     that differs in any bit from the fault-free reference, or returned
//     success from a call that must fail (ranks disagree on it);
//   - bad errors: a failure of the wrong class, one that does not name the
//     faulty rank where it is known, or a failure where none was due;
//   - state changed: a failed call did not leave the caller's buffer and the
//     tensor's state exactly as before;
//   - over the RSS bound: a rank's resident memory passed the bound during a
//     stranger's flood.

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/oktopk/oktopk/core"
)

// faultResult is what one injected fault did.
type faultResult struct {
	kind   string
	plan   *jobPlan
	victim int

	hangs, crashes, wrong, badErr, stateChanged, overRSS int
	detect                                               time.Duration
	hasDetect                                            bool
	rss                                                  uint64
	problems                                             []string
	notes                                                []string // what each rank returned (-v)
}

func (f *faultResult) problem(counter *int, format string, args ...any) {
	*counter++
	f.problems = append(f.problems, fmt.Sprintf(format, args...))
}

func (f *faultResult) detected(d time.Duration) {
	if !f.hasDetect || d > f.detect {
		f.detect, f.hasDetect = d, true
	}
}

func (f *faultResult) failed() bool {
	return f.hangs+f.crashes+f.wrong+f.badErr+f.stateChanged+f.overRSS > 0
}

// jobState is a running job seen from the harness: the calls issued so far
// and the reference that replays them.
type jobState struct {
	h    *harness
	j    *job
	plan *jobPlan
	rng  *rand.Rand

	next    int
	issued  map[int][]CallSpec // call index → each rank's spec
	refOK   map[int]bool       // the reference may replay this call
	ref     *reference
	refDone int
	refOut  map[int][]Outcome
	refLost bool // a call the reference could not replay came before

	initFailed []bool
	callTime   time.Duration // typical duration of one call in this job
}

func (st *jobState) all() []int {
	r := make([]int, st.plan.p)
	for i := range r {
		r[i] = i
	}
	return r
}

func without(ranks []int, v int) []int {
	return slices.DeleteFunc(slices.Clone(ranks), func(r int) bool { return r == v })
}

// spec is the job's next call as every rank issues it when nothing is wrong.
func (st *jobState) spec() CallSpec {
	s := CallSpec{Index: st.next, Alg: st.plan.alg, Dtype: st.plan.dtype, Tensor: 1, N: st.plan.n,
		Density: st.plan.density, Tau: st.plan.tau, TauPrime: st.plan.tauPrime,
		TimeoutMs: int(st.plan.timeout / time.Millisecond), Seed: st.rng.Uint64()}
	st.next++
	return s
}

// record notes the specs of one call (every rank's, so the reference can
// replay it when replayable).
func (st *jobState) record(specs []CallSpec, replayable bool) {
	st.issued[specs[0].Index] = specs
	st.refOK[specs[0].Index] = replayable
}

// uniform makes m fault-free calls, the same on every rank.
func (st *jobState) uniform(m int) [][]CallSpec {
	calls := make([][]CallSpec, m)
	for i := range calls {
		s := st.spec()
		specs := make([]CallSpec, st.plan.p)
		for r := range specs {
			specs[r] = s
		}
		st.record(specs, true)
		calls[i] = specs
	}
	return calls
}

// perRank turns calls (each with every rank's spec) into each listed
// rank's command.
func perRank(calls [][]CallSpec, ranks []int) map[int][]CallSpec {
	out := map[int][]CallSpec{}
	for _, r := range ranks {
		for _, c := range calls {
			out[r] = append(out[r], c[r])
		}
	}
	return out
}

// reference returns the fault-free outcome of call index on every rank, or
// nil when the reference cannot say (a call every rank must fail).
func (st *jobState) reference(index int) []Outcome {
	for ; st.refDone <= index; st.refDone++ {
		if !st.refOK[st.refDone] {
			st.refLost = true
			continue
		}
		if st.refLost {
			st.h.harnessProblem(fmt.Sprintf("job %d: call %d follows a call the reference could not replay", st.plan.id, st.refDone))
			continue
		}
		st.refOut[st.refDone] = st.ref.run(st.issued[st.refDone])
	}
	return st.refOut[index]
}

// checkOutcome applies the checks every call gets: its duration, a success
// against the reference, a failure's buffer and state. strict: a failure is
// due only where the reference fails the same way (no fault that may fail
// calls is in play). exemptTook: the rank itself was stopped mid-call.
func (st *jobState) checkOutcome(res *faultResult, r int, o Outcome, strict, exemptTook bool) {
	bound := st.plan.timeout * 11 / 10
	if !exemptTook && o.Took() > bound {
		res.problem(&res.hangs, "rank %d: call %d returned after %v, bound %v (%s)", r, o.Index, o.Took().Round(time.Millisecond), bound, briefErr(o))
	}
	ref := st.reference(o.Index)
	if o.OK {
		st.h.count(&st.h.okChecked)
		switch {
		case ref == nil:
			res.problem(&res.wrong, "rank %d: call %d returned success although the ranks' calls disagree", r, o.Index)
		case !ref[r].OK:
			res.problem(&res.wrong, "rank %d: call %d returned success where the fault-free reference fails (%s)", r, o.Index, ref[r].Err)
		case o.Out != ref[r].Out:
			res.problem(&res.wrong, "rank %d: call %d: result differs from the fault-free reference", r, o.Index)
		case o.State != ref[r].State:
			res.problem(&res.wrong, "rank %d: call %d: tensor state (residual, thresholds) differs from the fault-free reference", r, o.Index)
		}
		return
	}
	st.h.count(&st.h.failChecked)
	if !o.Intact {
		res.problem(&res.stateChanged, "rank %d: call %d failed (%s) but changed the caller's buffer or the tensor's state", r, o.Index, o.Class)
	}
	if strict {
		switch {
		case ref == nil:
		case ref[r].OK:
			res.problem(&res.badErr, "rank %d: call %d failed where nothing should fail: %s", r, o.Index, o.Err)
		case ref[r].Class != o.Class:
			res.problem(&res.badErr, "rank %d: call %d failed with %s, the fault-free reference with %s: %s", r, o.Index, o.Class, ref[r].Class, o.Err)
		}
	}
}

func briefErr(o Outcome) string {
	if o.OK {
		return "success"
	}
	e := o.Err
	if len(e) > 300 {
		e = e[:300] + "…"
	}
	return o.Class + ": " + e
}

// checkBatch checks every outcome of res and the rank's state at the end:
// hung (it is ended), exited (a crash). It reports whether the rank is
// still usable. stoppedAt (Unix ns, 0: never) is when the rank itself was
// stopped: the call it was in then is not held to its timeout.
func (st *jobState) checkBatch(res *faultResult, r int, b *batchResult, strict bool, stoppedAt int64) bool {
	for _, o := range b.calls {
		st.checkOutcome(res, r, o, strict, o.StartNs <= stoppedAt && stoppedAt <= o.EndNs)
	}
	switch {
	case b.hung:
		res.problem(&res.hangs, "rank %d: silent for longer than a call may take (%d calls reported)", r, len(b.calls))
		st.j.quit(r)
		return false
	case b.eof && st.j.killedForRSS(r) > 0:
		res.problem(&res.overRSS, "rank %d: its RSS reached %s; the harness killed it (cap %s)", r, mib(st.j.killedForRSS(r)), mib(st.h.cfg.rssKill))
		return false
	case b.eof:
		res.problem(&res.crashes, "rank %d: exited in the middle of a batch (%s): %s", r, st.j.procs[r].exitDescription(), lastLine(st.j.procs[r].stderr.String()))
		return false
	}
	return true
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// runBatch sends calls to ranks and collects every rank's outcomes.
func (st *jobState) runBatch(calls [][]CallSpec, ranks []int) map[int]*batchResult {
	st.j.sendCalls(perRank(calls, ranks))
	out := map[int]*batchResult{}
	for _, r := range ranks {
		out[r] = &batchResult{}
		st.j.collect(r, out[r])
	}
	return out
}

// verify runs m fault-free calls on every rank: each must succeed and match
// the reference. It reports whether the job is still healthy.
func (st *jobState) verify(res *faultResult, m int) bool {
	healthy := true
	for r, b := range st.runBatch(st.uniform(m), st.all()) {
		ok := st.checkBatch(res, r, b, true, 0)
		healthy = healthy && ok && b.failed() == nil
	}
	return healthy
}

// batchLength is how many calls take about d at this job's pace.
func (st *jobState) batchLength(d time.Duration) int {
	m := int(d / max(st.callTime, time.Millisecond))
	return max(4, min(m, 300))
}

var rankRE = regexp.MustCompile(`\b(?:rank|peer)s? (?:(\d+)|\[([\d ]+)\])`)

// namesRank reports whether msg names rank v ("rank 2", "peer 2",
// "ranks [1 2]").
func namesRank(msg string, v int) bool {
	want := strconv.Itoa(v)
	for _, m := range rankRE.FindAllStringSubmatch(msg, -1) {
		if m[1] == want {
			return true
		}
		for _, f := range strings.Fields(m[2]) {
			if f == want {
				return true
			}
		}
	}
	return false
}

// namesAnyRank reports whether msg names some rank.
func namesAnyRank(msg string) bool { return rankRE.MatchString(msg) }

// expectFailure checks that a rank's batch ended in a failure of one of the
// classes, naming rank v (v < 0: any rank; v == -2: no rank needed), and
// returns that failure.
func expectFailure(res *faultResult, r int, b *batchResult, classes []string, v int) *Outcome {
	f := b.failed()
	if f != nil {
		res.notes = append(res.notes, fmt.Sprintf("rank %d after %v: %s", r, f.Took().Round(time.Millisecond), briefErr(*f)))
	}
	if f == nil {
		if b.finished {
			res.problem(&res.badErr, "rank %d: every call succeeded: the fault went unnoticed", r)
		}
		return nil
	}
	if !slices.Contains(classes, f.Class) {
		res.problem(&res.badErr, "rank %d: failed with %s, want %s: %s", r, f.Class, strings.Join(classes, " or "), f.Err)
		return f
	}
	switch {
	case v >= 0 && !namesRank(f.Err, v):
		res.problem(&res.badErr, "rank %d: the error does not name rank %d: %s", r, v, f.Err)
	case v == -1 && !namesAnyRank(f.Err):
		res.problem(&res.badErr, "rank %d: the error names no rank: %s", r, f.Err)
	}
	return f
}

// inject runs one fault in the job and reports whether the job goes on.
func (st *jobState) inject(kind string, res *faultResult) bool {
	switch kind {
	case "sigkill", "sigstop":
		return st.signalFault(res, kind)
	case "link-down":
		return st.linkDown(res)
	case "link-slow":
		return st.linkSlow(res)
	case "never-arrives-call":
		return st.neverArrives(res)
	case "mismatch-tensor", "mismatch-n", "mismatch-k", "mismatch-dtype", "mismatch-algorithm":
		return st.mismatch(res, strings.TrimPrefix(kind, "mismatch-"))
	case "refused-locally":
		return st.refused(res)
	case "nan", "inf":
		return st.poison(res, kind)
	case "flood-random-bytes", "flood-empty-frames", "flood-huge-announce", "flood-idle-conns", "wrong-token-frames":
		return st.flood(res, kind)
	}
	panic("no injector for " + kind)
}

// faultBatch starts a batch long enough to be hit mid-call and waits until
// every rank is running it; it returns the batch's results so far and a
// random delay at which to strike.
func (st *jobState) faultBatch() (map[int]*batchResult, time.Duration) {
	m := st.batchLength(800 * time.Millisecond)
	st.j.sendCalls(perRank(st.uniform(m), st.all()))
	res := map[int]*batchResult{}
	for _, r := range st.all() {
		res[r] = &batchResult{}
		st.j.firstCall(r, res[r])
	}
	span := time.Duration(m-1) * st.callTime
	return res, time.Duration(st.rng.Int64N(int64(min(span*7/10, 500*time.Millisecond)) + 1))
}

// followUp gives ranks whose batch ended without noticing the fault (it came
// after their last call) one more call, which must notice it.
func (st *jobState) followUp(results map[int]*batchResult, ranks []int) {
	var again []int
	for _, r := range ranks {
		b := results[r]
		if b.finished && b.failed() == nil {
			again = append(again, r)
		}
	}
	if len(again) == 0 {
		return
	}
	calls := st.uniform(1)
	st.j.sendCalls(perRank(calls, again))
	for _, r := range again {
		b := results[r]
		b.finished = false
		st.j.collect(r, b)
	}
}

// signalFault: SIGKILL or SIGSTOP of one rank at a random point of a call.
// The others must fail, within the call timeout + 10%, with a remote error
// (killed: its connections drop) or a timeout (stopped: silent, connections
// up), naming it.
func (st *jobState) signalFault(res *faultResult, kind string) bool {
	v := st.rng.IntN(st.plan.p)
	res.victim = v
	sig, classes := syscall.SIGKILL, []string{"remote"}
	if kind == "sigstop" {
		sig, classes = syscall.SIGSTOP, []string{"timeout", "remote"}
	}
	results, delay := st.faultBatch()
	for r, b := range results {
		if b.hung || b.eof {
			st.checkBatch(res, r, b, true, 0)
			return false
		}
	}
	time.Sleep(delay)
	struck := time.Now()
	p := st.j.procs[v]
	p.injected = sig
	p.signal(sig)
	survivors := without(st.all(), v)
	for _, r := range survivors {
		st.j.collect(r, results[r])
	}
	st.followUp(results, survivors)
	for _, r := range survivors {
		b := results[r]
		if !st.checkBatch(res, r, b, false, 0) {
			continue
		}
		if f := expectFailure(res, r, b, classes, v); f != nil && f.EndNs > struck.UnixNano() {
			res.detected(time.Duration(f.EndNs - struck.UnixNano()))
		}
	}
	if sig == syscall.SIGSTOP {
		// The stopped rank resumes into a job that has failed: whatever it
		// returns must be a result the reference agrees with, or an error.
		p.injected = 0
		p.signal(syscall.SIGCONT)
		st.j.collect(v, results[v])
		st.checkBatch(res, v, results[v], false, struck.UnixNano())
	} else {
		<-p.exited
		if d := p.exitDescription(); d != "signal killed" {
			res.problem(&res.crashes, "rank %d: SIGKILL sent, but it ended with %s", v, d)
		}
		// Whatever it reported before dying must be right.
		for _, o := range results[v].calls {
			st.checkOutcome(res, v, o, false, false)
		}
	}
	return false
}

// linkDown: rank v's link goes down for a while and comes back. Calls may
// ride it out (then their results must be exact) or fail with a timeout or a
// remote error; while the link is down, a failing rank other than v must
// name v.
func (st *jobState) linkDown(res *faultResult) bool {
	v := st.rng.IntN(st.plan.p)
	res.victim = v
	outage := 100*time.Millisecond + time.Duration(st.rng.Int64N(int64(st.plan.timeout*3/2)))
	results, delay := st.faultBatch()
	for r, b := range results {
		if b.hung || b.eof {
			st.checkBatch(res, r, b, true, 0)
			return false
		}
	}
	time.Sleep(delay)
	down := time.Now()
	if err := st.h.cluster.linkDown(v); err != nil {
		st.h.harnessProblem(fmt.Sprintf("job %d: %v", st.plan.id, err))
	}
	upAt := make(chan time.Time, 1)
	go func() {
		time.Sleep(outage)
		if err := st.h.cluster.linkUp(v); err != nil {
			st.h.harnessProblem(fmt.Sprintf("job %d: %v", st.plan.id, err))
		}
		upAt <- time.Now()
	}()
	for _, r := range st.all() {
		st.j.collect(r, results[r])
	}
	up := <-upAt
	anyFailed := false
	for _, r := range st.all() {
		b := results[r]
		if !st.checkBatch(res, r, b, false, 0) {
			anyFailed = true
			continue
		}
		f := b.failed()
		if f == nil {
			continue
		}
		anyFailed = true
		who := -1
		if r != v && f.EndNs < up.UnixNano() {
			who = v
		}
		expectFailure(res, r, b, []string{"timeout", "remote"}, who)
		res.detected(time.Duration(f.EndNs - down.UnixNano()))
	}
	if !anyFailed {
		// The job rode the outage out; it must still work.
		st.verify(res, 2)
	}
	return false
}

// linkSlow: rank v's outgoing link limited by tc tbf for a batch of calls.
// Nothing may fail, and every result must be exact.
func (st *jobState) linkSlow(res *faultResult) bool {
	v := st.rng.IntN(st.plan.p)
	res.victim = v
	rate := 20 + st.rng.IntN(80)
	if isDense(st.plan.alg) {
		rate = 80 + st.rng.IntN(220)
	}
	if err := st.h.cluster.slow(v, fmt.Sprintf("%dmbit", rate)); err != nil {
		st.h.harnessProblem(fmt.Sprintf("job %d: %v", st.plan.id, err))
		return true
	}
	healthy := st.verify(res, 4+st.rng.IntN(6))
	if err := st.h.cluster.unslow(v); err != nil {
		st.h.harnessProblem(fmt.Sprintf("job %d: %v", st.plan.id, err))
	}
	return healthy && st.verify(res, 1)
}

// neverArrives: every rank but v makes a call; they must fail within the
// timeout + 10%, naming v.
func (st *jobState) neverArrives(res *faultResult) bool {
	v := st.rng.IntN(st.plan.p)
	res.victim = v
	s := st.spec()
	specs := make([]CallSpec, st.plan.p)
	for r := range specs {
		specs[r] = s
	}
	st.record(specs, false)
	others := without(st.all(), v)
	results := st.runBatch([][]CallSpec{specs}, others)
	for _, r := range others {
		b := results[r]
		if !st.checkBatch(res, r, b, false, 0) {
			continue
		}
		if f := expectFailure(res, r, b, []string{"timeout", "remote"}, v); f != nil {
			res.detected(f.Took())
		}
	}
	return false
}

// mismatch: rank v's call differs in one field. Every rank must fail with a
// mismatch naming the field and rank v, and no rank may return data.
func (st *jobState) mismatch(res *faultResult, field string) bool {
	v := st.rng.IntN(st.plan.p)
	res.victim = v
	s := st.spec()
	specs := make([]CallSpec, st.plan.p)
	for r := range specs {
		specs[r] = s
	}
	switch field {
	case "tensor":
		specs[v].Tensor = 1000 + uint64(s.Index)
	case "n":
		// A fresh tensor on every rank: a known tensor that changes size on
		// one rank is refused there (refused-locally), not a mismatch.
		for r := range specs {
			specs[r].Tensor = 2000 + uint64(s.Index)
		}
		specs[v].N += 1 + st.rng.IntN(7)
	case "k":
		d := s.Density * 2
		if d > 1 {
			d = s.Density / 2
		}
		specs[v].Density = d
		if kOf(d, s.N) == kOf(s.Density, s.N) {
			st.h.harnessProblem(fmt.Sprintf("job %d: density %g and %g give the same k", st.plan.id, d, s.Density))
		}
	case "dtype":
		if s.Dtype == "float32" {
			specs[v].Dtype = halfDtypes[st.rng.IntN(2)]
		} else {
			specs[v].Dtype = "float32"
		}
	case "algorithm":
		others := slices.DeleteFunc(slices.Clone(campaignAlgs), func(a string) bool { return a == s.Alg })
		specs[v].Alg = others[st.rng.IntN(len(others))]
	}
	st.record(specs, false)
	results := st.runBatch([][]CallSpec{specs}, st.all())
	for _, r := range st.all() {
		b := results[r]
		if !st.checkBatch(res, r, b, false, 0) {
			continue
		}
		f := expectFailure(res, r, b, []string{"mismatch"}, v)
		if f == nil {
			continue
		}
		res.detected(f.Took())
		if f.Class == "mismatch" && !strings.Contains(f.Err, field+": rank") {
			res.problem(&res.badErr, "rank %d: the mismatch does not name the field %q: %s", r, field, f.Err)
		}
	}
	return false
}

func kOf(density float64, n int) int { return min(n, int(math.Ceil(density*float64(n)))) }

// refused: rank v refuses the call itself (its tensor resized, or an invalid
// density); the others must not wait out their timeout for it: they fail
// with an invalid-argument or mismatch error (or a remote one carrying v's
// invalid argument) naming v.
func (st *jobState) refused(res *faultResult) bool {
	v := st.rng.IntN(st.plan.p)
	res.victim = v
	s := st.spec()
	specs := make([]CallSpec, st.plan.p)
	for r := range specs {
		specs[r] = s
	}
	if !isDense(s.Alg) && st.rng.IntN(2) == 0 {
		specs[v].N += 1 + st.rng.IntN(7) // tensor 1 already has s.N elements on v
	} else {
		specs[v].Density = 1.5
	}
	st.record(specs, false)
	results := st.runBatch([][]CallSpec{specs}, st.all())
	for _, r := range st.all() {
		b := results[r]
		if !st.checkBatch(res, r, b, false, 0) {
			continue
		}
		if r == v {
			expectFailure(res, r, b, []string{"invalid"}, -2)
			continue
		}
		// The others learn of the refusal as an invalid call or a mismatch,
		// or from the refusing rank's abort (a remote error that passes on
		// its invalid argument).
		classes := []string{"invalid", "mismatch"}
		if f := b.failed(); f != nil && f.Class == "remote" && strings.Contains(f.Err, core.ErrInvalidArgument.Error()) {
			classes = append(classes, "remote")
		}
		if f := expectFailure(res, r, b, classes, v); f != nil {
			res.detected(f.Took())
		}
	}
	return false
}

// poison: NaN or ±Inf in rank v's gradient. Every rank must do what the
// reference does (sparse algorithms skip the step on every rank with a
// non-finite error, buffer and residual untouched; dense ones sum it), and
// the communicator must stay usable.
func (st *jobState) poison(res *faultResult, kind string) bool {
	v := st.rng.IntN(st.plan.p)
	res.victim = v
	s := st.spec()
	specs := make([]CallSpec, st.plan.p)
	for r := range specs {
		specs[r] = s
	}
	specs[v].Poison = kind
	if kind == "inf" && st.rng.IntN(2) == 0 {
		specs[v].Poison = "-inf"
	}
	specs[v].PoisonAt = st.rng.IntN(s.N)
	st.record(specs, true)
	results := st.runBatch([][]CallSpec{specs}, st.all())
	healthy := true
	for _, r := range st.all() {
		b := results[r]
		ok := st.checkBatch(res, r, b, true, 0)
		healthy = healthy && ok
		if f := b.failed(); f != nil {
			res.detected(f.Took())
			if f.Class != "nonfinite" {
				healthy = false
			}
		}
	}
	return healthy && st.verify(res, 1)
}

// flood: a stranger attacks a rank's inbox or the rendezvous port (or both)
// while the job keeps calling. Nothing may fail, every result must be exact,
// and no rank's RSS may pass the bound.
func (st *jobState) flood(res *faultResult, kind string) bool {
	v := st.rng.IntN(st.plan.p)
	res.victim = v
	inbox := strings.TrimPrefix(st.j.procs[v].endpoint, "tcp://")
	if i := strings.Index(inbox, "#"); i >= 0 {
		inbox = inbox[:i]
	}
	store := fmt.Sprintf("%s:%d", st.h.cluster.masterAddr(), st.j.port+1)
	var targets []string
	attacked := map[int]bool{} // whose memory the flood is aimed at
	switch st.rng.IntN(3) {
	case 0:
		targets, attacked[v] = []string{"zmq=" + inbox}, true
	case 1:
		targets, attacked[0] = []string{"store=" + store}, true
	default:
		targets, attacked[v], attacked[0] = []string{"zmq=" + inbox, "store=" + store}, true, true
	}
	fkind := strings.TrimPrefix(kind, "flood-")
	if kind == "wrong-token-frames" {
		fkind = "wrong-token"
	}
	args := []string{"flood", "-kind", fkind, "-targets", strings.Join(targets, ","),
		"-dur", st.h.cfg.floodTime.String(), "-size", strconv.Itoa(st.plan.p)}
	switch fkind {
	case "idle-conns":
		args = append(args, "-conns", "500")
	case "huge-announce":
		args = append(args, "-conns", "64", "-body", strconv.Itoa(8<<20))
	}
	st.j.rssWindow()
	cmd := st.h.cluster.attackerCommand(st.h.bin, args...)
	out, err := os.CreateTemp("", "chaos-flood")
	if err != nil {
		st.h.harnessProblem(fmt.Sprintf("job %d: %v", st.plan.id, err))
		return true
	}
	defer os.Remove(out.Name())
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Start(); err != nil {
		st.h.harnessProblem(fmt.Sprintf("job %d: starting the flooder: %v", st.plan.id, err))
		return true
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	healthy, exited := true, false
	var werr error
	for healthy && !exited {
		healthy = st.verify(res, st.batchLength(150*time.Millisecond))
		select {
		case werr = <-done:
			exited = true
		default:
		}
	}
	if !exited {
		select {
		case werr = <-done:
		case <-time.After(st.h.cfg.floodTime + 20*time.Second):
			cmd.Process.Kill()
			werr = <-done
		}
	}
	if healthy {
		healthy = st.verify(res, 1)
	}
	// Only the attacked ranks are held to the bound: another rank may still
	// hold memory from an earlier flood (Go and libzmq keep what they got).
	for r, rss := range st.j.rssWindow() {
		if !attacked[r] {
			continue
		}
		res.rss = max(res.rss, rss)
		if rss > st.h.cfg.rssBound && st.j.killedForRSS(r) == 0 {
			res.problem(&res.overRSS, "rank %d's RSS reached %s during the flood (targets %v), bound %s", r, mib(rss), targets, mib(st.h.cfg.rssBound))
		}
	}
	var rep FloodReport
	text, _ := os.ReadFile(out.Name())
	if werr != nil || json.Unmarshal([]byte(lastLine(string(text))), &rep) != nil {
		st.h.harnessProblem(fmt.Sprintf("job %d: flooder %v: %v: %s", st.plan.id, args, werr, text))
	} else if rep.Delivered == 0 {
		st.h.harnessProblem(fmt.Sprintf("job %d: flood %s on %v delivered nothing (%d errors, first: %s)", st.plan.id, fkind, targets, rep.Errors, rep.FirstErr))
	}
	return healthy
}

func mib(b uint64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

// initFault: a rank never starts (never-arrives-init) or joins with another
// job token (wrong-token-rank) while the others join. Every rank that runs
// must fail to join within the join timeout + 10%: with another token, an
// authentication error; waiting for the missing or refused rank, a
// rendezvous error or timeout naming it.
func (h *harness) initFault(plan *jobPlan, rng *rand.Rand, res *faultResult) {
	v := rng.IntN(plan.p)
	res.victim = v
	skip, wrong := -1, -1
	if res.kind == "never-arrives-init" {
		skip = v
	} else {
		wrong = v
	}
	j := h.startJob(plan, skip, wrong)
	defer j.stop()
	inits := j.awaitInit()
	bound := h.cfg.initTimeout * 11 / 10
	for r, in := range inits {
		p := j.procs[r]
		if !p.started {
			continue
		}
		switch {
		case in.hung:
			res.problem(&res.hangs, "rank %d: neither joined nor failed within %v", r, bound+3*time.Second)
			j.quit(r)
			continue
		case in.eof:
			<-p.exited
			res.problem(&res.crashes, "rank %d: exited while joining (%s): %s", r, p.exitDescription(), lastLine(p.stderr.String()))
			continue
		case in.ready:
			res.problem(&res.wrong, "rank %d: joined a job in which rank %d %s", r, v, map[bool]string{true: "never started", false: "has another token"}[skip >= 0])
			continue
		}
		took := time.Duration(in.ev.TookNs)
		res.detected(took)
		if took > bound {
			res.problem(&res.hangs, "rank %d: joining failed after %v, bound %v", r, took.Round(time.Millisecond), bound)
		}
		classes, who := []string{"rendezvous", "timeout"}, v
		switch {
		case wrong == 0 && r == 0:
			who = -1 // rank 0 serves the rendezvous with the odd token: it waits on everyone
		case wrong == 0, wrong == r:
			classes, who = []string{"auth"}, -2
		}
		b := &batchResult{calls: []Outcome{{Class: in.ev.Class, Err: in.ev.Err, EndNs: in.ev.TookNs}}, finished: true}
		expectFailure(res, r, b, classes, who)
	}
	for r, p := range j.procs {
		if !p.started || p.quitted {
			continue
		}
		select {
		case <-p.exited:
		case <-time.After(5 * time.Second):
			res.problem(&res.hangs, "rank %d: did not exit after failing to join", r)
			j.quit(r)
			continue
		}
		if d := p.exitDescription(); d != fmt.Sprintf("exit %d", exitInitFailed) && !inits[r].eof {
			res.problem(&res.crashes, "rank %d: ended with %s after failing to join", r, d)
		}
		if s := p.panicked(); s != "" {
			res.problem(&res.crashes, "rank %d: %s", r, s)
		}
	}
	if res.failed() {
		j.saveLogs(h.cfg.logs)
	}
}
