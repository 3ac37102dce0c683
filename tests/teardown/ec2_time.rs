//! EC2's own time: a terminated instance stays `shutting-down` for a while and a read right after
//! `TerminateInstances` may still show it running. LocalStack terminates at once; the EC2 proxy
//! models both, and the teardown must still end clean.

use crate::common;

use std::time::Duration;

use crate::common::safety::*;
use karpenter_teardown::aws::InstanceState;
use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyFaults};
use sandbox_sim::ec2time::Ec2Timing;
use sandbox_sim::{generate, naming};

/// The EC2 proxy's clock in these tests runs ten times as fast as EC2's: a minute of
/// `shutting-down` takes six seconds.
const EC2_TIME_SCALE: f64 = 0.1;

/// A minute of `shutting-down`, the first ten seconds of it read as `running`, on the tests' clock.
pub fn slow_terminations() -> Ec2Timing {
    Ec2Timing {
        shutting_down: Duration::from_secs(60).mul_f64(EC2_TIME_SCALE),
        stale_reads: Duration::from_secs(10).mul_f64(EC2_TIME_SCALE),
    }
}

/// The default plan with `--reclaim`: every machine's termination is confirmed before its
/// finalizer goes, and an instance Karpenter launched but never registered (no NodeClaim names
/// it) is reclaimed by the verify step, which must wait for it to be terminated before it checks
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_plan_ends_clean_when_instances_stay_shutting_down_for_a_minute() {
    let s = two_pool_world("ec2-time", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let n = &world.nodes[0];
    let tags = naming::launch_tags(&world.cluster, &n.pool, &n.class);
    let orphan = b.cloud.launch_tagged(naming::IMAGE_ID, naming::INSTANCE_TYPE, Some(&n.zone), 1, &tags).await.unwrap();
    let orphan = orphan[0].id.clone();
    let proxy = Ec2Proxy::start(common::LOCALSTACK, ProxyFaults::default()).await.unwrap();
    proxy.control().set_timing(slow_terminations());
    let key = common::fresh_key();
    proxy.control().attach_policy(&key, common::principal(common::shipped_policy(&world.cluster, REGION)));

    let inv = Invocation {
        args: vec!["--yes", "--reclaim"],
        env: vec![("AWS_ENDPOINT_URL", proxy.url()), ("AWS_ACCESS_KEY_ID", key)],
        ..Invocation::default()
    };
    let run = tool(&b, "run", &world.cluster, &inv).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean", "{}", run.dump());
    assert!(proxy.control().unauthorized().is_empty(), "{:?}", proxy.control().unauthorized());
    assert!(run.report["reclaimed"].to_string().contains(&orphan), "{}", run.dump());
    assert_eq!(states(&b.aws, std::slice::from_ref(&orphan)).await[&orphan], InstanceState::Terminated);
    assert_torn_down(&b, &world, &before).await;
    proxy.shutdown().await;
    b.server.shutdown().await;
}
