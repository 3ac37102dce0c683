//! How the sandbox API server holds a large cluster: 1,000 nodes and 20,000 pods, a paged list of
//! every pod through kube-rs, a field-selector list, and a watch from resourceVersion 0 that
//! delivers every pod, with the process's memory. Run: `cargo bench --bench apiserver`
//! (optionally `-- NODES PODS`). The numbers in the README come from this command.

use std::time::{Duration, Instant};

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_apiserver::{GroupResource, WriteOptions};
use serde_json::json;

/// Resident and peak memory of this process, from /proc (kB).
fn memory_kb() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let nodes: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let pods: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let opts = ServerOptions { control_plane: false, ..ServerOptions::default() };
    let server = ApiServer::start(opts).await.expect("the sandbox server starts");
    let client = kube::Client::try_from(server.kube_config()).expect("a client for the sandbox");
    let store = server.store();
    let wo = WriteOptions::manager("bench");

    let t = Instant::now();
    for i in 0..nodes {
        store
            .create(&GroupResource::new("", "nodes"), "", json!({"metadata": {"name": format!("n{i}")}}), &wo)
            .expect("create node");
    }
    for i in 0..pods {
        let pod = json!({
            "metadata": {"name": format!("p{i:06}"), "labels": {"app": format!("a{}", i % 500)}},
            "spec": {"nodeName": format!("n{}", i % nodes.max(1)), "containers": [{"name": "c", "image": "busybox"}]},
        });
        store.create(&GroupResource::new("", "pods"), "default", pod, &wo).expect("create pod");
    }
    let created = t.elapsed();
    let (rss_loaded, _) = memory_kb();

    let api: Api<Pod> = Api::all(client.clone());
    let t = Instant::now();
    let mut lp = ListParams::default().limit(500);
    let (mut listed, mut pages) = (0, 0);
    loop {
        let page = api.list(&lp).await.expect("list page");
        listed += page.items.len();
        pages += 1;
        match page.metadata.continue_ {
            Some(tok) if !tok.is_empty() => lp = lp.continue_token(&tok),
            _ => break,
        }
    }
    let paged = t.elapsed();

    let t = Instant::now();
    let on_node = api.list(&ListParams::default().fields("spec.nodeName=n7")).await.expect("field selector");
    let selected = t.elapsed();

    let t = Instant::now();
    let mut stream = Box::pin(api.watch(&WatchParams::default().timeout(60), "0").await.expect("watch"));
    let mut added = 0;
    while added < pods {
        match tokio::time::timeout(Duration::from_secs(60), stream.try_next()).await {
            Ok(Ok(Some(WatchEvent::Added(_)))) => added += 1,
            Ok(Ok(Some(_))) => {}
            _ => break,
        }
    }
    let watched = t.elapsed();
    let (rss_end, hwm) = memory_kb();

    println!("| measure | value |");
    println!("|---|---|");
    println!("| objects | {nodes} nodes, {pods} pods |");
    println!("| create (store, in process) | {:.2} s |", created.as_secs_f64());
    println!(
        "| paged list of all pods over HTTP (limit 500) | {:.2} s, {pages} pages, {listed} pods |",
        paged.as_secs_f64()
    );
    println!(
        "| list with fieldSelector spec.nodeName | {:.1} ms, {} pods |",
        selected.as_secs_f64() * 1e3,
        on_node.items.len()
    );
    println!("| watch from resourceVersion 0 (synthetic ADDED) | {:.2} s for {added} events |", watched.as_secs_f64());
    println!("| memory after loading (RSS) | {} MB |", rss_loaded / 1024);
    println!("| memory at the end (RSS / peak) | {} MB / {} MB |", rss_end / 1024, hwm / 1024);
    server.shutdown().await;
}
