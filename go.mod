module github.com/oktopk/oktopk

go 1.26.8

require (
	github.com/pebbe/zmq4 v1.4.0
	github.com/vmihailenco/msgpack/v5 v5.4.1
	golang.org/x/sync v0.24.0
)

require github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
