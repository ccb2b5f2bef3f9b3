package core

// Tests of the dense allreduces (ring, Rabenseifner): sums and averages
// bitwise equal to a serial reference, ranks bitwise identical, words and
// messages sent, and different lengths a mismatch; and a benchmark.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/oktopk/oktopk/internal/testref"
)

var denseAlgorithmsUnderTest = []Algorithm{DenseRing, DenseRabenseifner}

// integerInputs gives every rank n integer-valued floats in [-100, 100]:
// any sum of up to 2^17 of them is exact in float32, so every summation
// order gives the same bits and a serial sum is the exact reference.
func integerInputs(p, n int) [][]float32 {
	in := make([][]float32, p)
	for r := range in {
		in[r] = make([]float32, n)
		for i := range in[r] {
			in[r][i] = float32((r*7919+i*31+(i>>7)*13)%201 - 100)
		}
	}
	return in
}

func serialSum(in [][]float32, n int) []float32 {
	out := make([]float32, n)
	for _, v := range in {
		for i := range out {
			out[i] += v[i]
		}
	}
	return out
}

func cloneAll(in [][]float32) [][]float32 {
	out := make([][]float32, len(in))
	for r, v := range in {
		out[r] = append([]float32(nil), v...)
	}
	return out
}

func denseSizes(p int) []int {
	sizes := []int{0, 1, 7, p - 1, 1000}
	// The 2^20+3 case is kept to two rank counts: one power of two, one not.
	if p == 3 || p == 8 {
		sizes = append(sizes, 1<<20+3)
	}
	// At P = 2 Rabenseifner's partners exchange ranges of one piece and of
	// two (densePiece values and one more): a rank waits for a first piece
	// its partner has, and sends a second its partner does not wait for.
	if p == 2 {
		sizes = append(sizes, 2*densePiece+1)
	}
	return sizes
}

func TestDenseAllreduceSumIsBitwiseSerialSum(t *testing.T) {
	for _, alg := range denseAlgorithmsUnderTest {
		for _, p := range []int{1, 2, 3, 5, 8} {
			for _, n := range denseSizes(p) {
				t.Run(fmt.Sprintf("%v/P=%d/n=%d", alg, p, n), func(t *testing.T) {
					in := integerInputs(p, n)
					want := serialSum(in, n)
					data := cloneAll(in)
					runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
						_, err := c.Allreduce(ctx, data[r], false, alg)
						return err
					})
					for r := range data {
						if i, bad := testref.FirstBitwiseDifference(data[r], want); bad {
							t.Fatalf("rank %d element %d: got %v, want %v", r, i, data[r][i], want[i])
						}
					}
				})
			}
		}
	}
}

func TestDenseAllreduceAverageIsBitwiseSerialAverage(t *testing.T) {
	for _, alg := range denseAlgorithmsUnderTest {
		for _, p := range []int{1, 2, 3, 5, 8} {
			t.Run(fmt.Sprintf("%v/P=%d", alg, p), func(t *testing.T) {
				const n = 1000
				in := integerInputs(p, n)
				want := serialSum(in, n)
				for i := range want {
					want[i] /= float32(p)
				}
				data := cloneAll(in)
				runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
					_, err := c.Allreduce(ctx, data[r], true, alg)
					return err
				})
				for r := range data {
					if i, bad := testref.FirstBitwiseDifference(data[r], want); bad {
						t.Fatalf("rank %d element %d: got %v, want %v", r, i, data[r][i], want[i])
					}
				}
			})
		}
	}
}

// With arbitrary floats the sum depends on the order of additions; the
// property that must still hold is that every rank gets the same bits.
func TestDenseAllreduceRanksBitwiseIdenticalOnArbitraryFloats(t *testing.T) {
	for _, alg := range denseAlgorithmsUnderTest {
		for _, p := range []int{2, 3, 5, 8} {
			t.Run(fmt.Sprintf("%v/P=%d", alg, p), func(t *testing.T) {
				const n = 4099
				rng := rand.New(rand.NewPCG(uint64(p), 7))
				data := make([][]float32, p)
				for r := range data {
					data[r] = make([]float32, n)
					for i := range data[r] {
						data[r][i] = float32(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(9)-4)))
					}
				}
				runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
					_, err := c.Allreduce(ctx, data[r], false, alg)
					return err
				})
				for r := 1; r < p; r++ {
					if i, bad := testref.FirstBitwiseDifference(data[r], data[0]); bad {
						t.Fatalf("rank %d element %d: %v, rank 0 has %v", r, i, data[r][i], data[0][i])
					}
				}
			})
		}
	}
}

// The ring moves 2(P−1) chunks per rank, so each rank sends 2n(P−1)/P words
// up to the chunk rounding (each chunk is within one element of n/P).
func TestRingAllreduceSendsTwoNTimesPMinusOneOverPWords(t *testing.T) {
	for _, p := range []int{2, 3, 5, 8} {
		for _, n := range []int{7, 1000, 4099} {
			t.Run(fmt.Sprintf("P=%d/n=%d", p, n), func(t *testing.T) {
				stats := make([]Stats, p)
				data := cloneAll(integerInputs(p, n))
				runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
					var err error
					stats[r], err = c.Allreduce(ctx, data[r], false, DenseRing)
					return err
				})
				model := 2 * float64(n) * float64(p-1) / float64(p)
				for r, st := range stats {
					words := float64(st.WordsSent())
					if math.Abs(words-model) > 2 {
						t.Errorf("rank %d sent %v words, model 2n(P-1)/P = %.2f", r, words, model)
					}
					if st.MessagesSent != uint64(2*(p-1)) {
						t.Errorf("rank %d sent %d messages, want 2(P-1) = %d", r, st.MessagesSent, 2*(p-1))
					}
				}
			})
		}
	}
}

// Rabenseifner sends 2n(P'−1)/P' words per rank on the P' = 2^⌊log P⌋ ranks
// of the halving/doubling, in 2 log P' messages; the fold adds one message
// of n words on the ranks that take part in it.
func TestRabenseifnerAllreduceWordsAndMessages(t *testing.T) {
	for _, p := range []int{2, 3, 5, 8} {
		const n = 4099
		t.Run(fmt.Sprintf("P=%d", p), func(t *testing.T) {
			stats := make([]Stats, p)
			data := cloneAll(integerInputs(p, n))
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				var err error
				stats[r], err = c.Allreduce(ctx, data[r], false, DenseRabenseifner)
				return err
			})
			rounds := bits.Len(uint(p)) - 1
			pow2 := 1 << rounds
			extra := p - pow2
			core := 2 * float64(n) * float64(pow2-1) / float64(pow2)
			for r, st := range stats {
				words, msgs := float64(st.WordsSent()), st.MessagesSent
				var wantWords float64
				var wantMsgs uint64
				switch {
				case r < 2*extra && r%2 == 1: // folded away: sends its vector once
					wantWords, wantMsgs = n, 1
				case r < 2*extra: // takes the fold, hands back the result
					wantWords, wantMsgs = core+n, uint64(2*rounds+1)
				default:
					wantWords, wantMsgs = core, uint64(2*rounds)
				}
				// Each of the 2 log P' ranges is within one element of its share.
				if math.Abs(words-wantWords) > float64(2*rounds) {
					t.Errorf("rank %d sent %v words, model %.2f", r, words, wantWords)
				}
				if msgs != wantMsgs {
					t.Errorf("rank %d sent %d messages, want %d", r, msgs, wantMsgs)
				}
			}
		})
	}
}

// Ranks that call with different lengths must get ErrMismatch (or be
// released by the abort that follows it), never hang or scribble.
func TestDenseAllreduceDifferentLengthsIsMismatch(t *testing.T) {
	for _, alg := range denseAlgorithmsUnderTest {
		for _, p := range []int{2, 3, 5} {
			t.Run(fmt.Sprintf("%v/P=%d", alg, p), func(t *testing.T) {
				start := time.Now()
				errs := runInProcErrors(t, p, 10*time.Second, func(ctx context.Context, r int, c *Communicator) error {
					n := 100
					if r == p-1 {
						n = 101
					}
					_, err := c.Allreduce(ctx, make([]float32, n), false, alg)
					return err
				})
				mismatch := false
				for r, err := range errs {
					if err == nil {
						t.Errorf("rank %d: no error", r)
					}
					mismatch = mismatch || errors.Is(err, ErrMismatch)
				}
				if !mismatch {
					t.Errorf("no rank reported ErrMismatch: %v", errors.Join(errs...))
				}
				if d := time.Since(start); d > 5*time.Second {
					t.Errorf("took %v: ranks waited for the timeout", d)
				}
			})
		}
	}
}

// BenchmarkDenseAllreduce times one in-process allreduce of 2^20 floats at
// P = 4 (memory copies only: the figure compares the two algorithms' local
// work, not a network).
func BenchmarkDenseAllreduce(b *testing.B) {
	const p, n = 4, 1 << 20
	for _, alg := range denseAlgorithmsUnderTest {
		b.Run(alg.String(), func(b *testing.B) {
			data := cloneAll(integerInputs(p, n))
			b.SetBytes(4 * n)
			runInProc(b, p, func(ctx context.Context, r int, c *Communicator) error {
				for i := 0; i < b.N; i++ {
					if _, err := c.Allreduce(ctx, data[r], true, alg); err != nil {
						return err
					}
				}
				return nil
			})
		})
	}
}
