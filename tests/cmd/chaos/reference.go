package main

// The fault-free reference: the same calls, with the same seeded inputs and
// in the same order, on P ranks connected in memory (transport.NewInProc).
// A call that succeeds on a real rank must produce bitwise what its
// reference rank produced, in the caller's buffer and in the tensor's state;
// a call that fails in the reference (NaN/Inf on some rank) must fail the
// same way for real. The in-process transport shares the mailbox, matching
// and error propagation with the ZeroMQ one, so what differs between the two
// is what the campaign tests: sockets, processes and faults.

import (
	"sync"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

type reference struct {
	comms []*core.Communicator
}

func newReference(p int) *reference {
	ref := &reference{}
	for _, t := range transport.NewInProcDiagnostics(p, transport.Diagnostics{StallWarn: -1}) {
		ref.comms = append(ref.comms, core.NewCommunicator(t))
	}
	return ref
}

// run issues call specs[r] on every reference rank r at once. A reference
// call has a minute whatever the spec says: a loaded machine must not make
// the reference itself time out.
func (ref *reference) run(specs []CallSpec) []Outcome {
	out := make([]Outcome, len(ref.comms))
	var wg sync.WaitGroup
	for r, c := range ref.comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := specs[r]
			s.TimeoutMs = 60_000
			out[r] = runCall(c, r, s)
		}()
	}
	wg.Wait()
	return out
}

func (ref *reference) close() {
	for _, c := range ref.comms {
		c.T.Close()
	}
}
