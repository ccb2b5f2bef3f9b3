package zmq

// Tests of who may talk to a rank: a token holder cannot pose as another
// rank, connections bind to a rank at their first hello, and CURVE refuses
// clients without a job key.

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
	"github.com/pebbe/zmq4"
)

// rawDealer is a hand-driven client of a rank's outbox (the port it
// advertises): it speaks the wire format directly, so it can claim any
// sender rank.
type rawDealer struct {
	t     *testing.T
	zctx  *zmq4.Context
	sock  *zmq4.Socket
	token transport.TokenDigest
}

// dialOutbox connects a raw DEALER to endpoint, as a PLAIN client holding
// token's password or, when curveKeys are given, as a CURVE client with
// (server public key, own public key, own secret key).
func dialOutbox(t *testing.T, endpoint, token string, curveKeys ...string) *rawDealer {
	t.Helper()
	zctx, err := zmq4.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	sock, err := zctx.NewSocket(zmq4.DEALER)
	if err != nil {
		t.Fatal(err)
	}
	sock.SetLinger(0)
	sock.SetSndtimeo(time.Second)
	if len(curveKeys) == 3 {
		if err := sock.ClientAuthCurve(curveKeys[0], curveKeys[1], curveKeys[2]); err != nil {
			t.Fatal(err)
		}
	} else if err := sock.ClientAuthPlain(plainUser, plainPassword(token)); err != nil {
		t.Fatal(err)
	}
	addr, _, err := splitEndpoint(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	if err := sock.Connect(addr); err != nil {
		t.Fatal(err)
	}
	d := &rawDealer{t: t, zctx: zctx, sock: sock, token: transport.DigestToken(token)}
	t.Cleanup(func() { sock.Close(); zctx.Term() })
	return d
}

// send queues one well-formed frame that claims to come from sender.
func (d *rawDealer) send(kind transport.FrameKind, sender int, tag transport.Tag, payload []byte) {
	h := transport.FrameHeader{Kind: kind, Token: d.token, Sender: uint32(sender), Tag: tag,
		Dtype: transport.DtypeBytes, Count: uint64(len(payload)), PayloadLen: uint64(len(payload))}
	b := make([]byte, transport.HeaderSize)
	h.Encode(b)
	// Over CURVE the handshake may still be running (or be refused): the
	// frames then wait in the DEALER's queue, which is what a stranger's
	// frames would do.
	if _, err := d.sock.SendMessage(b, payload); err != nil {
		d.t.Fatalf("raw send: %v", err)
	}
}

// recvNothing asserts that no message of tag from peer arrives for a while.
func recvNothing(t *testing.T, z *Transport, peer int, tag transport.Tag) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if m, err := z.Recv(ctx, peer, tag); err == nil {
		t.Fatalf("rank %d accepted a forged message from \"rank %d\": %q", z.Rank(), peer, m.Payload)
	} else if !errors.Is(err, transport.ErrTimeout) {
		t.Fatalf("want a timeout, got %v", err)
	}
}

// recvReal asserts that the real peer's message of tag still arrives intact.
func recvReal(t *testing.T, zs []*Transport, from, to int, tag transport.Tag) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	go zs[from].Send(ctx, to, tag, transport.DtypeBytes, 4, []byte("real"))
	m, err := zs[to].Recv(ctx, from, tag)
	if err != nil || string(m.Payload) != "real" {
		t.Fatalf("got %q, %v; want the real rank %d's message", m.Payload, err, from)
	}
}

func TestZMQTokenHolderCannotImpersonateAnotherRank(t *testing.T) {
	zs := startZMQ(t, 3, nil)
	victim := zs[1]
	before := victim.Dropped()
	// A process that knows the job token connects to rank 1's outbox, says
	// hello as rank 0 (already bound to rank 0's own inbox) and sends data
	// as rank 0 and as rank 2 (the outbox takes hellos only).
	intruder := dialOutbox(t, victim.Endpoint(), victim.opts.Token)
	forged := transport.Tag{Op: transport.OpAllgather, Seq: 7, Step: 0}
	intruder.send(transport.FrameHello, 0, transport.Tag{}, nil)
	intruder.send(transport.FrameData, 0, forged, []byte("forged"))
	intruder.send(transport.FrameData, 2, forged, []byte("forged"))
	deadline := time.Now().Add(5 * time.Second)
	for victim.Dropped()-before < 3 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := victim.Dropped() - before; got < 3 {
		t.Fatalf("%d of the intruder's 3 frames were dropped", got)
	}
	// The real ranks' messages under the same tag are the ones delivered,
	// and rank 1's messages for rank 0 go to rank 0 alone.
	recvReal(t, zs, 0, 1, forged)
	recvReal(t, zs, 2, 1, forged)
	recvNothing(t, victim, 0, forged)
	recvReal(t, zs, 1, 0, forged)
	intruder.sock.SetRcvtimeo(300 * time.Millisecond)
	if parts, err := intruder.sock.RecvMessageBytes(0); err == nil {
		t.Fatalf("the intruder received %d parts meant for rank 0", len(parts))
	}
}

func TestConnectionRanksBindAtFirstHello(t *testing.T) {
	var b connectionRanks
	a, c := []byte("conn-a"), []byte("conn-c")
	steps := []struct {
		conn   []byte
		kind   transport.FrameKind
		sender int
		want   bool
	}{
		{a, transport.FrameData, 0, false},      // data before any hello
		{a, transport.FrameHeartbeat, 0, false}, // so is a heartbeat
		{a, transport.FrameHello, 0, true},      // binds conn-a to rank 0
		{a, transport.FrameData, 0, true},
		{a, transport.FrameHello, 0, true}, // a repeated hello changes nothing
		{a, transport.FrameData, 1, false}, // conn-a claims rank 1
		{a, transport.FrameHello, 1, false},
		{c, transport.FrameHello, 0, false}, // rank 0 is taken by conn-a
		{c, transport.FrameData, 0, false},
		{c, transport.FrameHello, 1, true},
		{c, transport.FrameBye, 1, true},
	}
	for i, s := range steps {
		if got := b.admit(s.conn, s.kind, s.sender, -1, false); got != s.want {
			t.Fatalf("step %d (%s, kind %d, sender %d): admit %v, want %v", i, s.conn, s.kind, s.sender, got, s.want)
		}
	}
	// With CURVE the connection's key decides, whatever the hello says.
	var k connectionRanks
	if k.admit(a, transport.FrameHello, 0, 2, true) || !k.admit(a, transport.FrameHello, 2, 2, true) || k.admit(a, transport.FrameData, 0, 2, true) {
		t.Fatal("CURVE: a frame was admitted under a rank other than its key's")
	}
}

func skipWithoutCurve(t *testing.T) {
	if !zmq4.HasCurve() {
		t.Skip("libzmq here was built without CURVE (no libsodium/tweetnacl): CURVE tests skipped")
	}
}

func TestZMQCurveRefusesClientsWithoutAJobKey(t *testing.T) {
	skipWithoutCurve(t)
	zs := startZMQ(t, 2, func(o *Options) { o.Curve = true })
	victim := zs[1]
	addr, serverKey, err := splitEndpoint(victim.Endpoint())
	if err != nil || serverKey == "" || !strings.HasPrefix(addr, "tcp://") {
		t.Fatalf("endpoint %q: want tcp://host:port#curve=<key> (%v)", victim.Endpoint(), err)
	}
	token := victim.opts.Token
	forged := transport.Tag{Op: transport.OpAllgather, Seq: 9, Step: 0}
	// Knows the token, speaks plain ZMTP: the handshake fails.
	plain := dialOutbox(t, victim.Endpoint(), token)
	plain.send(transport.FrameHello, 0, transport.Tag{}, nil)
	plain.send(transport.FrameData, 0, forged, []byte("plain"))
	// Knows the token and the server's public key, but its own key is not
	// one of the job's: the ZAP handler refuses it.
	public, secret, err := zmq4.NewCurveKeypair()
	if err != nil {
		t.Fatal(err)
	}
	stranger := dialOutbox(t, victim.Endpoint(), token, serverKey, public, secret)
	stranger.send(transport.FrameHello, 0, transport.Tag{}, nil)
	stranger.send(transport.FrameData, 0, forged, []byte("stranger"))
	deadline := time.Now().Add(5 * time.Second)
	for victim.curve.refused.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if victim.curve.refused.Load() == 0 {
		t.Fatal("the ZAP handler never refused the stranger's key")
	}
	recvNothing(t, victim, 0, forged)
	recvReal(t, zs, 0, 1, transport.Tag{Op: transport.OpAllgather, Seq: 10, Step: 0})
}

func TestZMQCurveFromEnvironment(t *testing.T) {
	skipWithoutCurve(t)
	t.Setenv("OKTOPK_CURVE", "1")
	zs := startZMQ(t, 2, nil)
	for _, z := range zs {
		if !strings.Contains(z.Endpoint(), curveEndpointMark) {
			t.Fatalf("OKTOPK_CURVE=1 but endpoint %q carries no key", z.Endpoint())
		}
	}
	recvReal(t, zs, 1, 0, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
}

func TestZMQCurveOnSomeRanksOnlyIsAClearError(t *testing.T) {
	skipWithoutCurve(t)
	token := transport.NewToken()
	secure, err := Listen(Options{Rank: 0, Size: 2, Token: token, Curve: true})
	if err != nil {
		t.Fatal(err)
	}
	defer secure.Close()
	plain, err := Listen(Options{Rank: 1, Size: 2, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	eps := []string{secure.Endpoint(), plain.Endpoint()}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	for _, z := range []*Transport{secure, plain} {
		// An invalid argument (a setting that differs across ranks), which the
		// C ABI reports as oktopkInvalidArgument, not as a system error.
		if err := z.Connect(ctx, eps); !errors.Is(err, transport.ErrInvalidArgument) || !strings.Contains(err.Error(), "CURVE") {
			t.Fatalf("rank %d: want ErrInvalidArgument naming CURVE, got %v", z.Rank(), err)
		}
	}
}
