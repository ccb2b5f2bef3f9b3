package transport

import (
	"context"
	"fmt"
	"sync"
)

// mailbox holds messages that arrived before anyone asked for them and wakes
// the receiver waiting for a given (peer, seq, step). Both transports deliver
// into one, so matching, mismatch detection and failure propagation behave
// the same in tests and in production.
type mailbox struct {
	mu      sync.Mutex
	pending map[mailKey][]Message
	waiters map[mailKey]chan struct{}
	failed  error         // set once by Abort/Close: every call fails with it
	peerErr map[int]error // a peer known to be dead or misbehaving
	wakeAll chan struct{} // closed when failed or a peerErr is set
}

type mailKey struct {
	peer int
	seq  uint64
	step uint32
}

func newMailbox() *mailbox {
	return &mailbox{
		pending: make(map[mailKey][]Message),
		waiters: make(map[mailKey]chan struct{}),
		peerErr: make(map[int]error),
		wakeAll: make(chan struct{}),
	}
}

// deliver files msg from peer and wakes its receiver, if one waits.
func (m *mailbox) deliver(peer int, msg Message) {
	k := mailKey{peer, msg.Tag.Seq, msg.Tag.Step}
	m.mu.Lock()
	m.pending[k] = append(m.pending[k], msg)
	if w, ok := m.waiters[k]; ok {
		close(w)
		delete(m.waiters, k)
	}
	m.mu.Unlock()
}

// receive blocks until the message for (peer, tag.Seq, tag.Step) is there.
func (m *mailbox) receive(ctx context.Context, peer int, tag Tag) (Message, error) {
	k := mailKey{peer, tag.Seq, tag.Step}
	for {
		m.mu.Lock()
		if q := m.pending[k]; len(q) > 0 {
			msg := q[0]
			if len(q) == 1 {
				delete(m.pending, k)
			} else {
				m.pending[k] = q[1:]
			}
			m.mu.Unlock()
			if msg.Tag.Op != tag.Op {
				return Message{}, fmt.Errorf("%w: rank expects %s, peer %d sent %s", ErrMismatch, tag, peer, msg.Tag)
			}
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
		case <-ctx.Done():
			return Message{}, ContextError(ctx, fmt.Sprintf("receiving %s from peer %d", tag, peer))
		}
	}
}

// fail makes every blocked and future receive return err (first error wins).
func (m *mailbox) fail(err error) {
	m.mu.Lock()
	if m.failed == nil {
		m.failed = err
		close(m.wakeAll)
		m.wakeAll = make(chan struct{})
	}
	m.mu.Unlock()
}

// failPeer makes receives from one peer return err (first error wins).
func (m *mailbox) failPeer(peer int, err error) {
	m.mu.Lock()
	if m.peerErr[peer] == nil {
		m.peerErr[peer] = err
		close(m.wakeAll)
		m.wakeAll = make(chan struct{})
	}
	m.mu.Unlock()
}

func (m *mailbox) err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.failed
}
