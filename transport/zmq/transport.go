package zmq

// The transport itself: its options and limits, its state, Listen (binding
// the outbox and starting its owners), counters, and Abort and Close.

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/oktopk/oktopk/transport"
	"github.com/pebbe/zmq4"
)

// Options configure one rank's ZeroMQ transport.
type Options struct {
	Rank, Size      int
	Token           string                // per-job random token; every frame carries its digest
	BindHost        string                // address to bind and advertise; "" → transport.ResolveBindHost
	Ifname          string                // interface whose IPv4 address to use; "" → $OKTOPK_SOCKET_IFNAME, else 127.0.0.1
	Generation      uint32                // communicator generation, checked in every frame
	ConnectTimeout  time.Duration         // Connect's limit when its ctx has none (default 60 s)
	PeerTimeout     time.Duration         // silence after which a peer is declared dead (default 30 s)
	MaxMessageBytes int64                 // largest accepted message payload, from a peer (default 1 GiB)
	Diagnostics     transport.Diagnostics // stall warnings ($OKTOPK_STALL_WARN, default 10 s, to stderr)
	Curve           bool                  // CURVE-encrypt and authenticate every connection (also $OKTOPK_CURVE=1); see auth.go
}

const (
	heartbeatInterval = 250 * time.Millisecond
	pollInterval      = 50 * time.Millisecond // how often socket owners look up from a blocking call
	lingerOnClose     = 200 * time.Millisecond
	sendQueueLength   = 64
	reconnectInterval = 100 * time.Millisecond

	// outboxFrameLimit is the outbox's ZMQ_MAXMSGSIZE. Only hello frames
	// (96 bytes) arrive there legitimately, and ZeroMQ decodes the
	// handshake's commands under the same limit: PLAIN's HELLO is under
	// 600 bytes, CURVE's commands under 300 plus the socket's metadata.
	outboxFrameLimit = 4 << 10
	// outboxHWM bounds the complete messages the outbox queues per
	// connection (ZMQ_RCVHWM); only authenticated peers get that far.
	outboxHWM = 64
	// handshakeLimit is how long a connection to the outbox may take to
	// authenticate (ZMQ_HANDSHAKE_IVL) before it is closed. A rank that
	// connects before this one has learnt the job's CURVE keys is closed
	// too, and retries a reconnect interval later.
	handshakeLimit = 5 * time.Second

	// CloseBound is how long Close takes at most, on a machine that is not
	// overloaded: every socket owner looks up within a poll interval, and
	// the ZeroMQ context then waits at most lingerOnClose for the last
	// bye or abort frames to leave.
	CloseBound = pollInterval + lingerOnClose

	// peerDisconnectGrace is how long a dropped connection to a peer may
	// stay down, with nothing heard from the peer, before the peer is
	// declared dead. A drop alone is no proof of death: ZeroMQ reconnects
	// by itself, and an inbox drops a connection that sent an oversized
	// or malformed message, or a middlebox may reset one. Those reconnect
	// within a reconnect interval or two. A killed process refuses every
	// reconnect, so ten intervals separate the two cases with a wide
	// margin and still detect a death in about a second. (ZeroMQ does not
	// say why a reconnect failed, so a refused one cannot be told from a
	// transient routing failure and taken as proof at once.) It also lets
	// an orderly Close's bye frame, sent just before its sockets close, be
	// the reason peers report.
	peerDisconnectGrace = time.Second
)

// Transport is a transport.Transport over ZeroMQ TCP sockets.
type Transport struct {
	opts     Options
	token    transport.TokenDigest
	zctx     *zmq4.Context
	endpoint string
	box      *transport.Mailbox

	out       outboxQueue
	connected atomic.Bool // Connect has begun: the inbox exists
	lastSeen  []atomic.Int64
	// hello[r]: rank r's outbox has reached this rank's inbox (r can send
	// here); bound[r]: r's inbox has said hello to this rank's outbox
	// (this rank can send to r).
	hello    []atomic.Bool
	bound    []atomic.Bool
	helloCh  chan struct{} // signalled on every first hello and binding
	gone     chan int      // peers the inbox should stop dialing (receiveLoop)
	watching atomic.Bool   // liveness checks start after Connect

	curve       *curveState     // nil unless CURVE is on
	connections connectionRanks // outbox connection → rank; outbox goroutine only

	closing   chan struct{}
	closeOnce sync.Once      // closes closing
	closeAll  sync.Once      // Close's work
	owners    sync.WaitGroup // socket-owner goroutines
	dropped   atomic.Uint64  // frames refused (bad header, other job, ...)
	// Outbox connections accepted and those that completed their handshake
	// (authenticated), from the outbox's socket monitor: the difference is
	// the connections refused (or, for at most handshakeLimit, still
	// authenticating).
	accepted, authenticated atomic.Uint64

	onClose func() // extra cleanup (a rendezvous server this rank serves)

	// The store the ranks met through (address and its token), where a
	// shrink meets the survivors again; "" for a transport connected by
	// its caller's own rendezvous.
	storeAddr, storeToken string
}

// MetThrough returns the store this transport's ranks met through (its
// address and token) and whether there is one.
func (z *Transport) MetThrough() (addr, token string, ok bool) {
	return z.storeAddr, z.storeToken, z.storeAddr != ""
}

// MeetThrough records the store this transport's ranks met through (a
// process that joined a running job met it there).
func (z *Transport) MeetThrough(addr, token string) {
	z.storeAddr, z.storeToken = addr, token
}

// HandOver gives the store this transport met through, and the cleanup
// it runs at Close (the rendezvous server this rank serves), to next: the
// communicator a shrink made, which the survivors meet through next.
func (z *Transport) HandOver(next *Transport) {
	next.storeAddr, next.storeToken = z.storeAddr, z.storeToken
	next.onClose, z.onClose = z.onClose, nil
}

// outboxQueue is how Sends reach the outbox's goroutine.
type outboxQueue struct {
	reqs chan *sendRequest
	// stopped is closed once the outbox goroutine takes no more requests;
	// every request it took has been answered by then.
	stopped chan struct{}
}

// sendRequest is one message handed to the outbox. Its state settles who
// may touch payload: the outbox only after moving it from queued to taken;
// the caller's buffer is free again once the request is answered, or once
// the caller has cancelled it while still queued.
type sendRequest struct {
	peer    int
	header  []byte
	payload []byte
	state   atomic.Int32
	done    chan error // buffered; answered once for every taken request
}

const (
	reqQueued    int32 = iota
	reqTaken           // the outbox is sending (or copying) it
	reqCancelled       // the caller gave up first: skipped
)

// Listen binds this rank's outbox on an ephemeral port and starts
// serving it; it does not connect to peers (see Connect).
func Listen(opts Options) (*Transport, error) {
	if opts.Size < 1 || opts.Rank < 0 || opts.Rank >= opts.Size {
		return nil, fmt.Errorf("%w: rank %d of %d", transport.ErrInvalidArgument, opts.Rank, opts.Size)
	}
	if opts.ConnectTimeout <= 0 {
		opts.ConnectTimeout = 60 * time.Second
	}
	if opts.PeerTimeout <= 0 {
		opts.PeerTimeout = 30 * time.Second
	}
	if opts.MaxMessageBytes <= 0 {
		opts.MaxMessageBytes = 1 << 30
	}
	host, err := transport.ResolveBindHost(opts.BindHost, opts.Ifname)
	if err != nil {
		return nil, err
	}
	curve, err := newCurveState(&opts)
	if err != nil {
		return nil, err
	}
	zctx, err := zmq4.NewContext()
	if err != nil {
		return nil, fmt.Errorf("%w: zmq context: %w", transport.ErrRendezvous, err)
	}
	// A signal arriving during a blocking zmq call must not surface as an
	// error; the owner loops look up every pollInterval anyway.
	zctx.SetRetryAfterEINTR(true)
	// The ZAP handler's socket and the outbox's security and limits must
	// all be in place before it binds, or an early connection would get in
	// without them.
	var zap, monitor *zmq4.Socket
	outbox, err := zctx.NewSocket(zmq4.ROUTER)
	if err == nil {
		zap, err = serveAuth(zctx, outbox, curve)
	}
	if err == nil {
		err = firstErr(
			outbox.SetLinger(lingerOnClose),
			outbox.SetSndhwm(0),
			// Sends never block the outbox's goroutine: a peer that is not
			// connected is an error (EHOSTUNREACH), not a silent drop.
			outbox.SetSndtimeo(0),
			outbox.SetRouterMandatory(1),
			// A peer's inbox that reconnects takes its routing id back at
			// once, even before the old connection is cleaned up.
			outbox.SetRouterHandover(true),
			outbox.SetRcvhwm(outboxHWM),
			outbox.SetMaxmsgsize(outboxFrameLimit),
			outbox.SetHandshakeIvl(handshakeLimit),
		)
	}
	if err == nil {
		monitor, err = monitorSocket(zctx, outbox, "outbox", zmq4.EVENT_ACCEPTED|zmq4.EVENT_HANDSHAKE_SUCCEEDED)
	}
	if err == nil {
		err = outbox.Bind("tcp://" + bracketHost(host) + ":*")
	}
	var endpoint string
	if err == nil {
		endpoint, err = outbox.GetLastEndpoint()
	}
	if err != nil {
		for _, sock := range []*zmq4.Socket{outbox, zap, monitor} {
			if sock != nil {
				sock.Close()
			}
		}
		zctx.Term()
		return nil, fmt.Errorf("%w: binding %s: %w", transport.ErrRendezvous, host, err)
	}
	z := &Transport{
		opts:     opts,
		token:    transport.DigestToken(opts.Token),
		zctx:     zctx,
		endpoint: curve.endpoint(endpoint),
		curve:    curve,
		box:      transport.NewMailbox(opts.Rank, opts.Size, opts.Diagnostics),
		out: outboxQueue{
			reqs:    make(chan *sendRequest, sendQueueLength*max(1, opts.Size-1)),
			stopped: make(chan struct{}),
		},
		lastSeen: make([]atomic.Int64, opts.Size),
		hello:    make([]atomic.Bool, opts.Size),
		bound:    make([]atomic.Bool, opts.Size),
		helloCh:  make(chan struct{}, 2*opts.Size),
		gone:     make(chan int, opts.Size),
		closing:  make(chan struct{}),
	}
	z.box.SetSilence(z.silence)
	z.owners.Add(3)
	go z.outboxLoop(outbox)
	go z.zapLoop(zap)
	go z.outboxMonitorLoop(monitor)
	return z, nil
}

func bracketHost(h string) string {
	if strings.Contains(h, ":") && !strings.HasPrefix(h, "[") {
		return "[" + h + "]"
	}
	return h
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// Endpoint is the address peers connect to, "tcp://host:port", followed
// by "#curve=<public key>" when CURVE is on. Pass it to Connect unchanged.
func (z *Transport) Endpoint() string { return z.endpoint }

func (z *Transport) Rank() int { return z.opts.Rank }

func (z *Transport) Size() int { return z.opts.Size }

// Dropped counts what this rank refused: frames that failed validation
// (another job's token, a bad header, wrong lengths, a sender that is not
// its connection's rank, anything but a hello on the outbox) and
// connections to its outbox that did not authenticate (no or a wrong job
// password or key, not ZeroMQ at all, a handshake frame over
// outboxFrameLimit, too slow). A connection still in its handshake counts
// until it succeeds, at most handshakeLimit.
func (z *Transport) Dropped() uint64 {
	r := z.Refusals()
	return r.Frames + r.Connections
}

// Refusals is Dropped, by kind.
type Refusals struct {
	Frames      uint64 // frames dropped by validation
	Connections uint64 // outbox connections that did not (or not yet) authenticate
}

// Refusals counts what this rank refused, by kind.
func (z *Transport) Refusals() Refusals {
	// authenticated is read first: a connection is accepted before it
	// authenticates, so this order never makes the difference negative.
	auth := z.authenticated.Load()
	acc := z.accepted.Load()
	var conns uint64
	if acc > auth {
		conns = acc - auth
	}
	return Refusals{Frames: z.dropped.Load(), Connections: conns}
}

func (z *Transport) closedErr() error {
	if err := z.box.Err(); err != nil {
		return err
	}
	return transport.ErrClosed
}

// Abort fails every blocked and future call and tells the peers.
func (z *Transport) Abort(cause error) {
	z.box.Fail(fmt.Errorf("%w: %w", transport.ErrAborted, cause))
	z.shutdown()
}

// Close stops the socket owners, says bye to peers, and releases the
// ZeroMQ context; it returns within CloseBound. Closing twice is harmless:
// a second Close waits for the first.
func (z *Transport) Close() error {
	z.closeAll.Do(func() {
		z.box.Fail(transport.ErrClosed)
		z.shutdown()
		z.owners.Wait()
		z.zctx.Term()
		if z.onClose != nil {
			z.onClose()
		}
	})
	return nil
}

func (z *Transport) shutdown() {
	z.closeOnce.Do(func() { close(z.closing) })
}
