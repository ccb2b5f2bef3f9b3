package main

// Tests that a failed init closes the rendezvous of the unique id that
// the same process made.

import (
	"context"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// A failed init on the process that made the unique id closes the id's
// rendezvous: its server leaves the table and its port stops answering.
func TestFailedInitClosesItsUniqueIDsRendezvous(t *testing.T) {
	s := defaultSettings()
	s.timeout = 300 * time.Millisecond
	s.bindHost = "127.0.0.1"
	text, err := newUniqueID(s)
	if err != nil {
		t.Fatal(err)
	}
	id, err := transport.ParseUniqueID(text)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := initFromUniqueID(text, 0, 2, s); err == nil { // rank 1 never comes
		t.Fatal("init of rank 0 of 2 alone succeeded")
	}
	uniqueIDServers.Lock()
	_, held := uniqueIDServers.m[text]
	uniqueIDServers.Unlock()
	if held {
		t.Fatal("the failed init left the id's rendezvous server registered")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if _, err := transport.DialStore(ctx, id.Addr, id.Token); err == nil {
		t.Fatal("the id's rendezvous still answers after the failed init")
	}
}
