package transport

// The ZeroMQ TCP transport works as follows. Each rank binds one ROUTER
// socket, its outbox, on the address it advertises, and every peer's inbox
// (a ROUTER that only ever connects) dials it: a rank's messages to a peer
// travel outbox → the peer's inbox, over a connection the receiver opened
// itself to the address the rendezvous gave it. On each socket one
// goroutine, its only user, does all the work. The outbox's goroutine takes
// every Send from a channel and sends it to the peer's inbox connection;
// messages to one peer keep their order, and a peer whose connection is
// down has its messages held (copied) until it is back, never holding up
// the others. The inbox's goroutine validates each frame and files it in
// the mailbox.
//
// ZeroMQ sockets are not goroutine-safe, hence one owner goroutine per socket
// and a private zmq4.Context per transport, so that closing one communicator
// never touches another's sockets.
//
// Why the receiver dials: a stranger can open a connection to any bound
// port, and ZeroMQ decodes what arrives there under the socket's limits
// before anything else looks at it — a frame's announced size is allocated
// up front (so a 1 GiB limit let anyone make a rank hold 1 GiB per
// connection), and no option bounds a multi-part message that never ends
// (0x01 0x00 repeated: 32 bytes of queue per wire byte, whatever the
// high-water mark). So the only port a rank binds, the outbox, never takes
// data: its frames are capped at outboxFrameLimit, and a connection must
// pass a PLAIN handshake with the job's password, or CURVE with the job's
// keys (auth.go), before it may send any frame at all. What a connection
// that has not authenticated can make a rank hold is one handshake frame of
// at most outboxFrameLimit plus ZeroMQ's fixed per-connection buffers (20
// KiB in all, measured with 400 such connections), for at most
// handshakeLimit; the kernel's socket buffers come on top, as for any TCP
// port. How many such connections a stranger keeps open at once is bounded
// only by how fast it can open them and by the process's file limit: this
// layer cannot close one before ZeroMQ does. Large messages
// arrive only on the inbox's own connections, which accept frames of up to
// MaxMessageBytes. Refused connections and frames are counted (Dropped).
//
// Liveness has three sources, fastest first. Close sends a bye frame and
// Abort an abort frame, so peers of an orderly or failed rank learn of it at
// once. A rank that dies without a word (SIGKILL, a crash, OOM) has its TCP
// connections closed by the kernel: a socket monitor on the inbox reports
// the drop of its connection to that rank, and a drop not repaired within
// peerDisconnectGrace fails every receive waiting on that peer with
// ErrRemote ("peer 2 disconnected"). A rank that hangs with its connections
// up (SIGSTOP, a stuck process, a host gone without a reset) is caught by
// heartbeats: the outbox sends one to every peer it has been idle towards
// for a heartbeatInterval, and a peer not heard from for PeerTimeout is
// declared dead the same way, unless the caller's deadline fires first.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// ZMQOptions configure one rank's ZeroMQ transport.
type ZMQOptions struct {
	Rank, Size      int
	Token           string        // per-job random token; every frame carries its digest
	BindHost        string        // address to bind and advertise; "" → ResolveBindHost
	Ifname          string        // interface whose IPv4 address to use; "" → $OKTOPK_SOCKET_IFNAME, else 127.0.0.1
	Generation      uint32        // communicator generation, checked in every frame
	ConnectTimeout  time.Duration // Connect's limit when its ctx has none (default 60 s)
	PeerTimeout     time.Duration // silence after which a peer is declared dead (default 30 s)
	MaxMessageBytes int64         // largest accepted message payload, from a peer (default 1 GiB)
	Diagnostics     Diagnostics   // stall warnings ($OKTOPK_STALL_WARN, default 10 s, to stderr)
	Curve           bool          // CURVE-encrypt and authenticate every connection (also $OKTOPK_CURVE=1); see auth.go
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

// ZMQ is a Transport over ZeroMQ TCP sockets.
type ZMQ struct {
	opts     ZMQOptions
	token    tokenDigest
	zctx     *zmq.Context
	endpoint string
	box      *mailbox

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

// NewToken returns a random job token (32 bytes of entropy, hex).
func NewToken() string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic("oktopk: no randomness: " + err.Error())
	}
	return hex.EncodeToString(b)
}

// ResolveBindHost decides which address a rank binds and advertises: the
// explicit host if given, else the IPv4 address of the named interface
// (ifname, or $OKTOPK_SOCKET_IFNAME), else loopback. It never picks the
// wildcard address on its own; "0.0.0.0" must be asked for explicitly.
func ResolveBindHost(bindHost, ifname string) (string, error) {
	if bindHost != "" {
		return bindHost, nil
	}
	if ifname == "" {
		ifname = Getenv("OKTOPK_SOCKET_IFNAME")
	}
	if ifname == "" {
		return "127.0.0.1", nil
	}
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		return "", fmt.Errorf("%w: interface %q: %w", ErrRendezvous, ifname, err)
	}
	addrs, err := iface.Addrs()
	if err != nil {
		return "", fmt.Errorf("%w: interface %q: %w", ErrRendezvous, ifname, err)
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil {
			return ipn.IP.String(), nil
		}
	}
	return "", fmt.Errorf("%w: interface %q has no IPv4 address", ErrRendezvous, ifname)
}

// ListenZMQ binds this rank's outbox on an ephemeral port and starts
// serving it; it does not connect to peers (see Connect).
func ListenZMQ(opts ZMQOptions) (*ZMQ, error) {
	if opts.Size < 1 || opts.Rank < 0 || opts.Rank >= opts.Size {
		return nil, fmt.Errorf("%w: rank %d of %d", ErrInvalidArgument, opts.Rank, opts.Size)
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
	host, err := ResolveBindHost(opts.BindHost, opts.Ifname)
	if err != nil {
		return nil, err
	}
	curve, err := newCurveState(&opts)
	if err != nil {
		return nil, err
	}
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, fmt.Errorf("%w: zmq context: %w", ErrRendezvous, err)
	}
	// A signal arriving during a blocking zmq call must not surface as an
	// error; the owner loops look up every pollInterval anyway.
	zctx.SetRetryAfterEINTR(true)
	// The ZAP handler's socket and the outbox's security and limits must
	// all be in place before it binds, or an early connection would get in
	// without them.
	var zap, monitor *zmq.Socket
	outbox, err := zctx.NewSocket(zmq.ROUTER)
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
		monitor, err = monitorSocket(zctx, outbox, "outbox", zmq.EVENT_ACCEPTED|zmq.EVENT_HANDSHAKE_SUCCEEDED)
	}
	if err == nil {
		err = outbox.Bind("tcp://" + bracketHost(host) + ":*")
	}
	var endpoint string
	if err == nil {
		endpoint, err = outbox.GetLastEndpoint()
	}
	if err != nil {
		for _, sock := range []*zmq.Socket{outbox, zap, monitor} {
			if sock != nil {
				sock.Close()
			}
		}
		zctx.Term()
		return nil, fmt.Errorf("%w: binding %s: %w", ErrRendezvous, host, err)
	}
	z := &ZMQ{
		opts:     opts,
		token:    digestToken(opts.Token),
		zctx:     zctx,
		endpoint: curve.endpoint(endpoint),
		curve:    curve,
		box:      newMailbox(opts.Rank, opts.Size, opts.Diagnostics),
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
	z.box.silence = z.silence
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
func (z *ZMQ) Endpoint() string { return z.endpoint }

func (z *ZMQ) Rank() int { return z.opts.Rank }
func (z *ZMQ) Size() int { return z.opts.Size }

// Dropped counts what this rank refused: frames that failed validation
// (another job's token, a bad header, wrong lengths, a sender that is not
// its connection's rank, anything but a hello on the outbox) and
// connections to its outbox that did not authenticate (no or a wrong job
// password or key, not ZeroMQ at all, a handshake frame over
// outboxFrameLimit, too slow). A connection still in its handshake counts
// until it succeeds, at most handshakeLimit.
func (z *ZMQ) Dropped() uint64 {
	r := z.Refusals()
	return r.Frames + r.Connections
}

// Refusals is Dropped, by kind.
type Refusals struct {
	Frames      uint64 // frames dropped by validation
	Connections uint64 // outbox connections that did not (or not yet) authenticate
}

// Refusals counts what this rank refused, by kind.
func (z *ZMQ) Refusals() Refusals {
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

// peerRoutingID names the inbox's connection to rank r's outbox
// (ZMQ_CONNECT_ROUTING_ID): every message arriving under it comes from the
// address the rendezvous gave for rank r.
func peerRoutingID(r int) string { return "rank-" + strconv.Itoa(r) }

// routingIDRank is peerRoutingID's inverse; -1 for anything else.
func routingIDRank(id []byte) int {
	s, ok := strings.CutPrefix(string(id), "rank-")
	if !ok {
		return -1
	}
	r, err := strconv.Atoi(s)
	if err != nil || s != strconv.Itoa(r) {
		return -1
	}
	return r
}

// Connect connects this rank's inbox to every peer's outbox (endpoints in
// rank order, this rank's own entry ignored) and waits until every peer
// can send here and this rank can send to every peer, so that a successful
// Connect means the whole job is reachable.
func (z *ZMQ) Connect(ctx context.Context, endpoints []string) error {
	if len(endpoints) != z.opts.Size {
		return fmt.Errorf("%w: %d endpoints for %d ranks", ErrInvalidArgument, len(endpoints), z.opts.Size)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, z.opts.ConnectTimeout)
		defer cancel()
	}
	addrs, serverKeys, err := z.learnPeers(endpoints)
	if err != nil {
		return err
	}
	if !z.connected.CompareAndSwap(false, true) {
		return fmt.Errorf("oktopk: invalid usage: already connected")
	}
	if z.opts.Size > 1 {
		if err := z.openInbox(addrs, serverKeys); err != nil {
			return err
		}
	}
	for {
		missing := []int{}
		for r := range z.hello {
			if r != z.opts.Rank && !(z.hello[r].Load() && z.bound[r].Load()) {
				missing = append(missing, r)
			}
		}
		if len(missing) == 0 {
			break
		}
		select {
		case <-z.helloCh:
		case <-ctx.Done():
			return fmt.Errorf("%w: %s", ContextError(ctx, "connecting"), z.connectProblem(addrs))
		case <-z.closing:
			return z.closedErr()
		}
	}
	now := time.Now().UnixNano()
	for r := range z.lastSeen {
		z.lastSeen[r].Store(now)
	}
	z.watching.Store(true)
	return nil
}

// openInbox makes the inbox, connects it to every peer's outbox at addrs
// (with CURVE, pinning each peer's key), says hello on each connection, and
// hands the inbox to its goroutine and its monitor to the monitor's.
func (z *ZMQ) openInbox(addrs, serverKeys []string) error {
	inbox, err := z.zctx.NewSocket(zmq.ROUTER)
	if err == nil {
		err = firstErr(
			inbox.SetLinger(0),
			inbox.SetRcvhwm(0),
			inbox.SetMaxmsgsize(z.opts.MaxMessageBytes+headerSize),
			inbox.SetRcvtimeo(pollInterval),
			inbox.SetSndtimeo(0),
			inbox.SetRouterMandatory(1),
			inbox.SetReconnectIvl(reconnectInterval),
			// A unique, unguessable routing id for this inbox at every
			// peer's outbox: its hello binds the id to this rank there,
			// and a reconnect presents it again.
			inbox.SetIdentity(fmt.Sprintf("oktopk-rank-%d-%s", z.opts.Rank, NewToken()[:16])),
		)
	}
	var monitor *zmq.Socket
	if err == nil {
		// The monitor must listen before the inbox connects, or the first
		// events would be lost.
		monitor, err = monitorSocket(z.zctx, inbox, "inbox", zmq.EVENT_DISCONNECTED|zmq.EVENT_HANDSHAKE_SUCCEEDED)
	}
	if err != nil {
		if inbox != nil {
			inbox.Close()
		}
		return fmt.Errorf("%w: making the inbox: %w", ErrRendezvous, err)
	}
	hello := frameHeader{kind: kindHello, token: z.token, generation: z.opts.Generation, sender: uint32(z.opts.Rank), dtype: DtypeBytes}
	helloFrame := make([]byte, headerSize)
	hello.encode(helloFrame)
	for r, ep := range addrs {
		if r == z.opts.Rank {
			continue
		}
		// Security options apply to the connections made after them, so
		// each peer's CURVE key is set just before connecting to it.
		err = firstErr(z.secureClient(inbox, serverKeys[r]), inbox.SetConnectRid(peerRoutingID(r)))
		if err == nil {
			err = inbox.Connect(ep)
		}
		if err == nil {
			// The connection's queue exists from Connect on (ZeroMQ
			// connects in the background), so the hello waits there.
			_, err = inbox.SendMessage(peerRoutingID(r), helloFrame, "")
		}
		if err != nil {
			inbox.Close()
			monitor.Close()
			return fmt.Errorf("%w: connecting to rank %d at %q: %w", ErrRendezvous, r, ep, err)
		}
	}
	z.owners.Add(2)
	go z.receiveLoop(inbox, addrs)
	go z.monitorLoop(monitor, addrs)
	return nil
}

func (z *ZMQ) closedErr() error {
	if err := z.box.err(); err != nil {
		return err
	}
	return ErrClosed
}

// Send hands payload to the outbox and returns once it is copied (by ZeroMQ,
// or by the outbox while peer's connection is down), so that the caller may
// reuse the buffer.
func (z *ZMQ) Send(ctx context.Context, peer int, tag Tag, dtype Dtype, count uint64, payload []byte) error {
	if err := checkPeer(z, peer); err != nil {
		return err
	}
	if err := z.box.err(); err != nil {
		return err
	}
	if !z.connected.Load() {
		return fmt.Errorf("oktopk: invalid usage: send before Connect")
	}
	h := frameHeader{kind: kindData, tag: tag, call: z.box.callOf(tag.Seq), dtype: dtype, count: count, payloadLen: uint64(len(payload))}
	return z.enqueue(ctx, peer, &h, payload)
}

// StartCall records the call this rank has begun; its heartbeats carry the
// sequence number to the peers.
func (z *ZMQ) StartCall(op Op, seq uint64, call CallDesc) { z.box.start(op, seq, call) }

func (z *ZMQ) enqueue(ctx context.Context, peer int, h *frameHeader, payload []byte) error {
	// Said only on failure: formatting it on every send cost an allocation.
	what := func() string { return fmt.Sprintf("sending %s to peer %d", h.tag, peer) }
	h.token = z.token
	h.generation = z.opts.Generation
	h.sender = uint32(z.opts.Rank)
	req := &sendRequest{peer: peer, header: make([]byte, headerSize), payload: payload, done: make(chan error, 1)}
	h.encode(req.header)
	select {
	case z.out.reqs <- req:
	case <-ctx.Done():
		return ContextError(ctx, what())
	case <-z.closing:
		return z.closedErr()
	}
	// The request may have gone into the queue after the outbox drained it
	// for the last time (both cases of the select above were ready): then
	// nobody will take it, and stopped says so.
	select {
	case err := <-req.done:
		return err
	case <-z.out.stopped:
		return z.answeredOrClosed(req)
	case <-ctx.Done():
		if req.state.CompareAndSwap(reqQueued, reqCancelled) {
			return ContextError(ctx, what()) // the outbox will skip it
		}
		// The outbox has taken it and is copying payload: wait so the
		// caller can reuse the buffer. The outbox never blocks on a peer,
		// so this lasts one copy at most.
		select {
		case <-req.done:
		case <-z.out.stopped:
		}
		return ContextError(ctx, what())
	}
}

// answeredOrClosed is a request's outcome once the outbox has stopped: its
// answer if the outbox took it, else the reason the transport closed.
func (z *ZMQ) answeredOrClosed(req *sendRequest) error {
	select {
	case err := <-req.done:
		return err
	default:
		return z.closedErr()
	}
}

// outMessage is one message the outbox still has to send to a peer: req is
// the caller waiting for it, or nil once answered (the payload is then the
// outbox's own copy).
type outMessage struct {
	req             *sendRequest
	header, payload []byte
}

// outboxState is what the outbox's goroutine keeps.
type outboxState struct {
	sock     *zmq.Socket
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
func (z *ZMQ) outboxLoop(sock *zmq.Socket) {
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
	hb := frameHeader{kind: kindHeartbeat, token: z.token, generation: z.opts.Generation, sender: uint32(z.opts.Rank), dtype: DtypeBytes}
	hbFrame := make([]byte, headerSize)
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
				hb.tag.Seq = z.box.startedSeq()
				hb.encode(hbFrame)
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
func (z *ZMQ) accept(o *outboxState, req *sendRequest) {
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
func (z *ZMQ) flush(o *outboxState, p int) {
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
func sendTo(sock *zmq.Socket, id, header, payload []byte) error {
	if _, err := sock.SendBytes(id, zmq.SNDMORE); err != nil {
		if errno := zmq.AsErrno(err); errno == zmq.Errno(syscall.EHOSTUNREACH) || errno == zmq.Errno(syscall.EAGAIN) {
			return errUnreachable
		}
		return fmt.Errorf("%w: send: %w", ErrRemote, err)
	}
	// Once the first part is queued the others always go (ZeroMQ queues a
	// multi-part message whole, or drops the rest of it with a connection
	// lost meanwhile).
	if _, err := sock.SendBytes(header, zmq.SNDMORE); err != nil {
		return fmt.Errorf("%w: send: %w", ErrRemote, err)
	}
	if _, err := sock.SendBytes(payload, 0); err != nil {
		return fmt.Errorf("%w: send: %w", ErrRemote, err)
	}
	return nil
}

// closeOutbox answers every request still waiting, then says bye (or, after
// a failure, abort) to every peer so that it learns at once.
func (z *ZMQ) closeOutbox(o *outboxState) {
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
	last := frameHeader{kind: kindBye, token: z.token, generation: z.opts.Generation, sender: uint32(z.opts.Rank), dtype: DtypeBytes}
	var text []byte
	if z.box.err() != nil && !errors.Is(z.box.err(), ErrClosed) {
		var reason string
		last.kind = kindAbort
		last.reason, reason = z.box.abortReason()
		text = []byte(reason)
		last.count, last.payloadLen = uint64(len(text)), uint64(len(text))
	}
	lastFrame := make([]byte, headerSize)
	last.encode(lastFrame)
	for _, id := range o.ids {
		if id != nil {
			sendTo(o.sock, id, lastFrame, text)
		}
	}
}

// readOutbox handles what peers' inboxes sent the outbox: hellos only. A
// hello binds its connection to its rank (auth.go) and is answered with a
// hello, which tells the peer it can now receive from this rank.
func (z *ZMQ) readOutbox(o *outboxState) {
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
		h, err := decodeFrameHeader(parts[1], z.token, z.opts.Generation, z.opts.Size)
		peer := int(h.sender)
		if err != nil || h.kind != kindHello || h.payloadLen != 0 || peer == z.opts.Rank ||
			!z.connections.admit(parts[0], h.kind, peer, keyRank, z.curve != nil) {
			z.dropped.Add(1)
			continue
		}
		if o.ids[peer] == nil {
			o.ids[peer] = parts[0]
			z.bound[peer].Store(true)
			z.helloCh <- struct{}{}
		}
		hello := frameHeader{kind: kindHello, token: z.token, generation: z.opts.Generation, sender: uint32(z.opts.Rank), dtype: DtypeBytes}
		frame := make([]byte, headerSize)
		hello.encode(frame)
		sendTo(o.sock, o.ids[peer], frame, nil)
	}
}

// receiveLoop owns the inbox: it validates each message, files data in the
// mailbox, records liveness, and fails peers that fell silent.
//
// It stops dialing a peer once that peer is gone (declared dead, or said
// bye or abort): ZeroMQ would otherwise redial its address for as long as
// the communicator lives, and without CURVE nothing tells this rank that
// whoever answers there later is still that rank.
func (z *ZMQ) receiveLoop(inbox *zmq.Socket, addrs []string) {
	defer z.owners.Done()
	defer inbox.Close()
	dialing := make([]bool, len(addrs))
	for r := range dialing {
		dialing[r] = r != z.opts.Rank
	}
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		if parts, err := inbox.RecvMessageBytes(0); err == nil {
			z.handle(parts)
		}
		z.checkLiveness()
		for more := true; more; {
			select {
			case r := <-z.gone:
				if dialing[r] {
					dialing[r] = false
					inbox.Disconnect(addrs[r])
				}
			default:
				more = false
			}
		}
	}
}

// forget tells the inbox to stop dialing peer (see receiveLoop).
func (z *ZMQ) forget(peer int) {
	select {
	case z.gone <- peer:
	default: // full of repeats; the peer is in there already
	}
}

// handle validates one inbox message and acts on it. ROUTER prepends the
// routing id of the connection it came on, which names the peer whose
// outbox this rank dialed: ours are [routing id, header, payload].
func (z *ZMQ) handle(parts [][]byte) {
	if len(parts) != 3 {
		z.dropped.Add(1)
		return
	}
	h, err := decodeFrameHeader(parts[1], z.token, z.opts.Generation, z.opts.Size)
	peer := int(h.sender)
	if err != nil || h.payloadLen != uint64(len(parts[2])) || peer == z.opts.Rank || peer != routingIDRank(parts[0]) {
		z.dropped.Add(1)
		return
	}
	z.lastSeen[peer].Store(time.Now().UnixNano())
	switch h.kind {
	case kindData:
		z.box.deliver(peer, Message{Tag: h.tag, Dtype: h.dtype, Count: h.count, Call: h.call, Payload: parts[2]})
	case kindHello:
		if !z.hello[peer].Swap(true) {
			z.helloCh <- struct{}{}
		}
	case kindHeartbeat:
		z.box.noteStarted(peer, h.tag.Seq)
	case kindBye:
		z.box.failPeer(peer, fmt.Errorf("%w: peer %d closed its communicator", ErrRemote, peer))
		z.forget(peer)
	case kindAbort:
		z.box.peerAborted(peer, h.reason, strings.ToValidUTF8(string(parts[2]), "?"))
		z.forget(peer)
	case kindRefuse:
		z.box.peerRefused(peer, h.tag.Seq, strings.ToValidUTF8(string(parts[2]), "?"))
	}
}

// silence is how long peer has sent nothing (0 before Connect finished).
func (z *ZMQ) silence(peer int) time.Duration {
	if !z.watching.Load() {
		return 0
	}
	return time.Duration(time.Now().UnixNano() - z.lastSeen[peer].Load())
}

func (z *ZMQ) checkLiveness() {
	if !z.watching.Load() {
		return
	}
	now := time.Now().UnixNano()
	for r := range z.lastSeen {
		if r == z.opts.Rank {
			continue
		}
		if silent := time.Duration(now - z.lastSeen[r].Load()); silent > z.opts.PeerTimeout {
			z.box.failPeer(r, fmt.Errorf("%w: peer %d silent for %v", ErrRemote, r, silent.Round(time.Millisecond)))
			z.forget(r)
		}
	}
}

// monitorSocket starts ZeroMQ's socket monitor on sock for events and
// returns the PAIR socket they arrive on, named name within the transport's
// private context. Only one goroutine may use that socket afterwards; sock
// stays its own owner's alone.
func monitorSocket(zctx *zmq.Context, sock *zmq.Socket, name string, events zmq.Event) (*zmq.Socket, error) {
	addr := "inproc://oktopk-monitor-" + name // the context is private
	if err := sock.Monitor(addr, events); err != nil {
		return nil, fmt.Errorf("monitoring the %s socket: %w", name, err)
	}
	m, err := zctx.NewSocket(zmq.PAIR)
	if err == nil {
		err = firstErr(m.SetLinger(0), m.SetRcvtimeo(pollInterval))
	}
	if err == nil {
		err = m.Connect(addr)
	}
	if err != nil {
		if m != nil {
			m.Close()
		}
		return nil, fmt.Errorf("monitoring the %s socket: %w", name, err)
	}
	return m, nil
}

// outboxMonitorLoop owns the outbox's monitor socket: it counts the
// connections the outbox accepted and those that authenticated.
func (z *ZMQ) outboxMonitorLoop(m *zmq.Socket) {
	defer z.owners.Done()
	defer m.Close()
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		event, _, _, err := m.RecvEvent(0)
		if err != nil {
			continue
		}
		switch event {
		case zmq.EVENT_ACCEPTED:
			z.accepted.Add(1)
		case zmq.EVENT_HANDSHAKE_SUCCEEDED:
			z.authenticated.Add(1)
		}
	}
}

// monitorLoop owns the inbox's monitor socket: it notes when the
// connection to a peer (addrs[r] is rank r's outbox) drops and when a
// handshake brings it back, and declares a peer dead once a drop has lasted
// peerDisconnectGrace with nothing heard from it. It never touches the
// inbox itself.
func (z *ZMQ) monitorLoop(m *zmq.Socket, addrs []string) {
	defer z.owners.Done()
	defer m.Close()
	down := make([]time.Time, len(addrs)) // when each peer's connection dropped; zero while up
	declared := make([]bool, len(addrs))
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		for {
			event, addr, _, err := m.RecvEvent(0)
			if err != nil {
				break
			}
			r := endpointRank(addrs, addr, z.opts.Rank)
			if r < 0 {
				continue
			}
			switch event {
			case zmq.EVENT_DISCONNECTED:
				if down[r].IsZero() {
					down[r] = time.Now()
				}
			case zmq.EVENT_HANDSHAKE_SUCCEEDED:
				down[r] = time.Time{}
			}
		}
		if !z.watching.Load() {
			continue
		}
		now := time.Now()
		for r, since := range down {
			if since.IsZero() || declared[r] {
				continue
			}
			quiet := since
			if seen := time.Unix(0, z.lastSeen[r].Load()); seen.After(quiet) {
				quiet = seen
			}
			if now.Sub(quiet) > peerDisconnectGrace {
				declared[r] = true
				z.box.failPeer(r, fmt.Errorf("%w: peer %d disconnected (connection lost %v ago, not re-established)",
					ErrRemote, r, now.Sub(since).Round(time.Millisecond)))
				z.forget(r)
			}
		}
	}
}

// endpointRank is the rank whose outbox address a monitor event names: the
// address as connected to, or else the one peer listening on that port
// (ZeroMQ reports the address it resolved, which for a host name differs
// from the one given); -1 when none or several match.
func endpointRank(addrs []string, event string, self int) int {
	for r, a := range addrs {
		if r != self && a == event {
			return r
		}
	}
	i := strings.LastIndex(event, ":")
	if i < 0 {
		return -1
	}
	found := -1
	for r, a := range addrs {
		if r != self && strings.HasSuffix(a, event[i:]) {
			if found >= 0 {
				return -1
			}
			found = r
		}
	}
	return found
}

// Recv waits for the message of tag from peer.
func (z *ZMQ) Recv(ctx context.Context, peer int, tag Tag) (Message, error) {
	if err := checkPeer(z, peer); err != nil {
		return Message{}, err
	}
	return z.box.receive(ctx, peer, tag)
}

// Abort fails every blocked and future call and tells the peers.
func (z *ZMQ) Abort(cause error) {
	z.box.fail(fmt.Errorf("%w: %w", ErrAborted, cause))
	z.shutdown()
}

// Close stops the socket owners, says bye to peers, and releases the
// ZeroMQ context; it returns within CloseBound. Closing twice is harmless:
// a second Close waits for the first.
func (z *ZMQ) Close() error {
	z.closeAll.Do(func() {
		z.box.fail(ErrClosed)
		z.shutdown()
		z.owners.Wait()
		z.zctx.Term()
		if z.onClose != nil {
			z.onClose()
		}
	})
	return nil
}

func (z *ZMQ) shutdown() {
	z.closeOnce.Do(func() { close(z.closing) })
}
