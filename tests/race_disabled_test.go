//go:build !race

package tests

// raceEnabled is false in a build without the race detector (its twin,
// race_enabled_test.go, says why tests read it).

const raceEnabled = false
