package zmq

// Fuzz tests of a rank's inbox, checked against a model of its admission
// rules, and of splitEndpoint on endpoints read from the rendezvous store.

import (
	"bytes"
	"encoding/hex"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

// fuzzInbox is a transport's receiving side without sockets: what handle
// needs to validate and file inbox messages, for rank 0 of 4.
func fuzzInbox() *Transport {
	const size = 4
	return &Transport{
		opts:     Options{Rank: 0, Size: size},
		token:    transport.DigestToken("tok"),
		box:      transport.NewMailbox(0, size, transport.Diagnostics{StallWarn: -1, Log: func(string) {}}),
		lastSeen: make([]atomic.Int64, size),
		hello:    make([]atomic.Bool, size),
		helloCh:  make(chan struct{}, size),
		closing:  make(chan struct{}),
	}
}

// inboxMessages cuts fuzz bytes into inbox messages: each is a part count
// (low two bits, plus one) and parts of a length byte and that many bytes;
// the first part is the connection's routing id, as ROUTER delivers it.
func inboxMessages(b []byte) [][][]byte {
	var msgs [][][]byte
	for len(b) > 0 {
		n := int(b[0]&3) + 1
		b = b[1:]
		var parts [][]byte
		for i := 0; i < n && len(b) > 0; i++ {
			l := min(int(b[0]), len(b)-1)
			parts = append(parts, b[1:1+l])
			b = b[1+l:]
		}
		msgs = append(msgs, parts)
	}
	return msgs
}

func encodeInbox(msgs ...[][]byte) []byte {
	var out []byte
	for _, parts := range msgs {
		out = append(out, byte(len(parts)-1))
		for _, p := range parts {
			out = append(out, byte(len(p)))
			out = append(out, p...)
		}
	}
	return out
}

func fuzzFrame(kind transport.FrameKind, sender uint32, token string, payload []byte) [][]byte {
	h := transport.FrameHeader{Kind: kind, Token: transport.DigestToken(token), Sender: sender, Tag: transport.Tag{Op: transport.OpOkTopk, Seq: 1, Step: 0},
		Dtype: transport.DtypeBytes, Count: uint64(len(payload)), PayloadLen: uint64(len(payload))}
	b := make([]byte, transport.HeaderSize)
	h.Encode(b)
	return [][]byte{b, payload}
}

func withID(id string, frame [][]byte) [][]byte { return append([][]byte{[]byte(id)}, frame...) }

// FuzzInboxMessage: a rank's inbox. Any sequence of messages is handled
// without a panic and exactly as the rules say (inbox.go's handle): the inbox
// dials each peer's outbox itself under the routing id peerRoutingID(r), so
// a message is admitted only with three parts, a valid header of this job,
// a payload of the declared length, and a sender that is another rank and
// the very rank whose connection it came on. The model below is written from
// those rules, apart from the code: every rank that said hello must be marked
// so and no other, every admitted data frame must be filed and nothing else,
// and every other message counted as dropped.
func FuzzInboxMessage(f *testing.F) {
	f.Add(encodeInbox(
		withID("rank-1", fuzzFrame(transport.FrameHello, 1, "tok", nil)),
		withID("rank-1", fuzzFrame(transport.FrameData, 1, "tok", []byte("data"))),
		withID("rank-2", fuzzFrame(transport.FrameData, 1, "tok", []byte("spoof"))),
		withID("rank-3", fuzzFrame(transport.FrameHello, 3, "other", nil)),
		withID("x", fuzzFrame(transport.FrameData, 3, "tok", []byte("stranger"))),
		withID("rank-1", fuzzFrame(transport.FrameHeartbeat, 1, "tok", nil)),
		withID("rank-1", fuzzFrame(transport.FrameAbort, 1, "tok", []byte("reason"))),
		withID("rank-2", fuzzFrame(transport.FrameBye, 2, "tok", nil)),
	))
	f.Add(encodeInbox(withID("rank-0", fuzzFrame(transport.FrameHello, 0, "tok", nil)), [][]byte{[]byte("y"), {}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		z := fuzzInbox()
		said := map[int]bool{}
		admittedData := map[int]int{}
		dropped := 0
		for _, parts := range inboxMessages(b) {
			z.handle(parts)
			admit := false
			var h transport.FrameHeader
			if len(parts) == 3 {
				var err error
				h, err = transport.DecodeFrameHeader(parts[1], z.token, 0, 4)
				sender := int(h.Sender)
				if err == nil && h.PayloadLen == uint64(len(parts[2])) && sender != 0 &&
					string(parts[0]) == "rank-"+strconv.Itoa(sender) {
					admit = true
					if h.Kind == transport.FrameHello {
						said[sender] = true
					}
				}
			}
			switch {
			case !admit:
				dropped++
			case h.Kind == transport.FrameData:
				admittedData[int(h.Sender)]++
			}
		}
		for r := range z.hello {
			if z.hello[r].Load() != said[r] {
				t.Fatalf("rank %d marked as having said hello: %v, want %v", r, z.hello[r].Load(), said[r])
			}
		}
		filed := z.box.Pending()
		if !reflect.DeepEqual(filed, admittedData) && (len(filed) > 0 || len(admittedData) > 0) {
			t.Fatalf("data filed per rank %v, admitted %v", filed, admittedData)
		}
		if got := int(z.Dropped()); got != dropped {
			t.Fatalf("dropped %d messages, want %d", got, dropped)
		}
	})
}

// FuzzSplitEndpoint: the endpoints ranks read from the rendezvous store
// (another rank's, or whatever was put there) are refused or split into a
// ZeroMQ address without the key mark and, with CURVE, a 32-byte key.
func FuzzSplitEndpoint(f *testing.F) {
	f.Add("tcp://127.0.0.1:5000")
	f.Add("tcp://10.0.0.1:5000" + curveEndpointMark + hex.EncodeToString(bytes.Repeat([]byte{7}, 32)))
	f.Add("tcp://h:1" + curveEndpointMark + "zz")
	f.Fuzz(func(t *testing.T, ep string) {
		addr, key, err := splitEndpoint(ep)
		if err != nil {
			return
		}
		if strings.Contains(ep, curveEndpointMark) != (key != "") {
			t.Fatalf("%q: key %q", ep, key)
		}
		if key != "" && (len(key) != 40 || strings.Contains(addr, curveEndpointMark)) {
			t.Fatalf("%q split into %q and key %q", ep, addr, key)
		}
	})
}
