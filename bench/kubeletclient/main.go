// Command kubeletclient is the kubelet's side of device plugin admissions for
// bench/deviceplugin_latency.py (--client go): the calls a kubelet, a Go program, makes, with the
// kubelet's own generated v1beta1 client, so that the benchmark's client costs what the kubelet's
// does rather than what a Python gRPC client does.
//
// It reads one JSON object per line on stdin, a round:
//
//	{"socket": "/plugin/dir/tessera.sock", "free": ["GPU-x::0", ...], "pods": ["r0-p0", ...], "concurrency": 20}
//
// and admits each pod's container as bench/deviceplugin_latency.py's Admissions does, "concurrency"
// at a time: GetPreferredAllocation of one device among the slices still free, then Allocate of a
// free slice of the GPU it names. For each admission it writes one JSON line as soon as Allocate
// answered,
//
//	{"pod": "r0-p0", "device": "GPU-x::3", "preferred_ms": 1.2, "allocate_ms": 2.3}
//
// (the benchmark then names the pod as the slice's holder in its pod-resources API, as a kubelet
// does), and {"done": true} once every pod of the round is admitted. A failed call ends the program
// with {"error": "..."} on stdout and exit status 1.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// The kubelet's device manager gives each plugin call this long (pluginapi has no constant for it).
const callTimeout = 30 * time.Second

type round struct {
	Socket      string   `json:"socket"`
	Free        []string `json:"free"`
	Pods        []string `json:"pods"`
	Concurrency int      `json:"concurrency"`
}

type admission struct {
	Pod         string  `json:"pod"`
	Device      string  `json:"device"`
	PreferredMs float64 `json:"preferred_ms"`
	AllocateMs  float64 `json:"allocate_ms"`
}

type output struct {
	mu  sync.Mutex
	out *bufio.Writer
}

func (o *output) write(value any) {
	line, err := json.Marshal(value)
	if err != nil {
		panic(err) // only plain structs and maps are written
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.out.Write(line)
	o.out.WriteByte('\n')
	o.out.Flush()
}

func (o *output) fail(err error) {
	o.write(map[string]string{"error": err.Error()})
	os.Exit(1)
}

// devices is the round's device bookkeeping, as the kubelet's device manager keeps it: the free
// slices, each taken once.
type devices struct {
	mu   sync.Mutex
	free map[string]bool
}

func (d *devices) list() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	ids := make([]string, 0, len(d.free))
	for id := range d.free {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// take removes and returns the first free slice (in sorted order) of the GPU that device belongs to.
func (d *devices) take(device string) (string, error) {
	gpu, _, _ := strings.Cut(device, "::")
	d.mu.Lock()
	defer d.mu.Unlock()
	candidates := []string{}
	for id := range d.free {
		if strings.HasPrefix(id, gpu+"::") {
			candidates = append(candidates, id)
		}
	}
	if len(candidates) == 0 {
		return "", fmt.Errorf("no free slice of GPU %q (preferred %q)", gpu, device)
	}
	sort.Strings(candidates)
	delete(d.free, candidates[0])
	return candidates[0], nil
}

func milliseconds(since time.Time) float64 {
	return float64(time.Since(since).Nanoseconds()) / 1e6
}

func admit(client pluginapi.DevicePluginClient, free *devices, pod string) (admission, error) {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	start := time.Now()
	preferred, err := client.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
		ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
			{AvailableDeviceIDs: free.list(), AllocationSize: 1},
		},
	})
	if err != nil {
		return admission{}, fmt.Errorf("GetPreferredAllocation for pod %s: %w", pod, err)
	}
	preferredMs := milliseconds(start)
	responses := preferred.GetContainerResponses()
	if len(responses) != 1 || len(responses[0].GetDeviceIDs()) == 0 {
		return admission{}, fmt.Errorf("GetPreferredAllocation for pod %s: no device in %v", pod, preferred)
	}
	slice, err := free.take(responses[0].GetDeviceIDs()[0])
	if err != nil {
		return admission{}, fmt.Errorf("pod %s: %w", pod, err)
	}
	start = time.Now()
	_, err = client.Allocate(ctx, &pluginapi.AllocateRequest{
		ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{slice}}},
	})
	if err != nil {
		return admission{}, fmt.Errorf("Allocate of %s for pod %s: %w", slice, pod, err)
	}
	return admission{Pod: pod, Device: slice, PreferredMs: preferredMs, AllocateMs: milliseconds(start)}, nil
}

func run(out *output, connections map[string]*grpc.ClientConn, r round) error {
	if r.Concurrency < 1 {
		return fmt.Errorf("concurrency: bad value %d, must be at least 1", r.Concurrency)
	}
	conn, ok := connections[r.Socket]
	if !ok {
		var err error
		conn, err = grpc.NewClient("unix://"+r.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return fmt.Errorf("socket %q: %w", r.Socket, err)
		}
		connections[r.Socket] = conn
	}
	client := pluginapi.NewDevicePluginClient(conn)
	free := &devices{free: map[string]bool{}}
	for _, id := range r.Free {
		free.free[id] = true
	}
	pods := make(chan string)
	errs := make(chan error, len(r.Pods))
	var workers sync.WaitGroup
	for range r.Concurrency {
		workers.Add(1)
		go func() {
			defer workers.Done()
			for pod := range pods {
				result, err := admit(client, free, pod)
				if err != nil {
					errs <- err
					continue
				}
				out.write(result)
			}
		}()
	}
	for _, pod := range r.Pods {
		pods <- pod
	}
	close(pods)
	workers.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	out.write(map[string]bool{"done": true})
	return nil
}

func main() {
	out := &output{out: bufio.NewWriter(os.Stdout)}
	connections := map[string]*grpc.ClientConn{}
	lines := bufio.NewScanner(os.Stdin)
	lines.Buffer(make([]byte, 1<<20), 1<<24)
	for lines.Scan() {
		var r round
		if err := json.Unmarshal(lines.Bytes(), &r); err != nil {
			out.fail(fmt.Errorf("round: bad JSON %q: %w", lines.Text(), err))
		}
		if err := run(out, connections, r); err != nil {
			out.fail(err)
		}
	}
	if err := lines.Err(); err != nil {
		out.fail(fmt.Errorf("stdin: %w", err))
	}
}
