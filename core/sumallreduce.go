package core

// SumAllreduce: the allreduce of a small vector of unsigned integers, for
// control messages (Ok-Topk's histograms and region boundaries beyond
// okTopkGatheredControlMaxP ranks). Integers sum exactly in any order, so
// every rank ends with the same bits whatever the order of the additions.
//
// The schedule is Rabenseifner's (rabenseifner.go), without its phases:
// the extra ranks beyond the largest power of two P′ ≤ P fold their
// vectors into an even neighbour, the P′ ranks left reduce-scatter by
// recursive halving (the vector cut into P′ chunks, chunkStart) and
// allgather by recursive doubling, and the result is unfolded. A range
// that is empty on both sides of an exchange (a vector shorter than P′
// leaves many chunks empty) is not sent: both ranks know its size.
//
// Cost, for a vector of m values: 2⌊log₂ P⌋ rounds (plus 2 when P is not a
// power of two), and over the P′ ranks that stay exactly 2m(P′−1) values
// sent in all — 2m(P′−1)/P′ per rank on average. The P′ chunks hold
// ⌊m/P′⌋ or ⌈m/P′⌉ values, so a rank's share differs from the average by
// less than one value per round. An extra rank sends its m values and
// nothing else; its even neighbour sends m more than its share (the
// unfold). A value is one word (uint32) or two (uint64). Against an
// allgather of every rank's vector (m(P−1) values per rank) it trades
// ⌊log₂ P⌋ more rounds for a volume that does not grow with P.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/bits"

	"github.com/oktopk/oktopk/transport"
)

// controlWord is the element of a vector SumAllreduce sums: travelling in
// 4 or 8 bytes.
type controlWord interface{ uint32 | uint64 }

func controlWordSize[T controlWord]() int {
	var z T
	if _, ok := any(z).(uint32); ok {
		return 4
	}
	return 8
}

// SumAllreduceSteps is how many step numbers SumAllreduce uses from its
// first: the fold, ⌊log₂ P⌋ halving and as many doubling rounds, the
// unfold.
func SumAllreduceSteps(p int) uint32 {
	return uint32(2*(bits.Len(uint(max(p, 1)))-1) + 2)
}

// SumAllreduce sums data over every rank of call, element by element, in
// place (modulo 2^32 or 2^64: callers keep their sums within range). Every
// rank must pass a vector of the same length; one of another length makes
// the call fail with ErrMismatch. It sends and receives in whatever phase
// the call is in. Steps are numbered from firstStep; it uses at most
// SumAllreduceSteps(P) of them.
func SumAllreduce[T controlWord](ctx context.Context, call *Call, firstStep uint32, data []T) error {
	p, r := call.Size(), call.Rank()
	if p <= 1 {
		return nil
	}
	n, size := len(data), controlWordSize[T]()
	rounds := bits.Len(uint(p)) - 1
	pow2 := 1 << rounds
	extra := p - pow2
	foldStep, firstHalving, firstDoubling, unfoldStep := firstStep, firstStep+1, firstStep+1+uint32(rounds), firstStep+1+2*uint32(rounds)

	send := func(peer int, step uint32, v []T) error {
		if len(v) == 0 {
			return nil
		}
		buf := make([]byte, 0, size*len(v))
		for _, x := range v {
			if size == 4 {
				buf = binary.LittleEndian.AppendUint32(buf, uint32(x))
			} else {
				buf = binary.LittleEndian.AppendUint64(buf, uint64(x))
			}
		}
		return call.Send(ctx, peer, step, transport.DtypeBytes, uint64(len(buf)), buf)
	}
	// recv receives len(into) values from peer and adds them into into, or
	// copies them.
	recv := func(peer int, step uint32, into []T, add bool) error {
		if len(into) == 0 {
			return nil
		}
		m, err := call.Recv(ctx, peer, step)
		if err != nil {
			return err
		}
		if len(m.Payload) != size*len(into) || m.Count != uint64(len(m.Payload)) || m.Dtype != transport.DtypeBytes {
			return fmt.Errorf("%w: rank %d sent %d bytes (%s) in a control allreduce, where rank %d (this rank) expects %d: the ranks' vectors differ in length",
				ErrMismatch, peer, len(m.Payload), m.Dtype, r, size*len(into))
		}
		for i := range into {
			var x T
			if size == 4 {
				x = T(binary.LittleEndian.Uint32(m.Payload[4*i:]))
			} else {
				x = T(binary.LittleEndian.Uint64(m.Payload[8*i:]))
			}
			if add {
				into[i] += x
			} else {
				into[i] = x
			}
		}
		return nil
	}

	// Fold the extra ranks into their even neighbours.
	var v int
	switch {
	case r < 2*extra && r%2 == 1:
		if err := send(r-1, foldStep, data); err != nil {
			return fmt.Errorf("oktopk: control allreduce, fold to rank %d: %w", r-1, err)
		}
		if err := recv(r-1, unfoldStep, data, false); err != nil {
			return fmt.Errorf("oktopk: control allreduce, unfold from rank %d: %w", r-1, err)
		}
		return nil
	case r < 2*extra:
		if err := recv(r+1, foldStep, data, true); err != nil {
			return fmt.Errorf("oktopk: control allreduce, fold from rank %d: %w", r+1, err)
		}
		v = r / 2
	default:
		v = r - extra
	}
	span := func(lo, hi int) []T { return data[chunkStart(n, pow2, lo):chunkStart(n, pow2, hi)] }

	// Recursive halving; [lo, hi) is the chunk range still being summed here.
	lo, hi := 0, pow2
	for j, d := 0, pow2/2; d >= 1; j, d = j+1, d/2 {
		mid := (lo + hi) / 2
		keep, give := span(lo, mid), span(mid, hi)
		if v&d != 0 {
			keep, give = give, keep
		}
		peer := foldedRank(v^d, extra)
		if err := send(peer, firstHalving+uint32(j), give); err != nil {
			return fmt.Errorf("oktopk: control allreduce, reduce-scatter with rank %d: %w", peer, err)
		}
		if err := recv(peer, firstHalving+uint32(j), keep, true); err != nil {
			return fmt.Errorf("oktopk: control allreduce, reduce-scatter with rank %d: %w", peer, err)
		}
		if v&d != 0 {
			lo = mid
		} else {
			hi = mid
		}
	}

	// Recursive doubling; [lo, hi) is the chunk range complete here. The
	// sums are copied, never re-added.
	for j, d := 0, 1; d < pow2; j, d = j+1, d*2 {
		width := hi - lo
		sibLo, sibHi := hi, hi+width
		if v&d != 0 {
			sibLo, sibHi = lo-width, lo
		}
		peer := foldedRank(v^d, extra)
		if err := send(peer, firstDoubling+uint32(j), span(lo, hi)); err != nil {
			return fmt.Errorf("oktopk: control allreduce, allgather with rank %d: %w", peer, err)
		}
		if err := recv(peer, firstDoubling+uint32(j), span(sibLo, sibHi), false); err != nil {
			return fmt.Errorf("oktopk: control allreduce, allgather with rank %d: %w", peer, err)
		}
		lo, hi = min(lo, sibLo), max(hi, sibHi)
	}

	// Hand the result to the folded-in neighbour.
	if r < 2*extra {
		if err := send(r+1, unfoldStep, data); err != nil {
			return fmt.Errorf("oktopk: control allreduce, unfold to rank %d: %w", r+1, err)
		}
	}
	return nil
}
