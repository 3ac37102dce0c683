// Command realstack is the real control plane of the test bed in one binary, so that one Go build
// (one link of the shared Kubernetes packages) serves every component:
//
//	realstack etcd --data-dir DIR --listen-client-url URL --listen-peer-url URL
//	realstack kube-apiserver [kube-apiserver's own flags]
//	realstack kube-controller-manager [kube-controller-manager's own flags]
//	realstack kube-scheduler [kube-scheduler's own flags]
package main

import (
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"
	_ "time/tzdata" // kube-apiserver validates CronJob time zones against it

	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // --logging-format=json, as in kube-apiserver's own main
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as in kube-apiserver's own main
	_ "k8s.io/component-base/metrics/prometheus/version"  // the build info metric, as in kube-apiserver's own main
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: realstack etcd|kube-apiserver|kube-controller-manager|kube-scheduler [flags]")
		os.Exit(2)
	}
	component, rest := os.Args[1], os.Args[2:]
	go exitWhenOrphaned()
	switch component {
	case "etcd":
		if err := runEtcd(rest); err != nil {
			fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
			os.Exit(1)
		}
	case "kube-apiserver":
		// cobra reads os.Args[1:] as the flags, so drop the component's name
		os.Args = append([]string{"kube-apiserver"}, rest...)
		os.Exit(cli.Run(apiserver.NewAPIServerCommand()))
	case "kube-controller-manager":
		os.Args = append([]string{"kube-controller-manager"}, rest...)
		os.Exit(cli.Run(controllermanager.NewControllerManagerCommand()))
	case "kube-scheduler":
		os.Args = append([]string{"kube-scheduler"}, rest...)
		os.Exit(cli.Run(scheduler.NewSchedulerCommand()))
	default:
		fmt.Fprintf(os.Stderr, "realstack: unknown component %q (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)\n", component)
		os.Exit(2)
	}
}

// runEtcd runs a single-member etcd until SIGTERM/SIGINT. It serves plain HTTP on loopback only:
// the test bed's apiserver is its only client.
func runEtcd(args []string) error {
	fs := flag.NewFlagSet("etcd", flag.ContinueOnError)
	dataDir := fs.String("data-dir", "", "directory for etcd's data (required)")
	clientURL := fs.String("listen-client-url", "http://127.0.0.1:2379", "client URL to listen on")
	peerURL := fs.String("listen-peer-url", "http://127.0.0.1:2380", "peer URL to listen on")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dataDir == "" {
		return fmt.Errorf("--data-dir is required")
	}
	client, err := url.Parse(*clientURL)
	if err != nil {
		return fmt.Errorf("--listen-client-url: %w", err)
	}
	peer, err := url.Parse(*peerURL)
	if err != nil {
		return fmt.Errorf("--listen-peer-url: %w", err)
	}

	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*client}
	cfg.AdvertiseClientUrls = []url.URL{*client}
	cfg.ListenPeerUrls = []url.URL{*peer}
	cfg.AdvertisePeerUrls = []url.URL{*peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "warn"
	// a throwaway store for one test binary: fsync only costs time on a shared disk
	cfg.UnsafeNoFsync = true

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return err
	}
	defer e.Close()
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		return fmt.Errorf("not ready within 60s")
	}

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	select {
	case err := <-e.Err():
		return err
	case <-stop:
		return nil
	}
}

// exitWhenOrphaned ends the process once the process named by REALSTACK_PARENT_PID is no longer
// its parent. The test bed kills its stack when it is dropped, but a test binary that is killed
// outright (a CI timeout, an abort) runs no drop, and the stack, in a process group of its own,
// would outlive it. The parent passes its pid because it may be gone before this process could
// first ask for it.
func exitWhenOrphaned() {
	want, err := strconv.Atoi(os.Getenv("REALSTACK_PARENT_PID"))
	if err != nil {
		return
	}
	for ; ; time.Sleep(time.Second) {
		if os.Getppid() != want {
			fmt.Fprintf(os.Stderr, "realstack: process %d, which started this one, is gone; exiting\n", want)
			os.Exit(1)
		}
	}
}
