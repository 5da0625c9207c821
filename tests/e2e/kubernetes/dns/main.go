// The e2e cluster's DNS: answers the names Kubernetes DNS gives the pods of a headless Service
// (<hostname>.<subdomain>.<namespace>.svc.<zone>, and the Service's own name), looked up in the
// API server on each query, as Trainer's PET_MASTER_ADDR names a pod. Every node of this cluster
// is this machine and its stage pods use the host network, so such a pod's address is 127.0.0.1.
// Other names are NXDOMAIN. UDP only, A and AAAA: what glibc's resolver asks.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

const (
	typeA    = 1
	typeAAAA = 28
	classIN  = 1
	rcodeOK  = 0
	rcodeFmt = 1
	rcodeNX  = 3
	rcodeNI  = 4
)

type api struct {
	server string
	token  string
	client *http.Client
}

type pod struct {
	Metadata struct {
		Name              string  `json:"name"`
		DeletionTimestamp *string `json:"deletionTimestamp"`
	} `json:"metadata"`
	Spec struct {
		Hostname    string `json:"hostname"`
		Subdomain   string `json:"subdomain"`
		NodeName    string `json:"nodeName"`
		HostNetwork bool   `json:"hostNetwork"`
	} `json:"spec"`
	Status struct {
		Phase string `json:"phase"`
	} `json:"status"`
}

func (a *api) get(path string, out any) (bool, error) {
	req, err := http.NewRequest(http.MethodGet, a.server+path, nil)
	if err != nil {
		return false, err
	}
	req.Header.Set("Authorization", "Bearer "+a.token)
	resp, err := a.client.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		return false, nil
	}
	if resp.StatusCode != http.StatusOK {
		return false, fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	return true, json.NewDecoder(resp.Body).Decode(out)
}

// headless says whether namespace/name is a Service without a cluster IP.
func (a *api) headless(namespace, name string) (bool, error) {
	var svc struct {
		Spec struct {
			ClusterIP string `json:"clusterIP"`
		} `json:"spec"`
	}
	found, err := a.get("/api/v1/namespaces/"+url.PathEscape(namespace)+"/services/"+url.PathEscape(name), &svc)
	return found && svc.Spec.ClusterIP == "None", err
}

// pods of the headless Service `subdomain`, scheduled, not ending, on the host network; with
// hostname set, only the pod of that hostname.
func (a *api) pods(namespace, subdomain, hostname string) ([]pod, error) {
	var list struct {
		Items []pod `json:"items"`
	}
	if _, err := a.get("/api/v1/namespaces/"+url.PathEscape(namespace)+"/pods", &list); err != nil {
		return nil, err
	}
	var out []pod
	for _, p := range list.Items {
		live := p.Metadata.DeletionTimestamp == nil && p.Spec.NodeName != "" &&
			(p.Status.Phase == "Pending" || p.Status.Phase == "Running")
		if live && p.Spec.HostNetwork && p.Spec.Subdomain == subdomain && (hostname == "" || p.Spec.Hostname == hostname) {
			out = append(out, p)
		}
	}
	return out, nil
}

// resolve says whether the name exists, and which pods stand behind it.
func (a *api) resolve(name, zone string) ([]pod, error) {
	suffix := ".svc." + zone
	if !strings.HasSuffix(name, suffix) {
		return nil, nil
	}
	labels := strings.Split(strings.TrimSuffix(name, suffix), ".")
	var host, sub, ns string
	switch len(labels) {
	case 2: // <service>.<namespace>
		sub, ns = labels[0], labels[1]
	case 3: // <hostname>.<subdomain>.<namespace>
		host, sub, ns = labels[0], labels[1], labels[2]
	default:
		return nil, nil
	}
	if ok, err := a.headless(ns, sub); !ok || err != nil {
		return nil, err
	}
	return a.pods(ns, sub, host)
}

// question reads the one question of a query: its name (lower case, no trailing dot), type
// and class, and where the question ends.
func question(msg []byte) (string, uint16, uint16, int, error) {
	if len(msg) < 12 || binary.BigEndian.Uint16(msg[4:6]) != 1 {
		return "", 0, 0, 0, errors.New("not one question")
	}
	var labels []string
	i := 12
	for {
		if i >= len(msg) {
			return "", 0, 0, 0, errors.New("truncated name")
		}
		n := int(msg[i])
		i++
		if n == 0 {
			break
		}
		if n&0xC0 != 0 || i+n > len(msg) {
			return "", 0, 0, 0, errors.New("bad label")
		}
		labels = append(labels, strings.ToLower(string(msg[i:i+n])))
		i += n
	}
	if i+4 > len(msg) {
		return "", 0, 0, 0, errors.New("truncated question")
	}
	return strings.Join(labels, "."), binary.BigEndian.Uint16(msg[i : i+2]), binary.BigEndian.Uint16(msg[i+2 : i+4]), i + 4, nil
}

// answer builds the response: the query's header and question, and an A record for
// 127.0.0.1 when there is one to give.
func answer(query []byte, end int, rcode int, withA bool) []byte {
	out := make([]byte, 0, end+16)
	out = append(out, query[:end]...)
	// QR, opcode 0, AA, RD as asked; RA unset.
	out[2] = 0x84 | (query[2] & 0x01)
	out[3] = byte(rcode)
	binary.BigEndian.PutUint16(out[6:8], 0)
	binary.BigEndian.PutUint16(out[8:10], 0)
	binary.BigEndian.PutUint16(out[10:12], 0)
	if withA {
		binary.BigEndian.PutUint16(out[6:8], 1)
		// Name: pointer to the question's; type A, class IN, TTL 5 s, 4 bytes.
		out = append(out, 0xC0, 0x0C, 0, typeA, 0, classIN, 0, 0, 0, 5, 0, 4, 127, 0, 0, 1)
	}
	return out
}

func (a *api) handle(query []byte, zone string) []byte {
	name, qtype, qclass, end, err := question(query)
	if err != nil {
		if len(query) < 12 {
			return nil
		}
		out := answer(query, 12, rcodeFmt, false)
		binary.BigEndian.PutUint16(out[4:6], 0)
		return out
	}
	if qclass != classIN {
		return answer(query, end, rcodeNI, false)
	}
	pods, err := a.resolve(name, zone)
	if err != nil {
		log.Printf("%s: %v", name, err)
		// SERVFAIL: the resolver tries again.
		return answer(query, end, 2, false)
	}
	if len(pods) == 0 {
		return answer(query, end, rcodeNX, false)
	}
	if qtype == typeA {
		log.Printf("A %s -> 127.0.0.1 (pod %s on node %s)", name, pods[0].Metadata.Name, pods[0].Spec.NodeName)
	}
	// The name exists; only A has data (no IPv6 here).
	return answer(query, end, rcodeOK, qtype == typeA)
}

func main() {
	listen := flag.String("listen", "127.0.0.1:53", "UDP address to serve")
	server := flag.String("server", "https://127.0.0.1:6443", "API server")
	caFile := flag.String("ca", "", "CA bundle of the API server")
	tokenFile := flag.String("token-file", "", "file holding a bearer token that may get services and list pods")
	zone := flag.String("zone", "cluster.local", "the cluster domain")
	flag.Parse()

	ca, err := os.ReadFile(*caFile)
	if err != nil {
		log.Fatalf("reading the CA: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		log.Fatalf("%s holds no PEM certificate", *caFile)
	}
	token, err := os.ReadFile(*tokenFile)
	if err != nil {
		log.Fatalf("reading the token: %v", err)
	}
	a := &api{
		server: strings.TrimSuffix(*server, "/"),
		token:  strings.TrimSpace(string(token)),
		client: &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}},
	}
	conn, err := net.ListenPacket("udp", *listen)
	if err != nil {
		log.Fatalf("listening on %s: %v", *listen, err)
	}
	log.Printf("serving %s on udp %s", "svc."+*zone, *listen)
	buf := make([]byte, 1500)
	for {
		n, from, err := conn.ReadFrom(buf)
		if err != nil {
			log.Fatalf("reading: %v", err)
		}
		query := append([]byte(nil), buf[:n]...)
		go func() {
			if out := a.handle(query, *zone); out != nil {
				_, _ = conn.WriteTo(out, from)
			}
		}()
	}
}
