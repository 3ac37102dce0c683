//! Bad input, each case through the real binary: one clear message naming the fix, the
//! documented exit code (2 bad input, 3 refused), and nothing changed in Kubernetes or EC2.

use crate::common;

use std::path::PathBuf;

use crate::common::safety::*;
use karpenter_teardown::aws::InstanceState;
use sandbox_apiserver::ServerOptions;
use sandbox_apiserver::authz::Rbac;
use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyFaults};
use sandbox_sim::{World, generate};

/// A small live world, and the state that must not change: the store's resourceVersion and
/// the instances' states.
struct Guarded {
    b: Bed,
    world: World,
    rv: u64,
}

async fn guarded(prefix: &str) -> Guarded {
    guarded_with(prefix, None).await
}

/// A guarded world whose kubeconfig identity holds `rbac` instead of `deploy/rbac.yaml`.
async fn guarded_with(prefix: &str, rbac: Option<Rbac>) -> Guarded {
    let mut s = two_pool_world(prefix, 2);
    s.pods_per_node = 1;
    s.decoys = 0;
    let opts = ServerOptions { time_scale: 0.01, rbac, ..ServerOptions::default() };
    let b = bed_with(&s.cluster, opts).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let rv = settled_resource_version(&b.server).await;
    Guarded { b, world, rv }
}

impl Guarded {
    async fn assert_unchanged(self, run: &Run) {
        assert_eq!(self.b.server.store().resource_version(), self.rv, "the cluster was written:\n{}", run.dump());
        let ours = states(&self.b.aws, &self.world.karpenter_instance_ids()).await;
        assert!(ours.values().all(|s| *s == InstanceState::Running), "instances changed: {ours:?}");
        self.b.server.shutdown().await;
    }

    async fn run(&self, args: &[&str], env: Vec<(&str, String)>, env_remove: Vec<&str>) -> Run {
        let mut a = vec!["--yes"];
        a.extend_from_slice(args);
        tool(&self.b, "run", &self.world.cluster, &Invocation { args: a, env, env_remove }).await
    }
}

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plans").join(name).display().to_string()
}

/// Exactly one error, which must contain every part. The message may wrap over several lines
/// (the SDK's and the YAML parser's causes carry newlines), so everything from the `error:` line
/// to the end of stderr counts as the message.
fn assert_one_error(run: &Run, parts: &[&str]) {
    let errors = run.stderr.lines().filter(|l| l.starts_with("error: ")).count();
    assert_eq!(errors, 1, "expected one error:\n{}", run.dump());
    let at = run.stderr.find("error: ").unwrap_or(0);
    let message = &run.stderr[at..];
    for p in parts {
        assert!(message.contains(p), "the error does not say {p:?}: {message}");
    }
}

/// A TCP port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_plan_toml() {
    let g = guarded("bad-toml").await;
    let plan = fixture("syntax-error.toml");
    let run = g.run(&["--plan", &plan], vec![], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["syntax-error.toml:8:8", "expected `]`"]);
    g.assert_unchanged(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_with_a_cycle() {
    let g = guarded("bad-cycle").await;
    let plan = fixture("cycle.toml");
    let run = g.run(&["--plan", &plan], vec![], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["cycle.toml:11:23", "a -> b -> c -> a", "remove one of these `after` entries"]);
    g.assert_unchanged(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_with_an_unknown_action() {
    let g = guarded("bad-action").await;
    let plan = fixture("unknown-action.toml");
    let run = g.run(&["--plan", &plan], vec![], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["unknown-action.toml:12:10", "\"drian\"", "did you mean \"drain\""]);
    g.assert_unchanged(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_kubeconfig() {
    let g = guarded("bad-kubeconfig").await;
    let garbage = g.b.dir.path().join("garbage-kubeconfig");
    std::fs::write(&garbage, "this: [is not a kubeconfig").unwrap();
    let path = garbage.display().to_string();
    // the later --kubeconfig wins over the bed's own
    let run = g.run(&["--kubeconfig", &path], vec![], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["cannot use the kubeconfig", &path, "--kubeconfig"]);
    let missing = g.b.dir.path().join("no-such-kubeconfig").display().to_string();
    let run = g.run(&["--kubeconfig", &missing], vec![], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["cannot use the kubeconfig", &missing]);
    g.assert_unchanged(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_api_server() {
    let g = guarded("bad-apiserver").await;
    let text = std::fs::read_to_string(&g.b.kubeconfig).unwrap();
    let url = g.b.server.url();
    assert!(text.contains(&url), "the bed's kubeconfig names {url}:\n{text}");
    let closed = format!("http://127.0.0.1:{}", closed_port());
    let kc = g.b.dir.path().join("closed-kubeconfig");
    std::fs::write(&kc, text.replace(&url, &closed)).unwrap();
    let path = kc.display().to_string();
    let run = g.run(&["--kubeconfig", &path], vec![], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["cannot reach the Kubernetes API server", &closed, "check the kubeconfig's server"]);
    g.assert_unchanged(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_aws_credentials() {
    let g = guarded("bad-creds").await;
    let nowhere = g.b.dir.path().join("no-such-aws-file").display().to_string();
    let run = g
        .run(
            &[],
            vec![("AWS_SHARED_CREDENTIALS_FILE", nowhere.clone()), ("AWS_CONFIG_FILE", nowhere)],
            vec![
                "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN",
                "AWS_PROFILE",
                "AWS_WEB_IDENTITY_TOKEN_FILE",
            ],
        )
        .await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["no AWS credentials found", "AWS_ACCESS_KEY_ID"]);
    g.assert_unchanged(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn localstack_down() {
    let g = guarded("bad-endpoint").await;
    let closed = format!("http://127.0.0.1:{}", closed_port());
    // one attempt: the SDK's retries of a refused connection only make the test slower
    let run = g.run(&[], vec![("AWS_ENDPOINT_URL", closed.clone()), ("AWS_MAX_ATTEMPTS", "1".into())], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["cannot reach the AWS", &closed, "AWS_ENDPOINT_URL"]);
    g.assert_unchanged(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_nodes_exceeded() {
    let g = guarded("bad-max").await;
    let run = g.run(&["--max-nodes", "1"], vec![], vec![]).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    assert_one_error(&run, &["2 Karpenter machines", "--max-nodes 1", "raise --max-nodes"]);
    assert_eq!(run.report["outcome"], "refused");
    g.assert_unchanged(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_cluster() {
    let g = guarded("bad-cluster").await;
    let run =
        tool(&g.b, "run", "some-other-cluster", &Invocation { args: vec!["--yes"], ..Invocation::default() }).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    assert_one_error(&run, &["refusing", "some-other-cluster", &g.world.cluster, "check --cluster"]);
    assert_eq!(run.report["outcome"], "refused");
    // refused even without --yes: a dry run checks identity too
    let dry = tool(&g.b, "run", "some-other-cluster", &Invocation::default()).await;
    assert_eq!(dry.code, 3, "{}", dry.dump());
    g.assert_unchanged(&dry).await;
}

/// A permission the shipped RBAC grants is missing (here the eviction). Asked
/// through SelfSubjectAccessReview before the first write, it refuses the run with exit 2 naming
/// the permission and the file, instead of a 403 with the cluster half torn down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_rbac_permission_is_refused_before_any_change() {
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml")).unwrap();
    let eviction_rule = "  - apiGroups: [\"\"]\n    resources: [\"pods/eviction\"]\n    verbs: [\"create\"]\n";
    assert!(shipped.contains(eviction_rule), "deploy/rbac.yaml changed shape; update this test");
    let without_eviction = Rbac::from_yaml(&shipped.replace(eviction_rule, "")).unwrap();
    let g = guarded_with("bad-rbac", Some(without_eviction)).await;
    let run = g.run(&[], vec![], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["create pods/eviction", "deploy/rbac.yaml", "Nothing was changed"]);
    // a dry run says so too
    let dry = tool(&g.b, "run", &g.world.cluster, &Invocation::default()).await;
    assert_eq!(dry.code, 2, "{}", dry.dump());
    g.assert_unchanged(&run).await;
}

/// The AWS identity lacks `ec2:TerminateInstances` (the proxy answers as IAM would,
/// `UnauthorizedOperation`). EC2's `DryRun` finds it before the first write: exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_iam_permission_is_refused_before_any_change() {
    let g = guarded("bad-iam").await;
    let proxy = Ec2Proxy::start(common::LOCALSTACK, ProxyFaults::default()).await.unwrap();
    proxy.deny_actions(&["TerminateInstances"]);
    let run = g.run(&[], vec![("AWS_ENDPOINT_URL", proxy.url())], vec![]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert_one_error(&run, &["ec2:TerminateInstances", "deploy/iam-policy.json", "Nothing was changed"]);
    proxy.shutdown().await;
    g.assert_unchanged(&run).await;
}

/// The binary with only the environment a case gives it (no AWS or kubeconfig of the machine's),
/// logging as text, as a new user runs it.
fn bare(home: &std::path::Path, env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .envs(env.iter().copied())
        .args(["run", "--cluster", "prod", "--region", "us-west-2"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Each bad input is said once, on stderr, exactly as held here: kube's quoting of a path and
/// the SDK's debug dump of its causes are not passed on, no library logs the same failure ahead
/// of it, and the summary on stdout gives the outcome without repeating the error.
#[test]
fn each_bad_input_is_said_once_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path();
    let missing = home.join("nonexistent").display().to_string();
    let port = closed_port();
    let closed = home.join("closed-kubeconfig");
    std::fs::write(
        &closed,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{port}\n\
             contexts:\n- name: prod\n  context:\n    cluster: c\n    user: u\ncurrent-context: prod\n\
             users:\n- name: u\n  user:\n    token: t\n"
        ),
    )
    .unwrap();
    let closed = closed.display().to_string();
    let plan = fixture("syntax-error.toml");
    let creds = [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")];
    // what, its environment, its flags, the exact stderr, whether a summary follows
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, Vec<&'a str>, String, bool);
    let cases: [Case; 4] = [
        (
            "a kubeconfig that does not exist",
            vec![("KUBECONFIG", &missing)],
            vec![],
            format!(
                "error: cannot use the kubeconfig {missing}: No such file or directory (os error 2); pass --kubeconfig \
                 FILE (and --context NAME) or set KUBECONFIG\n"
            ),
            true,
        ),
        (
            "an API server nothing listens at",
            [("KUBECONFIG", closed.as_str())].into_iter().chain(creds).collect(),
            vec![],
            format!(
                "error: cannot reach the Kubernetes API server http://127.0.0.1:{port}/: ServiceError: client error \
                 (Connect): tcp connect error: Connection refused (os error 111); check the kubeconfig's server \
                 address, the network, and that the cluster is up\n"
            ),
            true,
        ),
        (
            "no AWS credentials",
            vec![("KUBECONFIG", &closed), ("AWS_EC2_METADATA_DISABLED", "true")],
            vec![],
            "error: no AWS credentials found (the credential provider was not enabled: no credentials found in chain. \
             Attempted:\n  Environment: the credential provider was not enabled: environment variable not set\n  \
             Profile: the credential provider was not enabled\n  WebIdentityToken: the credential provider was not \
             enabled: $AWS_WEB_IDENTITY_TOKEN_FILE was not set\n  EcsContainer: the credential provider was not \
             enabled: ECS provider not configured\n  Ec2InstanceMetadata: the credential provider was not enabled: \
             IMDS disabled by AWS_EC2_METADATA_DISABLED env var set to `true`); set AWS_PROFILE or \
             AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or run where an instance or pod role is available (for \
             LocalStack any non-empty pair works, e.g. test/test)\n"
                .to_string(),
            true,
        ),
        (
            "a plan that is not TOML",
            vec![("KUBECONFIG", &closed)],
            vec!["--plan", &plan],
            format!(
                "error: {plan}:8:8: invalid plan: unclosed array table, expected `]`; see plans/default.toml for a \
                 valid plan\n"
            ),
            // refused before the run starts: no report, no summary
            false,
        ),
    ];
    for (case, env, args, stderr, summary) in cases {
        let (code, out, err) = bare(home, &env, &args);
        assert_eq!(code, 2, "{case}: exit {code}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(err, stderr, "{case}: stderr");
        if summary {
            let first = out.lines().next().unwrap_or_default();
            assert!(
                first.starts_with("run [plan default] on cluster prod (us-west-2): failed in ")
                    && first.ends_with(", exit 2"),
                "{case}: the summary's outcome line: {out}"
            );
        } else {
            assert_eq!(out, "", "{case}: nothing on stdout");
        }
        assert!(!out.contains("error"), "{case}: the summary repeats the error:\n{out}");
    }
}
