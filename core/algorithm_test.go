package core

// Tests of Config.K (the ceiling of density·n without the float product's
// rounding) and of the algorithm table: every algorithm has a complete row.

import (
	"errors"
	"strings"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

// K is ⌈density·n⌉ without the float product's rounding: 0.07·100 is
// 7.000000000000001 in float64, whose ceiling would select one entry too
// many, and so can k/n·n be for a density computed as k/n.
func TestKIsTheCeilingOfTheDecimalDensityTimesN(t *testing.T) {
	cases := []struct {
		density float64
		n, want int
	}{
		{0.07, 100, 7},
		{0.29, 100, 29}, // 0.29·100 = 28.999999999999996 in float64
		{0.01, 1000, 10},
		{0.01, 1001, 11},
		{0.001, 4194304, 4195},
		{0.01, 1 << 24, 167773},
		{1e-9, 10, 1},
		{0.5, 3, 2},
		{0, 100, 0},
		{1, 100, 100},
		{0.3, 0, 0},
		{40.0 / 3000, 3000, 40},
		{0.1, 30, 3}, // 0.1·30 = 3.0000000000000004
		{2.0 / 3, 3, 2},
	}
	for _, c := range cases {
		if got := (Config{Density: c.density}).K(c.n); got != c.want {
			t.Errorf("K(density %v, n %d) = %d, want %d", c.density, c.n, got, c.want)
		}
	}
}

// TestAlgorithmTableIsComplete: every algorithm of the enum has a row with
// a unique name that ParseAlgorithm gives back (in any case), a frame
// operation of its own (Auto alone never goes on the wire), and exactly one
// kind of entry point: a dense allreduce, or a sparse one.
func TestAlgorithmTableIsComplete(t *testing.T) {
	names := map[string]Algorithm{}
	ops := map[transport.Op]Algorithm{}
	for _, a := range Algorithms() {
		row := a.row()
		if row.name == "" {
			t.Fatalf("algorithm %d has no row", int(a))
		}
		if b, dup := names[row.name]; dup {
			t.Errorf("%v and algorithm %d share the name %q", b, int(a), row.name)
		}
		names[row.name] = a
		for _, name := range []string{row.name, strings.ToUpper(row.name)} {
			if got, err := ParseAlgorithm(name); err != nil || got != a {
				t.Errorf("ParseAlgorithm(%q) = %v, %v; want %v", name, got, err, a)
			}
		}
		if a == Auto {
			if row.op != transport.OpNone || row.dense != nil || row.sparse != nil || row.sparseInput != nil {
				t.Errorf("auto has entry points or an operation of its own: %+v", row)
			}
			continue
		}
		if b, dup := ops[row.op]; dup || row.op == transport.OpNone {
			t.Errorf("%v: operation %v (also %v's)", a, row.op, b)
		}
		ops[row.op] = a
		if (row.dense == nil) == (row.sparse == nil) {
			t.Errorf("%v: want exactly one of a dense and a sparse entry point", a)
		}
		if row.sparseInput != nil && row.sparse == nil {
			t.Errorf("%v: a sparse-input form without a sparse allreduce", a)
		}
	}
	if _, err := ParseAlgorithm("nope"); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "oktopk, topka") {
		t.Errorf("ParseAlgorithm(nope) = %v, want ErrInvalidArgument listing the names", err)
	}
	if Algorithm(-1).Dense() || Algorithm(numAlgorithms).takesReducedValues() || Algorithm(99).Op() != transport.OpNone {
		t.Error("an invalid algorithm has properties")
	}
}
