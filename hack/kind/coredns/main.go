// Command coredns is CoreDNS v1.14.6 with only the plugins kubeadm's Corefile uses (errors health
// ready kubernetes prometheus forward cache loop reload loadbalance) plus log, so the build does
// not pull in every cloud SDK of the full plugin list. The directive order is upstream's
// (core/dnsserver/zdirectives.go) restricted to these plugins; it decides the order in which
// the plugins see a query, not the order in the Corefile.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics" // the "prometheus" directive
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func init() {
	dnsserver.Directives = []string{
		"reload", "ready", "health", "prometheus", "errors", "log",
		"loadbalance", "cache", "kubernetes", "loop", "forward",
	}
}

func main() { coremain.Run() }
