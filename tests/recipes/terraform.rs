//! The README's `terraform_data` recipe, verbatim but for the references to resources of
//! providers this test does not build (the Helm releases, the EKS add-on and the kubectl
//! manifests), run by
//! OpenTofu: `init`, `apply`, an `apply` that changes `input`, a `destroy` the tool refuses, and
//! the `destroy` that tears the cluster's Karpenter compute down.

use std::path::Path;

use crate::common::e2e::{REGION, assert_torn_down, bed, live_karpenter, small_world, states, untouchable_nodes};
use crate::common::{ec2_proxy, judged_key};
use karpenter_teardown::aws::InstanceState;
use sandbox_sim::generate;

/// The recipe's section and the references the test replaces: a resource of a provider the
/// test does not build becomes a `terraform_data` of the same role, so the recipe's `depends_on`
/// keeps its shape and its ordering is checked the same way.
const SECTION: &str = "### Terraform";
const STAND_INS: [(&str, &str); 5] = [
    ("helm_release.karpenter", "terraform_data.helm_release_karpenter"),
    ("helm_release.aws_load_balancer_controller", "terraform_data.helm_release_aws_load_balancer_controller"),
    ("aws_eks_addon.aws_ebs_csi_driver", "terraform_data.aws_eks_addon_aws_ebs_csi_driver"),
    ("kubectl_manifest.karpenter_node_pool", "terraform_data.kubectl_manifest_karpenter_node_pool"),
    ("kubectl_manifest.karpenter_node_class", "terraform_data.kubectl_manifest_karpenter_node_class"),
];

/// The report file the recipe names, relative to where OpenTofu runs (local-exec runs its
/// command in OpenTofu's working directory unless `working_dir` says otherwise).
const REPORT: &str = "karpenter-teardown-report.json";

/// A destroy-time provisioner that appends `name` and whether the teardown's report exists yet
/// to `destroy-order.log`: the tool writes its report when its run ends, so `after` proves the
/// resource was destroyed after the teardown finished.
fn order_logger(name: &str) -> String {
    format!(
        "  provisioner \"local-exec\" {{\n    when    = destroy\n    command = \"echo \\\"{name} $(test -f {REPORT} && echo after || echo before)\\\" >> destroy-order.log\"\n  }}\n"
    )
}

/// The rest of a user's configuration, as small as the recipe allows: the modules it names
/// (`module.eks` gives the cluster's name) and the stand-ins, each logging when it is destroyed.
fn write_configuration(dir: &Path) {
    let mut root = String::from(
        "variable \"region\" {\n  type = string\n}\n\nvariable \"cluster_name\" {\n  type = string\n}\n\n\
         module \"eks\" {\n  source       = \"./modules/eks\"\n  cluster_name = var.cluster_name\n}\n\n\
         module \"vpc\" {\n  source = \"./modules/vpc\"\n}\n\nmodule \"karpenter\" {\n  source = \"./modules/karpenter\"\n}\n",
    );
    for (from, to) in STAND_INS {
        let name = to.trim_start_matches("terraform_data.");
        root.push_str(&format!("\nresource \"terraform_data\" \"{name}\" {{\n{}}}\n", order_logger(from)));
    }
    std::fs::write(dir.join("main.tf"), root).unwrap();
    for module in ["eks", "vpc", "karpenter"] {
        let m = dir.join("modules").join(module);
        std::fs::create_dir_all(&m).unwrap();
        let mut text =
            format!("resource \"terraform_data\" \"this\" {{\n{}}}\n", order_logger(&format!("module.{module}")));
        if module == "eks" {
            text.push_str(
                "\nvariable \"cluster_name\" {\n  type = string\n}\n\noutput \"cluster_name\" {\n  value = var.cluster_name\n}\n",
            );
        }
        std::fs::write(m.join("main.tf"), text).unwrap();
    }
    let recipe = tfbed::fenced_block(&crate::readme(), SECTION, "hcl").unwrap_or_else(|e| panic!("{e}"));
    let recipe = tfbed::replace_references(&recipe, &STAND_INS).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(dir.join("teardown.tf"), recipe).unwrap();
}

/// The AWS CLI's `eks update-kubeconfig`, the one AWS CLI call of the recipe, for the sandbox
/// cluster: LocalStack does not emulate EKS, so this writes the sandbox's kubeconfig where the
/// recipe asks, for the cluster and region the recipe passes, and fails as the AWS CLI does
/// (DescribeCluster's ResourceNotFoundException) for any other.
fn write_aws_cli(bin: &Path, cluster: &str, kubeconfig: &Path) {
    let script = format!(
        r#"#!/usr/bin/env bash
set -euo pipefail
if [[ "${{1-}} ${{2-}}" != "eks update-kubeconfig" ]]; then
    echo "aws (test bed): only 'eks update-kubeconfig' is served here, not: $*" >&2
    exit 252
fi
shift 2
name="" region="" kubeconfig=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --name) name="$2"; shift 2 ;;
        --region) region="$2"; shift 2 ;;
        --kubeconfig) kubeconfig="$2"; shift 2 ;;
        *) echo "aws (test bed): unexpected argument $1" >&2; exit 252 ;;
    esac
done
if [[ "$name" != '{cluster}' || "$region" != '{REGION}' ]]; then
    echo "An error occurred (ResourceNotFoundException) when calling the DescribeCluster operation: No cluster found for name: $name in $region." >&2
    exit 254
fi
cp '{source}' "$kubeconfig"
echo "Added new context $name to $kubeconfig"
"#,
        source = kubeconfig.display()
    );
    crate::write_script(&bin.join("aws"), &script);
}

fn destroy_log(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("destroy-order.log"))
        .map(|t| t.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_recipe_tears_down_at_destroy_after_a_refusal_and_never_at_apply() {
    let tools = crate::tools();
    let s = small_world("tf-recipe", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = live_karpenter(&b, &world);
    let before = untouchable_nodes(&b.client, &world).await;
    let ours = world.karpenter_instance_ids();

    let dir = tempfile::tempdir().unwrap();
    write_configuration(dir.path());
    let (bin, path) = crate::bin_dir(dir.path());
    write_aws_cli(&bin, &world.cluster, &b.kubeconfig);
    let mut tofu = tfbed::Tofu::new(&tools, dir.path());
    // What the recipe says the provisioner inherits from the shell that runs the destroy: the
    // AWS credentials (here held to deploy/iam-policy.json by the EC2 proxy) and PATH. local-exec
    // runs its command with OpenTofu's own environment plus `environment` (os.Environ() then the
    // block's values: opentofu internal/builtin/provisioners/local-exec/resource_provisioner.go)
    tofu.env("PATH", path)
        .env("AWS_ENDPOINT_URL", ec2_proxy())
        .env("AWS_ACCESS_KEY_ID", judged_key(&world.cluster, REGION))
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true");
    let vars = |region: &str| [format!("-var=region={region}"), format!("-var=cluster_name={}", world.cluster)];
    let run = |args: Vec<String>| {
        let tofu = tofu.clone();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            tofu.run(&args).await.unwrap()
        }
    };
    let with = |cmd: &[&str], region: &str| cmd.iter().map(|s| s.to_string()).chain(vars(region)).collect::<Vec<_>>();

    let init = run(vec!["init".into()]).await;
    assert_eq!(init.code, 0, "{}", init.all());
    let apply = run(with(&["apply", "-auto-approve"], REGION)).await;
    assert_eq!(apply.code, 0, "{}", apply.all());

    // An ordinary apply that changes an input updates the resource in place: no teardown
    let changed = run(with(&["apply", "-auto-approve"], "eu-west-1")).await;
    assert_eq!(changed.code, 0, "{}", changed.all());
    assert!(
        changed.stdout.contains("0 added, 1 changed, 0 destroyed"),
        "a change of input must update in place:\n{}",
        changed.all()
    );
    let back = run(with(&["apply", "-auto-approve"], REGION)).await;
    assert_eq!(back.code, 0, "{}", back.all());
    assert!(!dir.path().join(REPORT).exists(), "an apply ran the teardown");
    let running = states(&b.aws, &ours).await;
    assert!(running.values().all(|s| *s == InstanceState::Running), "an apply changed instances: {running:?}");

    // A refused teardown fails the destroy at this resource with the tool's exit code and
    // message, before anything it depends on is destroyed
    let mut capped = tofu.clone();
    capped.env("KARPENTER_TEARDOWN_MAX_NODES", "1");
    let refused = {
        let args = with(&["destroy", "-auto-approve"], REGION);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        capped.run(&args).await.unwrap()
    };
    assert_ne!(refused.code, 0, "{}", refused.all());
    let said = refused.all();
    assert!(said.contains("exit status 3"), "the tool's exit code is shown:\n{said}");
    assert!(said.contains("more than --max-nodes 1"), "the tool's refusal is shown:\n{said}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join(REPORT)).unwrap()).expect("the report is JSON");
    assert_eq!(report["outcome"], "refused", "{report:#}");
    assert_eq!(destroy_log(dir.path()), Vec::<String>::new(), "destroyed past a failed teardown");
    let running = states(&b.aws, &ours).await;
    assert!(running.values().all(|s| *s == InstanceState::Running), "a refused run changed instances: {running:?}");
    std::fs::remove_file(dir.path().join(REPORT)).unwrap();

    // Running the destroy again finishes the job
    let t = std::time::Instant::now();
    let destroy = run(with(&["destroy", "-auto-approve"], REGION)).await;
    eprintln!("destroy with the teardown took {:?}", t.elapsed());
    assert_eq!(destroy.code, 0, "{}", destroy.all());
    assert!(destroy.stdout.contains(&format!("Added new context {}", world.cluster)), "{}", destroy.all());
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join(REPORT)).unwrap()).expect("the report is JSON");
    assert_eq!(report["outcome"], "clean", "{report:#}");
    assert_torn_down(&b, &world, &before).await;
    let mut order = destroy_log(dir.path());
    order.sort();
    let mut want: Vec<String> = STAND_INS
        .iter()
        .map(|(from, _)| from.to_string())
        .chain(["module.eks", "module.vpc", "module.karpenter"].map(String::from))
        .map(|n| format!("{n} after"))
        .collect();
    want.sort();
    assert_eq!(order, want, "everything the recipe depends on is destroyed after the teardown ends");
    let left = run(vec!["state".into(), "list".into()]).await;
    assert_eq!((left.code, left.stdout.trim()), (0, ""), "{}", left.all());
    sim.shutdown().await;
    b.server.shutdown().await;
}

/// The CLI configuration the tests run OpenTofu with installs providers from the mirror only: a
/// provider that is not there fails `init` instead of being downloaded from a registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_missing_from_the_mirror_is_never_downloaded() {
    let tools = crate::tools();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("main.tf"),
        "terraform {\n  required_providers {\n    helm = {\n      source = \"hashicorp/helm\"\n    }\n  }\n}\n",
    )
    .unwrap();
    let init = tfbed::Tofu::new(&tools, dir.path()).run(&["init"]).await.unwrap();
    assert_eq!(init.code, 1, "{}", init.all());
    assert!(
        init.stderr.contains("provider registry.opentofu.org/hashicorp/helm was not found")
            && init.stderr.contains("search locations"),
        "{}",
        init.all()
    );
}
