package zmq

// The outbox's goroutine: per-peer queues sent in order, messages held
// while a peer's connection is down, hellos answered, heartbeats, and the
// bye or abort frames of Close.

import (
	"errors"
	"fmt"
	"runtime"
	"syscall"
	"time"

	"github.com/oktopk/oktopk/transport"
	"github.com/pebbe/zmq4"
)

// outMessage is one message the outbox still has to send to a peer: req is
// the caller waiting for it, or nil once answered (the payload is then the
// outbox's own copy).
type outMessage struct {
	req             *sendRequest
	header, payload []byte
}

// outboxState is what the outbox's goroutine keeps.
type outboxState struct {
	sock     *zmq4.Socket
	ids      [][]byte       // each peer's inbox routing id, once it said hello
	queues   [][]outMessage // per peer, in order
	held     []bool         // the peer's connection was down at the last try
	lastSent []time.Time    // for heartbeats
}

// outboxLoop owns the outbox: it sends each peer's messages in order,
// answers hellos, and sends a heartbeat to every peer it has been idle
// towards for a heartbeat interval. It never blocks on a peer: a message to
// a peer whose inbox is not connected is copied and held, and its sender
// answered, until the connection is back.
func (z *Transport) outboxLoop(sock *zmq4.Socket) {
	// ZeroMQ copies each payload into memory malloc takes from the calling
	// thread's arena. On one thread of its own, the outbox reuses its own
	// arena's free memory for the next payload; hopping between the Go
	// runtime's threads it would leave a freed payload-sized block in each
	// thread's arena (measured with per-peer senders: dense ring, P = 4,
	// n = 2^24: 2.75 × n × 4 B of retained C memory per rank, instead of
	// about one payload per peer).
	runtime.LockOSThread()
	defer z.owners.Done()
	defer sock.Close()
	defer close(z.out.stopped)
	n := z.opts.Size
	o := &outboxState{sock: sock, ids: make([][]byte, n), queues: make([][]outMessage, n), held: make([]bool, n), lastSent: make([]time.Time, n)}
	hb := transport.FrameHeader{Kind: transport.FrameHeartbeat, Token: z.token, Generation: z.opts.Generation, Sender: uint32(z.opts.Rank), Dtype: transport.DtypeBytes}
	hbFrame := make([]byte, transport.HeaderSize)
	ticker := time.NewTicker(pollInterval)
	defer ticker.Stop()
	for {
		z.readOutbox(o)
		for p := range o.queues {
			z.flush(o, p)
		}
		now := time.Now()
		for p, id := range o.ids {
			if id != nil && len(o.queues[p]) == 0 && now.Sub(o.lastSent[p]) >= heartbeatInterval {
				hb.Tag.Seq = z.box.StartedSeq()
				hb.Encode(hbFrame)
				if sendTo(sock, id, hbFrame, nil) == nil {
					o.lastSent[p] = now
				}
			}
		}
		select {
		case req := <-z.out.reqs:
			z.accept(o, req)
			// Take whatever else is waiting, so that one wake-up sends a
			// burst (and reads the outbox once for it).
			for more := true; more; {
				select {
				case req := <-z.out.reqs:
					z.accept(o, req)
				default:
					more = false
				}
			}
		case <-ticker.C:
		case <-z.closing:
			z.closeOutbox(o)
			return
		}
	}
}

// accept files a Send's request in its peer's queue; while the peer's
// connection is down, it is held at once, so that the Send returns.
func (z *Transport) accept(o *outboxState, req *sendRequest) {
	m := outMessage{req: req, header: req.header, payload: req.payload}
	if o.held[req.peer] && !hold(&m) {
		return
	}
	o.queues[req.peer] = append(o.queues[req.peer], m)
}

// hold makes m the outbox's own: it copies the payload and answers the
// caller. It reports false when the caller had already given up.
func hold(m *outMessage) bool {
	if m.req == nil {
		return true
	}
	if !m.req.state.CompareAndSwap(reqQueued, reqTaken) {
		return false
	}
	m.payload = append([]byte(nil), m.payload...)
	m.req.done <- nil
	m.req = nil
	return true
}

// flush sends peer p's queued messages in order, until its connection
// turns out to be down; then it holds them all.
func (z *Transport) flush(o *outboxState, p int) {
	q := o.queues[p]
	o.held[p] = false
	for len(q) > 0 {
		m := q[0]
		if m.req != nil && !m.req.state.CompareAndSwap(reqQueued, reqTaken) {
			q = q[1:] // cancelled by its caller
			continue
		}
		err := errUnreachable
		if o.ids[p] != nil {
			err = sendTo(o.sock, o.ids[p], m.header, m.payload)
		}
		if err == errUnreachable {
			if m.req != nil {
				m.req.state.Store(reqQueued) // taken a moment ago; nobody else writes it then
			}
			o.held[p] = true
			kept := q[:0]
			for i := range q {
				if hold(&q[i]) {
					kept = append(kept, q[i])
				}
			}
			q = kept
			break
		}
		if m.req != nil {
			m.req.done <- err
		}
		o.lastSent[p] = time.Now()
		q = q[1:]
	}
	if len(q) == 0 {
		q = nil // let the backing array go
	}
	o.queues[p] = q
}

// errUnreachable: the peer's inbox is not connected to the outbox right now.
var errUnreachable = errors.New("oktopk: peer not connected")

// sendTo sends header and payload as one message to the connection id,
// without blocking: errUnreachable when that connection is down.
func sendTo(sock *zmq4.Socket, id, header, payload []byte) error {
	if _, err := sock.SendBytes(id, zmq4.SNDMORE); err != nil {
		if errno := zmq4.AsErrno(err); errno == zmq4.Errno(syscall.EHOSTUNREACH) || errno == zmq4.Errno(syscall.EAGAIN) {
			return errUnreachable
		}
		return fmt.Errorf("%w: send: %w", transport.ErrRemote, err)
	}
	// Once the first part is queued the others always go (ZeroMQ queues a
	// multi-part message whole, or drops the rest of it with a connection
	// lost meanwhile).
	if _, err := sock.SendBytes(header, zmq4.SNDMORE); err != nil {
		return fmt.Errorf("%w: send: %w", transport.ErrRemote, err)
	}
	if _, err := sock.SendBytes(payload, 0); err != nil {
		return fmt.Errorf("%w: send: %w", transport.ErrRemote, err)
	}
	return nil
}

// closeOutbox answers every request still waiting, then says bye (or, after
// a failure, abort) to every peer so that it learns at once.
func (z *Transport) closeOutbox(o *outboxState) {
	for _, q := range o.queues {
		for _, m := range q {
			if m.req != nil && m.req.state.CompareAndSwap(reqQueued, reqTaken) {
				m.req.done <- z.closedErr()
			}
		}
	}
	for {
		select {
		case req := <-z.out.reqs:
			req.done <- z.closedErr()
			continue
		default:
		}
		break
	}
	// An abort says why, so that a mismatch is reported as one on every
	// rank and a timeout names the rank that held things up.
	last := transport.FrameHeader{Kind: transport.FrameBye, Token: z.token, Generation: z.opts.Generation, Sender: uint32(z.opts.Rank), Dtype: transport.DtypeBytes}
	var text []byte
	if z.box.Err() != nil && !errors.Is(z.box.Err(), transport.ErrClosed) {
		var reason string
		last.Kind = transport.FrameAbort
		last.Reason, reason = z.box.AbortReason()
		text = []byte(reason)
		last.Count, last.PayloadLen = uint64(len(text)), uint64(len(text))
	}
	lastFrame := make([]byte, transport.HeaderSize)
	last.Encode(lastFrame)
	for _, id := range o.ids {
		if id != nil {
			sendTo(o.sock, id, lastFrame, text)
		}
	}
}

// readOutbox handles what peers' inboxes sent the outbox: hellos only. A
// hello binds its connection to its rank (auth.go) and is answered with a
// hello, which tells the peer it can now receive from this rank.
func (z *Transport) readOutbox(o *outboxState) {
	// A bounded batch, so that a peer flooding the outbox cannot stall the
	// sending.
	for i := 0; i < 64; i++ {
		parts, keyRank, err := z.recvOutbox(o.sock)
		if err != nil {
			return
		}
		if len(parts) != 3 || len(parts[2]) != 0 {
			z.dropped.Add(1)
			continue
		}
		h, err := transport.DecodeFrameHeader(parts[1], z.token, z.opts.Generation, z.opts.Size)
		peer := int(h.Sender)
		if err != nil || h.Kind != transport.FrameHello || h.PayloadLen != 0 || peer == z.opts.Rank ||
			!z.connections.admit(parts[0], h.Kind, peer, keyRank, z.curve != nil) {
			z.dropped.Add(1)
			continue
		}
		if o.ids[peer] == nil {
			o.ids[peer] = parts[0]
			z.bound[peer].Store(true)
			z.helloCh <- struct{}{}
		}
		hello := transport.FrameHeader{Kind: transport.FrameHello, Token: z.token, Generation: z.opts.Generation, Sender: uint32(z.opts.Rank), Dtype: transport.DtypeBytes}
		frame := make([]byte, transport.HeaderSize)
		hello.Encode(frame)
		sendTo(o.sock, o.ids[peer], frame, nil)
	}
}
