// extproc-floor-go: the floor of an endpoint picker written in Go, for
// luftpause.loadgen.proxy_bench picker. An Envoy ext_proc server (grpc-go) that answers every
// message Envoy sends with a constant, exactly as luftpause.loadgen.floor_extproc does on
// grpc.aio: the request body with one fixed destination (the x-gateway-destination-endpoint
// header and the envoy.lb dynamic metadata), every other message "go on", nothing to the
// messages of a filter in observability mode. No route, identity, JSON, admission,
// scheduler link, metrics or logs: what this row costs per turn, a picker in Go cannot go
// below with the same processing modes; what it saves against the Python floor is what
// moving the picker's protocol work out of Python would save.
//
//	extproc-floor-go -port 9102 -destination 127.0.0.1:8101
package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"

	protov1 "github.com/golang/protobuf/proto"
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	pb "luftpause/extprocpb"
)

const (
	extProcService = "envoy.service.ext_proc.v3.ExternalProcessor"
	destination    = "x-gateway-destination-endpoint"
	lbNamespace    = "envoy.lb"
)

// codec is gRPC's "proto" codec for both protobuf APIs. Debian's grpc-go (1.33) marshals
// with github.com/golang/protobuf 1.3, which predates the API protoc-gen-go now generates
// (its table unmarshaller panics on a message with a oneof); later grpc-go releases
// marshal with google.golang.org/protobuf, as this does. The health service's messages,
// generated for the older API, go through the older package.
type codec struct{}

func (codec) Name() string { return "proto" }

func (codec) Marshal(v interface{}) ([]byte, error) {
	if message, ok := v.(proto.Message); ok {
		return proto.Marshal(message)
	}
	return protov1.Marshal(v.(protov1.Message))
}

func (codec) Unmarshal(data []byte, v interface{}) error {
	if message, ok := v.(proto.Message); ok {
		return proto.Unmarshal(data, message)
	}
	return protov1.Unmarshal(data, v.(protov1.Message))
}

type constantProcessor struct {
	pb.UnimplementedExternalProcessorServer
	requestHeaders, requestBody, responseHeaders, responseBody *pb.ProcessingResponse
	requestTrailers, responseTrailers                         *pb.ProcessingResponse
}

// newConstantProcessor builds the one answer to each kind of message.
func newConstantProcessor(endpoint string) *constantProcessor {
	metadata := &structpb.Struct{Fields: map[string]*structpb.Value{
		lbNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			destination: structpb.NewStringValue(endpoint)}})}}
	header := &pb.HeaderValueOption{Header: &pb.HeaderValue{Key: destination, RawValue: []byte(endpoint)}}
	routed := &pb.BodyResponse{Response: &pb.CommonResponse{
		HeaderMutation: &pb.HeaderMutation{SetHeaders: []*pb.HeaderValueOption{header}}}}
	return &constantProcessor{
		requestHeaders: &pb.ProcessingResponse{Response: &pb.ProcessingResponse_RequestHeaders{
			RequestHeaders: &pb.HeadersResponse{}}},
		requestBody: &pb.ProcessingResponse{Response: &pb.ProcessingResponse_RequestBody{RequestBody: routed},
			DynamicMetadata: metadata},
		responseHeaders: &pb.ProcessingResponse{Response: &pb.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &pb.HeadersResponse{}}},
		responseBody: &pb.ProcessingResponse{Response: &pb.ProcessingResponse_ResponseBody{
			ResponseBody: &pb.BodyResponse{}}},
		requestTrailers: &pb.ProcessingResponse{Response: &pb.ProcessingResponse_RequestTrailers{
			RequestTrailers: &pb.TrailersResponse{}}},
		responseTrailers: &pb.ProcessingResponse{Response: &pb.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &pb.TrailersResponse{}}},
	}
}

func (p *constantProcessor) answer(message *pb.ProcessingRequest) *pb.ProcessingResponse {
	switch message.Request.(type) {
	case *pb.ProcessingRequest_RequestHeaders:
		return p.requestHeaders
	case *pb.ProcessingRequest_RequestBody:
		return p.requestBody
	case *pb.ProcessingRequest_ResponseHeaders:
		return p.responseHeaders
	case *pb.ProcessingRequest_ResponseBody:
		return p.responseBody
	case *pb.ProcessingRequest_RequestTrailers:
		return p.requestTrailers
	case *pb.ProcessingRequest_ResponseTrailers:
		return p.responseTrailers
	}
	return nil
}

// Process answers each message of one HTTP request's stream as it comes.
func (p *constantProcessor) Process(stream pb.ExternalProcessor_ProcessServer) error {
	for {
		message, err := stream.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if message.ObservabilityMode { // an observing filter's messages want no answer
			continue
		}
		answer := p.answer(message)
		if answer == nil {
			return fmt.Errorf("a message of no kind this floor knows")
		}
		if err := stream.Send(answer); err != nil {
			return err
		}
	}
}

func main() {
	host := flag.String("host", "127.0.0.1", "the address to listen on")
	port := flag.Int("port", 0, "the ext_proc gRPC port Envoy calls (required)")
	endpoint := flag.String("destination", "", "the engine's ip:port, every request's destination (required)")
	flag.Parse()
	if *port == 0 || *endpoint == "" {
		fmt.Fprintln(os.Stderr, "extproc-floor-go: -port and -destination are required")
		os.Exit(2)
	}
	listener, err := net.Listen("tcp", fmt.Sprintf("%s:%d", *host, *port))
	if err != nil {
		fmt.Fprintf(os.Stderr, "extproc-floor-go: listen: %v\n", err)
		os.Exit(1)
	}
	encoding.RegisterCodec(codec{})
	server := grpc.NewServer()
	pb.RegisterExternalProcessorServer(server, newConstantProcessor(*endpoint))
	checks := health.NewServer()
	for _, name := range []string{"", extProcService} {
		checks.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
	}
	healthpb.RegisterHealthServer(server, checks)
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		server.Stop()
	}()
	if err := server.Serve(listener); err != nil {
		fmt.Fprintf(os.Stderr, "extproc-floor-go: serve: %v\n", err)
		os.Exit(1)
	}
}
