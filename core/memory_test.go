package core

// Tests of what every algorithm costs in memory per rank: a steady-state
// call allocates in proportion to k·P, not n, and little more than the
// residual stays allocated between calls.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
)

// What a rank pays in memory for a steady-state call (after warm-up), for
// every algorithm, in process (P = 4, 3 warm-up calls, then 4 measured
// calls with τ = τ′ = 2, so the measured calls include exact refreshes,
// repartitions and reuse calls):
//
//   - allocation per call, beyond the transport's one copy of each message
//     (the in-process transport copies every payload, as ZeroMQ does into
//     its own buffers), is at most 8 bytes × 10·k·P plus 16 KiB · P:
//     O(k·P + P), the k·P for the baselines whose global result is the
//     union of the P selections (TopkA, SparCML, TopkDSA), which they build
//     and decode in fresh storage (Ok-Topk reuses its storage from call to
//     call; what it allocates is that storage still growing to the sizes
//     the calls need). Nothing in proportion to n: the same k on a quarter
//     of the n (density × 4) allocates at most n × 4 B / 16 less per call
//     (Gaussiank excepted: the count it selects is an estimate, and differs
//     between the two densities);
//   - what stays allocated between calls is, per rank, at most the residual
//     (n × 4 B; a dense allreduce keeps none, but Rabenseifner keeps one
//     n-element copy of the caller's buffer to put back after a failure)
//     plus Ok-Topk's region sum (n/P × 4 B and a bit per entry, up to twice
//     that once a repartition has widened the region) plus O(k).
func TestSteadyStateMemoryPerCall(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	const p, n, density = 4, 1 << 20, 0.01
	// The selection's scratch (histograms, 256 KiB each) is kept in a
	// process-wide free list, as many as selections have run at once: one
	// run first fills it, so that what the runs below keep is theirs.
	measureSteadyState(t, OkTopk, p, n, density)
	for _, alg := range Algorithms() {
		t.Run(alg.String(), func(t *testing.T) {
			large := measureSteadyState(t, alg, p, n, density)
			small := measureSteadyState(t, alg, p, n/4, density*4)
			k := Config{Density: density}.K(n)
			allocBound := float64(8*10*k*p + 16<<10*p)
			t.Logf("n=%d k=%d: %.0f KiB per call beyond messages (bound %.0f KiB), %.3f × n × 4 B kept per rank; n=%d: %.0f KiB, %.3f",
				n, k, large.alloc/1024, allocBound/1024, large.kept/(4*n), n/4, small.alloc/1024, small.kept/float64(n))
			if large.alloc > allocBound {
				t.Errorf("n=%d: a call allocated %.0f KiB beyond its messages, above the O(k·P + P) bound of %.0f KiB", n, large.alloc/1024, allocBound/1024)
			}
			// Gaussiank sends k̂, its estimate of k, which differs between
			// the two densities: its messages, and the storage they are
			// decoded into, do not compare.
			if grew := large.alloc - small.alloc; grew > 4*n/16 && alg != Gaussiank {
				t.Errorf("the same k on 4 times the elements allocated %.0f KiB more per call: allocation in proportion to n", grew/1024)
			}
			for _, m := range []struct {
				n    int
				kept float64
			}{{n, large.kept}, {n / 4, small.kept}} {
				bound := float64(8*16*k) + 1<<20 // O(k) entries of 8 B, and a little the runtime keeps
				switch {
				case alg == OkTopk || alg == Auto: // its region may grow past n/P after a repartition (Auto may run Ok-Topk on the tensor's state)
					bound += float64(4*m.n) + 2*float64(4*m.n/p) + float64(m.n/p/4)
				case alg != DenseRing:
					bound += float64(4 * m.n)
				}
				if m.kept > bound {
					t.Errorf("n=%d: %.2f MiB stay allocated per rank between calls, above %.2f MiB (the residual and one scratch at most)", m.n, m.kept/(1<<20), bound/(1<<20))
				}
			}
		})
	}
}

// memoryTestLink is a slow link (50 µs, 125 MB/s), on which Auto chooses a
// sparse algorithm, the ones whose memory this test bounds most closely.
var memoryTestLink = LinkModel{Alpha: 50e-6, Beta: 8e-9, Gamma: 0.15e-9}

type steadyState struct {
	alloc float64 // bytes allocated per call per rank, beyond the messages
	kept  float64 // bytes that stay allocated per rank once the calls are done
}

func measureSteadyState(t *testing.T, alg Algorithm, p, n int, density float64) steadyState {
	const warm, calls = 3, 4
	cfg := Config{Algorithm: alg, Density: density, Tau: 2, TauPrime: 2}
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	src, grads := make([][]float32, p), make([][]float32, p)
	for r := range src {
		rng := rand.New(rand.NewPCG(uint64(r), 7))
		src[r], grads[r] = make([]float32, n), make([]float32, n)
		for i := range src[r] {
			src[r][i] = float32(rng.NormFloat64())
		}
	}
	var before, after runtime.MemStats
	sent := make([]uint64, p)
	// Every rank waits at each barrier until the test has read the memory
	// statistics: after the warm-up, and after the measured calls.
	var warmed, done sync.WaitGroup
	warmed.Add(p)
	done.Add(p)
	measure, finish := make(chan struct{}), make(chan struct{})
	var kept int64
	go func() {
		warmed.Wait()
		runtime.ReadMemStats(&before)
		close(measure)
		done.Wait()
		runtime.ReadMemStats(&after)
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		kept = int64(ms.HeapAlloc) - int64(base) - int64(2*p*n*4) // less the test's own src and grads
		close(finish)
	}()
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		wasWarmed, wasDone := false, false
		defer func() { // a failed rank still passes the barriers
			if !wasWarmed {
				warmed.Done()
			}
			if !wasDone {
				done.Done()
			}
		}()
		if alg == Auto {
			// A link model of its own, not one measured under this
			// machine's load of the moment: the choice, and so what the
			// calls keep, is the same on every run.
			if err := c.SetLinkModel(memoryTestLink); err != nil {
				return err
			}
		}
		for i := 0; i < warm+calls; i++ {
			if i == warm {
				warmed.Done()
				wasWarmed = true
				<-measure
			}
			copy(grads[rank], src[rank])
			var st Stats
			var err error
			if alg.Dense() {
				st, err = c.Allreduce(ctx, grads[rank], true, alg)
			} else {
				st, err = c.SparseAllreduce(ctx, 1, grads[rank], cfg)
			}
			if err != nil {
				return fmt.Errorf("call %d: %w", i, err)
			}
			if i >= warm {
				sent[rank] += st.BytesSent
			}
		}
		done.Done()
		wasDone = true
		<-finish
		runtime.KeepAlive(c) // its tensor state and scratch count as kept
		return nil
	})
	runtime.KeepAlive(src)
	runtime.KeepAlive(grads)
	var messages uint64
	for _, b := range sent {
		messages += b
	}
	return steadyState{
		alloc: (float64(after.TotalAlloc-before.TotalAlloc) - float64(messages)) / float64(p*calls),
		kept:  float64(kept) / float64(p),
	}
}
