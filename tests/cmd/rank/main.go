package main

// Command rank runs as one rank of a job launched torchrun-style (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment): it joins over
// ZeroMQ TCP, runs every registered algorithm on integer-valued data whose
// exact sum it knows, and exits non-zero on the first wrong element.
//
// In -loop mode (the fault tests) it runs one algorithm at density 1, so
// every result is exact and checked element by element, and reports how it
// ended through its exit status: exitError for a call that failed cleanly
// (after printing "call N failed after D: err" and "closed in D"),
// exitWrongResult for a wrong element. Anything else is a crash.
//
// In -auto mode it runs a random sequence of Auto calls, the same sequence
// on every rank (tensors of 1 to 2^17 elements, densities from 0.1% to 1,
// the three caller dtypes, re-measurements of the link in between), and
// prints each call's algorithm and output hash, which must be the same on
// every rank.

import (
	"context"
	"flag"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"time"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

func main() {
	n := flag.Int("n", 100003, "elements per allreduce")
	iters := flag.Int("iters", 3, "allreduces per algorithm")
	timeout := flag.Duration("timeout", 60*time.Second, "limit for the whole run")
	loop := flag.Int("loop", 0, "instead: this many verified calls of -alg, each limited by -call-timeout (fault tests)")
	callTimeout := flag.Duration("call-timeout", 3*time.Second, "limit of one call in -loop mode")
	algName := flag.String("alg", "oktopk", "algorithm of -loop mode")
	auto := flag.Int("auto", 0, "instead: this many random Auto calls, printing each one's algorithm and output hash")
	flag.Parse()
	if *auto > 0 {
		if err := runAuto(*auto, *timeout); err != nil {
			fmt.Fprintln(os.Stderr, "rank:", err)
			os.Exit(1)
		}
		return
	}
	if *loop > 0 {
		alg, err := core.ParseAlgorithm(*algName)
		if err != nil {
			fmt.Fprintln(os.Stderr, "rank:", err)
			os.Exit(exitError)
		}
		os.Exit(runLoop(*n, *loop, alg, *callTimeout))
	}
	if err := run(*n, *iters, *timeout); err != nil {
		fmt.Fprintln(os.Stderr, "rank:", err)
		os.Exit(1)
	}
}

// value is rank r's element i in iteration it: small integers, so every
// partial sum is exact in float32 and the result is known bitwise.
func value(r, i, it int) float32 { return float32((r*7+i*3+it*5)%17 - 8) }

// Exit statuses of -loop mode (a Go panic exits with 2, a signal otherwise).
const (
	exitError       = 10
	exitWrongResult = 11
)

// runLoop runs verified calls of alg until done or the first error, printing
// a line per verified call so a fault test knows the ranks are mid-run, and
// returns the exit status.
func runLoop(n, calls int, alg core.Algorithm, callTimeout time.Duration) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	z, err := zmq.InitFromEnv(ctx, zmq.Options{})
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "rank: joining:", err)
		return exitError
	}
	comm := core.NewCommunicator(z)
	p := comm.Size()
	cfg := core.DefaultConfig()
	cfg.Algorithm, cfg.Density = alg, 1 // density 1: the exact sum, checkable bitwise
	data := make([]float32, n)
	for it := 0; it < calls; it++ {
		for i := range data {
			data[i] = value(comm.Rank(), i, it)
		}
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		start := time.Now()
		_, err := comm.SparseAllreduce(ctx, 1, data, cfg)
		took := time.Since(start)
		cancel()
		if err != nil {
			fmt.Fprintf(os.Stderr, "rank: call %d failed after %v: %v\n", it, took.Round(time.Millisecond), err)
			start = time.Now()
			z.Close()
			fmt.Fprintf(os.Stderr, "rank: closed in %v\n", time.Since(start).Round(time.Millisecond))
			return exitError
		}
		for i, got := range data {
			var sum float32
			for r := 0; r < p; r++ {
				sum += value(r, i, it)
			}
			if want := sum / float32(p); got != want {
				fmt.Fprintf(os.Stderr, "rank: WRONG RESULT: %v call %d: element %d is %v, want %v\n", alg, it, i, got, want)
				return exitWrongResult
			}
		}
		fmt.Printf("call %d ok\n", it)
	}
	z.Close()
	return 0
}

func run(n, iters int, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	z, err := zmq.InitFromEnv(ctx, zmq.Options{})
	if err != nil {
		return err
	}
	defer z.Close()
	comm := core.NewCommunicator(z)
	p, rank := comm.Size(), comm.Rank()
	data := make([]float32, n)
	for _, alg := range core.Algorithms() {
		cfg := core.DefaultConfig()
		cfg.Algorithm, cfg.Density = alg, 1.0 // density 1: sparse equals dense, exactly
		for it := 0; it < iters; it++ {
			for i := range data {
				data[i] = value(rank, i, it)
			}
			var err error
			if alg.Dense() {
				_, err = comm.Allreduce(ctx, data, false, alg)
			} else {
				_, err = comm.SparseAllreduce(ctx, uint64(alg), data, cfg)
			}
			if err != nil {
				return fmt.Errorf("%v iteration %d: %w", alg, it, err)
			}
			for i, got := range data {
				var sum float32
				for r := 0; r < p; r++ {
					sum += value(r, i, it)
				}
				want := sum
				if !alg.Dense() {
					want = sum / float32(p)
				}
				if got != want {
					return fmt.Errorf("%v iteration %d: element %d is %v, want %v", alg, it, i, got, want)
				}
			}
		}
		h := fnv.New64a()
		h.Write(core.Float32Bytes(data))
		fmt.Printf("rank %d/%d %-22s ok hash %016x\n", rank, p, alg, h.Sum64())
	}
	return nil
}

// runAuto runs calls random Auto calls (see the package comment).
func runAuto(calls int, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	z, err := zmq.InitFromEnv(ctx, zmq.Options{})
	if err != nil {
		return err
	}
	defer z.Close()
	comm := core.NewCommunicator(z)
	sizes := []int{1, 21, 300, 5000, 40000, 1 << 17}
	densities := []float64{0.001, 0.01, 0.1, 1}
	dtypes := []transport.Dtype{transport.DtypeFloat32, transport.DtypeFloat16, transport.DtypeBFloat16}
	shared := rand.New(rand.NewPCG(7, 7)) // the same on every rank
	own := rand.New(rand.NewPCG(7, uint64(comm.Rank())+1))
	half := make([]uint16, sizes[len(sizes)-1])
	var widener binding.Widener
	for i := 0; i < calls; i++ {
		if i%10 == 0 {
			start := time.Now()
			m, err := comm.MeasureLink(ctx)
			if err != nil {
				return fmt.Errorf("measuring the link before call %d: %w", i, err)
			}
			fmt.Printf("link measured in %.1f ms: %v\n", float64(time.Since(start).Microseconds())/1e3, m)
		}
		tensor := shared.IntN(len(sizes))
		n, dt := sizes[tensor], dtypes[shared.IntN(len(dtypes))]
		cfg := core.Config{Algorithm: core.Auto, Density: densities[shared.IntN(len(densities))], Tau: 4, TauPrime: 8}
		grad := make([]float32, n)
		for j := range grad {
			grad[j] = float32(own.NormFloat64())
		}
		// A half-precision buffer goes through package binding, as the C
		// ABI's do: widened, reduced as float32, narrowed back; its result is
		// hashed widened again.
		buf := binding.Float32(grad)
		switch dt {
		case transport.DtypeFloat16:
			core.Float32ToFloat16(half[:n], grad)
			buf = binding.Buffer{Dtype: dt, Half: half[:n]}
		case transport.DtypeBFloat16:
			core.Float32ToBFloat16(half[:n], grad)
			buf = binding.Buffer{Dtype: dt, Half: half[:n]}
		}
		st, err := widener.SparseAllreduce(ctx, comm, uint64(tensor), buf, cfg, core.CallOptions{})
		switch dt {
		case transport.DtypeFloat16:
			core.Float16ToFloat32(grad, half[:n])
		case transport.DtypeBFloat16:
			core.BFloat16ToFloat32(grad, half[:n])
		}
		if err != nil {
			return fmt.Errorf("auto call %d (n=%d, density %g, %v): %w", i, n, cfg.Density, dt, err)
		}
		h := fnv.New64a()
		h.Write(core.Float32Bytes(grad))
		fmt.Printf("auto call %d %v %016x\n", i, st.Algorithm, h.Sum64())
	}
	return nil
}
