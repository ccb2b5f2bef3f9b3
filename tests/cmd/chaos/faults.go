package main

// Injecting each kind of fault into a running job, and judging what every
// rank did about it: the job's state, the dispatch (inject) and the checks
// are here; the faults themselves are in faults_process.go (signals and
// links), faults_call.go (one call's faults) and faults_stranger.go (floods
// and joins). The checks, for every fault:
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
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
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
	s := CallSpec{Index: st.next, Alg: st.plan.alg, Dtype: st.plan.dtype, Values: st.plan.values, Tensor: 1, N: st.plan.n,
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
		specs := sameSpecs(st.spec(), st.plan.p)
		st.record(specs, true)
		calls[i] = specs
	}
	return calls
}

// sameSpecs is one call as each of p ranks issues it: s on every rank.
func sameSpecs(s CallSpec, p int) []CallSpec {
	specs := make([]CallSpec, p)
	for r := range specs {
		specs[r] = s
	}
	return specs
}

// victimCall draws the fault's victim rank v (recorded in res) and then the
// job's next call s, as every rank would issue it; the fault changes v's
// (or every rank's) entry of specs.
func (st *jobState) victimCall(res *faultResult) (v int, s CallSpec, specs []CallSpec) {
	v = st.rng.IntN(st.plan.p)
	res.victim = v
	s = st.spec()
	return v, s, sameSpecs(s, st.plan.p)
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

// runFaultyCall runs specs, already recorded, as one call on ranks and
// hands each rank's result to each, unless checkBatch (not strict: the call
// may fail) found the rank hung or gone.
func (st *jobState) runFaultyCall(res *faultResult, specs []CallSpec, ranks []int, each func(r int, b *batchResult)) {
	results := st.runBatch([][]CallSpec{specs}, ranks)
	for _, r := range ranks {
		b := results[r]
		if st.checkBatch(res, r, b, false, 0) {
			each(r, b)
		}
	}
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
	case "mismatch-tensor", "mismatch-n", "mismatch-k", "mismatch-dtype", "mismatch-algorithm", "mismatch-values":
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
