package main

// Command busbw runs as one rank of a torchrun-style job (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) and measures the dense ring allreduce's bus
// bandwidth through oktopk's transport, beside the same ring schedule moved
// over raw ZeroMQ sockets between the same processes, for each size. The
// ratio of the two is the transport's overhead (framing, mailbox matching,
// the owner goroutine per socket).
//
// Rank 0 prints one line per size:
//
//	busbw size=1048576 oktopk_ms=… oktopk_busbw=… raw_ms=… raw_busbw=… ratio=…
//
// where busbw is bytes·2(P−1)/P per second, the NCCL-tests convention, so
// it reads the same for every P.

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport/zmq"
)

func main() {
	sizes := flag.String("sizes", "1048576,4194304,16777216,67108864", "message sizes in bytes, comma separated")
	iters := flag.Int("iters", 5, "timed allreduces per size (the median is reported)")
	flag.Parse()
	if err := run(*sizes, *iters); err != nil {
		fmt.Fprintln(os.Stderr, "busbw:", err)
		os.Exit(1)
	}
}

func run(sizeList string, iters int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	z, err := zmq.InitFromEnv(ctx, zmq.Options{})
	if err != nil {
		return err
	}
	defer z.Close()
	comm := core.NewCommunicator(z)
	p, r := comm.Size(), comm.Rank()
	raw, err := newRawRing(comm)
	if err != nil {
		return err
	}
	defer raw.close()

	for _, s := range strings.Split(sizeList, ",") {
		bytes, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || bytes < 4*p {
			return fmt.Errorf("bad size %q", s)
		}
		data := make([]float32, bytes/4)
		// Small sizes get more runs: at least iters, and about 64 MiB moved.
		runs := max(iters, min(200, (64<<20)/bytes))
		oktopk, rawTime, ratio, err := compare(runs, comm,
			func() error {
				_, err := comm.Allreduce(ctx, data, false, core.DenseRing)
				return err
			},
			func() error { return raw.allreduce(data) })
		if err != nil {
			return err
		}
		if r == 0 {
			bus := func(d time.Duration) float64 {
				return float64(bytes) * 2 * float64(p-1) / float64(p) / d.Seconds() / 1e6
			}
			fmt.Printf("busbw P=%d size=%d oktopk_ms=%.2f oktopk_busbw_MBps=%.1f raw_ms=%.2f raw_busbw_MBps=%.1f ratio=%.2f\n",
				p, bytes, ms(oktopk), bus(oktopk), ms(rawTime), bus(rawTime), ratio)
		}
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// compare times a and b in blocks of blockRuns runs, in the order A B B A
// A B B A …, and returns each side's median time over the timed runs and
// the median over neighbouring block pairs of b's block median over a's.
//
// Why blocks, and why that order: the two sides share one process, so each
// leaves state behind that the other inherits — the Go heap and where its
// next garbage collection falls, glibc's arenas, caches, TCP windows. Run
// one after the other (A B A B …), the collections, which come every few
// runs, lock into step with the alternation and land on one side more than
// the other: measured that way (2 ranks, 4 MiB), oktopk's median time was
// 10–15% above its median in jobs that ran oktopk alone, and raw's 15–20%
// below raw's alone, which turned an overhead of about 0.9 into 0.7. So each block starts with
// washoutRuns untimed runs that leave the other side's state behind, and
// the A B B A order has each side follow each side equally often. Short
// blocks still put slow drift (other load, the heap growing) on both alike.
//
// Each run starts together on every rank (a one-element allreduce as
// barrier); a run's time is the ranks' mean (a ring step waits on its
// neighbours, so the ranks' times differ by little).
func compare(runs int, comm *core.Communicator, a, b func() error) (medianA, medianB time.Duration, ratio float64, _ error) {
	const blockRuns, washoutRuns = 6, 2
	ctx := context.Background()
	timeRun := func(f func() error) (float64, error) {
		barrier := []float32{0}
		if _, err := comm.Allreduce(ctx, barrier, false, core.DenseRing); err != nil {
			return 0, err
		}
		start := time.Now()
		if err := f(); err != nil {
			return 0, err
		}
		mean := []float32{float32(time.Since(start).Seconds())}
		if _, err := comm.Allreduce(ctx, mean, true, core.DenseRabenseifner); err != nil {
			return 0, err
		}
		return float64(mean[0]), nil
	}
	med := func(t []float64) float64 {
		t = append([]float64(nil), t...)
		sort.Float64s(t)
		return t[len(t)/2]
	}
	block := func(f func() error) ([]float64, error) {
		for i := 0; i < washoutRuns; i++ {
			if err := f(); err != nil {
				return nil, err
			}
		}
		times := make([]float64, blockRuns)
		for i := range times {
			var err error
			if times[i], err = timeRun(f); err != nil {
				return nil, err
			}
		}
		return times, nil
	}
	pairs := max(3, (runs+blockRuns-1)/blockRuns) | 1 // odd: the median ratio is one pair's
	var timesA, timesB, ratios []float64
	for i := 0; i < pairs; i++ {
		first, second := a, b // A B, then B A
		if i%2 == 1 {
			first, second = b, a
		}
		t1, err := block(first)
		if err != nil {
			return 0, 0, 0, err
		}
		t2, err := block(second)
		if err != nil {
			return 0, 0, 0, err
		}
		if i%2 == 1 {
			t1, t2 = t2, t1
		}
		timesA, timesB = append(timesA, t1...), append(timesB, t2...)
		ratios = append(ratios, med(t2)/med(t1))
	}
	return time.Duration(med(timesA) * float64(time.Second)), time.Duration(med(timesB) * float64(time.Second)), med(ratios), nil
}

// rawRing is the ring allreduce's schedule over plain ZeroMQ sockets: a
// ROUTER per rank receiving from the left neighbour, a DEALER per rank
// sending to the right one, two-frame messages (a 96-byte header, as big as
// the transport's, then the payload) as the transport sends. Its endpoints
// are exchanged through the oktopk communicator, so it runs between the
// same processes.
type rawRing struct {
	comm     *core.Communicator
	zctx     *zmq.RawContext
	in, out  *zmq.RawSocket
	header   []byte
	received []float32
}

func newRawRing(comm *core.Communicator) (*rawRing, error) {
	zctx, err := zmq.NewRawContext()
	if err != nil {
		return nil, err
	}
	rr := &rawRing{comm: comm, zctx: zctx, header: make([]byte, 96)}
	if rr.in, err = zctx.NewSocket(zmq.Router); err != nil {
		return nil, err
	}
	if rr.out, err = zctx.NewSocket(zmq.Dealer); err != nil {
		return nil, err
	}
	for _, s := range []*zmq.RawSocket{rr.in, rr.out} {
		if err := s.SetLinger(0); err != nil {
			return nil, err
		}
		if err := s.SetSndhwm(0); err != nil {
			return nil, err
		}
		if err := s.SetRcvhwm(0); err != nil {
			return nil, err
		}
	}
	if err := rr.in.Bind("tcp://127.0.0.1:*"); err != nil {
		return nil, err
	}
	ep, err := rr.in.LastEndpoint()
	if err != nil {
		return nil, err
	}
	port, err := strconv.Atoi(ep[strings.LastIndex(ep, ":")+1:])
	if err != nil {
		return nil, err
	}
	// Every rank learns every port by a dense allreduce of a one-hot vector
	// (ports are below 2^16, exact in float32).
	p, r := comm.Size(), comm.Rank()
	ports := make([]float32, p)
	ports[r] = float32(port)
	if _, err := comm.Allreduce(context.Background(), ports, false, core.DenseRing); err != nil {
		return nil, err
	}
	right := (r + 1) % p
	if err := rr.out.Connect(fmt.Sprintf("tcp://127.0.0.1:%d", int(ports[right]))); err != nil {
		return nil, err
	}
	// One round of the ring proves every connection is up before timing.
	if _, err := rr.exchange(nil, 0); err != nil {
		return nil, err
	}
	return rr, nil
}

// exchange sends one message to the right neighbour and receives one from
// the left, returning its payload viewed as float32 (no copy when aligned,
// as the transport's receive path does).
func (rr *rawRing) exchange(send []float32, want int) ([]float32, error) {
	if _, err := rr.out.SendBytes(rr.header, true); err != nil {
		return nil, err
	}
	if _, err := rr.out.SendBytes(core.Float32Bytes(send), false); err != nil {
		return nil, err
	}
	msg, err := rr.in.RecvMessageBytes()
	if err != nil {
		return nil, err
	}
	if len(msg) != 3 || len(msg[2]) != 4*want { // routing id, header, payload
		return nil, fmt.Errorf("raw ring: got %d frames, want 3 with %d bytes of payload", len(msg), 4*want)
	}
	b := msg[2]
	if want > 0 && uintptr(unsafe.Pointer(&b[0]))%4 == 0 {
		return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), want), nil
	}
	if cap(rr.received) < want {
		rr.received = make([]float32, want)
	}
	got := rr.received[:want]
	return got, core.CopyBytesToFloat32(got, b)
}

// allreduce runs the ring schedule of core.RingAllreduce: P−1 reduce-scatter
// steps adding the received chunk, then P−1 allgather steps copying it.
func (rr *rawRing) allreduce(data []float32) error {
	p, r := rr.comm.Size(), rr.comm.Rank()
	n := len(data)
	chunk := func(c int) []float32 {
		c = ((c % p) + p) % p
		return data[c*n/p : (c+1)*n/p]
	}
	for i := 0; i < p-1; i++ {
		send, into := chunk(r-i), chunk(r-i-1)
		got, err := rr.exchange(send, len(into))
		if err != nil {
			return err
		}
		for j, v := range got {
			into[j] += v
		}
	}
	for i := 0; i < p-1; i++ {
		send, into := chunk(r+1-i), chunk(r-i)
		got, err := rr.exchange(send, len(into))
		if err != nil {
			return err
		}
		copy(into, got)
	}
	return nil
}

func (rr *rawRing) close() {
	rr.in.Close()
	rr.out.Close()
	rr.zctx.Term()
}
