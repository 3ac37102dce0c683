// Command ccm is cloud-provider-aws's cloud controller manager (k8s.io/cloud-provider-aws, its
// v1 provider) for the test bed, where the tests run only its service controller
// (--controllers=service): the in-tree service controller that makes a classic load balancer
// for a Service of type LoadBalancer, tags it and its security group with the cluster, and
// deletes them behind finalizer service.kubernetes.io/load-balancer-cleanup. On EKS it runs in
// the control plane; here it runs against LocalStack, through the cloud config's
// ServiceOverride endpoints. It is a module of its own because cloud-provider-aws pins its own
// k8s.io/* libraries.
//
// It builds the command as cloud-provider-aws's cmd/aws-cloud-controller-manager does, without
// that command's tagging controller (not used here), and exits once the process that started it
// is gone, as every component of ../go does.
package main

import (
	"fmt"
	"os"
	"strconv"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	cloudprovider "k8s.io/cloud-provider"
	awsv1 "k8s.io/cloud-provider-aws/pkg/providers/v1"
	"k8s.io/cloud-provider/app"
	cloudcontrollerconfig "k8s.io/cloud-provider/app/config"
	"k8s.io/cloud-provider/names"
	"k8s.io/cloud-provider/options"
	cliflag "k8s.io/component-base/cli/flag"
	"k8s.io/component-base/logs"
	"k8s.io/klog/v2"
)

func main() {
	go exitWhenOrphaned()
	logs.InitLogs()
	defer logs.FlushLogs()
	opts, err := options.NewCloudControllerManagerOptions()
	if err != nil {
		klog.Fatalf("unable to initialize command options: %v", err)
	}
	command := app.NewCloudControllerManagerCommand(opts, cloudInitializer, app.DefaultInitFuncConstructors,
		names.CCMControllerAliases(), cliflag.NamedFlagSets{}, wait.NeverStop)
	if err := command.Execute(); err != nil {
		klog.Fatalf("unable to execute command: %v", err)
	}
}

// cloudInitializer makes the AWS provider from --cloud-config; the test bed always names a
// cluster id there, so the provider's own check for one holds.
func cloudInitializer(config *cloudcontrollerconfig.CompletedConfig) cloudprovider.Interface {
	shared := config.ComponentConfig.KubeCloudShared.CloudProvider
	cloud, err := cloudprovider.InitCloudProvider(awsv1.ProviderName, shared.CloudConfigFile)
	if err != nil || cloud == nil {
		klog.Fatalf("the AWS cloud provider could not be initialized: %v", err)
	}
	if !cloud.HasClusterID() {
		klog.Fatalf("no cluster id in the cloud config (KubernetesClusterID)")
	}
	return cloud
}

// exitWhenOrphaned ends the process once the process named by REALSTACK_PARENT_PID is no longer
// its parent (see ../go/main.go: a killed test binary runs no drop).
func exitWhenOrphaned() {
	want, err := strconv.Atoi(os.Getenv("REALSTACK_PARENT_PID"))
	if err != nil {
		return
	}
	for ; ; time.Sleep(time.Second) {
		if os.Getppid() != want {
			fmt.Fprintf(os.Stderr, "ccm: process %d, which started this one, is gone; exiting\n", want)
			os.Exit(1)
		}
	}
}
