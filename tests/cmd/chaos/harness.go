package main

// The campaign: run every job of the plan, inject its faults in order,
// judge them, and tally the results into the table.

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/oktopk/oktopk/transport/zmq"
)

type config struct {
	faults      int
	seed        uint64
	out         string
	logs        string
	timeout     time.Duration // every call's
	initTimeout time.Duration // joining's
	floodTime   time.Duration
	rssBound    uint64
	rssKill     uint64 // a rank past this RSS is killed, whatever it was doing
	netns       string // on, off, auto
	job         int    // only this job (-1: all)
	maxP        int
	verbose     bool
	kinds       []string // only these fault kinds (none: all)
}

type harness struct {
	cfg     config
	bin     string
	cluster *cluster
	rng     *rand.Rand // tokens only; the plan and the faults have their own
	began   time.Time

	nextPort int

	mu       sync.Mutex
	live     map[*rankProc]struct{}
	problems []string // the harness's own failures
	results  []*faultResult

	okChecked   int // successful calls compared with the reference
	failChecked int // failed calls whose buffer and state were checked
}

func (h *harness) count(n *int) {
	h.mu.Lock()
	*n++
	h.mu.Unlock()
}

func (h *harness) track(p *rankProc) {
	h.mu.Lock()
	h.live[p] = struct{}{}
	h.mu.Unlock()
}

func (h *harness) untrack(p *rankProc) {
	h.mu.Lock()
	delete(h.live, p)
	h.mu.Unlock()
}

func (h *harness) harnessProblem(s string) {
	h.mu.Lock()
	h.problems = append(h.problems, s)
	h.mu.Unlock()
	fmt.Fprintln(os.Stderr, "chaos: HARNESS:", s)
}

func (h *harness) logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "chaos: "+format+"\n", args...)
}

// killAll ends every rank process still running (an interrupted campaign).
func (h *harness) killAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for p := range h.live {
		p.signal(syscall.SIGCONT)
		p.signal(syscall.SIGKILL)
	}
}

func runCampaign(cfg config) int {
	bin, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 2
	}
	h := &harness{cfg: cfg, bin: bin, rng: rand.New(rand.NewPCG(cfg.seed, uint64(time.Now().UnixNano()))),
		live: map[*rankProc]struct{}{}, began: time.Now(), nextPort: 12000 + int(cfg.seed%5000)*2}
	h.cluster, err = newCluster(cfg.maxP, cfg.netns)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos: network namespaces:", err)
		return 2
	}
	defer h.cluster.close()
	if cfg.logs != "" {
		// Logs of an earlier campaign would read as this one's.
		old, _ := filepath.Glob(filepath.Join(cfg.logs, "job*.rank*.log"))
		for _, f := range old {
			os.Remove(f)
		}
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		s := <-sigs
		h.killAll()
		h.cluster.close()
		fmt.Fprintf(os.Stderr, "chaos: interrupted by %v\n", s)
		os.Exit(130)
	}()
	if h.cluster.netns {
		h.logf("ranks run in network namespaces %s-r0…r%d on bridge %sbr", h.cluster.prefix, cfg.maxP-1, h.cluster.prefix)
	} else {
		h.logf("NO NETWORK NAMESPACES (%s): ranks run on 127.0.0.1, link faults (link-down, link-slow) are skipped", h.cluster.why)
	}
	for _, k := range cfg.kinds {
		kindByName(k)
	}
	plan := makePlan(cfg.seed, cfg.faults, h.cluster.netns, zmq.CurveAvailable(), cfg.maxP, cfg.timeout, cfg.kinds...)
	total := 0
	for _, jp := range plan {
		total += len(jp.faults)
	}
	h.logf("seed %d: %d faults in %d jobs; call timeout %v, join timeout %v, RSS bound %s", cfg.seed, total, len(plan), cfg.timeout, cfg.initTimeout, mib(cfg.rssBound))
	for _, jp := range plan {
		if cfg.job >= 0 && jp.id != cfg.job {
			continue
		}
		start := time.Now()
		results := h.runJob(jp)
		h.results = append(h.results, results...)
		verdict := "ok"
		var names []string
		for _, r := range results {
			names = append(names, r.kind)
			if r.failed() {
				verdict = "FAILED"
			}
		}
		h.logf("job %d/%d [%s] %s: %s (%.1fs, %s elapsed)", jp.id, len(plan), jp, strings.Join(names, ", "), verdict,
			time.Since(start).Seconds(), time.Since(h.began).Round(time.Second))
		if cfg.verbose {
			for _, r := range results {
				for _, n := range r.notes {
					h.logf("    %s (rank %d): %s", r.kind, r.victim, oneLine(n))
				}
				for _, p := range r.problems {
					h.logf("    %s (rank %d): FAILED: %s", r.kind, r.victim, oneLine(p))
				}
			}
		}
	}
	report := h.report()
	fmt.Print(report)
	if cfg.out != "" {
		if err := os.WriteFile(cfg.out, []byte(report), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "chaos:", err)
			return 2
		}
	}
	for _, r := range h.results {
		if r.failed() {
			return 1
		}
	}
	if len(h.problems) > 0 {
		return 1
	}
	return 0
}

// runJob starts a job, runs its faults in order and judges its end.
func (h *harness) runJob(plan *jobPlan) []*faultResult {
	rng := rand.New(rand.NewPCG(h.cfg.seed, uint64(plan.id)+1))
	var results []*faultResult
	for _, f := range plan.faults {
		results = append(results, &faultResult{kind: f, plan: plan, victim: -1})
	}
	if kindByName(plan.faults[len(plan.faults)-1]).init {
		h.initFault(plan, rng, results[0])
		return results
	}
	j := h.startJob(plan, -1, -1)
	st := &jobState{h: h, j: j, plan: plan, rng: rng, issued: map[int][]CallSpec{}, refOK: map[int]bool{},
		ref: newReference(plan.p), refOut: map[int][]Outcome{}, initFailed: make([]bool, plan.p)}
	defer st.ref.close()
	defer j.stop()

	// Joining and two warm-up calls, fault-free: a failure here is charged
	// to the job's first fault, which then is not injected.
	first := results[0]
	joined := true
	for r, in := range j.awaitInit() {
		switch {
		case in.hung:
			first.problem(&first.hangs, "rank %d: neither joined nor failed to join a fault-free job", r)
			j.quit(r)
			joined = false
		case !in.ready:
			st.initFailed[r] = !in.eof
			first.problem(&first.badErr, "rank %d: a fault-free job failed to join: %s: %s", r, in.ev.Class, in.ev.Err)
			joined = false
		}
	}
	last := first
	if joined {
		warm := st.runBatch(st.uniform(2), st.all())
		var took []time.Duration
		healthy := true
		for r, b := range warm {
			ok := st.checkBatch(first, r, b, true, 0)
			healthy = healthy && ok && b.failed() == nil
			for _, o := range b.calls {
				took = append(took, o.Took())
			}
		}
		sort.Slice(took, func(a, b int) bool { return took[a] < took[b] })
		if len(took) > 0 {
			st.callTime = took[len(took)/2]
		}
		for i, f := range plan.faults {
			if !healthy {
				break
			}
			res := results[i]
			last = res
			j.rssWindow()
			healthy = st.inject(f, res)
			if res.rss == 0 {
				res.rss = slices.Max(j.rssWindow())
			}
		}
	}
	h.finishJob(st, last)
	for _, r := range results {
		if r.failed() {
			j.saveLogs(h.cfg.logs)
			break
		}
	}
	return results
}

// finishJob asks every live rank to exit and checks how each process ended;
// whatever is wrong is charged to the job's last fault.
func (h *harness) finishJob(st *jobState, res *faultResult) {
	j := st.j
	for _, p := range j.procs {
		if p.alive() && p.injected == syscall.SIGSTOP {
			p.signal(syscall.SIGCONT)
		}
	}
	bound := 1100 * time.Millisecond
	for r, e := range j.exitAll() {
		p := j.procs[r]
		if !p.started {
			continue
		}
		switch {
		case e.hung:
			res.problem(&res.hangs, "rank %d: did not destroy its communicator and exit within 5 s of being asked", r)
		case e.closeTook > bound:
			res.problem(&res.hangs, "rank %d: destroying the communicator took %v, bound %v", r, e.closeTook.Round(time.Millisecond), bound)
		}
	}
	for r, p := range j.procs {
		if !p.started || p.quitted {
			continue
		}
		<-p.exited
		want := "exit 0"
		switch {
		case p.injected == syscall.SIGKILL, j.killedForRSS(r) > 0:
			want = "signal killed"
		case st.initFailed[r]:
			want = fmt.Sprintf("exit %d", exitInitFailed)
		}
		if d := p.exitDescription(); d != want {
			res.problem(&res.crashes, "rank %d: ended with %s, want %s: %s", r, d, want, lastLine(p.stderr.String()))
		}
		if s := p.panicked(); s != "" {
			res.problem(&res.crashes, "rank %d: %s", r, s)
		}
		if b := p.badLines.String(); b != "" {
			res.problem(&res.crashes, "rank %d: wrote something other than events to standard output: %.200s", r, b)
		}
	}
}
