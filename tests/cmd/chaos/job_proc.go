package main

// One rank's process as the harness holds it: its commands on standard
// input, its events from standard output, its standard error and exit,
// and the signals a fault sends it.

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.b.Len() > 4<<20 { // a rank that floods its own log is not kept in full
		return len(p), nil
	}
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// rankProc is one rank's process.
type rankProc struct {
	rank     int
	cmd      *exec.Cmd
	stdin    io.WriteCloser
	events   chan Event // closed when its standard output ends
	stderr   *syncBuffer
	badLines *syncBuffer // standard output that was not an event
	exited   chan struct{}
	waitErr  error
	endpoint string
	started  bool

	injected syscall.Signal // the signal a fault sent it (0: none)
	quitted  bool           // the harness sent SIGQUIT to a hung rank
	closed   bool           // it said "closed"
}

func (p *rankProc) alive() bool {
	select {
	case <-p.exited:
		return false
	default:
		return p.started
	}
}

func (p *rankProc) send(cmd Command) error {
	b, err := json.Marshal(cmd)
	if err != nil {
		return err
	}
	_, err = p.stdin.Write(append(b, '\n'))
	return err
}

func (p *rankProc) signal(sig syscall.Signal) {
	if p.started && p.cmd.Process != nil {
		p.cmd.Process.Signal(sig)
	}
}

// next waits up to d for p's next event; ok is false on timeout, and the
// event is "eof" once its output ended (it exited).
func (p *rankProc) next(d time.Duration) (Event, bool) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case e, ok := <-p.events:
		if !ok {
			return Event{Ev: "eof", Rank: p.rank}, true
		}
		return e, true
	case <-t.C:
		return Event{}, false
	}
}

// exitDescription says how p ended: "exit 0", "exit 10", "signal killed".
func (p *rankProc) exitDescription() string {
	if !p.started {
		return "not started"
	}
	select {
	case <-p.exited:
	default:
		return "running"
	}
	if p.waitErr == nil {
		return "exit 0"
	}
	var ee *exec.ExitError
	if errors.As(p.waitErr, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return "signal " + ws.Signal().String()
		}
		return "exit " + strconv.Itoa(ee.ExitCode())
	}
	return p.waitErr.Error()
}

// panicked reports Go panic or runtime-fatal output in p's standard error.
func (p *rankProc) panicked() string {
	text := p.stderr.String()
	for _, mark := range []string{"panic: ", "fatal error: ", "SIGSEGV", "SIGABRT", "WARNING: DATA RACE"} {
		if i := strings.Index(text, mark); i >= 0 {
			end := min(len(text), i+300)
			return strings.TrimSpace(text[i:end])
		}
	}
	return ""
}
