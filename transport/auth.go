package transport

// Who may put a frame in a rank's inbox, in two layers:
//
//   - Always: every frame carries the job token's digest (frame.go), and the
//     sender rank in a frame must be the rank that said hello on the same
//     ZeroMQ connection. The inbox records, at the first hello on each
//     connection (ROUTER routing id), which rank it speaks for; a frame that
//     claims another rank, or that comes before any hello, is dropped. So a
//     process holding the token still cannot pass its frames off as another
//     rank's once that rank has said hello.
//   - With CURVE (ZMQOptions.Curve or OKTOPK_CURVE=1): each rank draws a
//     keypair when it binds and advertises its public key inside its endpoint
//     string ("tcp://host:port#curve=<64 hex>"), which travels through the
//     same rendezvous as the endpoint. The inbox is a CURVE server; each
//     DEALER is a CURVE client with the peer's key as server key and the
//     rank's own keypair as client key. Everything after the handshake,
//     headers and payloads alike, is encrypted. A ZAP handler in the
//     transport's private context admits only the job's public keys and
//     names each connection by its key's rank (the User-Id property), and
//     every frame's sender must equal that rank: only the holder of rank r's
//     secret key can speak as rank r.
//
// pebbe/zmq4's AuthStart runs one ZAP handler for the process-wide default
// context, which the transport does not use (ZAP is per context); hence a
// small handler of our own, one per transport.

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	zmq "github.com/pebbe/zmq4"
)

// ErrCurveUnavailable: CURVE was asked for but libzmq was built without it.
var ErrCurveUnavailable = errors.New("oktopk: CURVE encryption requested but libzmq was built without CURVE support (needs libsodium or tweetnacl)")

const (
	curveEndpointMark = "#curve="
	zapEndpoint       = "inproc://zeromq.zap.01" // fixed by RFC 27
	zapDomain         = "oktopk"
)

// CurveAvailable reports whether the linked libzmq supports CURVE.
func CurveAvailable() bool { return zmq.HasCurve() }

// CurveFromEnv reports whether OKTOPK_CURVE asks for CURVE encryption.
func CurveFromEnv() bool {
	switch strings.ToLower(Getenv("OKTOPK_CURVE")) {
	case "1", "true", "yes", "on":
		return true
	}
	return false
}

// curveState is one rank's CURVE keypair and the job's public keys.
type curveState struct {
	public, secret string // Z85
	zap            *zmq.Socket

	mu      sync.Mutex
	rankOf  map[string]int // binary public key → rank, set by Connect
	ready   chan struct{}  // closed once rankOf is set
	refused atomic.Uint64  // handshakes the ZAP handler denied
}

// newCurveState draws a keypair when CURVE is on (opts or environment) and
// returns nil when it is off.
func newCurveState(opts *ZMQOptions) (*curveState, error) {
	if !opts.Curve && !CurveFromEnv() {
		return nil, nil
	}
	opts.Curve = true
	if !zmq.HasCurve() {
		return nil, ErrCurveUnavailable
	}
	public, secret, err := zmq.NewCurveKeypair()
	if err != nil {
		return nil, fmt.Errorf("%w: CURVE keypair: %w", ErrRendezvous, err)
	}
	return &curveState{public: public, secret: secret, ready: make(chan struct{})}, nil
}

// serve makes inbox a CURVE server and binds the ZAP handler's socket in
// zctx; both must happen before inbox binds, or early handshakes would skip
// authentication.
func (c *curveState) serve(zctx *zmq.Context, inbox *zmq.Socket) error {
	if c == nil {
		return nil
	}
	zap, err := zctx.NewSocket(zmq.REP)
	if err != nil {
		return err
	}
	if err := firstErr(zap.SetLinger(0), zap.SetRcvtimeo(pollInterval), zap.Bind(zapEndpoint)); err != nil {
		zap.Close()
		return fmt.Errorf("ZAP handler: %w", err)
	}
	c.zap = zap
	return inbox.ServerAuthCurve(zapDomain, c.secret)
}

// closeZAP releases the ZAP socket on a failed ListenZMQ (the context cannot
// terminate while it is open).
func (c *curveState) closeZAP() {
	if c != nil && c.zap != nil {
		c.zap.Close()
		c.zap = nil
	}
}

// endpoint appends this rank's public key to its ZeroMQ address.
func (c *curveState) endpoint(addr string) string {
	if c == nil {
		return addr
	}
	return addr + curveEndpointMark + hex.EncodeToString([]byte(zmq.Z85decode(c.public)))
}

// splitEndpoint separates an advertised endpoint into the ZeroMQ address and
// the Z85 public key it carries ("" when none).
func splitEndpoint(ep string) (addr, publicKey string, err error) {
	addr, keyHex, ok := strings.Cut(ep, curveEndpointMark)
	if !ok {
		return ep, "", nil
	}
	key, err := hex.DecodeString(keyHex)
	if err != nil || len(key) != 32 {
		return "", "", fmt.Errorf("%w: malformed CURVE key in endpoint %q", ErrRendezvous, ep)
	}
	return addr, zmq.Z85encode(string(key)), nil
}

// learnPeers reads the job's endpoints: the ZeroMQ address of each rank and,
// with CURVE, its public key, which from now on the ZAP handler admits. Every
// rank must agree on CURVE: a mixed job fails here with a clear error rather
// than in handshakes that never complete.
func (z *ZMQ) learnPeers(endpoints []string) (addrs, serverKeys []string, err error) {
	addrs = make([]string, len(endpoints))
	serverKeys = make([]string, len(endpoints))
	for r, ep := range endpoints {
		if addrs[r], serverKeys[r], err = splitEndpoint(ep); err != nil {
			return nil, nil, err
		}
		switch {
		case r == z.opts.Rank:
		case z.curve != nil && serverKeys[r] == "":
			return nil, nil, fmt.Errorf("oktopk: invalid argument: this rank uses CURVE but rank %d's endpoint %q carries no key (set OKTOPK_CURVE or the config's curve on every rank)", r, ep)
		case z.curve == nil && serverKeys[r] != "":
			return nil, nil, fmt.Errorf("oktopk: invalid argument: rank %d uses CURVE but this rank does not (set OKTOPK_CURVE or the config's curve on every rank)", r)
		}
	}
	if c := z.curve; c != nil {
		rankOf := make(map[string]int, len(endpoints))
		for r, key := range serverKeys {
			if r == z.opts.Rank {
				key = c.public
			}
			rankOf[zmq.Z85decode(key)] = r
		}
		c.mu.Lock()
		if c.rankOf == nil {
			c.rankOf = rankOf
			close(c.ready)
		}
		c.mu.Unlock()
	}
	return addrs, serverKeys, nil
}

// curveClient makes a DEALER a CURVE client of the peer whose key is
// serverKey, authenticating with this rank's own keypair.
func (z *ZMQ) curveClient(sock *zmq.Socket, serverKey string) error {
	if z.curve == nil {
		return nil
	}
	return sock.ClientAuthCurve(serverKey, z.curve.public, z.curve.secret)
}

// zapLoop answers ZeroMQ's authentication requests (RFC 27) for the inbox:
// a client key of one of the job's ranks is admitted under that rank's
// number as User-Id; any other key is refused. Requests that arrive before
// Connect has learnt the job's keys wait for them (the handshake waits with
// them), so a fast peer is not refused for being early.
func (z *ZMQ) zapLoop(zap *zmq.Socket) {
	defer z.owners.Done()
	defer zap.Close()
	c := z.curve
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		req, err := zap.RecvMessageBytes(0)
		if err != nil {
			continue
		}
		if len(req) < 6 {
			// Not a ZAP request we can parse; REP still owes a reply.
			zap.SendMessage("1.0", "", "500", "malformed request", "", "")
			continue
		}
		version, id, mechanism := req[0], req[1], string(req[5])
		status, text, user := "400", "not a rank of this job", ""
		if mechanism == "CURVE" && len(req) == 7 {
			select {
			case <-c.ready:
			case <-z.closing:
				return
			}
			c.mu.Lock()
			r, ok := c.rankOf[string(req[6])]
			c.mu.Unlock()
			if ok && r != z.opts.Rank {
				status, text, user = "200", "OK", strconv.Itoa(r)
			}
		}
		if status != "200" {
			c.refused.Add(1)
		}
		zap.SendMessage(version, id, status, text, user, "")
	}
}

// recvInbox receives one message from the inbox and, with CURVE, the rank
// its connection authenticated as (-1 without CURVE, or when unknown).
func (z *ZMQ) recvInbox(inbox *zmq.Socket) ([][]byte, int, error) {
	if z.curve == nil {
		parts, err := inbox.RecvMessageBytes(0)
		return parts, -1, err
	}
	parts, meta, err := inbox.RecvMessageBytesWithMetadata(0, "User-Id")
	if err != nil {
		return parts, -1, err
	}
	r, err := strconv.Atoi(meta["User-Id"])
	if err != nil {
		return parts, -1, nil
	}
	return parts, r, nil
}

// connectionRanks ties each inbox connection to the rank that said hello on
// it. Only the inbox's owner goroutine uses it.
type connectionRanks struct {
	rankOf map[string]int // ROUTER routing id → rank
	bound  map[int]string // rank → routing id
}

// admit reports whether a frame of kind, claiming sender, may be trusted on
// the connection routingID whose CURVE key belongs to keyRank (-1 without
// CURVE). The first hello on a connection binds it to its sender; a hello
// for a rank already bound to another connection, or any frame claiming a
// rank other than its connection's, is refused.
func (b *connectionRanks) admit(routingID []byte, kind frameKind, sender, keyRank int, curve bool) bool {
	if curve && keyRank != sender {
		return false
	}
	if b.rankOf == nil {
		b.rankOf, b.bound = make(map[string]int), make(map[int]string)
	}
	id := string(routingID)
	if r, ok := b.rankOf[id]; ok {
		return r == sender
	}
	if kind != kindHello {
		return false
	}
	if _, taken := b.bound[sender]; taken {
		return false
	}
	b.rankOf[id], b.bound[sender] = sender, id
	return true
}
