package core

// ξ, on demand: how far a sparse allreduce's result is from the exact top-k
// of the accumulated gradients' sum (Assumption 1 of the Ok-Topk paper,
// which bounds the algorithm's convergence by it; its §5.1 measures it
// during training):
//
//	ξ = ‖Topk(Σ_r acc_r) − result‖ / ‖Σ_r grad_r‖
//
// where acc_r = grad_r + residual_r on rank r before the call, Topk keeps
// the call's k entries of largest magnitude, and result is the call's
// sparse global sum (P × the averaged output).
//
// Steps of a call with CallOptions.MeasureXi:
//  1. Before the call, every rank forms [grad_r, acc_r] in a buffer of its
//     own and sums it over the ranks with a dense ring allreduce, as a
//     collective of its own sequence number (operation xi_sums): a rank
//     that did not ask for ξ in the same call meets a different operation
//     and every rank fails with ErrMismatch, with nothing changed. The
//     call's own buffer and state are only read, so the call's result is
//     bitwise what it is without ξ, and a failure of this step leaves
//     everything as it was.
//  2. The call runs as usual.
//  3. On success, each rank takes the exact top-k of Σ acc (k the call's
//     Stats.K) and the distance to P × its output. Every input is bitwise
//     alike on every rank, so every rank reports the same ξ.
//
// The cost (a dense allreduce of 2n values, an exact top-k, 2n words of
// memory for the call) is what the diagnostic needs; the bytes it moves
// are the call's Stats.XiBytesSent and XiBytesReceived, apart from the
// algorithm's own.

import (
	"context"
	"fmt"
	"math"

	"github.com/oktopk/oktopk/transport"
)

// xiSums holds Σ_r grad_r and Σ_r acc_r of one call, and the bytes this
// rank sent and received to form them.
type xiSums struct {
	grad, acc      []float32
	sent, received uint64
}

// measureXiSums is step 1 as call seq (taken by begin); it returns the sums
// and the sequence number the call itself then takes.
func (c *Communicator) measureXiSums(ctx context.Context, seq, id uint64, st *TensorState, grad []float32, dtype transport.Dtype) (*xiSums, uint64, error) {
	n := len(grad)
	buf := make([]float32, 2*n)
	copy(buf[:n], grad)
	Accumulate(buf[n:], grad, st.Residual)
	desc := DescribeCall(dtype, id, 2*n, 2*n)
	desc.Completed = uint32(st.Iter)
	var traffic Stats
	call := NewCall(c.T, transport.OpXiSums, seq, &traffic, WithDesc(desc))
	err := RingAllreduce(ctx, call, buf)
	call.EndPhases()
	if err != nil {
		return nil, seq, fmt.Errorf("oktopk: the sums that measure xi: %w", err)
	}
	c.seq++
	return &xiSums{grad: buf[:n:n], acc: buf[n:], sent: traffic.BytesSent, received: traffic.BytesReceived}, c.seq, nil
}

// report is step 3: ξ of the call whose averaged output over p ranks is out
// and whose k is stats.K, into stats.
func (x *xiSums) report(stats *Stats, out []float32, p int) {
	stats.XiMeasured = true
	stats.XiBytesSent, stats.XiBytesReceived = x.sent, x.received
	var den float64
	for _, g := range x.grad {
		den += float64(g) * float64(g)
	}
	stats.XiGradNorm = math.Sqrt(den)
	top, err := TopK(x.acc, stats.K)
	if err != nil {
		// The sum overflowed to ±Inf (a NaN or Inf in some acc_r skips the
		// call before this): the distance has no value.
		stats.Xi = math.NaN()
		return
	}
	var num float64
	j := 0
	for i, v := range out {
		want := 0.0
		if j < len(top.Idx) && int(top.Idx[j]) == i {
			want = float64(top.Val[j])
			j++
		}
		d := want - float64(p)*float64(v)
		num += d * d
	}
	switch {
	case num == 0:
		stats.Xi = 0 // also when Σ grad is 0: nothing was left out
	default:
		stats.Xi = math.Sqrt(num) / stats.XiGradNorm // +Inf when Σ grad is 0
	}
}
