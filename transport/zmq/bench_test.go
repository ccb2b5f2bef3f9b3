package zmq

// A benchmark of one transfer over TCP loopback, through this transport and
// through raw ZeroMQ sockets, so the transport's overhead reads as a ratio.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
	"github.com/pebbe/zmq4"
)

// BenchmarkTransferOverLoopback moves one message of each size from one
// endpoint to another over TCP loopback, through this transport and through
// raw ZeroMQ sockets of the same kind (a bound ROUTER sending to a ROUTER
// that dialed it, three-part messages), so the transport's overhead reads
// as the ratio of the two MB/s figures. Both endpoints live in this
// process; the bytes still cross the kernel's TCP stack.
func BenchmarkTransferOverLoopback(b *testing.B) {
	for _, size := range []int{1 << 20, 4 << 20, 16 << 20, 64 << 20} {
		payload := make([]byte, size)
		b.Run(fmt.Sprintf("oktopk/%dMiB", size>>20), func(b *testing.B) {
			zs := startZMQ(b, 2, nil)
			ctx := context.Background()
			b.SetBytes(int64(size))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				tag := transport.Tag{Op: transport.OpAllgather, Seq: uint64(i + 1), Step: 0}
				errc := make(chan error, 1)
				go func() { errc <- zs[0].Send(ctx, 1, tag, transport.DtypeBytes, uint64(size), payload) }()
				if _, err := zs[1].Recv(ctx, 0, tag); err != nil {
					b.Fatal(err)
				}
				if err := <-errc; err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("raw-zmq/%dMiB", size>>20), func(b *testing.B) {
			zctx, _ := zmq4.NewContext()
			defer zctx.Term()
			out, _ := zctx.NewSocket(zmq4.ROUTER)
			out.SetSndhwm(0)
			out.Bind("tcp://127.0.0.1:*")
			ep, _ := out.GetLastEndpoint()
			in, _ := zctx.NewSocket(zmq4.ROUTER)
			in.SetRcvhwm(0)
			in.SetIdentity("in")
			in.Connect(ep)
			defer in.Close()
			defer out.Close()
			out.SetLinger(0)
			in.SetLinger(0)
			id := []byte("in")
			header := make([]byte, transport.HeaderSize)
			time.Sleep(50 * time.Millisecond)
			b.SetBytes(int64(size))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := out.SendBytes(id, zmq4.SNDMORE); err != nil {
					b.Fatal(err)
				}
				if _, err := out.SendBytes(header, zmq4.SNDMORE); err != nil {
					b.Fatal(err)
				}
				if _, err := out.SendBytes(payload, 0); err != nil {
					b.Fatal(err)
				}
				if _, err := in.RecvMessageBytes(0); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
