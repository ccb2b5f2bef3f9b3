package main

// Faults in a rank's process or links: a signal (SIGKILL, SIGSTOP) during a
// batch of calls, a link that goes down or slows down, and the follow-up
// call that must notice a fault a batch ended before. The checks are the
// ones faults.go describes.

import (
	"fmt"
	"syscall"
	"time"
)

// faultBatch starts a batch long enough to be hit mid-call, waits until
// every rank is running it, then waits a random delay: the moment to strike.
// It returns the batch's results so far, and false (the rank reported in
// res) when a rank hung or exited before the fault.
func (st *jobState) faultBatch(res *faultResult) (map[int]*batchResult, bool) {
	m := st.batchLength(800 * time.Millisecond)
	st.j.sendCalls(perRank(st.uniform(m), st.all()))
	results := map[int]*batchResult{}
	for _, r := range st.all() {
		results[r] = &batchResult{}
		st.j.firstCall(r, results[r])
	}
	span := time.Duration(m-1) * st.callTime
	delay := time.Duration(st.rng.Int64N(int64(min(span*7/10, 500*time.Millisecond)) + 1))
	for r, b := range results {
		if b.hung || b.eof {
			st.checkBatch(res, r, b, true, 0)
			return nil, false
		}
	}
	time.Sleep(delay)
	return results, true
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
	results, ok := st.faultBatch(res)
	if !ok {
		return false
	}
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
	results, ok := st.faultBatch(res)
	if !ok {
		return false
	}
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
