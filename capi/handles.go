package main

// The handle table: the integers that C callers hold for communicators and
// requests, and the objects they name on this side.

import "sync"

// table maps integer handles to objects, so that no Go pointer ever crosses
// into C. Handles count up from the table's base and are never reused, which
// lets a lookup tell a destroyed handle from one that never existed; tables
// have far-apart bases so that a request passed as a communicator (or the
// reverse) is caught.
type table[T any] struct {
	mu   sync.Mutex
	base int64
	next int64
	live map[int64]T
}

func newTable[T any](base int64) *table[T] {
	return &table[T]{base: base, next: base, live: make(map[int64]T)}
}

func (t *table[T]) add(v T) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next++
	t.live[t.next] = v
	return t.next
}

// get returns the object of h, or ErrInvalidUsage saying why there is none.
func (t *table[T]) get(kind string, h int64) (T, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if v, ok := t.live[h]; ok {
		return v, nil
	}
	var zero T
	return zero, t.missing(kind, h)
}

// remove takes h out of the table; only one of several concurrent removes
// of the same handle succeeds, the others get ErrInvalidUsage.
func (t *table[T]) remove(kind string, h int64) (T, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.live[h]
	if !ok {
		return v, t.missing(kind, h)
	}
	delete(t.live, h)
	return v, nil
}

func (t *table[T]) missing(kind string, h int64) error {
	if h > t.base && h <= t.next {
		return invalidUsage("%s %d was already destroyed", kind, h)
	}
	return invalidUsage("%d is not a %s handle", h, kind)
}

// peek is get without the error, for recording last errors.
func (t *table[T]) peek(h int64) T {
	v, _ := t.get("", h)
	return v
}

var (
	comms    = newTable[*communicator](0)
	requests = newTable[*request](1 << 40)
)

// register enters c in the table and gives it its handle.
func register(c *communicator) int64 {
	comms.mu.Lock()
	defer comms.mu.Unlock()
	comms.next++
	c.handle = comms.next
	comms.live[c.handle] = c
	return c.handle
}
