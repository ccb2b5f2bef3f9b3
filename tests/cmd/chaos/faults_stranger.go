package main

// Faults from outside the job: a stranger flooding a rank's inbox or the
// rendezvous port while the job calls (the flood subcommand in flood.go does
// the sending), and a rank that never joins or joins with another token.
// The checks are the ones faults.go describes.

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"time"
)

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
