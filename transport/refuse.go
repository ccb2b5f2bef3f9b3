package transport

// Refused calls: how the mailbox records a call this rank refused and acts
// on its peers' refusals, and the in-process transport's RefuseCall.

import (
	"context"
	"fmt"
	"strings"
)

// Refused calls. A rank that refuses a call for a reason only it can see (a
// tensor that changed size on that rank alone, a bad argument at the C ABI)
// still takes the call's sequence number and tells every peer with a refuse
// frame. Without that, its next call would meet its peers' refused one under
// the same sequence number and, with the same descriptor, silently combine
// data of different steps.
//
// What a peer does with a refusal of call s depends on where it is:
//   - it runs s, or starts it later: it fails with ErrMismatch naming the
//     refusing rank and the reason (s cannot complete: the refusing rank
//     sends nothing under s), aborts, and its abort frames carry the
//     mismatch to every rank, the refusing one included;
//   - it refused s too: nothing happens, since the ranks are still in step;
//   - it has moved past s: nothing happens, since its own s either was
//     refused too or failed (it could not complete without the refusing
//     rank), and a failure has poisoned it already.

// maxPendingRefusals bounds the refusals kept for calls this rank has not
// reached: a peer refusing call after call runs ahead of the others, since a
// refusal waits for nobody. Past the bound the mailbox fails with a mismatch.
const maxPendingRefusals = 1024

type peerRefusal struct {
	peer int
	text string
}

func (r peerRefusal) err(seq uint64) error {
	return fmt.Errorf("%w: rank %d refused call %d: %s", ErrMismatch, r.peer, seq, r.text)
}

// Refuse records that this rank refused call seq.
func (m *Mailbox) Refuse(seq uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if seq > m.started[m.rank] {
		m.started[m.rank] = seq
	}
	m.refused = seq
	m.forgetRefusalsLocked(seq)
	for k := range m.pending {
		if k.seq == seq {
			delete(m.pending, k)
		}
	}
}

// PeerRefused handles peer's refusal of call seq, with its reason.
func (m *Mailbox) PeerRefused(peer int, seq uint64, text string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if seq > m.started[peer] {
		m.started[peer] = seq
	}
	if text == "" {
		text = "no reason given"
	}
	r := peerRefusal{peer: peer, text: text}
	mine := m.started[m.rank]
	switch {
	case seq < mine, seq == mine && m.refused == seq:
		// Moved past it, or refused it too.
	case seq == mine:
		m.failMismatchLocked(r.err(seq))
	case len(m.refusals) >= maxPendingRefusals:
		m.failMismatchLocked(fmt.Errorf("%w: rank %d refused call %d, more than %d refused calls ahead of this rank's call %d",
			ErrMismatch, peer, seq, maxPendingRefusals, mine))
	default:
		if _, ok := m.refusals[seq]; !ok {
			m.refusals[seq] = r
		}
	}
}

// forgetRefusalsLocked drops the refusals of calls up to seq, which this
// rank has now reached; m.mu must be held.
func (m *Mailbox) forgetRefusalsLocked(seq uint64) {
	for s := range m.refusals {
		if s <= seq {
			delete(m.refusals, s)
		}
	}
}

// RefusalText is what a refuse frame carries: the reason, cut to the frame
// limit and made valid UTF-8.
func RefusalText(reason string) string {
	return truncateText(strings.TrimPrefix(reason, "oktopk: "))
}

// RefuseCall tells every peer at once, as refuse frames do over TCP.
func (t *inprocRank) RefuseCall(_ context.Context, seq uint64, reason string) {
	t.box.Refuse(seq)
	text := RefusalText(reason)
	for _, peer := range t.group.ranks {
		if peer != t {
			peer.box.PeerRefused(t.rank, seq, text)
		}
	}
}
