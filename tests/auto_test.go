package tests

// Tests that Auto picks the same algorithm, with the same output bits, on
// every rank of a job of separate processes.

import (
	"bufio"
	"strings"
	"testing"
	"time"
)

// TestAutoChoicesAgreeAcrossProcesses starts 5 OS processes of the rank
// command on 127.0.0.1 (so the link measurement pairs four of them and
// leaves one out) running the same random sequence of Auto calls: tensors
// of 1 to 2^17 elements, densities from 0.1% to 1, the three caller dtypes,
// the link re-measured every ten calls. Every rank must run the same
// algorithm in every call, with the same output bits.
func TestAutoChoicesAgreeAcrossProcesses(t *testing.T) {
	const p, calls = 5, 40
	cmds, outs := startRanks(t, buildRank(t), p, "-auto", "40", "-timeout", "90s")
	waitRanks(t, cmds, outs, 120*time.Second)
	if t.Failed() {
		return
	}
	lines := make([][]string, p)
	for r := range outs {
		sc := bufio.NewScanner(strings.NewReader(outs[r].String()))
		for sc.Scan() {
			switch line := sc.Text(); {
			case strings.HasPrefix(line, "auto call "):
				lines[r] = append(lines[r], line)
			case r == 0 && strings.HasPrefix(line, "link measured"):
				t.Logf("rank 0: %s", line)
			}
		}
	}
	var dense, sparse int
	for i := 0; i < calls; i++ {
		for r := 0; r < p; r++ {
			if len(lines[r]) != calls {
				t.Fatalf("rank %d printed %d calls, want %d:\n%s", r, len(lines[r]), calls, outs[r])
			}
			if lines[r][i] != lines[0][i] {
				t.Fatalf("rank %d: %q, rank 0: %q", r, lines[r][i], lines[0][i])
			}
		}
		if f := strings.Fields(lines[0][i]); strings.HasPrefix(f[3], "dense") {
			dense++
		} else {
			sparse++
		}
	}
	if dense == 0 || sparse == 0 {
		t.Fatalf("the sequence chose %d dense and %d sparse algorithms; the test needs both", dense, sparse)
	}
	t.Logf("%d processes agreed on %d Auto calls (%d dense, %d sparse choices)", p, calls, dense, sparse)
}
