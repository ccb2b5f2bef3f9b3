package tests

// The in-process transport stands for the network in the scaling study
// (bench/cmd/scale, results/scale.md), which counts traffic at up to 1,024
// ranks in one process: that holds only if the same calls over both
// transports compute the same thing and send the same thing.

import (
	"context"
	"fmt"
	"testing"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/internal/testref"
	"github.com/oktopk/oktopk/transport"
)

// traffic is what a call's Stats say it sent and received, without times.
type traffic struct {
	bytesSent, bytesReceived, messagesSent, messagesReceived uint64
	phases                                                   [core.NumPhases][4]uint64
	k, localSelected, globalSelected, kept                   int
	repartitionWords, repartitionMessages                    int
}

func trafficOf(st core.Stats) traffic {
	tr := traffic{bytesSent: st.BytesSent, bytesReceived: st.BytesReceived, messagesSent: st.MessagesSent,
		messagesReceived: st.MessagesReceived, k: st.K, localSelected: st.LocalSelected,
		globalSelected: st.GlobalSelected, kept: st.Kept, repartitionWords: st.RepartitionWords,
		repartitionMessages: st.RepartitionMessages}
	for p, ph := range st.Phases {
		tr.phases[p] = [4]uint64{ph.BytesSent, ph.BytesReceived, ph.MessagesSent, ph.MessagesReceived}
	}
	return tr
}

// Every algorithm but Auto (whose choice follows a measured link), at
// P = 2, 3, 5 and 8 (2 and 8 under -race), four calls with τ′ = 2 and τ = 3 (so Ok-Topk's
// exact, reuse and repartition calls all run), on inputs whose first fifth
// is eight times larger (uneven regions, so the balance step moves
// entries): over the in-process transport and over ZeroMQ on loopback,
// every rank's result and residual are bitwise equal, and so are its words
// and messages sent and received in every phase.
func TestInProcAndZMQGiveEqualResultsAndTraffic(t *testing.T) {
	const n, calls = 20011, 4
	ranks := []int{2, 3, 5, 8}
	if raceEnabled {
		ranks = []int{2, 8}
	}
	for _, p := range ranks {
		zmqSide := zmqComms(t, p)
		inprocSide := make([]*core.Communicator, p)
		for r, tr := range transport.NewInProc(p) {
			inprocSide[r] = core.NewCommunicator(tr)
		}
		t.Cleanup(func() {
			for _, c := range inprocSide {
				c.T.Close()
			}
		})
		for _, alg := range core.Algorithms() {
			if alg == core.Auto {
				continue
			}
			t.Run(fmt.Sprintf("P=%d/%v", p, alg), func(t *testing.T) {
				id := uint64(alg) + 1
				cfg := core.Config{Algorithm: alg, Density: 0.01, Tau: 3, TauPrime: 2}
				inputs := newDriftingInputs(p, n, uint64(10*p)+uint64(alg))
				for call := 0; call < calls; call++ {
					in := inputs.next()
					for _, g := range in {
						for i := range g[:n/5] {
							g[i] *= 8
						}
					}
					var out [2][][]float32
					var stats [2][]core.Stats
					for side, comms := range [2][]*core.Communicator{inprocSide, zmqSide} {
						out[side], stats[side] = make([][]float32, p), make([]core.Stats, p)
						runRanks(t, comms, func(ctx context.Context, r int, c *core.Communicator) error {
							out[side][r] = append([]float32(nil), in[r]...)
							st, err := c.SparseAllreduce(ctx, id, out[side][r], cfg)
							stats[side][r] = st
							if err != nil {
								return fmt.Errorf("call %d: %w", call, err)
							}
							return nil
						})
					}
					for r := 0; r < p; r++ {
						if i, bad := testref.FirstBitwiseDifference(out[0][r], out[1][r]); bad {
							t.Fatalf("call %d rank %d element %d: %v in process, %v over ZeroMQ", call, r, i, out[0][r][i], out[1][r][i])
						}
						if st := inprocSide[r].TensorStateOf(id); st != nil {
							zst := zmqSide[r].TensorStateOf(id)
							if i, bad := testref.FirstBitwiseDifference(st.Residual, zst.Residual); bad {
								t.Fatalf("call %d rank %d residual %d: %v in process, %v over ZeroMQ", call, r, i, st.Residual[i], zst.Residual[i])
							}
						}
						if a, b := trafficOf(stats[0][r]), trafficOf(stats[1][r]); a != b {
							t.Fatalf("call %d rank %d: in process %+v, over ZeroMQ %+v", call, r, a, b)
						}
					}
				}
			})
		}
	}
}
