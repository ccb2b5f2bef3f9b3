//go:build race

package tests

// raceEnabled lets a test shrink work that the race detector makes slow
// without anything to add (its code paths are raced at smaller sizes).
const raceEnabled = true
