package core

import "testing"

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
