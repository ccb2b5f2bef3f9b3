package transport

// Mailbox: where both transports file arriving messages, matched to
// receives by (peer, seq, step), with mismatch detection and failures.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
)

// Mailbox holds messages that arrived before anyone asked for them and wakes
// the receiver waiting for a given (peer, seq, step). Both transports (the
// in-process one and package zmq's) deliver into one, so matching, mismatch
// detection, stall diagnostics and failure propagation behave the same in
// tests and in production.
type Mailbox struct {
	rank int
	diag Diagnostics
	// silence reports how long a peer has sent nothing while it should
	// have (SetSilence); nil where unknown.
	silence func(peer int) time.Duration

	mu       sync.Mutex
	pending  map[mailKey][]Message
	waiters  map[mailKey]chan struct{}
	failed   error         // set once by Abort/Close/mismatch: every call fails with it
	mismatch string        // the mismatch that failed this mailbox, passed on to peers
	peerErr  map[int]error // a peer known to be dead or misbehaving
	wakeAll  chan struct{} // closed when failed or a peerErr is set

	active    Tag      // op and seq of the call this rank started last (Step unused)
	call      CallDesc // that call's descriptor
	hasActive bool     // active is set
	started   []uint64 // latest call each rank has started or refused, as far as this rank knows
	warned    uint64   // seq of the last stall warning: one per call

	refused  uint64                 // the latest call this rank refused (0: none); see refuse.go
	refusals map[uint64]peerRefusal // calls peers refused that this rank has not reached yet
}

type mailKey struct {
	peer int
	seq  uint64
	step uint32
}

// NewMailbox is the mailbox of rank in a job of size ranks; diag says when
// and where a receive that waits long is reported.
func NewMailbox(rank, size int, diag Diagnostics) *Mailbox {
	return &Mailbox{
		rank:     rank,
		diag:     diag.withDefaults(),
		pending:  make(map[mailKey][]Message),
		waiters:  make(map[mailKey]chan struct{}),
		peerErr:  make(map[int]error),
		wakeAll:  make(chan struct{}),
		started:  make([]uint64, size),
		refusals: make(map[uint64]peerRefusal),
	}
}

// SetSilence installs how the stall warnings learn which peers fell silent:
// silence(peer) is how long peer has sent nothing beyond what its
// transport expects of a live peer (package zmq: two heartbeat intervals),
// and 0 while it is heard from. Set it before the mailbox is used.
func (m *Mailbox) SetSilence(silence func(peer int) time.Duration) { m.silence = silence }

// Start records the call this rank has begun and checks the frames of that
// call that peers sent before it started.
func (m *Mailbox) Start(op Op, seq uint64, call CallDesc) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.active, m.call, m.hasActive = Tag{Op: op, Seq: seq}, call, true
	if seq > m.started[m.rank] {
		m.started[m.rank] = seq
	}
	// A peer that refused this call before this rank started it sends
	// nothing under seq: the call cannot complete, and the ranks disagree.
	if r, ok := m.refusals[seq]; ok {
		m.failMismatchLocked(r.err(seq))
	}
	m.forgetRefusalsLocked(seq)
	if m.failed != nil {
		return
	}
	for k, q := range m.pending {
		if k.seq == seq && len(q) > 0 {
			if err := checkSameCall(m.rank, k.peer, seq, op, call, q[0].Tag.Op, q[0].Call); err != nil {
				m.failMismatchLocked(err)
				return
			}
		}
	}
}

// CallOf is the descriptor this rank's frames of call seq carry: the
// started call's, or zero for messages outside one.
func (m *Mailbox) CallOf(seq uint64) CallDesc {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.hasActive && m.active.Seq == seq {
		return m.call
	}
	return CallDesc{}
}

// Deliver files msg from peer and wakes its receiver, if one waits. A frame
// of the running call that disagrees with it fails the mailbox at once, even
// if nobody waits for that frame: ranks running different algorithms may
// never ask for each other's messages.
func (m *Mailbox) Deliver(peer int, msg Message) {
	k := mailKey{peer, msg.Tag.Seq, msg.Tag.Step}
	m.mu.Lock()
	defer m.mu.Unlock()
	if msg.Tag.Seq > m.started[peer] {
		m.started[peer] = msg.Tag.Seq
	}
	if m.refused != 0 && msg.Tag.Seq == m.refused {
		return // nobody here will ask for a refused call's frames
	}
	if m.hasActive && msg.Tag.Seq == m.active.Seq {
		if err := checkSameCall(m.rank, peer, msg.Tag.Seq, m.active.Op, m.call, msg.Tag.Op, msg.Call); err != nil {
			m.failMismatchLocked(err)
			return
		}
	}
	m.pending[k] = append(m.pending[k], msg)
	if w, ok := m.waiters[k]; ok {
		close(w)
		delete(m.waiters, k)
	}
}

// Receive blocks until the message for (peer, tag.Seq, tag.Step) is there.
func (m *Mailbox) Receive(ctx context.Context, peer int, tag Tag) (Message, error) {
	k := mailKey{peer, tag.Seq, tag.Step}
	begun := time.Now()
	var stall <-chan time.Time
	if m.diag.StallWarn > 0 {
		t := time.NewTimer(m.diag.StallWarn)
		defer t.Stop()
		stall = t.C
	}
	for {
		m.mu.Lock()
		// A message that arrived before a failure is still served: a peer
		// that finished this call before it aborted the next one sent it all.
		if q := m.pending[k]; len(q) > 0 {
			msg := q[0]
			if len(q) == 1 {
				delete(m.pending, k)
			} else {
				m.pending[k] = q[1:]
			}
			mine := CallDesc{}
			if m.hasActive && m.active.Seq == tag.Seq {
				mine = m.call
			}
			if err := checkSameCall(m.rank, peer, tag.Seq, tag.Op, mine, msg.Tag.Op, msg.Call); err != nil {
				m.failMismatchLocked(err)
				err = m.failed
				m.mu.Unlock()
				return Message{}, err
			}
			m.mu.Unlock()
			return msg, nil
		}
		if m.failed != nil {
			err := m.failed
			m.mu.Unlock()
			return Message{}, err
		}
		if err := m.peerErr[peer]; err != nil {
			m.mu.Unlock()
			return Message{}, fmt.Errorf("waiting for %s from peer %d: %w", tag, peer, err)
		}
		w, ok := m.waiters[k]
		if !ok {
			w = make(chan struct{})
			m.waiters[k] = w
		}
		wakeAll := m.wakeAll
		m.mu.Unlock()
		select {
		case <-w:
		case <-wakeAll:
		case <-stall:
			stall = nil
			m.warnStall(peer, tag, time.Since(begun))
		case <-ctx.Done():
			m.mu.Lock()
			why := m.explain(tag.Seq, peer)
			m.mu.Unlock()
			return Message{}, ContextError(ctx, fmt.Sprintf("receiving %s from peer %d after %.1fs (%s)",
				tag, peer, time.Since(begun).Seconds(), why))
		}
	}
}

// failMismatchLocked fails the mailbox with a mismatch; m.mu must be held.
func (m *Mailbox) failMismatchLocked(err error) {
	if m.failed == nil {
		var me *MismatchError
		if errors.As(err, &me) {
			m.mismatch = me.Detail()
		} else {
			m.mismatch = strings.TrimPrefix(err.Error(), ErrMismatch.Error()+": ")
		}
	}
	m.failLocked(err)
}

// Fail makes every blocked and future receive return err (first error wins).
func (m *Mailbox) Fail(err error) {
	m.mu.Lock()
	m.failLocked(err)
	m.mu.Unlock()
}

func (m *Mailbox) failLocked(err error) {
	if m.failed == nil {
		m.failed = err
		close(m.wakeAll)
		m.wakeAll = make(chan struct{})
	}
}

// FailPeer makes receives from one peer return err (first error wins).
func (m *Mailbox) FailPeer(peer int, err error) {
	m.mu.Lock()
	if m.peerErr[peer] == nil {
		m.peerErr[peer] = err
		close(m.wakeAll)
		m.wakeAll = make(chan struct{})
	}
	m.mu.Unlock()
}

// Pending counts, per peer, the messages filed that no receive has taken
// yet (a peer appears once anything of it was filed): what a transport's
// tests check its deliveries against.
func (m *Mailbox) Pending() map[int]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := map[int]int{}
	for k, q := range m.pending {
		n[k.peer] += len(q)
	}
	return n
}

// Err is the error that failed the mailbox (Fail, a mismatch), or nil.
func (m *Mailbox) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.failed
}

// AbortReason is what this rank tells its peers when it aborts: a mismatch
// is passed on as one (so every rank reports ErrMismatch, not a remote
// failure), anything else as the error's text.
func (m *Mailbox) AbortReason() (AbortReason, string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mismatch != "" {
		return AbortMismatch, truncateText(m.mismatch)
	}
	if m.failed == nil {
		return AbortFailure, ""
	}
	if errors.Is(m.failed, ErrMismatch) {
		return AbortMismatch, truncateText(m.failed.Error())
	}
	return AbortFailure, truncateText(m.failed.Error())
}

// PeerAborted handles a peer's abort: a mismatch fails every call of this
// rank too (the ranks disagree about the call, whoever this rank waits for);
// any other failure fails the receives waiting on that peer.
func (m *Mailbox) PeerAborted(peer int, reason AbortReason, text string) {
	if reason == AbortMismatch {
		m.mu.Lock()
		if m.failed == nil {
			m.mismatch = text
		}
		m.failLocked(fmt.Errorf("%w: %s (found by rank %d)", ErrMismatch, text, peer))
		m.mu.Unlock()
		return
	}
	if text == "" {
		text = "no reason given"
	}
	m.FailPeer(peer, fmt.Errorf("%w: peer %d aborted: %s", ErrRemote, peer, text))
}

func truncateText(s string) string {
	if len(s) > maxAbortText {
		s = s[:maxAbortText]
	}
	return strings.ToValidUTF8(s, "?")
}
