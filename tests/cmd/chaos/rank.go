package main

// The rank program: one rank of a job launched torchrun-style (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and OKTOPK_JOB_TOKEN in the
// environment). It joins over ZeroMQ TCP, then obeys commands read from
// standard input, one JSON object a line, and reports on standard output,
// one JSON event a line:
//
//	{"op":"calls","calls":[spec…]}  runs the calls in order, one "call"
//	                                 event each, stopping at the first that
//	                                 fails, then a "batch" event
//	{"op":"exit"}                    destroys the communicator ("closed"
//	                                 event with how long it took) and exits 0
//
// Joining reports "ready" (with the rank's inbox endpoint and process id) or
// "initfail" (and exits with exitInitFailed). Nothing else is written to
// standard output; the library's own log lines go to standard error.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport/zmq"
)

// Command is one line of the rank program's input.
type Command struct {
	Op    string     `json:"op"`
	Calls []CallSpec `json:"calls,omitempty"`
}

// Event is one line of the rank program's output.
type Event struct {
	Ev       string   `json:"ev"` // ready, initfail, call, batch, closed
	Rank     int      `json:"rank"`
	Pid      int      `json:"pid,omitempty"`
	Endpoint string   `json:"endpoint,omitempty"`
	Class    string   `json:"class,omitempty"`
	Err      string   `json:"err,omitempty"`
	TookNs   int64    `json:"took_ns,omitempty"`
	Call     *Outcome `json:"call,omitempty"`
	Done     int      `json:"done,omitempty"` // batch: calls run
}

// Exit statuses of the rank program besides 0.
const (
	exitInitFailed = 10
	exitProtocol   = 12
)

type eventWriter struct {
	mu  sync.Mutex
	enc *json.Encoder
}

func (w *eventWriter) emit(e Event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.enc.Encode(e); err != nil {
		// The harness is gone; nobody is left to report to.
		os.Exit(exitProtocol)
	}
}

func rankMain(args []string) int {
	initTimeout := 3 * time.Second
	for i := 0; i+1 < len(args); i += 2 {
		if args[i] == "-init-timeout" {
			d, err := time.ParseDuration(args[i+1])
			if err != nil {
				fmt.Fprintln(os.Stderr, "chaos rank:", err)
				return exitProtocol
			}
			initTimeout = d
		}
	}
	out := &eventWriter{enc: json.NewEncoder(os.Stdout)}
	rank, _ := strconv.Atoi(os.Getenv("RANK"))

	ctx, cancel := context.WithTimeout(context.Background(), initTimeout)
	start := time.Now()
	z, err := zmq.InitFromEnv(ctx, zmq.Options{})
	cancel()
	if err != nil {
		out.emit(Event{Ev: "initfail", Rank: rank, Class: classify(err), Err: err.Error(), TookNs: int64(time.Since(start))})
		return exitInitFailed
	}
	comm := core.NewCommunicator(z)
	out.emit(Event{Ev: "ready", Rank: rank, Pid: os.Getpid(), Endpoint: z.Endpoint(), TookNs: int64(time.Since(start))})

	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	for in.Scan() {
		var cmd Command
		if err := json.Unmarshal(in.Bytes(), &cmd); err != nil {
			fmt.Fprintln(os.Stderr, "chaos rank: bad command:", err)
			return exitProtocol
		}
		switch cmd.Op {
		case "calls":
			done := 0
			for _, s := range cmd.Calls {
				o := runCall(comm, rank, s)
				done++
				out.emit(Event{Ev: "call", Rank: rank, Call: &o})
				if !o.OK {
					break
				}
			}
			out.emit(Event{Ev: "batch", Rank: rank, Done: done})
		case "exit":
			start := time.Now()
			z.Close()
			out.emit(Event{Ev: "closed", Rank: rank, TookNs: int64(time.Since(start))})
			return 0
		default:
			fmt.Fprintf(os.Stderr, "chaos rank: unknown command %q\n", cmd.Op)
			return exitProtocol
		}
	}
	// The harness closed our input without saying exit: it is going away.
	z.Close()
	return exitProtocol
}
