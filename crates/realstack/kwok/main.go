// Command kwok is kwok's controller (sigs.k8s.io/kwok, cmd/kwok) for the test bed: it makes Node
// objects Ready and runs the pods bound to them. It is a module of its own because kwok v0.7.0
// does not compile against the k8s.io/* v0.34 libraries that kube-apiserver v1.34 needs in
// ../go (kwok's pkg/utils/informer names metav1.InitialEventsListBlueprintAnnotationKey, which
// apimachinery v0.34 no longer has), and kwok v0.8.0 needs v0.36.
//
// It also exits once the process that started it is gone, as every component of ../go does.
package main

import (
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/spf13/pflag"

	"sigs.k8s.io/kwok/pkg/config"
	"sigs.k8s.io/kwok/pkg/kwok/cmd"
	"sigs.k8s.io/kwok/pkg/log"
	"sigs.k8s.io/kwok/pkg/utils/signals"
)

func main() {
	go exitWhenOrphaned()
	os.Exit(run())
}

// run parses kwok's logging and configuration flags from a set that lets every other flag
// through to kwok's command, which then parses the rest: the order kwok's own main keeps, since
// the command is built from the configuration those flags load.
func run() int {
	global := pflag.NewFlagSet("global", pflag.ContinueOnError)
	global.ParseErrorsWhitelist.UnknownFlags = true
	global.Usage = func() {}
	ctx := signals.SetupSignalContext()
	ctx, logger := log.InitFlags(ctx, global)
	ctx, err := config.InitFlags(ctx, global)
	if err != nil {
		logger.Error("reading kwok's configuration flags", err)
		return 1
	}
	command := cmd.NewCommand(ctx)
	command.PersistentFlags().AddFlagSet(global)
	if err := command.ExecuteContext(ctx); err != nil {
		logger.Error("kwok exited", err)
		return 1
	}
	return 0
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
			fmt.Fprintf(os.Stderr, "kwok: process %d, which started this one, is gone; exiting\n", want)
			os.Exit(1)
		}
	}
}
