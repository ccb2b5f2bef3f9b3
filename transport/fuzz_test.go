package transport

// A fuzz test of the rendezvous store's message decoder: any bytes are
// refused or round-trip, with no panic and no large allocation.

import (
	"bytes"
	"reflect"
	"runtime"
	"testing"
)

// FuzzStoreMessage: the rendezvous server's request decoder (and the
// client's reply decoder, which trusts a server no more): any bytes are
// refused or decode into a message that encodes and decodes back to itself;
// never a panic; and decoding one message never allocates more than a few
// times the largest message (maxStoreMessage), whatever sizes the bytes
// claim: the server decodes a request before it can check its token, so
// this is what a stranger on the rendezvous port can make rank 0 allocate
// per message.
func FuzzStoreMessage(f *testing.F) {
	for _, v := range []any{
		storeRequest{Token: "tok", Op: "set", Key: "oktopk/g0/ep/1", Value: []byte("tcp://127.0.0.1:5000")},
		storeRequest{Token: "tok", Op: "get", Key: "oktopk/token", WaitMs: 1000},
		storeRequest{Token: "tok", Op: "add", Key: "n", Delta: -3},
		storeReply{Err: "wrong job token"},
		storeReply{Value: []byte("x"), Num: 7},
	} {
		var buf bytes.Buffer
		if err := writeStoreMessage(&buf, v); err != nil {
			f.Fatal(err)
		}
		f.Add(buf.Bytes())
	}
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		roundTrip := func(v, again any) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			err := readStoreMessage(bytes.NewReader(b), v)
			runtime.ReadMemStats(&after)
			if grew := after.TotalAlloc - before.TotalAlloc; grew > 4*maxStoreMessage {
				t.Fatalf("decoding %d bytes into %T allocated %d MiB (%v)", len(b), v, grew>>20, err)
			}
			if err != nil {
				return
			}
			var buf bytes.Buffer
			if err := writeStoreMessage(&buf, v); err != nil {
				t.Fatalf("decoded %+v but cannot encode it: %v", v, err)
			}
			if err := readStoreMessage(&buf, again); err != nil || !reflect.DeepEqual(v, again) {
				t.Fatalf("decoded %+v, which round-trips to %+v (%v)", v, again, err)
			}
		}
		roundTrip(&storeRequest{}, &storeRequest{})
		roundTrip(&storeReply{}, &storeReply{})
	})
}
