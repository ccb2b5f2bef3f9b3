package transport

// The ZeroMQ TCP transport works as follows. Each rank binds one ROUTER
// socket, its inbox, on the address it advertises; every peer's messages
// arrive there and one goroutine, the socket's only user, validates each
// frame and files it in the mailbox. For sending, each rank has one DEALER
// socket per peer, connected to that peer's inbox and owned by one goroutine
// fed by a channel: messages to one peer keep their order, and a slow peer
// only backs up its own channel, never the others.
//
// ZeroMQ sockets are not goroutine-safe, hence one owner goroutine per socket
// and a private zmq4.Context per transport, so that closing one communicator
// never touches another's sockets.
//
// Liveness has three sources, fastest first. Close sends a bye frame and
// Abort an abort frame, so peers of an orderly or failed rank learn of it at
// once. A rank that dies without a word (SIGKILL, a crash, OOM) has its TCP
// connections closed by the kernel: a socket monitor on each DEALER reports
// the drop, and a drop not repaired within peerDisconnectGrace fails every
// receive waiting on that peer with ErrRemote ("peer 2 disconnected"). A
// rank that hangs with its connections up (SIGSTOP, a stuck process, a host
// gone without a reset) is caught by heartbeats: an idle sender sends one
// every heartbeatInterval, and a peer not heard from for PeerTimeout is
// declared dead the same way, unless the caller's deadline fires first.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
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
	MaxMessageBytes int64         // largest accepted message (default 1 GiB)
	Diagnostics     Diagnostics   // stall warnings ($OKTOPK_STALL_WARN, default 10 s, to stderr)
	Curve           bool          // CURVE-encrypt and authenticate every connection (also $OKTOPK_CURVE=1); see auth.go
}

const (
	heartbeatInterval = 250 * time.Millisecond
	pollInterval      = 50 * time.Millisecond // how often socket owners look up from a blocking call
	lingerOnClose     = 200 * time.Millisecond
	sendQueueLength   = 64
	reconnectInterval = 100 * time.Millisecond

	// peerDisconnectGrace is how long a dropped connection to a peer may
	// stay down, with nothing heard from the peer, before the peer is
	// declared dead. A drop alone is no proof of death: ZeroMQ reconnects
	// by itself, and a live peer's inbox drops a connection that sent an
	// oversized or malformed message, or a middlebox may reset one. Those
	// reconnect within a reconnect interval or two. A killed process
	// refuses every reconnect, so ten intervals separate the two cases
	// with a wide margin and still detect a death in about a second.
	// (ZeroMQ does not say why a reconnect failed, so a refused one
	// cannot be told from a transient routing failure and taken as
	// proof at once.) It also lets an orderly Close's bye frame, sent
	// just before its sockets close, be the reason peers report.
	peerDisconnectGrace = time.Second
)

// ZMQ is a Transport over ZeroMQ TCP sockets.
type ZMQ struct {
	opts     ZMQOptions
	token    tokenDigest
	zctx     *zmq.Context
	endpoint string
	box      *mailbox

	peers    []*peerSender // index = rank; nil for this rank
	lastSeen []atomic.Int64
	hello    []atomic.Bool
	helloCh  chan struct{} // signalled on every first hello
	watching atomic.Bool   // liveness checks start after Connect

	curve       *curveState     // nil unless CURVE is on
	connections connectionRanks // inbox connection → rank; receive goroutine only

	closing   chan struct{}
	closeOnce sync.Once
	owners    sync.WaitGroup // socket-owner goroutines
	dropped   atomic.Uint64  // frames refused (bad header, other job, ...)

	onClose func() // extra cleanup (a rendezvous server this rank serves)
}

type peerSender struct {
	rank int
	reqs chan sendRequest
}

type sendRequest struct {
	header  []byte
	payload []byte
	done    chan error
}

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
		ifname = os.Getenv("OKTOPK_SOCKET_IFNAME")
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

// ListenZMQ binds this rank's inbox on an ephemeral port and starts
// receiving; it does not connect to peers (see Connect).
func ListenZMQ(opts ZMQOptions) (*ZMQ, error) {
	if opts.Size < 1 || opts.Rank < 0 || opts.Rank >= opts.Size {
		return nil, fmt.Errorf("oktopk: invalid argument: rank %d of %d", opts.Rank, opts.Size)
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
	inbox, err := zctx.NewSocket(zmq.ROUTER)
	if err == nil {
		err = firstErr(
			inbox.SetLinger(0),
			inbox.SetRcvhwm(0),
			inbox.SetMaxmsgsize(opts.MaxMessageBytes+headerSize),
			inbox.SetRcvtimeo(pollInterval),
			curve.serve(zctx, inbox),
		)
	}
	if err == nil {
		err = inbox.Bind("tcp://" + bracketHost(host) + ":*")
	}
	var endpoint string
	if err == nil {
		endpoint, err = inbox.GetLastEndpoint()
	}
	if err != nil {
		if inbox != nil {
			inbox.Close()
		}
		curve.closeZAP()
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
		peers:    make([]*peerSender, opts.Size),
		lastSeen: make([]atomic.Int64, opts.Size),
		hello:    make([]atomic.Bool, opts.Size),
		helloCh:  make(chan struct{}, opts.Size),
		closing:  make(chan struct{}),
	}
	z.box.silence = z.silence
	z.owners.Add(1)
	go z.receiveLoop(inbox)
	if curve != nil {
		z.owners.Add(1)
		go z.zapLoop(curve.zap)
	}
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

// Dropped counts frames refused by validation (another job's token, bad
// header, wrong lengths). Diagnostics and tests use it.
func (z *ZMQ) Dropped() uint64 { return z.dropped.Load() }

// Connect opens one sender per peer (endpoints in rank order, this rank's
// own entry ignored) and waits until every peer has said hello, so that a
// successful Connect means the whole job is reachable.
func (z *ZMQ) Connect(ctx context.Context, endpoints []string) error {
	if len(endpoints) != z.opts.Size {
		return fmt.Errorf("oktopk: invalid argument: %d endpoints for %d ranks", len(endpoints), z.opts.Size)
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
	// monitors[r] reports the TCP connection of the DEALER to rank r; the
	// monitor goroutine takes them over once every peer has its sender.
	monitors := make([]*zmq.Socket, z.opts.Size)
	closeMonitors := func() {
		for _, m := range monitors {
			if m != nil {
				m.Close()
			}
		}
	}
	for r, ep := range addrs {
		if r == z.opts.Rank {
			continue
		}
		if z.peers[r] != nil {
			return fmt.Errorf("oktopk: invalid usage: already connected")
		}
		sock, err := z.zctx.NewSocket(zmq.DEALER)
		if err == nil {
			err = firstErr(
				sock.SetLinger(lingerOnClose),
				sock.SetSndhwm(0),
				sock.SetSndtimeo(pollInterval),
				// A unique identity: ROUTER refuses a second connection under an
				// identity it already knows, which would let a stray process
				// squat a rank's name.
				sock.SetIdentity(fmt.Sprintf("oktopk-rank-%d-%s", z.opts.Rank, NewToken()[:16])),
				sock.SetReconnectIvl(reconnectInterval),
				z.curveClient(sock, serverKeys[r]),
			)
		}
		if err == nil {
			// The monitor must listen before the DEALER connects, or the
			// first events would be lost.
			monitors[r], err = z.monitor(sock, r)
		}
		if err == nil {
			err = sock.Connect(ep)
		}
		if err != nil {
			if sock != nil {
				sock.Close()
			}
			closeMonitors()
			return fmt.Errorf("%w: connecting to rank %d at %q: %w", ErrRendezvous, r, ep, err)
		}
		p := &peerSender{rank: r, reqs: make(chan sendRequest, sendQueueLength)}
		z.peers[r] = p
		z.owners.Add(1)
		go z.sendLoop(p, sock)
	}
	if z.opts.Size > 1 {
		z.owners.Add(1)
		go z.monitorLoop(monitors)
	}
	for r := range z.peers {
		if z.peers[r] != nil {
			if err := z.sendControl(ctx, r, kindHello); err != nil {
				return err
			}
		}
	}
	for {
		missing := []int{}
		for r := range z.hello {
			if r != z.opts.Rank && !z.hello[r].Load() {
				missing = append(missing, r)
			}
		}
		if len(missing) == 0 {
			break
		}
		select {
		case <-z.helloCh:
		case <-ctx.Done():
			return fmt.Errorf("%w: ranks %v never said hello", ContextError(ctx, "connecting"), missing)
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

func (z *ZMQ) closedErr() error {
	if err := z.box.err(); err != nil {
		return err
	}
	return ErrClosed
}

// Send hands payload to peer's sender goroutine and returns once ZeroMQ has
// copied it.
func (z *ZMQ) Send(ctx context.Context, peer int, tag Tag, dtype Dtype, count uint64, payload []byte) error {
	if err := checkPeer(z, peer); err != nil {
		return err
	}
	if err := z.box.err(); err != nil {
		return err
	}
	if z.peers[peer] == nil {
		return fmt.Errorf("oktopk: invalid usage: send before Connect")
	}
	h := frameHeader{kind: kindData, tag: tag, call: z.box.callOf(tag.Seq), dtype: dtype, count: count, payloadLen: uint64(len(payload))}
	return z.enqueue(ctx, peer, &h, payload)
}

// StartCall records the call this rank has begun; its heartbeats carry the
// sequence number to the peers.
func (z *ZMQ) StartCall(op Op, seq uint64, call CallDesc) { z.box.start(op, seq, call) }

func (z *ZMQ) sendControl(ctx context.Context, peer int, kind frameKind) error {
	h := frameHeader{kind: kind, dtype: DtypeBytes}
	return z.enqueue(ctx, peer, &h, nil)
}

func (z *ZMQ) enqueue(ctx context.Context, peer int, h *frameHeader, payload []byte) error {
	// Said only on failure: formatting it on every send cost an allocation.
	what := func() string {
		if h.kind == kindData {
			return fmt.Sprintf("sending %s to peer %d", h.tag, peer)
		}
		return fmt.Sprintf("sending %d to peer %d", h.kind, peer)
	}
	h.token = z.token
	h.generation = z.opts.Generation
	h.sender = uint32(z.opts.Rank)
	req := sendRequest{header: make([]byte, headerSize), payload: payload, done: make(chan error, 1)}
	h.encode(req.header)
	select {
	case z.peers[peer].reqs <- req:
	case <-ctx.Done():
		return ContextError(ctx, what())
	case <-z.closing:
		return z.closedErr()
	}
	select {
	case err := <-req.done:
		return err
	case <-ctx.Done():
		// The sender may still be copying payload; wait for it so the
		// caller can reuse the buffer, bounded by the poll interval.
		<-req.done
		return ContextError(ctx, what())
	}
}

// sendLoop owns one DEALER socket: it sends queued frames in order and a
// heartbeat whenever the queue has been idle for a heartbeat interval.
func (z *ZMQ) sendLoop(p *peerSender, sock *zmq.Socket) {
	// ZeroMQ copies each payload into memory malloc takes from the calling
	// thread's arena. On one thread of its own, each sender reuses its own
	// arena's free memory for the next payload; hopping between the Go
	// runtime's threads it would leave a freed payload-sized block in each
	// thread's arena (measured: dense ring, P = 4, n = 2^24: 2.75 × n × 4 B
	// of retained C memory per rank, instead of about one payload per peer).
	runtime.LockOSThread()
	defer z.owners.Done()
	defer sock.Close()
	// A heartbeat's sequence number is the latest call this rank started.
	hb := frameHeader{kind: kindHeartbeat, token: z.token, generation: z.opts.Generation, sender: uint32(z.opts.Rank)}
	hbFrame := make([]byte, headerSize)
	ticker := time.NewTicker(heartbeatInterval)
	defer ticker.Stop()
	for {
		select {
		case req := <-p.reqs:
			req.done <- z.sendFrame(sock, req.header, req.payload)
		case <-ticker.C:
			hb.tag.Seq = z.box.startedSeq()
			hb.encode(hbFrame)
			z.sendFrame(sock, hbFrame, nil)
		case <-z.closing:
			// Drain what is queued (callers wait on done), then say bye or
			// abort so the peer learns at once.
			for {
				select {
				case req := <-p.reqs:
					req.done <- z.closedErr()
					continue
				default:
				}
				break
			}
			// An abort says why, so that a mismatch is reported as one on
			// every rank and a timeout names the rank that held things up.
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
			sock.SendBytes(lastFrame, zmq.DONTWAIT|zmq.SNDMORE)
			sock.SendBytes(text, zmq.DONTWAIT)
			return
		}
	}
}

// sendFrame sends header and payload as one two-part message, retrying while
// ZeroMQ's queue is full, until the transport closes.
func (z *ZMQ) sendFrame(sock *zmq.Socket, header, payload []byte) error {
	for {
		_, err := sock.SendBytes(header, zmq.SNDMORE)
		if err == nil {
			break
		}
		if !isAgain(err) {
			return fmt.Errorf("%w: send: %w", ErrRemote, err)
		}
		select {
		case <-z.closing:
			return z.closedErr()
		default:
		}
	}
	for {
		// Once the first part is queued the second always fits: ZeroMQ
		// queues multipart messages atomically.
		_, err := sock.SendBytes(payload, 0)
		if err == nil || !isAgain(err) {
			if err != nil {
				return fmt.Errorf("%w: send: %w", ErrRemote, err)
			}
			return nil
		}
	}
}

func isAgain(err error) bool {
	return zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) || zmq.AsErrno(err) == zmq.Errno(syscall.EINTR)
}

// receiveLoop owns the ROUTER inbox: it validates each message, files data
// in the mailbox, records liveness, and fails peers that fell silent.
func (z *ZMQ) receiveLoop(inbox *zmq.Socket) {
	defer z.owners.Done()
	defer inbox.Close()
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		parts, keyRank, err := z.recvInbox(inbox)
		if err == nil {
			z.handle(parts, keyRank)
		}
		z.checkLiveness()
	}
}

// handle validates one inbox message; keyRank is the rank its connection's
// CURVE key belongs to (-1 without CURVE).
func (z *ZMQ) handle(parts [][]byte, keyRank int) {
	// ROUTER prepends the sender's identity; ours are [identity, header, payload].
	if len(parts) != 3 {
		z.dropped.Add(1)
		return
	}
	h, err := decodeFrameHeader(parts[1], z.token, z.opts.Generation, z.opts.Size)
	if err != nil || h.payloadLen != uint64(len(parts[2])) || int(h.sender) == z.opts.Rank {
		z.dropped.Add(1)
		return
	}
	// The sender named in the header must be the rank this connection
	// said hello as (and, with CURVE, the owner of its key): the token
	// alone does not let a process speak for another rank.
	if !z.connections.admit(parts[0], h.kind, int(h.sender), keyRank, z.curve != nil) {
		z.dropped.Add(1)
		return
	}
	peer := int(h.sender)
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
	case kindAbort:
		z.box.peerAborted(peer, h.reason, strings.ToValidUTF8(string(parts[2]), "?"))
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
		}
	}
}

// monitor starts ZeroMQ's socket monitor on the DEALER to peer and returns
// the PAIR socket its events arrive on. Only the monitor goroutine may use
// that socket afterwards; the DEALER stays its sender's alone.
func (z *ZMQ) monitor(dealer *zmq.Socket, peer int) (*zmq.Socket, error) {
	addr := fmt.Sprintf("inproc://oktopk-monitor-peer-%d", peer) // the context is private
	if err := dealer.Monitor(addr, zmq.EVENT_DISCONNECTED|zmq.EVENT_HANDSHAKE_SUCCEEDED); err != nil {
		return nil, fmt.Errorf("monitoring the connection: %w", err)
	}
	m, err := z.zctx.NewSocket(zmq.PAIR)
	if err == nil {
		err = m.SetLinger(0)
	}
	if err == nil {
		err = m.Connect(addr)
	}
	if err != nil {
		if m != nil {
			m.Close()
		}
		return nil, fmt.Errorf("monitoring the connection: %w", err)
	}
	return m, nil
}

// monitorLoop owns the monitor sockets (monitors[r] for the DEALER to rank
// r; nil for this rank): it notes when the connection to a peer drops and
// when a handshake brings it back, and declares a peer dead once a drop has
// lasted peerDisconnectGrace with nothing heard from it. It never touches a
// data socket.
func (z *ZMQ) monitorLoop(monitors []*zmq.Socket) {
	defer z.owners.Done()
	poller := zmq.NewPoller()
	rankOf := map[*zmq.Socket]int{}
	for r, m := range monitors {
		if m != nil {
			defer m.Close()
			poller.Add(m, zmq.POLLIN)
			rankOf[m] = r
		}
	}
	down := make([]time.Time, len(monitors)) // when each peer's connection dropped; zero while up
	declared := make([]bool, len(monitors))
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		polled, err := poller.Poll(pollInterval)
		if err != nil {
			time.Sleep(pollInterval)
		}
		for _, p := range polled {
			r := rankOf[p.Socket]
			for {
				event, _, _, err := p.Socket.RecvEvent(zmq.DONTWAIT)
				if err != nil {
					break
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
			}
		}
	}
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
// ZeroMQ context; it returns within about the linger bound.
func (z *ZMQ) Close() error {
	z.box.fail(ErrClosed)
	z.shutdown()
	z.owners.Wait()
	z.zctx.Term()
	if z.onClose != nil {
		z.onClose()
	}
	return nil
}

func (z *ZMQ) shutdown() {
	z.closeOnce.Do(func() { close(z.closing) })
}
