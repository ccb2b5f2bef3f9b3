package zmq

// Who may talk to a rank (doc.go has the topology: each rank binds an
// outbox, and every peer's inbox dials it; data flows outbox → inbox):
//
//   - Nobody can connect to an inbox: it only dials the addresses the
//     rendezvous gave. What arrives on its connection to rank r comes from
//     whoever listens at rank r's address (with CURVE: from the holder of
//     rank r's secret key), and every frame on it must name rank r as its
//     sender. Only there are large frames accepted.
//   - At the outbox, a connection must pass its ZeroMQ handshake before it
//     may send a single frame: without CURVE the outbox is a PLAIN server
//     and each inbox a PLAIN client whose password is derived from the job
//     token (plainPassword); with CURVE, the job's keys (below). A ZAP
//     handler in the transport's private context checks either. ZeroMQ's
//     NULL mechanism would have let anyone queue an endless multi-part
//     message, which no high-water mark bounds. Like the token digest in
//     frames, the PLAIN password travels in clear: it keeps out strangers,
//     not someone who watches the network (that takes CURVE).
//   - Every frame carries the job token's digest (package transport's
//     frame.go). The outbox takes hello frames only; it records, at the
//     first hello on each connection (ROUTER routing id), which rank's
//     inbox it is, and sends that rank's messages there. A hello for a rank already bound to
//     another connection is dropped, so a process holding the token cannot
//     take over a rank's messages once that rank has said hello.
//   - With CURVE (Options.Curve or OKTOPK_CURVE=1): each rank draws a
//     keypair when it binds and advertises its public key inside its endpoint
//     string ("tcp://host:port#curve=<64 hex>"), which travels through the
//     same rendezvous as the endpoint. The outbox is a CURVE server; the
//     inbox is a CURVE client of each peer's outbox, with that peer's key as
//     server key and the rank's own keypair as client key. Everything after
//     the handshake, headers and payloads alike, is encrypted. The ZAP
//     handler admits only the job's public keys and names each connection
//     by its key's rank (the User-Id property), and a hello's sender must
//     equal that rank: only the holder of rank r's secret key can receive
//     as rank r.
//
// pebbe/zmq4's AuthStart runs one ZAP handler for the process-wide default
// context, which the transport does not use (ZAP is per context); hence a
// small handler of our own, one per transport.

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/oktopk/oktopk/transport"
	"github.com/pebbe/zmq4"
)

// ErrCurveUnavailable: CURVE was asked for but libzmq was built without it.
var ErrCurveUnavailable = errors.New("oktopk: CURVE encryption requested but libzmq was built without CURVE support (needs libsodium or tweetnacl)")

const (
	curveEndpointMark = "#curve="
	zapEndpoint       = "inproc://zeromq.zap.01" // fixed by RFC 27
	zapDomain         = "oktopk"
)

// CurveAvailable reports whether the linked libzmq supports CURVE.
func CurveAvailable() bool { return zmq4.HasCurve() }

// CurveFromEnv reports whether OKTOPK_CURVE asks for CURVE encryption.
func CurveFromEnv() bool {
	switch strings.ToLower(transport.Getenv("OKTOPK_CURVE")) {
	case "1", "true", "yes", "on":
		return true
	}
	return false
}

// curveState is one rank's CURVE keypair and the job's public keys.
type curveState struct {
	public, secret string // Z85

	mu      sync.Mutex
	rankOf  map[string]int // binary public key → rank, set by Connect
	ready   chan struct{}  // closed once rankOf is set
	refused atomic.Uint64  // handshakes the ZAP handler denied
}

// newCurveState draws a keypair when CURVE is on (opts or environment) and
// returns nil when it is off.
func newCurveState(opts *Options) (*curveState, error) {
	if !opts.Curve && !CurveFromEnv() {
		return nil, nil
	}
	opts.Curve = true
	if !zmq4.HasCurve() {
		return nil, ErrCurveUnavailable
	}
	public, secret, err := zmq4.NewCurveKeypair()
	if err != nil {
		return nil, fmt.Errorf("%w: CURVE keypair: %w", transport.ErrRendezvous, err)
	}
	return &curveState{public: public, secret: secret, ready: make(chan struct{})}, nil
}

// plainUser and plainPassword are the PLAIN credentials of a job's inboxes:
// the password is a digest of the job token, domain-separated from the
// digest frames carry, so neither can be computed from the other.
const plainUser = "oktopk"

func plainPassword(token string) string {
	sum := sha256.Sum256([]byte("oktopk plain password\x00" + token))
	return hex.EncodeToString(sum[:16])
}

// serveAuth binds the ZAP handler's socket in zctx and makes outbox a PLAIN
// server, or a CURVE server when curve is set. Both must happen before the
// outbox binds, or early handshakes would skip authentication.
func serveAuth(zctx *zmq4.Context, outbox *zmq4.Socket, curve *curveState) (*zmq4.Socket, error) {
	zap, err := zctx.NewSocket(zmq4.REP)
	if err != nil {
		return nil, err
	}
	if err := firstErr(zap.SetLinger(0), zap.SetRcvtimeo(pollInterval), zap.Bind(zapEndpoint)); err != nil {
		zap.Close()
		return nil, fmt.Errorf("ZAP handler: %w", err)
	}
	if curve != nil {
		err = outbox.ServerAuthCurve(zapDomain, curve.secret)
	} else {
		err = outbox.ServerAuthPlain(zapDomain)
	}
	if err != nil {
		zap.Close()
		return nil, err
	}
	return zap, nil
}

// endpoint appends this rank's public key to its ZeroMQ address.
func (c *curveState) endpoint(addr string) string {
	if c == nil {
		return addr
	}
	return addr + curveEndpointMark + hex.EncodeToString([]byte(zmq4.Z85decode(c.public)))
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
		return "", "", fmt.Errorf("%w: malformed CURVE key in endpoint %q", transport.ErrRendezvous, ep)
	}
	return addr, zmq4.Z85encode(string(key)), nil
}

// learnPeers reads the job's endpoints: the ZeroMQ address of each rank and,
// with CURVE, its public key, which from now on the ZAP handler admits. Every
// rank must agree on CURVE: a mixed job fails here with a clear error rather
// than in handshakes that never complete.
func (z *Transport) learnPeers(endpoints []string) (addrs, serverKeys []string, err error) {
	addrs = make([]string, len(endpoints))
	serverKeys = make([]string, len(endpoints))
	for r, ep := range endpoints {
		if addrs[r], serverKeys[r], err = splitEndpoint(ep); err != nil {
			return nil, nil, err
		}
		switch {
		case r == z.opts.Rank:
		case z.curve != nil && serverKeys[r] == "":
			return nil, nil, fmt.Errorf("%w: this rank uses CURVE but rank %d's endpoint %q carries no key (set OKTOPK_CURVE or the config's curve on every rank)", transport.ErrInvalidArgument, r, ep)
		case z.curve == nil && serverKeys[r] != "":
			return nil, nil, fmt.Errorf("%w: rank %d uses CURVE but this rank does not (set OKTOPK_CURVE or the config's curve on every rank)", transport.ErrInvalidArgument, r)
		}
	}
	if c := z.curve; c != nil {
		rankOf := make(map[string]int, len(endpoints))
		for r, key := range serverKeys {
			if r == z.opts.Rank {
				key = c.public
			}
			rankOf[zmq4.Z85decode(key)] = r
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

// secureClient makes the inbox a PLAIN client with the job's password or,
// with CURVE, a CURVE client of the peer whose key is serverKey (for the
// connection made next), authenticating with this rank's own keypair.
func (z *Transport) secureClient(sock *zmq4.Socket, serverKey string) error {
	if z.curve == nil {
		return sock.ClientAuthPlain(plainUser, plainPassword(z.opts.Token))
	}
	return sock.ClientAuthCurve(serverKey, z.curve.public, z.curve.secret)
}

// zapLoop answers ZeroMQ's authentication requests (RFC 27) for the outbox.
// Without CURVE: a PLAIN client with the job's password is admitted, any
// other is refused. With CURVE: a client key of one of the job's ranks is
// admitted under that rank's number as User-Id; any other key is refused.
// CURVE requests that arrive before Connect has learnt the job's keys wait
// for them (the handshake waits with them, up to handshakeLimit), so a
// fast peer is not refused for being early.
func (z *Transport) zapLoop(zap *zmq4.Socket) {
	defer z.owners.Done()
	defer zap.Close()
	password := []byte(plainPassword(z.opts.Token))
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
		switch {
		case c == nil && mechanism == "PLAIN" && len(req) == 8:
			if subtle.ConstantTimeCompare(req[7], password) == 1 {
				status, text = "200", "OK"
			}
		case c != nil && mechanism == "CURVE" && len(req) == 7:
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
			if status != "200" {
				c.refused.Add(1)
			}
		}
		zap.SendMessage(version, id, status, text, user, "")
	}
}

// recvOutbox receives one message from the outbox without waiting, and,
// with CURVE, the rank its connection authenticated as (-1 without CURVE,
// or when unknown).
func (z *Transport) recvOutbox(outbox *zmq4.Socket) ([][]byte, int, error) {
	if z.curve == nil {
		parts, err := outbox.RecvMessageBytes(zmq4.DONTWAIT)
		return parts, -1, err
	}
	parts, meta, err := outbox.RecvMessageBytesWithMetadata(zmq4.DONTWAIT, "User-Id")
	if err != nil {
		return parts, -1, err
	}
	r, err := strconv.Atoi(meta["User-Id"])
	if err != nil {
		return parts, -1, nil
	}
	return parts, r, nil
}

// connectionRanks ties each outbox connection to the rank that said hello
// on it. Only the outbox's owner goroutine uses it.
type connectionRanks struct {
	rankOf map[string]int // ROUTER routing id → rank
	bound  map[int]string // rank → routing id
}

// admit reports whether a frame of kind, claiming sender, may be trusted on
// the connection routingID whose CURVE key belongs to keyRank (-1 without
// CURVE). The first hello on a connection binds it to its sender; a hello
// for a rank already bound to another connection, or any frame claiming a
// rank other than its connection's, is refused.
func (b *connectionRanks) admit(routingID []byte, kind transport.FrameKind, sender, keyRank int, curve bool) bool {
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
	if kind != transport.FrameHello {
		return false
	}
	if _, taken := b.bound[sender]; taken {
		return false
	}
	b.rankOf[id], b.bound[sender] = sender, id
	return true
}
