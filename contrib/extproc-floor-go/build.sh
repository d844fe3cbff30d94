#!/bin/sh
# Builds extproc-floor-go from Debian's Go packages alone (GOPATH mode, no module
# downloads): golang-go, golang-google-grpc-dev, golang-google-protobuf-dev,
# protobuf-compiler, protoc-gen-go-grpc. Usage: build.sh OUTPUT_BINARY
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUTPUT_BINARY}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GO111MODULE=off GOFLAGS= GOPATH="$work/gopath:/usr/share/gocode" GOCACHE="${GOCACHE:-$work/cache}"
mkdir -p "$work/bin" "$work/gopath/src/luftpause/extproc-floor-go"
# protoc-gen-go is packaged as source only: built from golang-google-protobuf-dev's tree.
go build -o "$work/bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
PATH="$work/bin:$PATH" protoc -I "$here" -I /usr/include --go_out="$work/gopath/src" \
  --go-grpc_out="$work/gopath/src" "$here/external_processor.proto"
cp "$here/main.go" "$work/gopath/src/luftpause/extproc-floor-go/"
mkdir -p "$(dirname "$out")"
go build -trimpath -o "$out" luftpause/extproc-floor-go
