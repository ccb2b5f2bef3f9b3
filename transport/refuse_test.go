package transport

// Tests that the refusals a peer sends ahead of this rank are bounded.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// A peer that refuses call after call runs ahead (a refusal waits for
// nobody): past maxPendingRefusals of them this rank fails with a mismatch
// instead of keeping them all.
func TestRefusalsAheadAreBounded(t *testing.T) {
	ts := NewInProc(2)
	ctx := context.Background()
	for seq := uint64(1); seq <= maxPendingRefusals+1; seq++ {
		ts[1].RefuseCall(ctx, seq, "bad")
	}
	err := ts[0].Send(ctx, 1, Tag{Op: OpAllgather, Seq: 1}, DtypeBytes, 0, nil)
	if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), fmt.Sprintf("more than %d refused calls ahead", maxPendingRefusals)) {
		t.Fatalf("after %d refusals ahead: %v, want ErrMismatch naming the bound", maxPendingRefusals+1, err)
	}
}
