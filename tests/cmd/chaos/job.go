package main

// A job: P rank processes started torchrun-style, driven through their
// standard input and watched through their standard output, their exit
// status, their standard error (Go panics) and their resident memory.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// job is one set of rank processes.
type job struct {
	h     *harness
	id    int
	plan  *jobPlan
	port  int
	token string
	procs []*rankProc

	rssMu     sync.Mutex
	rssMax    []uint64 // each rank's max since the last rssWindow call
	rssKilled []uint64 // the RSS at which the harness killed a rank (0: never)
	stopRS    chan struct{}
	rsWG      sync.WaitGroup
}

// startJob launches the ranks of plan, except skip (-1: none); a rank in
// wrongToken gets another job token.
func (h *harness) startJob(plan *jobPlan, skip, wrongToken int) *job {
	j := &job{h: h, id: plan.id, plan: plan, token: newToken(h.rng), stopRS: make(chan struct{}),
		rssMax: make([]uint64, plan.p), rssKilled: make([]uint64, plan.p)}
	j.port = h.cluster.freePortPair(&h.nextPort)
	for r := 0; r < plan.p; r++ {
		p := &rankProc{rank: r, stderr: &syncBuffer{}, badLines: &syncBuffer{}, events: make(chan Event, 1<<14), exited: make(chan struct{})}
		j.procs = append(j.procs, p)
		if r == skip {
			close(p.exited)
			close(p.events)
			continue
		}
		token := j.token
		if r == wrongToken {
			token = newToken(h.rng)
		}
		cmd := h.cluster.command(r, h.bin, "rank", "-init-timeout", h.cfg.initTimeout.String())
		cmd.Env = append(os.Environ(),
			"MASTER_ADDR="+h.cluster.masterAddr(), "MASTER_PORT="+strconv.Itoa(j.port),
			"RANK="+strconv.Itoa(r), "WORLD_SIZE="+strconv.Itoa(plan.p),
			"OKTOPK_JOB_TOKEN="+token, "OKTOPK_SOCKET_IFNAME="+h.cluster.ifname(),
			"OKTOPK_RENDEZVOUS_PORT=", "OKTOPK_CURVE="+map[bool]string{true: "1"}[plan.curve], "GOTRACEBACK=all")
		cmd.Stderr = p.stderr
		cmd.WaitDelay = 2 * time.Second // a dead rank's pipes cannot hold Wait up
		stdin, err := cmd.StdinPipe()
		if err != nil {
			panic(err)
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			panic(err)
		}
		if err := cmd.Start(); err != nil {
			h.harnessProblem(fmt.Sprintf("job %d: starting rank %d: %v", j.id, r, err))
			close(p.exited)
			close(p.events)
			continue
		}
		p.cmd, p.stdin, p.started = cmd, stdin, true
		h.track(p)
		go func() {
			sc := bufio.NewScanner(stdout)
			sc.Buffer(make([]byte, 1<<16), 1<<22)
			for sc.Scan() {
				var e Event
				if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
					p.badLines.Write(append(append([]byte(nil), sc.Bytes()...), '\n'))
					continue
				}
				p.events <- e
			}
			io.Copy(io.Discard, stdout)
			close(p.events)
		}()
		go func() {
			p.waitErr = cmd.Wait()
			close(p.exited)
			h.untrack(p)
		}()
	}
	j.rsWG.Add(1)
	go j.sampleRSS()
	return j
}

func newToken(rng interface{ Uint64() uint64 }) string {
	return fmt.Sprintf("%016x%016x", rng.Uint64(), rng.Uint64())
}

// sampleRSS records each rank's largest resident set, every 20 ms, and
// kills a rank past the hard cap (cfg.rssKill).
func (j *job) sampleRSS() {
	defer j.rsWG.Done()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-j.stopRS:
			return
		case <-t.C:
		}
		for r, p := range j.procs {
			if !p.alive() {
				continue
			}
			if rss := readRSS(p.cmd.Process.Pid); rss > 0 {
				j.rssMu.Lock()
				j.rssMax[r] = max(j.rssMax[r], rss)
				if rss > j.h.cfg.rssKill && j.rssKilled[r] == 0 {
					// A rank whose memory runs away takes the machine with
					// it; the harness ends it and the flood is charged.
					j.rssKilled[r] = rss
					p.signal(syscall.SIGKILL)
				}
				j.rssMu.Unlock()
			}
		}
	}
}

// killedForRSS is the RSS at which the harness killed rank r (0: never).
func (j *job) killedForRSS(r int) uint64 {
	j.rssMu.Lock()
	defer j.rssMu.Unlock()
	return j.rssKilled[r]
}

// rssWindow returns each rank's largest RSS seen since the previous call
// (now included) and starts a new window.
func (j *job) rssWindow() []uint64 {
	j.rssMu.Lock()
	defer j.rssMu.Unlock()
	m := j.rssMax
	j.rssMax = make([]uint64, len(j.procs))
	for r, p := range j.procs {
		if p.alive() {
			m[r] = max(m[r], readRSS(p.cmd.Process.Pid))
		}
	}
	return m
}

func readRSS(pid int) uint64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				kb, _ := strconv.ParseUint(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// initResult is how a rank's joining ended.
type initResult struct {
	ready bool
	ev    Event // ready or initfail
	hung  bool  // neither within the bound
	eof   bool  // its output ended first
}

// awaitInit waits for every started rank's ready or initfail.
func (j *job) awaitInit() []initResult {
	res := make([]initResult, len(j.procs))
	deadline := time.Now().Add(j.h.cfg.initTimeout*11/10 + 3*time.Second)
	for r, p := range j.procs {
		if !p.started {
			continue
		}
	wait:
		for {
			e, ok := p.next(time.Until(deadline))
			switch {
			case !ok:
				res[r].hung = true
			case e.Ev == "eof":
				res[r].eof = true
			case e.Ev == "ready":
				res[r].ready, res[r].ev = true, e
				p.endpoint = e.Endpoint
			case e.Ev == "initfail":
				res[r].ev = e
			default:
				continue
			}
			break wait
		}
	}
	return res
}

// batchResult is what one rank reported for one batch.
type batchResult struct {
	calls    []Outcome
	finished bool // its "batch" event arrived
	hung     bool // it went silent for longer than any call may take
	eof      bool // it exited mid-batch
}

func (b batchResult) failed() *Outcome {
	for i := range b.calls {
		if !b.calls[i].OK {
			return &b.calls[i]
		}
	}
	return nil
}

// sendCalls sends each listed rank its specs.
func (j *job) sendCalls(specs map[int][]CallSpec) {
	for r, s := range specs {
		if err := j.procs[r].send(Command{Op: "calls", Calls: s}); err != nil {
			j.h.logf("job %d: rank %d: sending calls: %v", j.id, r, err)
		}
	}
}

// collect reads rank r's events until its batch ends.
func (j *job) collect(r int, into *batchResult) {
	j.readUntil(r, into, func() bool { return false })
}

// firstCall waits until rank r has reported one call of the batch.
func (j *job) firstCall(r int, into *batchResult) {
	j.readUntil(r, into, func() bool { return len(into.calls) > 0 })
}

// readUntil reads rank r's events into into until done says so or the
// batch ends. A rank is hung when no event comes for longer than a call may
// take (its timeout + 10%) plus a margin for a loaded machine.
func (j *job) readUntil(r int, into *batchResult, done func() bool) {
	p := j.procs[r]
	quiet := j.plan.timeout*11/10 + 3*time.Second
	for !done() && !into.finished && !into.hung && !into.eof {
		e, ok := p.next(quiet)
		switch {
		case !ok:
			into.hung = true
		case e.Ev == "eof":
			into.eof = true
		case e.Ev == "call" && e.Call != nil:
			into.calls = append(into.calls, *e.Call)
		case e.Ev == "batch":
			into.finished = true
		}
	}
}

// quit ends a hung rank with SIGQUIT, so that its goroutines' stacks land in
// its standard error (saved with the job's log), then SIGKILL.
func (j *job) quit(r int) {
	p := j.procs[r]
	if !p.alive() {
		return
	}
	p.quitted = true
	p.signal(syscall.SIGCONT)
	p.signal(syscall.SIGQUIT)
	select {
	case <-p.exited:
	case <-time.After(2 * time.Second):
		p.signal(syscall.SIGKILL)
		<-p.exited
	}
}

// exitResult is how a rank's orderly exit went.
type exitResult struct {
	closeTook time.Duration
	hung      bool
}

// exitAll asks every live rank to destroy its communicator and exit, and
// waits for them; ranks that do not are ended with SIGQUIT.
func (j *job) exitAll() []exitResult {
	res := make([]exitResult, len(j.procs))
	for _, p := range j.procs {
		if p.alive() {
			p.send(Command{Op: "exit"})
		}
	}
	for r, p := range j.procs {
		if !p.alive() {
			continue
		}
		deadline := time.Now().Add(5 * time.Second)
		for !p.closed {
			e, ok := p.next(time.Until(deadline))
			if !ok || e.Ev == "eof" {
				break
			}
			if e.Ev == "closed" {
				p.closed = true
				res[r].closeTook = time.Duration(e.TookNs)
			}
		}
		select {
		case <-p.exited:
		case <-time.After(time.Until(deadline)):
		}
		if p.alive() {
			res[r].hung = true
			j.quit(r)
		}
	}
	return res
}

// stop ends the job: every process is gone and the RSS sampler stopped.
func (j *job) stop() {
	for _, p := range j.procs {
		if p.alive() {
			p.signal(syscall.SIGCONT)
			p.signal(syscall.SIGKILL)
		}
		<-p.exited
	}
	close(j.stopRS)
	j.rsWG.Wait()
}

// saveLogs writes every rank's standard error for a job that failed a
// check.
func (j *job) saveLogs(dir string) {
	if dir == "" {
		return
	}
	os.MkdirAll(dir, 0o755)
	for _, p := range j.procs {
		name := fmt.Sprintf("%s/job%04d.rank%d.log", dir, j.id, p.rank)
		text := p.stderr.String()
		if b := p.badLines.String(); b != "" {
			text += "\n--- stdout that was not an event ---\n" + b
		}
		os.WriteFile(name, []byte(fmt.Sprintf("exit: %s\n%s", p.exitDescription(), text)), 0o644)
	}
}
